"""GGML block dequantizers and ds4.c's activation quantizers written with MLX ops.

These are bit-exact twins of the numpy versions in ``ds4_mlx.formats.quants`` (and so of gguf-py and
ds4.c): the model's CPU path uses them to dequantize only the gathered blocks of the selected experts,
and they specify what the Metal kernels must compute.

Speed notes (MLX CPU, measured): element-wise chains run fused under ``mx.compile``, but a compiled kernel
that broadcasts per-element ``mx.where`` selects is slow, and ``mx.take`` costs several ns per index. So the
bit fields are unpacked SWAR-style (one shift-and-mask of a uint32 word extracts a field of 4 bytes), IQ2_XXS
gathers one uint64 of 8 signed grid values per group of 8, and the per-element work is a convert and a
multiply. Outputs of 32 MiB or more are fresh mmaps under glibc's default malloc (MLX's CPU allocator keeps
no cache), and faulting their pages in can cost more than the dequantization itself.

Exactness rule: a fused kernel may contract ``a * b - c`` into one fused multiply-add, which rounds once
instead of twice. So no compiled function here ever feeds a float product into an addition; the two
places where the reference does ``scale * q - offset`` (Q2_K, Q4_K) run the product and the subtraction as
separate MLX operations. (With f16 scales and small integer factors those products are exact anyway, so a
contraction could only change NaN payloads; keeping them apart costs little. Do not wrap these functions in
your own ``mx.compile``.) Bit-exactness is tested on the CPU backend; on a GPU backend divisions,
conversions and ``argmax`` tie-breaking must be re-verified.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from ds4_mlx.errors import QuantError
from ds4_mlx.formats.ggml_types import BLOCK_GEOMETRY, GGMLType
from ds4_mlx.formats.quants import (
    QK8_0,
    QK_K,
    SIGNED_GRID_WORDS,
    check_data_size,
    check_row_bytes,
    supported_qtype,
)

__all__ = [
    "dequantize_mlx",
    "dequantize_rows_mlx",
    "dequant_f16_mlx",
    "dequant_q8_0_mlx",
    "dequant_q2_k_mlx",
    "dequant_q4_k_mlx",
    "dequant_iq2_xxs_mlx",
    "mxfp4_fields_mlx",
    "quantize_q8_0_activation_mlx",
    "quantize_q8_k_activation_mlx",
]


_SIGNED_GRID_WORDS = mx.array(SIGNED_GRID_WORDS)
_SIGN_SHIFTS = mx.array([0, 7, 14, 21], dtype=mx.uint32)
_SHIFTS_2BIT = mx.array([0, 2, 4, 6], dtype=mx.uint32).reshape(4, 1)
_SHIFTS_4BIT = mx.array([0, 4], dtype=mx.uint32).reshape(2, 1)


# --------------------------------------------------------------------------------------------------
# helpers


def _f16(lo: mx.array, hi: mx.array) -> mx.array:
    """Little-endian half (two uint8 arrays) -> float32 by the hardware conversion.

    That conversion quiets signalling NaNs; callers only use it for scales that are then multiplied, and the
    multiplication quiets them in the numpy reference too, so results agree bit for bit.
    """
    bits = lo.astype(mx.uint16) | (hi.astype(mx.uint16) << 8)
    return mx.view(bits, mx.float16).astype(mx.float32)


def _as_u8(raw: Any) -> mx.array:
    if not isinstance(raw, mx.array):
        raise QuantError(f"expected an MLX array, got {type(raw).__name__}")
    if raw.ndim == 0:
        raise QuantError("quantized rows must have at least one axis (the row bytes)")
    return raw if raw.dtype == mx.uint8 else mx.view(raw, mx.uint8)


def _words32(block_bytes: mx.array) -> mx.array:
    """Packed quant bytes (..., k) -> uint32 (..., k/4), byte i of a word = element i of a run of 4."""
    return mx.view(mx.contiguous(block_bytes), mx.uint32)


@mx.compile
def _unpack_fields(words: mx.array, shifts: mx.array, mask: mx.array) -> mx.array:
    # SWAR: one shift-and-mask of a 32-bit word extracts the same bit field of 4 bytes at once
    return (words >> shifts) & mask


@mx.compile
def _scale_u8(q: mx.array, scale: mx.array) -> mx.array:
    return q.astype(mx.float32) * scale


@mx.compile
def _scale_i8(q: mx.array, scale: mx.array) -> mx.array:
    return q.astype(mx.int8).astype(mx.float32) * scale


# --------------------------------------------------------------------------------------------------
# per-format row dequantizers: uint8 (R, row_bytes) -> float32 (R, cols)


@mx.compile
def _f16_kernel(h: mx.array) -> mx.array:
    hw = mx.view(mx.view(h, mx.float16).astype(mx.float32), mx.uint32)
    # numpy keeps a signalling NaN's quiet bit clear; the hardware conversion sets it (bit 22): undo that
    h32 = h.astype(mx.uint32)
    snan = ((h32 & 0x7C00) == 0x7C00) & ((h32 & 0x03FF) != 0) & ((h32 & 0x0200) == 0)
    return mx.view(hw & ~(snan.astype(mx.uint32) << 22), mx.float32)


def dequant_f16_mlx(raw: mx.array) -> mx.array:
    """F16 rows: uint8 (R, 2*cols) -> float32 (R, cols), NaN payloads kept."""
    return _f16_kernel(mx.view(mx.contiguous(raw), mx.uint16))


def _bf16_rows(raw: mx.array) -> mx.array:
    bits = mx.view(mx.contiguous(raw), mx.uint16).astype(mx.uint32) << 16
    return mx.view(bits, mx.float32)


def _f32_rows(raw: mx.array) -> mx.array:
    return mx.view(mx.contiguous(raw), mx.float32)


def _i32_rows(raw: mx.array) -> mx.array:
    return mx.view(mx.contiguous(raw), mx.int32)


def dequant_q8_0_mlx(raw: mx.array) -> mx.array:
    """Q8_0 rows: ``x = q * d`` per block of 32."""
    R = raw.shape[0]
    r = raw.reshape(R, -1, 34)
    d = _f16(r[..., 0], r[..., 1])[..., None]
    return _scale_i8(r[..., 2:], d).reshape(R, -1)


def dequant_q2_k_mlx(raw: mx.array) -> mx.array:
    """Q2_K rows: ``x = (d * (sc & 15)) * q - dmin * (sc >> 4)`` per sub-block of 16.

    The product is one compiled kernel, the subtraction a separate op: two roundings, as the reference.
    """
    R = raw.shape[0]
    r = raw.reshape(R, -1, 84)
    nb = r.shape[1]
    sc = r[..., 0:16]
    d = _f16(r[..., 80], r[..., 81])[..., None]
    dmin = _f16(r[..., 82], r[..., 83])[..., None]
    # sub-block 8h + 2j + s covers elements 128h + 32j + 16s + i, stored in bits 2j of qs[32h + 16s + i]
    dl = (d * (sc & 0x0F).astype(mx.float32)).reshape(R, nb, 2, 4, 2, 1)
    ml = (dmin * (sc >> 4).astype(mx.float32)).reshape(R, nb, 2, 4, 2, 1)
    words = _words32(r[..., 16:80]).reshape(R, nb, 2, 1, 8)
    q = mx.view(_unpack_fields(words, _SHIFTS_2BIT, mx.array(0x03030303, mx.uint32)), mx.uint8)
    prod = _scale_u8(q.reshape(R, nb, 2, 4, 2, 16), dl)
    return (prod - ml).reshape(R, -1)


@mx.compile
def _q4_k_scales(sc: mx.array) -> tuple[mx.array, mx.array]:
    lo, mid, hi = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scale = mx.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    mins = mx.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return scale, mins


def dequant_q4_k_mlx(raw: mx.array) -> mx.array:
    """Q4_K rows: ``x = (d * sc_b) * q - dmin * m_b`` per sub-block of 32 (6-bit packed scales/mins)."""
    R = raw.shape[0]
    r = raw.reshape(R, -1, 144)
    nb = r.shape[1]
    d = _f16(r[..., 0], r[..., 1])[..., None]
    dmin = _f16(r[..., 2], r[..., 3])[..., None]
    scale, mins = _q4_k_scales(r[..., 4:16])
    # sub-block b = 2p + n: nibble n (low, high) of qs[32p : 32p + 32]
    ds = (d * scale.astype(mx.float32)).reshape(R, nb, 4, 2, 1)
    dm = (dmin * mins.astype(mx.float32)).reshape(R, nb, 4, 2, 1)
    words = _words32(r[..., 16:144]).reshape(R, nb, 4, 1, 8)
    q = mx.view(_unpack_fields(words, _SHIFTS_4BIT, mx.array(0x0F0F0F0F, mx.uint32)), mx.uint8)
    prod = _scale_u8(q.reshape(R, nb, 4, 2, 32), ds)
    return (prod - dm).reshape(R, -1)


@mx.compile
def _iq2_xxs_prelude(r: mx.array, sign_shifts: mx.array) -> tuple[mx.array, mx.array]:
    R, nb = r.shape[0], r.shape[1]
    d = _f16(r[..., 0], r[..., 1])
    g = r[..., 2:].reshape(R, nb, 8, 8)
    w = (
        g[..., 4].astype(mx.uint32)
        | (g[..., 5].astype(mx.uint32) << 8)
        | (g[..., 6].astype(mx.uint32) << 16)
        | (g[..., 7].astype(mx.uint32) << 24)
    )
    # (d * (0.5 + s)) * 0.25 as the reference; no product feeds an addition
    db = d[..., None] * (0.5 + (w >> 28).astype(mx.float32)) * 0.25
    sign_index = (w[..., None] >> sign_shifts) & 127  # (R, nb, 8, 4)
    row = (g[..., 0:4].astype(mx.uint32) << 7) | sign_index
    return db, row


def dequant_iq2_xxs_mlx(raw: mx.array) -> mx.array:
    """IQ2_XXS rows: ``x = (d * (0.5 + s) * 0.25) * grid * sign`` per group of 32 (8 groups per block).

    One gather per 8 outputs fetches the signed grid values as a uint64; ``db * (-g) == -(db * g)`` exactly,
    so folding the sign into the table keeps the reference's ``(db * g) * sign`` bit for bit.
    """
    R = raw.shape[0]
    r = raw.reshape(R, -1, 66)
    nb = r.shape[1]
    db, row = _iq2_xxs_prelude(r, _SIGN_SHIFTS)
    words = mx.take(_SIGNED_GRID_WORDS, row.reshape(-1))
    vals = mx.view(words, mx.int8).reshape(R, nb, 8, 32)
    return _scale_i8(vals, db[..., None]).reshape(R, -1)


@mx.compile
def _mxfp4_kernel(e: mx.array, codes: mx.array) -> mx.array:
    e32 = e.astype(mx.uint32)
    # ggml's e8m0 "half": 2**(e-128); e < 2 lands in the float32 subnormals
    dbits = mx.where(e32 < 2, mx.array(0x00200000, mx.uint32) << e32, (e32 - 1) << 23)
    d = mx.view(dbits, mx.float32)
    c = codes.astype(mx.uint32)
    # doubled e2m1 magnitudes 0,1,2,3,4,6,8,12 as nibbles of one constant; bit 3 of the code is the sign
    mag = ((mx.array(0xC8643210, mx.uint32) >> ((c & 7) << 2)) & 15).astype(mx.int32)
    neg = (c >> 3).astype(mx.int32)
    val = (mag ^ -neg) + neg
    return val.astype(mx.float32) * d


def mxfp4_fields_mlx(raw: mx.array) -> tuple[mx.array, mx.array]:
    """MXFP4 rows uint8 [R, row_bytes] -> (E8M0 scale bytes [R, nb, 1, 1], codes uint8 [R, nb, 2, 16]):
    code [b, h, j] is element 16 h + j of block b (the low nibbles are elements 0..15, the high 16..31).
    Shared with the model's ds4-valued decoder (``ds4_mlx.model.mxfp4``)."""
    R = raw.shape[0]
    r = raw.reshape(R, -1, 17)
    nb = r.shape[1]
    e = r[..., 0].reshape(R, nb, 1, 1)
    words = _words32(r[..., 1:17]).reshape(R, nb, 1, 4)
    codes = mx.view(_unpack_fields(words, _SHIFTS_4BIT, mx.array(0x0F0F0F0F, mx.uint32)), mx.uint8)
    return e, codes.reshape(R, nb, 2, 16)


