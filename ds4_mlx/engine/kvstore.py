"""Disk KV cache: ds4's ``.kv`` checkpoint files around an opaque session payload.

The store does not look inside the payload (the session module writes and reads it); it names,
finds, checks, writes atomically, counts hits and evicts files, with ds4's rules
(``ds4_kvstore.c``; the policy arithmetic is in ``kvstore_policy.py``).

File ``<dir>/<sha1-hex>.kv``, the SHA1 taken over the key text (below); all integers little-endian::

    48-byte KVC header | u32 text_len | text | payload | [KTM tool-id trailer] | KXM trailer

KVC header, ds4's layout byte for byte:

    ====  ====  ===============================================================================
    off   size  field
    ====  ====  ===============================================================================
    0     3     magic "KVC"
    3     1     version 1
    4     1     routed-expert quant bits, 2 or 4
    5     1     save reason: 0 unknown, 1 cold, 2 continued, 3 evict, 4 shutdown,
                5 agent-system, 6 agent-session (a larger code reads as unknown, as in ds4)
    6     1     ext flags: bit0 KTM trailer present, bit1 key is responses-visible text,
                bit2 key is thinking-visible text, **bit7 ds4-mlx KXM trailer present** (ours)
    7     1     reserved, 0
    8     4     token count (> 0, <= ctx size)
    12    4     hit count
    16    4     ctx size the snapshot was made for
    20    4     **crc32 of header bytes 0..19 and 24..47** (ours; reserved 0 in ds4)
    24    8     created, unix seconds
    32    8     last used, unix seconds
    40    8     payload byte count
    ====  ====  ===============================================================================

Then ``u32 text_len`` and the key text: ds4's rendered text (concatenated token texts, raw bytes,
possibly cut inside a UTF-8 character), or a visible-transcript override (ext bit1/bit2). Then the
payload. Then, when ext bit0 is set, ds4's tool-id map: "KTM", u8 version 1, u32 count, and per
entry ``u32 id_len, u32 dsml_len, id bytes, dsml bytes``.

Then our trailer, always last (ds4 readers stop after the payload or the KTM map, so they never see
it; ``ds4-mlx kv inspect`` shows it):

    ====  ========  ==========================================================================
    off   size      field
    ====  ========  ==========================================================================
    0     4*n       the n token ids (u32), the exact history the payload continues from
    +0    3         magic "KXM" (the 68-byte tail starts here, 68 bytes before EOF)
    +3    1         trailer version 1
    +4    4         payload format version (the session module's own, passed in by the caller)
    +8    1         model id length m, 1..32
    +9    3         0
    +12   32        model id: m bytes, zero padded (the caller's model fingerprint, e.g. a
                    sha256 of the GGUF metadata and tensor table)
    +44   20        token key: SHA1 of the 4*n token bytes
    +64   4         crc32 of every byte from offset 48 up to here (text length, text, payload,
                    KTM, tokens, tail)
    ====  ========  ==========================================================================

Why this shape:

* The header stays ds4's, so ds4-style tools read tokens, hits, reason, sizes, text and payload
  bounds unchanged; only ds4's two reserved fields are used (byte 7 stays 0; bytes 20..23 hold
  the header crc) plus one unused ext bit. The payload itself is ds4-mlx's own and deliberately
  *not* ds4's: a ds4 file (no bit7) is rejected, never fed to our loader.
* Model identity is 32 bytes, more than ds4's reserved space, so it sits in the trailer. Lookups
  read header and tail only (two small reads per file); files of another model, another payload
  version, the other quant (unless ``accept_other_quant``) or a larger ctx are skipped. ds4 has no
  model identity because one binary serves one model; a Python package can open any GGUF.
* Checksums (ds4 has none; a torn or flipped file reaches its payload loader). Two crc32s: the
  header one covers the mutable hit count and last-use time and is rewritten by the single
  48-byte write that records a hit, so counting a hit never rewrites or re-reads the payload; the
  file one covers everything else and is checked on every load, streamed with the read. crc32
  rather than a SHA: zlib's crc32 runs at 1.6-3 GB/s on this box against 0.8 GB/s for SHA1
  (sha_ni), detects every burst up to 32 bits and misses random damage with probability 2**-32;
  it guards against accidents, not forgery (the cache directory is trusted, as in ds4).
* Tokens live outside the payload so the CLI, which has tokens but no rendered text, can look up
  by token prefix (the token key) and ``load`` can return the tokens without decoding the payload.

Key scheme. The file name is always ds4's: SHA1 of the key text, so one directory never holds two
files for the same text. Two lookups: ``rendered_text`` (ds4's rule: the longest stored text that
is a byte prefix of the prompt; ties, more tokens) and ``tokens`` (the longest stored token
sequence that is a prefix of the given tokens, compared by token key; ties, most recently used).
``store`` always takes both tokens and text; a caller without a renderer passes the tokenizer's
decoded bytes of the tokens.

Atomic writes: the file is written as ``<name>.kv.tmp.<pid>`` in the same directory, fsynced,
renamed over ``<name>.kv`` and the directory fsynced. A killed writer leaves only a temp file,
which is never listed, and which the next ``KVStore`` open removes once its process is gone. Room
is made *before* writing (evicting by score; ds4 evicts right after the rename, protecting the new
file, which picks the same victims: the file about to be written already counts as the newest
entry when deciding which continued checkpoints it supersedes), so the directory never holds more
than the budget, temp file included. A same-name file is replaced by the rename too, so a crash
leaves the old file or the new one; only when the budget cannot hold both for the length of the
write is an incompatible or damaged same-name file removed first (ds4 always removes it first),
while a compatible one is then kept as is.

Eviction scores are ds4's times ds4-mlx's anchor and superseded-continued factors (see
``kvstore_policy``); ``KVStoreOptions.ds4_head()`` gives ds4 HEAD's order exactly. Deciding
supersession reads the stored tokens (trailer only, ``4 * tokens`` bytes) of entries that could
extend a continued one, and only when something has to be evicted.

Rejections. A file that fails a check is logged (logger ``ds4_mlx.kvstore``: warning when damaged,
info when merely incompatible), never loaded and never deleted for that reason alone, matching
ds4, which only logs a failed load. Damaged files do count toward the budget, with score 0 so
they are the first evicted when room is needed. The one deletion besides eviction is ds4's
"consumed" rule: a loaded checkpoint longer than ``cold_max_tokens`` is removed after the load.
A file that failed to load is remembered (by name, size and mtime) so lookups stop offering it;
``mark_unloadable`` does the same for a payload the session loader refuses (ds4 deletes that
file; we keep it, since the bytes are intact and may suit another setup).

Any number of writers per directory: each store takes an exclusive ``flock`` on
``<dir>/.ds4-mlx-kv.lock`` around its eviction and write (ds4 assumes one writer), so the budget
holds however many processes share the directory; lookups and loads take no lock (a file replaced
under a reader is caught by the "changed since listed" check). A ``KVStore`` is thread-safe within
a process.

Only regular files are ever opened: a FIFO, link or directory named like an entry is skipped by
``lstat`` before any open, and every open is non-blocking and re-checked with ``fstat``
(``open_regular``), so such a file can neither hang a scan nor redirect a write.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import heapq
import logging
import math
import os
import re
import stat
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from enum import IntEnum
from pathlib import Path

import numpy as np

from ds4_mlx.engine.kvstore_policy import (
    DEFAULT_BUDGET_MB,
    DEFAULT_OPTIONS,
    KVStoreOptions,
    budget_bytes,
    effective_hits,
    eviction_score,
    fits_budget,
    required_bytes,
    score_factors,
)
from ds4_mlx.errors import KVStoreError

logger = logging.getLogger("ds4_mlx.kvstore")

HEADER_BYTES = 48
TEXT_LEN_BYTES = 4
KVC_MAGIC = b"KVC"
KVC_VERSION = 1
TAIL_MAGIC = b"KXM"
TAIL_VERSION = 1
KTM_MAGIC = b"KTM"
KTM_VERSION = 1
KTM_MAX_ID_BYTES = 256  # ds4-server refuses longer ids on load
KTM_MAX_DSML_BYTES = 512 * 1024 * 1024
MODEL_ID_MAX_BYTES = 32
QUANT_BITS = (2, 4)

EXT_TOOL_MAP = 0x01
EXT_RESPONSES_VISIBLE = 0x02
EXT_THINKING_VISIBLE = 0x04
EXT_DS4_MLX = 0x80
KEY_KINDS = {"token-text": 0, "responses-visible": EXT_RESPONSES_VISIBLE,
             "thinking-visible": EXT_THINKING_VISIBLE}

_HEADER = struct.Struct("<3sBBBBBIIIIQQQ")
_TEXT_LEN = struct.Struct("<I")
_TAIL = struct.Struct("<3sBIB3s32s20sI")
_KTM_HEAD = struct.Struct("<3sBI")
_KTM_LENS = struct.Struct("<II")
TAIL_BYTES = _TAIL.size
MIN_FILE_BYTES = HEADER_BYTES + TEXT_LEN_BYTES + TAIL_BYTES
U32_MAX = 0xFFFFFFFF

_NAME_RE = re.compile(r"^([0-9a-fA-F]{40})\.kv$")
_TEMP_RE = re.compile(r"^[0-9a-fA-F]{40}\.kv\.tmp\.(\d+)$")
STALE_TEMP_SECONDS = 24 * 60 * 60  # a temp file this old is removed even if its pid is alive (reused)
_READ_CHUNK = 64 * 1024 * 1024
LOCK_NAME = ".ds4-mlx-kv.lock"  # flock'd around evict + write; matches neither name pattern


class SaveReason(IntEnum):
    """Header byte 5: why the checkpoint was written (ds4's codes)."""

    UNKNOWN = 0
    COLD = 1
    CONTINUED = 2
    EVICT = 3
    SHUTDOWN = 4
    AGENT_SYSTEM = 5
    AGENT_SESSION = 6

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", "-")

    @classmethod
    def parse(cls, value: SaveReason | str | int) -> SaveReason:
        if isinstance(value, str):
            for reason in cls:
                if reason.label == value:
                    return reason
            raise KVStoreError(f"unknown KV save reason {value!r} "
                               f"(expected one of {', '.join(r.label for r in cls)})")
        try:
            return cls(value)
        except ValueError:
            raise KVStoreError(f"unknown KV save reason code {value!r}") from None


# ---------------------------------------------------------------------------------------------
# Keys and input normalization


def _text_bytes(text: str | bytes | bytearray | memoryview) -> bytes:
    if isinstance(text, str):
        return text.encode("utf-8", "surrogateescape")  # round-trips bytes decoded that way
    if isinstance(text, (bytes, bytearray, memoryview)):
        return bytes(text)
    raise KVStoreError(f"KV key text must be str or bytes, not {type(text).__name__}")


def tokens_to_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian u32 bytes (the token-key and trailer encoding)."""
    ids = np.asarray(tokens)
    if ids.size == 0:
        return b""
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise KVStoreError(f"tokens must be a 1-D sequence of integers (got shape {ids.shape}, "
                           f"dtype {ids.dtype})")
    if int(ids.min()) < 0 or int(ids.max()) > U32_MAX:
        raise KVStoreError(f"token id out of the u32 range: min {int(ids.min())}, max {int(ids.max())}")
    return ids.astype("<u4").tobytes()


def key_for_text(text: str | bytes) -> str:
    """ds4's key: lower-case SHA1 hex of the text bytes (UTF-8 for ``str``); also the file name."""
    return hashlib.sha1(_text_bytes(text)).hexdigest()


def key_for_tokens(tokens: Sequence[int] | np.ndarray) -> str:
    """SHA1 hex of the tokens as little-endian u32 bytes (the trailer's token key)."""
    return hashlib.sha1(tokens_to_bytes(tokens)).hexdigest()


def normalize_model_id(model_id: bytes | bytearray | str) -> bytes:
    """Model id as 1..32 raw bytes; a ``str`` is read as hex (e.g. a sha256 hexdigest)."""
    if isinstance(model_id, str):
        try:
            raw = bytes.fromhex(model_id)
        except ValueError:
            raise KVStoreError(f"model id {model_id!r} is not a hex string") from None
    elif isinstance(model_id, (bytes, bytearray)):
        raw = bytes(model_id)
    else:
        raise KVStoreError(f"model id must be bytes or a hex string, not {type(model_id).__name__}")
    if not 1 <= len(raw) <= MODEL_ID_MAX_BYTES:
        raise KVStoreError(f"model id is {len(raw)} bytes; expected 1..{MODEL_ID_MAX_BYTES}")
    return raw


def _payload_views(payload) -> list[memoryview]:
    """One byte view per chunk; a single buffer is one chunk (no copy either way)."""
    chunks = [payload] if isinstance(payload, (bytes, bytearray, memoryview, np.ndarray)) else payload
    views = []
    for i, chunk in enumerate(chunks):
        try:
            view = memoryview(chunk)
        except TypeError:
            raise KVStoreError(f"payload chunk {i} ({type(chunk).__name__}) is not a buffer") from None
        if not view.c_contiguous:
            raise KVStoreError(f"payload chunk {i} is not C-contiguous")
        if view.format != "B" or view.ndim != 1:
            try:
                view = view.cast("B")
            except (TypeError, ValueError):
                raise KVStoreError(f"payload chunk {i} (format {view.format!r}) cannot be viewed "
                                   f"as bytes") from None
        views.append(view)
    return views


def encode_tool_map(tool_map: Mapping[str, str] | None) -> bytes:
    """ds4's KTM trailer for ``{tool call id: exact DSML block}``; empty when there is nothing."""
    if not tool_map:
        return b""
    parts = [_KTM_HEAD.pack(KTM_MAGIC, KTM_VERSION, len(tool_map))]
    for tool_id, dsml in tool_map.items():
        id_b, dsml_b = _text_bytes(tool_id), _text_bytes(dsml)
        if not 1 <= len(id_b) <= KTM_MAX_ID_BYTES:
            raise KVStoreError(f"tool id {tool_id!r}: {len(id_b)} bytes, expected 1..{KTM_MAX_ID_BYTES}")
        if not 1 <= len(dsml_b) <= KTM_MAX_DSML_BYTES:
            raise KVStoreError(f"tool id {tool_id!r}: DSML of {len(dsml_b)} bytes, expected "
                               f"1..{KTM_MAX_DSML_BYTES}")
        parts += [_KTM_LENS.pack(len(id_b), len(dsml_b)), id_b, dsml_b]
    return b"".join(parts)


def decode_tool_map(data: bytes, where: str = "KTM trailer") -> dict[str, str]:
    """Inverse of ``encode_tool_map``; the block must be consumed exactly."""
    if len(data) < _KTM_HEAD.size:
        raise KVStoreError(f"{where}: {len(data)} bytes, shorter than its 8-byte header")
    magic, version, count = _KTM_HEAD.unpack_from(data, 0)
    if magic != KTM_MAGIC or version != KTM_VERSION:
        raise KVStoreError(f"{where}: bad magic/version {magic!r}/{version}")
    pos, out = _KTM_HEAD.size, {}
    for i in range(count):
        if pos + _KTM_LENS.size > len(data):
            raise KVStoreError(f"{where}: entry {i} header runs past the trailer at byte {pos}")
        id_len, dsml_len = _KTM_LENS.unpack_from(data, pos)
        pos += _KTM_LENS.size
        if not (1 <= id_len <= KTM_MAX_ID_BYTES and 1 <= dsml_len <= KTM_MAX_DSML_BYTES) or \
                pos + id_len + dsml_len > len(data):
            raise KVStoreError(f"{where}: entry {i} lengths {id_len}/{dsml_len} invalid at byte {pos}")
        tool_id = data[pos:pos + id_len].decode("utf-8", "surrogateescape")
        dsml = data[pos + id_len:pos + id_len + dsml_len].decode("utf-8", "surrogateescape")
        out[tool_id] = dsml
        pos += id_len + dsml_len
    if pos != len(data):
        raise KVStoreError(f"{where}: {len(data) - pos} unexpected bytes after {count} entries")
    return out


# ---------------------------------------------------------------------------------------------
# Header, tail and entries


def _header_crc(header: bytes) -> int:
    return zlib.crc32(header[24:48], zlib.crc32(header[:20]))


def pack_header(*, quant_bits: int, reason: int, ext_flags: int, tokens: int, hits: int,
                ctx_size: int, created_at: int, last_used: int, payload_bytes: int) -> bytes:
    """The 48-byte KVC header with its crc in bytes 20..23."""
    raw = _HEADER.pack(KVC_MAGIC, KVC_VERSION, quant_bits, reason, ext_flags, 0, tokens, hits,
                       ctx_size, 0, created_at, last_used, payload_bytes)
    return raw[:20] + struct.pack("<I", _header_crc(raw)) + raw[24:]


@dataclass(frozen=True)
class RawHeader:
    """The 48 header bytes unpacked as they are, before any check (for display and parsing)."""

    magic: bytes
    version: int
    quant_bits: int
    reason_code: int
    ext_flags: int
    reserved: int
    tokens: int
    hits: int
    ctx_size: int
    header_crc: int
    created_at: int
    last_used: int
    payload_bytes: int
    crc_ok: bool

    @classmethod
    def unpack(cls, data: bytes) -> RawHeader:
        fields = _HEADER.unpack_from(data, 0)
        return cls(*fields, crc_ok=fields[9] == _header_crc(data[:HEADER_BYTES]))


@dataclass(frozen=True)
class RawTail:
    magic: bytes
    version: int
    payload_version: int
    model_id_len: int
    pad: bytes
    model_id_field: bytes
    token_key: bytes
    file_crc: int

    @classmethod
    def unpack(cls, data: bytes) -> RawTail:
        return cls(*_TAIL.unpack_from(data, 0))


def pack_tail(*, payload_version: int, model_id: bytes, token_key: bytes) -> bytes:
    """The tail without its final crc (64 bytes); the writer appends the crc."""
    return _TAIL.pack(TAIL_MAGIC, TAIL_VERSION, payload_version, len(model_id), b"\0\0\0",
                      model_id.ljust(MODEL_ID_MAX_BYTES, b"\0"), token_key, 0)[:-4]


def key_kind_of(ext_flags: int) -> str:
    """ds4's precedence: responses-visible, then thinking-visible, else token-text."""
    if ext_flags & EXT_RESPONSES_VISIBLE:
        return "responses-visible"
    if ext_flags & EXT_THINKING_VISIBLE:
        return "thinking-visible"
    return "token-text"


@dataclass(frozen=True)
class Entry:
    """A ``.kv`` file whose header and trailer passed the cheap checks (payload not yet read)."""

    path: Path
    key: str  # lower-case SHA1 hex of the key text, from the file name
    quant_bits: int
    reason: SaveReason
    ext_flags: int
    tokens: int
    hits: int
    ctx_size: int
    created_at: int
    last_used: int
    payload_bytes: int
    text_bytes: int
    tool_map_bytes: int
    file_size: int
    mtime_ns: int
    model_id: bytes
    payload_version: int
    token_key: str

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def key_kind(self) -> str:
        return key_kind_of(self.ext_flags)

    @property
    def has_tool_map(self) -> bool:
        return bool(self.ext_flags & EXT_TOOL_MAP)

    def same_snapshot(self, other: Entry) -> bool:
        """Same file contents apart from the hit count and last-use time."""
        skip = {"hits", "last_used", "mtime_ns"}
        return all(getattr(self, f) == getattr(other, f)
                   for f in self.__dataclass_fields__ if f not in skip)


@dataclass(frozen=True)
class InvalidFile:
    """A ``<sha1>.kv`` file that failed the cheap checks; it still occupies the budget."""

    path: Path
    file_size: int
    mtime_ns: int
    reason: str
    corrupt: bool


class KVCacheDirError(KVStoreError):
    """The cache directory path is unusable: a regular file, or it cannot be created."""


class KVSaveSkipped(KVStoreError):
    """``store`` declined to write (not a failure): e.g. another model's checkpoint holds the name."""


class KVFileRejected(KVStoreError):
    """A ``.kv`` file failed a check. ``corrupt``: damaged (vs. valid but for another setup)."""

    def __init__(self, path: Path | str, reason: str, *, corrupt: bool):
        super().__init__(f"{path}: {reason}")
        self.path = Path(path)
        self.reason = reason
        self.corrupt = corrupt


def _read_exact(f, n: int, offset: int, path: Path, what: str) -> bytes:
    f.seek(offset)
    data = f.read(n)
    if len(data) != n:
        raise KVFileRejected(path, f"truncated: {what} needs {n} bytes at byte offset {offset}, "
                                   f"got {len(data)}", corrupt=True)
    return data


def _parse_entry(f, path: Path, st: os.stat_result) -> Entry:
    """Cheap checks: header, sizes, trailer; reads 52 + 68 bytes. Raises ``KVFileRejected``."""
    size = st.st_size
    if size < HEADER_BYTES + TEXT_LEN_BYTES:
        raise KVFileRejected(path, f"truncated: {size} bytes, shorter than the 52-byte header and "
                                   f"text length", corrupt=True)
    head = _read_exact(f, HEADER_BYTES + TEXT_LEN_BYTES, 0, path, "header")
    h = RawHeader.unpack(head)
    if h.magic != KVC_MAGIC:
        raise KVFileRejected(path, f"bad magic {h.magic!r} (not a KVC file)", corrupt=True)
    if (not h.ext_flags & EXT_DS4_MLX and h.header_crc == 0 and h.version == KVC_VERSION
            and h.quant_bits in QUANT_BITS and h.tokens != 0):
        # A header ds4 would accept, with bytes 20..23 zero as ds4 leaves them; ours carry a crc.
        raise KVFileRejected(path, "a ds4 (C) file (no ds4-mlx trailer flag, ext bit7): its payload "
                                   "is not ds4-mlx's", corrupt=False)
    if not h.crc_ok:
        raise KVFileRejected(path, f"header checksum mismatch (stored {h.header_crc:#010x}, "
                                   f"computed {_header_crc(head):#010x})", corrupt=True)
    if not h.ext_flags & EXT_DS4_MLX:
        raise KVFileRejected(path, "no ds4-mlx trailer flag (ext bit7)", corrupt=False)
    if h.version != KVC_VERSION:
        raise KVFileRejected(path, f"unsupported KVC version {h.version} (expected {KVC_VERSION})",
                             corrupt=False)
    if h.quant_bits not in QUANT_BITS:
        raise KVFileRejected(path, f"invalid routed quant bits {h.quant_bits} (expected 2 or 4)",
                             corrupt=True)
    if h.tokens == 0 or h.tokens > h.ctx_size:
        raise KVFileRejected(path, f"token count {h.tokens} invalid for ctx size {h.ctx_size}",
                             corrupt=True)
    if size < MIN_FILE_BYTES:
        raise KVFileRejected(path, f"truncated: {size} bytes, shorter than header and trailer",
                             corrupt=True)
    (text_bytes,) = _TEXT_LEN.unpack_from(head, HEADER_BYTES)
    fixed = MIN_FILE_BYTES + text_bytes + h.payload_bytes + 4 * h.tokens
    if size < fixed:
        raise KVFileRejected(path, f"truncated: {size} bytes, the header promises at least {fixed}",
                             corrupt=True)
    ktm_bytes = size - fixed
    if h.ext_flags & EXT_TOOL_MAP:
        if ktm_bytes < _KTM_HEAD.size:
            raise KVFileRejected(path, f"tool-map flag set but only {ktm_bytes} bytes left for it",
                                 corrupt=True)
    elif ktm_bytes:
        raise KVFileRejected(path, f"{ktm_bytes} unexpected bytes after the payload (expected "
                                   f"{fixed}-byte file)", corrupt=True)
    t = RawTail.unpack(_read_exact(f, TAIL_BYTES, size - TAIL_BYTES, path, "trailer"))
    if t.magic != TAIL_MAGIC:
        raise KVFileRejected(path, f"ds4-mlx trailer missing: bad magic {t.magic!r} at byte offset "
                                   f"{size - TAIL_BYTES}", corrupt=True)
    if t.version != TAIL_VERSION:
        raise KVFileRejected(path, f"unsupported ds4-mlx trailer version {t.version}", corrupt=False)
    m = t.model_id_len
    if not 1 <= m <= MODEL_ID_MAX_BYTES or t.pad != b"\0\0\0" or any(t.model_id_field[m:]):
        raise KVFileRejected(path, f"malformed model id field (length {m})", corrupt=True)
    match = _NAME_RE.match(path.name)
    return Entry(
        path=path, key=(match.group(1).lower() if match else ""), quant_bits=h.quant_bits,
        reason=SaveReason(h.reason_code) if h.reason_code <= SaveReason.AGENT_SESSION else SaveReason.UNKNOWN,
        ext_flags=h.ext_flags, tokens=h.tokens, hits=h.hits, ctx_size=h.ctx_size,
        created_at=h.created_at, last_used=h.last_used, payload_bytes=h.payload_bytes,
        text_bytes=text_bytes, tool_map_bytes=ktm_bytes, file_size=size, mtime_ns=st.st_mtime_ns,
        model_id=t.model_id_field[:m], payload_version=t.payload_version, token_key=t.token_key.hex())


class NotRegularFile(OSError):
    """A path that names a FIFO, socket, device, directory or (unless followed) a symlink."""


def open_regular(path: Path, flags: int = os.O_RDONLY, *, follow: bool = False):
    """``(unbuffered binary file, fstat)`` of a regular file, opened so that it cannot hang.

    A FIFO named like an entry would block a plain ``open`` until some writer appears (and then
    feed it garbage): O_NONBLOCK makes the open return at once, and the fstat after it, on the
    very file opened, refuses anything that is not a regular file. O_NOFOLLOW (unless ``follow``)
    keeps a link in the cache directory from pointing a read or a header rewrite elsewhere.
    Raises ``NotRegularFile`` or the ``OSError`` of the open.
    """
    extra = os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (0 if follow else os.O_NOFOLLOW)
    fd = os.open(path, flags | extra)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(errno.EINVAL, "not a regular file")
        return os.fdopen(fd, "rb" if flags == os.O_RDONLY else "wb", buffering=0), st
    except BaseException:
        os.close(fd)
        raise


def read_entry(path: str | os.PathLike) -> Entry:
    """Cheap checks on one file (header, layout, trailer). Raises ``KVFileRejected``."""
    path = Path(path)
    try:
        f, st = open_regular(path, follow=True)
    except OSError as exc:
        raise KVFileRejected(path, f"cannot read: {exc.strerror or exc}", corrupt=False) from None
    with f:
        try:
            return _parse_entry(f, path, st)
        except OSError as exc:
            raise KVFileRejected(path, f"cannot read: {exc.strerror or exc}", corrupt=False) from None


@dataclass(frozen=True)
class FileContents:
    tokens: list[int]
    text: bytes
    payload: bytearray
    tool_map: dict[str, str]


def read_tool_map(entry: Entry) -> dict[str, str]:
    """Only the KTM block of ``entry`` (``{}`` when it has none), without reading the payload:
    the server looks up exact tool-call replays by id across the directory (ds4's
    kv_cache_restore_tool_memory_for_messages). Structure is checked, not the file crc (that
    needs the whole payload); a damaged map can only cost a cache miss. Raises
    ``KVFileRejected``."""
    if not entry.tool_map_bytes:
        return {}
    path = entry.path
    try:
        f, _ = open_regular(path)
    except OSError as exc:
        raise KVFileRejected(path, f"cannot read: {exc.strerror or exc}", corrupt=False) from None
    with f:
        at = HEADER_BYTES + TEXT_LEN_BYTES + entry.text_bytes + entry.payload_bytes
        data = _read_exact(f, entry.tool_map_bytes, at, path, "KTM trailer")
    try:
        return decode_tool_map(data, f"{path}: KTM trailer")
    except KVStoreError as exc:
        raise KVFileRejected(path, str(exc), corrupt=True) from None


def read_contents(entry: Entry) -> FileContents:
    """Full read with every check: file unchanged since ``entry``, text hash = name, token key,
    KTM block, file crc. Raises ``KVFileRejected``."""
    path = entry.path
    try:
        f, st = open_regular(path)
    except OSError as exc:
        raise KVFileRejected(path, f"cannot read: {exc.strerror or exc}", corrupt=False) from None
    with f:
        now = _parse_entry(f, path, st)
        if not now.same_snapshot(entry):
            raise KVFileRejected(path, "file changed since it was listed", corrupt=False)
        pre = _read_exact(f, TEXT_LEN_BYTES + entry.text_bytes, HEADER_BYTES, path, "text")
        text = pre[TEXT_LEN_BYTES:]
        if entry.key and hashlib.sha1(text).hexdigest() != entry.key:
            raise KVFileRejected(path, "text does not hash to the file name (damaged text or "
                                       "misnamed file)", corrupt=True)
        crc = zlib.crc32(pre)
        payload = bytearray(entry.payload_bytes)
        view = memoryview(payload)
        pos = 0
        while pos < len(payload):
            got = f.readinto(view[pos:pos + _READ_CHUNK])
            if not got:
                raise KVFileRejected(path, f"truncated: payload ends after {pos} of "
                                           f"{len(payload)} bytes", corrupt=True)
            crc = zlib.crc32(view[pos:pos + got], crc)
            pos += got
        n_rest = entry.tool_map_bytes + 4 * entry.tokens + TAIL_BYTES
        rest = _read_exact(f, n_rest, HEADER_BYTES + len(pre) + len(payload), path, "trailer")
        crc = zlib.crc32(memoryview(rest)[:-4], crc)
        (stored,) = struct.unpack_from("<I", rest, n_rest - 4)
        if crc != stored:
            raise KVFileRejected(path, f"file checksum mismatch (stored {stored:#010x}, computed "
                                       f"{crc:#010x}): damaged text, payload or trailer", corrupt=True)
    k = entry.tool_map_bytes
    token_bytes = rest[k:k + 4 * entry.tokens]
    if hashlib.sha1(token_bytes).hexdigest() != entry.token_key:
        raise KVFileRejected(path, "stored tokens do not match the token key", corrupt=True)
    tool_map = {}
    if k:
        try:
            tool_map = decode_tool_map(rest[:k], f"{path}: KTM trailer")
        except KVStoreError as exc:
            raise KVFileRejected(path, str(exc), corrupt=True) from None
    tokens = np.frombuffer(token_bytes, dtype="<u4").tolist()
    return FileContents(tokens=tokens, text=text, payload=payload, tool_map=tool_map)


# ---------------------------------------------------------------------------------------------
# Directory scan, temp clean-up, eviction


@dataclass
class DirScan:
    entries: list[Entry] = field(default_factory=list)
    invalid: list[InvalidFile] = field(default_factory=list)
    temps: list[Path] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        """Bytes of every ``.kv`` file, valid or not (temp files are not counted)."""
        return sum(e.file_size for e in self.entries) + sum(i.file_size for i in self.invalid)

    def by_name(self, name: str) -> Entry | InvalidFile | None:
        for item in (*self.entries, *self.invalid):
            if item.path.name == name:
                return item
        return None


def scan_dir(directory: str | os.PathLike) -> DirScan:
    """Every ``<40 hex>.kv`` file (cheap checks only) and every ``.kv.tmp.<pid>`` temp, by name."""
    directory = Path(directory)
    scan = DirScan()
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return scan
    except OSError as exc:
        raise KVStoreError(f"{directory}: cannot list the KV cache directory: {exc.strerror or exc}") from None
    for name in names:
        path = directory / name
        if _TEMP_RE.match(name):
            try:
                if stat.S_ISREG(path.lstat().st_mode):
                    scan.temps.append(path)
            except OSError:
                pass
            continue
        if not _NAME_RE.match(name):
            continue
        try:
            st = path.lstat()
        except FileNotFoundError:
            continue
        except OSError as exc:
            scan.invalid.append(InvalidFile(path, 0, 0, f"cannot stat: {exc.strerror}", corrupt=False))
            continue
        if not stat.S_ISREG(st.st_mode):
            continue  # a FIFO, link, directory...: never ours, never opened, never deleted
        try:
            f, st = open_regular(path)
            with f:
                scan.entries.append(_parse_entry(f, path, st))
        except NotRegularFile:
            continue  # replaced by a non-regular file since the lstat
        except KVFileRejected as rej:
            scan.invalid.append(InvalidFile(path, st.st_size, st.st_mtime_ns, rej.reason, rej.corrupt))
        except FileNotFoundError:
            continue
        except OSError as exc:
            scan.invalid.append(InvalidFile(path, st.st_size, st.st_mtime_ns,
                                            f"cannot read: {exc.strerror or exc}", corrupt=False))
    return scan


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OverflowError:
        return False
    return True


def clean_stale_temps(directory: str | os.PathLike, now: float | None = None) -> list[Path]:
    """Remove temp files left by writers that died (their pid is gone, or older than a day)."""
    now = time.time() if now is None else now
    removed = []
    for path in scan_dir(directory).temps:
        pid = int(_TEMP_RE.match(path.name).group(1))
        try:
            age = now - path.stat().st_mtime
        except FileNotFoundError:
            continue
        if pid == os.getpid() and age < STALE_TEMP_SECONDS:
            continue  # possibly another store of this process, mid-write
        if _pid_alive(pid) and age < STALE_TEMP_SECONDS:
            continue
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            logger.warning("kv cache: cannot remove stale temp file %s: %s", path, exc.strerror)
            continue
        logger.info("kv cache: removed stale temp file %s (writer pid %d gone)", path, pid)
        removed.append(path)
    return removed


# The issue's (and ds4 branch f6bd3ee's) set; ds4's agent-system / agent-session saves come from
# its separate agent tool and are left at x1 until there is a reason to rank them.
ANCHOR_REASONS = frozenset({SaveReason.COLD, SaveReason.EVICT, SaveReason.SHUTDOWN})


@dataclass(frozen=True)
class Evicted:
    path: Path
    file_size: int
    tokens: int  # 0 for an invalid file
    hits: int
    score: float  # the effective score it was chosen by
    why: str  # "disk-cache-full" or "invalid: <reason>"
    note: str = ""  # the score's factors, e.g. "superseded x0.02 by <name>" (EvictionScore.note)


@dataclass(frozen=True)
class PendingCheckpoint:
    """The file ``store`` is about to write. Room is made before it exists, but it may already
    supersede stored continued checkpoints (ds4 evicts after the rename, with the new file listed)."""

    name: str
    token_bytes: bytes
    model_id: bytes
    payload_version: int
    created_at: int  # as its header will say (now, or the replaced file's when rewritten)


@dataclass(frozen=True)
class EvictionScore:
    """An item's eviction value: ``score = base * anchor_factor * superseded_factor``."""

    score: float  # what eviction compares, lowest first (inf for the protected file)
    base: float  # ds4 HEAD's (effective hits + 1) * tokens / bytes; 0 for an invalid file
    anchor_factor: float = 1.0
    superseded_factor: float = 1.0
    superseded_by: tuple[str, ...] = ()  # newer entries whose tokens strictly extend this one
    protected: bool = False

    @property
    def note(self) -> str:
        parts = []
        if self.protected:
            parts.append("protected")
        if self.anchor_factor != 1.0:
            parts.append(f"anchor x{self.anchor_factor:g}")
        if self.superseded_factor != 1.0:
            more = f" (+{len(self.superseded_by) - 1})" if len(self.superseded_by) > 1 else ""
            parts.append(f"superseded x{self.superseded_factor:g} by {self.superseded_by[0]}{more}")
        return ", ".join(parts)


def read_trailer_tokens(entry: Entry) -> bytes | None:
    """The entry's token ids as stored in its trailer (u32 LE), or None when unreadable, changed
    since it was listed, or not matching its token key. Reads ``4 * tokens`` bytes, never the
    text or payload (120 KB for a 30k-token checkpoint of several GB)."""
    n = 4 * entry.tokens
    try:
        f, st = open_regular(entry.path)
    except OSError:
        return None
    with f:
        if st.st_size != entry.file_size:
            return None
        try:
            data = os.pread(f.fileno(), n, entry.file_size - TAIL_BYTES - n)
        except OSError:
            return None
    if len(data) != n or hashlib.sha1(data).hexdigest() != entry.token_key:
        return None  # damaged: a file we cannot trust must not demote another
    return data


def superseded_continued(entries: Sequence[Entry],
                         pending: PendingCheckpoint | None = None) -> dict[str, tuple[str, ...]]:
    """Continued entries whose tokens are a strict prefix of a newer entry's, by file name, with
    the names of those newer entries.

    Newer means created at the same second or later (timestamps are whole seconds, and within one
    session a prefix is always saved before its extension); ``pending`` counts as listed. Only an
    entry of the same model id and payload version can stand in for the prefix. Trailer tokens
    are read only for entries that could extend some continued entry, each once, and each one's
    candidate prefixes are hashed incrementally in one pass over its tokens.
    """
    conts = [e for e in entries if e.reason == SaveReason.CONTINUED]
    if not conts:
        return {}
    newer: list[tuple[str, int, float, bytes, int, Callable[[], bytes | None]]] = [
        (e.name, e.tokens, float(e.created_at), e.model_id, e.payload_version,
         (lambda e=e: read_trailer_tokens(e))) for e in entries]
    if pending is not None:
        newer.append((pending.name, len(pending.token_bytes) // 4, float(pending.created_at),
                      pending.model_id, pending.payload_version, lambda: pending.token_bytes))
    found: dict[str, list[str]] = {}
    for name, n_tokens, created, model_id, payload_version, read in newer:
        cands = sorted((p for p in conts if p.name != name and p.tokens < n_tokens
                        and p.created_at <= created and p.model_id == model_id
                        and p.payload_version == payload_version), key=lambda p: p.tokens)
        if not cands:
            continue
        data = read()
        if data is None:
            continue
        view = memoryview(data)
        h, pos = hashlib.sha1(), 0
        for p in cands:
            end = 4 * p.tokens
            h.update(view[pos:end])
            pos = end
            if h.hexdigest() == p.token_key:
                found.setdefault(p.name, []).append(name)
    return {k: tuple(sorted(v)) for k, v in found.items()}


def _score(item: Entry | InvalidFile, now: float, options: KVStoreOptions = DEFAULT_OPTIONS,
           superseded_by: Sequence[str] = ()) -> EvictionScore:
    if isinstance(item, InvalidFile):
        return EvictionScore(0.0, 0.0)  # unloadable: worth nothing
    base = eviction_score(item.tokens, item.hits, item.file_size, item.last_used, item.created_at, now)
    eff = effective_hits(item.hits, item.last_used, item.created_at, now)
    superseded = bool(superseded_by) and item.reason == SaveReason.CONTINUED
    anchor_f, superseded_f = score_factors(anchor=item.reason in ANCHOR_REASONS, superseded=superseded,
                                           eff_hits=eff, opts=options)
    return EvictionScore(base * anchor_f * superseded_f, base, anchor_f, superseded_f,
                         tuple(superseded_by) if superseded_f != 1.0 else ())


def eviction_scores(items: Sequence[Entry | InvalidFile], now: float,
                    options: KVStoreOptions = DEFAULT_OPTIONS) -> dict[str, EvictionScore]:
    """Every item's current eviction score, by file name (what ``kv ls`` shows)."""
    entries = [x for x in items if isinstance(x, Entry)]
    sup = superseded_continued(entries) if options.demote_superseded_continued else {}
    return {x.path.name: _score(x, now, options, sup.get(x.path.name, ())) for x in items}


def eviction_order(items: Sequence[Entry | InvalidFile], now: float, protect: str | None = None, *,
                   options: KVStoreOptions = DEFAULT_OPTIONS, pending: PendingCheckpoint | None = None,
                   ) -> list[tuple[Entry | InvalidFile, EvictionScore]]:
    """Items in the order they are evicted: score, then older last use, then name; ``protect``
    (a file name) last.

    Equal to ds4's repeated minimum search: a score only changes when an entry's last superseder
    goes, which restores its full score, so that entry is re-queued with its new key.
    """
    entries = [x for x in items if isinstance(x, Entry)]
    sup = superseded_continued(entries, pending) if options.demote_superseded_continued else {}
    remaining = {p: set(qs) for p, qs in sup.items()}
    extends: dict[str, list[str]] = {}
    for p, qs in sup.items():
        for q in qs:
            extends.setdefault(q, []).append(p)
    by_name = {x.path.name: x for x in items}
    current: dict[str, tuple[int, EvictionScore]] = {}  # name -> (version, score)
    heap: list[tuple[float, int, str, int]] = []

    def push(name: str) -> None:
        item = by_name[name]
        s = _score(item, now, options, sorted(remaining.get(name, ())))
        if protect and name == protect:
            s = replace(s, score=math.inf, protected=True)
        version = current[name][0] + 1 if name in current else 0
        current[name] = (version, s)
        heapq.heappush(heap, (s.score, item.last_used if isinstance(item, Entry) else 0, name, version))

    for name in by_name:
        push(name)
    order: list[tuple[Entry | InvalidFile, EvictionScore]] = []
    done: set[str] = set()
    while heap:
        _, _, name, version = heapq.heappop(heap)
        if name in done or version != current[name][0]:
            continue  # the old key of a re-queued entry
        done.add(name)
        order.append((by_name[name], current[name][1]))
        for p in extends.get(name, ()):
            left = remaining[p]
            left.discard(name)
            if not left and p not in done:
                push(p)
    return order


def _unlink_victim(item: Entry | InvalidFile, score: EvictionScore) -> Evicted | None:
    try:
        item.path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("kv cache: cannot evict %s: %s", item.path, exc.strerror)
        return None
    if isinstance(item, InvalidFile):
        ev = Evicted(item.path, item.file_size, 0, 0, score.score, f"invalid: {item.reason}", score.note)
    else:
        ev = Evicted(item.path, item.file_size, item.tokens, item.hits, score.score, "disk-cache-full",
                     score.note)
    logger.info("kv cache evicted reason=%s tokens=%d hits=%d size=%.2f MiB score=%.6g%s file=%s",
                ev.why, ev.tokens, ev.hits, ev.file_size / 2**20, ev.score,
                f" ({ev.note})" if ev.note else "", ev.path)
    return ev


def evict_to_budget(directory: str | os.PathLike, budget: int, now: float | None = None, *,
                    protect: str | None = None, extra_bytes: int = 0,
                    options: KVStoreOptions = DEFAULT_OPTIONS) -> list[Evicted]:
    """Delete files by ``eviction_order`` until all ``.kv`` files plus ``extra_bytes`` fit ``budget``.

    ``protect`` (a file name) is never chosen unless it alone exceeds the budget (ds4's rule).
    ``options`` selects the scoring (``KVStoreOptions.ds4_head()``: ds4 HEAD's). Returns what was
    removed.
    """
    now = time.time() if now is None else now
    scan = scan_dir(directory)
    total = scan.total_bytes + extra_bytes
    if total <= budget:
        return []  # no scoring, so no trailer reads, when nothing has to go
    protected = scan.by_name(protect) if protect else None
    if protected is not None and protected.file_size > budget:
        protect = None
    removed = []
    for item, score in eviction_order([*scan.entries, *scan.invalid], now, protect, options=options):
        if total <= budget:
            break
        if protect and item.path.name == protect:
            break
        ev = _unlink_victim(item, score)
        if ev is not None:
            removed.append(ev)
            total -= item.file_size
    return removed


def check_cache_dir(directory: str | os.PathLike) -> None:
    """Raise ``KVCacheDirError`` when ``directory`` exists and is not a directory (it is created
    later when missing)."""
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise KVCacheDirError(f"{path}: exists and is not a directory; the KV cache needs a "
                              f"directory of its own")


@contextmanager
def directory_lock(directory: str | os.PathLike) -> Iterator[bool]:
    """Hold an exclusive advisory lock on the cache directory (``flock`` on ``LOCK_NAME`` in it).

    Every writer takes it around "make room, then write", so the budget holds for any number of
    processes sharing the directory: without it, each one evicts against the same listing and
    then writes, and the directory ends up holding all their files. Yields False, unlocked, when
    the lock file cannot be opened (a read-only directory, where nothing can be written anyway).
    """
    path = Path(directory) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW
                     | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)  # releases the lock


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename itself already happened
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# The store


