"""The disk KV cache and ``ds4-mlx kv`` against hostile input: files that are not KV files, FIFOs
named like entries, missing or unusable directories, out-of-range options, several writers on one
directory. No model needed; runs that could hang run in a subprocess under a timeout."""

from __future__ import annotations

import multiprocessing
import os
import secrets
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ds4_mlx.engine import kvstore
from ds4_mlx.engine import kvstore_scan
from ds4_mlx.engine.kvstore import KVStore
from ds4_mlx.engine.kvstore_scan import KVCacheDirError
from ds4_mlx.frontends.cli import main

MODEL = bytes(range(32))
REPO = Path(__file__).resolve().parents[1]


def make_store(d, budget_mb=64, **kw) -> KVStore:
    return KVStore(d, budget_mb, model_id=kw.pop("model_id", MODEL), quant_bits=2, ctx=65536, **kw)


def toks(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 129280, n).tolist()


def run_py(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter on this tree; a hang fails the test instead of the run."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                              text=True, timeout=timeout, env=env, cwd=REPO)
    except subprocess.TimeoutExpired:
        pytest.fail(f"hung for {timeout} s (a blocking open?)")


# -- kv CLI ------------------------------------------------------------------------------------------


def test_inspect_of_a_non_kv_file_is_one_line_and_prints_no_fields(tmp_path, capsys):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + os.urandom(4000))
    for extra in ([], ["--json"]):
        assert main(["kv", "inspect", str(gguf), *extra]) == 2
        out, err = capsys.readouterr()
        assert out == ""  # no "version 70", no payload bytes in the quintillions, no year 10^11
        assert err.count("\n") == 1 and "not a ds4-mlx KV cache file (bad magic b'GGU'" in err
    tiny = tmp_path / "short.kv"
    tiny.write_bytes(b"K")
    assert main(["kv", "inspect", str(tiny)]) == 2
    assert "bad magic b'K'" in capsys.readouterr().err


def test_ls_and_prune_of_a_missing_dir_say_it_does_not_exist(tmp_path, capsys):
    for cmd in (["ls"], ["prune", "--budget-mb", "1"]):
        assert main(["kv", cmd[0], str(tmp_path / "missing"), *cmd[1:]]) == 2
        err = capsys.readouterr().err
        assert "missing: KV cache directory does not exist" in err and "not a directory" not in err
    (tmp_path / "file").write_bytes(b"x")
    assert main(["kv", "ls", str(tmp_path / "file")]) == 2
    assert "not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "-0.5", "1e30", "-inf"])
