"""Public entry point for GGML quantization blocks (re-exports ``ds4_mlx.formats.quants`` and its MLX twins).

    from ds4_mlx.quants import dequantize, dequantize_rows
    x = dequantize(raw_bytes, "IQ2_XXS", n_elements)        # float32 numpy (MLX in -> MLX out)
    w = dequantize_rows(tensor_rows_uint8, "Q2_K")           # (..., row_bytes) -> (..., cols)

See ``ds4_mlx/formats/quants.py`` for the bit-exactness contract and ds4.c's arithmetic order.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ds4_mlx.formats import quants as _np_quants
from ds4_mlx.formats.quants import (
    QK8_0,
    QK_K,
    quantize_q8_0,
    quantize_q8_0_activation,
    quantize_q8_k_activation,
    vec_dot_iq2_xxs_q8_k,
    vec_dot_q2_k_q8_k,
    vec_dot_q8_0_q8_0,
)
from ds4_mlx.formats.quants_mlx import (
    dequant_f16_mlx,
    dequant_iq2_xxs_mlx,
    dequant_q2_k_mlx,
    dequant_q4_k_mlx,
    dequant_q8_0_mlx,
    dequantize_mlx,
    dequantize_rows_mlx,
    quantize_q8_0_activation_mlx,
    quantize_q8_k_activation_mlx,
)



def dequantize(data: Any, qtype, n_elements: int) -> Any:
    """``formats.quants.dequantize`` (numpy) or, for an MLX array, its MLX twin ``dequantize_mlx``.

    The dispatch lives here, above both modules, so that the numpy module never imports the MLX one
    (which imports it)."""
    if isinstance(data, mx.array):
        return dequantize_mlx(data, qtype, n_elements)
    return _np_quants.dequantize(data, qtype, n_elements)


def dequantize_rows(raw: Any, qtype) -> Any:
    """``formats.quants.dequantize_rows`` (numpy) or, for an MLX array, ``dequantize_rows_mlx``."""
    if isinstance(raw, mx.array):
        return dequantize_rows_mlx(raw, qtype)
    return _np_quants.dequantize_rows(raw, qtype)


__all__ = [
    "QK8_0",
    "QK_K",
    "dequantize",
    "dequantize_rows",
    "quantize_q8_0",
    "quantize_q8_0_activation",
    "quantize_q8_k_activation",
    "vec_dot_q8_0_q8_0",
    "vec_dot_q2_k_q8_k",
    "vec_dot_iq2_xxs_q8_k",
    "dequantize_mlx",
    "dequantize_rows_mlx",
    "dequant_f16_mlx",
    "dequant_q8_0_mlx",
    "dequant_q2_k_mlx",
    "dequant_q4_k_mlx",
    "dequant_iq2_xxs_mlx",
    "quantize_q8_0_activation_mlx",
    "quantize_q8_k_activation_mlx",
]
