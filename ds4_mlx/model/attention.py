"""Attention sub-layer of DS4 Flash: one latent KV head (K = V), sinks, sliding raw window plus
compressed rows, grouped low-rank output.

For a query at position p (x = HC-reduced input, D = head_dim, n_h heads):
    xn = RMSNorm(x, attn_norm)
    qn = RMSNorm(Wq_a·xn, q_a_norm);   q = RMSNorm_per_head(Wq_b·qn)            [n_h, D]
    kv = RMSNorm(Wkv·xn, kv_norm)                                               [D]
    q, kv = RoPE(·, p) on the last n_rot dims;  kv = f16r(FP8(kv) on dims < D - n_rot)
    keys = raw rows at positions max(0, p-n_swa+1)..p   ++ compressed rows visible at p
           (row c visible iff (c+1)·R <= p+1; ratio 4: only the indexer's top_k when more are visible)
    out_h = Σ_j e^(s_j - m) key_j / (e^(sink_h - m) + Σ_j e^(s_j - m)),  s_j = q_h·key_j / sqrt(D)
    heads = RoPE⁻¹(out, p);  a = Wo_b · concat_g(Wo_a[g] · heads[group g])
A chunk of L queries is processed at once, in blocks of queries sized to bound memory; causality
is expressed by per-query masks (raw window, compressed-row visibility, indexer selection).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ds4_mlx.formats.config import ModelConfig
from ds4_mlx.model.compressor import Compressor
from ds4_mlx.model.cache import LayerCache
from ds4_mlx.model.indexer import Indexer
from ds4_mlx.model.linear import DenseWeight
from ds4_mlx.model.numerics import f16_round, fp8_kv_round
from ds4_mlx.model.ops import DefaultOps
from ds4_mlx.model.rope import Rope, apply_rope

# Upper bound on the floats held by one query block's score / gather tensors.
BLOCK_BUDGET = 1 << 23


class Attention:
    def __init__(self, cfg: ModelConfig, il: int, *, attn_norm: mx.array, q_a: DenseWeight,
                 q_a_norm: mx.array, q_b: DenseWeight, kv: DenseWeight, kv_norm: mx.array,
                 sinks: mx.array, out_a: DenseWeight, out_b: DenseWeight,
                 compressor: Compressor | None = None, index_compressor: Compressor | None = None,
                 indexer: Indexer | None = None, ops: DefaultOps):
        self.il, self.ops = il, ops
        self.n_head, self.head_dim, self.n_rot = cfg.n_head, cfg.head_dim, cfg.n_rot
        self.n_nope, self.n_swa, self.eps = cfg.n_nope, cfg.n_swa, cfg.rms_eps
        self.ratio = cfg.compress_ratio(il)
        self.n_group, self.o_rank = cfg.n_out_group, cfg.o_lora_rank
        self.attn_norm, self.q_a, self.q_a_norm, self.q_b = attn_norm, q_a, q_a_norm, q_b
        self.kv, self.kv_norm, self.sinks, self.out_b = kv, kv_norm, sinks, out_b
        self.out_a = out_a  # [n_group * o_rank, (n_head / n_group) * head_dim]: one block of rows per group
        self.compressor, self.index_compressor, self.indexer = compressor, index_compressor, indexer
        self.rope = Rope(cfg, il)
        self.kq_scale = float(np.float32(1.0) / np.sqrt(np.float32(self.head_dim)))

    # -- the sub-layer ---------------------------------------------------------------------------

    def __call__(self, x: mx.array, cache: LayerCache) -> mx.array:
        """x [L, n_embd] at the cache's bound positions (``cache.at``) -> a [L, n_embd]; appends the
        tokens to ``cache`` (raw ring, compressor and indexer lanes).

        One body for prefill chunks and decode steps; the cache supplies the layout-dependent parts
        (RoPE tables of the positions, the raw keys, the lanes' visible rows) and ``_attend`` picks
        the keys: exact-shape query blocks with the indexer's selection on the host for a chunk,
        fixed shapes padded with masked keys and the selection on the device for a step.
        """
        L, at = x.shape[0], cache.at
        xn, qn, q, kv = self._project(x, L)

        cos, sin = at.tables(self.rope)
        q = apply_rope(q, cos, sin)
        kv = f16_round(fp8_kv_round(apply_rope(kv, cos, sin), self.n_nope))
        raw = cache.update_raw(kv)

        comp = idx_rows = None
        if self.ratio:
            comp = self.compressor(xn, cache.attn)
            if self.ratio == 4:
                idx_rows = self.index_compressor(xn, cache.index)

        if at.fixed:
            heads = self._attend_step(q, qn, xn, cos, sin, at.pos, raw, comp, idx_rows)
        else:
            heads = self._attend(q, qn, xn, cos, sin, at.positions, *raw, comp, idx_rows)
        icos, isin = at.inverse_tables(self.rope)
        return self._output(apply_rope(heads, icos, isin))

    # -- projections in and out ---------------------------------------------------------------------

    def _project(self, x: mx.array, L: int) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """x [L, n_embd] -> (xn, qn, q [L, H, D] before RoPE, kv [L, D] before RoPE)."""
        ops = self.ops
        xn = ops.rms_norm(x, self.attn_norm, self.eps)
        qn = ops.rms_norm(ops.linear(self.q_a, xn), self.q_a_norm, self.eps)
        q = ops.rms_norm(ops.linear(self.q_b, qn).reshape(L, self.n_head, self.head_dim), None, self.eps)
        kv = ops.rms_norm(ops.linear(self.kv, xn), self.kv_norm, self.eps)
        return xn, qn, q, kv

    def _output(self, heads: mx.array) -> mx.array:
        """heads [L, H, D] (after the inverse RoPE) -> a = Wo_b · concat_g(Wo_a[g] · group g)."""
        L, H, D = heads.shape
        groups = heads.reshape(L, self.n_group, (H // self.n_group) * D)
        return self.ops.linear(self.out_b, self.ops.grouped_linear(self.out_a, groups))

    # -- attention over the visible rows -----------------------------------------------------------

    def _block_size(self, L: int, n_comp_keys: int, n_index_rows: int) -> int:
        """Queries per block so that one block's scores / gathered keys stay within BLOCK_BUDGET.

        ds4-cpu ops materialise per-(query, head, key) products of width head_dim to sum them in
        ds4's order (``ops.product_width``), so their blocks are head_dim times smaller.
        """
        H, D, ops = self.n_head, self.head_dim, self.ops
        per_query = H * (self.n_swa + n_comp_keys) * ops.product_width(D) + self.n_swa * D
        if self.indexer is not None:
            per_query += self.indexer.n_head * n_index_rows * ops.product_width(self.indexer.head_dim)
            per_query += self.indexer.top_k * D
        shared_raw = H if ops.shares_raw_keys else 0  # block-shared raw keys grow with the block
        qb = L
        while qb > 1 and qb * (per_query + shared_raw * qb) > BLOCK_BUDGET:
            qb = (qb + 1) // 2
        return qb

    def _attend(self, q: mx.array, qn: mx.array, xn: mx.array, cos: mx.array, sin: mx.array,
                pos: np.ndarray, raw: mx.array, n_prev: int, comp: mx.array | None,
                idx_rows: mx.array | None) -> mx.array:
        """Attention outputs [L, H, D] (before the inverse RoPE) for queries at ``pos``."""
        L, H, D = q.shape
        R = self.ratio
        raw_base = int(pos[0]) - n_prev  # position of raw[0]
        n_vis_all = (pos + 1) // R if R else np.zeros(L, dtype=np.int64)
        top_k = self.indexer.top_k if R == 4 else 0

        use_indexer = R == 4 and int(n_vis_all[-1]) > top_k
        qi = wi = None
        if use_indexer:
            qi, wi = self.indexer.queries(qn, xn, cos, sin)
        n_comp_keys = top_k if R == 4 else int(n_vis_all[-1])
        qb = self._block_size(L, n_comp_keys, int(n_vis_all[-1]) if use_indexer else 0)

        out = []
        for b0 in range(0, L, qb):
            b1 = min(L, b0 + qb)
            pb = pos[b0:b1]
            key_sets = [self.ops.raw_window(raw, raw_base, pb, self.n_swa)]

            if R:
                n_vis = n_vis_all[b0:b1]
                n_max = int(n_vis[-1])
                if R == 4 and n_max > top_k:
                    # Per-query indexer selection; rows keep ascending index order, as ds4 scans them.
                    sc = self.indexer.scores(qi[b0:b1], wi[b0:b1], idx_rows[:n_max])
                    sel = self.indexer.select(sc, n_vis)
                    gathered = mx.take(comp, mx.array(sel.reshape(-1)), axis=0).reshape(b1 - b0, -1, D)
                    key_sets.append((gathered, sel < n_vis[:, None]))
                elif n_max > 0:
                    key_sets.append((comp[:n_max], np.arange(n_max)[None, :] < n_vis[:, None]))

            out.append(self.ops.sink_softmax(q[b0:b1], key_sets, self.sinks, self.kq_scale))
        return out[0] if len(out) == 1 else mx.concatenate(out, axis=0)

    def _attend_step(self, q: mx.array, qn: mx.array, xn: mx.array, cos: mx.array, sin: mx.array,
                     pos: mx.array, raw: tuple[mx.array, mx.array], comp: mx.array | None,
                     idx_rows: mx.array | None) -> mx.array:
        """``_attend`` for one query at the traced position ``pos`` with fixed shapes: the same keys
        in the same order (raw window oldest first, then compressed rows ascending), padded with
        masked keys: compressed rows are every row slot (visible iff row < (p+1)//R) or, on ratio-4
        layers whose buffer exceeds top_k rows, the indexer's top_k slots (``Indexer.select_fixed``).
        """
        key_sets = [raw]
        if self.ratio:
            n_vis = (pos + 1) // self.ratio
            n_slots = comp.shape[0]
            if self.ratio == 4 and n_slots > self.indexer.top_k:
                qi, wi = self.indexer.queries(qn, xn, cos, sin)
                sc = self.indexer.scores(qi, wi, idx_rows)[0]
                ids, used = self.indexer.select_fixed(sc, n_vis)
                key_sets.append((mx.take(comp, ids, axis=0)[None], used[None]))
            else:
                key_sets.append((comp, (mx.arange(n_slots, dtype=mx.int32) < n_vis)[None]))
        return self.ops.sink_softmax(q, key_sets, self.sinks, self.kq_scale)
