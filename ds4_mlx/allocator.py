"""glibc malloc tuning for MLX's CPU backend (Linux only).

MLX's CPU allocator keeps no cache of its own, so every array of >= 32 MiB (glibc's dynamic mmap
threshold tops out there) is a fresh mmap whose pages fault in on first touch and are unmapped on
free. A dequantized expert or an output-head row block hits that on every token: measured here,
one q2 expert dequantization took 61 ms (numpy) / 131 ms (MLX) with the defaults and 25 / 29 ms
with the thresholds below, which keep large blocks on the heap for reuse.

Opt out with DS4_MLX_MALLOPT=off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

ENV_VAR = "DS4_MLX_MALLOPT"
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30  # allocations below 1 GiB come from the heap
TRIM_THRESHOLD = (1 << 31) - 1  # never give the top of the heap back eagerly

_state: dict[str, object] = {"applied": False, "reason": "not attempted"}


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
            mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
            ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
            _state.update(applied=ok, reason="applied" if ok else "mallopt refused the values")
    return dict(_state)


def status() -> dict[str, object]:
    return dict(_state)
