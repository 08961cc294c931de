"""Elementwise numerics of DS4 Flash that are part of the model, not of the matmuls.

The FP8 (E4M3) round trip of KV rows, the FP4 (E2M1) round trip and the Hadamard-128 of the
indexer, fp16 storage rounding, RMSNorm and the small nonlinearities. All of them work on float32
MLX arrays and are exact where ds4 is exact: the low-precision roundings are computed from the
float32 bit pattern (exponent field) and a round-half-to-even on an exactly scaled value, so they
agree bit for bit with ds4's table search, ties included.

Also the exact building blocks of the ds4-cpu mode: glibc's expf evaluated step by step (ds4's
oracle ran on glibc; MLX's own exp is a fast approximation) and sums in a fixed order
(``ordered_sum``, ``sequential_sum``, ``sequential_outer_sum``). Which mode uses what is decided in ``ops`` only; nothing here
takes a mode. log2f comes from MLX's CPU kernel, which calls the C library like ds4 does.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from decimal import Decimal, localcontext

import mlx.core as mx
import numpy as np

# ds4's "empty" compressor score (CPU init); anything at or below half of it counts as empty.
EMPTY_SCORE = -1.0e30
# 1/sqrt(128) as the float32 constant ds4 multiplies after the unnormalised Walsh-Hadamard transform.
HADAMARD_SCALE = 0.08838834764831845
FP8_MAX = 448.0
FP8_AMAX_FLOOR = 1.0e-4
FP4_MAX = 6.0
FP4_AMAX_FLOOR = 7.052966104933725e-38  # keeps amax/6 a normal float32


def f16_round(x: mx.array) -> mx.array:
    """Round to IEEE half (nearest-even) and back: caches hold f16-exact values."""
    return x.astype(mx.float16).astype(mx.float32)


def _exp2_int(e: mx.array) -> mx.array:
    """2**e as float32 for integer-valued e in the normal range, built from the bit pattern (exact)."""
    biased = mx.clip(e.astype(mx.int32) + 127, 1, 254)
    return mx.view(biased << 23, mx.float32)


def _pow2_scale(y: mx.array) -> mx.array:
    """2**ceil(log2f(y)) for y > 0, as ds4 computes the block scales.

    The float32 log2 is the C library's log2f (what MLX's CPU kernel calls), so the rare y just
    above a power of two, where log2f rounds to the integer itself, gets ds4's scale.
    """
    return _exp2_int(mx.ceil(mx.log2(y)))


def _round_to_minifloat(a: mx.array, mant_bits: int, min_exp: int) -> mx.array:
    """Round non-negative float32 ``a`` to a float format with ``mant_bits`` mantissa bits and
    minimum normal exponent ``min_exp`` (subnormals below), nearest with ties to even.

    The quantum at ``a`` is 2**(max(floor(log2 a), min_exp) - mant_bits); dividing by it is exact, so
    mx.round (half to even) on the quotient picks the even code on ties, like ds4's search.
    """
    exp = (mx.view(a, mx.int32) >> 23) - 127  # floor(log2 a) for normal a; -127 for 0 / subnormals
    quantum = _exp2_int(mx.maximum(exp, min_exp) - mant_bits)
    return mx.round(a / quantum) * quantum


def fp8_e4m3_round(x: mx.array, block: int = 64) -> mx.array:
    """FP8 E4M3FN round trip with one power-of-two scale per block of ``block`` along the last axis."""
    lead, n = x.shape[:-1], x.shape[-1]
    xb = x.reshape(*lead, n // block, block)
    amax = mx.maximum(mx.max(mx.abs(xb), axis=-1, keepdims=True), FP8_AMAX_FLOOR)
    scale = _pow2_scale(amax / FP8_MAX)
    v = mx.clip(xb / scale, -FP8_MAX, FP8_MAX)
    r = _round_to_minifloat(mx.abs(v), mant_bits=3, min_exp=-6)
    return (mx.where(v < 0, -r, r) * scale).reshape(x.shape)


def fp8_kv_round(x: mx.array, n_nope: int) -> mx.array:
    """FP8 round trip of the non-rotary dims of KV rows (the rotary tail stays float)."""
    return mx.concatenate([fp8_e4m3_round(x[..., :n_nope]), x[..., n_nope:]], axis=-1)


def fp4_e2m1_round(x: mx.array, block: int = 32) -> mx.array:
    """FP4 E2M1 round trip (values 0, .5, 1, 1.5, 2, 3, 4, 6) with a power-of-two scale per block."""
    lead, n = x.shape[:-1], x.shape[-1]
    xb = x.reshape(*lead, n // block, block)
    amax = mx.maximum(mx.max(mx.abs(xb), axis=-1, keepdims=True), FP4_AMAX_FLOOR)
    scale = _pow2_scale(amax / FP4_MAX)
    v = mx.clip(xb / scale, -FP4_MAX, FP4_MAX)
    r = _round_to_minifloat(mx.abs(v), mant_bits=1, min_exp=0)
    return (mx.where(v < 0, -r, r) * scale).reshape(x.shape)


def hadamard128(x: mx.array) -> mx.array:
    """Walsh-Hadamard transform of the last axis (128), natural order, then × 1/sqrt(128).

    Each butterfly stage forms (a+b, a-b) from the same operands as ds4's in-place loops, so the
    float32 result is identical.
    """
    lead = x.shape[:-1]
    h = 1
    while h < 128:
        y = x.reshape(*lead, 128 // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = mx.stack([a + b, a - b], axis=-2).reshape(*lead, 128)
        h *= 2
    return x * HADAMARD_SCALE


def indexer_qat(x: mx.array) -> mx.array:
    """The indexer's quantisation-aware rounding of 128-wide rows: Hadamard, then FP4."""
    return fp4_e2m1_round(hadamard128(x))


