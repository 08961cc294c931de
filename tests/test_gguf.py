"""GGUF reader: value types, alignment, offsets, zero-copy views, agreement with gguf-py."""

from __future__ import annotations

import math
import mmap
import struct

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from ds4_mlx.errors import GGUFError
from ds4_mlx.formats.ggml_types import GGMLType
from ds4_mlx.formats.gguf import GGUFFile, ValueType


def _write(path, kvs=(), tensors=(), alignment=None, forced_alignment_key=True):
    """Write a GGUF with gguf-py's writer: kvs = [(key, value, vtype, sub_type)], tensors =
    [(name, array, raw_dtype or None)]."""
    w = gguf.GGUFWriter(str(path), "test")
    if alignment is not None:
        w.data_alignment = alignment  # the writer's own helper refuses non-powers of two
        if forced_alignment_key:
            w.add_uint32("general.alignment", alignment)
    for key, value, vtype, sub in kvs:
        w.add_key_value(key, value, vtype, sub_type=sub)
    for name, arr, raw in tensors:
        if raw is None:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _raw_gguf(kvs: list[bytes], n_kv: int | None = None, version: int = 3) -> bytes:
    """Minimal GGUF bytes by hand: header + pre-encoded KV entries, no tensors."""
    return b"GGUF" + struct.pack("<IQQ", version, 0, len(kvs) if n_kv is None else n_kv) + b"".join(kvs)


def _s(text: str) -> bytes:
    b = text.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


SCALARS = [
    ("t.u8", 200, VT.UINT8, ValueType.UINT8),
    ("t.i8", -100, VT.INT8, ValueType.INT8),
    ("t.u16", 60000, VT.UINT16, ValueType.UINT16),
    ("t.i16", -30000, VT.INT16, ValueType.INT16),
    ("t.u32", 4_000_000_000, VT.UINT32, ValueType.UINT32),
    ("t.i32", -2_000_000_000, VT.INT32, ValueType.INT32),
    ("t.f32", 0.15625, VT.FLOAT32, ValueType.FLOAT32),  # exact in f32
    ("t.bool_t", True, VT.BOOL, ValueType.BOOL),
    ("t.bool_f", False, VT.BOOL, ValueType.BOOL),
    ("t.str", "héllo ✓ 🙂", VT.STRING, ValueType.STRING),
    ("t.u64", 2**64 - 5, VT.UINT64, ValueType.UINT64),
    ("t.i64", -(2**62), VT.INT64, ValueType.INT64),
    ("t.f64", 1.0 / 3.0, VT.FLOAT64, ValueType.FLOAT64),
]
ARRAYS = [
    ("a.u8", [0, 1, 255], VT.UINT8, ValueType.UINT8),
    ("a.i8", [-128, 0, 127], VT.INT8, ValueType.INT8),
    ("a.u16", [0, 65535], VT.UINT16, ValueType.UINT16),
    ("a.i16", [-32768, 32767], VT.INT16, ValueType.INT16),
    ("a.u32", [0, 4, 128, 2**32 - 1], VT.UINT32, ValueType.UINT32),
    ("a.i32", [-(2**31), -1, 2**31 - 1], VT.INT32, ValueType.INT32),
    ("a.f32", [10.0, -0.5, 1e-6], VT.FLOAT32, ValueType.FLOAT32),
    ("a.bool", [True, False, True], VT.BOOL, ValueType.BOOL),
    ("a.str", ["", "a b", "Ġt he", "中文", "🙂"], VT.STRING, ValueType.STRING),
    ("a.u64", [0, 2**64 - 1], VT.UINT64, ValueType.UINT64),
    ("a.i64", [-(2**63), 2**63 - 1], VT.INT64, ValueType.INT64),
    ("a.f64", [math.pi, -2.5], VT.FLOAT64, ValueType.FLOAT64),
]


