"""GGUF string arrays read in place (``StringArray``): list semantics, lifetime, UTF-8 checked at open.

Files are written byte by byte here so that invalid UTF-8 can be put exactly where wanted; the
expected errors come from decoding each element on its own with Python's UTF-8 codec.
"""

from __future__ import annotations

import copy
import pickle
import random
import struct
from collections.abc import Sequence

import pytest

from ds4_mlx.errors import GGUFError
from ds4_mlx.formats.gguf import GGUFFile, StringArray, ValueType


def _s(raw: bytes) -> bytes:
    return struct.pack("<Q", len(raw)) + raw


def _kv_string_array(key: str, items: Sequence[bytes]) -> bytes:
    return (_s(key.encode()) + struct.pack("<IIQ", ValueType.ARRAY, ValueType.STRING, len(items))
            + b"".join(_s(x) for x in items))


def _kv_u32(key: str, value: int) -> bytes:
    return _s(key.encode()) + struct.pack("<II", ValueType.UINT32, value)


def _gguf(kvs: list[bytes]) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs)


def _first_element_offset(data: bytes, key: str) -> int:
    """Byte offset of element 0's length in the string array ``key`` (the only array or the first)."""
    at = data.index(_s(key.encode()))
    return at + 8 + len(key.encode()) + 4 + 4 + 8


def _open(tmp_path, kvs: list[bytes], name: str = "t.gguf") -> GGUFFile:
    path = tmp_path / name
    path.write_bytes(_gguf(kvs))
    return GGUFFile(path)


ITEMS = ["", "a b", "Ġt he", "中文", "🙂", "x" * 300, "é\x00z"]


def test_string_array_behaves_as_a_read_only_list(tmp_path):
    f = _open(tmp_path, [_kv_u32("n", 1), _kv_string_array("s", [x.encode() for x in ITEMS]), _kv_u32("m", 2)])
    sa = f.metadata["s"]
    assert isinstance(sa, StringArray) and isinstance(sa, Sequence)
    assert f.fields["s"].value is sa and f.fields["s"].count == len(ITEMS)
    assert (f.metadata["n"], f.metadata["m"]) == (1, 2)  # parsing went on after the array
    assert len(sa) == len(ITEMS)
    assert [sa[i] for i in range(len(ITEMS))] == ITEMS
    assert [sa[-i] for i in range(1, len(ITEMS) + 1)] == [ITEMS[-i] for i in range(1, len(ITEMS) + 1)]
    for sl in (slice(None), slice(1, 4), slice(None, None, -2), slice(5, 100), slice(-3, None)):
        got = sa[sl]
        assert type(got) is list and got == ITEMS[sl], sl
    for bad in (len(ITEMS), -len(ITEMS) - 1):
        with pytest.raises(IndexError):
            sa[bad]
    with pytest.raises(TypeError):
        sa["0"]
    assert list(sa) == ITEMS and sa.tolist() == ITEMS and list(reversed(sa)) == ITEMS[::-1]
    assert sa == ITEMS and ITEMS == sa and not (sa != ITEMS)
    assert sa != ITEMS[:-1] and sa != ITEMS[:-1] + ["other"] and sa != tuple(ITEMS) and sa != "s"
    assert "中文" in sa and "" in sa and "zz" not in sa and 5 not in sa and "\ud800" not in sa
    assert sa.index("🙂") == ITEMS.index("🙂") and sa.count("x" * 300) == 1
    assert [sa.raw(i) for i in range(len(ITEMS))] == [x.encode() for x in ITEMS]
    assert list(sa.iter_bytes()) == [x.encode() for x in ITEMS]
    blob, offsets = sa.packed_utf8()
    assert blob == "".join(ITEMS).encode()
    assert [blob[offsets[i]:offsets[i + 1]].decode() for i in range(len(ITEMS))] == ITEMS
    assert len(offsets) == len(ITEMS) + 1 and offsets[0] == 0
    with pytest.raises(TypeError):
        hash(sa)
    for copied in (pickle.loads(pickle.dumps(sa)), copy.deepcopy(sa), copy.copy(sa)):
        assert type(copied) is list and copied == ITEMS
    assert f"{len(ITEMS)} strings" in repr(sa) and "'a b'" in repr(sa)


def test_equal_arrays_in_two_files_compare_equal(tmp_path):
    a = _open(tmp_path, [_kv_string_array("s", [x.encode() for x in ITEMS])], "a.gguf")
    # same strings at other file offsets (a key in front)
    b = _open(tmp_path, [_kv_u32("k", 7), _kv_string_array("s", [x.encode() for x in ITEMS])], "b.gguf")
    c = _open(tmp_path, [_kv_string_array("s", [x.encode() for x in ITEMS[:-1] + ["é\x00y"]])], "c.gguf")
    d = _open(tmp_path, [_kv_string_array("s", [x.encode() for x in ITEMS[:-1]])], "d.gguf")
    assert a.metadata["s"] == b.metadata["s"]
    assert a.metadata["s"] != c.metadata["s"] and a.metadata["s"] != d.metadata["s"]


