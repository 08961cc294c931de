"""Streaming GGUF v3 writer.

Everything that goes into the header is declared first: metadata (each value with its explicit GGUF
type) and every tensor's name, GGML type and GGUF dims. ``write_header`` then writes the header, the
metadata, the tensor directory (offsets already known, since sizes follow from type and dims) and the
padding up to the data start. Tensor bytes are streamed afterwards, in declaration order, in chunks
of any size, so a multi-gigabyte model never has to be in memory at once.

The file is written under ``<path>.<pid>.<random>.partial`` (one per writer) and renamed onto ``path`` only when ``close`` finds every
tensor complete, so an interrupted or failed write never leaves a truncated GGUF at ``path``.

Misuse raises ``GGUFError``: a value that does not fit its declared type, a duplicate key or tensor
name, a tensor written out of order or with the wrong number of bytes.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import os
import secrets
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Union

import numpy as np

from ds4_mlx.errors import GGUFError
from ds4_mlx.formats.ggml_types import BLOCK_GEOMETRY, GGMLType, ggml_type
from ds4_mlx.formats.gguf import DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUF_VERSION, MAX_DIMS, ValueType

# ggml keeps tensor names in a 64-byte buffer that includes the terminating NUL.
MAX_TENSOR_NAME_BYTES = 63

_INT_RANGES = {
    ValueType.UINT8: (0, 2**8 - 1),
    ValueType.INT8: (-(2**7), 2**7 - 1),
    ValueType.UINT16: (0, 2**16 - 1),
    ValueType.INT16: (-(2**15), 2**15 - 1),
    ValueType.UINT32: (0, 2**32 - 1),
    ValueType.INT32: (-(2**31), 2**31 - 1),
    ValueType.UINT64: (0, 2**64 - 1),
    ValueType.INT64: (-(2**63), 2**63 - 1),
}
_NUMPY_DTYPE = {
    ValueType.UINT8: "<u1",
    ValueType.INT8: "<i1",
    ValueType.UINT16: "<u2",
    ValueType.INT16: "<i2",
    ValueType.UINT32: "<u4",
    ValueType.INT32: "<i4",
    ValueType.UINT64: "<u8",
    ValueType.INT64: "<i8",
    ValueType.FLOAT32: "<f4",
    ValueType.FLOAT64: "<f8",
    ValueType.BOOL: "<u1",
}


@dataclass(frozen=True)
class MetaArray:
    """A typed GGUF array value; needed for the elements of a nested array (``sub_type`` ARRAY)."""

    sub_type: ValueType
    values: Sequence[Any]


@dataclass(frozen=True)
class PlannedTensor:
    """A declared tensor: its directory entry and where its bytes go (relative to the data start)."""

    name: str
    ggml_type: GGMLType
    ne: tuple[int, ...]
    nbytes: int
    rel_offset: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))


Chunk = Union[bytes, bytearray, memoryview, np.ndarray]

_DECLARING, _WRITING, _CLOSED, _FAILED = "declaring", "writing", "closed", "failed"


class GGUFWriter:
    """Declare metadata and tensors, ``write_header()``, then ``write_tensor`` each tensor in order.

    Use as a context manager: leaving the block normally calls ``close()`` (which checks that every
    tensor was written, then publishes the file); leaving it by an exception discards the partial file.
    """

    def __init__(self, path: str | os.PathLike, *, compute_sha256: bool = False):
        self.path = str(path)
        # Unique per writer (pid + random suffix, created with O_EXCL below): two processes writing the
        # same target never share, truncate or unlink each other's partial file; the last rename wins.
        self._tmp_path = f"{self.path}.{os.getpid()}.{secrets.token_hex(4)}.partial"
        self._meta: dict[str, tuple[ValueType, bytes]] = {}
        self._tensors: list[PlannedTensor] = []
        self._names: set[str] = set()
        self._data_size = 0  # bytes of tensor data declared so far, padding included
        self._state = _DECLARING
        self._fh: BinaryIO | None = None
        self._next = 0  # index of the next tensor to write
        self._pos = 0  # bytes written so far (absolute file offset)
        self._hash = hashlib.sha256() if compute_sha256 else None
        self.data_offset: int | None = None
        self.sha256: str | None = None

    # -- metadata --------------------------------------------------------------------------------

    def add(self, key: str, vtype: ValueType, value: Any, sub_type: ValueType | None = None) -> None:
        """Add one metadata entry of explicit type; arrays need ``sub_type`` (their element type)."""
        self._require(_DECLARING, f"add metadata {key!r}")
        if not isinstance(key, str) or not key:
            raise GGUFError(f"metadata key must be a non-empty string, got {key!r}", path=self.path)
        if key in self._meta:
            raise GGUFError(f"duplicate metadata key {key!r}", path=self.path)
        vtype = self._value_type(vtype, key)
        if vtype == ValueType.ARRAY:
            if sub_type is None:
                raise GGUFError(f"metadata {key!r}: an ARRAY needs its element type (sub_type)", path=self.path)
            payload = self._encode_array(key, self._value_type(sub_type, key), value)
        else:
            if sub_type is not None:
                raise GGUFError(f"metadata {key!r}: sub_type is only meaningful for ARRAY values", path=self.path)
            payload = self._encode_scalar(key, vtype, value)
        if key == "general.alignment":
            if vtype != ValueType.UINT32 or value <= 0 or value & (value - 1):
                raise GGUFError(f"general.alignment must be a positive power-of-two UINT32, got {value!r}",
                                path=self.path)
            if self._tensors:
                raise GGUFError("general.alignment must be set before any tensor is declared "
                                "(the offsets depend on it)", path=self.path)
        self._meta[key] = (vtype, payload)

    def add_uint8(self, key: str, value: int) -> None:
        self.add(key, ValueType.UINT8, value)

    def add_int8(self, key: str, value: int) -> None:
        self.add(key, ValueType.INT8, value)

    def add_uint16(self, key: str, value: int) -> None:
        self.add(key, ValueType.UINT16, value)

    def add_int16(self, key: str, value: int) -> None:
        self.add(key, ValueType.INT16, value)

    def add_uint32(self, key: str, value: int) -> None:
        self.add(key, ValueType.UINT32, value)

    def add_int32(self, key: str, value: int) -> None:
        self.add(key, ValueType.INT32, value)

    def add_uint64(self, key: str, value: int) -> None:
        self.add(key, ValueType.UINT64, value)

    def add_int64(self, key: str, value: int) -> None:
        self.add(key, ValueType.INT64, value)

    def add_float32(self, key: str, value: float) -> None:
        self.add(key, ValueType.FLOAT32, value)

    def add_float64(self, key: str, value: float) -> None:
        self.add(key, ValueType.FLOAT64, value)

    def add_bool(self, key: str, value: bool) -> None:
        self.add(key, ValueType.BOOL, value)

    def add_string(self, key: str, value: str) -> None:
        self.add(key, ValueType.STRING, value)

    def add_array(self, key: str, values: Sequence[Any], sub_type: ValueType) -> None:
        """Array of ``sub_type``; for nested arrays pass ``ValueType.ARRAY`` and ``MetaArray`` elements."""
        self.add(key, ValueType.ARRAY, values, sub_type)

    @property
    def alignment(self) -> int:
        entry = self._meta.get("general.alignment")
        return struct.unpack("<I", entry[1])[0] if entry else DEFAULT_ALIGNMENT

    # -- tensors ---------------------------------------------------------------------------------

    def add_tensor(self, name: str, gtype: GGMLType | int | str, ne: Sequence[int]) -> PlannedTensor:
        """Declare a tensor by GGUF dims (``ne[0]`` fastest); its data offset is fixed now."""
        self._require(_DECLARING, f"declare tensor {name!r}")
        if not isinstance(name, str) or not name:
            raise GGUFError(f"tensor name must be a non-empty string, got {name!r}", path=self.path)
        if len(name.encode("utf-8")) > MAX_TENSOR_NAME_BYTES:
            raise GGUFError(f"tensor name {name!r} is longer than {MAX_TENSOR_NAME_BYTES} bytes", path=self.path)
        if name in self._names:
            raise GGUFError(f"duplicate tensor name {name!r}", path=self.path)
        try:
            gt = ggml_type(gtype)
        except ValueError as exc:
            raise GGUFError(f"tensor {name!r}: {exc}", path=self.path) from None
        dims = tuple(ne)
        if not 1 <= len(dims) <= MAX_DIMS:
            raise GGUFError(f"tensor {name!r} has {len(dims)} dims (1..{MAX_DIMS} allowed)", path=self.path)
        if any(isinstance(d, bool) or not isinstance(d, numbers.Integral) or d <= 0 for d in dims):
            raise GGUFError(f"tensor {name!r}: dims must be positive integers, got {list(dims)}", path=self.path)
        dims = tuple(int(d) for d in dims)
        elems, block_bytes = BLOCK_GEOMETRY[gt]
        if dims[0] % elems:
            raise GGUFError(f"tensor {name!r}: ne[0]={dims[0]} is not a multiple of the {gt.name} block size "
                            f"{elems}", path=self.path)
        nbytes = math.prod(dims) // elems * block_bytes
        planned = PlannedTensor(name, gt, dims, nbytes, self._data_size)
        self._data_size += _align(nbytes, self.alignment)
        self._tensors.append(planned)
        self._names.add(name)
        return planned

    @property
    def tensors(self) -> tuple[PlannedTensor, ...]:
        return tuple(self._tensors)

    # -- writing ---------------------------------------------------------------------------------

    def header_bytes(self) -> bytes:
        """Header, metadata and tensor directory exactly as ``write_header`` writes them (unpadded)."""
        out = bytearray()
        out += GGUF_MAGIC
        out += struct.pack("<IQQ", GGUF_VERSION, len(self._tensors), len(self._meta))
        for key, (vtype, payload) in self._meta.items():
            out += _gguf_string(key)
            out += struct.pack("<I", vtype)
            out += payload
        for t in self._tensors:
            out += _gguf_string(t.name)
            out += struct.pack(f"<I{len(t.ne)}QIQ", len(t.ne), *t.ne, t.ggml_type, t.rel_offset)
        return bytes(out)

    def write_header(self) -> None:
        """Open the file and write everything up to the (aligned) start of the tensor data."""
        self._require(_DECLARING, "write the header")
        header = self.header_bytes()
        self.data_offset = _align(len(header), self.alignment)
        Path(self._tmp_path).parent.mkdir(parents=True, exist_ok=True)
        try:
            self._fh = open(self._tmp_path, "xb")
        except OSError as exc:
            raise GGUFError(f"cannot create {self._tmp_path}: {exc.strerror or exc}", path=self.path) from None
        self._state = _WRITING
        self._emit(header)
        self._emit(bytes(self.data_offset - len(header)))

    def write_tensor(self, name: str, data: Chunk | Iterable[Chunk]) -> None:
        """Write the bytes of the next declared tensor: one buffer or an iterable of chunks.

        Arrays are written as their raw little-endian bytes (row-major); the byte count must equal the
        declared size exactly. A wrong count leaves the writer failed (the partial file is discarded on
        close); a wrong name is refused before anything is written.
        """
        self._require(_WRITING, f"write tensor {name!r}")
        if self._next >= len(self._tensors):
            raise GGUFError(f"tensor {name!r} written after all {len(self._tensors)} declared tensors",
                            path=self.path)
        planned = self._tensors[self._next]
        if name != planned.name:
            what = "was never declared" if name not in self._names else (
                "was already written" if any(t.name == name for t in self._tensors[: self._next]) else
                "is out of order")
            raise GGUFError(f"tensor {name!r} {what}: the next declared tensor is {planned.name!r}",
                            path=self.path)
        start = self.data_offset + planned.rel_offset
        assert self._pos == start, "writer position and planned offset diverged"
        chunks = [data] if isinstance(data, (bytes, bytearray, memoryview, np.ndarray)) else data
        written = 0
        try:
            for chunk in chunks:
                view = _as_bytes(chunk, planned.name)
                if written + len(view) > planned.nbytes:
                    raise GGUFError(f"tensor {planned.name!r} ({planned.ggml_type.name} {list(planned.ne)}) "
                                    f"expects {planned.nbytes} bytes, got at least {written + len(view)}",
                                    path=self.path, offset=start + written)
                self._emit(view)
                written += len(view)
            if written != planned.nbytes:
                raise GGUFError(f"tensor {planned.name!r} ({planned.ggml_type.name} {list(planned.ne)}) "
                                f"expects {planned.nbytes} bytes, got {written}",
                                path=self.path, offset=start + written)
        except BaseException:
            self._state = _FAILED
            raise
        self._emit(bytes(_align(planned.nbytes, self.alignment) - planned.nbytes))
        self._next += 1

    def close(self) -> None:
        """Finish: check every tensor was written, flush, and move the file onto ``path``."""
        if self._state == _CLOSED:
            return
        if self._state != _WRITING or self._next != len(self._tensors):
            missing = [t.name for t in self._tensors[self._next:]]
            reason = ("the header was never written" if self._state == _DECLARING else
                      "an earlier write failed" if self._state == _FAILED else
                      f"{len(missing)} tensor(s) not written, first {missing[0]!r}")
            self.abort()
            raise GGUFError(f"incomplete GGUF discarded: {reason}", path=self.path)
        assert self._fh is not None
        self._fh.close()
        self._fh = None
        os.replace(self._tmp_path, self.path)
        self._state = _CLOSED
        if self._hash is not None:
            self.sha256 = self._hash.hexdigest()

    def abort(self) -> None:
        """Discard the partial file (safe to call at any point)."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._state != _CLOSED:
            try:
                os.unlink(self._tmp_path)
            except FileNotFoundError:
                pass
            self._state = _FAILED

    @property
    def bytes_written(self) -> int:
        return self._pos

    def __enter__(self) -> "GGUFWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # -- internals -------------------------------------------------------------------------------

    def _require(self, state: str, action: str) -> None:
        if self._state != state:
            raise GGUFError(f"cannot {action}: writer is {self._state} (needs {state})", path=self.path)

    def _emit(self, buf) -> None:
        assert self._fh is not None
        self._fh.write(buf)
        if self._hash is not None:
            self._hash.update(buf)
        self._pos += len(buf)

    def _value_type(self, vtype: Any, key: str) -> ValueType:
        try:
            return ValueType(vtype)
        except (ValueError, TypeError):
            raise GGUFError(f"metadata {key!r}: unsupported value type {vtype!r}", path=self.path) from None

    def _fail_value(self, key: str, vtype: ValueType, value: Any, why: str) -> GGUFError:
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        return GGUFError(f"metadata {key!r}: {shown} is not a valid {vtype.name} ({why})", path=self.path)

    def _check_scalar(self, key: str, vtype: ValueType, value: Any) -> Any:
        """Validate one scalar and return it as the plain Python value to pack."""
        if vtype in _INT_RANGES:
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
                raise self._fail_value(key, vtype, value, "not an integer")
            lo, hi = _INT_RANGES[vtype]
            if not lo <= int(value) <= hi:
                raise self._fail_value(key, vtype, value, f"outside [{lo}, {hi}]")
            return int(value)
        if vtype in (ValueType.FLOAT32, ValueType.FLOAT64):
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
                raise self._fail_value(key, vtype, value, "not a real number")
            v = float(value)
            if vtype == ValueType.FLOAT32 and math.isfinite(v) and abs(v) > float(np.finfo(np.float32).max):
                raise self._fail_value(key, vtype, value, "overflows float32")
            return v
        if vtype == ValueType.BOOL:
            if not isinstance(value, (bool, np.bool_)):
                raise self._fail_value(key, vtype, value, "not a bool")
            return bool(value)
        if vtype == ValueType.STRING:
            if not isinstance(value, str):
                raise self._fail_value(key, vtype, value, "not a str")
            return value
        raise self._fail_value(key, vtype, value, "not a scalar type")

    def _encode_scalar(self, key: str, vtype: ValueType, value: Any) -> bytes:
        v = self._check_scalar(key, vtype, value)
        if vtype == ValueType.STRING:
            return _gguf_string(v, key=key, path=self.path)
        return np.array(v, dtype=_NUMPY_DTYPE[vtype]).tobytes()

    def _encode_array(self, key: str, sub_type: ValueType, values: Any) -> bytes:
        if isinstance(values, MetaArray):
            raise GGUFError(f"metadata {key!r}: pass the MetaArray's values and sub_type, not the MetaArray",
                            path=self.path)
        if isinstance(values, np.ndarray):
            if values.ndim != 1:
                raise GGUFError(f"metadata {key!r}: array values must be 1-D, got shape {values.shape}",
                                path=self.path)
            values = values.tolist()
        if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
            raise GGUFError(f"metadata {key!r}: array value must be a sequence, got {type(values).__name__}",
                            path=self.path)
        values = list(values)
        out = bytearray(struct.pack("<IQ", sub_type, len(values)))
        if sub_type == ValueType.ARRAY:
            for i, elem in enumerate(values):
                if not isinstance(elem, MetaArray):
                    raise GGUFError(f"metadata {key!r}[{i}]: elements of a nested array must be MetaArray, "
                                    f"got {type(elem).__name__}", path=self.path)
                inner = self._value_type(elem.sub_type, f"{key}[{i}]")
                out += self._encode_array(f"{key}[{i}]", inner, elem.values)
        elif sub_type == ValueType.STRING:
            for i, s in enumerate(values):
                out += _gguf_string(self._check_scalar(f"{key}[{i}]", sub_type, s), key=f"{key}[{i}]",
                                    path=self.path)
        else:
            checked = [self._check_scalar(f"{key}[{i}]", sub_type, v) for i, v in enumerate(values)]
            out += np.array(checked, dtype=_NUMPY_DTYPE[sub_type]).tobytes()
        return bytes(out)


def _gguf_string(s: str, *, key: str | None = None, path: str | None = None) -> bytes:
    try:
        raw = s.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise GGUFError(f"{'metadata ' + repr(key) if key else 'string'} is not encodable as UTF-8 ({exc.reason})",
                        path=path) from None
    return struct.pack("<Q", len(raw)) + raw


def _as_bytes(chunk: Any, name: str) -> memoryview:
    if isinstance(chunk, np.ndarray):
        if chunk.dtype.hasobject:
            raise GGUFError(f"tensor {name!r}: data chunk is a numpy array of Python objects, not raw values")
        if chunk.dtype.byteorder == ">":
            chunk = chunk.astype(chunk.dtype.newbyteorder("<"))
        chunk = np.ascontiguousarray(chunk)
        return memoryview(chunk.reshape(-1).view(np.uint8))
    if isinstance(chunk, (bytes, bytearray, memoryview)):
        view = memoryview(chunk)
        return (view if view.c_contiguous else memoryview(view.tobytes())).cast("B")
    raise GGUFError(f"tensor {name!r}: data chunk of type {type(chunk).__name__} is not bytes or a numpy array")


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a
