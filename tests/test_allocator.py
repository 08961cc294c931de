"""The malloc tuning takes effect (large blocks come from the heap) and can be switched off."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import ctypes, sys
    import ds4_mlx
    from ds4_mlx import allocator
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    # A 64 MiB block is mmapped under glibc's defaults; with the tuning it is carved from the heap,
    # so it shows up as heap growth (sbrk) instead of a new mapping.
    libc.sbrk.restype = ctypes.c_void_p
    start = libc.sbrk(0)
    p = libc.malloc(64 << 20)
    grown = libc.sbrk(0) - start
    libc.free(ctypes.c_void_p(p))
    print(allocator.status()["reason"], grown >= (64 << 20))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning is Linux-only")
@pytest.mark.parametrize("setting,reason,on_heap", [("auto", "applied", "True"), ("off", "disabled by DS4_MLX_MALLOPT", "False")])
def test_large_blocks_follow_the_setting(setting, reason, on_heap):
    env = dict(os.environ, DS4_MLX_MALLOPT=setting)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == reason.split() + [on_heap]
