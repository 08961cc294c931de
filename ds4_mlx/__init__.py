"""ds4-mlx: DeepSeek V4 Flash inference on MLX (a reimplementation of antirez/ds4)."""

from __future__ import annotations

# Must run before anything imports mlx: on Linux it puts OpenBLAS in the global symbol scope so
# libmlx.so binds its BLAS calls there instead of to the slow reference BLAS the wheel bundles.
from ds4_mlx import blas as _blas

_blas.preload()

from ds4_mlx import allocator as _allocator

_allocator.tune()

__version__ = "0.1.0"

__all__ = [
    "load", "generate", "stream_generate", "Engine", "Session", "Snapshot",
    "GenerationEvent", "GenerationResult", "GenerationStats", "TokenLogprob", "GenerationError",
    "IndexedToolCall", "perplexity", "PerplexityResult", "run_vectors", "VectorResult",
    "__version__",
]

# Public names resolved on first use, so ``import ds4_mlx`` does not import mlx or the model code.
_LAZY = {
    "generate": "ds4_mlx.engine.generate",
    "stream_generate": "ds4_mlx.engine.generate",
    "GenerationEvent": "ds4_mlx.engine.generate",
    "GenerationResult": "ds4_mlx.engine.generate",
    "GenerationStats": "ds4_mlx.engine.generate",
    "TokenLogprob": "ds4_mlx.engine.generate",
    "IndexedToolCall": "ds4_mlx.engine.generate",
    "GenerationError": "ds4_mlx.engine.generate",
    "Engine": "ds4_mlx.engine.engine",
    "Session": "ds4_mlx.engine.session",
    "Snapshot": "ds4_mlx.engine.session",
    "perplexity": "ds4_mlx.engine.perplexity",
    "PerplexityResult": "ds4_mlx.engine.perplexity",
    "run_vectors": "ds4_mlx.engine.vectors",
    "VectorResult": "ds4_mlx.engine.vectors",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ds4_mlx' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


def load(path_or_repo, numerics: str = "default", **kwargs):
    """Open a DS4 Flash GGUF (mmap) and return the model object (``Engine``): ``.tokenizer``,
    ``.config``, ``.apply_chat_template``, ``.new_session``; the network is ``.network``.

    ``path_or_repo``: a local path or ``hf:REPO/FILE`` (resolved by ``ds4_mlx.hub``).
    ``numerics``: "default" or "ds4-cpu"; ``kwargs`` go to ``ds4_mlx.model.loader.load``, among
    them ``experts``: "device" (the raw expert blocks held in MLX memory, ~80 GiB resident for the
    2-bit DS4 Flash, routing on the device: a decode step has no host round trip), "host" (routing in
    numpy, slabs read out of the mmap on demand) or "auto" (default: device on a GPU, host on the
    CPU, where device only doubles the expert memory). A bad value raises a one-line ``LayoutError``.
    ``distributed="pipeline"``: run under ``mlx.launch``, the layers split over the ranks
    (``ds4_mlx.model.pipeline``); ``distributed="experts"``: every rank holds the dense weights and
    its share of each layer's routed experts (``ds4_mlx.model.expert_parallel``). Only rank 0
    returns, the other ranks serve their part inside this call and exit when rank 0 does
    (``join_timeout``: seconds to wait for them, default 120). ``checkpoint``: "preview" or "0731",
    for a file whose name and metadata do not say which DeepSeek V4 Flash checkpoint it holds (its
    thinking levels differ: ``ds4_mlx.chat.effort``); by default it is decided from the file.
    ``ctx``: the context the sessions will use (default 32768, capped at the model's; it becomes
    ``new_session()``'s default) and ``simulate_memory``: plan for a machine of that many GiB. The
    load is planned first (``ds4_mlx.model.memory_plan``: weights, expert cache, KV at ``ctx``,
    scratch); one that does not fit raises a one-line ``MemoryPlanError`` naming the numbers and
    what would fit, before any weight is read. ``model.memory_plan`` is the plan.
    """
    from ds4_mlx.engine.engine import Engine

    return Engine.open(path_or_repo, numerics=numerics, **kwargs)
