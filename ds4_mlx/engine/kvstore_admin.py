"""What a tool that looks after a KV cache directory needs: list, inspect, prune.

Three calls, each returning plain data (no printing, no formatting choices): ``list_entries`` (every
file with its metadata, key-text preview and eviction score), ``inspect_file`` (every header and
trailer field of one file plus a full verdict) and ``prune`` (evict to a budget under the
writers' lock, with a report). ``ds4-mlx kv`` is built on them; they are the store's only surface
a frontend needs, so the file format and eviction internals stay free to change.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from ds4_mlx.engine.kvstore_eviction import Evicted, EvictionScore, evict_to_budget, eviction_scores
from ds4_mlx.engine.kvstore_format import (
    EXT_DS4_MLX,
    EXT_RESPONSES_VISIBLE,
    EXT_THINKING_VISIBLE,
    EXT_TOOL_MAP,
    HEADER_BYTES,
    KVC_MAGIC,
    TAIL_BYTES,
    TAIL_MAGIC,
    TEXT_LEN_BYTES,
    Entry,
    KVFileRejected,
    RawHeader,
    RawTail,
    SaveReason,
    key_kind_of,
    open_regular,
    read_contents,
    read_entry,
)
from ds4_mlx.engine.kvstore_policy import DEFAULT_OPTIONS, KVStoreOptions
from ds4_mlx.engine.kvstore_scan import LOCK_TIMEOUT_S, clean_stale_temps, directory_lock, scan_dir
from ds4_mlx.errors import KVStoreError

PREVIEW_CHARS = 40
_EXT_NAMES = [(EXT_TOOL_MAP, "tool-map"), (EXT_RESPONSES_VISIBLE, "responses-visible"),
              (EXT_THINKING_VISIBLE, "thinking-visible"), (EXT_DS4_MLX, "ds4-mlx")]


def _read_at(path: Path, offset: int, n: int) -> bytes:
    f, _ = open_regular(path, follow=True)  # never blocks on a FIFO swapped in after the listing
    with f:
        return os.pread(f.fileno(), n, offset)


def text_preview(path: Path, text_bytes: int, chars: int = PREVIEW_CHARS) -> tuple[str, str]:
    """(first, last) ``chars`` characters of the key text, unescaped (undecodable bytes as
    surrogateescape); last is "" when the text is that short. Reads at most ``16 * chars`` bytes."""
    window = 8 * chars  # enough bytes for ``chars`` characters of up to 4 bytes, plus a cut one
    start = HEADER_BYTES + TEXT_LEN_BYTES
    if text_bytes <= 2 * window:
        text = _read_at(path, start, text_bytes).decode("utf-8", "surrogateescape")
        if len(text) <= 2 * chars:
            return text, ""
        return text[:chars], text[-chars:]
    head = _read_at(path, start, window).decode("utf-8", "surrogateescape")
    tail = _read_at(path, start + text_bytes - window, window).decode("utf-8", "surrogateescape")
    return head[:chars], tail[-chars:]


def utc(ts: int) -> str:
    """A header timestamp as ``YYYY-mm-dd HH:MM:SS`` UTC; "-" for none, ``@ts`` when out of range."""
    if ts <= 0:
        return "-"
    try:
        return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, OSError, ValueError):
        return f"@{ts}"


def ext_names(flags: int) -> list[str]:
    """Names of the set ext flag bits, plus ``unknown:0x..`` for bits no one defines."""
    names = [name for bit, name in _EXT_NAMES if flags & bit]
    unknown = flags & ~sum(bit for bit, _ in _EXT_NAMES)
    return names + ([f"unknown:{unknown:#04x}"] if unknown else [])


def cache_dir(directory: str | os.PathLike) -> Path:
    """``directory`` as a Path; ``KVStoreError`` when it is missing or not a directory."""
    path = Path(directory)
    if not path.exists():
        raise KVStoreError(f"{path}: KV cache directory does not exist")
    if not path.is_dir():
        raise KVStoreError(f"{path}: not a directory (a KV cache is a directory of .kv files)")
    return path


# -- list ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ListedFile:
    """One ``<sha1>.kv`` file of a listing. ``entry`` is None for a file that failed the cheap
    checks (``problem`` says why); ``text_head``/``text_tail`` are None when unreadable."""

    path: Path
    size: int
    score: EvictionScore
    entry: Entry | None = None
    problem: str | None = None
    text_head: str | None = None
    text_tail: str | None = None

    @property
    def name(self) -> str:
        return self.path.name


@dataclass(frozen=True)
class Listing:
    files: list[ListedFile]  # valid entries most recently used first, then invalid files
    total_bytes: int
    valid: int
    invalid: int


def list_entries(directory: str | os.PathLike, options: KVStoreOptions = DEFAULT_OPTIONS,
                 now: float | None = None) -> Listing:
    """Every file of the cache directory with its metadata and current eviction score (header
    and trailer checks only: cheap). Raises ``KVStoreError`` when the directory is unusable."""
    scan = scan_dir(cache_dir(directory))
    now = time.time() if now is None else now
    scores = eviction_scores([*scan.entries, *scan.invalid], now, options)
    files = []
    for e in sorted(scan.entries, key=lambda e: (-e.last_used, e.name)):
        try:
            head, tail = text_preview(e.path, e.text_bytes)
        except OSError:
            head, tail = None, None
        files.append(ListedFile(e.path, e.file_size, scores[e.name], entry=e, text_head=head,
                                text_tail=tail))
    for bad in scan.invalid:
        files.append(ListedFile(bad.path, bad.file_size, scores[bad.path.name], problem=bad.reason))
    return Listing(files, scan.total_bytes, len(scan.entries), len(scan.invalid))


# -- inspect ---------------------------------------------------------------------------------------


def inspect_file(path: str | os.PathLike) -> dict:
    """Every field of one file that can be decoded, plus ``problems`` (empty when the file is
    fully valid: the whole file is read and both checksums verified) and ``notes``.

    Raises ``KVStoreError`` for a missing or unreadable path, one that is not a regular file, or a
    file without the KVC magic (nothing else of it would mean anything). Text previews are raw
    (surrogateescape), as in ``text_preview``.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise KVStoreError(f"{path}: does not exist") from None
    except OSError as exc:
        raise KVStoreError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not path.is_file():
        raise KVStoreError(f"{path}: not a regular file")
    try:
        magic = _read_at(path, 0, len(KVC_MAGIC))
    except OSError as exc:
        raise KVStoreError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if magic != KVC_MAGIC:
        # Decoding anything further would print garbage fields (a GGUF read as a header).
        raise KVStoreError(f"{path}: not a ds4-mlx KV cache file (bad magic {magic!r}, "
                           f"expected {KVC_MAGIC!r})")
    report: dict = {"file": str(path), "size": size, "header": None, "text_bytes": None,
                    "text_head": None, "text_tail": None, "trailer": None, "tool_map_entries": None,
                    "file_crc": "not checked", "problems": [], "notes": []}
    if size >= HEADER_BYTES:
        h = RawHeader.unpack(_read_at(path, 0, HEADER_BYTES))
        report["header"] = {
            "magic": h.magic.decode("latin-1"), "version": h.version, "quant_bits": h.quant_bits,
            "reason": SaveReason(h.reason_code).label if h.reason_code <= SaveReason.AGENT_SESSION
            else "unknown", "reason_code": h.reason_code,
            "ext_flags": h.ext_flags, "ext_names": ext_names(h.ext_flags),
            "key_kind": key_kind_of(h.ext_flags), "reserved": h.reserved, "tokens": h.tokens,
            "hits": h.hits, "ctx_size": h.ctx_size, "header_crc": f"{h.header_crc:#010x}",
            "header_crc_ok": h.crc_ok, "created": h.created_at, "created_utc": utc(h.created_at),
            "last_used": h.last_used, "last_used_utc": utc(h.last_used),
            "payload_bytes": h.payload_bytes,
        }
    if size >= HEADER_BYTES + TEXT_LEN_BYTES:
        text_bytes = int.from_bytes(_read_at(path, HEADER_BYTES, TEXT_LEN_BYTES), "little")
        report["text_bytes"] = text_bytes
        if HEADER_BYTES + TEXT_LEN_BYTES + text_bytes <= size:
            report["text_head"], report["text_tail"] = text_preview(path, text_bytes)
    if size >= TAIL_BYTES:
        t = RawTail.unpack(_read_at(path, size - TAIL_BYTES, TAIL_BYTES))
        if t.magic == TAIL_MAGIC:
            report["trailer"] = {
                "version": t.version, "payload_version": t.payload_version,
                "model_id": t.model_id_field[:t.model_id_len].hex(), "token_key": t.token_key.hex(),
                "file_crc": f"{t.file_crc:#010x}",
            }
    try:
        entry = read_entry(path)
    except KVFileRejected as rej:
        report["problems"].append(rej.reason)
        return report
    if not entry.key:
        report["notes"].append("file name is not <sha1>.kv: the text-hash check is skipped")
    report["tool_map_bytes"] = entry.tool_map_bytes
    try:
        contents = read_contents(entry)
    except KVFileRejected as rej:
        report["problems"].append(rej.reason)
        report["file_crc"] = "mismatch" if "checksum" in rej.reason else "not checked"
        return report
    report["file_crc"] = "ok"
    report["tool_map_entries"] = len(contents.tool_map)
    return report