def test_empty_and_long_arrays(tmp_path):
    rng = random.Random(5)
    alphabet = "aé中🙂 Ġ\n"
    many = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 12))) for _ in range(20000)]
    f = _open(tmp_path, [_kv_string_array("e", []), _kv_string_array("l", [x.encode() for x in many])])
    e, sa = f.metadata["e"], f.metadata["l"]
    assert len(e) == 0 and e == [] and list(e) == [] and e.packed_utf8()[0] == b""
    assert sa == many and sa[12345] == many[12345] and sa[-1] == many[-1]
    blob, offsets = sa.packed_utf8()
    assert blob == "".join(many).encode() and offsets[-1] == len(blob)


def test_nested_string_arrays_stay_lists(tmp_path):
    inner = [[b"x", b"yz"], [b"\xf0\x9f\x99\x82"]]
    body = struct.pack("<IIQ", ValueType.ARRAY, ValueType.ARRAY, len(inner))
    for items in inner:
        body += struct.pack("<IQ", ValueType.STRING, len(items)) + b"".join(_s(x) for x in items)
    f = _open(tmp_path, [_s(b"n") + body])
    v = f.metadata["n"]
    assert v == [["x", "yz"], ["🙂"]] and all(type(x) is list for x in v)


def test_string_array_outlives_close(tmp_path):
    f = _open(tmp_path, [_kv_string_array("s", [x.encode() for x in ITEMS])])
    sa = f.metadata["s"]
    f.close()
    assert f.closed
    assert sa == ITEMS and sa[4] == "🙂"  # the mapping lives while an array does, as for tensor views


def _expected_utf8_error(items: list[bytes], first: int) -> tuple[int, str, int] | None:
    """(element, message tail, byte offset) of the first element that does not decode on its own."""
    pos = first
    for j, raw in enumerate(items):
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            return j, f"is not valid UTF-8 ({exc.reason} at byte {exc.start} of the string)", pos
        pos += 8 + len(raw)
    return None


@pytest.mark.parametrize("items", [
    [b"ab\xc3", b"\xa9cd"],  # split sequence: together "abécd" would be valid
    [b"x\xc3", b"y" * 0x85],  # the next length's first byte (0x85) would complete the sequence
    [b"x\xe2\x82", b"\xacy"],  # a 3-byte sequence cut after 2 bytes
    [b"ok", b"\xed\xa0\x80"],  # an encoded surrogate
    [b"ok", b"\xc0\x80"],  # overlong NUL
    [b"ok", b"\xf4\x90\x80\x80"],  # beyond U+10FFFF
    [b"ok", b"fine", b"last\xff"],  # the last element
    [b"\x80"],  # a lone continuation byte
])
def test_invalid_utf8_is_rejected_at_open(tmp_path, items):
    data = _gguf([_kv_string_array("tok", items)])
    (tmp_path / "bad.gguf").write_bytes(data)
    expect = _expected_utf8_error(items, _first_element_offset(data, "tok"))
    assert expect is not None
    j, tail, offset = expect
    with pytest.raises(GGUFError) as e:
        GGUFFile(tmp_path / "bad.gguf")
    assert f"metadata 'tok'[{j}] {tail}" in str(e.value) and e.value.offset == offset


def test_invalid_utf8_anywhere_in_a_long_array(tmp_path):
    """One bad element among thousands (checked in runs of elements): found, and no other."""
    rng = random.Random(11)
    alphabet = "aé中🙂"
    bad_bytes = [b"\xff", b"\xc3", b"\xe4\xb8", b"\xed\xbf\xbf", b"\x80\x80", b"\xf0\x9f\x99"]
    base = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 9))).encode() for _ in range(30000)]
    for trial in range(12):
        items = list(base)
        k = rng.randrange(len(items)) if trial else len(items) - 1
        raw = items[k]
        cut = rng.randrange(len(raw) + 1)
        while True:  # insert at a character boundary so only the inserted bytes are at fault
            try:
                raw[:cut].decode()
                break
            except UnicodeDecodeError:
                cut -= 1
        items[k] = raw[:cut] + rng.choice(bad_bytes) + raw[cut:]
        data = _gguf([_kv_u32("n", 1), _kv_string_array("tok", items)])
        path = tmp_path / f"bad{trial}.gguf"
        path.write_bytes(data)
        j, tail, offset = _expected_utf8_error(items, _first_element_offset(data, "tok"))
        assert j == k
        with pytest.raises(GGUFError) as e:
            GGUFFile(path)
        assert f"metadata 'tok'[{j}] {tail}" in str(e.value) and e.value.offset == offset, trial


def test_length_errors_still_name_the_element(tmp_path):
    items = [b"a" * 100, b"b" * 100, b"c" * 100]
    data = bytearray(_gguf([_kv_string_array("tok", items)]))
    first = _first_element_offset(bytes(data), "tok")
    second = first + 8 + 100
    data[second : second + 8] = struct.pack("<Q", 1 << 40)
    (tmp_path / "len.gguf").write_bytes(bytes(data))
    with pytest.raises(GGUFError) as e:
        GGUFFile(tmp_path / "len.gguf")
    assert f"metadata 'tok'[1]: string length {1 << 40} runs past the end of the file" in str(e.value)
    assert e.value.offset == second
    cut = bytes(data[: second + 4])  # the file ends inside element 1's length
    (tmp_path / "cut.gguf").write_bytes(cut)
    with pytest.raises(GGUFError) as e:
        GGUFFile(tmp_path / "cut.gguf")
    assert "metadata 'tok'[1] length: needs 8 bytes but only 4 remain" in str(e.value) and e.value.offset == second
