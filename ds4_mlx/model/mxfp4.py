"""MXFP4 routed experts (GGML type 39: DeepSeek's released FP4 experts, ``ds4f-mxfp4``) as ds4 reads them.

Block: 17 bytes for 32 weights, ``e`` (an E8M0 scale byte) then ``qs[16]``; weight j (0..15) is the low
nibble of ``qs[j]``, weight j + 16 its high nibble (ggml's half split, not interleaved pairs). Each weight

    w = scale(e) * E2M1[code]         E2M1 = 0, 0.5, 1, 1.5, 2, 3, 4, 6 for codes 0..7; bit 3 the sign
    scale(e) = the float32 with exponent bits e (2^(e-127)); e = 0: 2^-127 (bits 0x00400000); e = 255: +inf

[ds4_e8m0_to_f32, ds4_mxfp4_values: ds4.c at b0309611, its CPU reference and its Metal kernels alike].
Every product ``scale * value`` is exact in float32 or overflows to inf (e = 254 with |value| >= 2, every
code at e = 255, where the zero codes give NaN), so whoever forms it (this module, the native code, the
GPU kernels, MLX's own ``mode="mxfp4"`` dequantize) gets the same bits.

Where this differs from ggml / gguf-py (``formats.quants`` matches gguf-py, bit for bit): ggml multiplies
doubled integers by 2^(e-128), so code 8 is +0.0 there (-0.0 here) and e = 255 is 2^127 there (finite
for codes ±1 and 0) where ds4 has +inf. The model follows ds4. A real file never holds e = 255 (the OCP
spec makes it NaN); if one does, every path gives a non-finite output, which the engine reports.

DS4_CPU numerics [ds4_vec_dot_mxfp4_f32]: the activation stays float32 (no Q8_K quantization, so the
SwiGLU mid vector reaches the down projection unrounded), one float32 accumulator per output from +0.0,

    for each block b, for j = 0..15:   sumf += (d_b * v[lo_j]) * y[32b + j];  sumf += (d_b * v[hi_j]) * y[32b + j + 16]

every product and every add rounded on its own (no FMA). ds4 runs this function for GLM's routed experts;
its DeepSeek CPU path refuses MXFP4 experts (only its GPU paths run ds4f-mxfp4), so for DeepSeek it is our
choice of reference: ds4's own CPU arithmetic for the type. The order is each byte's low then high nibble,
byte after byte: the activation is permuted to that order once (``ds4_input_order``) and the sum is a
left-to-right scan (``numerics.sequential_outer_sum``).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ds4_mlx.errors import LayoutError
from ds4_mlx.formats.ggml_types import GGMLType
from ds4_mlx.formats.quants_mlx import dequantize_rows_mlx, mxfp4_fields_mlx
from ds4_mlx.model.numerics import sequential_outer_sum

QK_MXFP4 = 32
BLOCK_BYTES = 17

@mx.compile
def _ds4_values(e: mx.array, codes: mx.array) -> mx.array:
    e32 = e.astype(mx.uint32)
    d = mx.view(mx.where(e32 == 0, mx.array(0x00400000, mx.uint32), e32 << 23), mx.float32)
    c = codes.astype(mx.uint32)
    # the doubled magnitudes 0,1,2,3,4,6,8,12 are the nibbles of one constant; halving them is exact
    mag = ((mx.array(0xC8643210, mx.uint32) >> ((c & 7) << 2)) & 15).astype(mx.float32) * 0.5
    # code bit 3 straight into the float's sign bit (so code 8 is ds4's -0.0; a select was 3x slower)
    return mx.view(mx.view(mag, mx.uint32) | ((c & 8) << 28), mx.float32) * d


def _fields(raw: mx.array) -> tuple[mx.array, mx.array]:
    if raw.dtype != mx.uint8 or raw.ndim < 1 or raw.shape[-1] % BLOCK_BYTES:
        raise LayoutError(f"MXFP4: rows must be uint8 whole 17-byte blocks, got {raw.dtype} {tuple(raw.shape)}")
    return mxfp4_fields_mlx(raw.reshape(-1, raw.shape[-1]))  # [R, nb, 1, 1], [R, nb, 2, 16]


def dequant_rows(raw: mx.array) -> mx.array:
    """uint8 (..., row_bytes) -> float32 (..., n_in): ds4's weights in element order."""
    e, codes = _fields(raw)
    return _ds4_values(e, codes).reshape(*raw.shape[:-1], -1)


def dequant_rows_ds4_order(raw: mx.array) -> mx.array:
    """The same weights in ds4's summation order (each byte's low nibble, then its high one)."""
    e, codes = _fields(raw)
    return _ds4_values(e, codes.swapaxes(-1, -2)).reshape(*raw.shape[:-1], -1)


def ds4_input_order(x: mx.array) -> mx.array:
    """Activations (..., n_in) permuted to ds4's summation order: 32b + j, 32b + j + 16 for j = 0..15."""
    lead, n = x.shape[:-1], x.shape[-1]
    return x.reshape(*lead, n // QK_MXFP4, 2, 16).swapaxes(-1, -2).reshape(*lead, n)


def expert_rows_mlx(raw: mx.array, qtype: GGMLType | int) -> mx.array:
    """The model's dequantized routed-expert weights: ds4's MXFP4 values (this module), every other type
    through ``dequantize_rows_mlx`` (already ds4's values)."""
    if GGMLType(qtype) == GGMLType.MXFP4:
        return dequant_rows(raw)
    return dequantize_rows_mlx(raw, qtype)


def ds4_pairs(slabs: mx.array, x_rows: mx.array, order: np.ndarray, bounds: np.ndarray, rows: np.ndarray,
              step: int) -> list[mx.array]:
    """ds4_vec_dot_mxfp4_f32 for pairs sorted by expert: slab s (of ``slabs`` uint8 [u, out, row_bytes])
    multiplies the input rows ``rows[order[bounds[s]:bounds[s + 1]]]`` of ``x_rows`` float32 [R, n_in].
    Returns the [pairs, out] pieces in sorted order, at most ``step`` pairs each (the caller's bound on
    a temporary)."""
    xp = ds4_input_order(x_rows)
    pieces = []
    for s in range(len(bounds) - 1):
        sel = order[bounds[s]:bounds[s + 1]]
        if sel.size == 0:
            continue
        w_cols = dequant_rows_ds4_order(slabs[s]).T  # [n_in, out]
        for a in range(0, sel.size, step):
            x2 = mx.take(xp, mx.array(rows[sel[a:a + step]]), axis=0)
            pieces.append(sequential_outer_sum(w_cols, x2))
            mx.eval(pieces[-1])  # one expert's weights alive at a time
    return pieces
