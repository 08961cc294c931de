"""The raw-GGUF-block kernels on MLX's CUDA backend (``mx.fast.cuda_kernel``).

Same kernels, same twins, same contracts as ``metal_kernels`` (which holds the one implementation): the
shared sources are compiled in their CUDA dialect (``kernels/dialect_cuda.cuh``). Routing the model's
experts here is the model's business; these functions take expert ids as arrays like the Metal ones.
"""

from __future__ import annotations

import mlx.core as mx

from ds4_mlx.formats.ggml_types import GGMLType
from ds4_mlx.model import metal_kernels as _mk
from ds4_mlx.model.metal_kernels import (  # noqa: F401  (the twins are dialect-free)
    expert_matmul_dense,
    expert_matmul_twin,
    expert_swiglu_twin,
    gather_tiles,
    q8_0_matvec_twin,
)


def available() -> bool:
    """Whether MLX's CUDA backend (and so ``mx.fast.cuda_kernel``) can run here."""
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available())


def kernel_sources(key: str) -> tuple[str, str]:
    """(header, body) of kernel ``key`` as handed to ``mx.fast.cuda_kernel``."""
    return _mk.kernel_sources(key, "cuda")


def q8_0_matvec_kernel(w_raw: mx.array, x: mx.array) -> mx.array:
    return _mk.q8_0_matvec_kernel(w_raw, x, dialect="cuda")


def expert_matvec_kernel(slabs: mx.array, qtype: GGMLType, x: mx.array, slot, rows) -> mx.array:
    return _mk.expert_matvec_kernel(slabs, qtype, x, slot, rows, dialect="cuda")


def expert_swiglu_kernel(gate_slabs: mx.array, up_slabs: mx.array, qtype: GGMLType, x: mx.array, slot, rows,
                         clamp: float) -> mx.array:
    return _mk.expert_swiglu_kernel(gate_slabs, up_slabs, qtype, x, slot, rows, clamp, dialect="cuda")


def expert_gather_mm_kernel(slabs: mx.array, qtype: GGMLType, x: mx.array, slot, rows) -> mx.array:
    return _mk.expert_gather_mm_kernel(slabs, qtype, x, slot, rows, dialect="cuda")


def expert_matmul_kernel(slabs: mx.array, qtype: GGMLType, x: mx.array, slot, rows) -> mx.array:
    return _mk.expert_matmul_kernel(slabs, qtype, x, slot, rows, dialect="cuda")
