"""Learned KV compressor: one row per window of R tokens, pooled by a per-dimension softmax.

For every token at position p (input xn = attn_norm output):
    k = Wkv·xn,  g = Wgate·xn + ape[p mod R]                                   (width W = coff·D)
Window w = tokens [wR, wR+R-1] (aligned to absolute positions) is emitted when its last token
arrives, before that token's attention:
    R = 128: slots = the window's 128 tokens (all W = D columns)
    R = 4:   slots = previous window's 4 tokens through columns [0, D) ++ this window's 4 tokens
             through columns [D, 2D)  (overlapping windows, coff = 2; window -1 is empty)
    pooled_j = Σ_slots e^(g_j - max g_j)·k_j / Σ_slots e^(g_j - max g_j)
    row = f16r(round(RoPE(RMSNorm(pooled, norm), wR)))     round = FP8 on the nope dims (D = head_dim)
                                                                   or Hadamard + FP4 (indexer lane)
One ``__call__`` serves prefill chunks and decode steps; the lane (``cache.CompressorLane``) owns
the layout: a chunk of L tokens at p0 prepends the frontier to its projections, pools every window
completed inside it and leaves the leftover tokens as the canonical frontier; a fixed-shape step
writes its token into the frontier and pools only when the token closes its window (``StepAt.closes``,
known on the host: the compiled decoder traces such a layer once for closing steps, once for the rest).
"""

from __future__ import annotations

import mlx.core as mx

from ds4_mlx.model.cache import CompressorLane
from ds4_mlx.model.linear import DenseWeight
from ds4_mlx.model.numerics import f16_round, fp8_kv_round, indexer_qat
from ds4_mlx.model.ops import DefaultOps
from ds4_mlx.model.rope import Rope, apply_rope


class Compressor:
    def __init__(self, kv: DenseWeight, gate: DenseWeight, ape: mx.array, norm: mx.array, ratio: int,
                 dim: int, rope: Rope, n_nope: int | None, eps: float, coff: int, ops: DefaultOps):
        """``n_nope`` set: attention lane (FP8 on dims < n_nope); None: indexer lane (Hadamard + FP4).
        ``coff``: ``ModelConfig.coff(il)`` (2 on ratio-4 layers: overlapping windows, else 1)."""
        self.kv, self.gate, self.ape, self.norm, self.ops = kv, gate, ape, norm, ops
        self.ratio, self.dim, self.rope, self.n_nope, self.eps = ratio, dim, rope, n_nope, eps
        self.coff = coff

    def __call__(self, xn: mx.array, lane: CompressorLane) -> mx.array:
        """xn [L, n_embd] at the lane's bound positions -> the rows the call's queries may see
        (``CompressorLane.commit``); updates ``lane``."""
        at = lane.at
        k = self.ops.linear(self.kv, xn)
        g = self.ops.linear(self.gate, xn) + at.ape(self.ape, self.ratio)
        win = lane.windows(k, g)
        if win is None:
            return lane.commit(None)
        slot_k, slot_g, starts = win
        c = self.ops.rms_norm(self.ops.pool(slot_k, slot_g, self.ratio), self.norm, self.eps)
        cos, sin = at.window_tables(self.rope, starts)
        c = apply_rope(c, cos, sin)
        c = fp8_kv_round(c, self.n_nope) if self.n_nope is not None else indexer_qat(c)
        return lane.commit(f16_round(c))
