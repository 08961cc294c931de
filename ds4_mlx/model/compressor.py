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
A chunk of L tokens at P0 is handled at once: the frontier (state rows, see ``state.py``) is
prepended to the chunk's projections, every window completed inside the chunk is pooled, and the
leftover tokens become the new canonical frontier.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ds4_mlx.model.linear import DenseWeight
from ds4_mlx.model.numerics import EMPTY_SCORE, f16_round, fp8_kv_round, indexer_qat
from ds4_mlx.model.ops import DefaultOps
from ds4_mlx.model.decode_cache import LaneCache
from ds4_mlx.model.rope import Rope, apply_rope
from ds4_mlx.model.state import CompressorState


class Compressor:
    def __init__(self, kv: DenseWeight, gate: DenseWeight, ape: mx.array, norm: mx.array, ratio: int,
                 dim: int, rope: Rope, n_nope: int | None, eps: float, coff: int, ops: DefaultOps):
        """``n_nope`` set: attention lane (FP8 on dims < n_nope); None: indexer lane (Hadamard + FP4).
        ``coff``: ``ModelConfig.coff(il)`` (2 on ratio-4 layers: overlapping windows, else 1)."""
        self.kv, self.gate, self.ape, self.norm, self.ops = kv, gate, ape, norm, ops
        self.ratio, self.dim, self.rope, self.n_nope, self.eps = ratio, dim, rope, n_nope, eps
        self.coff = coff

    def __call__(self, xn: mx.array, p0: int, state: CompressorState) -> tuple[mx.array, CompressorState]:
        """xn [L, n_embd] at positions p0.. -> (rows emitted in this chunk [n_emit, D], new state)."""
        R, D, W = self.ratio, self.dim, self.coff * self.dim
        L = xn.shape[0]
        pos_mod = (p0 + np.arange(L)) % R
        k = self.ops.linear(self.kv, xn)
        g = self.ops.linear(self.gate, xn) + self.ape[mx.array(pos_mod)]

        r0 = p0 % R
        n_front = R + r0 if R == 4 else r0  # frontier rows in position order
        seq_k = mx.concatenate([state.kst[:n_front], k], axis=0)
        seq_g = mx.concatenate([state.gst[:n_front], g], axis=0)
        n_emit = (r0 + L) // R
        first = n_front - r0  # index in seq of the first token of the first open window

        if R == 4:
            # Frontier: the last complete window (or the untouched previous one) + the partial one.
            prev_k = seq_k[4 * n_emit: 4 * n_emit + 4]
            prev_g = seq_g[4 * n_emit: 4 * n_emit + 4]
            tail_k = seq_k[4 + 4 * n_emit:]
            tail_g = seq_g[4 + 4 * n_emit:]
            new_k = [prev_k, tail_k]
            new_g = [prev_g, tail_g]
            n_rows_state = 8
        else:
            tail_k, tail_g = seq_k[first + R * n_emit:], seq_g[first + R * n_emit:]
            new_k, new_g = [tail_k], [tail_g]
            n_rows_state = R
        pad = n_rows_state - sum(a.shape[0] for a in new_k)
        new_state_k = mx.concatenate(new_k + [mx.zeros((pad, W), dtype=mx.float32)], axis=0)
        new_state_g = mx.concatenate(new_g + [mx.full((pad, W), EMPTY_SCORE, dtype=mx.float32)], axis=0)

        if n_emit == 0:
            rows = mx.zeros((0, D), dtype=mx.float32)
        else:
            if R == 4:
                cur_k = seq_k[4: 4 + 4 * n_emit].reshape(n_emit, 4, W)
                cur_g = seq_g[4: 4 + 4 * n_emit].reshape(n_emit, 4, W)
                prv_k = seq_k[: 4 * n_emit].reshape(n_emit, 4, W)
                prv_g = seq_g[: 4 * n_emit].reshape(n_emit, 4, W)
                # Slots interleaved (prev r, cur r) as ds4 accumulates them.
                slot_k = mx.stack([prv_k[..., :D], cur_k[..., D:]], axis=2).reshape(n_emit, 8, D)
                slot_g = mx.stack([prv_g[..., :D], cur_g[..., D:]], axis=2).reshape(n_emit, 8, D)
            else:
                slot_k = seq_k[first: first + R * n_emit].reshape(n_emit, R, D)
                slot_g = seq_g[first: first + R * n_emit].reshape(n_emit, R, D)
            pooled = self.ops.pool(slot_k, slot_g, R)
            c = self.ops.rms_norm(pooled, self.norm, self.eps)
            w0 = p0 // R
            cos, sin = self.ops.rope_tables(self.rope, R * (w0 + np.arange(n_emit)))
            c = apply_rope(c, cos, sin)
            c = fp8_kv_round(c, self.n_nope) if self.n_nope is not None else indexer_qat(c)
            rows = f16_round(c)

        return rows, CompressorState(mx.concatenate([state.rows, rows], axis=0), new_state_k, new_state_g)

    def decode_step(self, xn: mx.array, pos: mx.array, cos: mx.array, sin: mx.array,
                    lane: LaneCache) -> LaneCache:
        """One token at position ``pos`` (int32 scalar array) with fixed shapes, for the compiled
        decode step (DEFAULT numerics). ``cos``/``sin`` [1, n_rot/2]: the tables of the first position
        of the token's window, p - p mod R.

        The pooled row of the open window is computed every step and written to slot p // R: it is
        the emitted row when p closes the window ((p+1) mod R == 0), otherwise a provisional value in
        a slot no query can see yet, overwritten by the next step. The frontier stays canonical:
        on emission the window's rows are cleared (R = 4: moved to the "previous window" half).
        """
        R, D, W = self.ratio, self.dim, self.coff * self.dim
        r = pos % R
        k = self.ops.linear(self.kv, xn)
        g = self.ops.linear(self.gate, xn) + mx.take(self.ape, r.reshape(1), axis=0)
        row = (r + 4 if R == 4 else r).reshape(1)
        kst = mx.slice_update(lane.kst, k, row, axes=(0,))
        gst = mx.slice_update(lane.gst, g, row, axes=(0,))
        if R == 4:
            # same slot layout as the chunk path: (prev r, cur r) interleaved
            prv_k, cur_k = kst[None, :4], kst[None, 4:]
            prv_g, cur_g = gst[None, :4], gst[None, 4:]
            slot_k = mx.stack([prv_k[..., :D], cur_k[..., D:]], axis=2).reshape(1, 8, D)
            slot_g = mx.stack([prv_g[..., :D], cur_g[..., D:]], axis=2).reshape(1, 8, D)
        else:
            slot_k, slot_g = kst.reshape(1, R, D), gst.reshape(1, R, D)
        c = self.ops.rms_norm(self.ops.pool(slot_k, slot_g, R), self.norm, self.eps)
        c = apply_rope(c, cos, sin)
        c = f16_round(fp8_kv_round(c, self.n_nope) if self.n_nope is not None else indexer_qat(c))
        rows = mx.slice_update(lane.rows, c, (pos // R).reshape(1), axes=(0,))

        emit = r == R - 1
        if R == 4:
            kst = mx.where(emit, mx.concatenate([kst[4:], mx.zeros((4, W), dtype=mx.float32)], axis=0), kst)
            gst = mx.where(emit, mx.concatenate([gst[4:], mx.full((4, W), EMPTY_SCORE, dtype=mx.float32)], axis=0),
                           gst)
        else:
            kst = mx.where(emit, mx.zeros_like(kst), kst)
            gst = mx.where(emit, mx.full(gst.shape, EMPTY_SCORE, dtype=mx.float32), gst)
        return LaneCache(rows, kst, gst)
