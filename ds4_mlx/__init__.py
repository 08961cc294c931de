"""ds4-mlx: DeepSeek V4 Flash inference on MLX (a reimplementation of antirez/ds4)."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["load", "__version__"]


def load(path, numerics: str = "default", **kwargs):
    """Open a DS4 Flash GGUF (mmap) and return the loaded model (see ``ds4_mlx.model.loader``)."""
    from ds4_mlx.model.loader import load as _load

    return _load(path, numerics=numerics, **kwargs)
