"""GGUF v3 reader: mmap, header, metadata, tensor directory; tensor bytes are zero-copy numpy views.

Nothing is read from tensor data until a view is asked for, and even then the OS pages it in lazily,
so opening the 81 GB model costs the size of its header (~10 MB, mostly the tokenizer tables).
String arrays (the 257k tokenizer strings) are not turned into Python objects either: each becomes a
``StringArray`` holding one offset per element and decoding an element when it is read; their bounds
and UTF-8 are still checked while the file is opened.

Every structural problem raises ``GGUFError`` naming the file and the byte offset where parsing
stopped; the parser bounds every length by the bytes actually left in the file before allocating
or looping, so a corrupt count can never make it allocate or iterate absurdly: the work done on any
input is linear in the file's header size. The metadata key and tensor counts are also capped
(``MAX_METADATA_KEYS``, ``MAX_TENSORS``), since linear is not enough when each 13-byte key costs
hundreds of bytes of Python objects.
"""

from __future__ import annotations

import codecs
import hashlib
import mmap
import operator
import os
import struct
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any, overload

import numpy as np

from ds4_mlx.errors import GGUFError
from ds4_mlx.formats import mapping_guard
from ds4_mlx.formats.ggml_types import BLOCK_GEOMETRY, GGMLType

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS; ggml and gguf-py refuse more
MAX_NESTING = 8  # array-of-array depth; ds4 refuses deeper nesting too

# Arrays longer than this are not turned into Python lists: a numeric one becomes a ``NumericArray``
# (a view of the file), a nested string array a ``StringArray``. As lists, a 100 MB array cost 2.1 GB
# of Python objects; shorter ones cost at most tens of MB. It is above every tokenizer cap below, so
# the arrays a model needs (token types: 129,280 in DS4 Flash) are still plain lists.
LAZY_ARRAY_MIN = 1 << 21
# Element counts of the arrays a model needs, refused beyond a generous cap as soon as the count is
# read, before anything is allocated (DS4 Flash: 129,280 tokens and types, 127,741 merges).
KNOWN_ARRAY_LIMITS = {
    "tokenizer.ggml.tokens": 1 << 21,
    "tokenizer.ggml.token_type": 1 << 21,
    "tokenizer.ggml.scores": 1 << 21,
    "tokenizer.ggml.merges": 1 << 21,
}
# Arrays of arrays become one Python list per element (~60 bytes for a 12-byte empty array in the
# file); no GGUF a model uses has them, so their element count is capped.
MAX_NESTED_ARRAYS = 1 << 16

# Caps on the header's two counts, refused from the header alone before a key or tensor is read.
# Bounding a count by the bytes left (below) is not enough: a key can be 13 bytes, and each one read
# costs ~400 bytes of Python objects and a few microseconds, so a 65 MB header declaring and holding
# 5 M keys took 90 s and 2.2 GB before being refused. Real files are far below both caps: the DS4
# Flash GGUFs hold ~60 keys (the generator in ds4_mlx/synth.py writes 52) and 1,331 tensors (43
# layers); the tensor cap also admits the largest model the config accepts (block_count 1024 x at
# most 35 tensors a layer + 6 global ones = 35,846). At the caps, parsing costs under a second and
# a few tens of MB.
MAX_METADATA_KEYS = 1 << 16
MAX_TENSORS = 1 << 16

# Smallest possible encodings, used to reject impossible counts before looping over them:
# a KV entry is key length (8) + value type (4) + at least one value byte; a tensor info is
# name length (8) + n_dims (4) + one dim (8) + type (4) + offset (8).
_MIN_KV_BYTES = 13
_MIN_TENSOR_INFO_BYTES = 32


class ValueType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


_SCALAR = {
    ValueType.UINT8: struct.Struct("<B"),
    ValueType.INT8: struct.Struct("<b"),
    ValueType.UINT16: struct.Struct("<H"),
    ValueType.INT16: struct.Struct("<h"),
    ValueType.UINT32: struct.Struct("<I"),
    ValueType.INT32: struct.Struct("<i"),
    ValueType.FLOAT32: struct.Struct("<f"),
    ValueType.BOOL: struct.Struct("<B"),
    ValueType.UINT64: struct.Struct("<Q"),
    ValueType.INT64: struct.Struct("<q"),
    ValueType.FLOAT64: struct.Struct("<d"),
}
_U32 = _SCALAR[ValueType.UINT32]
_U64 = _SCALAR[ValueType.UINT64]