def test_prune_budget_out_of_range_is_one_line(tmp_path, capsys, value):
    assert main(["kv", "prune", str(tmp_path), f"--budget-mb={value}"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert f"--budget-mb {float(value)}: must be a number of MiB from 0 to" in err


def test_prune_that_cannot_delete_exits_non_zero(tmp_path, capsys, monkeypatch):
    store = make_store(tmp_path)
    e = store.store(toks(600), "text", bytes(5000), "cold")
    real_unlink = Path.unlink

    def refuse(self, missing_ok=False):
        if self.suffix == ".kv":
            raise PermissionError(13, "Permission denied")
        return real_unlink(self, missing_ok)

    monkeypatch.setattr(Path, "unlink", refuse)
    assert main(["kv", "prune", str(tmp_path), "--budget-mb", "0"]) == 1
    assert "still over budget" in capsys.readouterr().out
    assert main(["kv", "prune", str(tmp_path), "--budget-mb", "0", "--json"]) == 1
    capsys.readouterr()
    monkeypatch.undo()
    assert e.path.exists()
    assert main(["kv", "prune", str(tmp_path), "--budget-mb", "0"]) == 0


# -- cache directory ---------------------------------------------------------------------------------


def test_cache_dir_that_is_a_regular_file_is_a_typed_error(tmp_path):
    f = tmp_path / "not-a-dir"
    f.write_bytes(b"data")
    with pytest.raises(KVCacheDirError, match="not-a-dir: exists and is not a directory"):
        make_store(f)
    from ds4_mlx.engine.disk_cache import DiskCache

    # checked first, before the engine is asked for anything (its model id reads the weights)
    with pytest.raises(KVCacheDirError, match="exists and is not a directory"):
        DiskCache(object(), f)
    assert f.read_bytes() == b"data"


def test_failed_write_is_raised_not_logged(tmp_path, monkeypatch, caplog):
    store = make_store(tmp_path)

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kvstore.os, "fsync", full)
    with caplog.at_level("DEBUG", logger="ds4_mlx"):
        with pytest.raises(kvstore.KVStoreError, match="No space left"):
            store.store(toks(600), "t", bytes(100), "cold")
    assert not [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")]


# -- FIFOs and other non-regular files ---------------------------------------------------------------


def test_fifo_named_like_an_entry_hangs_nothing(tmp_path):
    store = make_store(tmp_path)
    good = store.store(toks(600), "good", bytes(5000), "cold")
    fifo = tmp_path / ("ab" * 20 + ".kv")
    os.mkfifo(fifo)
    os.mkfifo(tmp_path / ("cd" * 20 + f".kv.tmp.{2**22 + 7}"))  # a dead writer's "temp"
    os.symlink(good.path, tmp_path / ("ef" * 20 + ".kv"))
    r = run_py(f"""
        from ds4_mlx.frontends.cli import main
        from ds4_mlx.engine.kvstore import KVStore
        import numpy as np
        d = {str(tmp_path)!r}
        assert main(["kv", "ls", d]) == 0
        assert main(["kv", "inspect", d + "/{fifo.name}"]) == 2
        s = KVStore(d, 64, model_id=bytes(range(32)), quant_bits=2, ctx=65536)
        t = np.random.default_rng(0).integers(0, 129280, 600).tolist()
        assert s.lookup(tokens=t).name == {good.name!r}
        assert s.load(s.lookup(rendered_text="good")).payload == bytes(5000)
        s.store(np.random.default_rng(1).integers(0, 129280, 600).tolist(), "more", bytes(5000), "cold")
        assert main(["kv", "prune", d, "--budget-mb", "0"]) == 0
        print("done")
    """)
    assert r.returncode == 0, r.stderr
    assert "done" in r.stdout and "1 valid, 0 invalid" in r.stdout  # the FIFO and link: not listed
    assert "not a regular file" in r.stderr
    assert fifo.exists() and not good.path.exists()  # prune removed entries, never the FIFO


def test_read_entry_refuses_a_fifo_without_blocking(tmp_path):
    fifo = tmp_path / ("ab" * 20 + ".kv")
    os.mkfifo(fifo)
    r = run_py(f"""
        from ds4_mlx.engine.kvstore_format import KVFileRejected, read_entry
        try:
            read_entry({str(fifo)!r})
        except KVFileRejected as rej:
            print(rej.reason)
    """, timeout=60)
    assert "not a regular file" in r.stdout, r.stderr


# -- several writers ---------------------------------------------------------------------------------

BUDGET_MB = 2
FILE_BYTES = 300_000


def _writer(d: str, seed: int, n: int) -> None:
    store = make_store(d, BUDGET_MB)
    for i in range(n):
        store.store(toks(600, 1000 * seed + i), f"writer {seed} file {i}", bytes(FILE_BYTES), "cold")


def _dir_bytes(d: Path) -> int:
    total = 0
    for name in os.listdir(d):
        try:
            total += os.path.getsize(d / name)
        except FileNotFoundError:
            pass  # evicted or renamed since the listing: only ever undercounts
    return total


def test_concurrent_writers_keep_the_budget(tmp_path):
    budget = BUDGET_MB * 2**20
    make_store(tmp_path, BUDGET_MB)  # creates the directory
    peak = [0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _dir_bytes(tmp_path))

    sampler = threading.Thread(target=sample)
    sampler.start()
    ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), seed, 12)) for seed in range(4)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=240)
    finally:
        stop.set()
        sampler.join()
    assert all(p.exitcode == 0 for p in procs)
    assert _dir_bytes(tmp_path) <= budget
    assert peak[0] <= budget, f"peak {peak[0]} bytes > budget {budget}"
    assert len(list(tmp_path.glob("*.kv"))) >= 1