@dataclass(frozen=True)
class LoadedEntry(FileContents):
    """A loaded checkpoint: the file's contents plus where they came from. Unpacks as
    ``tokens, text, payload = store.load(entry)``."""

    entry: Entry
    consumed: bool  # the file was deleted after loading (more than cold_max_tokens tokens)

    def __iter__(self) -> Iterator:
        return iter((self.tokens, self.text, self.payload))


class KVStore:
    """A ds4-style disk KV cache directory for one model, quant and context size.

    ``model_id``: 1..32 bytes (or hex) identifying the weights; ``payload_version``: the session
    payload format version. Files that differ in either, in quant bits (unless
    ``accept_other_quant``, ds4's default), or were saved for a larger ctx are never offered.
    ``budget_mb`` is in MiB (fractions allowed; 0 = ds4's default 4096). ``clock`` returns unix
    seconds (injectable for tests). Opening removes dead writers' temp files and evicts down to
    the budget, as ds4 does on open.
    """

    def __init__(self, directory: str | os.PathLike, budget_mb: float = DEFAULT_BUDGET_MB, *,
                 model_id: bytes | str, quant_bits: int, ctx: int, payload_version: int = 1,
                 options: KVStoreOptions = DEFAULT_OPTIONS, accept_other_quant: bool = False,
                 clock: Callable[[], float] = time.time):
        if quant_bits not in QUANT_BITS:
            raise KVStoreError(f"quant_bits={quant_bits!r}: expected 2 or 4")
        if not isinstance(ctx, int) or not 0 < ctx <= U32_MAX:
            raise KVStoreError(f"ctx={ctx!r}: expected a positive u32")
        if not isinstance(payload_version, int) or not 0 <= payload_version <= U32_MAX:
            raise KVStoreError(f"payload_version={payload_version!r}: expected a u32")
        self.directory = Path(directory)
        self.budget = budget_bytes(budget_mb)
        self.model_id = normalize_model_id(model_id)
        self.quant_bits = quant_bits
        self.ctx = ctx
        self.payload_version = payload_version
        self.options = options
        self.accept_other_quant = accept_other_quant
        self._clock = clock
        self._lock = threading.RLock()
        self._failed: dict[str, tuple[int, int]] = {}  # name -> (size, mtime_ns) of a failed load
        self._logged: set[tuple] = set()
        check_cache_dir(self.directory)
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise KVCacheDirError(f"{self.directory}: cannot create the KV cache directory: "
                                  f"{exc.strerror or exc}") from None
        with directory_lock(self.directory):
            clean_stale_temps(self.directory, self._clock())
            evict_to_budget(self.directory, self.budget, self._clock(), options=options)
        logger.info("kv cache %s budget=%.2f MiB quant=%d ctx=%d cross-quant=%s min=%d cold_max=%d "
                    "continued=%d trim=%d align=%d anchor=x%g demote-superseded=%s", self.directory,
                    self.budget / 2**20, quant_bits, ctx, "accept" if accept_other_quant else "reject",
                    options.min_tokens, options.cold_max_tokens, options.continued_interval_tokens,
                    options.boundary_trim_tokens, options.boundary_align_tokens,
                    options.anchor_score_factor, "on" if options.demote_superseded_continued else "off")

    key_for_text = staticmethod(key_for_text)
    key_for_tokens = staticmethod(key_for_tokens)

    # -- listing ---------------------------------------------------------------------------------

    def scan(self) -> DirScan:
        with self._lock:
            scan = scan_dir(self.directory)
            for bad in scan.invalid:
                self._log_once(logging.WARNING if bad.corrupt else logging.INFO,
                               (bad.path.name, bad.file_size, bad.mtime_ns, bad.reason),
                               "kv cache ignoring %s: %s", bad.path, bad.reason)
            return scan

    def entries(self) -> list[Entry]:
        """Every readable entry in the directory, compatible or not."""
        return self.scan().entries

    def total_bytes(self) -> int:
        return scan_dir(self.directory).total_bytes

    def incompatibility(self, entry: Entry) -> str | None:
        """Why this store must not load ``entry`` (None: it may)."""
        if entry.model_id != self.model_id:
            return f"other model (id {entry.model_id.hex()}, ours {self.model_id.hex()})"
        if entry.payload_version != self.payload_version:
            return f"payload version {entry.payload_version} (ours {self.payload_version})"
        if entry.quant_bits != self.quant_bits and not self.accept_other_quant:
            return f"quant bits {entry.quant_bits} (ours {self.quant_bits})"
        if entry.ctx_size > self.ctx:
            return f"saved for ctx {entry.ctx_size} > current ctx {self.ctx}"
        return None

    def _log_once(self, level: int, token: tuple, msg: str, *args) -> None:
        if token not in self._logged:
            self._logged.add(token)
            logger.log(level, msg, *args)

    def _failed_before(self, entry: Entry) -> bool:
        return self._failed.get(entry.name) == (entry.file_size, entry.mtime_ns)

    # -- lookup and load -------------------------------------------------------------------------

    def lookup(self, rendered_text: str | bytes | None = None,
               tokens: Sequence[int] | np.ndarray | None = None,
               min_tokens: int | None = None) -> Entry | None:
        """The longest compatible stored prefix of the prompt, by text or by tokens (give one)."""
        if (rendered_text is None) == (tokens is None):
            raise KVStoreError("lookup needs exactly one of rendered_text or tokens")
        min_tokens = self.options.min_tokens if min_tokens is None else min_tokens
        by_text = rendered_text is not None
        query = _text_bytes(rendered_text) if by_text else tokens_to_bytes(tokens)
        hashes: dict[int, str] = {}
        best: Entry | None = None
        with self._lock:
            for e in self.scan().entries:
                length = e.text_bytes if by_text else 4 * e.tokens
                if length > len(query) or e.tokens < min_tokens or self._failed_before(e):
                    continue
                rank = (e.text_bytes, e.tokens) if by_text else (e.tokens, e.last_used)
                if best is not None and rank <= ((best.text_bytes, best.tokens) if by_text
                                                 else (best.tokens, best.last_used)):
                    continue
                if length not in hashes:
                    hashes[length] = hashlib.sha1(memoryview(query)[:length]).hexdigest()
                if hashes[length] != (e.key if by_text else e.token_key):
                    continue
                why = self.incompatibility(e)
                if why is not None:
                    self._log_once(logging.INFO, (e.name, e.file_size, e.mtime_ns, why),
                                   "kv cache skipping %s: %s", e.path, why)
                    continue
                best = e
        return best

    def load(self, entry: Entry) -> LoadedEntry:
        """Read and fully check ``entry``; then count the hit, or delete it when consumed.

        Raises ``KVFileRejected`` (logged; the file stays on disk) when any check fails.
        """
        with self._lock:
            t0 = time.perf_counter()
            try:
                why = self.incompatibility(entry)
                if why is not None:
                    raise KVFileRejected(entry.path, why, corrupt=False)
                contents = read_contents(entry)
            except KVFileRejected as rej:
                self._failed[entry.name] = (entry.file_size, entry.mtime_ns)
                logger.log(logging.WARNING if rej.corrupt else logging.INFO,
                           "kv cache load failed %s: %s", entry.path, rej.reason)
                raise
            ms = (time.perf_counter() - t0) * 1e3
            cold_max = self.options.cold_max_tokens
            consumed = cold_max > 0 and entry.tokens > cold_max
            if consumed:
                try:
                    entry.path.unlink()
                except OSError as exc:
                    logger.warning("kv cache cannot delete consumed %s: %s", entry.path, exc.strerror)
            else:
                self._touch(entry)
            logger.info("kv cache hit tokens=%d text=%d quant=%d key=%s load=%.1f ms%s file=%s",
                        entry.tokens, entry.text_bytes, entry.quant_bits, entry.key_kind, ms,
                        " consumed" if consumed else "", entry.path)
            return LoadedEntry(contents.tokens, contents.text, contents.payload, contents.tool_map,
                               entry, consumed)

    def restore(self, rendered_text: str | bytes | None = None,
                tokens: Sequence[int] | np.ndarray | None = None,
                min_tokens: int | None = None) -> LoadedEntry | None:
        """``lookup`` then ``load``, falling back to the next best entry when a load fails."""
        with self._lock:
            for _ in range(len(self.entries()) + 1):  # each failed load is skipped afterwards
                entry = self.lookup(rendered_text, tokens, min_tokens)
                if entry is None:
                    return None
                try:
                    return self.load(entry)
                except KVFileRejected:
                    continue
            return None

    def mark_unloadable(self, entry: Entry, reason: str) -> None:
        """Record that the session loader refused this entry's payload: lookups skip it from now on.

        ds4 deletes such a file; here it stays (it may suit another configuration) and is logged.
        """
        with self._lock:
            try:
                st = entry.path.stat()  # the load that preceded this rewrote the header (mtime)
            except OSError:
                return
            self._failed[entry.name] = (st.st_size, st.st_mtime_ns)
            logger.warning("kv cache payload of %s refused by the loader: %s", entry.path, reason)

    def _touch(self, entry: Entry) -> None:
        """hits + 1 and last used = now, by one 48-byte write (header crc included)."""
        header = pack_header(quant_bits=entry.quant_bits, reason=int(entry.reason),
                             ext_flags=entry.ext_flags, tokens=entry.tokens, hits=min(entry.hits + 1, U32_MAX),
                             ctx_size=entry.ctx_size, created_at=entry.created_at,
                             last_used=int(self._clock()), payload_bytes=entry.payload_bytes)
        try:
            f, _ = open_regular(entry.path, os.O_WRONLY)
        except OSError as exc:
            logger.warning("kv cache cannot record hit on %s: %s", entry.path, exc.strerror)
            return
        with f:
            try:
                os.pwrite(f.fileno(), header, 0)
            except OSError as exc:
                logger.warning("kv cache cannot record hit on %s: %s", entry.path, exc.strerror)

    # -- store -----------------------------------------------------------------------------------

    def store(self, tokens: Sequence[int] | np.ndarray, text: str | bytes, payload,
              reason: SaveReason | str | int, *, key_kind: str = "token-text",
              tool_map: Mapping[str, str] | None = None) -> Entry | None:
        """Write a checkpoint of ``tokens`` keyed by ``text``; returns its entry, or None if skipped.

        ``payload``: one buffer or a sequence of buffers (written in order, never joined).
        Skipped (logged, None) when shorter than ``min_tokens`` or too big for the budget. A
        compatible file with the same text is kept as is (ds4), unless ``tool_map`` differs from
        its stored map: then it is rewritten with its hit count. Raises ``KVStoreError`` on bad
        arguments or a failed write (the directory is left as it was, minus evicted files).
        """
        reason = SaveReason.parse(reason)
        if key_kind not in KEY_KINDS:
            raise KVStoreError(f"key_kind={key_kind!r}: expected one of {', '.join(KEY_KINDS)}")
        token_bytes = tokens_to_bytes(tokens)
        n = len(token_bytes) // 4
        if n == 0:
            raise KVStoreError("cannot store a checkpoint of 0 tokens")
        if n > self.ctx:
            raise KVStoreError(f"{n} tokens do not fit the context size {self.ctx}")
        text_b = _text_bytes(text)
        if len(text_b) > U32_MAX:
            raise KVStoreError(f"key text of {len(text_b)} bytes exceeds the u32 length field")
        views = _payload_views(payload)
        payload_bytes = sum(v.nbytes for v in views)
        if payload_bytes == 0:
            raise KVStoreError("cannot store an empty payload")
        ktm = encode_tool_map(tool_map)
        ext = EXT_DS4_MLX | KEY_KINDS[key_kind] | (EXT_TOOL_MAP if ktm else 0)
        if n < self.options.min_tokens:
            logger.debug("kv cache skipped tokens=%d reason=%s: below min %d", n, reason.label,
                         self.options.min_tokens)
            return None
        file_bytes = MIN_FILE_BYTES + len(text_b) + payload_bytes + len(ktm) + len(token_bytes)
        if not fits_budget(file_bytes, self.budget):
            logger.info("kv cache skipped tokens=%d reason=%s: file %.2f MiB (%.2f MiB with safety) "
                        "exceeds budget %.2f MiB", n, reason.label, file_bytes / 2**20,
                        required_bytes(file_bytes) / 2**20, self.budget / 2**20)
            return None
        key = hashlib.sha1(text_b).hexdigest()
        name = f"{key}.kv"
        with self._lock, directory_lock(self.directory):
            return self._store_locked(name, n, token_bytes, text_b, views, payload_bytes, ktm, ext,
                                      reason, key_kind, file_bytes)

    def _store_locked(self, name: str, n: int, token_bytes: bytes, text_b: bytes, views: list,
                      payload_bytes: int, ktm: bytes, ext: int, reason: SaveReason, key_kind: str,
                      file_bytes: int) -> Entry | None:
        """``store``'s part under both locks: make room, then write (see ``directory_lock``)."""
        scan = self.scan()
        same = scan.by_name(name)
        hits, created = 0, int(self._clock())
        keep_same = False  # a compatible copy of this very checkpoint is already there
        same_why = same.reason if isinstance(same, InvalidFile) else None
        if isinstance(same, Entry) and same.model_id != self.model_id:
            # The name is the text's hash alone (ds4's): another model sharing the directory
            # saved the same text. Its checkpoint is not ours to overwrite.
            raise KVSaveSkipped(f"{same.path} holds another model's checkpoint of the same "
                                f"text (model id {same.model_id.hex()[:16]}…); not overwritten")
        if isinstance(same, Entry):
            same_why = self.incompatibility(same)
            if same_why is None and self._failed_before(same):
                # Our session loader refused its payload (e.g. another prefill chunk): keeping
                # it "as is" would report a save that no later run of ours can load.
                same_why = "its payload was refused by this loader"
        if isinstance(same, Entry) and same_why is None:
            # Fully verified (a read, cheaper than the write it saves): a damaged copy must
            # not shadow the good checkpoint we hold in hand.
            try:
                stored = read_contents(same)
            except KVFileRejected as rej:
                logger.warning("kv cache existing %s is unusable: %s", same.path, rej.reason)
                stored, same_why = None, rej.reason
            if stored is not None:
                if not ktm or encode_tool_map(stored.tool_map) == ktm:
                    logger.debug("kv cache already holds %s", same.path)
                    return same
                keep_same, hits, created = True, same.hits, same.created_at
        same_bytes = same.file_size if same is not None else 0
        others = [x for x in (*scan.entries, *scan.invalid) if x.path.name != name]
        if same_bytes + file_bytes > self.budget:
            if keep_same:
                logger.info("kv cache kept %s: no room to rewrite it with a new tool map", same.path)
                return same
            if same is not None:
                self._remove(same.path, f"to make room for its replacement ({same_why})")
                same_bytes = 0
        excess = sum(x.file_size for x in others) + same_bytes + file_bytes - self.budget
        if excess > 0:  # scoring reads trailers; skip it when nothing has to go
            pending = PendingCheckpoint(name, token_bytes, self.model_id, self.payload_version, created)
            for item, score in eviction_order(others, self._clock(), options=self.options,
                                              pending=pending):
                if excess <= 0:
                    break
                if _unlink_victim(item, score) is not None:
                    excess -= item.file_size
        if excess > 0:
            raise KVStoreError(f"{self.directory}: cannot make room for a {file_bytes}-byte "
                               f"checkpoint within the {self.budget}-byte budget")
        if same_bytes:
            logger.info("kv cache replacing %s (%s)", same.path,
                        "new tool map" if keep_same else same_why)
        header = pack_header(quant_bits=self.quant_bits, reason=int(reason), ext_flags=ext,
                             tokens=n, hits=hits, ctx_size=self.ctx, created_at=created,
                             last_used=int(self._clock()), payload_bytes=payload_bytes)
        tail = pack_tail(payload_version=self.payload_version, model_id=self.model_id,
                         token_key=hashlib.sha1(token_bytes).digest())
        t0 = time.perf_counter()
        path = self.directory / name
        self._write_atomic(path, header, [_TEXT_LEN.pack(len(text_b)), text_b, *views, ktm,
                                          token_bytes, tail])
        ms = (time.perf_counter() - t0) * 1e3
        entry = read_entry(path)
        logger.info("kv cache stored tokens=%d reason=%s key=%s size=%.2f MiB save=%.1f ms file=%s",
                    n, reason.label, key_kind, file_bytes / 2**20, ms, path)
        return entry

    @staticmethod
    def _remove(path: Path, why: str) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise KVStoreError(f"{path}: cannot remove {why}: {exc.strerror}") from None
        logger.info("kv cache removed %s %s", path, why)

    def _write_atomic(self, path: Path, header: bytes, pieces: list) -> None:
        """header + pieces + crc32(pieces) into a temp file, fsync, rename over ``path``, fsync dir."""
        tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                crc = 0
                for piece in pieces:
                    if len(piece):
                        f.write(piece)
                        crc = zlib.crc32(piece, crc)
                f.write(struct.pack("<I", crc))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException as exc:
            try:
                tmp.unlink()
            except OSError:
                pass
            if isinstance(exc, OSError):  # raised, not logged: the caller makes the one report
                code = errno.errorcode.get(exc.errno or 0, "")
                raise KVStoreError(f"{path}: write failed: {exc.strerror or exc} {code}".rstrip()) from None
            raise
        _fsync_dir(self.directory)

    # -- eviction --------------------------------------------------------------------------------

    def evict(self, protect: str | None = None) -> list[Evicted]:
        """Evict down to the budget now (ds4 does this on open and after each store)."""
        with self._lock, directory_lock(self.directory):
            return evict_to_budget(self.directory, self.budget, self._clock(), protect=protect,
                                   options=self.options)