# numpy dtype of each fixed-width element type (bool is handled apart: only 0 and 1 are valid)
_NUMPY = {
    ValueType.UINT8: np.dtype("<u1"),
    ValueType.INT8: np.dtype("<i1"),
    ValueType.UINT16: np.dtype("<u2"),
    ValueType.INT16: np.dtype("<i2"),
    ValueType.UINT32: np.dtype("<u4"),
    ValueType.INT32: np.dtype("<i4"),
    ValueType.FLOAT32: np.dtype("<f4"),
    ValueType.UINT64: np.dtype("<u8"),
    ValueType.INT64: np.dtype("<i8"),
    ValueType.FLOAT64: np.dtype("<f8"),
    ValueType.BOOL: np.dtype("<u1"),
}

# Plain element types whose tensor data maps onto one numpy dtype (BF16 has none: raw uint16).
_PLAIN_TENSOR_DTYPES = {
    GGMLType.F32: np.dtype("<f4"),
    GGMLType.F16: np.dtype("<f2"),
    GGMLType.BF16: np.dtype("<u2"),
    GGMLType.F64: np.dtype("<f8"),
    GGMLType.I8: np.dtype("<i1"),
    GGMLType.I16: np.dtype("<i2"),
    GGMLType.I32: np.dtype("<i4"),
    GGMLType.I64: np.dtype("<i8"),
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: GGMLType
    ne: tuple[int, ...]  # GGUF order, ne[0] fastest
    offset: int  # absolute byte offset in the file
    nbytes: int
    info_offset: int  # where this tensor's directory entry starts (for error messages)

    @property
    def shape(self) -> tuple[int, ...]:
        """Row-major (numpy/MLX) shape: the reverse of ``ne``."""
        return tuple(reversed(self.ne))

    @property
    def n_dims(self) -> int:
        return len(self.ne)

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.ne:
            n *= d
        return n

    @property
    def row_bytes(self) -> int:
        elems, nbytes = BLOCK_GEOMETRY[self.ggml_type]
        return self.ne[0] // elems * nbytes


@dataclass(frozen=True)
class MetadataField:
    key: str
    type: ValueType
    sub_type: ValueType | None  # element type for arrays (outermost level)
    value: Any
    offset: int  # where the entry (its key) starts
    value_offset: int = -1  # first value byte; for arrays, the first element (after type and count)

    @property
    def count(self) -> int | None:
        """Element count for arrays, None for scalars."""
        return len(self.value) if self.type == ValueType.ARRAY else None


class StringArray(Sequence[str]):
    """A GGUF string array read in place: a read-only ``Sequence[str]`` decoded element by element.

    The file stores each element as a u64 byte length followed by that many UTF-8 bytes. Only the
    position of each length is kept (``count + 1`` int64, the last one where the array ends), so
    the 129k-token vocabulary costs 1 MB instead of ~15 MB of Python strings, and nothing is decoded
    until read. Every element's bounds and UTF-8 were checked when the file was opened, so reading
    never fails. Compares equal to a list of the same strings; slicing returns a list.

    The array holds a buffer export of the mapping, so, like a tensor view, it stays readable after
    ``GGUFFile.close()`` (the mapping goes away with the last of them).
    """

    __slots__ = ("_buf", "_pin", "_off")

    def __init__(self, buf: Any, offsets: np.ndarray):
        self._buf = buf  # sliced directly: an mmap slice is a bytes object in one step
        self._pin = memoryview(buf)
        self._off = offsets

    def __len__(self) -> int:
        return len(self._off) - 1

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[k] for k in range(*index.indices(len(self)))]
        return self.raw(index).decode("utf-8")

    def raw(self, index: int) -> bytes:
        """Element ``index`` as its UTF-8 bytes."""
        i = operator.index(index)
        n = len(self._off) - 1
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"StringArray index {index} out of range for {n} strings")
        return self._buf[int(self._off[i]) + 8 : int(self._off[i + 1])]

    def iter_bytes(self) -> Iterator[bytes]:
        """Every element as UTF-8 bytes, in order."""
        buf, off, n = self._buf, self._off, len(self)
        for k in range(0, n, _RUN):
            pos = off[k : k + _RUN + 1].tolist()
            for a, b in zip(pos, pos[1:]):
                yield buf[a + 8 : b]

    def __iter__(self) -> Iterator[str]:
        for raw in self.iter_bytes():
            yield raw.decode("utf-8")

    def __contains__(self, value: object) -> bool:
        if not isinstance(value, str):
            return False
        try:
            target = value.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate is never a stored string
            return False
        return any(raw == target for raw in self.iter_bytes())

    def packed_utf8(self) -> tuple[bytes, array]:
        """All elements' UTF-8 back to back, and ``count + 1`` offsets into it (``array('q')``, the
        first 0): element i is ``blob[offsets[i]:offsets[i + 1]]``. A compact copy, independent of
        the file, made a run of elements at a time so no temporary is large."""
        off, n, buf = self._off, len(self), self._buf
        packed = array("q", [0]) * (n + 1)
        view = np.frombuffer(packed, dtype=np.int64)
        base = int(off[0])
        pieces = []
        for k in range(0, n, _RUN):
            pos = off[k : k + _RUN + 1].tolist()
            pieces.append(b"".join([buf[a + 8 : b] for a, b in zip(pos, pos[1:])]))
            # packed, element i starts 8 bytes earlier than in the file per length prefix before it
            idx = np.arange(k + 1, k + len(pos))
            view[idx] = off[idx] - base - 8 * idx
        del view  # release the export: the array is returned
        return b"".join(pieces), packed

    def tolist(self) -> list[str]:
        return list(self)

    def _stored(self) -> bytes:
        return self._buf[int(self._off[0]) : int(self._off[-1])]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StringArray):
            # the stored bytes include every length, so they are equal exactly when all elements are
            return len(self) == len(other) and self._stored() == other._stored()
        if isinstance(other, list):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # compares equal to (unhashable) lists

    def __reduce__(self):
        return (list, (self.tolist(),))  # pickled or deep-copied, it is the plain list

    def __repr__(self) -> str:
        head = ", ".join(repr(s) for s in self[:3])
        return f"StringArray([{head}{', ...' if len(self) > 3 else ''}], {len(self)} strings)"


