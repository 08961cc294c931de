"""`ds4-mlx perplexity -m MODEL --file TEXT [--ctx N] [-n N] [--chunk N] [--json]`: ds4's
``--perplexity-file`` (``ds4_mlx.engine.perplexity`` has the exact rules).

The text is tokenized as plain text (no BOS, no chat template); its first 32 tokens are context, the
next ones are scored (at most ``-n``, and at most ``ctx - 32``) by their teacher-forced next-token
log-likelihood. stdout gets ds4's line::

    tokens=T scored=S nll=X avg_nll=Y ppl=Z

(``--json``: the same values as an object). On a terminal a progress bar is drawn on stderr; piped,
stderr stays empty unless something fails. ``--chunk N`` scores N tokens per forward instead of
ds4's one decode step per token: faster, and in the default numerics different by float32 rounding
(bit-identical in ``--numerics ds4-cpu``).

A file that is not UTF-8, or holds NUL bytes (ds4 would stop reading at the first one), is refused.
"""

from __future__ import annotations

import argparse
import json
import sys

from ds4_mlx.chat.template import DEFAULT_CTX
from ds4_mlx.frontends.args import UsageError, add_ctx_option, add_model_options, model_options, ranged, read_text_file

# Restated from engine.perplexity, which loads numpy and mlx: `ds4-mlx --help` builds every parser.
DEFAULT_MAX_SCORED = 50000
MAX_SCORE_CHUNK = 2048


def register(sub) -> None:
    p = sub.add_parser("perplexity", help="perplexity of a text file (ds4's --perplexity-file)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(p)
    p.add_argument("--file", required=True, metavar="TEXT", help="the text to score (UTF-8)")
    add_ctx_option(p, DEFAULT_CTX)
    p.add_argument("-n", "--tokens", action=ranged(int, 0, why="a count of tokens (0 = only ctx caps it)"),
                   default=DEFAULT_MAX_SCORED, metavar="N",
                   help=f"score at most N tokens (default {DEFAULT_MAX_SCORED}, ds4's; 0 = up to ctx - 32)")
    p.add_argument("--chunk", action=ranged(int, 1, MAX_SCORE_CHUNK,
                                            why=f"a chunk's logits take N x 0.5 MiB; {MAX_SCORE_CHUNK} is the prefill chunk"),
                   default=1, metavar="N",
                   help="tokens per teacher-forced forward (default 1: one decode step per token, as ds4)")
    p.add_argument("--json", action="store_true", help="print the result as a JSON object")
    p.set_defaults(func=run)


def read_text(path: str) -> str:
    text = read_text_file(path, "--file")
    nul = text.find("\0")
    if nul >= 0:
        raise UsageError(f"--file {path} holds a NUL character (index {nul}): a binary file, not text")
    return text


def run(args) -> int:
    from ds4_mlx.engine.engine import Engine
    from ds4_mlx.engine.perplexity import perplexity

    text = read_text(args.file)  # before the model loads: a wrong file costs no load
    engine = Engine.open(args.model, **model_options(args))
    if args.ctx > engine.context_length:
        raise UsageError(f"--ctx {args.ctx} is larger than the model's context length {engine.context_length}")
    bar = ScoreBar(sys.stderr)
    try:
        result = perplexity(engine, text, ctx=args.ctx, n=args.tokens, chunk=args.chunk, progress=bar.update)
    finally:
        bar.close()
    print(json.dumps(result.to_json()) if args.json else result.line())
    return 0


class ScoreBar:
    """A tqdm bar of scored tokens on a terminal; nothing when ``stream`` is not one."""

    def __init__(self, stream):
        self.stream = stream
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self.bar = None

    def update(self, done: int, total: int) -> None:
        if not self.tty:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="tok", desc="scoring", file=self.stream, leave=False,
                            dynamic_ncols=True)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
