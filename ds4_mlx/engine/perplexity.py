"""Perplexity of a raw text (``ds4_mlx.perplexity``, ``ds4-mlx perplexity``): ds4's ``--perplexity-file``
(ds4_cli.c ``run_perplexity_file``).

* The text is tokenized as plain text (``ds4_tokenize_text``: BPE only, no BOS, no chat template,
  special strings kept as text).
* A fixed prefix of its first 32 tokens is prefilled first (ds4: enough real context to stay on
  its normal prefill path); a text of 32 tokens or fewer is refused.
* The tokens after the prefix are scored, at most ``n`` of them (if ``n`` > 0) and at most
  ``ctx - 32``; a ``ctx`` that leaves none is refused.
* Each scored token's logprob comes from the logits before it (``ds4_session_token_logprob``:
  log-softmax in float64 over the finite logits, rounded to float32); the negative sum is kept in
  float64. ``ppl = exp(nll / scored)``.

``chunk=1`` (the default) is ds4's path exactly: after each score the token is fed by one decode
step (``Session.eval``; the last scored token is never fed). ``chunk=N`` feeds the scored tokens N
at a time in one teacher-forced forward whose every position's logits score the next tokens
(``Session.append_with_logits``), which is faster on long texts. In the ``ds4-cpu``
numerics the two give the same bits (``tests/test_perplexity.py``); in the default numerics a
decode step runs the compiled one-token graph and a chunk runs MLX's batched products, whose float32
sums are ordered differently, so the logits differ by rounding (measured there).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from ds4_mlx.engine.sampling import token_logprob
from ds4_mlx.errors import InferenceError

PREFIX_TOKENS = 32  # ds4's prefix_len
# ds4's -n default (its n_predict): it caps the scored tokens too, e.g. with --ctx above 50032
DEFAULT_MAX_SCORED = 50000
# A chunk's logits are N x n_vocab float32 (0.5 MiB a position on DS4 Flash): the prefill chunk bounds it
MAX_SCORE_CHUNK = 2048


@dataclass(frozen=True)
class PerplexityResult:
    tokens: int      # tokens of the whole text
    scored: int      # tokens scored (after the 32-token prefix, within n and ctx)
    nll: float       # summed negative log-likelihood (nats)
    avg_nll: float   # nll / scored
    ppl: float       # exp(avg_nll)

    def line(self) -> str:
        """ds4's output line, same format."""
        return (f"tokens={self.tokens} scored={self.scored} nll={self.nll:.9f} "
                f"avg_nll={self.avg_nll:.9f} ppl={self.ppl:.9f}")

    def to_json(self) -> dict:
        return asdict(self)


def _int(name: str, value, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo or \
            (hi is not None and value > hi):
        span = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise InferenceError(f"{name} must be an integer {span}, got {value!r}")
    return int(value)


def scored_count(n_tokens: int, n: int, ctx: int) -> int:
    """How many tokens ds4 scores in a text of ``n_tokens``: after the prefix, capped by ``n`` (when
    > 0) and by ``ctx - 32``. Raises ``InferenceError`` where ds4 refuses."""
    if n_tokens <= PREFIX_TOKENS:
        raise InferenceError(f"the text has {n_tokens} tokens: perplexity needs more than {PREFIX_TOKENS} "
                             f"(the first {PREFIX_TOKENS} are context, the rest are scored)")
    scored = n_tokens - PREFIX_TOKENS
    if n > 0:
        scored = min(scored, n)
    scored = min(scored, ctx - PREFIX_TOKENS)
    if scored <= 0:
        raise InferenceError(f"ctx {ctx} is too small for perplexity scoring: it must exceed the "
                             f"{PREFIX_TOKENS}-token prefix")
    return scored


def result_of(n_tokens: int, scored: int, nll: float) -> PerplexityResult:
    avg = nll / scored
    try:
        ppl = math.exp(avg)
    except OverflowError:  # C's exp() gives inf there, and ds4 prints it
        ppl = math.inf
    return PerplexityResult(n_tokens, scored, nll, avg, ppl)


def perplexity(model, text: str, *, ctx: int | None = None, n: int = DEFAULT_MAX_SCORED, chunk: int = 1,
               progress: Callable[[int, int], None] | None = None) -> PerplexityResult:
    """ds4's ``--perplexity-file`` on ``text`` (see the module docstring). ``model``:
    ``ds4_mlx.load(...)``; ``ctx``: the session's context (default ``model.default_ctx()``, ds4's
    32768); ``n``: most tokens scored (0: no cap but ctx, ds4's -n, default 50000); ``chunk``:
    tokens per teacher-forced forward (1: decode steps, as ds4). ``progress(done, total)`` is
    called as tokens are scored."""
    from ds4_mlx.engine.engine import Engine

    if not isinstance(model, Engine):
        raise InferenceError(f"perplexity needs the model ds4_mlx.load() returns, got {type(model).__name__}")
    if not isinstance(text, str):
        raise InferenceError(f"text must be a str, got {type(text).__name__}")
    ctx = model.default_ctx() if ctx is None else _int("ctx", ctx, 2)
    if ctx > model.context_length:
        raise InferenceError(f"ctx {ctx} is larger than the model's context length {model.context_length}")
    n = _int("n", n, 0)
    chunk = _int("chunk", chunk, 1, MAX_SCORE_CHUNK)
    if chunk > 1 and hasattr(model.network, "rank"):
        # a pipeline's last rank sends rank 0 one row of logits per forward, not one per position
        raise InferenceError("perplexity with chunk > 1 needs a single-process model")
    tokens = model.tokenizer.encode(text)
    scored = scored_count(len(tokens), n, ctx)
    if chunk == 1:
        nll = _score_decode(model, tokens, scored, ctx, progress)
    else:
        nll = _score_chunked(model, tokens, scored, chunk, ctx, progress)
    return result_of(len(tokens), scored, nll)


def _score_decode(model, tokens: list[int], scored: int, ctx: int, progress) -> float:
    """ds4's loop: score from the live logits, then feed the token by one decode step."""
    session = model.new_session(ctx=ctx)
    session.sync(tokens[:PREFIX_TOKENS])
    nll = 0.0
    for j in range(scored):
        tok = tokens[PREFIX_TOKENS + j]
        nll -= session.token_logprob(tok).logprob
        if progress is not None:
            progress(j + 1, scored)
        if j + 1 < scored:
            session.eval(tok)
    return nll


def _score_chunked(model, tokens: list[int], scored: int, chunk: int, ctx: int, progress) -> float:
    """The same sum, the scored tokens fed ``chunk`` at a time: the logits after the prefix score the
    first one, a chunk of fed tokens gives the logits that score the tokens after each of them
    (``Session.append_with_logits``). The ctx bound holds as in the decode loop: scored <= ctx - 32
    and the last token is not fed."""
    session = model.new_session(ctx=ctx, auto_checkpoints=0)
    session.sync(tokens[:PREFIX_TOKENS])
    nll = -session.token_logprob(tokens[PREFIX_TOKENS]).logprob
    done = 1
    if progress is not None:
        progress(done, scored)
    while done < scored:
        take = min(chunk, scored - done)
        start = PREFIX_TOKENS + done - 1  # the first token not fed yet
        rows = session.append_with_logits(tokens[start:start + take])
        for r in range(take):
            nll -= token_logprob(rows[r], tokens[start + r + 1]).logprob
        done += take
        if progress is not None:
            progress(done, scored)
    return nll
