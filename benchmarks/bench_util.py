"""What the weight benchmarks share: valid random GGUF blocks and a timing loop.

Imported by the benchmark scripts as ``bench_util`` (a script's own folder is first on ``sys.path``).
"""

from __future__ import annotations

import lzma
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from ds4_mlx.formats.ggml_types import BLOCK_GEOMETRY, GGMLType
from ds4_mlx.formats.quants import quantize_q8_0

BENCH_DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "bench-data"


def proc_memory() -> dict[str, int]:
    """VmHWM / VmRSS (and its split into RssAnon / RssFile: file = pages of the mmapped GGUF) of this
    process in bytes (Linux); empty elsewhere."""
    out = {}
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def read_text(path: Path) -> str:
    """A UTF-8 text file, decompressed when its name ends in ``.xz``."""
    if path.suffix == ".xz":
        with lzma.open(path, "rt", encoding="utf-8") as fh:
            return fh.read()
    return path.read_text(encoding="utf-8")


def bench_text(name: str = "promessi_sposi.txt") -> str:
    """A reference text the repository ships (``tests/data/bench-data/<name>.xz``), decoded."""
    return read_text(BENCH_DATA / f"{name}.xz")


def random_blocks(rng, qtype: GGMLType, lead: tuple[int, ...], n_in: int) -> np.ndarray:
    """uint8 [*lead, n_in/elems*block_bytes]: Q8_0 quantized Gaussian rows, or random codes of
    IQ2_XXS / Q2_K / Q4_K with moderate f16 scales, MXFP4 with E8M0 scales near 2^-10 (every byte
    pattern of their codes is valid)."""
    if qtype == GGMLType.Q8_0:
        return quantize_q8_0(rng.standard_normal((*lead, n_in)).astype(np.float32) * 0.02)
    elems, block_bytes = BLOCK_GEOMETRY[qtype]
    nb = n_in // elems
    raw = rng.integers(0, 256, size=(*lead, nb, block_bytes), dtype=np.uint8)
    if qtype == GGMLType.MXFP4:
        raw[..., 0] = rng.integers(116, 119, size=(*lead, nb), dtype=np.uint8)
        return raw.reshape(*lead, nb * block_bytes)
    for off in {GGMLType.IQ2_XXS: (0,), GGMLType.Q2_K: (80, 82), GGMLType.Q4_K: (0, 2)}[qtype]:
        d = (rng.uniform(0.5, 2.0, size=(*lead, nb)) * 1e-3).astype(np.float16)
        raw[..., off:off + 2] = d.view(np.uint8).reshape(*lead, nb, 2)
    return raw.reshape(*lead, nb * block_bytes)


def timed(fn, min_time: float = 0.3, max_iter: int = 200) -> float:
    """Seconds per call (after one warm-up call), repeating until ``min_time`` has passed or
    ``max_iter`` calls were made."""
    mx.eval(fn())
    n, start = 0, time.perf_counter()
    while True:
        mx.eval(fn())
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_time or n >= max_iter:
            return elapsed / n
