"""GGML quantization block formats in numpy: dequantizers, the Q8_0 weight quantizer, ds4.c's activation
quantizers and reference re-statements of ds4.c's scalar quantized dot products.

Bit-exactness contract
----------------------
* Dequantizers reproduce ``gguf.quants.dequantize`` bit for bit (NaN payloads included) for F32, F16,
  BF16, Q8_0, Q2_K, Q4_K, IQ2_XXS and MXFP4. They evaluate the same float32 operations in the same order
  (e.g. Q2_K is ``(d*sc)*q - dmin*m``: two roundings, never a fused multiply-add); where a table replaces
  arithmetic, the table holds exactly the value the arithmetic would produce.
* ``quantize_q8_0`` reproduces ``gguf.quants.quantize(x, Q8_0)`` (ggml's round-half-away reference).
* ``quantize_q8_0_activation`` / ``quantize_q8_k_activation`` reproduce ds4.c's ``quantize_q8_0_activation``
  and ``ds4_quantize_row_q8_K`` (``lrintf`` = round half to even).
* ``vec_dot_*`` reproduce ds4.c's quantized dot kernels: exact integer sums, then float32 operations in
  ds4's order (documented on each), for its portable C branch (``variant="scalar"``, the default: x86-64)
  or its AArch64 NEON branch (``variant="neon"``: Apple silicon). ds4 has no CPU Q4_K dot product.

Every function works on whole blocks and is vectorized over blocks; bad arguments raise ``QuantError``.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ds4_mlx.errors import QuantError
from ds4_mlx.formats.ggml_types import BLOCK_GEOMETRY, SUPPORTED, GGMLType, ggml_type
from ds4_mlx.formats.iq2xxs_tables import grid_bytes, sign_bits

QK_K = 256
QK8_0 = 32

# Blocks dequantized per step: bounds the temporaries (a few MiB) so large tensors stay cache friendly.
_CHUNK_BLOCKS = {
    GGMLType.Q8_0: 32768,
    GGMLType.Q2_K: 4096,
    GGMLType.Q4_K: 4096,
    GGMLType.IQ2_XXS: 4096,
    GGMLType.MXFP4: 32768,
}


# --------------------------------------------------------------------------------------------------
# argument handling


def resolve_qtype(qtype: "int | str | GGMLType") -> GGMLType:
    """Resolve a type id, name (case-insensitive) or enum member; QuantError if unknown."""
    try:
        return ggml_type(qtype)
    except (ValueError, TypeError):
        raise QuantError(f"unknown GGML type {qtype!r}") from None


def supported_qtype(qtype: "int | str | GGMLType") -> GGMLType:
    """Like ``resolve_qtype`` but also rejects known types that ds4-mlx has no dequantizer for."""
    qt = resolve_qtype(qtype)
    if qt not in SUPPORTED:
        names = ", ".join(t.name for t in sorted(SUPPORTED))
        raise QuantError(f"GGML type {qt.name} (id {int(qt)}) is not supported (supported: {names})")
    return qt


def as_bytes_1d(data: Any) -> np.ndarray:
    """View bytes / bytearray / memoryview / any numpy array as a flat uint8 array (copying only if needed)."""
    if isinstance(data, np.ndarray):
        arr = data if data.dtype == np.uint8 else np.ascontiguousarray(data).view(np.uint8)
        return arr.reshape(-1)
    if isinstance(data, (bytes, bytearray, memoryview)):
        return np.frombuffer(data, dtype=np.uint8)
    raise QuantError(f"quantized data must be bytes-like or a numpy uint8 array, got {type(data).__name__}")


def _rows_u8(raw: Any) -> np.ndarray:
    """A (..., row_bytes) uint8 matrix; typed arrays are viewed as their bytes along the last axis."""
    if not isinstance(raw, np.ndarray):
        if isinstance(raw, (bytes, bytearray, memoryview)):
            return np.frombuffer(raw, dtype=np.uint8)[None, :]
        raise QuantError(f"quantized rows must be a numpy uint8 array, got {type(raw).__name__}")
    if raw.ndim == 0:
        raise QuantError("quantized rows must have at least one axis (the row bytes)")
    if raw.dtype != np.uint8:
        raw = np.ascontiguousarray(raw).view(np.uint8)
    return raw


def check_data_size(qt: GGMLType, n_elements: int, n_bytes: int) -> int:
    """Validate that ``n_bytes`` hold exactly ``n_elements`` of ``qt`` in whole blocks; returns the block count."""
    elems, block_bytes = BLOCK_GEOMETRY[qt]
    if isinstance(n_elements, bool) or not isinstance(n_elements, (int, np.integer)) or n_elements < 0:
        raise QuantError(f"{qt.name}: n_elements must be a non-negative integer, got {n_elements!r}")
    n_elements = int(n_elements)
    if n_elements % elems:
        raise QuantError(
            f"{qt.name}: {n_elements} elements is not a multiple of the block size {elems} "
            f"({block_bytes} bytes per block)"
        )
    n_blocks = n_elements // elems
    expected = n_blocks * block_bytes
    if n_bytes != expected:
        raise QuantError(
            f"{qt.name}: {n_elements} elements need {expected} bytes ({n_blocks} blocks of {block_bytes}), "
            f"found {n_bytes} bytes"
        )
    return n_blocks


def check_row_bytes(qt: GGMLType, row_bytes: int) -> int:
    """Validate a row length in bytes (whole blocks); returns the number of elements per row."""
    elems, block_bytes = BLOCK_GEOMETRY[qt]
    if row_bytes % block_bytes:
        raise QuantError(
            f"{qt.name}: row of {row_bytes} bytes is not a whole number of {block_bytes}-byte blocks "
            f"(expected a multiple of {block_bytes}, found {row_bytes})"
        )
    return row_bytes // block_bytes * elems


# --------------------------------------------------------------------------------------------------
# scalar helpers


def f16_bits_to_f32(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """IEEE half (given as its little-endian byte pair) -> float32; subnormals and NaN payloads kept."""
    bits = lo.astype(np.uint16) | (hi.astype(np.uint16) << 8)
    return bits.view(np.float16).astype(np.float32)


def _f16_at(blocks: np.ndarray, offset: int) -> np.ndarray:
    return f16_bits_to_f32(blocks[:, offset], blocks[:, offset + 1])


def e8m0_to_f32_half(e: np.ndarray) -> np.ndarray:
    """ggml's MXFP4 scale: 2**(e - 128) as float32 ("half" because e2m1 values are stored doubled).

    e = 0 and 1 give the subnormals 2**-128 and 2**-127; e = 255 gives 2**127 (no NaN encoding is honoured).
    """
    e32 = e.astype(np.uint32)
    bits = np.where(e32 < 2, np.uint32(0x00200000) << e32, (e32 - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


# --------------------------------------------------------------------------------------------------
# lookup tables (values equal to what the reference arithmetic produces)


def _signed_grid_int() -> np.ndarray:
    """int8[256, 128, 8]: grid point ``g`` with sign index ``s`` applied (ds4's ``iq2xxs_signed_grid``)."""
    mags = grid_bytes().astype(np.int16)
    signs = np.where(sign_bits() == 1, -1, 1).astype(np.int16)
    return (mags[:, None, :] * signs[None, :, :]).astype(np.int8)


SIGNED_GRID_I8 = _signed_grid_int()
# The same table with each 8-value row packed in a little-endian uint64 (row ``g * 128 + s``): one gather
# per group of 8. Folding the sign in is exact: ``db * (-g) == -(db * g)`` in IEEE arithmetic, so the
# reference's ``(db * g) * sign`` is reproduced bit for bit.
SIGNED_GRID_WORDS = np.ascontiguousarray(SIGNED_GRID_I8.reshape(256 * 128, 8)).view("<u8").reshape(-1).copy()

# MXFP4 e2m1 code -> value * 2 (the "half" scale undoes the doubling).
MXFP4_KVALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32)

