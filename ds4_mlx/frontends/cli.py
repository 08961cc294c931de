"""`ds4-mlx` command line: one sub-command per module ``ds4_mlx.frontends.cmd_<name>``.

Each command module defines ``register(subparsers)`` (adds its parser and sets ``func``).
Errors of ours (``Ds4Error``) are printed as one line and exit with status 2; nothing else is caught.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ds4_mlx.errors import Ds4Error

# Order is the order of `ds4-mlx --help`.
COMMANDS = ["generate", "inspect", "tokenize", "kv", "bench", "demo"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ds4-mlx", description="DeepSeek V4 Flash on MLX")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"ds4_mlx.frontends.cmd_{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"ds4_mlx.frontends.cmd_{name}":
                continue  # command not built yet
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 1
    try:
        return int(args.func(args) or 0)
    except Ds4Error as exc:
        print(f"ds4-mlx {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
