"""The cache directory: listing its ``.kv`` files, dead writers' temp files, and its lock.

A listing applies the file format's cheap checks (header and trailer) to every ``<40 hex>.kv``
name; a file that fails them is listed as invalid (it still occupies the budget; a ``RejectMemo``
lets the next listing skip it unread while its stat is unchanged), and anything
that is not a regular file (a FIFO, link or directory named like an entry) is skipped by
``lstat`` before any open, so it can neither hang a scan nor be deleted. Temp files
``<name>.kv.tmp.<pid>.<random>`` are never listed as entries; ``clean_stale_temps`` removes those whose
writer is gone. ``directory_lock`` is the one lock every writer takes around "make room, then
write".
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ds4_mlx.engine.kvstore_format import (
    ENTRY_NAME_RE,
    Entry,
    InvalidFile,
    KVFileRejected,
    NotRegularFile,
    open_regular,
    parse_entry,
)
from ds4_mlx.errors import KVStoreError

logger = logging.getLogger("ds4_mlx.kvstore")

# <name>.kv.tmp.<pid>.<random>; the pid-only form is what older writers left behind
_TEMP_RE = re.compile(r"^[0-9a-fA-F]{40}\.kv\.tmp\.(\d+)(?:\.[0-9a-f]{16})?$")
STALE_TEMP_SECONDS = 24 * 60 * 60  # a temp file this old is removed even if its pid is alive (reused)
LOCK_NAME = ".ds4-mlx-kv.lock"  # flock'd around evict + write; matches neither name pattern


class KVCacheDirError(KVStoreError):
    """The cache directory path is unusable: a regular file, or it cannot be created."""


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


# A rejected file is remembered only once its ctime is this much older than the scan. Within a
# filesystem's timestamp granularity (a coarse clock tick; seconds on some) a later write may
# leave size, mtime and ctime as they were, so a young file's verdict cannot be trusted by its
# stat; re-reading such a file costs one small read, and junk that sits still ages past this.
SETTLED_NS = 2_000_000_000


@dataclass
class RejectMemo:
    """Files a listing found invalid by their bytes, keyed by stat, so the next listing skips
    them without an open or a read (20,000 junk files named like entries made every lookup
    reopen all of them). A file whose inode, size, mtime or ctime differs is read again: any
    write, rename over it or chmod moves at least one. ``scan_dir`` keeps only names it saw."""

    files: dict[str, tuple[tuple[int, int, int, int], InvalidFile]] = field(default_factory=dict)

    @staticmethod
    def key(st: os.stat_result) -> tuple[int, int, int, int]:
        return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def get(self, name: str, st: os.stat_result) -> InvalidFile | None:
        hit = self.files.get(name)
        return hit[1] if hit is not None and hit[0] == self.key(st) else None


def scan_dir(directory: str | os.PathLike, memo: RejectMemo | None = None,
             on_invalid: Callable[[InvalidFile], None] | None = None) -> DirScan:
    """Every ``<40 hex>.kv`` file (cheap checks only) and every ``.kv.tmp.<pid>[.<random>]``
    temp, by name.

    With ``memo``, a file it holds under its current stat is listed as invalid unread, and files
    rejected now by their bytes are added to it. ``on_invalid`` is called for each invalid file
    found by this listing (not for those the memo held: they were reported when first read).
    """
    directory = Path(directory)
    scan = DirScan()
    started_ns = time.time_ns()
    seen: dict[str, tuple[tuple[int, int, int, int], InvalidFile]] = {}
    try:
        with os.scandir(directory) as it:
            # DirEntry, not listdir + Path: with thousands of junk names, building a Path for
            # each one cost as much as the lstat it needs
            items = sorted(it, key=lambda d: d.name)
    except FileNotFoundError:
        return scan
    except OSError as exc:
        raise KVStoreError(f"{directory}: cannot list the KV cache directory: {exc.strerror or exc}") from None
    for item in items:
        name = item.name
        if _TEMP_RE.match(name):
            try:
                if item.is_file(follow_symlinks=False):
                    scan.temps.append(directory / name)
            except OSError:
                pass
            continue
        if not ENTRY_NAME_RE.match(name):
            continue
        try:
            st = item.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        except OSError as exc:
            bad = InvalidFile(directory / name, 0, 0, f"cannot stat: {exc.strerror}", corrupt=False)
            scan.invalid.append(bad)
            if on_invalid is not None:
                on_invalid(bad)
            continue
        if not stat.S_ISREG(st.st_mode):
            continue  # a FIFO, link, directory...: never ours, never opened, never deleted
        known = memo.get(name, st) if memo is not None else None
        if known is not None:
            scan.invalid.append(known)
            seen[name] = memo.files[name]
            continue
        path = directory / name
        bad = None
        try:
            f, st = open_regular(path)
            with f:
                scan.entries.append(parse_entry(f, path, st))
        except NotRegularFile:
            continue  # replaced by a non-regular file since the lstat
        except KVFileRejected as rej:
            bad = InvalidFile(path, st.st_size, st.st_mtime_ns, rej.reason, rej.corrupt)
            # st is the fstat of the very file read; only a verdict on its bytes is remembered
            # (an OSError below may be passing: EMFILE, EIO), and only once the file has settled
            if started_ns - st.st_ctime_ns >= SETTLED_NS:
                seen[name] = (RejectMemo.key(st), bad)
        except FileNotFoundError:
            continue
        except OSError as exc:
            bad = InvalidFile(path, st.st_size, st.st_mtime_ns, f"cannot read: {exc.strerror or exc}",
                              corrupt=False)
        if bad is not None:
            scan.invalid.append(bad)
            if on_invalid is not None:
                on_invalid(bad)
    if memo is not None:
        memo.files = seen  # names gone from the directory are forgotten: the memo stays bounded
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


def check_cache_dir(directory: str | os.PathLike) -> None:
    """Raise ``KVCacheDirError`` when ``directory`` exists and is not a directory (it is created
    later when missing)."""
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise KVCacheDirError(f"{path}: exists and is not a directory; the KV cache needs a "
                              f"directory of its own")


# How long a writer waits for another process's lock by default; a load's plan (and the ``kv``
# commands) pass ``DS4_MLX_KV_LOCK_TIMEOUT``'s value down (``model.load_plan.kv_lock_timeout``).
LOCK_TIMEOUT_S = 5.0


class KVLockTimeout(KVStoreError):
    """Another process held the cache directory's lock for longer than the timeout."""


@contextmanager
def directory_lock(directory: str | os.PathLike, timeout: float = LOCK_TIMEOUT_S) -> Iterator[bool]:
    """Hold an exclusive advisory lock on the cache directory (``flock`` on ``LOCK_NAME`` in it).

    Every writer takes it around "make room, then write", so the budget holds for any number of
    processes sharing the directory: without it, each one evicts against the same listing and
    then writes, and the directory ends up holding all their files. Yields False, unlocked, when
    the lock file cannot be opened (a read-only directory, where nothing can be written anyway).

    A lock another process holds is waited for at most ``timeout`` seconds (default
    ``LOCK_TIMEOUT_S``), then ``KVLockTimeout`` is raised: a stuck or slow process sharing the
    directory must not stall every request of this one (the save is skipped and reported, the
    request goes on without it).
    """
    path = Path(directory) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW
                     | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError:
        yield False
        return
    try:
        wait = timeout
        deadline = time.monotonic() + wait
        delay = 0.005
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise KVLockTimeout(f"{directory}: another process has held the KV cache lock for "
                                        f"{wait:g} s; not written (DS4_MLX_KV_LOCK_TIMEOUT sets the wait)") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.1)
        yield True
    finally:
        os.close(fd)  # releases the lock
