"""GGUF v3 reader: mmap, header, metadata, tensor directory; tensor bytes are zero-copy numpy views.

Nothing is read from tensor data until a view is asked for, and even then the OS pages it in lazily,
so opening the 81 GB model costs the size of its header (~10 MB, mostly the tokenizer tables).

Every structural problem raises ``GGUFError`` naming the file and the byte offset where parsing
stopped; the parser bounds every length by the bytes actually left in the file before allocating,
so a corrupt count can never make it allocate or loop absurdly.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

import numpy as np

from ds4_mlx.errors import GGUFError
from ds4_mlx.formats.ggml_types import BLOCK_GEOMETRY, GGMLType

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4


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


# struct format of each fixed-size scalar type
_SCALAR = {
    ValueType.UINT8: "<B",
    ValueType.INT8: "<b",
    ValueType.UINT16: "<H",
    ValueType.INT16: "<h",
    ValueType.UINT32: "<I",
    ValueType.INT32: "<i",
    ValueType.FLOAT32: "<f",
    ValueType.BOOL: "<B",
    ValueType.UINT64: "<Q",
    ValueType.INT64: "<q",
    ValueType.FLOAT64: "<d",
}
_NUMPY = {
    ValueType.UINT8: "<u1",
    ValueType.INT8: "<i1",
    ValueType.UINT16: "<u2",
    ValueType.INT16: "<i2",
    ValueType.UINT32: "<u4",
    ValueType.INT32: "<i4",
    ValueType.FLOAT32: "<f4",
    ValueType.UINT64: "<u8",
    ValueType.INT64: "<i8",
    ValueType.FLOAT64: "<f8",
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
    offset: int


class _Cursor:
    """Bounds-checked little-endian reads from the mapped file."""

    def __init__(self, buf, path: str):
        self.buf = buf
        self.size = len(buf)
        self.pos = 0
        self.path = path

    def fail(self, message: str, offset: int | None = None):
        raise GGUFError(message, path=self.path, offset=self.pos if offset is None else offset)

    def need(self, n: int, what: str):
        if n < 0 or self.pos + n > self.size:
            self.fail(f"{what}: needs {n} bytes but only {self.size - self.pos} remain (file is {self.size} bytes)")

    def scalar(self, vtype: ValueType, what: str):
        fmt = _SCALAR[vtype]
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def u32(self, what: str) -> int:
        return self.scalar(ValueType.UINT32, what)

    def u64(self, what: str) -> int:
        return self.scalar(ValueType.UINT64, what)

    def string(self, what: str) -> str:
        start = self.pos
        n = self.u64(f"{what} length")
        self.need(n, f"{what} ({n} bytes)")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            self.fail(f"{what} is not valid UTF-8 ({exc.reason} at byte {exc.start})", start)


class GGUFFile:
    """A GGUF v3 file opened read-only by mmap.

    ``metadata`` maps keys to Python values (arrays become lists, numeric arrays numpy arrays
    only via ``metadata_array``); ``fields`` keeps the declared types for validation;
    ``tensors`` is the ordered tensor directory.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        try:
            self._fh = open(self.path, "rb")
        except OSError as exc:
            raise GGUFError(f"cannot open: {exc.strerror or exc}", path=self.path) from None
        try:
            size = os.fstat(self._fh.fileno()).st_size
            if size == 0:
                raise GGUFError("empty file, not a GGUF", path=self.path, offset=0)
            self._mm = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ)
            self.file_size = size
            self._parse()
        except BaseException:
            self.close()
            raise

    # -- parsing ---------------------------------------------------------------------------------

    def _parse(self) -> None:
        cur = _Cursor(self._mm, self.path)
        cur.need(4, "magic")
        magic = bytes(self._mm[0:4])
        if magic != GGUF_MAGIC:
            cur.fail(f"bad magic {magic!r}, expected b'GGUF' (not a GGUF file)", 0)
        cur.pos = 4
        self.version = cur.u32("version")
        if self.version != GGUF_VERSION:
            cur.fail(f"unsupported GGUF version {self.version} (only version 3 is supported)", 4)
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("metadata count")
        # Each KV entry needs at least 8+1+4+1 bytes and each tensor info at least 8+1+4+8+4+8:
        # reject counts the file cannot possibly hold before looping over them.
        remaining = self.file_size - cur.pos
        if n_kv * 13 > remaining:
            cur.fail(f"metadata count {n_kv} is impossible: the file has only {remaining} bytes left", 16)
        if n_tensors * 33 > remaining:
            cur.fail(f"tensor count {n_tensors} is impossible: the file has only {remaining} bytes left", 8)

        self.fields: dict[str, MetadataField] = {}
        for i in range(n_kv):
            start = cur.pos
            key = cur.string(f"metadata key #{i}")
            vtype = self._value_type(cur, cur.u32(f"type of metadata {key!r}"), key)
            value, sub = self._read_value(cur, vtype, key, depth=0)
            if key in self.fields:
                cur.fail(f"duplicate metadata key {key!r}", start)
            self.fields[key] = MetadataField(key, vtype, sub, value, start)
        self.metadata: dict[str, Any] = {k: f.value for k, f in self.fields.items()}

        align_field = self.fields.get("general.alignment")
        self.alignment = DEFAULT_ALIGNMENT
        if align_field is not None:
            a = align_field.value
            if align_field.type != ValueType.UINT32 or not isinstance(a, int) or a <= 0 or a & (a - 1):
                cur.fail(f"general.alignment must be a positive power-of-two u32, found {a!r}", align_field.offset)
            self.alignment = a

        infos = []
        for i in range(n_tensors):
            start = cur.pos
            name = cur.string(f"tensor #{i} name")
            n_dims = cur.u32(f"tensor {name!r} dimension count")
            if not 1 <= n_dims <= MAX_DIMS:
                cur.fail(f"tensor {name!r} has {n_dims} dimensions (1..{MAX_DIMS} allowed)", cur.pos - 4)
            ne = tuple(cur.u64(f"tensor {name!r} dim {d}") for d in range(n_dims))
            raw_type = cur.u32(f"tensor {name!r} type")
            try:
                gtype = GGMLType(raw_type)
            except ValueError:
                cur.fail(f"tensor {name!r} has unknown GGML type id {raw_type}", cur.pos - 4)
            rel = cur.u64(f"tensor {name!r} offset")
            infos.append((name, ne, gtype, rel, start))

        self.data_offset = _align(cur.pos, self.alignment)
        if self.data_offset > self.file_size and infos:
            cur.fail(f"tensor data would start at {self.data_offset}, past the end of the file ({self.file_size} bytes)")

        self.tensors: dict[str, TensorInfo] = {}
        for name, ne, gtype, rel, start in infos:
            if name in self.tensors:
                cur.fail(f"duplicate tensor name {name!r}", start)
            if any(d == 0 for d in ne):
                cur.fail(f"tensor {name!r} has a zero dimension {list(ne)}", start)
            elems, bbytes = BLOCK_GEOMETRY[gtype]
            if ne[0] % elems:
                cur.fail(f"tensor {name!r}: row length ne[0]={ne[0]} is not a multiple of the "
                         f"{gtype.name} block size {elems}", start)
            n = 1
            for d in ne:
                n *= d
            nbytes = n // elems * bbytes
            if rel % self.alignment:
                cur.fail(f"tensor {name!r}: data offset {rel} is not aligned to {self.alignment}", start)
            offset = self.data_offset + rel
            if offset + nbytes > self.file_size:
                cur.fail(f"tensor {name!r}: data [{offset}, {offset + nbytes}) extends past the end of the file "
                         f"({self.file_size} bytes; the file is truncated or the offset is wrong)", start)
            self.tensors[name] = TensorInfo(name, gtype, ne, offset, nbytes, start)
        self._check_overlaps()

    def _check_overlaps(self) -> None:
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in self.tensors.values())
        for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
            if s1 < e0:
                raise GGUFError(f"tensor {n1!r} data [{s1}, {e1}) overlaps tensor {n0!r} [{s0}, {e0})",
                                path=self.path, offset=s1)

    @staticmethod
    def _value_type(cur: _Cursor, raw: int, key: str) -> ValueType:
        try:
            return ValueType(raw)
        except ValueError:
            cur.fail(f"metadata {key!r} has unknown value type {raw}", cur.pos - 4)

    def _read_value(self, cur: _Cursor, vtype: ValueType, key: str, depth: int):
        if vtype == ValueType.STRING:
            return cur.string(f"metadata {key!r} string"), None
        if vtype == ValueType.ARRAY:
            if depth > 8:
                cur.fail(f"metadata {key!r}: arrays nested deeper than 8 levels")
            sub = self._value_type(cur, cur.u32(f"metadata {key!r} array element type"), key)
            count = cur.u64(f"metadata {key!r} array length")
            if sub in _NUMPY:
                width = np.dtype(_NUMPY[sub]).itemsize
                cur.need(count * width, f"metadata {key!r} array of {count} {sub.name}")
                arr = np.frombuffer(self._mm, dtype=_NUMPY[sub], count=count, offset=cur.pos)
                cur.pos += count * width
                return arr.tolist(), sub
            if sub == ValueType.BOOL:
                cur.need(count, f"metadata {key!r} array of {count} BOOL")
                raw = bytes(self._mm[cur.pos : cur.pos + count])
                cur.pos += count
                return [b != 0 for b in raw], sub
            # strings and nested arrays need at least 8 bytes (a length) per element
            cur.need(count * 8 if count < (1 << 60) else -1, f"metadata {key!r} array of {count} {sub.name}")
            out = []
            for j in range(count):
                v, _ = self._read_value(cur, sub, f"{key}[{j}]", depth + 1)
                out.append(v)
            return out, sub
        v = cur.scalar(vtype, f"metadata {key!r} {vtype.name}")
        if vtype == ValueType.BOOL:
            if v > 1:
                cur.fail(f"metadata {key!r}: bool byte is {v}, expected 0 or 1", cur.pos - 1)
            v = bool(v)
        return v, None

    # -- access ----------------------------------------------------------------------------------

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"no tensor named {name!r}", path=self.path) from None

    def tensor_data(self, name: str) -> np.ndarray:
        """The tensor's raw bytes as a read-only uint8 view into the mapping (no copy)."""
        t = self.tensor(name)
        return np.frombuffer(self._mm, dtype=np.uint8, count=t.nbytes, offset=t.offset)

    def tensor_array(self, name: str) -> np.ndarray:
        """Zero-copy typed view: F32/F16/I32 (BF16 as uint16) reshaped to ``shape``; block types as
        uint8 ``(*shape[:-1], row_bytes)``."""
        t = self.tensor(name)
        raw = self.tensor_data(name)
        plain = {GGMLType.F32: "<f4", GGMLType.F16: "<f2", GGMLType.BF16: "<u2", GGMLType.I32: "<i4",
                 GGMLType.F64: "<f8", GGMLType.I8: "<i1", GGMLType.I16: "<i2", GGMLType.I64: "<i8"}
        if t.ggml_type in plain:
            return raw.view(plain[t.ggml_type]).reshape(t.shape)
        return raw.reshape(*t.shape[:-1], t.row_bytes)

    def close(self) -> None:
        mm = getattr(self, "_mm", None)
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                # numpy views still reference the mapping; it is released when they are.
                pass
            self._mm = None
        fh = getattr(self, "_fh", None)
        if fh is not None:
            fh.close()
            self._fh = None

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFFile({Path(self.path).name!r}, {len(self.fields)} keys, {len(self.tensors)} tensors)"


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a