_SHIFT_2BIT_WORDS = np.array([0, 2, 4, 6], dtype=np.uint32).reshape(1, 1, 4, 1)
_SHIFT_4BIT_WORDS = np.array([0, 4], dtype=np.uint32).reshape(1, 1, 2, 1)


def _unpack_fields(packed: np.ndarray, shifts: np.ndarray, mask: int) -> np.ndarray:
    """SWAR bit-field extraction: packed bytes [n, k, 4m] -> uint8 [n, k, len(shifts), 4m].

    One shift-and-mask of a 32-bit word extracts the same field of its 4 bytes at once.
    """
    n, k, nbytes = packed.shape
    words = np.ascontiguousarray(packed).view("<u4").reshape(n, k, 1, nbytes // 4)
    return ((words >> shifts) & np.uint32(mask)).view(np.uint8)


# --------------------------------------------------------------------------------------------------
# block dequantizers: uint8[n_blocks, block_bytes] -> float32[n_blocks, block_elems]


def _deq_q8_0(blocks: np.ndarray) -> np.ndarray:
    d = _f16_at(blocks, 0)[:, None]
    q = blocks[:, 2:].view(np.int8).astype(np.float32)
    np.multiply(q, d, out=q)
    return q


def _deq_q2_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    sc = blocks[:, 0:16]
    d = _f16_at(blocks, 80)[:, None]
    dmin = _f16_at(blocks, 82)[:, None]
    dl = d * (sc & 0x0F).astype(np.float32)  # [n, 16] sub-block scales
    ml = dmin * (sc >> 4).astype(np.float32)  # [n, 16] sub-block offsets
    # element t = 128h + 32j + l lives in bits 2j of qs[32h + l]; sub-block of 16 is t // 16 = 8h + 2j + l // 16
    q = _unpack_fields(blocks[:, 16:80].reshape(n, 2, 32), _SHIFT_2BIT_WORDS, 0x03030303)
    q = q.astype(np.float32).reshape(n, 16, 16)
    np.multiply(q, dl[:, :, None], out=q)
    np.subtract(q, ml[:, :, None], out=q)
    return q.reshape(n, QK_K)


def q4_k_scale_min(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack Q4_K's 12 bytes of 6-bit scales and mins into two uint8[n, 8] arrays."""
    lo, mid, hi = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scale = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mins = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return scale, mins


def _deq_q4_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    d = _f16_at(blocks, 0)[:, None]
    dmin = _f16_at(blocks, 2)[:, None]
    scale, mins = q4_k_scale_min(blocks[:, 4:16])
    ds = d * scale.astype(np.float32)  # [n, 8]
    dm = dmin * mins.astype(np.float32)
    # sub-block b uses the low (b even) or high (b odd) nibbles of qs[32 * (b // 2) : +32]
    q = _unpack_fields(blocks[:, 16:144].reshape(n, 4, 32), _SHIFT_4BIT_WORDS, 0x0F0F0F0F)
    q = q.astype(np.float32).reshape(n, 8, 32)
    np.multiply(q, ds[:, :, None], out=q)
    np.subtract(q, dm[:, :, None], out=q)
    return q.reshape(n, QK_K)


def _iq2_xxs_fields(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(d float32[n], grid index uint8[n, 8, 4], packed sign/scale word uint32[n, 8])."""
    n = blocks.shape[0]
    d = _f16_at(blocks, 0)
    groups = blocks[:, 2:66].reshape(n, 8, 8)
    gidx = groups[:, :, 0:4]
    word = np.ascontiguousarray(groups[:, :, 4:8]).view("<u4").reshape(n, 8)
    return d, gidx, word


def _deq_iq2_xxs(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    d, gidx, word = _iq2_xxs_fields(blocks)
    db = d[:, None] * (np.float32(0.5) + (word >> 28).astype(np.float32)) * np.float32(0.25)  # [n, 8]
    sidx = (word[:, :, None] >> np.array([0, 7, 14, 21], dtype=np.uint32)) & np.uint32(127)  # [n, 8, 4]
    row = (gidx.astype(np.uint32) << 7) | sidx
    vals = SIGNED_GRID_WORDS[row].view(np.int8).astype(np.float32).reshape(n, 8, 32)
    np.multiply(vals, db[:, :, None], out=vals)
    return vals.reshape(n, QK_K)


def _deq_mxfp4(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    d = e8m0_to_f32_half(blocks[:, 0])[:, None]
    qs = blocks[:, 1:17]
    # elements 0..15 are the low nibbles, 16..31 the high nibbles
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    vals = MXFP4_KVALUES[codes]
    np.multiply(vals, d, out=vals)
    return vals.reshape(n, 32)


_BLOCK_DEQUANT: dict[GGMLType, Callable[[np.ndarray], np.ndarray]] = {
    GGMLType.Q8_0: _deq_q8_0,
    GGMLType.Q2_K: _deq_q2_k,
    GGMLType.Q4_K: _deq_q4_k,
    GGMLType.IQ2_XXS: _deq_iq2_xxs,
    GGMLType.MXFP4: _deq_mxfp4,
}


def _dequantize_flat(flat: np.ndarray, qt: GGMLType, n_elements: int) -> np.ndarray:
    """flat uint8 bytes (already size-checked) -> 1-D values."""
    with np.errstate(all="ignore"):  # NaN/inf scales are legal inputs and decode like the reference
        return _dequantize_flat_unchecked(flat, qt, n_elements)


def _dequantize_flat_unchecked(flat: np.ndarray, qt: GGMLType, n_elements: int) -> np.ndarray:
    if qt == GGMLType.F32:
        return flat.view("<f4").astype(np.float32)
    if qt == GGMLType.F16:
        return flat.view("<f2").astype(np.float32)
    if qt == GGMLType.BF16:
        return (flat.view("<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)
    if qt == GGMLType.I32:
        return flat.view("<i4").astype(np.int32)
    elems, block_bytes = BLOCK_GEOMETRY[qt]
    n_blocks = n_elements // elems
    blocks = flat.reshape(n_blocks, block_bytes)
    fn = _BLOCK_DEQUANT[qt]
    step = _CHUNK_BLOCKS[qt]
    if n_blocks <= step:
        return fn(blocks).reshape(-1)
    out = np.empty((n_blocks, elems), dtype=np.float32)
    for b0 in range(0, n_blocks, step):
        out[b0 : b0 + step] = fn(blocks[b0 : b0 + step])
    return out.reshape(-1)


# --------------------------------------------------------------------------------------------------
# public dequantization


def dequantize(data: Any, qtype: "int | str | GGMLType", n_elements: int) -> Any:
    """Decode ``n_elements`` values of ``qtype`` from ``data`` (whole blocks, nothing more, nothing less).

    Returns float32 (int32 for I32), 1-D numpy. MLX arrays are ``quants_mlx.dequantize_mlx``'s job
    (``ds4_mlx.quants.dequantize`` dispatches on the input type); this module never imports MLX.
    """
    qt = supported_qtype(qtype)
    flat = as_bytes_1d(data)
    check_data_size(qt, n_elements, flat.size)
    return _dequantize_flat(flat, qt, int(n_elements))


def dequantize_rows(raw: Any, qtype: "int | str | GGMLType") -> Any:
    """Decode a (..., row_bytes) matrix of quantized rows into float32 (..., cols) (int32 for I32).

    numpy only; ``quants_mlx.dequantize_rows_mlx`` is the MLX twin.
    """
    qt = supported_qtype(qtype)
    rows = _rows_u8(raw)
    cols = check_row_bytes(qt, rows.shape[-1])
    lead = rows.shape[:-1]
    flat = np.ascontiguousarray(rows).reshape(-1)
    n_rows = int(np.prod(lead, dtype=np.int64))
    return _dequantize_flat(flat, qt, n_rows * cols).reshape(*lead, cols)


# --------------------------------------------------------------------------------------------------
# weight quantizer (ggml reference)


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """ggml's ``roundf`` (ties away from zero) in float32, phrased so the tie test is exact:
    ``floor(2 * frac)`` is 1 exactly when the fractional part is >= 0.5."""
    a = np.abs(v)
    whole = np.floor(a)
    return np.sign(v) * (whole + np.floor(np.float32(2) * (a - whole)))


def quantize_q8_0(x: Any) -> np.ndarray:
    """float32 [..., n] -> Q8_0 blocks uint8 [..., n/32*34], identical to ``gguf.quants.quantize(x, Q8_0)``.

    Per block of 32: ``d = amax/127``, ``q = roundf(x * (1/d))`` (ties away from zero), ``d`` stored as f16.
    """
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % QK8_0:
        n = x.shape[-1] if x.ndim else 0
        raise QuantError(f"Q8_0: row length {n} is not a multiple of the block size {QK8_0}")
    lead, n = x.shape[:-1], x.shape[-1]
    blocks = x.reshape(-1, QK8_0)
    with np.errstate(all="ignore"):  # huge blocks overflow the f16 scale to inf, as in ggml
        d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
        q = _round_half_away(blocks * inv).astype(np.int8)
        d16 = d.astype(np.float16)
    out = np.concatenate([d16.view(np.uint8), q.view(np.uint8)], axis=1)
    return out.reshape(*lead, n // QK8_0 * 34)


# --------------------------------------------------------------------------------------------------
# ds4.c activation quantizers


def _lrintf_clamped(v: np.ndarray) -> np.ndarray:
    """``(int)lrintf(v)`` clamped to [-128, 127] as int8.

    lrintf rounds half to even (default rounding mode), like ``np.rint``. A NaN/inf product can only come
    from non-finite input; x86-64 lrintf then yields the "integer indefinite" LONG_MIN, whose (int) cast is 0,
    so those lanes become 0 here (other platforms may differ; ds4 never feeds such values on purpose).
    """
    r = np.rint(v)
    r = np.where(np.isfinite(r), r, np.float32(0))
    return np.clip(r, -128, 127).astype(np.int8)


def _abs_ignoring_nan(x: np.ndarray) -> np.ndarray:
    # C's ``if (ax > amax)`` never selects a NaN
    ax = np.abs(x)
    return np.where(np.isnan(ax), np.float32(0), ax)


def quantize_q8_0_activation(x: Any) -> tuple[np.ndarray, np.ndarray]:
    """ds4.c ``quantize_q8_0_activation``: float32 [..., n] -> (q int8 [..., n], d float32 [..., ceil(n/32)]).

    Per block of 32: ``d = amax / 127.0f`` (a division), ``id = d != 0 ? 1.0f / d : 0``,
    ``q = clamp(lrintf(x * id), -128, 127)`` (a multiplication by the reciprocal, ties to even). A short last
    block (n not a multiple of 32) is quantized over its own elements, as ds4 does.
    """
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0:
        raise QuantError("Q8_0 activation: input must have at least one axis")
    lead, n = x.shape[:-1], x.shape[-1]
    nb = -(-n // QK8_0)
    pad = nb * QK8_0 - n
    xp = np.concatenate([x, np.zeros((*lead, pad), np.float32)], axis=-1) if pad else x
    blocks = xp.reshape(*lead, nb, QK8_0)
    amax = _abs_ignoring_nan(blocks).max(axis=-1) if nb else np.zeros((*lead, 0), np.float32)
    d = amax / np.float32(127)
    with np.errstate(all="ignore"):  # 1/d overflows for subnormal d; inf * 0 is NaN: both end as q = 0
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
        q = _lrintf_clamped(blocks * inv[..., None])
    return q.reshape(*lead, nb * QK8_0)[..., :n], d.astype(np.float32)


def quantize_q8_k_activation(x: Any) -> tuple[np.ndarray, np.ndarray]:
    """ds4.c ``ds4_quantize_row_q8_K``: float32 [..., n] -> (q int8 [..., n], d float32 [..., n/256]).

    Per block of 256: ``max`` is the first element of largest magnitude (signed), ``iscale = -127.0f / max``
    (so the largest element maps to -127 and ``d`` is negative when ``max > 0``), ``q = clamp(lrintf(iscale
    * x))``, ``d = 1.0f / iscale``. An all-zero block gives ``d = 0`` and ``q = 0``. The block sums
    (``bsums``) ds4 stores are ``q.reshape(..., 16, 16).sum(-1)`` and are recomputed where needed.
    """
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % QK_K:
        n = x.shape[-1] if x.ndim else 0
        raise QuantError(f"Q8_K activation: row length {n} is not a multiple of the block size {QK_K}")
    lead, n = x.shape[:-1], x.shape[-1]
    blocks = x.reshape(*lead, n // QK_K, QK_K)
    ax = _abs_ignoring_nan(blocks)
    first = np.argmax(ax, axis=-1)[..., None]  # argmax returns the first maximal index, as the strict > does
    amax = np.take_along_axis(ax, first, axis=-1)[..., 0]
    vmax = np.take_along_axis(blocks, first, axis=-1)[..., 0]
    zero = amax == 0
    with np.errstate(all="ignore"):  # a subnormal max overflows iscale, as it does in C
        iscale = np.float32(-127) / np.where(zero, np.float32(1), vmax)
        q = _lrintf_clamped(blocks * iscale[..., None])
        d = np.float32(1) / iscale
    q = np.where(zero[..., None], np.int8(0), q)
    d = np.where(zero, np.float32(0), d).astype(np.float32)
    return q.reshape(*lead, n), d


# --------------------------------------------------------------------------------------------------
# ds4.c dot products (reference re-statements)
#
# ds4.c has two builds of each kernel: a portable C branch and an AArch64 NEON+dotprod branch. The integer
# sums are identical; the float32 operations differ in order (and Q8_0's NEON branch uses fused
# multiply-adds). ``variant="scalar"`` (default) follows the portable branch, what ds4 runs on x86-64;
# ``variant="neon"`` follows the ARM branch, what it runs on Apple silicon. Each docstring lists both orders.

VARIANTS = ("scalar", "neon")


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise QuantError(f"unknown dot-product variant {variant!r} (expected one of {', '.join(VARIANTS)})")


def _dot_args(w: Any, q: Any, d: Any, qt: GGMLType, act_block: int, name: str):
    """Common checks; returns (w2 [R, row_bytes], q2 [T, n], d2 [T, nb_act], out_shape)."""
    w = _rows_u8(w)
    cols = check_row_bytes(qt, w.shape[-1])
    q = np.asarray(q)
    d = np.asarray(d, dtype=np.float32)
    if q.dtype != np.int8:
        raise QuantError(f"{name}: activation q must be int8, got {q.dtype}")
    if q.ndim == 0 or q.shape[-1] != cols:
        raise QuantError(f"{name}: activation length {q.shape[-1] if q.ndim else 0} != weight row length {cols}")
    nb = cols // act_block
    if d.shape != (*q.shape[:-1], nb):
        raise QuantError(f"{name}: activation scales have shape {d.shape}, expected {(*q.shape[:-1], nb)}")
    out_shape = (*q.shape[:-1], *w.shape[:-1])
    return w.reshape(-1, w.shape[-1]), q.reshape(-1, cols), d.reshape(-1, nb), out_shape


def _batched_int_dot(x: np.ndarray, w: np.ndarray, dtype: type = np.float32) -> np.ndarray:
    """x [T, G, k], w [R, G, k] -> [G, T, R] integer dot products per group G.

    float32 is exact while every partial sum stays below 2**24 in magnitude (callers check the bound);
    float64 is exact below 2**53.
    """
    return np.matmul(x.astype(dtype).transpose(1, 0, 2), w.astype(dtype).transpose(1, 2, 0))


def fma_f32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Correctly rounded float32 ``a * b + c`` (one rounding), as a hardware fused multiply-add.

    The product of two float32 is exact in float64; the float64 sum is made round-to-odd (nudged off an
    even last bit when inexact), after which rounding to float32 is correct despite the two steps.
    """
    a64, b64, c64 = (np.asarray(v, dtype=np.float32).astype(np.float64) for v in (a, b, c))
    with np.errstate(all="ignore"):
        p = a64 * b64
        s = p + c64
        bb = s - p
        err = (p - (s - bb)) + (c64 - bb)  # exact residual of the float64 sum (TwoSum)
        inexact = np.isfinite(s) & np.isfinite(err) & (err != 0)
        even = (s.view(np.uint64) & np.uint64(1)) == 0
        nudged = np.nextafter(s, np.where(err > 0, np.inf, -np.inf))
        s = np.where(inexact & even, nudged, s)
        return s.astype(np.float32)


def _accumulate(terms: np.ndarray) -> np.ndarray:
    """``acc = 0.0f; for b: acc += terms[b]`` in float32, left to right over the first axis."""
    acc = np.zeros(terms.shape[1:], dtype=np.float32)
    for b in range(terms.shape[0]):
        np.add(acc, terms[b], out=acc)
    return acc


def vec_dot_q8_0_q8_0(w_rows: Any, q: Any, d: Any, variant: str = "scalar") -> np.ndarray:
    """ds4.c ``dot_q8_0_row``: Q8_0 weight rows x ``quantize_q8_0_activation`` output (float32).

    Shapes: ``w_rows`` [R, row_bytes] (or [..., row_bytes]), ``q`` [n] or [T, n], ``d`` [n/32] or [T, n/32];
    result [R] or [T, R] (activation axes first).

    scalar: per block b, ``isum_b = sum(wq * xq)`` (exact); ``acc = 0.0f``; for b = 0, 1, ...:
    ``acc = acc + ((f16(w.d_b) * x.d_b) * (float)isum_b)`` (three roundings per block, no FMA).

    neon: per block, four int32 lanes, lane k summing elements 4k..4k+3 and 16+4k..16+4k+3; even blocks
    accumulate into lane vector A, odd blocks into B: ``A_k = fma((float)lane_k, f16(w.d_b) * x.d_b, A_k)``;
    result ``((A0+B0) + (A1+B1)) + ((A2+B2) + (A3+B3))``.
    """
    _check_variant(variant)
    w, qa, da, out_shape = _dot_args(w_rows, q, d, GGMLType.Q8_0, QK8_0, "vec_dot_q8_0_q8_0")
    R, T, nb = w.shape[0], qa.shape[0], da.shape[1]
    blocks = w.reshape(R, nb, 34)
    wd = f16_bits_to_f32(blocks[..., 0], blocks[..., 1])  # [R, nb]
    wq = blocks[..., 2:].view(np.int8)  # [R, nb, 32]
    xq = qa.reshape(T, nb, QK8_0)
    scale = wd.T[:, None, :] * da.T[:, :, None]  # [nb, T, R]
    if variant == "scalar":
        isum = _batched_int_dot(xq, wq)  # |sum| <= 32 * 128 * 128 < 2**24
        return _accumulate(scale * isum).reshape(out_shape)
    # neon: regroup each block's 32 bytes as [half, lane, 4] -> [lane, 8]
    def lanes(a: np.ndarray) -> np.ndarray:
        return a.reshape(a.shape[0], nb, 2, 4, 4).transpose(0, 1, 3, 2, 4).reshape(a.shape[0], nb * 4, 8)

    isum = _batched_int_dot(lanes(xq), lanes(wq)).reshape(nb, 4, T, R)
    acc = [np.zeros((4, T, R), np.float32), np.zeros((4, T, R), np.float32)]
    for b in range(nb):
        acc[b % 2] = fma_f32(isum[b], np.broadcast_to(scale[b], (4, T, R)), acc[b % 2])
    v = acc[0] + acc[1]
    return ((v[0] + v[1]) + (v[2] + v[3])).reshape(out_shape)


def _q2_k_parts(w: np.ndarray, qa: np.ndarray, nb: int):
    """Integer parts of the Q2_K x Q8_K dot: isum, summs [nb, T, R] and the f16 scales d, dmin [nb, 1, R]."""
    R, T = w.shape[0], qa.shape[0]
    blocks = w.reshape(R * nb, 84)
    sc = blocks[:, 0:16]
    q2 = _unpack_fields(blocks[:, 16:80].reshape(-1, 2, 32), _SHIFT_2BIT_WORDS, 0x03030303).reshape(R * nb, 16, 16)
    wint = (q2 * (sc & 0x0F)[:, :, None]).reshape(R, nb, QK_K)  # <= 45 per element
    xq = qa.reshape(T, nb, QK_K)
    isum = _batched_int_dot(xq, wint)  # |sum| <= 256 * 45 * 128 < 2**24
    bsums = xq.reshape(T, nb, 16, 16).astype(np.int32).sum(axis=-1)  # ds4's block_q8_K.bsums
    summs = _batched_int_dot(bsums, (sc >> 4).reshape(R, nb, 16))  # |sum| <= 16 * 2048 * 15 < 2**24
    xd = _f16_at(blocks, 80).reshape(R, nb).T[:, None, :]
    xdmin = _f16_at(blocks, 82).reshape(R, nb).T[:, None, :]
    return isum, summs, xd, xdmin


def vec_dot_q2_k_q8_k(w_rows: Any, q: Any, d: Any, variant: str = "scalar") -> np.ndarray:
    """ds4.c ``ds4_vec_dot_q2_K_q8_K``: Q2_K weight rows x ``quantize_q8_k_activation`` output (float32).

    Integers per super-block i (exact): ``isum = sum_j (sc_j & 15) * dot16_j(q2, q8)``,
    ``summs = sum_j bsums_j * (sc_j >> 4)`` with ``bsums_j`` the sum of q8 over sub-block j.

    scalar: ``dall = y.d * f16(x.d)``, ``dmin = y.d * f16(x.dmin)``, from ``sumf = 0.0f``:
    ``sumf = sumf + ((dall * (float)isum) - (dmin * (float)summs))``.

    neon: ``d = y.d * f16(x.d)``, ``m = -y.d * f16(x.dmin)``, from ``sum = 0.0f``:
    ``sum = sum + m * (float)summs`` then ``sum = sum + d * (float)isum``.
    """
    _check_variant(variant)
    w, qa, da, out_shape = _dot_args(w_rows, q, d, GGMLType.Q2_K, QK_K, "vec_dot_q2_k_q8_k")
    nb = da.shape[1]
    with np.errstate(all="ignore"):
        isum, summs, xd, xdmin = _q2_k_parts(w, qa, nb)
        yd = da.T[:, :, None]  # [nb, T, 1]
        if variant == "scalar":
            terms = (yd * xd) * isum - (yd * xdmin) * summs  # [nb, T, R]
            return _accumulate(terms).reshape(out_shape)
        dd = yd * xd
        mm = (-yd) * xdmin
        acc = np.zeros(isum.shape[1:], np.float32)
        for b in range(nb):
            acc = acc + mm[b] * summs[b]
            acc = acc + dd[b] * isum[b]
        return acc.reshape(out_shape)


def vec_dot_iq2_xxs_q8_k(w_rows: Any, q: Any, d: Any, variant: str = "scalar") -> np.ndarray:
    """ds4.c ``ds4_vec_dot_iq2_xxs_q8_K``: IQ2_XXS weight rows x ``quantize_q8_k_activation`` output.

    Integers per group g of 32 (exact): ``sumi_g = sum(signed_grid * q8)``; ``s_g = w_g >> 28``.

    scalar: ``bsum = sum_g sumi_g * (2 * s_g + 1)`` (exact int, can exceed 2**24),
    ``d = f16(x.d) * y.d``, from ``sumf = 0.0f``: ``sumf = sumf + d * (float)bsum`` (the conversion rounds to
    nearest even); result ``0.125f * sumf``.

    neon: per block ``s1 = s2 = 0.0f``; for g = 0, 2, 4, 6: ``s1 = s1 + (float)sumi_g * (0.5f + (float)s_g)``
    and ``s2 = s2 + (float)sumi_{g+1} * (0.5f + (float)s_{g+1})``; ``sumf = sumf + d * (s1 + s2)``;
    result ``0.25f * sumf``. With the real grid (largest point sum 203) every NEON partial sum is an exact
    half-integer below 2**23 and ``s1 + s2 == bsum / 2`` is rounded exactly like ``(float)bsum``, so both
    variants agree bit for bit unless a product lands in the float32 subnormal range.
    """
    _check_variant(variant)
    w, qa, da, out_shape = _dot_args(w_rows, q, d, GGMLType.IQ2_XXS, QK_K, "vec_dot_iq2_xxs_q8_k")
    R, T, nb = w.shape[0], qa.shape[0], da.shape[1]
    blocks = w.reshape(R * nb, 66)
    xd, gidx, word = _iq2_xxs_fields(blocks)
    sidx = (word[:, :, None] >> np.array([0, 7, 14, 21], dtype=np.uint32)) & np.uint32(127)
    vals = SIGNED_GRID_I8[gidx.astype(np.intp), sidx.astype(np.intp)].reshape(R, nb * 8, 32)
    xq = qa.reshape(T, nb * 8, 32)
    sumi = _batched_int_dot(xq, vals).reshape(nb, 8, T, R)  # |sum| <= 32 * 43 * 128 < 2**24
    s = (word >> 28).reshape(R, nb, 8).transpose(1, 2, 0)[:, :, None, :]  # [nb, 8, 1, R]
    dd = xd.reshape(R, nb).T[:, None, :] * da.T[:, :, None]  # [nb, T, R]
    with np.errstate(all="ignore"):
        if variant == "scalar":
            ls = (2 * s + 1).astype(np.int64)
            bsum = (sumi.astype(np.int64) * ls).sum(axis=1).astype(np.float32)  # exact int64, then RNE
            return (np.float32(0.125) * _accumulate(dd * bsum)).reshape(out_shape)
        half = np.float32(0.5) + s.astype(np.float32)  # [nb, 8, 1, R]
        acc = np.zeros((T, R), np.float32)
        for b in range(nb):
            s1 = np.zeros((T, R), np.float32)
            s2 = np.zeros((T, R), np.float32)
            for g in range(0, 8, 2):
                s1 = s1 + sumi[b, g] * half[b, g]
                s2 = s2 + sumi[b, g + 1] * half[b, g + 1]
            acc = acc + dd[b] * (s1 + s2)
        return (np.float32(0.25) * acc).reshape(out_shape)
