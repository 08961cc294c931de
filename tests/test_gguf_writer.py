"""The streaming GGUF writer, checked against gguf-py (an independent writer and reader) and our reader."""

from __future__ import annotations

import hashlib
import math

import gguf
import numpy as np
import pytest

from ds4_mlx.errors import Ds4Error, GGUFError
from ds4_mlx.formats.ggml_types import GGMLType
from ds4_mlx.formats.gguf import GGUFFile, ValueType
from ds4_mlx.formats.gguf_writer import GGUFWriter, MetaArray

GV = gguf.GGUFValueType

# (key, type, value) for every scalar type, with values at the edges of each range.
SCALARS = [
    ("t.u8", ValueType.UINT8, 255),
    ("t.i8", ValueType.INT8, -128),
    ("t.u16", ValueType.UINT16, 65535),
    ("t.i16", ValueType.INT16, -32768),
    ("t.u32", ValueType.UINT32, 2**32 - 1),
    ("t.i32", ValueType.INT32, -(2**31)),
    ("t.u64", ValueType.UINT64, 2**64 - 1),
    ("t.i64", ValueType.INT64, -(2**63)),
    ("t.f32", ValueType.FLOAT32, 0.1),
    ("t.f64", ValueType.FLOAT64, 0.1),
    ("t.bool_t", ValueType.BOOL, True),
    ("t.bool_f", ValueType.BOOL, False),
    ("t.str", ValueType.STRING, "Ünïcode ｜DSML｜ \n tab\t"),
    ("t.str_empty", ValueType.STRING, ""),
]
ARRAYS = [
    ("a.u8", ValueType.UINT8, [0, 1, 255]),
    ("a.i8", ValueType.INT8, [-128, 0, 127]),
    ("a.u16", ValueType.UINT16, [0, 65535]),
    ("a.i16", ValueType.INT16, [-32768, 32767]),
    ("a.u32", ValueType.UINT32, [0, 4, 128, 2**32 - 1]),
    ("a.i32", ValueType.INT32, [-(2**31), 7, 2**31 - 1]),
    ("a.u64", ValueType.UINT64, [0, 2**64 - 1]),
    ("a.i64", ValueType.INT64, [-(2**63), 2**63 - 1]),
    ("a.f32", ValueType.FLOAT32, [10.0, -0.5, 1e-6]),
    ("a.f64", ValueType.FLOAT64, [1e300, -2.5]),
    ("a.bool", ValueType.BOOL, [True, False, True]),
    ("a.str", ValueType.STRING, ["a", "", "Ġhello", "<｜begin▁of▁sentence｜>"]),
]


def _float32(x: float) -> float:
    return float(np.float32(x))


def _expected(vtype: ValueType, value):
    if vtype == ValueType.FLOAT32:
        return [_float32(v) for v in value] if isinstance(value, list) else _float32(value)
    return value


def _decode_parts(field) -> object:
    """Decode a gguf-py ReaderField from its raw parts, nested arrays included (gguf-py's own
    ``contents()`` flattens them)."""
    parts = field.parts
    pos = 0

    def value(vtype: int):
        nonlocal pos
        if vtype == GV.STRING:
            pos += 2
            return bytes(parts[pos - 1]).decode("utf-8")
        if vtype == GV.ARRAY:
            sub, n = int(parts[pos][0]), int(parts[pos + 1][0])
            pos += 2
            return [value(sub) for _ in range(n)]
        pos += 1
        v = parts[pos - 1][0]
        return bool(v) if vtype == GV.BOOL else v.item()

    pos = 3  # key length, key bytes, value type
    return value(int(parts[2][0]))


def _write_metadata_file(path, extra=()):
    with GGUFWriter(path) as w:
        for key, vtype, value in SCALARS:
            w.add(key, vtype, value)
        for key, sub, values in ARRAYS:
            w.add_array(key, values, sub)
        w.add_array("n.empty", [], ValueType.UINT32)
        w.add_array("n.nested", [MetaArray(ValueType.INT16, [1, -2]), MetaArray(ValueType.STRING, ["x", "yz"]),
                                 MetaArray(ValueType.ARRAY, [MetaArray(ValueType.FLOAT64, [0.25])])],
                    ValueType.ARRAY)
        for key, vtype, value in extra:
            w.add(key, vtype, value)
        w.write_header()


