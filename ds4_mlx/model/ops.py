"""The two numerics modes of the forward pass, bound once at load: every difference between
``default`` and ``ds4-cpu`` arithmetic lives in this file.

The architecture code (attention, compressor, indexer, hyper-connections, MoE, the stack) is written
once against an ``Ops`` object it receives at construction and never asks which mode it runs in:

    DefaultOps   MLX's fused kernels: ``mx.fast.rms_norm``, ``mx.exp``, ``mx.sigmoid``, reductions with
                 ``mx.sum`` and matmuls; matmuls over dequantized weights (the fast path). Compilable.
    Ds4CpuOps    ds4.c's CPU reference arithmetic (its portable, non-NEON branch), so per-layer
                 comparison with the oracle is exact: Q8-quantized activations with integer block sums
                 (``linear``/``experts``), RMSNorm's Σx² in float64, glibc's expf step by step, ds4's
                 sigmoid formulas, the C library's cosf/sinf, and every sum ds4 writes as a loop in its
                 order. It runs on the CPU stream and is never passed through ``mx.compile`` (a fused
                 kernel may contract ``a * b + c`` into an FMA and change the last bit).

The bit-level helpers both modes share (FP8/FP4 rounding, Hadamard, glibc's expf, ordered sums) are in
``numerics``; how a GGUF matrix is multiplied in each mode is in ``linear`` / ``experts`` (selected here).
"""

from __future__ import annotations

import contextlib
from enum import Enum

import mlx.core as mx
import numpy as np

from ds4_mlx.errors import InferenceError
from ds4_mlx.model.numerics import expf_glibc, ordered_sum, sequential_sum

NEG_INF = float("-inf")

# Upper bound on the elements of one temporary in the ds4-cpu matmuls (float32: 32 MiB). Work is split
# into token (or expert-pair) chunks below it so an 800-token prefill never builds GiB-sized block sums.
DS4_CHUNK_ELEMENTS = 1 << 23


class Numerics(str, Enum):
    """Which arithmetic the model uses (chosen at load; ``ops_for`` gives its ``Ops``)."""

    DEFAULT = "default"  # float activations x dequantized weights (the fast path)
    DS4_CPU = "ds4-cpu"  # ds4.c's CPU reference arithmetic (quantized activations, integer block sums)


def as_numerics(numerics: "Numerics | str") -> Numerics:
    return numerics if isinstance(numerics, Numerics) else Numerics(numerics)


def chunks(n: int, step: int):
    """(a, b) bounds of consecutive pieces of at most ``step`` out of ``n``."""
    step = max(1, step)
    for a in range(0, n, step):
        yield a, min(n, a + step)


