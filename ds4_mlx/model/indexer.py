"""Lightning indexer of ratio-4 layers: picks, per query, the compressed rows attention may see.

When a query at position p sees Nc = (p+1)//4 compressed rows and Nc > top_k:
    qi_h  = QAT(RoPE(Wq·qn, p))_h          (n_ih heads × 128; qn = normalised q-lora)
    wi_h  = (Wproj·xn)_h / sqrt(128·n_ih)
    score[c] = Σ_h max(0, qi_h · Kidx[c]) · wi_h       over the indexer's own compressed rows
    selected = the top_k scores, ties to the lowest row index.
Otherwise every visible row is used and nothing here is computed. The indexer rows come from a
second compressor (width 128, Hadamard + FP4 rounding) that runs in lock-step with the attention
compressor, so indexer row c and attention row c describe the same window.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ds4_mlx.model.host import to_host
from ds4_mlx.model.linear import DenseWeight
from ds4_mlx.model.numerics import indexer_qat
from ds4_mlx.model.ops import DefaultOps
from ds4_mlx.model.rope import apply_rope


class Indexer:
    def __init__(self, q_b: DenseWeight, proj: DenseWeight, n_head: int, head_dim: int, top_k: int,
                 ops: DefaultOps):
        self.q_b, self.proj, self.ops = q_b, proj, ops
        self.n_head, self.head_dim, self.top_k = n_head, head_dim, top_k
        self.w_scale = float(np.float32(1.0) / np.sqrt(np.float32(head_dim * n_head)))

    def queries(self, qn: mx.array, xn: mx.array, cos: mx.array, sin: mx.array) -> tuple[mx.array, mx.array]:
        """(qi [T, n_ih, 128] after RoPE + QAT, wi [T, n_ih]) for queries with tables [T, n_rot/2]."""
        T = qn.shape[0]
        qi = self.ops.linear(self.q_b, qn).reshape(T, self.n_head, self.head_dim)
        qi = indexer_qat(apply_rope(qi, cos, sin))
        wi = self.ops.linear(self.proj, xn) * self.w_scale
        return qi, wi

    def scores(self, qi: mx.array, wi: mx.array, rows: mx.array) -> mx.array:
        """score[t, c] = Σ_h relu(qi[t,h]·rows[c])·wi[t,h]   -> [T, Nc]."""
        return self.ops.indexer_scores(qi, wi, rows)

    def select(self, scores: mx.array, n_visible: np.ndarray) -> np.ndarray:
        """Per query: the top_k visible rows (ties -> lower index), ascending; int32 [T, top_k].

        Queries whose visible count is <= top_k are not scored by ds4: they get rows 0..top_k-1,
        the caller masks rows >= n_visible.
        """
        T, nc = scores.shape
        k = self.top_k
        s = to_host(scores, np.float32)
        s[np.arange(nc)[None, :] >= n_visible[:, None]] = -np.inf
        # A stable sort of -score keeps equal scores in index order, as ds4's repeated argmax does.
        top = np.argsort(-s, axis=1, kind="stable")[:, :k]
        top.sort(axis=1)
        dense = n_visible <= k
        if dense.any():
            top[dense] = np.arange(k)[None, :]
        return top.astype(np.int32)

    def select_fixed(self, scores: mx.array, n_visible: mx.array) -> tuple[mx.array, mx.array]:
        """``select`` for one query with fixed shapes (compiled decode): scores [C] over every row
        slot, n_visible an int32 scalar array (rows >= it are not visible).

        Returns (ids int32 [top_k], used bool [top_k]): the selected rows in ascending order,
        then padding (row 0, used = False). As in ``select``: all visible rows when there are at
        most top_k of them, else the top_k visible scores with ties to the lower index — the rows
        scoring above the k-th largest value t, then the lowest-indexed rows scoring exactly t.
        """
        C, k = scores.shape[0], self.top_k
        idx = mx.arange(C, dtype=mx.int32)
        visible = idx < n_visible
        s = mx.where(visible, scores, -mx.inf)
        t = mx.min(mx.topk(s, k))
        above = s > t
        tie = s == t
        need = k - mx.sum(above.astype(mx.int32))
        top = above | (tie & (mx.cumsum(tie.astype(mx.int32)) <= need))
        chosen = mx.where(n_visible <= k, visible, top)
        # compaction: the j-th chosen row goes to slot j, the others to a dump slot k
        dest = mx.where(chosen, mx.cumsum(chosen.astype(mx.int32)) - 1, k)
        ids = mx.zeros((k + 1,), dtype=mx.int32).at[dest].add(mx.where(chosen, idx, 0))[:k]
        used = mx.arange(k, dtype=mx.int32) < mx.minimum(n_visible, k)
        return ids, used