def test_every_metadata_type_round_trips_through_gguf_py_and_our_reader(tmp_path):
    path = tmp_path / "meta.gguf"
    _write_metadata_file(path)

    reader = gguf.GGUFReader(path)
    ours = GGUFFile(path)
    for key, vtype, value in SCALARS:
        field = reader.fields[key]
        assert [int(t) for t in field.types] == [int(vtype)], key
        assert field.contents() == _expected(vtype, value), key
        assert ours.fields[key].type == vtype and ours.metadata[key] == _expected(vtype, value), key
    for key, sub, values in ARRAYS:
        field = reader.fields[key]
        assert [int(t) for t in field.types] == [int(GV.ARRAY), int(sub)], key
        assert field.contents() == _expected(sub, values), key
        assert ours.fields[key].sub_type == sub and ours.metadata[key] == _expected(sub, values), key
    assert _decode_parts(reader.fields["n.empty"]) == [] and int(reader.fields["n.empty"].parts[3][0]) == int(GV.UINT32)
    nested = [[1, -2], ["x", "yz"], [[0.25]]]
    assert _decode_parts(reader.fields["n.nested"]) == nested
    assert ours.metadata["n.nested"] == nested
    assert list(ours.metadata) == [k for k, _, _ in SCALARS] + [k for k, _, _ in ARRAYS] + ["n.empty", "n.nested"]
    assert reader.tensors == [] and ours.tensors == {}


