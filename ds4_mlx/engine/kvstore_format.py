"""The ``.kv`` checkpoint file: ds4's layout around an opaque session payload, read and written.

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

Only regular files are ever opened: a FIFO, link or directory named like an entry is skipped by
``lstat`` before any open, and every open is non-blocking and re-checked with ``fstat``
(``open_regular``), so such a file can neither hang a scan nor redirect a write.

This module knows the bytes: header, key text, KTM tool-id section, KXM trailer, their checks, and
opening a file safely. The directory (``kvstore_scan``), eviction (``kvstore_eviction``) and the
store that writes under the lock (``kvstore``) build on it.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import stat
import struct
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import numpy as np

from ds4_mlx.errors import KVStoreError

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
_READ_CHUNK = 64 * 1024 * 1024
ENTRY_NAME_RE = re.compile(r"^([0-9a-fA-F]{40})\.kv$")  # <sha1 of the key text>.kv


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


def text_to_bytes(text: str | bytes | bytearray | memoryview) -> bytes:
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
    return hashlib.sha1(text_to_bytes(text)).hexdigest()


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

def encode_tool_map(tool_map: Mapping[str, str] | None) -> bytes:
    """ds4's KTM trailer for ``{tool call id: exact DSML block}``; empty when there is nothing."""
    if not tool_map:
        return b""
    parts = [_KTM_HEAD.pack(KTM_MAGIC, KTM_VERSION, len(tool_map))]
    for tool_id, dsml in tool_map.items():
        id_b, dsml_b = text_to_bytes(tool_id), text_to_bytes(dsml)
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


def parse_entry(f, path: Path, st: os.stat_result) -> Entry:
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
    match = ENTRY_NAME_RE.match(path.name)
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
            return parse_entry(f, path, st)
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
        now = parse_entry(f, path, st)
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



def body_pieces(text: bytes, payload: Sequence, tool_map_section: bytes, token_bytes: bytes,
                tail: bytes) -> list:
    """Everything after the header in file order, crc32 not included (the writer appends the crc
    of these pieces, streamed as they are written, as the last 4 bytes)."""
    return [_TEXT_LEN.pack(len(text)), text, *payload, tool_map_section, token_bytes, tail]


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