class NumericArray(Sequence):
    """A long numeric GGUF array read in place: a read-only ``Sequence`` of Python numbers backed by
    a numpy view of the mapping, so opening a file with a huge array costs no memory. Compares equal
    to a list of the same values; slicing returns a list; ``numpy()`` gives the (read-only) view.
    Like a tensor view, it stays readable after ``GGUFFile.close()``."""

    __slots__ = ("_arr",)

    def __init__(self, arr: np.ndarray):
        self._arr = arr

    def __len__(self) -> int:
        return len(self._arr)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self._arr[index].tolist()
        i = operator.index(index)
        n = len(self._arr)
        if not -n <= i < n:
            raise IndexError(f"NumericArray index {index} out of range for {n} values")
        return self._arr[i].item()

    def __iter__(self) -> Iterator:
        for k in range(0, len(self._arr), _RUN):
            yield from self._arr[k : k + _RUN].tolist()

    def numpy(self) -> np.ndarray:
        return self._arr

    def tolist(self) -> list:
        return self._arr.tolist()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, NumericArray):
            return len(self) == len(other) and bool(np.array_equal(self._arr, other._arr))
        if isinstance(other, list):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self):
        return (list, (self.tolist(),))

    def __repr__(self) -> str:
        head = ", ".join(repr(v) for v in self[:3])
        return f"NumericArray([{head}, ...], {len(self)} {self._arr.dtype.name})"


# String arrays are checked and copied a run of elements at a time, runs of about this many bytes
# or elements: every temporary stays well under the allocator's mmap threshold, so none lingers.
_UTF8_CHUNK = 1 << 16
_RUN = 4096


