"""The cache directory: listing its ``.kv`` files, dead writers' temp files, and its lock.

A listing applies the file format's cheap checks (header and trailer) to every ``<40 hex>.kv``
name; a file that fails them is listed as invalid (it still occupies the budget), and anything
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
from collections.abc import Iterator
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


def scan_dir(directory: str | os.PathLike) -> DirScan:
    """Every ``<40 hex>.kv`` file (cheap checks only) and every ``.kv.tmp.<pid>[.<random>]``
    temp, by name."""
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
        if not ENTRY_NAME_RE.match(name):
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
                scan.entries.append(parse_entry(f, path, st))
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


def check_cache_dir(directory: str | os.PathLike) -> None:
    """Raise ``KVCacheDirError`` when ``directory`` exists and is not a directory (it is created
    later when missing)."""
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise KVCacheDirError(f"{path}: exists and is not a directory; the KV cache needs a "
                              f"directory of its own")


LOCK_TIMEOUT_S = 5.0  # how long a writer waits for another process's lock (DS4_MLX_KV_LOCK_TIMEOUT)


class KVLockTimeout(KVStoreError):
    """Another process held the cache directory's lock for longer than the timeout."""


def lock_timeout() -> float:
    env = os.environ.get("DS4_MLX_KV_LOCK_TIMEOUT")
    try:
        return max(0.0, float(env)) if env else LOCK_TIMEOUT_S
    except ValueError:
        return LOCK_TIMEOUT_S


@contextmanager
def directory_lock(directory: str | os.PathLike, timeout: float | None = None) -> Iterator[bool]:
    """Hold an exclusive advisory lock on the cache directory (``flock`` on ``LOCK_NAME`` in it).

    Every writer takes it around "make room, then write", so the budget holds for any number of
    processes sharing the directory: without it, each one evicts against the same listing and
    then writes, and the directory ends up holding all their files. Yields False, unlocked, when
    the lock file cannot be opened (a read-only directory, where nothing can be written anyway).

    A lock another process holds is waited for at most ``timeout`` seconds (default
    :func:`lock_timeout`), then ``KVLockTimeout`` is raised: a stuck or slow process sharing the
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
        wait = lock_timeout() if timeout is None else timeout
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
