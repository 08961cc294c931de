"""Minimal inference session over a ``Model``: prefill, one-token eval, next-token logits.

Prefill runs in chunks whose boundaries are absolute multiples of ``chunk`` (ds4's 2048 by
default), so a session resumed from any checkpoint executes the same chunks as a cold prefill of
the whole prompt would from that point on. ``eval(token)`` is a one-token chunk. The engine layer
builds sampling, snapshots and the KV store on top of this.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from ds4_mlx.model.state import InferenceError, ModelState


class Session:
    def __init__(self, model, ctx: int | None = None, chunk: int = 2048):
        cfg = model.config
        if chunk < 1:
            raise InferenceError(f"prefill chunk size must be >= 1, got {chunk}")
        if ctx is not None and ctx < 1:
            raise InferenceError(f"context size must be >= 1, got {ctx}")
        self.model = model
        self.ctx = ctx if ctx is not None else cfg.context_length
        self.chunk = chunk
        self.state = ModelState.empty(cfg)
        self.tokens: list[int] = []
        self._logits: mx.array | None = None

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
        self._check(toks)
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

    def eval(self, token: int) -> None:
        """Feed one token (decode step)."""
        self.prefill([token])

    def logits(self) -> np.ndarray:
        """float32 [n_vocab]: next-token logits after everything fed so far."""
        if self._logits is None:
            raise InferenceError("no logits yet: feed at least one token first")
        return np.array(self._logits, dtype=np.float32)

    def snapshot(self) -> tuple[ModelState, list[int], mx.array | None]:
        return self.state.copy(), list(self.tokens), self._logits

    def restore(self, snap: tuple[ModelState, list[int], mx.array | None]) -> None:
        state, tokens, logits = snap
        self.state, self.tokens, self._logits = state.copy(), list(tokens), logits
