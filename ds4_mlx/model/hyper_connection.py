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

from ds4_mlx.model.linear import DenseWeight, Numerics
from ds4_mlx.model.numerics import exp, ordered_sum, rms_norm, sigmoid_expf, sigmoid_stable


def _row_sum(c: mx.array, numerics: Numerics) -> mx.array:
    """Σ_b C[a][b], keepdims, in ds4's loop order for DS4_CPU."""
    if numerics is Numerics.DS4_CPU:
        return ordered_sum([c[..., b: b + 1] for b in range(c.shape[-1])])
    return mx.sum(c, axis=-1, keepdims=True)


def _col_sum(c: mx.array, numerics: Numerics) -> mx.array:
    """Σ_a C[a][b], keepdims."""
    if numerics is Numerics.DS4_CPU:
        return ordered_sum([c[..., a: a + 1, :] for a in range(c.shape[-2])])
    return mx.sum(c, axis=-2, keepdims=True)


def weighted_streams(H: mx.array, w: mx.array, numerics: Numerics) -> mx.array:
    """Σ_s w[:, s]·H[:, s]  ([T, n_hc, D], [T, n_hc] -> [T, D])."""
    if numerics is Numerics.DS4_CPU:
        return ordered_sum([H[:, s] * w[:, s: s + 1] for s in range(H.shape[1])])
    return mx.sum(H * w[:, :, None], axis=1)


class HyperConnection:
    """One HC mixer (``hc_attn_*`` or ``hc_ffn_*`` of a layer)."""

    def __init__(self, fn: DenseWeight, scale: mx.array, base: mx.array, n_hc: int, sinkhorn_iter: int,
                 hc_eps: float, norm_eps: float):
        self.fn, self.scale, self.base = fn, scale, base
        self.n_hc, self.iters, self.hc_eps, self.norm_eps = n_hc, sinkhorn_iter, hc_eps, norm_eps

    def split(self, mix: mx.array, numerics: Numerics) -> tuple[mx.array, mx.array, mx.array]:
        """mix [T, 2n+n²] -> (pre [T, n], post [T, n], C [T, n, n])."""
        n, eps = self.n_hc, self.hc_eps
        T = mix.shape[0]
        pre = sigmoid_expf(mix[:, :n] * self.scale[0] + self.base[:n], numerics) + eps
        z_post = mix[:, n: 2 * n] * self.scale[1] + self.base[n: 2 * n]
        if numerics is Numerics.DS4_CPU:
            post = 2.0 / (1.0 + exp(-z_post, numerics))  # ds4's formula: one rounding fewer than 2·σ(z)
        else:
            post = 2.0 * mx.sigmoid(z_post)

        c = (mix[:, 2 * n:] * self.scale[2] + self.base[2 * n:]).reshape(T, n, n)
        c = exp(c - mx.max(c, axis=-1, keepdims=True), numerics)
        c = c * (1.0 / _row_sum(c, numerics)) + eps
        c = c * (1.0 / (_col_sum(c, numerics) + eps))
        for _ in range(1, self.iters):
            c = c * (1.0 / (_row_sum(c, numerics) + eps))
            c = c * (1.0 / (_col_sum(c, numerics) + eps))
        return pre, post, c

    def pre(self, H: mx.array, numerics: Numerics) -> tuple[mx.array, mx.array, mx.array]:
        """H [T, n, D] -> (sub-layer input x [T, D], post [T, n], C [T, n, n])."""
        T, n, D = H.shape
        flat = rms_norm(H.reshape(T, n * D), None, self.norm_eps, numerics)
        pre, post, comb = self.split(self.fn(flat, numerics), numerics)
        return weighted_streams(H, pre, numerics), post, comb

    @staticmethod
    def post(f: mx.array, H: mx.array, post: mx.array, comb: mx.array, numerics: Numerics) -> mx.array:
        """H'[d] = post[d]·f + Σ_s C[s][d]·H[s]   (f [T, D]) -> [T, n, D]."""
        if numerics is Numerics.DS4_CPU:
            n = H.shape[1]
            out = [ordered_sum([f * post[:, d: d + 1]] + [comb[:, s, d: d + 1] * H[:, s] for s in range(n)])
                   for d in range(n)]
            return mx.stack(out, axis=1)
        return post[:, :, None] * f[:, None, :] + mx.matmul(comb.transpose(0, 2, 1), H)


class OutputHC:
    """Final reduction of the streams before the output norm: y = Σ_s (σ(pre_s·scale + base_s) + eps)·H[s]."""

    def __init__(self, fn: DenseWeight, scale: mx.array, base: mx.array, hc_eps: float, norm_eps: float):
        self.fn, self.scale, self.base, self.hc_eps, self.norm_eps = fn, scale, base, hc_eps, norm_eps

    def __call__(self, H: mx.array, numerics: Numerics) -> mx.array:
        T, n, D = H.shape
        flat = rms_norm(H.reshape(T, n * D), None, self.norm_eps, numerics)
        pre = self.fn(flat, numerics)
        w = sigmoid_stable(pre * self.scale[0] + self.base, numerics) + self.hc_eps
        return weighted_streams(H, w, numerics)
