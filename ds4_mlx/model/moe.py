"""FFN sub-layer: routed mixture of experts plus one shared expert, both with clamped SwiGLU.

    xn     = RMSNorm(x, ffn_norm)
    prob   = sqrt(softplus(W_router·xn))                                   [n_expert]
    sel    = tid2eid[token]                       (hash layers, il < n_hash_layer)
           | top-k of prob + bias, ties -> lower expert id                 (other layers)
    w_i    = prob[sel_i] / max(Σ_i prob[sel_i], 2^-14) · 1.5
    mid_i  = silu(min(gate_i·xn, c)) · clip(up_i·xn, -c, c) · w_i          (router weight before down)
    f      = Σ_i down_i·mid_i  +  down_sh·(silu(min(gate_sh·xn, c)) · clip(up_sh·xn, -c, c))

Where the ids are chosen is the ``routing`` object the loader hands in (its load plan decides once):
``device_experts.DeviceRouting`` keeps them MLX arrays (``topk_lowest_id``, tid2eid by ``mx.take``), so
the layer has no host break and a compiled decode step traces all of it; ``host_step.HostRouting``
chooses them in numpy (the host expert strategy, and the bounded device cache, whose misses are read
from the file). Both select the same ids (the same tie rule on the same scores).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ds4_mlx.model.experts import ExpertWeights
from ds4_mlx.model.linear import DenseWeight
from ds4_mlx.model.ops import DefaultOps

ROUTER_SUM_FLOOR = 6.103515625e-5  # 2^-14


def _local(down: mx.array) -> mx.array:
    return down


class MoE:
    def __init__(self, *, ffn_norm: mx.array, router: DenseWeight, bias: mx.array | None,
                 tid2eid: np.ndarray | None, gate_exps: ExpertWeights, up_exps: ExpertWeights,
                 down_exps: ExpertWeights, gate_sh: DenseWeight, up_sh: DenseWeight, down_sh: DenseWeight,
                 n_used: int, weight_scale: float, clamp: float, eps: float, ops: DefaultOps, routing,
                 gather=None):
        self.ffn_norm, self.router, self.bias, self.tid2eid = ffn_norm, router, bias, tid2eid
        self.gate_exps, self.up_exps, self.down_exps = gate_exps, up_exps, down_exps
        self.gate_sh, self.up_sh, self.down_sh = gate_sh, up_sh, down_sh
        self.n_used, self.weight_scale, self.clamp, self.eps = n_used, weight_scale, clamp, eps
        self.ops = ops
        # Where the routed experts' outputs come together before their sum: here (one process), or
        # across ranks (``expert_parallel.RankGather``: each rank computed its own experts' pairs).
        self.gather = _local if gather is None else gather
        # Where the expert ids are chosen (``DeviceRouting`` / ``HostRouting``), and the hash table in
        # the form it reads.
        self.routing = routing
        self.table = None if tid2eid is None else routing.table(tid2eid)

    def _swiglu(self, gate: mx.array, up: mx.array) -> mx.array:
        c = self.clamp
        return self.ops.silu(mx.minimum(gate, c)) * mx.clip(up, -c, c)

    def router_scores(self, xn: mx.array) -> tuple[mx.array, mx.array | None]:
        """(prob = sqrt(softplus(W_router·xn)) [T, n_expert], the selection score prob + bias, or
        None for hash layers, which select by token id)."""
        prob = mx.sqrt(self.ops.softplus(self.ops.linear(self.router, xn)))
        if self.tid2eid is not None:
            return prob, None
        return prob, (prob if self.bias is None else prob + self.bias)

    def select(self, choice: mx.array | None, tokens) -> np.ndarray | mx.array:
        """Selected expert ids int32 [T, k]: tid2eid[token] on hash layers, else the top-k of
        ``choice`` (ds4's insertion top-k with strict '>': ties to the lower id), where the routing
        keeps them (numpy on the host, an MLX array never read back on the device)."""
        return self.routing.select(choice, self.table, tokens, self.n_used)

    def route_weights(self, prob: mx.array, sel) -> mx.array:
        """w_i = prob[sel_i] / max(Σ prob[sel], 2^-14) · scale   [T, k]."""
        w = mx.take_along_axis(prob, sel if isinstance(sel, mx.array) else mx.array(sel), axis=1)
        total = self.ops.small_sum(w, 1, keepdims=True)
        return w / mx.maximum(total, ROUTER_SUM_FLOOR) * self.weight_scale

    def route(self, xn: mx.array, tokens) -> tuple[np.ndarray | mx.array, mx.array]:
        """(selected expert ids int32 [T, k], their weights [T, k])."""
        prob, choice = self.router_scores(xn)
        sel = self.select(choice, tokens)
        return sel, self.route_weights(prob, sel)

    def routed_experts(self, xn: mx.array, sel, w: mx.array) -> mx.array:
        """Per selected expert: down_i·(swiglu(gate_i·xn, up_i·xn)·w_i)   -> [T, k, n_embd]."""
        ops, xe = self.ops, xn[:, None, :]
        mid = self._swiglu(ops.experts(self.gate_exps, xe, sel), ops.experts(self.up_exps, xe, sel))
        return ops.experts(self.down_exps, mid * w[:, :, None], sel)

    def shared_expert(self, xn: mx.array) -> mx.array:
        ops = self.ops
        return ops.linear(self.down_sh, self._swiglu(ops.linear(self.gate_sh, xn), ops.linear(self.up_sh, xn)))

    def combine(self, down: mx.array, shared: mx.array) -> mx.array:
        """Σ_i down[:, i] + shared (``gather``: the pairs computed on other ranks joined first)."""
        return self.ops.small_sum(self.gather(down), 1) + shared

    def __call__(self, x: mx.array, tokens) -> mx.array:
        """x [T, n_embd] (HC-reduced), tokens [T] (this position's input ids; numpy, or an MLX array
        with device experts) -> f [T, n_embd]."""
        xn = self.ops.rms_norm(x, self.ffn_norm, self.eps)
        sel, w = self.route(xn, tokens)
        down = self.routed_experts(xn, sel, w)  # [T, k, n_embd]
        return self.combine(down, self.shared_expert(xn))
