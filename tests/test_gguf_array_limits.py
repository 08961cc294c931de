"""Metadata arrays cannot make opening a GGUF expensive (issue #8, 6e): a declared length is checked
against the bytes left before anything is allocated, the arrays a model needs have an element cap,
and a long array that is really there is read in place (``NumericArray``), not made into a list.

Files are written byte by byte so any count can be declared; memory is measured in a fresh
subprocess (``ru_maxrss`` only grows, so it has to start from a clean process).
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ds4_mlx.errors import GGUFError
from ds4_mlx.formats.gguf import KNOWN_ARRAY_LIMITS, LAZY_ARRAY_MIN, MAX_NESTED_ARRAYS, GGUFFile, NumericArray, \
    ValueType

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _s(raw: bytes) -> bytes:
    return struct.pack("<Q", len(raw)) + raw


def _array_head(key: str, sub: ValueType, count: int) -> bytes:
    return _s(key.encode()) + struct.pack("<IIQ", ValueType.ARRAY, sub, count)


def _gguf(*kvs: bytes) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs)


def _write_numeric(path, key: str, values: np.ndarray, sub: ValueType) -> None:
    with open(path, "wb") as fh:
        fh.write(_gguf(_array_head(key, sub, len(values))))
        fh.write(values.tobytes())


def _open_in_subprocess(path, body: str = "") -> dict:
    """Open ``path`` in a fresh interpreter; its peak RSS growth (MiB), time, and error if any."""
    script = textwrap.dedent(f"""
        import json, resource, time
        from ds4_mlx.formats.gguf import GGUFFile
        from ds4_mlx.errors import GGUFError
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        out = {{}}
        try:
            f = GGUFFile({str(path)!r})
        except GGUFError as exc:
            out["error"] = str(exc)
        else:
{textwrap.indent(textwrap.dedent(body), " " * 12) if body else "            pass"}
        out["seconds"] = time.perf_counter() - t0
        out["rss_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        print(json.dumps(out))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": REPO})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_declared_huge_length_is_refused_fast_and_small(tmp_path):
    paths = []
    for sub in (ValueType.UINT8, ValueType.UINT32, ValueType.FLOAT64, ValueType.BOOL, ValueType.STRING,
                ValueType.ARRAY):
        for count in (1 << 40, (1 << 64) - 1):
            p = tmp_path / f"huge-{sub.name}-{count}.gguf"
            p.write_bytes(_gguf(_array_head("big", sub, count) + b"\x00" * 4096))
            paths.append((p, sub, count))
    ok = tmp_path / "ok.gguf"
    ok.write_bytes(_gguf())
    r = _open_in_subprocess(ok, f"""
        out["errors"] = []
        for p in {[str(p) for p, _, _ in paths]!r}:
            try:
                GGUFFile(p)
                out["errors"].append(None)
            except GGUFError as exc:
                out["errors"].append(str(exc))
    """)
    for (p, sub, count), err in zip(paths, r["errors"]):
        assert err is not None and str(p) in err and f"array of {count} {sub.name}" in err and "remain" in err, err
    assert r["seconds"] < 2.0 and r["rss_mib"] < 16, r


def test_long_numeric_array_is_read_in_place(tmp_path):
    """A 32 MiB u32 array (8M varied values) used to become 8M Python ints (~300 MB); now a view."""
    n = 8 << 20
    p = tmp_path / "long.gguf"
    _write_numeric(p, "long", (np.arange(n, dtype=np.uint64) * 2654435761 % (1 << 32)).astype("<u4"),
                   ValueType.UINT32)
    r = _open_in_subprocess(p, """
        a = f.metadata["long"]
        out["type"] = type(a).__name__
        out["len"] = len(a)
        out["probe"] = [a[0], a[1], a[n - 1], a[-1]] if (n := len(a)) else []
        out["count"] = f.fields["long"].count
    """)
    assert "error" not in r, r
    assert r["type"] == "NumericArray" and r["len"] == r["count"] == n
    last = (n - 1) * 2654435761 % (1 << 32)
    assert r["probe"] == [0, 2654435761, last, last]
    assert r["rss_mib"] < 24, r


