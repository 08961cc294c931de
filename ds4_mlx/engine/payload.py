"""The session payload: everything needed to continue a session exactly, as one versioned blob.

It is the state of spec §9.2 (per layer: raw window, compressed rows, compressor frontiers, indexer
rows and frontier) plus the token history and the next-token logits, with a header that says which
model, context and prefill chunk it was made for. The disk KV store (``kvstore.py``) keeps it as
opaque bytes; this module is the only one that looks inside.

Layout (little-endian)::

    off  size        field
    0    8           magic b"DS4MLXSP"
    8    4           version (1)
    12   4           header bytes H = 96 + 4·n_layer (everything up to the token ids)
    16   32          model id: sha256 of the GGUF's metadata + tensor table + a sample of every
                     tensor's bytes (``model_fingerprint``)
    48   4 × 6       n_layer, n_embd, n_vocab, head_dim, indexer_head_dim, n_swa
    72   4           ctx the session was created with
    76   4           prefill chunk (chunk boundaries are absolute multiples of it)
    80   4           n = token count
    84   4           numerics the state was computed in (0 default, 1 ds4-cpu; informational)
    88   4           reserved, 0
    92   4           number of array records
    96   4·n_layer   compress ratio of every layer
    H    4·n         token ids (u32)
         4·n_vocab   next-token logits (f32)
         records     per layer, in order: raw; attn rows, kst, gst (R > 0); index rows, kst, gst (R = 4).
                     Each: u16 layer, u8 lane (0 raw, 1 attn, 2 index), u8 field (0 rows, 1 kst,
                     2 gst), u8 dtype (1 f32, 2 f16), 3 × u8 0, u32 rows, u32 cols, u32 stored
                     rows s, then s·cols elements; frontier rows s.. are the empty fill (below).
    end  4           crc32 of every byte before it

Storage dtype. Raw rows, compressed rows and indexer rows are f16-exact by construction (the model
rounds them through half precision), so they are stored as f16 when every element survives the
float32 -> float16 -> float32 trip bit for bit, and as f32 otherwise; the check is made on save, so
a load always returns the exact float32 arrays that were saved. The frontier scores hold the
-1e30 "empty" sentinel, which has no f16 form, and stay f32. The rows grow with the session, so
this halves the part that matters (a ~2x smaller file than ds4's all-f32 payload).

Frontier trimming. A canonical compressor frontier (spec §6.3) holds the partial window in its
first rows and the empty fill (K = +0.0, G = -1e30) in the rest; a record stores its rows up to the
last one that differs from the fill in any bit, and the loader refills the tail. For the ratio-128
frontiers (128 rows of K and G per layer, 10 MiB on the real model) this removes most of the
fixed cost of a payload. Rows arrays are always stored whole.

Why not ds4's payload bytes: ds4 hard-codes the 43-layer shape and has no model identity (one
binary, one model); ds4-mlx opens any GGUF, so the payload names its model and its own shapes, and
carries a checksum because it may live in a plain file as well as in the checksummed KV store.

Load checks (``PayloadError`` names the field and its byte offset): magic, version, header size,
model id, every config field, ratios; saved ctx <= current ctx (a smaller context's state fits a
larger one, never the reverse) and n < current ctx; same prefill chunk (another chunk would make a
resumed prefill take different chunk boundaries than a cold one, losing bit equality); token ids in
the vocabulary; every record's identity, dtype and shape against what n tokens imply
(raw min(n, n_swa), rows n // R, frontiers coff·R × coff·D); no truncation, no trailing bytes, crc.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from ds4_mlx.errors import PayloadError
from ds4_mlx.formats.config import ModelConfig
from ds4_mlx.model.numerics import EMPTY_SCORE
from ds4_mlx.model.cache import FIELDS, LANES, StateArray, state_layout

MAGIC = b"DS4MLXSP"
VERSION = 1
MODEL_ID_BYTES = 32
_FIXED = struct.Struct("<8sII32s12I")  # through the record count: 96 bytes
FIXED_HEADER_BYTES = _FIXED.size
_RECORD = struct.Struct("<HBBB3xIII")
RECORD_HEADER_BYTES = _RECORD.size
CRC_BYTES = 4

NUMERICS_CODES = {"default": 0, "ds4-cpu": 1}
DTYPE_F32, DTYPE_F16 = 1, 2
_DTYPES = {DTYPE_F32: np.dtype("<f4"), DTYPE_F16: np.dtype("<f2")}
# The empty frontier row's value per field (rows arrays have none), compared bit for bit.
_FILL = {1: np.float32(0.0), 2: np.float32(EMPTY_SCORE)}


FINGERPRINT_BLOCK = 4096  # bytes per sample
FINGERPRINT_SAMPLES = 16  # samples per tensor, evenly spaced, first and last block included


def fingerprint_spans(offset: int, nbytes: int) -> list[tuple[int, int]]:
    """(offset, length) of the bytes of one tensor that enter the model id: all of a tensor of up
    to 64 KiB, else 16 blocks of 4 KiB evenly spaced from its first byte to its last."""
    if nbytes <= FINGERPRINT_SAMPLES * FINGERPRINT_BLOCK:
        return [(offset, nbytes)] if nbytes else []
    step = (nbytes - FINGERPRINT_BLOCK) // (FINGERPRINT_SAMPLES - 1)
    return [(offset + i * step if i < FINGERPRINT_SAMPLES - 1 else offset + nbytes - FINGERPRINT_BLOCK,
             FINGERPRINT_BLOCK) for i in range(FINGERPRINT_SAMPLES)]


def model_fingerprint(gguf_file) -> bytes:
    """32-byte model id: sha256 of the GGUF bytes before the tensor data (header, metadata, tensor
    table) followed by a fixed sample of every tensor's data (``fingerprint_spans``, in file order).

    The header alone names every tensor's type, shape and offset, so it tells models of other
    shapes or quantisations apart, but not two files of the same layout with other weights (a
    retrain, a fine-tune, another quantiser of the same types): those would load each other's KV
    checkpoints and answer wrongly. Hashing all the weights (81 GB for the real model) on every
    start is not acceptable and a remembered hash can go stale, so a sample is taken instead: up to
    64 KiB per tensor (about 80 MB, in 4 KiB reads, for the real model; all of every small tensor).
    Any retrain, fine-tune or re-quantisation rewrites nearly every block of the tensors it
    touches, so it changes sampled bytes; an edit of a few bytes between samples would not, and is
    not what this guards against.
    """
    end = int(gguf_file.info_end)
    h = hashlib.sha256()
    spans = [(0, end)]
    for t in sorted(getattr(gguf_file, "tensors", {}).values(), key=lambda t: t.offset):
        spans += fingerprint_spans(int(t.offset), int(t.nbytes))
    with open(gguf_file.path, "rb") as fh:
        for off, n in spans:
            fh.seek(off)
            while n > 0:
                block = fh.read(min(n, 1 << 22))
                if not block:
                    raise PayloadError(f"{gguf_file.path}: file ends at byte {fh.tell()}, before the "
                                       f"{'GGUF header' if off == 0 else 'tensor data'} it declares")
                h.update(block)
                n -= len(block)
    return h.digest()


# One record: layer, lane (raw / attn / index), field (rows / kst / gst) and its shape; the layout is
# the model's (``cache.state_layout``), so the payload never restates it.
ArraySpec = StateArray


def expected_arrays(cfg: ModelConfig, n_tokens: int) -> list[ArraySpec]:
    """The records a payload of ``n_tokens`` holds, in file order, with their shapes."""
    return state_layout(cfg, n_tokens)


def compressed_bytes_per_token(cfg: ModelConfig) -> float:
    """Spec §9.2's growth of the state with n, stored as float32: compressed rows plus indexer rows
    (ds4's payload grows by this plus 4 bytes of token id per token)."""
    total = 0.0
    for il in range(cfg.n_layer):
        r = cfg.compress_ratio(il)
        if r:
            total += cfg.head_dim * 4 / r
        if r == 4:
            total += cfg.indexer_head_dim * 4 / 4
    return total


@dataclass
class Payload:
    """A decoded payload. ``arrays`` are float32 numpy arrays keyed like ``ModelCache.to_numpy``."""

    model_id: bytes
    ctx: int
    chunk: int
    numerics: str
    tokens: list[int]
    logits: np.ndarray
    arrays: dict[str, np.ndarray]


def _byte_view(a: np.ndarray) -> memoryview | bytes:
    """The array's bytes without a copy (an empty array has no castable view)."""
    return memoryview(np.ascontiguousarray(a).reshape(-1)).cast("B") if a.size else b""


def _f16_exact(a: np.ndarray) -> bool:
    with np.errstate(over="ignore"):
        back = a.astype(np.float16).astype(np.float32)
    return bool(np.array_equal(back.view(np.uint32), a.view(np.uint32)))


def _stored_rows(a: np.ndarray, field: int) -> int:
    """Rows to store: all for a rows array, else up to the last row that is not the empty fill."""
    if field not in _FILL or a.shape[0] == 0:
        return a.shape[0]
    fill = _FILL[field].view(np.uint32)
    differs = np.flatnonzero((a.view(np.uint32) != fill).any(axis=1))
    return int(differs[-1]) + 1 if differs.size else 0


def _header(cfg: ModelConfig, *, model_id: bytes, ctx: int, chunk: int, n_tokens: int, numerics: str,
            n_records: int) -> bytes:
    fixed = _FIXED.pack(MAGIC, VERSION, FIXED_HEADER_BYTES + 4 * cfg.n_layer, model_id,
                        cfg.n_layer, cfg.n_embd, cfg.n_vocab, cfg.head_dim, cfg.indexer_head_dim, cfg.n_swa,
                        ctx, chunk, n_tokens, NUMERICS_CODES.get(numerics, 255), 0, n_records)
    ratios = np.array([cfg.compress_ratio(il) for il in range(cfg.n_layer)], dtype="<u4")
    return fixed + ratios.tobytes()


class NonFiniteStateError(PayloadError):
    """The state holds a NaN or an infinity: it must never be saved (it would poison every run
    that continues from it) nor loaded."""


def _check_finite(a: np.ndarray, what: str, offset: int | None = None) -> None:
    """Raise ``NonFiniteStateError`` naming ``what`` and the first bad element."""
    ok = np.isfinite(a)
    if ok.all():
        return
    i = int(np.flatnonzero(~ok.reshape(-1))[0])
    where = f" (byte offset {offset})" if offset is not None else ""
    raise NonFiniteStateError(f"session payload: {what} holds a non-finite value ({a.reshape(-1)[i]} at "
                              f"element {i}){where}")


def encode(cfg: ModelConfig, *, model_id: bytes, ctx: int, chunk: int, numerics: str,
           tokens: Sequence[int], logits: np.ndarray, arrays: dict[str, np.ndarray]) -> list[bytes | memoryview]:
    """The payload as a list of buffers (in order; the caller writes them, never needs to join them).

    ``arrays`` as ``ModelCache.to_numpy`` gives them. Raises PayloadError if an argument does not
    fit the config (a caller bug, but cheap to catch before it reaches a file).
    """
    if len(model_id) != MODEL_ID_BYTES:
        raise PayloadError(f"model id must be {MODEL_ID_BYTES} bytes, got {len(model_id)}")
    n = len(tokens)
    for name, value in (("ctx", ctx), ("chunk", chunk), ("token count", n)):
        if not 0 <= value < 2**32:
            raise PayloadError(f"{name} {value} does not fit a u32")
    toks = np.asarray(tokens, dtype=np.int64)
    if n and (toks.min() < 0 or toks.max() >= cfg.n_vocab):
        raise PayloadError(f"token ids must lie in 0..{cfg.n_vocab - 1}")
    logits = np.ascontiguousarray(logits, dtype="<f4").reshape(-1)
    if logits.size != cfg.n_vocab:
        raise PayloadError(f"logits have {logits.size} entries, vocabulary is {cfg.n_vocab}")
    _check_finite(logits, "logits")
    specs = expected_arrays(cfg, n)
    pieces: list[bytes | memoryview] = [
        _header(cfg, model_id=model_id, ctx=ctx, chunk=chunk, n_tokens=n, numerics=numerics,
                n_records=len(specs)),
        toks.astype("<u4").tobytes(),
        _byte_view(logits),
    ]
    for spec in specs:
        a = arrays.get(spec.key)
        if a is None:
            raise PayloadError(f"state array {spec.key} is missing")
        a = np.ascontiguousarray(a, dtype="<f4")
        if a.shape != spec.shape:
            raise PayloadError(f"state array {spec.key} has shape {a.shape}, {n} tokens imply {spec.shape}")
        _check_finite(a, f"state array {spec.key}")
        stored = _stored_rows(a, spec.field)
        a = a[:stored]
        dtype = DTYPE_F16 if a.size and _f16_exact(a) else DTYPE_F32
        data = a.astype(_DTYPES[dtype]) if dtype == DTYPE_F16 else a
        pieces.append(_RECORD.pack(spec.layer, spec.lane, spec.field, dtype, *spec.shape, stored))
        pieces.append(_byte_view(data))
    crc = 0
    for p in pieces:
        crc = zlib.crc32(p, crc)
    pieces.append(struct.pack("<I", crc))
    return pieces


def nbytes(pieces: Sequence[bytes | memoryview]) -> int:
    return sum(memoryview(p).nbytes for p in pieces)


def write(fp: BinaryIO, pieces: Sequence[bytes | memoryview]) -> int:
    total = 0
    for p in pieces:
        fp.write(p)
        total += memoryview(p).nbytes
    return total


class _Reader:
    """Sequential reads from a buffer or a binary file, tracking the byte offset and the crc, and
    stopping at ``limit`` bytes when the payload's size is known (a store entry's payload is
    followed by trailers that are not ours)."""

    def __init__(self, src, limit: int | None):
        self.buf = None
        self.fp = None
        if hasattr(src, "read"):
            self.fp = src
        else:
            self.buf = memoryview(src).cast("B")
            if limit is None:
                limit = self.buf.nbytes
            elif limit > self.buf.nbytes:
                # Without this the reads stop at the buffer's end and the final size check would
                # call the missing bytes "trailing".
                raise PayloadError(f"session payload: truncated: {self.buf.nbytes} of {limit} bytes")
        self.limit = limit
        self.offset = 0
        self.crc = 0

    def take(self, n: int, what: str) -> memoryview:
        if self.limit is not None and self.offset + n > self.limit:
            raise PayloadError(f"truncated payload: {what} at byte offset {self.offset} needs {n} bytes, "
                               f"only {self.limit - self.offset} left of {self.limit}")
        if self.buf is not None:
            data = self.buf[self.offset:self.offset + n]
        else:
            data = memoryview(self.fp.read(n))
            if data.nbytes != n:
                of = "" if self.limit is None else f" (truncated: {self.offset + data.nbytes} of {self.limit} bytes)"
                raise PayloadError(f"truncated payload: {what} at byte offset {self.offset} needs {n} bytes, "
                                   f"the file ends after {data.nbytes}{of}")
        self.crc = zlib.crc32(data, self.crc)
        self.offset += n
        return data

    def at_end(self) -> bool:
        if self.limit is not None:
            return self.offset == self.limit
        return self.fp.read(1) == b""


def decode(src, cfg: ModelConfig, *, model_id: bytes, ctx: int, chunk: int,
           size: int | None = None) -> Payload:
    """Read and check a payload for a session of this model, ``ctx`` and ``chunk``.

    ``src``: a bytes-like object (the whole payload) or a binary file positioned at its start;
    ``size``: the payload's byte count when known (required to stop before trailing data in a file).
    """
    r = _Reader(src, size)

    def fail(msg: str, offset: int) -> PayloadError:
        return PayloadError(f"session payload: {msg} (byte offset {offset})")

    head = r.take(FIXED_HEADER_BYTES, "header")
    (magic, version, header_bytes, saved_id, n_layer, n_embd, n_vocab, head_dim, idx_dim, n_swa,
     saved_ctx, saved_chunk, n, numerics_code, _reserved, n_records) = _FIXED.unpack(head)
    if magic != MAGIC:
        raise fail(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}", 0)
    if version != VERSION:
        raise fail(f"version {version} is not supported (this build reads {VERSION})", 8)
    if header_bytes != FIXED_HEADER_BYTES + 4 * cfg.n_layer:
        raise fail(f"header size {header_bytes}, expected {FIXED_HEADER_BYTES + 4 * cfg.n_layer} "
                   f"for {cfg.n_layer} layers", 12)
    if saved_id != model_id:
        raise fail(f"made for another model (id {saved_id.hex()[:16]}…, this model {model_id.hex()[:16]}…)", 16)
    for off, name, got, want in ((48, "n_layer", n_layer, cfg.n_layer), (52, "n_embd", n_embd, cfg.n_embd),
                                 (56, "n_vocab", n_vocab, cfg.n_vocab), (60, "head_dim", head_dim, cfg.head_dim),
                                 (64, "indexer_head_dim", idx_dim, cfg.indexer_head_dim),
                                 (68, "n_swa", n_swa, cfg.n_swa)):
        if got != want:
            raise fail(f"{name} is {got}, this model has {want}", off)
    if saved_ctx > ctx:
        raise fail(f"saved for ctx {saved_ctx}, larger than this session's ctx {ctx}", 72)
    if saved_chunk != chunk:
        raise fail(f"saved with prefill chunk {saved_chunk}, this session uses {chunk}", 76)
    if n > saved_ctx or n >= ctx:
        raise fail(f"token count {n} does not fit (saved ctx {saved_ctx}, this session's ctx {ctx})", 80)
    saved_numerics = {v: k for k, v in NUMERICS_CODES.items()}.get(numerics_code)
    if saved_numerics is None:
        raise fail(f"unknown numerics code {numerics_code}", 84)
    specs = expected_arrays(cfg, n)
    if n_records != len(specs):
        raise fail(f"{n_records} array records, {n} tokens on this model imply {len(specs)}", 92)
    ratios_off = r.offset
    ratios = np.frombuffer(r.take(4 * cfg.n_layer, "compress ratios"), dtype="<u4")
    for il, got in enumerate(ratios):
        if int(got) != cfg.compress_ratio(il):
            raise fail(f"layer {il} compress ratio {int(got)}, this model has {cfg.compress_ratio(il)}",
                       ratios_off + 4 * il)

    tok_off = r.offset
    tokens = np.frombuffer(r.take(4 * n, "token ids"), dtype="<u4")
    bad = np.flatnonzero(tokens >= cfg.n_vocab)
    if bad.size:
        i = int(bad[0])
        raise fail(f"token id {int(tokens[i])} at index {i} is outside the vocabulary", tok_off + 4 * i)
    logits_off = r.offset
    logits = np.frombuffer(r.take(4 * cfg.n_vocab, "logits"), dtype="<f4").astype(np.float32)

    arrays: dict[str, np.ndarray] = {}
    data_offsets: dict[str, int] = {}
    for spec in specs:
        off = r.offset
        layer, lane, field, dtype, rows, cols, stored = _RECORD.unpack(
            r.take(RECORD_HEADER_BYTES, f"{spec.key} record header"))
        if (layer, lane, field) != (spec.layer, spec.lane, spec.field):
            got = ArraySpec(layer, lane, field, (rows, cols))
            known = lane < len(LANES) and field < len(FIELDS)
            name = got.key if known else f"(layer {layer}, lane {lane}, field {field})"
            raise fail(f"array record {name} where {spec.key} was expected", off)
        if dtype not in _DTYPES:
            raise fail(f"{spec.key}: unknown dtype code {dtype}", off + 4)
        if (rows, cols) != spec.shape:
            raise fail(f"{spec.key} has shape {(rows, cols)}, {n} tokens imply {spec.shape}", off + 8)
        if stored > rows or (stored != rows and field not in _FILL):
            raise fail(f"{spec.key} stores {stored} of its {rows} rows", off + 16)
        dt = _DTYPES[dtype]
        data = r.take(stored * cols * dt.itemsize, f"{spec.key} data")
        a = np.empty((rows, cols), dtype=np.float32)
        a[:stored] = np.frombuffer(data, dtype=dt).reshape(stored, cols)
        if stored < rows:
            a[stored:] = _FILL[field]
        arrays[spec.key] = a
        data_offsets[spec.key] = off + RECORD_HEADER_BYTES

    crc_off = r.offset
    want_crc = r.crc
    (crc,) = struct.unpack("<I", r.take(CRC_BYTES, "checksum"))
    if crc != want_crc:
        raise fail(f"checksum {crc:08x} does not match the contents ({want_crc:08x})", crc_off)
    if not r.at_end():
        where = r.offset
        extra = "" if r.limit is None else f" ({r.limit - r.offset} bytes)"
        raise fail(f"trailing bytes after the payload{extra}", where)
    # After the checksum: a non-finite value here is not damage but a state that was broken when
    # saved (by a writer that did not check), and continuing from it would poison the session.
    _check_finite(logits, "logits", logits_off)
    for key, a in arrays.items():
        _check_finite(a, f"state array {key}", data_offsets[key])
    return Payload(bytes(saved_id), saved_ctx, saved_chunk, saved_numerics, [int(t) for t in tokens], logits,
                   arrays)