def _mxfp4_rows(raw: mx.array) -> mx.array:
    e, codes = mxfp4_fields_mlx(raw)
    return _mxfp4_kernel(e, codes).reshape(raw.shape[0], -1)


_ROW_DEQUANT = {
    GGMLType.F32: _f32_rows,
    GGMLType.F16: dequant_f16_mlx,
    GGMLType.BF16: _bf16_rows,
    GGMLType.I32: _i32_rows,
    GGMLType.Q8_0: dequant_q8_0_mlx,
    GGMLType.Q2_K: dequant_q2_k_mlx,
    GGMLType.Q4_K: dequant_q4_k_mlx,
    GGMLType.IQ2_XXS: dequant_iq2_xxs_mlx,
    GGMLType.MXFP4: _mxfp4_rows,
}


def dequantize_rows_mlx(raw: Any, qtype: "int | str | GGMLType") -> mx.array:
    """MLX twin of ``dequantize_rows``: uint8 (..., row_bytes) -> float32 (..., cols) (int32 for I32)."""
    qt = supported_qtype(qtype)
    rows = _as_u8(raw)
    cols = check_row_bytes(qt, rows.shape[-1])
    lead = rows.shape[:-1]
    n_rows = int(np.prod(lead, dtype=np.int64))
    if n_rows == 0 or cols == 0:
        return mx.zeros((*lead, cols), dtype=mx.int32 if qt == GGMLType.I32 else mx.float32)
    out = _ROW_DEQUANT[qt](rows.reshape(n_rows, rows.shape[-1]))
    return out.reshape(*lead, cols)