def _first_invalid_utf8(buf: Any, offsets: np.ndarray) -> int | None:
    """Index of the first string-array element that is not valid UTF-8, or None.

    Decoding element by element would build every Python string; instead a copy of a run of
    elements, with their 8-byte length prefixes zeroed, is decoded in one call. A NUL byte is a
    complete character that neither continues nor can be continued by a multi-byte sequence, so the
    zeroed prefixes separate the elements: the run is valid UTF-8 exactly when each element is.
    """
    n = len(offsets) - 1
    i = 0
    while i < n:
        j = int(np.searchsorted(offsets, offsets[i] + _UTF8_CHUNK, side="right")) - 1
        j = min(max(j, i + 1), n)
        a, b = int(offsets[i]), int(offsets[j])
        run = np.frombuffer(buf, dtype=np.uint8, count=b - a, offset=a).copy()
        rel = offsets[i:j] - a
        for k in range(8):
            run[rel + k] = 0
        try:
            codecs.utf_8_decode(run, "strict", True)
        except UnicodeDecodeError as exc:
            return i + int(np.searchsorted(rel, exc.start, side="right")) - 1
        i = j
    return None


class _Cursor:
    """Bounds-checked little-endian reads from the mapped file."""

    def __init__(self, buf, path: str):
        self.buf = buf
        self.size = len(buf)
        self.pos = 0
        self.path = path

    def fail(self, message: str, offset: int | None = None):
        raise GGUFError(message, path=self.path, offset=self.pos if offset is None else offset)

    def need(self, n: int, what: str) -> None:
        if n < 0 or n > self.size - self.pos:
            self.fail(f"{what}: needs {n} bytes but only {self.size - self.pos} remain "
                      f"(file is {self.size} bytes; truncated or corrupt)")

    def scalar(self, vtype: ValueType, what: str):
        st = _SCALAR[vtype]
        self.need(st.size, what)
        (v,) = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return v

    def u32(self, what: str) -> int:
        return self.scalar(ValueType.UINT32, what)

    def u64(self, what: str) -> int:
        return self.scalar(ValueType.UINT64, what)

    def string(self, what: str) -> str:
        start = self.pos
        n = self.u64(f"{what} length")
        self.need(n, f"{what} ({n} bytes)")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            self.fail(f"{what} is not valid UTF-8 ({exc.reason} at byte {exc.start} of the string)", start)

    def string_array(self, count: int, what: str) -> StringArray:
        """``count`` length-prefixed strings: bounds walked in one tight loop (the tokenizer tables
        hold ~257k), UTF-8 checked in bulk, nothing decoded."""
        buf, size, pos = self.buf, self.size, self.pos
        unpack = _U64.unpack_from
        offsets = array("q")  # grown as elements check out: a corrupt count allocates nothing
        append = offsets.append
        j = 0
        try:
            for j in range(count):
                append(pos)
                (n,) = unpack(buf, pos)
                end = pos + 8 + n
                if end > size:
                    self.pos = pos
                    self.fail(f"{what}[{j}]: string length {n} runs past the end of the file "
                              f"(only {size - pos - 8} bytes remain)")
                pos = end
        except struct.error:
            self.pos = pos
            self.fail(f"{what}[{j}] length: needs 8 bytes but only {size - pos} remain "
                      f"(file is {size} bytes; truncated or corrupt)")
        append(pos)
        offs = np.frombuffer(offsets, dtype=np.int64)
        bad = _first_invalid_utf8(buf, offs)
        if bad is not None:
            start = int(offs[bad])
            try:
                buf[start + 8 : int(offs[bad + 1])].decode("utf-8")
            except UnicodeDecodeError as exc:
                self.fail(f"{what}[{bad}] is not valid UTF-8 ({exc.reason} at byte {exc.start} of the string)",
                          start)
            raise AssertionError("a string array failed bulk UTF-8 validation but the element decodes")
        self.pos = pos
        return StringArray(buf, offs)