class DefaultOps:
    """MLX's fast arithmetic (see the module docstring)."""

    numerics = Numerics.DEFAULT
    compilable = True  # mx.compile may fuse these ops
    shares_raw_keys = True  # a query block shares one raw-key span (masked per query)
    libm_trig = False  # correctly rounded cos/sin of the float32 RoPE angles

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def stream(self):
        """The context the forward pass runs in (the default device here)."""
        return contextlib.nullcontext()

    def check_compilable(self) -> None:
        """Raise unless a decode step in these numerics may be ``mx.compile``d (the compiled decoder's
        guard: ds4-cpu's reference arithmetic reads to the host and is never compiled)."""
        if not self.compilable:
            raise InferenceError(f"the compiled decode step exists for DEFAULT numerics only "
                                 f"({self.numerics.value} runs its reference arithmetic uncompiled)")

    # -- matmuls -----------------------------------------------------------------------------------

    def linear(self, w, x: mx.array) -> mx.array:
        """``DenseWeight`` w applied to x [..., in] -> [..., out]."""
        return w(x)

    def grouped_linear(self, w, x: mx.array) -> mx.array:
        """``DenseWeight`` w's rows in G groups, group g applied to x[:, g]: x [L, G, in] -> [L, out]."""
        return w.grouped(x)

    def experts(self, e, x: mx.array, ids) -> mx.array:
        """``ExpertWeights`` e on x [T, k|1, in] for expert ids [T, k] -> [T, k, out]."""
        return e(x, ids)

    # -- elementwise -------------------------------------------------------------------------------

    def rms_norm(self, x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
        """x · (mean(x²) + eps)^-1/2 (· weight) over the last axis."""
        return mx.fast.rms_norm(x, weight, eps)

    def exp(self, x: mx.array) -> mx.array:
        """e^x of float32 x (MLX's, ~1e-6 relative)."""
        return mx.exp(x)

    def log1p(self, x: mx.array) -> mx.array:
        """log(1+x). MLX's CPU float32 log1p is the C library's log1pf, which is what ds4 calls
        (glibc's is not correctly rounded, and the oracle's router weights show it): both modes."""
        return mx.log1p(x)

    def sigmoid_expf(self, z: mx.array) -> mx.array:
        """1/(1+e^-z) as ds4's hyper-connection split writes it."""
        return mx.sigmoid(z)

    def sigmoid_stable(self, z: mx.array) -> mx.array:
        """ds4's two-branch sigmoid (used by SiLU and the output HC)."""
        return mx.sigmoid(z)

    def post_gain(self, z: mx.array) -> mx.array:
        """The hyper-connection post gains 2·σ(z)."""
        return 2.0 * mx.sigmoid(z)

    def silu(self, x: mx.array) -> mx.array:
        return x * self.sigmoid_stable(x)

    def softplus(self, x: mx.array) -> mx.array:
        """ds4's softplus_stable: identity above 20, exp below -20, log1p(exp) between."""
        e = self.exp(mx.minimum(x, 20.0))
        return mx.where(x > 20.0, x, mx.where(x < -20.0, e, self.log1p(e)))

    # -- reductions --------------------------------------------------------------------------------

    def small_sum(self, x: mx.array, axis: int, keepdims: bool = False) -> mx.array:
        """Σ over a short axis (hyper-connection streams, Sinkhorn rows/columns, router weights,
        routed-expert outputs)."""
        return mx.sum(x, axis=axis, keepdims=keepdims)

    def weighted_streams(self, H: mx.array, w: mx.array) -> mx.array:
        """Σ_s w[:, s]·H[:, s]  ([T, n_hc, D], [T, n_hc] -> [T, D])."""
        return mx.sum(H * w[:, :, None], axis=1)

    def hc_post(self, f: mx.array, H: mx.array, post: mx.array, comb: mx.array) -> mx.array:
        """H'[d] = post[d]·f + Σ_s C[s][d]·H[s]   (f [T, D]) -> [T, n, D]."""
        return post[:, :, None] * f[:, None, :] + mx.matmul(comb.transpose(0, 2, 1), H)

    def pool(self, k: mx.array, g: mx.array, ratio: int) -> mx.array:
        """Compressor pooling: per-dimension softmax over the slot axis, [N, S, D] -> [N, D]."""
        m = mx.max(g, axis=1, keepdims=True)
        w = self.exp(g - m)  # empty slots (score -1e30) weigh exactly 0
        # Emitted windows always hold real slots, so the max is finite and the denominator > 0.
        return mx.sum(w * k, axis=1) / mx.sum(w, axis=1)

    def indexer_scores(self, qi: mx.array, wi: mx.array, rows: mx.array) -> mx.array:
        """score[t, c] = Σ_h relu(qi[t,h]·rows[c])·wi[t,h]   -> [T, Nc]."""
        dots = mx.maximum(mx.matmul(qi, rows.T), 0.0)  # [T, n_ih, Nc]
        return mx.sum(dots * wi[:, :, None], axis=1)

    # -- attention ---------------------------------------------------------------------------------

    def product_width(self, d: int) -> int:
        """Floats a score of d-wide vectors materialises (memory bound of a query block)."""
        return 1

    def raw_window(self, raw: mx.array, raw_base: int, pb: np.ndarray,
                   n_swa: int) -> tuple[mx.array, np.ndarray]:
        """Raw keys for queries at positions ``pb`` (raw[0] at ``raw_base``) and their masks.
        Here: the span [pb[0]-n_swa+1, pb[-1]] shared by the block ([K, D]), masked per query."""
        k_lo = max(raw_base, int(pb[0]) - n_swa + 1)
        k_hi = int(pb[-1]) + 1
        kp = np.arange(k_lo, k_hi)
        keys = raw[k_lo - raw_base: k_hi - raw_base]
        return keys, (kp[None, :] <= pb[:, None]) & (kp[None, :] > pb[:, None] - n_swa)

    def sink_softmax(self, q: mx.array, key_sets: list, sinks: mx.array, kq_scale: float) -> mx.array:
        """One sink softmax over all key sets with matmuls. q [n, H, D]; keys [K, D] shared by the
        block's queries or [n, K, D] per query; masks [n, K] (numpy, or MLX inside a compiled step).
        out_h = Σ_j e^(s_j - m) key_j / (e^(sink_h - m) + Σ_j e^(s_j - m)),  s_j = q_h·key_j·kq_scale."""
        n, H, D = q.shape
        sink = sinks.reshape(1, H, 1)
        qflat = q.reshape(n * H, D)
        scores = []
        for keys, mask in key_sets:
            if keys.ndim == 2:
                s = (qflat @ keys.T).reshape(n, H, -1)
            else:
                s = mx.matmul(q, keys.transpose(0, 2, 1))
            mask = mask if isinstance(mask, mx.array) else mx.array(mask)
            scores.append(mx.where(mask[:, None, :], s * kq_scale, NEG_INF))
        m = sink
        for s in scores:
            m = mx.maximum(m, mx.max(s, axis=-1, keepdims=True))
        denom = mx.exp(sink - m)
        acc = None
        for s, (keys, _) in zip(scores, key_sets):
            e = mx.exp(s - m)
            denom = denom + mx.sum(e, axis=-1, keepdims=True)
            o = (e.reshape(n * H, -1) @ keys).reshape(n, H, D) if keys.ndim == 2 else mx.matmul(e, keys)
            acc = o if acc is None else acc + o
        return acc * (1.0 / denom)

    # -- RoPE --------------------------------------------------------------------------------------

    def rope_tables(self, rope, positions: np.ndarray, inverse: bool = False) -> tuple[mx.array, mx.array]:
        """(cos, sin) [len(positions), n_rot/2] of ``rope`` (a ``Rope``)."""
        return rope.tables(positions, inverse=inverse, libm=self.libm_trig)


class Ds4CpuOps(DefaultOps):
    """ds4.c's CPU reference arithmetic (see the module docstring); every override says which of
    ds4's loops it reproduces."""

    numerics = Numerics.DS4_CPU
    compilable = False
    shares_raw_keys = False  # each query gathers its own window, oldest first
    libm_trig = True  # the C library's cosf/sinf, as ds4 calls them

    def stream(self):
        # float64 steps; the reference arithmetic is a CPU one anyway
        return mx.stream(mx.cpu)

    def linear(self, w, x: mx.array) -> mx.array:
        return w.ds4_cpu(x)  # Q8-quantized activations, integer block sums (``linear``)

    def grouped_linear(self, w, x: mx.array) -> mx.array:
        # ds4 multiplies each group's rows on its own (its Q8 activation blocks lie within a group)
        return mx.concatenate([g.ds4_cpu(x[:, i]) for i, g in enumerate(w.groups(x.shape[1]))], axis=-1)

    def experts(self, e, x: mx.array, ids) -> mx.array:
        return e.ds4_cpu(x, ids)  # Q8_K-quantized activations, integer super-block sums (``experts``)

    def rms_norm(self, x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
        # ds4: Σx² in double, mean rounded to float, then 1/sqrtf(mean + eps) and (x·scale)·w.
        ss = mx.sum(mx.square(x.astype(mx.float64)), axis=-1, keepdims=True)
        mean = (ss / x.shape[-1]).astype(mx.float32)
        scale = 1.0 / mx.sqrt(mean + eps)
        y = x * scale
        return y if weight is None else y * weight

    def exp(self, x: mx.array) -> mx.array:
        return expf_glibc(x)  # glibc's expf bit for bit (ds4's oracle ran on glibc)

    def sigmoid_expf(self, z: mx.array) -> mx.array:
        return 1.0 / (1.0 + self.exp(-z))

    def sigmoid_stable(self, z: mx.array) -> mx.array:
        e = self.exp(-mx.abs(z))
        return mx.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))

    def post_gain(self, z: mx.array) -> mx.array:
        return 2.0 / (1.0 + self.exp(-z))  # ds4's formula: one rounding fewer than 2·σ(z)

    def small_sum(self, x: mx.array, axis: int, keepdims: bool = False) -> mx.array:
        # ((x0 + x1) + x2) + …: ds4's loop order
        axis = axis % x.ndim
        n = x.shape[axis]
        parts = [x[(slice(None),) * axis + (slice(i, i + 1),)] for i in range(n)]
        out = ordered_sum(parts)
        return out if keepdims else out.squeeze(axis)

    def weighted_streams(self, H: mx.array, w: mx.array) -> mx.array:
        return ordered_sum([H[:, s] * w[:, s: s + 1] for s in range(H.shape[1])])

    def hc_post(self, f: mx.array, H: mx.array, post: mx.array, comb: mx.array) -> mx.array:
        n = H.shape[1]
        out = [ordered_sum([f * post[:, d: d + 1]] + [comb[:, s, d: d + 1] * H[:, s] for s in range(n)])
               for d in range(n)]
        return mx.stack(out, axis=1)

    def pool(self, k: mx.array, g: mx.array, ratio: int) -> mx.array:
        m = mx.max(g, axis=1, keepdims=True)
        w = self.exp(g - m)
        # ds4's loop order; ratio 4 adds (w_prev + w_cur) per r into the denominator and the two
        # products in turn into the numerator (slots are interleaved prev, cur, prev, …).
        pairs = w[:, 0::2] + w[:, 1::2] if ratio == 4 else w
        return sequential_sum(w * k, axis=1) / sequential_sum(pairs, axis=1)

    def indexer_scores(self, qi: mx.array, wi: mx.array, rows: mx.array) -> mx.array:
        # Left-to-right float32 dots, then the heads added in order, as ds4's scoring loop.
        dots = mx.maximum(sequential_sum(qi[:, :, :, None] * rows.T[None, None], axis=2), 0.0)
        return ordered_sum([dots[:, h] * wi[:, h: h + 1] for h in range(qi.shape[1])])

    def product_width(self, d: int) -> int:
        # per-(query, head, key) products of width d are materialised to be summed in ds4's order
        return d

    def raw_window(self, raw: mx.array, raw_base: int, pb: np.ndarray,
                   n_swa: int) -> tuple[mx.array, np.ndarray]:
        # Each query's own window, oldest first (positions before 0 masked): [n, n_swa, D].
        kp = pb[:, None] - n_swa + 1 + np.arange(n_swa)[None, :]
        idx = np.maximum(kp - raw_base, 0)
        keys = mx.take(raw, mx.array(idx.reshape(-1)), axis=0).reshape(len(pb), n_swa, raw.shape[-1])
        return keys, kp >= raw_base

    def sink_softmax(self, q: mx.array, key_sets: list, sinks: mx.array, kq_scale: float) -> mx.array:
        """The same softmax in ds4's CPU order: each score a left-to-right float32 dot, then
        denominator (sink first) and output accumulated key by key (raw rows, then compressed rows
        in index order); masked keys weigh exactly 0 and leave both sums unchanged."""
        n, H, D = q.shape
        sink = sinks.reshape(1, H, 1)
        scores, keys4 = [], []
        for keys, mask in key_sets:
            k4 = keys[None, None] if keys.ndim == 2 else keys[:, None]  # [1|n, 1, K, D]
            # products laid out [n, H, D, K]: the scan over D then runs on contiguous K-vectors
            s = sequential_sum(q[:, :, :, None] * k4.transpose(0, 1, 3, 2), axis=2) * kq_scale
            scores.append(mx.where(mx.array(mask)[:, None, :], s, NEG_INF))
            keys4.append(k4)
        m = sink
        for s in scores:
            m = mx.maximum(m, mx.max(s, axis=-1, keepdims=True))
        w = [self.exp(s - m) for s in scores]
        denom = sequential_sum(mx.concatenate([self.exp(sink - m) * mx.ones((n, 1, 1))] + w, axis=-1))
        terms = mx.concatenate([wi[..., None] * k4 for wi, k4 in zip(w, keys4)], axis=2)  # [n, H, K, D]
        return sequential_sum(terms, axis=2) * (1.0 / denom[..., None])


DEFAULT_OPS = DefaultOps()
DS4_CPU_OPS = Ds4CpuOps()


def ops_for(numerics: "Numerics | str") -> DefaultOps:
    """The ``Ops`` of a numerics mode (ValueError for an unknown name)."""
    return DS4_CPU_OPS if as_numerics(numerics) is Numerics.DS4_CPU else DEFAULT_OPS