# -- prune -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PruneReport:
    budget_bytes: int
    total_bytes: int  # what the directory holds afterwards
    kept_files: int
    removed: list[Evicted]
    temps_removed: list[Path]

    @property
    def within_budget(self) -> bool:
        return self.total_bytes <= self.budget_bytes


def prune(directory: str | os.PathLike, budget_bytes: int, options: KVStoreOptions = DEFAULT_OPTIONS,
          now: float | None = None, lock_timeout: float = LOCK_TIMEOUT_S) -> PruneReport:
    """Remove dead writers' temp files, then evict in eviction order (damaged files first, then
    lowest score) until the directory fits ``budget_bytes`` (0 empties it). Holds the writers'
    lock throughout (waiting ``lock_timeout`` seconds for it at most), so a store in another
    process cannot refill the directory meanwhile.
    ``within_budget`` is False when a file could not be deleted."""
    directory = cache_dir(directory)
    if budget_bytes < 0:
        raise KVStoreError(f"budget of {budget_bytes} bytes: must be >= 0")
    now = time.time() if now is None else now
    with directory_lock(directory, lock_timeout):
        temps = clean_stale_temps(directory, now)
        removed = evict_to_budget(directory, budget_bytes, now, options=options)
        scan = scan_dir(directory)
    return PruneReport(budget_bytes, scan.total_bytes, len(scan.entries) + len(scan.invalid),
                       removed, temps)