def dequantize_mlx(data: Any, qtype: "int | str | GGMLType", n_elements: int) -> mx.array:
    """MLX twin of ``dequantize``: any-shaped uint8 array holding exactly ``n_elements`` -> 1-D."""
    qt = supported_qtype(qtype)
    flat = _as_u8(data).reshape(-1)
    check_data_size(qt, n_elements, flat.size)
    elems, block_bytes = BLOCK_GEOMETRY[qt]
    n_blocks = int(n_elements) // elems
    if n_blocks == 0:
        return mx.zeros((0,), dtype=mx.int32 if qt == GGMLType.I32 else mx.float32)
    # one row per 256 blocks keeps the compiled kernels' shapes few and the rows moderate
    per_row = 1
    for cand in (256, 64, 16, 4, 1):
        if n_blocks % cand == 0:
            per_row = cand
            break
    rows = flat.reshape(n_blocks // per_row, per_row * block_bytes)
    return _ROW_DEQUANT[qt](rows).reshape(-1)


# --------------------------------------------------------------------------------------------------
# ds4.c activation quantizers


def _lrintf_clamped(v: mx.array) -> mx.array:
    # mx.round rounds half to even like lrintf; non-finite lanes -> 0 as in the numpy twin
    r = mx.round(v)
    r = mx.where(mx.isnan(r) | mx.isinf(r), 0.0, r)
    return mx.clip(r, -128, 127).astype(mx.int8)


def _abs_ignoring_nan(x: mx.array) -> mx.array:
    ax = mx.abs(x)
    return mx.where(mx.isnan(ax), 0.0, ax)


@mx.compile
def _q8_0_act_kernel(blocks: mx.array) -> tuple[mx.array, mx.array]:
    amax = mx.max(_abs_ignoring_nan(blocks), axis=-1)
    d = amax / 127.0
    inv = mx.where(d != 0, 1.0 / d, 0.0)
    q = _lrintf_clamped(blocks * inv[..., None])
    return q, d


def quantize_q8_0_activation_mlx(x: mx.array) -> tuple[mx.array, mx.array]:
    """MLX twin of ``quantize_q8_0_activation``: (q int8 [..., n], d float32 [..., ceil(n/32)])."""
    x = x.astype(mx.float32)
    if x.ndim == 0:
        raise QuantError("Q8_0 activation: input must have at least one axis")
    lead, n = x.shape[:-1], x.shape[-1]
    nb = -(-n // QK8_0)
    if nb == 0:
        return mx.zeros((*lead, 0), mx.int8), mx.zeros((*lead, 0), mx.float32)
    pad = nb * QK8_0 - n
    if pad:
        x = mx.concatenate([x, mx.zeros((*lead, pad), mx.float32)], axis=-1)
    q, d = _q8_0_act_kernel(x.reshape(*lead, nb, QK8_0))
    return q.reshape(*lead, nb * QK8_0)[..., :n], d


@mx.compile
def _q8_k_act_kernel(blocks: mx.array) -> tuple[mx.array, mx.array]:
    ax = _abs_ignoring_nan(blocks)
    first = mx.argmax(ax, axis=-1, keepdims=True)  # first maximal index, like the strict > scan
    amax = mx.take_along_axis(ax, first, axis=-1)[..., 0]
    vmax = mx.take_along_axis(blocks, first, axis=-1)[..., 0]
    zero = amax == 0
    iscale = -127.0 / mx.where(zero, 1.0, vmax)
    q = _lrintf_clamped(blocks * iscale[..., None])
    q = mx.where(zero[..., None], mx.array(0, mx.int8), q)
    d = mx.where(zero, 0.0, 1.0 / iscale)
    return q, d


def quantize_q8_k_activation_mlx(x: mx.array) -> tuple[mx.array, mx.array]:
    """MLX twin of ``quantize_q8_k_activation``: (q int8 [..., n], d float32 [..., n/256])."""
    x = x.astype(mx.float32)
    if x.ndim == 0 or x.shape[-1] % QK_K:
        n = x.shape[-1] if x.ndim else 0
        raise QuantError(f"Q8_K activation: row length {n} is not a multiple of the block size {QK_K}")
    lead, n = x.shape[:-1], x.shape[-1]
    if n == 0:
        return mx.zeros((*lead, 0), mx.int8), mx.zeros((*lead, 0), mx.float32)
    q, d = _q8_k_act_kernel(x.reshape(*lead, n // QK_K, QK_K))
    return q.reshape(*lead, n), d