# glibc's expf (2.27+, the algorithm of ARM's optimized-routines): e^x = 2^(k/32) · 2^(r/32) with a
# 32-entry table and a cubic, all in double, rounded to float once. ds4's oracle ran on glibc, and
# its softmax / pooling / sigmoid weights depend on the last bit of every expf, so DS4_CPU
# evaluates the same double-precision steps (MLX's float64 add/mul round like C's).
_EXPF_N = 32
_EXPF_INVLN2N = float.fromhex("0x1.71547652b82fep+0") * _EXPF_N
_EXPF_SHIFT = float.fromhex("0x1.8p+52")
_EXPF_C0 = float.fromhex("0x1.c6af84b912394p-5") / _EXPF_N ** 3
_EXPF_C1 = float.fromhex("0x1.ebfce50fac4f3p-3") / _EXPF_N ** 2
_EXPF_C2 = float.fromhex("0x1.62e42ff0c52d6p-1") / _EXPF_N
_EXPF_OVERFLOW = float.fromhex("0x1.62e42ep6")  # above: +inf
_EXPF_UNDERFLOW = -float.fromhex("0x1.9fe368p6")  # below: +0


def _expf_table() -> np.ndarray:
    """bits(2^(i/32)) - (i << 47): the table entry to which k << 47 is added to form 2^(k/32)."""
    out = []
    with localcontext() as ctx:
        ctx.prec = 60
        for i in range(_EXPF_N):
            d = float(Decimal(2) ** (Decimal(i) / Decimal(_EXPF_N)))  # correctly rounded double
            out.append(struct.unpack("<Q", struct.pack("<d", d))[0] - (i << 47))
    return np.array(out, dtype=np.uint64)


_EXPF_TAB = mx.array(_expf_table())


def expf_glibc(x: mx.array) -> mx.array:
    """glibc's expf of float32 x, bit for bit (checked against the C library in the tests)."""
    xd = mx.clip(x, -104.0, 89.0).astype(mx.float64)
    z = xd * _EXPF_INVLN2N
    kd = z + _EXPF_SHIFT
    ki = mx.view(kd, mx.uint64)
    kd = kd - _EXPF_SHIFT
    r = z - kd
    t = mx.take(_EXPF_TAB, (ki & 31).astype(mx.uint32)) + (ki << 47)
    scale = mx.view(t, mx.float64)
    y = (r * _EXPF_C0 + _EXPF_C1) * (r * r) + (r * _EXPF_C2 + 1.0)
    y = (y * scale).astype(mx.float32)
    y = mx.where(x > _EXPF_OVERFLOW, mx.inf, y)
    return mx.where(x < _EXPF_UNDERFLOW, 0.0, y)


def sequential_sum(x: mx.array, axis: int = -1) -> mx.array:
    """acc = 0; acc += x[i] for i in order, along ``axis`` (float32 rounding after every add).

    MLX's CPU scan is a left-to-right loop, so the last element of cumsum is exactly that sum; the
    final + 0.0 turns the only other difference, a -0.0 from an all-zero sum, into ds4's +0.0.
    """
    c = mx.cumsum(x, axis=axis)
    return mx.take(c, mx.array([x.shape[axis] - 1]), axis=axis).squeeze(axis) + 0.0


def ordered_sum(parts: Sequence[mx.array]) -> mx.array:
    """((p0 + p1) + p2) + …: a short float32 sum in a fixed order (ds4's loop order)."""
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc


# Below this many outputs (tokens x rows) a step of the loop in ``sequential_outer_sum`` costs more in
# dispatch than in arithmetic, and one cumulative sum over all products is faster.
_LOOP_MIN_OUTPUTS = 4096


def sequential_outer_sum(w_cols: mx.array, x2: mx.array) -> mx.array:
    """``acc = 0; for i: acc += w[:, i] * x[:, i]`` elementwise over [T, out], left to right in i.

    ``w_cols`` is the weight as [in, out]. Either every step is one rounded product and one rounded add on
    a [T, out] slab (ds4's scalar loop run for all rows and tokens at once), or, for few outputs, all
    products are formed and summed by ``cumsum``, which on MLX's CPU is a left-to-right scan (checked in
    the tests); the zero prepended to the scan is ds4's ``acc = 0`` (it turns an all ``-0.0`` sum into
    ``+0.0``, as C does).
    """
    n_in, out_dim = w_cols.shape
    T = x2.shape[0]
    if T * out_dim < _LOOP_MIN_OUTPUTS:
        prods = w_cols.T[None, :, :] * x2[:, None, :]  # [T, out, in]
        zero = mx.zeros((T, out_dim, 1), dtype=w_cols.dtype)
        return mx.cumsum(mx.concatenate([zero, prods], axis=-1), axis=-1)[..., -1]
    xt = mx.contiguous(x2.T)  # [in, T]
    acc = mx.zeros((T, out_dim), dtype=w_cols.dtype)
    for i in range(n_in):
        acc = acc + w_cols[i][None, :] * xt[i][:, None]
        if i % 1024 == 1023:
            mx.eval(acc)  # keeps the lazy graph short
    return acc