def test_header_and_data_are_byte_identical_to_gguf_py_writer(tmp_path):
    """Same metadata and tensors written by gguf-py's GGUFWriter give the same file, byte for byte."""
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((3, 5)).astype(np.float32)
    f16 = rng.standard_normal((2, 64)).astype(np.float16)
    i32 = rng.integers(-5, 5, size=(7, 3), dtype=np.int32)
    q8 = rng.integers(0, 256, size=(4, 2 * 34), dtype=np.uint8)  # 4 rows of 64 Q8_0 values
    nested = [[1, 2], ["a"], [0.5, 1.5]]

    theirs = tmp_path / "theirs.gguf"
    gw = gguf.GGUFWriter(theirs, "arch")
    gw.add_custom_alignment(64)  # also sets gguf-py's own data alignment
    gw.add_uint8("k.u8", 7)
    gw.add_int64("k.i64", -3)
    gw.add_float32("k.f32", 1.5)
    gw.add_float64("k.f64", -2.25)
    gw.add_bool("k.b", True)
    gw.add_string("k.s", "héllo")
    gw.add_key_value("k.tok", ["a", "b c"], GV.ARRAY, sub_type=GV.STRING)
    gw.add_key_value("k.ratios", [0, 0, 4, 128], GV.ARRAY, sub_type=GV.UINT32)
    gw.add_key_value("k.nested", nested, GV.ARRAY, sub_type=GV.ARRAY)
    gw.add_tensor("t.f32", f32)
    gw.add_tensor("t.f16", f16)
    gw.add_tensor("t.q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    gw.add_tensor("t.i32", i32)
    gw.write_header_to_file()
    gw.write_kv_data_to_file()
    gw.write_tensors_to_file()
    gw.close()

    ours = tmp_path / "ours.gguf"
    with GGUFWriter(ours, compute_sha256=True) as w:
        w.add_string("general.architecture", "arch")
        w.add_uint32("general.alignment", 64)
        w.add_uint8("k.u8", 7)
        w.add_int64("k.i64", -3)
        w.add_float32("k.f32", 1.5)
        w.add_float64("k.f64", -2.25)
        w.add_bool("k.b", True)
        w.add_string("k.s", "héllo")
        w.add_array("k.tok", ["a", "b c"], ValueType.STRING)
        w.add_array("k.ratios", [0, 0, 4, 128], ValueType.UINT32)
        # gguf-py types inner arrays from their first element: int -> INT32, str -> STRING, float -> FLOAT32
        w.add_array("k.nested", [MetaArray(ValueType.INT32, [1, 2]), MetaArray(ValueType.STRING, ["a"]),
                                 MetaArray(ValueType.FLOAT32, [0.5, 1.5])], ValueType.ARRAY)
        w.add_tensor("t.f32", GGMLType.F32, [5, 3])
        w.add_tensor("t.f16", "F16", [64, 2])
        w.add_tensor("t.q8", GGMLType.Q8_0, [64, 4])
        w.add_tensor("t.i32", 26, [3, 7])
        w.write_header()
        w.write_tensor("t.f32", f32)
        w.write_tensor("t.f16", [f16[:1], f16[1:]])  # chunked
        w.write_tensor("t.q8", (q8.reshape(-1)[i : i + 50] for i in range(0, q8.size, 50)))  # ragged chunks
        # big-endian arrays are converted; a non-C-contiguous buffer is written in row-major order
        w.write_tensor("t.i32", [i32[:3].astype(">i4"), memoryview(np.asfortranarray(i32[3:]))])
    assert ours.read_bytes() == theirs.read_bytes()
    assert w.sha256 == hashlib.sha256(ours.read_bytes()).hexdigest()


def test_tensor_data_offsets_and_alignment(tmp_path):
    path = tmp_path / "t.gguf"
    rng = np.random.default_rng(1)
    arrays = {"a": rng.standard_normal(3).astype(np.float32), "b": rng.standard_normal((5, 7)).astype(np.float16),
              "c": np.arange(11, dtype=np.int32)}
    types = {"a": GGMLType.F32, "b": GGMLType.F16, "c": GGMLType.I32}
    with GGUFWriter(path) as w:
        w.add_uint32("general.alignment", 128)
        planned = {n: w.add_tensor(n, types[n], a.shape[::-1]) for n, a in arrays.items()}
        w.write_header()
        assert w.data_offset % 128 == 0
        for n, a in arrays.items():
            w.write_tensor(n, a)
    f = GGUFFile(path)
    r = gguf.GGUFReader(path)
    assert f.alignment == 128
    for t in r.tensors:
        assert t.data_offset % 128 == 0
        assert t.data_offset == f.data_offset + planned[t.name].rel_offset
        np.testing.assert_array_equal(np.asarray(t.data).reshape(arrays[t.name].shape), arrays[t.name])
        np.testing.assert_array_equal(f.tensor_array(t.name), arrays[t.name])
    last = planned["c"]
    # every tensor, the last one included, is padded to the alignment
    assert f.file_size == f.data_offset + math.ceil((last.rel_offset + last.nbytes) / 128) * 128
    assert f.file_size > f.data_offset + last.rel_offset + last.nbytes


# -- errors ------------------------------------------------------------------------------------------


def _declared(tmp_path, names=("a", "b")) -> GGUFWriter:
    w = GGUFWriter(tmp_path / "e.gguf")
    for n in names:
        w.add_tensor(n, GGMLType.F32, [4])
    w.write_header()
    return w


def test_wrong_byte_count_fails_and_discards_the_file(tmp_path):
    for data in (np.zeros(5, np.float32), [bytes(8), bytes(9)], np.zeros(3, np.float32), []):
        w = _declared(tmp_path)
        with pytest.raises(GGUFError, match=r"tensor 'a' \(F32 \[4\]\) expects 16 bytes"):
            w.write_tensor("a", data)
        with pytest.raises(GGUFError, match="failed"):
            w.write_tensor("b", np.zeros(4, np.float32))
        with pytest.raises(GGUFError, match="an earlier write failed"):
            w.close()
        assert not (tmp_path / "e.gguf").exists() and not list(tmp_path.glob("*.partial"))


def test_out_of_order_unknown_and_repeated_tensors_are_refused(tmp_path):
    w = _declared(tmp_path, ("a", "b", "c"))
    with pytest.raises(GGUFError, match="'b' is out of order: the next declared tensor is 'a'"):
        w.write_tensor("b", np.zeros(4, np.float32))
    with pytest.raises(GGUFError, match="'zz' was never declared"):
        w.write_tensor("zz", np.zeros(4, np.float32))
    w.write_tensor("a", np.zeros(4, np.float32))  # a refused name leaves the writer usable
    with pytest.raises(GGUFError, match="'a' was already written"):
        w.write_tensor("a", np.zeros(4, np.float32))
    w.write_tensor("b", np.zeros(4, np.float32))
    with pytest.raises(GGUFError, match=r"1 tensor\(s\) not written, first 'c'"):
        w.close()
    assert not (tmp_path / "e.gguf").exists()


def test_declaration_errors(tmp_path):
    w = GGUFWriter(tmp_path / "d.gguf")
    w.add_tensor("x", GGMLType.Q8_0, [32, 2])
    for args, msg in [
        (("x", GGMLType.F32, [1]), "duplicate tensor name 'x'"),
        (("y", GGMLType.Q8_0, [33]), "not a multiple of the Q8_0 block size 32"),
        (("y", GGMLType.F32, [1, 1, 1, 1, 1]), "5 dims"),
        (("y", GGMLType.F32, [0]), "positive integers"),
        (("y", GGMLType.F32, [2.0]), "positive integers"),
        (("y", "NOPE", [1]), "unknown GGML type name"),
        (("y", 999, [1]), "unknown GGML type id"),
        (("n" * 64, GGMLType.F32, [1]), "longer than 63 bytes"),
        (("", GGMLType.F32, [1]), "non-empty"),
    ]:
        with pytest.raises(GGUFError, match=msg):
            w.add_tensor(*args)
    with pytest.raises(GGUFError, match="before any tensor is declared"):
        w.add_uint32("general.alignment", 64)
    with pytest.raises(GGUFError, match="cannot write tensor 'x': writer is declaring"):
        w.write_tensor("x", bytes(68))
    w.write_header()
    with pytest.raises(GGUFError, match="cannot add metadata 'late'"):
        w.add_uint32("late", 1)
    with pytest.raises(GGUFError, match="cannot declare tensor 'late'"):
        w.add_tensor("late", GGMLType.F32, [1])
    with pytest.raises(GGUFError, match="not bytes or a numpy array"):
        w.write_tensor("x", [[0] * 68])
    w.abort()
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("vtype, value, msg", [
    (ValueType.UINT8, 256, "outside"),
    (ValueType.UINT8, -1, "outside"),
    (ValueType.INT8, -129, "outside"),
    (ValueType.UINT16, 65536, "outside"),
    (ValueType.INT16, 32768, "outside"),
    (ValueType.UINT32, 2**32, "outside"),
    (ValueType.INT32, 2**31, "outside"),
    (ValueType.UINT64, 2**64, "outside"),
    (ValueType.INT64, -(2**63) - 1, "outside"),
    (ValueType.UINT32, 1.0, "not an integer"),
    (ValueType.UINT32, True, "not an integer"),
    (ValueType.UINT32, "1", "not an integer"),
    (ValueType.FLOAT32, "x", "not a real number"),
    (ValueType.FLOAT32, 1e39, "overflows float32"),
    (ValueType.FLOAT64, None, "not a real number"),
    (ValueType.BOOL, 1, "not a bool"),
    (ValueType.STRING, b"bytes", "not a str"),
    (ValueType.STRING, "\ud800", "UTF-8"),
    (13, 1, "unsupported value type 13"),
    ("u32", 1, "unsupported value type 'u32'"),
])
def test_bad_scalar_values_are_refused(tmp_path, vtype, value, msg):
    w = GGUFWriter(tmp_path / "v.gguf")
    with pytest.raises(GGUFError, match=msg) as info:
        w.add("k", vtype, value)
    assert isinstance(info.value, Ds4Error)
    assert "'k'" in str(info.value)


def test_bad_metadata_structure_is_refused(tmp_path):
    w = GGUFWriter(tmp_path / "v.gguf")
    w.add_uint32("k", 1)
    cases = [
        (lambda: w.add_uint32("k", 2), "duplicate metadata key 'k'"),
        (lambda: w.add("", ValueType.UINT32, 1), "non-empty string"),
        (lambda: w.add("a", ValueType.ARRAY, [1]), "needs its element type"),
        (lambda: w.add("a", ValueType.UINT32, 1, ValueType.UINT32), "only meaningful for ARRAY"),
        (lambda: w.add_array("a", [1, 300], ValueType.UINT8), r"'a\[1\]': 300 is not a valid UINT8"),
        (lambda: w.add_array("a", ["x", 1], ValueType.STRING), r"'a\[1\]'.*not a str"),
        (lambda: w.add_array("a", [[1]], ValueType.ARRAY), "must be MetaArray"),
        (lambda: w.add_array("a", [MetaArray(ValueType.UINT8, [-1])], ValueType.ARRAY), r"'a\[0\]\[0\]'"),
        (lambda: w.add_array("a", [MetaArray(99, [1])], ValueType.ARRAY), "unsupported value type 99"),
        (lambda: w.add_array("a", "abc", ValueType.STRING), "must be a sequence"),
        (lambda: w.add_array("a", 5, ValueType.UINT32), "must be a sequence"),
        (lambda: w.add_array("a", np.zeros((2, 2)), ValueType.FLOAT32), "1-D"),
        (lambda: w.add_uint16("general.alignment", 32), "power-of-two UINT32"),
        (lambda: w.add_uint32("general.alignment", 48), "power-of-two UINT32"),
        (lambda: w.add_uint32("general.alignment", 0), "power-of-two UINT32"),
    ]
    for call, msg in cases:
        with pytest.raises(GGUFError, match=msg):
            call()
    # a refused entry is not half-added
    w.add_array("a", np.array([1, 2], dtype=np.int64), ValueType.UINT8)
    w.write_header()
    w.close()
    assert GGUFFile(tmp_path / "v.gguf").metadata == {"k": 1, "a": [1, 2]}


def test_exception_inside_with_block_discards_partial_file(tmp_path):
    path = tmp_path / "x.gguf"
    with pytest.raises(RuntimeError):
        with GGUFWriter(path) as w:
            w.add_tensor("a", GGMLType.F32, [4])
            w.write_header()
            raise RuntimeError("boom")
    assert not list(tmp_path.iterdir())
    with pytest.raises(GGUFError, match="header was never written"):
        GGUFWriter(path).close()


def test_object_arrays_are_not_tensor_data(tmp_path):
    w = _declared(tmp_path, ("a",))
    with pytest.raises(GGUFError, match="Python objects"):
        w.write_tensor("a", np.array([0.0] * 4, dtype=object))
    w.abort()
