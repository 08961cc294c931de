"""ds4-mlx: DeepSeek V4 Flash inference on MLX (a reimplementation of antirez/ds4)."""

from __future__ import annotations

# Must run before anything imports mlx: on Linux it puts OpenBLAS in the global symbol scope so
# libmlx.so binds its BLAS calls there instead of to the slow reference BLAS the wheel bundles.
from ds4_mlx import blas as _blas

_blas.preload()

from ds4_mlx import allocator as _allocator

_allocator.tune()

__version__ = "0.1.0"

__all__ = ["load", "__version__"]


def load(path, numerics: str = "default", **kwargs):
    """Open a DS4 Flash GGUF (mmap) and return the loaded model (see ``ds4_mlx.model.loader``)."""
    from ds4_mlx.model.loader import load as _load

    return _load(path, numerics=numerics, **kwargs)
