"""The header's metadata_kv_count and tensor_count are capped (issue #26 item 8).

Bounding a count by the bytes left in the file is not enough: a 65 MB header that declares and
holds 5 M one-byte keys took 90 s and 2.2 GB of Python objects before the file was refused. The
counts are refused up front, from the header alone, above a cap far beyond any real file.
"""

from __future__ import annotations

import struct
import time
import tracemalloc
from collections import Counter

import pytest
from test_config_layout import _real_flash_metadata

from ds4_mlx.errors import GGUFError
from ds4_mlx.formats.config import INT_RANGES, ModelConfig
from ds4_mlx.formats.gguf import MAX_METADATA_KEYS, MAX_TENSORS, GGUFFile
from ds4_mlx.formats.layout import expected_tensors


def _s(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def _u8_kv(i: int) -> bytes:
    return _s(b"k%d" % i) + struct.pack("<IB", 0, 7)  # key, UINT8, value 7


def _header(n_tensors: int, n_kv: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)


def _fail(path, data: bytes) -> GGUFError:
    path.write_bytes(data)
    with pytest.raises(GGUFError) as ei:
        GGUFFile(path)
    return ei.value


def test_caps_are_generous_for_real_files():
    # DS4 Flash holds ~60 keys and 1,331 tensors; the largest layer count the config accepts
    # (INT_RANGES' block_count) must still fit under the tensor cap with its most tensors a layer.
    assert MAX_METADATA_KEYS >= 1000 * 60
    cfg = ModelConfig.from_metadata(_real_flash_metadata(), "real")
    per_layer = Counter(e.layer for e in expected_tensors(cfg) if e.layer is not None)
    n_global = sum(1 for e in expected_tensors(cfg) if e.layer is None)
    assert len(expected_tensors(cfg)) == 1331
    assert MAX_TENSORS >= INT_RANGES["block_count"][1] * max(per_layer.values()) + n_global


def test_metadata_kv_count_above_the_cap_is_refused_before_any_key_is_read(tmp_path):
    n = MAX_METADATA_KEYS + 1
    # enough bytes for the count to be possible, but they are 0xFF: reading key #0 would fail on its
    # length, so the error below can only come from the count itself
    body = b"\xff" * (n * 13 + 64)
    p = tmp_path / "many_keys.gguf"
    t0 = time.perf_counter()
    e = _fail(p, _header(0, n) + body)
    assert time.perf_counter() - t0 < 1.0
    msg = str(e)
    assert str(p) in msg and "metadata_kv_count" in msg
    assert f"{n:,}" in msg and f"{MAX_METADATA_KEYS:,}" in msg
    assert e.offset == 16 and e.path == str(p)


def test_a_huge_declared_key_count_is_refused_from_the_header(tmp_path):
    """The reported case: 5 M keys declared with room for them in the file. Refused from the header
    alone, whatever the bytes after it hold (here a sparse run of zeros)."""
    n = 5_000_000
    p = tmp_path / "five_million.gguf"
    p.write_bytes(_header(0, n))
    with open(p, "r+b") as fh:  # sparse: 65 MB that cost no disk
        fh.truncate(24 + n * 13)
    t0 = time.perf_counter()
    with pytest.raises(GGUFError, match="metadata_kv_count 5,000,000 is more than"):
        GGUFFile(p)
    assert time.perf_counter() - t0 < 1.0


def test_tensor_count_above_the_cap_is_refused_before_any_tensor_is_read(tmp_path):
    n = MAX_TENSORS + 1
    body = _u8_kv(0) + b"\xff" * (n * 32 + 64)
    p = tmp_path / "many_tensors.gguf"
    e = _fail(p, _header(n, 1) + body)
    msg = str(e)
    assert str(p) in msg and "tensor_count" in msg
    assert f"{n:,}" in msg and f"{MAX_TENSORS:,}" in msg
    assert e.offset == 8


def test_counts_at_the_cap_are_read_and_cost_little(tmp_path):
    """At the cap the per-key cost is what bounds the work: every key costs a few hundred bytes of
    Python objects and microseconds, so the capped worst case is tens of MB and well under seconds."""
    n = MAX_METADATA_KEYS
    p = tmp_path / "at_cap.gguf"
    p.write_bytes(_header(0, n) + b"".join(_u8_kv(i) for i in range(n)))
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        with GGUFFile(p) as f:
            assert len(f.fields) == n and f.metadata["k65535"] == 7
            elapsed = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak
    assert elapsed < 10.0, elapsed  # ~0.3 s untraced; tracemalloc slows it several times


def test_a_count_under_the_cap_in_a_truncated_file_keeps_the_truncation_error(tmp_path):
    n = 1000
    full = _header(0, n) + b"".join(_u8_kv(i) for i in range(n))
    # cut inside key #900: the count is still possible for what is left, so the parse reaches the cut
    cut = len(_header(0, n) + b"".join(_u8_kv(i) for i in range(900))) + 5
    e = _fail(tmp_path / "cut.gguf", full[:cut])
    assert "metadata key #900 length: needs 8 bytes but only 5 remain" in str(e)
    assert "truncated or corrupt" in str(e)
    # cut so early that the count cannot fit: the existing bound on the bytes left
    e = _fail(tmp_path / "early.gguf", full[:500])
    assert f"metadata count {n} is impossible" in str(e) and "truncated" in str(e)


def test_tensor_count_under_the_cap_in_a_truncated_file_keeps_the_truncation_error(tmp_path):
    n = 200

    def entry(i: int) -> bytes:  # long names, so the entries held outweigh the 32-byte minimum each
        return _s(b"t%04d" % i + b"x" * 995) + struct.pack("<IQIQ", 1, 8, 0, 32 * i)

    head = _header(n, 1) + _u8_kv(0) + b"".join(entry(i) for i in range(10))
    cut = len(head) + 8 + 300  # inside tensor #10's name
    data = head + entry(10)
    e = _fail(tmp_path / "t.gguf", data[:cut])
    msg = str(e).replace(str(e.path), "")
    assert "tensor #10 name (1000 bytes): needs 1000 bytes but only 300 remain" in msg
    assert "tensor_count" not in msg