class GGUFFile:
    """A GGUF v3 file opened read-only by mmap.

    ``metadata`` maps keys to Python values (scalars as int/float/bool/str, arrays as lists, nested
    arrays as nested lists), except that a top-level string array is a ``StringArray`` (a lazily
    decoded ``Sequence[str]`` that equals the list of its strings), and any array of more than
    ``LAZY_ARRAY_MIN`` elements is a ``StringArray`` or ``NumericArray`` read in place (so a huge
    array costs no memory); ``fields`` keeps each key's
    declared GGUF types and byte offsets; ``tensors`` is the ordered tensor directory. Numeric
    arrays are also reachable without a copy through ``metadata_array``.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self._mm = None
        self._fh = None
        self._guarded = False
        try:
            self._fh = open(self.path, "rb")
        except OSError as exc:
            raise GGUFError(f"cannot open: {exc.strerror or exc}", path=self.path) from None
        try:
            size = os.fstat(self._fh.fileno()).st_size
            if size == 0:
                raise GGUFError("empty file, not a GGUF", path=self.path, offset=0)
            try:
                self._mm = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as exc:
                raise GGUFError(f"cannot mmap: {exc}", path=self.path) from None
            self.file_size = len(self._mm)
            self._parse()
        except BaseException:
            self.close()
            raise

    # -- parsing ---------------------------------------------------------------------------------

    def _parse(self) -> None:
        cur = _Cursor(self._mm, self.path)
        cur.need(4, "magic")
        magic = self._mm[0:4]
        if magic != GGUF_MAGIC:
            cur.fail(f"bad magic {magic!r}, expected b'GGUF' (not a GGUF file)", 0)
        cur.pos = 4
        self.version = cur.u32("version")
        if self.version != GGUF_VERSION:
            cur.fail(f"unsupported GGUF version {self.version} (only version {GGUF_VERSION} is supported)", 4)
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("metadata count")
        remaining = self.file_size - cur.pos
        need_kv = n_kv * _MIN_KV_BYTES
        need_ti = n_tensors * _MIN_TENSOR_INFO_BYTES
        if need_kv > remaining:
            cur.fail(f"metadata count {n_kv} is impossible: it needs at least {need_kv} bytes but the file has "
                     f"only {remaining} left (corrupt count, or the file is truncated)", 16)
        if need_ti > remaining:
            cur.fail(f"tensor count {n_tensors} is impossible: it needs at least {need_ti} bytes but the file has "
                     f"only {remaining} left (corrupt count, or the file is truncated)", 8)
        if need_kv + need_ti > remaining:
            cur.fail(f"metadata count {n_kv} and tensor count {n_tensors} need at least {need_kv + need_ti} bytes "
                     f"but the file has only {remaining} left (corrupt counts, or the file is truncated)", 8)
        # After the byte bounds above, so a count no file could hold keeps its "impossible" message;
        # both before the first key is read (see MAX_METADATA_KEYS for why the caps exist).
        if n_kv > MAX_METADATA_KEYS:
            cur.fail(f"metadata_kv_count {n_kv:,} is more than the {MAX_METADATA_KEYS:,} metadata keys allowed "
                     f"(a DS4 Flash GGUF holds about 60; corrupt or hostile header)", 16)
        if n_tensors > MAX_TENSORS:
            cur.fail(f"tensor_count {n_tensors:,} is more than the {MAX_TENSORS:,} tensors allowed "
                     f"(a DS4 Flash GGUF holds 1,331; corrupt or hostile header)", 8)
        self.n_kv = n_kv
        self.n_tensors = n_tensors

        self.fields: dict[str, MetadataField] = {}
        for i in range(n_kv):
            start = cur.pos
            key = cur.string(f"metadata key #{i}")
            if key in self.fields:
                cur.fail(f"duplicate metadata key {_q(key)} (first at byte offset {self.fields[key].offset})", start)
            vtype = self._value_type(cur, cur.u32(f"type of metadata {_q(key)}"), f"metadata {_q(key)}")
            value_start = cur.pos
            value, sub = self._read_value(cur, vtype, f"metadata {_q(key)}", depth=0, key=key)
            if vtype == ValueType.ARRAY:
                value_start += 12  # skip the element type and count
            self.fields[key] = MetadataField(key, vtype, sub, value, start, value_start)
        self.metadata: dict[str, Any] = {k: f.value for k, f in self.fields.items()}

        self.alignment = DEFAULT_ALIGNMENT
        align_field = self.fields.get("general.alignment")
        if align_field is not None:
            a = align_field.value
            # ggml and gguf-py refuse anything but a power of two (ds4 takes any non-zero value).
            if align_field.type != ValueType.UINT32 or a == 0 or a & (a - 1):
                cur.fail(f"general.alignment must be a power-of-two u32, found {align_field.type.name} {a!r}",
                         align_field.offset)
            self.alignment = a

        infos = []
        names: dict[str, int] = {}
        for i in range(n_tensors):
            start = cur.pos
            name = cur.string(f"tensor #{i} name")
            if name in names:
                cur.fail(f"duplicate tensor name {_q(name)} (first at byte offset {names[name]})", start)
            names[name] = start
            n_dims = cur.u32(f"tensor {_q(name)} dimension count")
            if not 1 <= n_dims <= MAX_DIMS:
                cur.fail(f"tensor {_q(name)} has {n_dims} dimensions (1..{MAX_DIMS} allowed)", cur.pos - 4)
            ne = tuple(cur.u64(f"tensor {_q(name)} dim {d}") for d in range(n_dims))
            raw_type = cur.u32(f"tensor {_q(name)} type")
            try:
                gtype = GGMLType(raw_type)
            except ValueError:
                cur.fail(f"tensor {_q(name)} has unknown GGML type id {raw_type}", cur.pos - 4)
            rel = cur.u64(f"tensor {_q(name)} offset")
            infos.append((name, ne, gtype, rel, start))

        self.info_end = cur.pos
        self.data_offset = _align(cur.pos, self.alignment)
        if infos and self.data_offset > self.file_size:
            cur.fail(f"tensor data would start at {self.data_offset}, past the end of the file "
                     f"({self.file_size} bytes; truncated)")

        self.tensors: dict[str, TensorInfo] = {}
        for name, ne, gtype, rel, start in infos:
            if 0 in ne:
                cur.fail(f"tensor {_q(name)} has a zero dimension, ne={list(ne)}", start)
            elems, bbytes = BLOCK_GEOMETRY[gtype]
            if ne[0] % elems:
                cur.fail(f"tensor {_q(name)}: row length ne[0]={ne[0]} is not a multiple of the "
                         f"{gtype.name} block size {elems}", start)
            n = 1
            for d in ne:
                n *= d
            nbytes = n // elems * bbytes
            if rel % self.alignment:
                cur.fail(f"tensor {_q(name)}: data offset {rel} is not a multiple of the alignment {self.alignment}",
                         start)
            offset = self.data_offset + rel
            if offset + nbytes > self.file_size:
                cur.fail(f"tensor {_q(name)}: data [{offset}, {offset + nbytes}) runs past the end of the file "
                         f"({self.file_size} bytes; truncated, or a wrong offset or shape)", start)
            self.tensors[name] = TensorInfo(name, gtype, ne, offset, nbytes, start)
        self._check_overlaps()

    def _check_overlaps(self) -> None:
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in self.tensors.values())
        for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
            if s1 < e0:
                raise GGUFError(f"tensor {_q(n1)} data [{s1}, {e1}) overlaps tensor {_q(n0)} [{s0}, {e0})",
                                path=self.path, offset=self.tensors[n1].info_offset)

    @staticmethod
    def _value_type(cur: _Cursor, raw: int, what: str) -> ValueType:
        try:
            return ValueType(raw)
        except ValueError:
            cur.fail(f"{what} has unknown value type {raw}", cur.pos - 4)

    def _read_value(self, cur: _Cursor, vtype: ValueType, what: str, depth: int, key: str = ""):
        if vtype == ValueType.STRING:
            return cur.string(f"{what} string"), None
        if vtype != ValueType.ARRAY:
            v = cur.scalar(vtype, f"{what} {vtype.name}")
            if vtype == ValueType.BOOL:
                if v > 1:
                    cur.fail(f"{what}: bool byte is {v}, expected 0 or 1", cur.pos - 1)
                v = bool(v)
            return v, None

        if depth >= MAX_NESTING:
            cur.fail(f"{what}: arrays nested deeper than {MAX_NESTING} levels")
        sub = self._value_type(cur, cur.u32(f"{what} array element type"), f"{what} array element")
        count = cur.u64(f"{what} array length")
        # Bounded by the bytes left before anything is allocated or looped over; strings and nested
        # arrays take at least 8 bytes per element (a length, or a type and a count).
        cur.need(count * (_NUMPY[sub].itemsize if sub in _NUMPY else 8), f"{what} array of {count} {sub.name}")
        limit = KNOWN_ARRAY_LIMITS.get(key) if depth == 0 else None
        if limit is not None and count > limit:
            cur.fail(f"{what} declares {count} elements, more than the {limit} allowed for this key", cur.pos - 8)
        if sub in _NUMPY:
            dt = _NUMPY[sub]
            arr = np.frombuffer(self._mm, dtype=dt, count=count, offset=cur.pos)
            if sub == ValueType.BOOL:
                for k in range(0, count, _UTF8_CHUNK):  # in runs: no temporary as large as the array
                    bad = np.flatnonzero(arr[k : k + _UTF8_CHUNK] > 1)
                    if bad.size:
                        j = k + int(bad[0])
                        cur.fail(f"{what}[{j}]: bool byte is {int(arr[j])}, expected 0 or 1", cur.pos + j)
                arr = arr.view(np.bool_)
            cur.pos += count * dt.itemsize
            if count > LAZY_ARRAY_MIN:
                return NumericArray(arr), sub
            out = arr.tolist()
            del arr  # drop the buffer export so close() can unmap
            return out, sub
        if sub == ValueType.STRING:
            strings = cur.string_array(count, what)
            # short nested arrays stay plain lists (rare and small; consumers walk them as lists)
            return (strings if depth == 0 or count > LAZY_ARRAY_MIN else strings.tolist()), sub
        if count > MAX_NESTED_ARRAYS:
            cur.fail(f"{what}: array of {count} arrays, more than the {MAX_NESTED_ARRAYS} allowed", cur.pos - 8)
        out = []
        for j in range(count):
            v, _ = self._read_value(cur, sub, f"{what}[{j}]", depth + 1)
            out.append(v)
        return out, sub

    # -- access ----------------------------------------------------------------------------------

    def _buffer(self):
        if self._mm is None:
            raise GGUFError("file is closed", path=self.path)
        return self._mm

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"no tensor named {name!r}", path=self.path) from None

    def tensor_data(self, name: str) -> np.ndarray:
        """The tensor's raw bytes as a read-only 1-D uint8 view into the mapping (no copy)."""
        t = self.tensor(name)
        return np.frombuffer(self._buffer(), dtype=np.uint8, count=t.nbytes, offset=t.offset)

    def tensor_array(self, name: str) -> np.ndarray:
        """Zero-copy typed view: F32/F16/I32/... (BF16 as uint16) reshaped to ``shape``; block types
        as uint8 ``(*shape[:-1], row_bytes)``."""
        t = self.tensor(name)
        raw = self.tensor_data(name)
        dt = _PLAIN_TENSOR_DTYPES.get(t.ggml_type)
        if dt is not None:
            return raw.view(dt).reshape(t.shape)
        return raw.reshape(*t.shape[:-1], t.row_bytes)

    def metadata_array(self, key: str) -> np.ndarray:
        """A numeric metadata array as a read-only numpy view of the file (no copy)."""
        f = self.fields.get(key)
        if f is None:
            raise GGUFError(f"no metadata key {key!r}", path=self.path)
        if f.type != ValueType.ARRAY or f.sub_type not in _NUMPY:
            kind = f.type.name if f.type != ValueType.ARRAY else f"array of {f.sub_type.name}"
            raise GGUFError(f"metadata {key!r} is {kind}, not a numeric array", path=self.path, offset=f.offset)
        arr = np.frombuffer(self._buffer(), dtype=_NUMPY[f.sub_type], count=len(f.value), offset=f.value_offset)
        return arr.view(np.bool_) if f.sub_type == ValueType.BOOL else arr

    @property
    def tensor_bytes(self) -> int:
        """Sum of the bytes described by the tensor directory."""
        return sum(t.nbytes for t in self.tensors.values())

    def fingerprint(self, samples: int = 16, sample_bytes: int = 1 << 16) -> str:
        """A short hex digest naming this file's content for comparing copies on other machines: the
        size, the whole header (metadata, tokenizer, tensor directory) and ``samples`` evenly spaced
        ``sample_bytes`` windows of the tensor data. A few MiB read however big the file, so two
        different models or quantizations always differ, and different weights under one layout
        almost always do; a single corrupted byte can go unseen (the download's sha256 check is what covers
        every byte)."""
        mm = self._buffer()
        h = hashlib.sha256(str(self.file_size).encode())
        h.update(mm[:self.data_offset])
        span = self.file_size - self.data_offset
        for i in range(samples if span > 0 else 0):
            start = self.data_offset + (span - min(span, sample_bytes)) * i // max(1, samples - 1)
            h.update(mm[start:start + sample_bytes])
        return h.hexdigest()[:16]

    def drop_pages(self, view: np.ndarray) -> None:
        """Tell the kernel the mapped pages wholly under ``view`` (a view of this file's tensor data,
        one contiguous range) are not needed by this process (``MADV_DONTNEED``): they leave its
        resident set, the page cache keeps them (a later read is a minor fault). A bounded expert
        cache calls it after copying slabs out, so the mapping's pages do not pile up in its RSS.
        No-op where madvise is unavailable or the view is not of this mapping."""
        mm = self._mm
        if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED") or view.size == 0:
            return
        base = np.frombuffer(mm, dtype=np.uint8, count=1).__array_interface__["data"][0]
        start = view.__array_interface__["data"][0] - base
        end = start + view.nbytes
        if start < 0 or end > self.file_size:
            return
        page = mmap.PAGESIZE
        lo, hi = -(-start // page) * page, end // page * page
        if hi > lo:
            mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    @property
    def closed(self) -> bool:
        return self._mm is None

    def check_intact(self) -> None:
        """Raise GGUFError naming the file if it shrank since it was opened.

        Reading a mapped page past the new end of a truncated file kills the process with SIGBUS,
        which nothing in Python can catch; this ``fstat`` is cheap enough to call before each batch
        of weight reads (each layer), so truncation between reads is a clean error instead. The
        file being cut during a read remains a race: see ``mapping_guard``."""
        fh = self._fh
        if fh is None:
            return
        try:
            now = os.fstat(fh.fileno()).st_size
        except (OSError, ValueError) as exc:
            raise GGUFError(f"cannot check the file is still intact: {exc}", path=self.path) from None
        if now < self.file_size:
            raise GGUFError(f"the file shrank from {self.file_size:,} to {now:,} bytes while in use (truncated "
                            f"or rewritten in place); its tensors can no longer be read", path=self.path)

    def guard(self) -> bool:
        """Have a SIGBUS from this file's mapping (the file truncated during a read) end the process
        with one line naming the file (``mapping_guard``). True when the guard runs."""
        if not self._guarded and self._mm is not None:
            self._guarded = mapping_guard.watch(self)
        return self._guarded

    def close(self) -> None:
        if self._guarded:
            self._guarded = False
            mapping_guard.forget(self)
        mm = self._mm
        if mm is not None:
            self._mm = None
            try:
                mm.close()
            except BufferError:
                # numpy views or string arrays still reference the mapping; it is unmapped when
                # the last one dies.
                pass
        fh = self._fh
        if fh is not None:
            self._fh = None
            fh.close()

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFFile({Path(self.path).name!r}, {len(self.fields)} keys, {len(self.tensors)} tensors)"


def _q(name: str, limit: int = 96) -> str:
    """A key or tensor name quoted for a message; a corrupt length can make one megabytes long."""
    if len(name) <= limit:
        return repr(name)
    return repr(name[:limit]) + f"... ({len(name)} characters)"


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a