def test_numeric_array_behaves_as_a_read_only_list(tmp_path):
    n = LAZY_ARRAY_MIN + 5
    p = tmp_path / "f.gguf"
    values = (np.arange(n) % 1000 - 500).astype("<i2")
    _write_numeric(p, "a", values, ValueType.INT16)
    f = GGUFFile(p)
    a = f.metadata["a"]
    assert isinstance(a, NumericArray) and len(a) == n
    assert a[0] == -500 and type(a[0]) is int and a[-1] == int(values[-1]) and a[3:6] == [-497, -496, -495]
    with pytest.raises(IndexError):
        a[n]
    assert a == values.tolist() and a != values.tolist()[:-1] and a == f.metadata["a"]
    assert sum(1 for _ in a) == n
    assert np.array_equal(f.metadata_array("a"), values) and not a.numpy().flags.writeable
    assert pickle.loads(pickle.dumps(a)) == values.tolist()
    f.close()
    assert a[7] == int(values[7])  # the view outlives close(), like a tensor view


def test_long_bool_array_is_checked_and_read_in_place(tmp_path):
    n = LAZY_ARRAY_MIN + 3
    values = (np.arange(n) % 3 == 0).astype(np.uint8)
    p = tmp_path / "b.gguf"
    _write_numeric(p, "b", values, ValueType.BOOL)
    with GGUFFile(p) as f:
        b = f.metadata["b"]
        assert isinstance(b, NumericArray) and b[0] is True and b[1] is False and b[n - 1] is ((n - 1) % 3 == 0)
    values[n - 2] = 7
    _write_numeric(p, "b", values, ValueType.BOOL)
    with pytest.raises(GGUFError, match=rf"metadata 'b'\[{n - 2}\]: bool byte is 7, expected 0 or 1"):
        GGUFFile(p)


@pytest.mark.parametrize("key", sorted(KNOWN_ARRAY_LIMITS))
def test_model_arrays_over_their_cap_are_refused_before_reading(tmp_path, key):
    """Even when the file really holds that many elements (2M empty strings are 16 MiB)."""
    limit = KNOWN_ARRAY_LIMITS[key]
    p = tmp_path / "cap.gguf"
    sub = ValueType.STRING if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges") else ValueType.UINT8
    with open(p, "wb") as fh:
        fh.write(_gguf(_array_head(key, sub, limit + 1)))
        fh.write(b"\x00" * ((limit + 1) * (8 if sub == ValueType.STRING else 1)))
    with pytest.raises(GGUFError, match=rf"declares {limit + 1} elements, more than the {limit} allowed"):
        GGUFFile(p)
    with open(p, "r+b") as fh:  # at the cap: accepted
        fh.write(_gguf(_array_head(key, sub, limit)))
    with GGUFFile(p) as f:
        assert len(f.metadata[key]) == limit


def test_arrays_of_arrays_are_capped(tmp_path):
    inner = struct.pack("<IQ", ValueType.UINT8, 0)  # an empty u8 array: 12 bytes, ~60 as a Python list
    p = tmp_path / "nested.gguf"
    p.write_bytes(_gguf(_array_head("n", ValueType.ARRAY, MAX_NESTED_ARRAYS + 1) + inner * (MAX_NESTED_ARRAYS + 1)))
    with pytest.raises(GGUFError, match=rf"array of {MAX_NESTED_ARRAYS + 1} arrays, more than the "
                                        rf"{MAX_NESTED_ARRAYS} allowed"):
        GGUFFile(p)
    p.write_bytes(_gguf(_array_head("n", ValueType.ARRAY, 3) + inner * 3))
    with GGUFFile(p) as f:
        assert f.metadata["n"] == [[], [], []]