def test_every_metadata_value_type(tmp_path):
    kvs = [(k, v, vt, None) for k, v, vt, _ in SCALARS] + [(k, v, VT.ARRAY, vt) for k, v, vt, _ in ARRAYS]
    kvs.append(("n.arr_arr", [[1, 2, 3], [4], [5, 6]], VT.ARRAY, VT.ARRAY))
    kvs.append(("n.arr_arr_str", [["x", "yz"], ["🙂"]], VT.ARRAY, VT.ARRAY))
    kvs.append(("n.deep", [[[7, 8]], [[9]]], VT.ARRAY, VT.ARRAY))
    path = _write(tmp_path / "types.gguf", kvs)
    with GGUFFile(path) as f:
        for key, value, _, vt in SCALARS:
            fl = f.fields[key]
            assert fl.type == vt and fl.sub_type is None, key
            got = f.metadata[key]
            assert got == value and type(got) is type(value), (key, got)
        for key, value, _, vt in ARRAYS:
            fl = f.fields[key]
            assert fl.type == ValueType.ARRAY and fl.sub_type == vt and fl.count == len(value), key
            got = f.metadata[key]
            if vt == ValueType.FLOAT32:
                assert got == [float(np.float32(x)) for x in value], key
            else:
                assert got == value, key
            assert all(type(g) is type(v) for g, v in zip(got, value)), key
        assert f.fields["n.arr_arr"].sub_type == ValueType.ARRAY
        assert f.metadata["n.arr_arr"] == [[1, 2, 3], [4], [5, 6]]
        assert f.metadata["n.arr_arr_str"] == [["x", "yz"], ["🙂"]]
        assert f.metadata["n.deep"] == [[[7, 8]], [[9]]]
        # the writer always records the architecture first
        assert list(f.fields)[0] == "general.architecture" and f.metadata["general.architecture"] == "test"
        assert f.tensors == {} and f.n_kv == len(kvs) + 1


def test_numeric_metadata_arrays_are_zero_copy_views(tmp_path):
    path = _write(tmp_path / "a.gguf", [(k, v, VT.ARRAY, vt) for k, v, vt, _ in ARRAYS])
    with GGUFFile(path) as f:
        for key, value, _, vt in ARRAYS:
            if vt == ValueType.STRING:
                with pytest.raises(GGUFError, match="not a numeric array"):
                    f.metadata_array(key)
                continue
            arr = f.metadata_array(key)
            assert arr.tolist() == f.metadata[key], key
            assert not arr.flags.writeable
            assert isinstance(_root_base(arr), mmap.mmap), key
        with pytest.raises(GGUFError, match="no metadata key 'nope'"):
            f.metadata_array("nope")


