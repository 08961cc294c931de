"""Hyper-connections: the residual stream is n_hc (= 4) parallel copies H[s] of the hidden state.

Before each sub-layer a learned mixer reads RMSNorm(vec H) and produces
    pre[s]  = σ(mix·scale0 + base) + eps           weights that reduce H to the sub-layer input,
    post[d] = 2 σ(mix·scale1 + base)                gains of the sub-layer output per stream,
    C[a][b]                                          a Sinkhorn-balanced n_hc×n_hc combine matrix
(row softmax + eps, then column / row / column … normalisation, ``hc_sinkhorn_iter`` passes total).
After the sub-layer:  H'[d] = post[d]·f + Σ_s C[s][d]·H[s]   (C is read transposed).
The output head reduces H with its own pre weights only (no Sinkhorn, no post).

Shapes: H [T, n_hc, D]; mix [T, 2·n_hc + n_hc²]; pre, post [T, n_hc]; C [T, n_hc, n_hc].
"""

from __future__ import annotations

import mlx.core as mx

from ds4_mlx.model.linear import DenseWeight
from ds4_mlx.model.ops import DefaultOps


class HyperConnection:
    """One HC mixer (``hc_attn_*`` or ``hc_ffn_*`` of a layer)."""

    def __init__(self, fn: DenseWeight, scale: mx.array, base: mx.array, n_hc: int, sinkhorn_iter: int,
                 hc_eps: float, norm_eps: float, ops: DefaultOps):
        self.fn, self.scale, self.base, self.ops = fn, scale, base, ops
        self.n_hc, self.iters, self.hc_eps, self.norm_eps = n_hc, sinkhorn_iter, hc_eps, norm_eps

    def mix(self, H: mx.array) -> mx.array:
        """H [T, n, D] -> the mixer's logits mix [T, 2n+n²] (RMSNorm of the flattened streams, then fn)."""
        T, n, D = H.shape
        return self.ops.linear(self.fn, self.ops.rms_norm(H.reshape(T, n * D), None, self.norm_eps))

    def gains(self, mix: mx.array) -> tuple[mx.array, mx.array]:
        """mix [T, 2n+n²] -> (pre [T, n], post [T, n])."""
        n, ops = self.n_hc, self.ops
        pre = ops.sigmoid_expf(mix[:, :n] * self.scale[0] + self.base[:n]) + self.hc_eps
        post = ops.post_gain(mix[:, n: 2 * n] * self.scale[1] + self.base[n: 2 * n])
        return pre, post

    def comb(self, mix: mx.array) -> mx.array:
        """mix [T, 2n+n²] -> the Sinkhorn-balanced combine matrix C [T, n, n]."""
        n, eps, ops = self.n_hc, self.hc_eps, self.ops
        T = mix.shape[0]
        c = (mix[:, 2 * n:] * self.scale[2] + self.base[2 * n:]).reshape(T, n, n)
        c = ops.exp(c - mx.max(c, axis=-1, keepdims=True))
        c = c * (1.0 / ops.small_sum(c, -1, keepdims=True)) + eps
        c = c * (1.0 / (ops.small_sum(c, -2, keepdims=True) + eps))
        for _ in range(1, self.iters):
            c = c * (1.0 / (ops.small_sum(c, -1, keepdims=True) + eps))
            c = c * (1.0 / (ops.small_sum(c, -2, keepdims=True) + eps))
        return c

    def reduce(self, H: mx.array, mix: mx.array) -> tuple[mx.array, mx.array]:
        """H [T, n, D] and its logits ``mix`` -> (sub-layer input x [T, D], post [T, n])."""
        pre, post = self.gains(mix)
        return self.ops.weighted_streams(H, pre), post

    def pre(self, H: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """H [T, n, D] -> (sub-layer input x [T, D], post [T, n], C [T, n, n])."""
        mix = self.mix(H)
        return (*self.reduce(H, mix), self.comb(mix))

    def post(self, f: mx.array, H: mx.array, post: mx.array, comb: mx.array) -> mx.array:
        """H'[d] = post[d]·f + Σ_s C[s][d]·H[s]   (f [T, D]) -> [T, n, D]."""
        return self.ops.hc_post(f, H, post, comb)


class OutputHC:
    """Final reduction of the streams before the output norm: y = Σ_s (σ(pre_s·scale + base_s) + eps)·H[s]."""

    def __init__(self, fn: DenseWeight, scale: mx.array, base: mx.array, hc_eps: float, norm_eps: float,
                 ops: DefaultOps):
        self.fn, self.scale, self.base, self.hc_eps, self.norm_eps = fn, scale, base, hc_eps, norm_eps
        self.ops = ops

    def __call__(self, H: mx.array) -> mx.array:
        T, n, D = H.shape
        ops = self.ops
        flat = ops.rms_norm(H.reshape(T, n * D), None, self.norm_eps)
        pre = ops.linear(self.fn, flat)
        w = ops.sigmoid_stable(pre * self.scale[0] + self.base) + self.hc_eps
        return ops.weighted_streams(H, w)
