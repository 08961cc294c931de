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
    # A 64 MiB block is mmapped under glibc's defaults; with the tuning it is carved from the main heap.
    # Ask where it landed (inside the [heap] mapping or not) rather than whether the heap grew: the heap may
    # already hold 64 MiB freed during the imports, and then a tuned malloc reuses it without growing.
    p = libc.malloc(64 << 20)
    lo = hi = 0
    with open("/proc/self/maps") as fh:
        for line in fh:
            if line.rstrip().endswith("[heap]"):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
    on_heap = lo <= p and p + (64 << 20) <= hi
    libc.free(ctypes.c_void_p(p))
    print(allocator.status()["reason"], on_heap)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning is Linux-only")
@pytest.mark.parametrize("setting,reason,on_heap", [("auto", "applied", "True"), ("off", "disabled by DS4_MLX_MALLOPT", "False")])
def test_large_blocks_follow_the_setting(setting, reason, on_heap):
    env = dict(os.environ, DS4_MLX_MALLOPT=setting)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == reason.split() + [on_heap]


def _rss_file_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile in /proc/self/status")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise release is Linux-only")
def test_release_file_pages_drops_residency_and_keeps_bytes(tiny_model_path):
    import hashlib

    import numpy as np

    from ds4_mlx.allocator import release_file_pages
    from ds4_mlx.formats.gguf import GGUFFile

    f = GGUFFile(tiny_model_path)
    emb = f.tensor_array("token_embd.weight")  # 126 MiB of F16 pages
    before_hash = hashlib.sha256(np.ascontiguousarray(emb).tobytes()).hexdigest()  # touches every page
    touched = _rss_file_bytes()
    assert release_file_pages(emb)
    released = _rss_file_bytes()
    assert touched - released > 100 << 20, (touched, released)
    assert hashlib.sha256(np.ascontiguousarray(emb).tobytes()).hexdigest() == before_hash


def test_release_file_pages_refuses_ordinary_and_writable_memory(tmp_path):
    import mmap

    import numpy as np

    from ds4_mlx.allocator import release_file_pages

    assert not release_file_pages(np.ones(1000))
    p = tmp_path / "w.bin"
    p.write_bytes(b"x" * 8192)
    with open(p, "r+b") as fh:
        mm = mmap.mmap(fh.fileno(), 0)  # writable shared mapping: its pages must never be dropped
        view = np.frombuffer(mm, dtype=np.uint8)
        assert not release_file_pages(view)
        assert view[:3].tobytes() == b"xxx"
        del view
        mm.close()


def test_trim_heap_runs_only_when_tuned():
    from ds4_mlx import allocator

    assert allocator.trim_heap() is bool(allocator.status()["applied"])
