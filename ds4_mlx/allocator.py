"""glibc malloc tuning for MLX's CPU backend (Linux only).

MLX's CPU allocator keeps no cache of its own, so every array of >= 32 MiB (glibc's dynamic mmap
threshold tops out there) is a fresh mmap whose pages fault in on first touch and are unmapped on
free. A dequantized expert or an output-head row block hits that on every token: measured here,
one q2 expert dequantization took 61 ms (numpy) / 131 ms (MLX) with the defaults and 25 / 29 ms
with the thresholds below, which keep large blocks on the heap for reuse.

The price of those thresholds is that freed temporaries stay in the heap: after a 2048-token prefill
chunk at the real dims ~1.8 GiB of free heap is still resident. ``trim_heap`` hands it back (the
session calls it after a long prefill; the next one faults the pages in again, well under 1% of its
time).

``release_file_pages`` is unrelated to malloc: the GGUF is mmapped, and every weight page a read
touches (an expert slab copied out, a Q8_0 matrix dequantized once) stays in this process's
resident set as a clean file page. A 2048-token chunk selects nearly every expert, so without it
the resident set grows by the whole file (7.7 GiB of 15.4 GiB on the 4-layer real-dims model).

Opt out with DS4_MLX_MALLOPT=off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys

ENV_VAR = "DS4_MLX_MALLOPT"
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30  # allocations below 1 GiB come from the heap
TRIM_THRESHOLD = (1 << 31) - 1  # never give the top of the heap back eagerly

_state: dict[str, object] = {"applied": False, "reason": "not attempted"}
_libc: list[object] = []


def tune() -> dict[str, object]:
    """Apply once; returns what was done (for `ds4-mlx inspect` and tests)."""
    if _state["reason"] != "not attempted":
        return dict(_state)
    if os.environ.get(ENV_VAR, "auto").lower() in ("off", "0", "no"):
        _state.update(reason=f"disabled by {ENV_VAR}")
    elif not sys.platform.startswith("linux"):
        _state.update(reason="not Linux")
    else:
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name or "libc.so.6")
            mallopt = libc.mallopt
        except (OSError, AttributeError):
            _state.update(reason="libc has no mallopt (not glibc)")
        else:
            _libc.append(libc)
            mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
            ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
            _state.update(applied=ok, reason="applied" if ok else "mallopt refused the values")
    return dict(_state)


def status() -> dict[str, object]:
    return dict(_state)


def trim_heap() -> bool:
    """Return the heap's free pages to the kernel (glibc ``malloc_trim(0)``, ~0.15 s for 2 GiB).
    Only when the tuning above is applied: untuned, glibc trims on its own. True if it ran."""
    if not _state["applied"] or not _libc:
        return False
    trim = getattr(_libc[0], "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes = (ctypes.c_size_t,)
    trim(0)
    return True


def _mapping_of(view: object) -> mmap.mmap | None:
    """The ``mmap`` object at the bottom of a numpy view's base chain (views, memoryviews), if any."""
    seen = 0
    while view is not None and seen < 64:
        if isinstance(view, mmap.mmap):
            return view
        view = view.obj if isinstance(view, memoryview) else getattr(view, "base", None)
        seen += 1
    return None


def release_file_pages(view: object) -> bool:
    """Drop, from this process's resident set, every page of the read-only file mapping that
    ``view`` (a zero-copy numpy view of it, e.g. a GGUF tensor) lives in. True if it ran.

    Linux ``madvise(MADV_DONTNEED)`` on a shared read-only file mapping only unmaps the pages: they
    stay in the page cache and the next read faults them back with the same bytes, so no result can
    change. It runs only on mappings that cannot have been written (a writable or private mapping
    would lose its data), and only on Linux (elsewhere the advice is not the same operation).
    """
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_DONTNEED"):
        return False
    mm = _mapping_of(view)
    if mm is None or mm.closed or len(mm) == 0:
        return False
    try:
        if not memoryview(mm).readonly:
            return False
        mm.madvise(mmap.MADV_DONTNEED)
    except (OSError, ValueError):
        return False
    return True
