"""FFN sub-layer: routed mixture of experts plus one shared expert, both with clamped SwiGLU.

    xn     = RMSNorm(x, ffn_norm)
    prob   = sqrt(softplus(W_router·xn))                                   [n_expert]
    sel    = tid2eid[token]                       (hash layers, il < n_hash_layer)
           | top-k of prob + bias, ties -> lower expert id                 (other layers)
    w_i    = prob[sel_i] / max(Σ_i prob[sel_i], 2^-14) · 1.5
    mid_i  = silu(min(gate_i·xn, c)) · clip(up_i·xn, -c, c) · w_i          (router weight before down)
    f      = Σ_i down_i·mid_i  +  down_sh·(silu(min(gate_sh·xn, c)) · clip(up_sh·xn, -c, c))
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ds4_mlx.model.linear import DenseWeight, ExpertWeights, Numerics
from ds4_mlx.model.numerics import ordered_sum, rms_norm, silu, softplus

ROUTER_SUM_FLOOR = 6.103515625e-5  # 2^-14


class MoE:
    def __init__(self, *, ffn_norm: mx.array, router: DenseWeight, bias: mx.array | None,
                 tid2eid: np.ndarray | None, gate_exps: ExpertWeights, up_exps: ExpertWeights,
                 down_exps: ExpertWeights, gate_sh: DenseWeight, up_sh: DenseWeight, down_sh: DenseWeight,
                 n_used: int, weight_scale: float, clamp: float, eps: float):
        self.ffn_norm, self.router, self.bias, self.tid2eid = ffn_norm, router, bias, tid2eid
        self.gate_exps, self.up_exps, self.down_exps = gate_exps, up_exps, down_exps
        self.gate_sh, self.up_sh, self.down_sh = gate_sh, up_sh, down_sh
        self.n_used, self.weight_scale, self.clamp, self.eps = n_used, weight_scale, clamp, eps

    def _swiglu(self, gate: mx.array, up: mx.array, numerics: Numerics) -> mx.array:
        c = self.clamp
        return silu(mx.minimum(gate, c), numerics) * mx.clip(up, -c, c)

    def route(self, xn: mx.array, tokens: np.ndarray, numerics: Numerics) -> tuple[np.ndarray, mx.array]:
        """(selected expert ids int32 [T, k], their weights [T, k])."""
        prob = mx.sqrt(softplus(self.router(xn, numerics), numerics))
        if self.tid2eid is not None:
            sel = self.tid2eid[tokens]
        else:
            choice = prob if self.bias is None else prob + self.bias
            # Stable sort of the negated scores = ds4's insertion top-k with strict '>'.
            sel = np.argsort(-np.array(choice, dtype=np.float32), axis=1, kind="stable")[:, : self.n_used]
        sel = np.ascontiguousarray(sel, dtype=np.int32)
        w = mx.take_along_axis(prob, mx.array(sel), axis=1)
        if numerics is Numerics.DS4_CPU:
            total = ordered_sum([w[:, i: i + 1] for i in range(self.n_used)])
        else:
            total = mx.sum(w, axis=1, keepdims=True)
        return sel, w / mx.maximum(total, ROUTER_SUM_FLOOR) * self.weight_scale

    def __call__(self, x: mx.array, tokens: np.ndarray, numerics: Numerics) -> mx.array:
        """x [T, n_embd] (HC-reduced), tokens [T] (this position's input ids) -> f [T, n_embd]."""
        xn = rms_norm(x, self.ffn_norm, self.eps, numerics)
        sel, w = self.route(xn, tokens, numerics)
        xe = xn[:, None, :]
        mid = self._swiglu(self.gate_exps(xe, sel, numerics), self.up_exps(xe, sel, numerics), numerics)
        down = self.down_exps(mid * w[:, :, None], sel, numerics)  # [T, k, n_embd]
        if numerics is Numerics.DS4_CPU:
            routed = ordered_sum([down[:, i] for i in range(self.n_used)])
        else:
            routed = mx.sum(down, axis=1)
        shared = self.down_sh(self._swiglu(self.gate_sh(xn, numerics), self.up_sh(xn, numerics), numerics),
                              numerics)
        return routed + shared
