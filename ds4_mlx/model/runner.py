"""The model-level runner under ``engine.session.Session``: prefill, one-token eval, next-token logits.

Internal: users hold an engine ``Session`` (``ds4_mlx.Session``), which adds sync, snapshots,
payloads and sampling on top of this; tests of the forward pass drive a runner directly.

Prefill runs in chunks whose boundaries are absolute multiples of ``chunk`` (ds4's 2048 by
default), so a session resumed from any checkpoint executes the same chunks as a cold prefill of
the whole prompt would from that point on. ``eval(token)`` feeds one token (see Decode). The engine layer
builds sampling, snapshots and the KV store on top of this (``engine/session.py``).

The runner holds one ``ModelCache`` (``state``). Decode: in DEFAULT numerics a one-token feed
(``eval``, or ``prefill`` of one token, which is how the engine decodes) runs the compiled decode
step (``compiled_decode``) on that same cache, updated in place; prefill chunks replace it with the
cache after the chunk. ``compile=False`` (or the environment variable ``DS4_MLX_COMPILE=0``) keeps
every feed on the chunk path. ds4-cpu numerics never compile (``compiled`` is then False whatever was asked).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from ds4_mlx import allocator
from ds4_mlx.errors import InferenceError
from ds4_mlx.model.cache import ModelCache
from ds4_mlx.model.host import to_host


# A prefill at least this long leaves GiBs of freed temporaries in the (tuned) heap: give them back.
TRIM_AFTER_TOKENS = 256


def _compile_default() -> bool:
    return os.environ.get("DS4_MLX_COMPILE", "1").strip().lower() not in ("0", "false", "no", "off")


class Runner:
    def __init__(self, model, ctx: int | None = None, chunk: int = 2048, compile: bool | None = None):
        cfg = model.config
        if chunk < 1:
            raise InferenceError(f"prefill chunk size must be >= 1, got {chunk}")
        if ctx is not None and ctx < 1:
            raise InferenceError(f"context size must be >= 1, got {ctx}")
        self.model = model
        self.ctx = ctx if ctx is not None else cfg.context_length
        self.chunk = chunk
        want = _compile_default() if compile is None else bool(compile)
        self.compiled = want and model.ops.compilable
        # The live cache after ``n_tokens`` (take ``copy()`` for anything that must outlive the next
        # feed: decode steps update it in place).
        self.state = model.empty_cache()  # a pipeline rank: its own layers only
        self.tokens: list[int] = []
        self._logits: mx.array | None = None
        # A compiled decode step leaves the cache's new arrays lazy, tied to its logits: the caller's
        # one read of the logits (``logits()``) evaluates both, one host sync per decoded token. A
        # feed whose logits nobody read is evaluated before the next one (``_settle``), so a run of
        # unread one-token feeds never grows one long lazy graph.
        self._lazy = False
        # a speculative verify not yet committed: (the cache before it, tokens before it, its logits)
        self._pending: tuple[ModelCache, int, mx.array] | None = None

    @property
    def n_tokens(self) -> int:
        return self.state.n_tokens

    def _check(self, tokens: np.ndarray) -> None:
        n_vocab = self.model.config.n_vocab
        if tokens.ndim != 1:
            raise InferenceError(f"tokens must be a 1-D sequence of ids, got shape {tokens.shape}")
        bad = np.flatnonzero((tokens < 0) | (tokens >= n_vocab))
        if bad.size:
            raise InferenceError(f"token id {int(tokens[bad[0]])} at index {int(bad[0])} is outside the "
                                 f"vocabulary 0..{n_vocab - 1}")
        if self.n_tokens + tokens.size > self.ctx:
            raise InferenceError(f"context overflow: {self.n_tokens} + {tokens.size} tokens > ctx {self.ctx}")

    def prefill(self, tokens: Sequence[int]) -> None:
        """Feed tokens (layer-major per chunk); afterwards ``logits()`` predicts the next one."""
        toks = np.asarray(list(tokens) if not isinstance(tokens, np.ndarray) else tokens, dtype=np.int64)
        if toks.size == 0:
            return
        if self._pending is not None:
            raise InferenceError("a verify is pending: commit it first")
        self._check(toks)
        self._settle()
        if toks.size == 1 and self.compiled:
            self._decode(toks)
            return
        i = 0
        while i < toks.size:
            p = self.state.n_tokens
            take = min(toks.size - i, self.chunk - p % self.chunk)
            last = i + take == toks.size
            logits, self.state = self.model.forward_chunk(toks[i: i + take], self.state, want_logits=last)
            if last:
                self._logits = logits
            i += take
        self.tokens.extend(int(t) for t in toks)
        if toks.size >= TRIM_AFTER_TOKENS:
            allocator.trim_heap()

    @property
    def pending(self) -> bool:
        """A verify chunk is held that ``commit`` has not cut back yet."""
        return self._pending is not None

    def verify(self, tokens: Sequence[int], taps: Sequence[int] | None = None) -> tuple[mx.array, mx.array]:
        """Feed ``tokens`` (at most n_swa) as one speculative verify chunk (``Model.forward_verify``),
        keeping the state before it: returns (logits [L, n_vocab], H [L, n_hc, n_embd] or, with
        ``taps``, those layers' HC-mean rows [L, len(taps), n_embd]), both evaluated. The runner
        holds all L tokens until ``commit(n)``."""
        toks = np.asarray(list(tokens), dtype=np.int64)
        if self._pending is not None:
            raise InferenceError("a verify is pending: commit it first")
        if toks.size == 0 or toks.size > self.model.config.n_swa:
            raise InferenceError(f"a verify chunk holds 1..{self.model.config.n_swa} tokens, got {toks.size}")
        self._check(toks)
        self._settle()
        mark, n0 = self.state.mark(), len(self.tokens)
        logits, H, self.state = self.model.forward_verify(toks, self.state, taps)
        mx.eval(logits, H)
        self._pending = (mark, n0, logits)
        self.tokens.extend(int(t) for t in toks)
        self._logits = logits[-1]
        return logits, H

    def commit(self, n: int) -> None:
        """Keep the first ``n`` (1..L) tokens of the pending verify: the state becomes exactly the
        one after them (``ModelCache.rollback``, no recomputation), the logits those of token n."""
        if self._pending is None:
            raise InferenceError("commit without a pending verify")
        mark, n0, logits = self._pending
        L = len(self.tokens) - n0
        if not 1 <= n <= L:
            raise InferenceError(f"commit keeps 1..{L} tokens of the verify, got {n}")
        self.state.rollback(mark, n0 + n)
        del self.tokens[n0 + n:]
        self._logits = logits[n - 1]
        self._pending = None

    def _decode(self, toks: np.ndarray) -> None:
        logits = self.model.step(int(toks[0]), self.state, evaluate=False)
        self._logits = mx.depends([logits], self.state.arrays())[0]
        self._lazy = True
        self.tokens.extend(int(t) for t in toks)

    def _settle(self) -> None:
        """Evaluate a decode step whose logits were never read (see ``_lazy``)."""
        if self._lazy:
            mx.eval(*self.state.arrays())
            self._lazy = False

    def eval(self, token: int) -> None:
        """Feed one token (decode step)."""
        self.prefill([token])

    def logits(self) -> np.ndarray:
        """float32 [n_vocab]: next-token logits after everything fed so far."""
        if self._logits is None:
            raise InferenceError("no logits yet: feed at least one token first")
        out = to_host(self._logits, np.float32)
        self._lazy = False  # the read evaluated the step's cache arrays with the logits
        return out

    def nbytes(self) -> int:
        """Bytes of the live cache's buffers."""
        return self.state.nbytes

    def snapshot(self) -> tuple[ModelCache, list[int], mx.array | None]:
        if self._pending is not None:  # a snapshot never holds draft tokens
            raise InferenceError("a verify is pending: commit it before taking a snapshot")
        self._settle()
        return self.state.copy(), list(self.tokens), self._logits

    def restore(self, snap: tuple[ModelCache, list[int], mx.array | None]) -> None:
        state, tokens, logits = snap
        self.state, self.tokens, self._logits = state.copy(), list(tokens), logits
        self._lazy = False  # a snapshot is taken settled
        self._pending = None  # a verify in flight is dropped with the state it was on
