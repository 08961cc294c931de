"""`ds4-mlx` command line: one sub-command per module ``ds4_mlx.frontends.cmd_<name>``.

Each command module defines ``register(subparsers)`` (adds its parser and sets ``func``); numeric
options use ``ds4_mlx.frontends.args`` so bad values stop at parse time with the command's usage.

What ``main`` guarantees for every command, so no user ever sees a traceback for these:

- usage errors (unknown flag, bad value, missing argument): the *sub-command's* usage and one
  ``ds4-mlx CMD: error: ...`` line, exit status 2;
- errors of ours (``Ds4Error``): one ``ds4-mlx CMD: error: ...`` line, exit status 2;
- Ctrl-C (``KeyboardInterrupt``) anywhere, model loading included: one line, exit status 130
  (128 + SIGINT, what a shell reports for a process killed by Ctrl-C);
- a closed stdout (``ds4-mlx ... | head -1``): silence, exit status 0.
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading

from ds4_mlx.errors import Ds4Error

# Order is the order of `ds4-mlx --help`.
COMMANDS = ["generate", "chat", "serve", "download", "bench", "inspect", "tokenize", "kv", "vectors", "perplexity", "demo"]

EXIT_INTERRUPTED = 128 + signal.SIGINT


@contextlib.contextmanager
def cancel_on_sigint():
    """Within the block, Ctrl-C (SIGINT) sets the yielded ``threading.Event`` instead of raising
    ``KeyboardInterrupt``: ``stream_generate`` checks it before every token and prefill chunk, so a
    run ends cleanly (its stats still printed) instead of unwinding from inside a forward pass.
    Off the main thread (where Python cannot install handlers) the event is only set by its owner."""
    cancel = threading.Event()
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, lambda *_: cancel.set()) if main else None
    try:
        yield cancel
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)


class CommandParser(argparse.ArgumentParser):
    """A parser that rejects leftover arguments itself.

    argparse hands a sub-command's unknown flags back up to the top-level parser, which then
    prints the top-level usage (``ds4-mlx [-h] COMMAND ...``), useless to someone who mistyped a
    ``generate`` flag. Failing in the innermost parser shows that command's usage instead; nested
    sub-commands (``kv ls``) inherit the class through ``add_subparsers``.
    """

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def version_text() -> str:
    """``ds4-mlx --version``: our version, then mlx's, the device MLX computes on, and its BLAS; then
    the load plan a default load would resolve here (``model.load_plan``)."""
    import platform

    import mlx.core as mx

    from ds4_mlx import __version__, blas
    from ds4_mlx.model import load_plan

    try:
        lp = load_plan.resolve()
        backend, plan = lp.backend, lp.describe()
    except Ds4Error as exc:  # a bad DS4_MLX_* variable: --version still answers, and names it
        backend, plan = load_plan.detect_backend(), f"load plan: error: {exc}"
    return (f"ds4-mlx {__version__}\n"
            f"mlx {mx.__version__}, backend {backend}, {blas.describe()}, Python {platform.python_version()}\n"
            f"{plan}")


class _VersionAction(argparse.Action):
    """argparse's own ``version`` action wants the text up front; ours imports mlx, so only
    when asked."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ds4-mlx", description="DeepSeek V4 Flash on MLX")
    parser.add_argument("--version", action=_VersionAction, help="print the version of ds4-mlx, mlx and the backend")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CommandParser)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"ds4_mlx.frontends.cmd_{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"ds4_mlx.frontends.cmd_{name}":
                continue  # command not built yet
            raise
        module.register(sub)
    return parser


def _silence_stdout() -> None:
    """After a broken pipe, point stdout at /dev/null: the interpreter flushes stdout at exit, and
    the data still buffered would raise again as an "Exception ignored ... BrokenPipeError"."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass  # stdout replaced by something without a descriptor (tests): nothing to flush to


def _interrupted(command: str | None) -> int:
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        _silence_stdout()
    prog = f"ds4-mlx {command}" if command else "ds4-mlx"
    lead = "\n" if sys.stderr.isatty() else ""  # the terminal's "^C" ends mid-line
    print(f"{lead}{prog}: interrupted", file=sys.stderr)
    return EXIT_INTERRUPTED


def _run(argv: list[str] | None, state: dict) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # usage error or --help/--version: a status to return, not raise
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    state["command"] = args.command
    if not getattr(args, "func", None):
        parser.print_help()
        return 1
    try:
        return int(args.func(args) or 0)
    except Ds4Error as exc:
        print(f"ds4-mlx {args.command}: error: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    state: dict = {"command": None}
    try:
        return _run(argv, state)
    except KeyboardInterrupt:
        return _interrupted(state["command"])
    except BrokenPipeError:
        _silence_stdout()
        return 0


if __name__ == "__main__":
    sys.exit(main())
