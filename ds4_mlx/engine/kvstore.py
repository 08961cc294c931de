"""Disk KV cache: the store of ds4's ``.kv`` checkpoint files around an opaque session payload.

The store does not look inside the payload (the session module writes and reads it); it names,
finds, checks, writes atomically, counts hits and evicts files, with ds4's rules
(``ds4_kvstore.c``). It is built from one module per job; import each name from its module:

* ``kvstore_format``    the file's bytes: header, key text, KTM section, KXM trailer, reads;
* ``kvstore_scan``      the directory: listing, temp files of dead writers, the writers' lock;
* ``kvstore_eviction``  what to evict first and the eviction itself;
* ``kvstore_policy``    the options and the save-point arithmetic (when, and where to cut);
* ``kvstore_admin``     what a maintenance tool needs (list, inspect, prune with a report).

Key scheme. The file name is always ds4's: SHA1 of the key text, so one directory never holds two
files for the same text. Two lookups: ``rendered_text`` (ds4's rule: the longest stored text that
is a byte prefix of the prompt; ties, more tokens) and ``tokens`` (the longest stored token
sequence that is a prefix of the given tokens, compared by token key; ties, most recently used).
``store`` always takes both tokens and text; a caller without a renderer passes the tokenizer's
decoded bytes of the tokens.

Atomic writes: the file is written as ``<name>.kv.tmp.<pid>.<16 random hex>`` in the same
directory (created exclusively, never through a link, mode 0600), fsynced, renamed over
``<name>.kv`` and the directory fsynced. A killed writer leaves only a temp file,
which is never listed, and which the next ``KVStore`` open removes once its process is gone. Room
is made *before* writing (evicting by score; ds4 evicts right after the rename, protecting the new
file, which picks the same victims: the file about to be written already counts as the newest
entry when deciding which continued checkpoints it supersedes), so the directory never holds more
than the budget, temp file included. A same-name file is replaced by the rename too, so a crash
leaves the old file or the new one; only when the budget cannot hold both for the length of the
write is an incompatible or damaged same-name file removed first (ds4 always removes it first),
while a compatible one is then kept as is.

Rejections. A file that fails a check is logged (logger ``ds4_mlx.kvstore``: warning when damaged,
info when merely incompatible), never loaded and never deleted for that reason alone, matching
ds4, which only logs a failed load. Damaged files do count toward the budget, with score 0 so
they are the first evicted when room is needed. The store remembers each one by its stat
(``RejectMemo``): a lookup lists the directory on every request, and reads a junk file once, then
again only when its stat changes. The one deletion besides eviction is ds4's "consumed" rule: a
loaded checkpoint longer than ``cold_max_tokens`` is removed after the load. A file that failed
to load is remembered (by name, size and mtime) so lookups stop offering it; ``mark_unloadable``
does the same for a file the caller cannot use (a payload the session loader refuses, stored
token ids outside the vocabulary; ds4 deletes such a file; we keep it, since the bytes are
intact and may suit another setup).

Any number of writers per directory: each store takes an exclusive ``flock`` on
``<dir>/.ds4-mlx-kv.lock`` around its eviction and write (ds4 assumes one writer), so the budget
holds however many processes share the directory; lookups and loads take no lock (a file replaced
under a reader is caught by the "changed since listed" check). A ``KVStore`` is thread-safe within
a process.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import secrets
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ds4_mlx.engine.kvstore_eviction import (
    Evicted,
    PendingCheckpoint,
    evict_to_budget,
    eviction_order,
    unlink_victim,
)
from ds4_mlx.engine.kvstore_format import (
    EXT_DS4_MLX,
    EXT_TOOL_MAP,
    KEY_KINDS,
    MIN_FILE_BYTES,
    QUANT_BITS,
    U32_MAX,
    Entry,
    FileContents,
    InvalidFile,
    KVFileRejected,
    KVSaveSkipped,
    SaveReason,
    body_pieces,
    encode_tool_map,
    key_for_text,
    key_for_tokens,
    normalize_model_id,
    open_regular,
    pack_header,
    pack_tail,
    read_contents,
    read_entry,
    text_to_bytes,
    tokens_to_bytes,
)
from ds4_mlx.engine.kvstore_policy import (
    DEFAULT_BUDGET_MB,
    DEFAULT_OPTIONS,
    KVStoreOptions,
    budget_bytes,
    fits_budget,
    required_bytes,
)
from ds4_mlx.engine.kvstore_scan import (
    LOCK_TIMEOUT_S,
    DirScan,
    KVCacheDirError,
    KVLockTimeout,
    RejectMemo,
    check_cache_dir,
    clean_stale_temps,
    directory_lock,
    scan_dir,
)
from ds4_mlx.errors import KVStoreError

logger = logging.getLogger("ds4_mlx.kvstore")

_TEMP_ATTEMPTS = 8  # fresh random temp names tried before a save gives up (one collides ~never)


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
    the budget, as ds4 does on open. ``lock_timeout``: seconds a write waits for another process's
    lock on the directory (``directory_lock``; a load's plan gives ``DS4_MLX_KV_LOCK_TIMEOUT``'s).
    """

    def __init__(self, directory: str | os.PathLike, budget_mb: float = DEFAULT_BUDGET_MB, *,
                 model_id: bytes | str, quant_bits: int, ctx: int, payload_version: int = 1,
                 options: KVStoreOptions = DEFAULT_OPTIONS, accept_other_quant: bool = False,
                 clock: Callable[[], float] = time.time, lock_timeout: float = LOCK_TIMEOUT_S):
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
        self.lock_timeout = float(lock_timeout)
        self._lock = threading.RLock()
        self._failed: dict[str, tuple[int, int]] = {}  # name -> (size, mtime_ns) of a failed load
        self._logged: set[tuple] = set()
        self._rejects = RejectMemo()  # files found invalid: every request's lookup lists the dir
        check_cache_dir(self.directory)
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise KVCacheDirError(f"{self.directory}: cannot create the KV cache directory: "
                                  f"{exc.strerror or exc}") from None
        try:
            with directory_lock(self.directory, self.lock_timeout):
                clean_stale_temps(self.directory, self._clock())
                evict_to_budget(self.directory, self.budget, self._clock(), options=options)
        except KVLockTimeout as exc:  # the next store evicts; opening must not wait for a stranger
            logger.warning("kv cache open: %s; the clean-up waits for the next save", exc)
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
            return scan_dir(self.directory, self._rejects, self._log_invalid)

    def _log_invalid(self, bad: InvalidFile) -> None:
        self._log_once(logging.WARNING if bad.corrupt else logging.INFO,
                       (bad.path.name, bad.file_size, bad.mtime_ns, bad.reason),
                       "kv cache ignoring %s: %s", bad.path, bad.reason)

    def entries(self) -> list[Entry]:
        """Every readable entry in the directory, compatible or not."""
        return self.scan().entries

    def total_bytes(self) -> int:
        with self._lock:
            return scan_dir(self.directory, self._rejects, self._log_invalid).total_bytes

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
               min_tokens: int | None = None, *, scan: DirScan | None = None) -> Entry | None:
        """The longest compatible stored prefix of the prompt, by text or by tokens (give one).

        ``scan``: a listing of this store's directory to search instead of a fresh one (a caller
        making several lookups for one request lists the directory once)."""
        if (rendered_text is None) == (tokens is None):
            raise KVStoreError("lookup needs exactly one of rendered_text or tokens")
        min_tokens = self.options.min_tokens if min_tokens is None else min_tokens
        by_text = rendered_text is not None
        query = text_to_bytes(rendered_text) if by_text else tokens_to_bytes(tokens)
        hashes: dict[int, str] = {}
        best: Entry | None = None
        with self._lock:
            for e in (scan if scan is not None else self.scan()).entries:
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
        """Record that the caller cannot use this entry (its payload refused by the session
        loader, its stored token ids outside the vocabulary): lookups skip it from now on.

        ds4 deletes such a file; here it stays (it may suit another configuration) and is logged.
        """
        with self._lock:
            try:
                st = entry.path.stat()  # the load that preceded this rewrote the header (mtime)
            except OSError:
                return
            self._failed[entry.name] = (st.st_size, st.st_mtime_ns)
            logger.warning("kv cache refusing %s (kept on disk, not offered again): %s", entry.path, reason)

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
        text_b = text_to_bytes(text)
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
        with self._lock, directory_lock(self.directory, self.lock_timeout):
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
                if unlink_victim(item, score) is not None:
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
        self._write_atomic(path, header, body_pieces(text_b, views, ktm, token_bytes, tail))
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

    @staticmethod
    def _create_temp(path: Path) -> tuple[Path, int]:
        """A new temp file beside ``path``, ``(its path, write fd)``.

        Whoever can write the directory can plant a link at any name a writer would predict
        (``<name>.kv.tmp.<pid>`` was one); a plain open follows it and truncates, or creates, a
        file elsewhere. So the name carries a random part as well as the pid (the stale-temp
        clean-up reads the pid), and O_CREAT|O_EXCL|O_NOFOLLOW makes the open fail on anything
        already there, link or not, instead of writing through it; a taken name is skipped.
        Mode 0600: a checkpoint holds the conversation it was made from.
        """
        flags = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        for _ in range(_TEMP_ATTEMPTS):
            tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}.{secrets.token_hex(8)}")
            try:
                return tmp, os.open(tmp, flags, 0o600)
            except FileExistsError:
                logger.warning("kv cache: %s already exists (not ours); trying another temp name", tmp)
        raise KVStoreError(f"{path}: write failed: {_TEMP_ATTEMPTS} fresh temp names were all "
                           f"taken in {path.parent} (is something planting files there?)")

    def _write_atomic(self, path: Path, header: bytes, pieces: list) -> None:
        """header + pieces + crc32(pieces) into a temp file, fsync, rename over ``path``, fsync dir.

        The rename replaces whatever ``path`` is, a planted link included, as a name: the file a
        link points to is never opened, so it is left as it was.
        """
        try:
            tmp, fd = self._create_temp(path)
        except OSError as exc:  # nothing was created, so nothing to remove
            code = errno.errorcode.get(exc.errno or 0, "")
            raise KVStoreError(f"{path}: write failed: {exc.strerror or exc} {code}".rstrip()) from None
        try:
            with os.fdopen(fd, "wb") as f:
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
        """Evict down to the budget now (ds4 does this on open and after each store); nothing
        when another process holds the directory's lock past the timeout (it is evicting)."""
        try:
            with self._lock, directory_lock(self.directory, self.lock_timeout):
                return evict_to_budget(self.directory, self.budget, self._clock(), protect=protect,
                                       options=self.options)
        except KVLockTimeout as exc:
            logger.warning("kv cache evict skipped: %s", exc)
            return []