def test_lock_is_exclusive_across_processes(tmp_path):
    with kvstore_scan.directory_lock(tmp_path) as held:
        assert held
        r = run_py(f"""
            import fcntl, os
            fd = os.open({str(tmp_path / kvstore_scan.LOCK_NAME)!r}, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                print("acquired")
            except BlockingIOError:
                print("busy")
        """, timeout=60)
    assert r.stdout.strip() == "busy", r.stderr
    t0 = time.time()
    with kvstore_scan.directory_lock(tmp_path):
        pass
    assert time.time() - t0 < 5


def test_a_lock_another_process_keeps_fails_the_write_after_the_timeout(tmp_path, monkeypatch):
    """#26 item 7: while another process held the directory lock a request waited 29 s (and the
    one queued behind it 21 s). The writer now waits its ``lock_timeout`` (a load's plan passes
    DS4_MLX_KV_LOCK_TIMEOUT's) seconds, then the write fails with one line (a failed save: the
    request goes on without it), nothing stored is lost, and opening and evicting do not wait at
    all past the timeout."""
    store = make_store(tmp_path, BUDGET_MB, lock_timeout=0.4)
    store.store(toks(600, 1), "kept before", bytes(FILE_BYTES), "cold")
    before = sorted(p.name for p in tmp_path.glob("*.kv"))
    holder = subprocess.Popen([sys.executable, "-c", f"""
import fcntl, os, sys, time
fd = os.open({str(tmp_path / kvstore_scan.LOCK_NAME)!r}, os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        with pytest.raises(kvstore_scan.KVLockTimeout, match="held the KV cache lock for 0.4 s; not written"):
            store.store(toks(600, 2), "blocked", bytes(FILE_BYTES), "cold")
        assert time.monotonic() - t0 < 3
        t0 = time.monotonic()
        assert store.evict() == []
        again = make_store(tmp_path, BUDGET_MB, lock_timeout=0.4)  # opening cleans up under the lock: skipped
        assert time.monotonic() - t0 < 3 and again is not None
    finally:
        holder.kill()
        holder.wait()
    assert sorted(p.name for p in tmp_path.glob("*.kv")) == before
    store.store(toks(600, 3), "after", bytes(FILE_BYTES), "cold")  # the lock is free again
    assert len(list(tmp_path.glob("*.kv"))) == len(before) + 1


# -- links planted at the temp and final names (#26 item 8) ------------------------------------------


@pytest.mark.parametrize("outside_exists", [True, False])
def test_planted_symlinks_are_never_written_through(tmp_path, monkeypatch, outside_exists):
    """Whoever can write the cache directory plants links at every temp name a save could pick
    (the old ``<name>.kv.tmp.<pid>``, the first random name the writer will draw) and at the
    final name: the save writes none of the files they point to, creates nothing outside, and
    its checkpoint loads."""
    d = tmp_path / "kv"
    d.mkdir()
    store = make_store(d)
    text = "a key text whose file name anyone can compute"
    name = kvstore.key_for_text(text) + ".kv"
    victims = [tmp_path / f"victim{i}" for i in range(4)]
    if outside_exists:
        for i, v in enumerate(victims):
            v.write_bytes(f"precious {i}\n".encode())
    draws = iter(["0" * 16, "1" * 16])  # the writer's random suffixes, the first one planted
    monkeypatch.setattr(secrets, "token_hex", lambda n: next(draws))
    os.symlink(victims[0], d / f"{name}.tmp.{os.getpid()}")
    os.symlink(victims[1], d / f"{name}.tmp.{os.getpid()}.{'0' * 16}")
    os.symlink(victims[2], d / f"{name}.tmp")
    os.symlink(victims[3], d / name)
    tokens = toks(600)
    entry = store.store(tokens, text, bytes(range(256)) * 8, "cold")
    assert entry is not None and entry.path == d / name
    for i, v in enumerate(victims):  # byte-identical, or still absent
        assert v.read_bytes() == f"precious {i}\n".encode() if outside_exists else not v.exists()
    assert not (d / name).is_symlink()  # the rename replaced the link itself
    assert (d / f"{name}.tmp.{os.getpid()}").is_symlink()  # someone else's name, left alone
    got = store.restore(tokens=tokens)
    assert got is not None and bytes(got.payload) == bytes(range(256)) * 8 and got.tokens == tokens
    assert not [n for n in os.listdir(d) if ".tmp." in n and not (d / n).is_symlink()]


def test_temp_file_is_private_and_unique_per_writer(tmp_path, monkeypatch):
    """The temp file is created 0600 under a name no other writer (of this pid or any) draws."""
    store = make_store(tmp_path)
    seen = []
    real = kvstore.os.replace

    def spy(src, dst):
        st = os.lstat(src)
        seen.append((Path(src).name, st.st_mode & 0o777))
        return real(src, dst)

    monkeypatch.setattr(kvstore.os, "replace", spy)
    store.store(toks(600, 1), "first", bytes(100), "cold")
    store.store(toks(600, 2), "second", bytes(100), "cold")
    assert [m for _, m in seen] == [0o600, 0o600]
    pid = str(os.getpid())
    suffixes = [n.rsplit(".tmp.", 1)[1].split(".") for n, _ in seen]
    assert all(s[0] == pid and len(s) == 2 and len(s[1]) == 16 for s in suffixes)
    assert suffixes[0][1] != suffixes[1][1]


# -- junk files named like entries (#26 item 8) ------------------------------------------------------


def _count_opens(monkeypatch) -> list[str]:
    """Names of the files the directory listing opens from now on."""
    opened: list[str] = []
    real = kvstore_scan.open_regular

    def spy(path, *a, **kw):
        opened.append(Path(path).name)
        return real(path, *a, **kw)

    monkeypatch.setattr(kvstore_scan, "open_regular", spy)
    return opened


def test_junk_files_are_read_once_not_on_every_lookup(tmp_path, monkeypatch):
    """Files named like entries whose bytes are junk (empty, random, a truncated checkpoint) are
    read by the first lookup and not again while their stat is unchanged; one replaced by a valid
    checkpoint (renamed over it, or rewritten in place at the same size) is read again, and found."""
    monkeypatch.setattr(kvstore_scan, "SETTLED_NS", 50_000_000)
    d = tmp_path / "kv"
    store = make_store(d)
    tokens = toks(600)
    good = store.store(tokens, "the valid one", bytes(5000), "cold")
    # two valid checkpoints made elsewhere, to land later on two of the junk names
    elsewhere = make_store(tmp_path / "elsewhere")
    later = [elsewhere.store(toks(600, 10 + i), f"junk {i}", bytes(3000), "cold") for i in range(2)]
    junk = []
    for i in range(60):
        p = d / (kvstore.key_for_text(f"junk {i}") + ".kv")
        if i == 1:  # the same size as the checkpoint that will overwrite it in place
            p.write_bytes(os.urandom(later[1].file_size))
        else:
            p.write_bytes([b"", os.urandom(10 + i), good.path.read_bytes()[:-1]][i % 3])
        junk.append(p.name)
    time.sleep(0.1)  # past the settling margin: these files are done changing
    opened = _count_opens(monkeypatch)
    assert store.lookup(tokens=tokens).path == good.path
    assert set(junk) <= set(opened)  # the first look reads each one
    assert len(store.scan().invalid) == 60
    opened.clear()
    for _ in range(3):
        assert store.lookup(tokens=tokens).path == good.path
    assert not set(opened) & set(junk)  # later looks read none of them

    staging = d / "staging"
    staging.write_bytes(later[0].path.read_bytes())
    os.replace(staging, d / junk[0])
    with open(d / junk[1], "r+b") as f:
        f.write(later[1].path.read_bytes())
    opened.clear()
    for i in range(2):
        found = store.lookup(tokens=toks(600, 10 + i))
        assert found is not None and found.path.name == junk[i]
    assert set(opened) & set(junk) == {junk[0], junk[1]}
    assert len(store.scan().invalid) == 58
    assert bytes(store.restore(tokens=toks(600, 11)).payload) == bytes(3000)


def test_a_junk_file_that_may_still_be_changing_is_read_again(tmp_path, monkeypatch):
    """A file whose ctime is within the settling margin is not remembered: a change in the same
    timestamp tick would leave its stat as it was, and trusting it could hide a valid entry."""
    store = make_store(tmp_path)
    p = tmp_path / ("ab" * 20 + ".kv")
    p.write_bytes(b"junk")
    opened = _count_opens(monkeypatch)
    for _ in range(2):
        assert store.lookup(tokens=toks(600)) is None
    assert opened.count(p.name) == 2