def test_empty_arrays_and_strings(tmp_path):
    # gguf-py's writer refuses empty arrays, so these are encoded by hand.
    kvs = [
        _s("e.u32") + struct.pack("<IIQ", 9, 4, 0),
        _s("e.str") + struct.pack("<IIQ", 9, 8, 0),
        _s("e.arr") + struct.pack("<IIQ", 9, 9, 0),
        _s("e.s") + struct.pack("<I", 8) + _s(""),
        _s("") + struct.pack("<I", 0) + b"\x07",  # an empty key is legal GGUF
    ]
    p = tmp_path / "e.gguf"
    raw = _raw_gguf(kvs)
    p.write_bytes(raw)
    with GGUFFile(p) as f:
        assert f.metadata == {"e.u32": [], "e.str": [], "e.arr": [], "e.s": "", "": 7}
        assert f.fields["e.str"].sub_type == ValueType.STRING
        assert f.metadata_array("e.u32").shape == (0,)
        assert f.info_end == len(raw) and f.data_offset == -(-len(raw) // 32) * 32
        assert f.tensors == {}


def _small_tensors():
    rng = np.random.default_rng(0)
    q8_rows = rng.integers(0, 256, size=(3, 2 * 34), dtype=np.uint8)
    return [
        ("a.f32", rng.standard_normal((2, 3, 5)).astype(np.float32), None),  # 120 bytes: breaks alignment
        ("b.f16", rng.standard_normal((7, 4)).astype(np.float16), None),
        ("c.i32", rng.integers(-5, 5, size=(11,), dtype=np.int32), None),
        ("d.q8_0", q8_rows, QT.Q8_0),
        ("e.f32", np.arange(3, dtype=np.float32), None),
    ]


@pytest.mark.parametrize("alignment", [None, 32, 64, 8, 256])
def test_alignment_and_data_offsets(tmp_path, alignment):
    tensors = _small_tensors()
    path = _write(tmp_path / "al.gguf", [("x.k", "v", VT.STRING, None)], tensors, alignment=alignment)
    want = 32 if alignment is None else alignment
    reader = gguf.GGUFReader(str(path))
    with GGUFFile(path) as f:
        assert f.alignment == want
        assert ("general.alignment" in f.metadata) == (alignment is not None)
        assert f.data_offset % want == 0 and f.info_end <= f.data_offset < f.info_end + want
        assert f.data_offset == reader.data_offset
        by_name = {t.name: t for t in reader.tensors}
        for name, arr, raw in tensors:
            t = f.tensors[name]
            assert (t.offset - f.data_offset) % want == 0, name
            assert t.offset == by_name[name].data_offset, name
            assert t.nbytes == arr.nbytes, name
            assert t.ne == tuple(int(d) for d in by_name[name].shape), name
            assert bytes(f.tensor_data(name)) == arr.tobytes(), name
        np.testing.assert_array_equal(f.tensor_array("a.f32"), tensors[0][1])
        np.testing.assert_array_equal(f.tensor_array("b.f16"), tensors[1][1])
        np.testing.assert_array_equal(f.tensor_array("c.i32"), tensors[2][1])
        q = f.tensor_array("d.q8_0")
        assert f.tensors["d.q8_0"].ne == (64, 3) and q.shape == (3, 68) and q.dtype == np.uint8
        np.testing.assert_array_equal(q, tensors[3][1])


@pytest.mark.parametrize("value,vtype,found", [(0, VT.UINT32, "UINT32 0"), (48, VT.UINT32, "UINT32 48"),
                                               (32, VT.UINT64, "UINT64 32")])
def test_alignment_must_be_a_power_of_two_u32(tmp_path, value, vtype, found):
    # ggml and gguf-py refuse these too; 48 is the GGUF spec's "multiple of 8" that is no power of two
    p = _write(tmp_path / "bad.gguf", [("general.alignment", value, vtype, None)])
    with pytest.raises(GGUFError, match=f"general.alignment must be a power-of-two u32, found {found}") as e:
        GGUFFile(p)
    assert str(p) in str(e.value) and "byte offset" in str(e.value)


def _root_base(a):
    """The object that owns a view's memory (numpy keeps the exporter behind a memoryview)."""
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return a.obj if isinstance(a, memoryview) else a


def test_views_are_zero_copy_and_read_only(tmp_path):
    tensors = _small_tensors()
    path = _write(tmp_path / "zc.gguf", [], tensors)
    with GGUFFile(path) as f:
        whole = np.frombuffer(f._mm, dtype=np.uint8)  # the mapping itself, to compare addresses
        for name, _, _ in tensors:
            for view in (f.tensor_data(name), f.tensor_array(name)):
                assert isinstance(_root_base(view), mmap.mmap), name
                assert np.shares_memory(view, whole), name
                assert not view.flags.writeable, name
                start = view.__array_interface__["data"][0] - whole.__array_interface__["data"][0]
                assert start == f.tensors[name].offset, name
        # two views of one tensor are the same memory, not two copies
        assert np.shares_memory(f.tensor_data("a.f32"), f.tensor_array("a.f32"))
        del whole


def test_closed_file_refuses_views_and_views_outlive_close(tmp_path):
    path = _write(tmp_path / "c.gguf", [], _small_tensors())
    f = GGUFFile(path)
    kept = f.tensor_array("e.f32")
    f.close()
    assert f.closed
    np.testing.assert_array_equal(kept, [0.0, 1.0, 2.0])  # the mapping lives while a view does
    with pytest.raises(GGUFError, match="file is closed"):
        f.tensor_data("e.f32")
    with pytest.raises(GGUFError, match="no tensor named 'zz'"):
        GGUFFile(path).tensor("zz")


def _assert_matches_gguf_py(path) -> None:
    reader = gguf.GGUFReader(str(path))
    with GGUFFile(path) as f:
        assert f.version == 3 and f.alignment == reader.alignment and f.data_offset == reader.data_offset
        # metadata: same keys in the same order, same values and declared types
        rkeys = [k for k in reader.fields if not k.startswith("GGUF.")]
        assert list(f.fields) == rkeys
        for k in rkeys:
            rf = reader.fields[k]
            assert int(f.fields[k].type) == int(rf.types[0]), k
            if rf.types[0] == VT.ARRAY:
                assert int(f.fields[k].sub_type) == int(rf.types[1]), k
            assert f.metadata[k] == rf.contents(), k
        # every tensor: name order, type, dims, offset, size and the bytes themselves
        assert list(f.tensors) == [t.name for t in reader.tensors]
        total = 0
        for rt in reader.tensors:
            t = f.tensors[rt.name]
            assert int(t.ggml_type) == int(rt.tensor_type), rt.name
            assert t.ne == tuple(int(d) for d in rt.shape), rt.name
            assert t.offset == rt.data_offset and t.nbytes == rt.n_bytes, rt.name
            assert t.n_elements == rt.n_elements, rt.name
            mine = f.tensor_data(rt.name)
            theirs = np.asarray(rt.data).reshape(-1).view(np.uint8)
            assert np.array_equal(mine, theirs), rt.name
            total += t.nbytes
            if t.ggml_type in (GGMLType.F32, GGMLType.F16, GGMLType.I32):
                # typed views agree with gguf-py's typed arrays (same dtype and row-major shape)
                theirs_typed = np.asarray(rt.data)
                mine_typed = f.tensor_array(rt.name)
                assert mine_typed.dtype == theirs_typed.dtype and mine_typed.shape == theirs_typed.shape
                assert np.array_equal(mine_typed, theirs_typed), rt.name
        assert f.tensor_bytes == total
        gate = f.tensors["blk.0.ffn_gate_exps.weight"]
        assert gate.ggml_type == GGMLType.IQ2_XXS
        assert f.tensor_array(gate.name).shape == (gate.ne[2], gate.ne[1], gate.ne[0] // 256 * 66)


def test_small_model_matches_gguf_py(small_model_path):
    _assert_matches_gguf_py(small_model_path)
    with GGUFFile(small_model_path) as f:
        assert len(f.metadata["tokenizer.ggml.tokens"]) == 512
        assert "🙂" in f.metadata["tokenizer.ggml.tokens"]


@pytest.mark.slow
def test_tiny_model_matches_gguf_py(tiny_model_path):
    """The oracle's tiny model, all 129k tokens and 178 tensors (gguf-py alone needs ~15 s)."""
    _assert_matches_gguf_py(tiny_model_path)
    with GGUFFile(tiny_model_path) as f:
        assert len(f.metadata["tokenizer.ggml.tokens"]) == 129280
        assert len(f.metadata["tokenizer.ggml.merges"]) == 127741


def test_tiny_model_opens_without_a_per_string_reader(tiny_model_path, monkeypatch):
    """The 257k tokenizer strings are parsed in one tight loop (``_Cursor.string_array``): ~0.07 s
    here, against 0.39 s when each string went through the generic reader ``_Cursor.string``. Counted,
    not timed (a timing bound fails on a loaded machine): only keys and scalar strings may take the
    generic path."""
    from ds4_mlx.formats import gguf

    calls = {"string": 0}
    generic = gguf._Cursor.string

    def counting(self, what):
        calls["string"] += 1
        return generic(self, what)

    monkeypatch.setattr(gguf._Cursor, "string", counting)
    f = GGUFFile(tiny_model_path)
    try:
        n_strings = len(f.fields["tokenizer.ggml.tokens"].value) + len(f.fields["tokenizer.ggml.merges"].value)
    finally:
        f.close()
    assert n_strings > 250_000
    assert calls["string"] < 1_000, calls
