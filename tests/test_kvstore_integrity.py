"""Damaged, foreign and half-written ``.kv`` files are rejected with a logged reason, never loaded,
never deleted for being bad, and never cost a valid entry; SIGKILL during a save is harmless."""

from __future__ import annotations

import hashlib
import logging
import os
import random
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from ds4_mlx.engine import kvstore_scan
from ds4_mlx.engine.kvstore import KVStore
from ds4_mlx.engine.kvstore_format import read_entry
from ds4_mlx.engine.kvstore_policy import KVStoreOptions
from ds4_mlx.errors import KVStoreError

MODEL = bytes(range(32))
TOKENS = list(range(1000, 1600))
TEXT = "<｜User｜>integrity test\n".encode() * 8
PAYLOAD = bytes(np.random.default_rng(7).integers(0, 256, 3000, dtype=np.uint8))
TOOLS = {"call_1": "<｜DSML｜tool_calls>a</｜DSML｜tool_calls>", "call_2": "b" * 40}


def make_store(d, **kw) -> KVStore:
    kw.setdefault("model_id", MODEL)
    kw.setdefault("quant_bits", 2)
    kw.setdefault("ctx", 8192)
    return KVStore(d, kw.pop("budget_mb", 64), **kw)


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    d = tmp_path_factory.mktemp("orig")
    e = make_store(d).store(TOKENS, TEXT, PAYLOAD, "cold", tool_map=TOOLS)
    return e.name, e.path.read_bytes()


def regions(raw: bytes) -> dict[str, tuple[int, int]]:
    text_len = struct.unpack_from("<I", raw, 48)[0]
    p0 = 52 + text_len
    k0 = p0 + len(PAYLOAD)
    t0 = len(raw) - 68 - 4 * len(TOKENS)
    return {"header": (0, 48), "text_len": (48, 52), "text": (52, p0), "payload": (p0, k0),
            "tool_map": (k0, t0), "tokens": (t0, len(raw) - 68), "tail": (len(raw) - 68, len(raw))}


def assert_rejected(d: Path, name: str, data: bytes, caplog) -> None:
    """No way in: both lookups find nothing, load raises, a log line names the file, file kept."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ds4_mlx.kvstore"):
        store = make_store(d)
        assert store.restore(rendered_text=TEXT + b" and more") is None
        assert store.restore(tokens=TOKENS + [5]) is None
        with pytest.raises(KVStoreError):
            store.load(read_entry(d / name))
    assert name in caplog.text
    assert (d / name).read_bytes() == data


def test_the_original_loads(tmp_path, original):
    name, raw = original
    (tmp_path / name).write_bytes(raw)
    got = make_store(tmp_path).restore(rendered_text=TEXT + b"x")
    assert (got.tokens, got.text, bytes(got.payload), got.tool_map) == (TOKENS, TEXT, PAYLOAD, TOOLS)


def test_bit_flips_anywhere_are_rejected(tmp_path, original, caplog):
    name, raw = original
    rng = random.Random(1)
    positions = []
    for region, (a, b) in regions(raw).items():
        span = range(a, b)
        positions += list(span) if region in ("header", "text_len", "tail") else rng.sample(span, 8)
    for pos in positions:
        d = tmp_path / f"flip{pos}"
        d.mkdir()
        bad = bytearray(raw)
        bad[pos] ^= 1 << (pos % 8)
        (d / name).write_bytes(bad)
        assert_rejected(d, name, bytes(bad), caplog)


def test_truncated_or_extended_files_are_rejected(tmp_path, original, caplog):
    name, raw = original
    rng = random.Random(2)
    cuts = set(range(0, 130)) | set(rng.sample(range(130, len(raw) - 80), 30)) | set(range(len(raw) - 80, len(raw)))
    for cut in sorted(cuts):
        d = tmp_path / f"cut{cut}"
        d.mkdir()
        (d / name).write_bytes(raw[:cut])
        assert_rejected(d, name, raw[:cut], caplog)
    for extra in (b"\0", b"KXM\x01" * 20):
        d = tmp_path / f"ext{len(extra)}"
        d.mkdir()
        (d / name).write_bytes(raw + extra)
        assert_rejected(d, name, raw + extra, caplog)


def _with_header_field(raw: bytes, offset: int, value: int) -> bytes:
    """Change one header byte *and* fix the header crc: a well-formed file of another kind."""
    h = bytearray(raw[:48])
    h[offset] = value
    h[20:24] = struct.pack("<I", zlib.crc32(bytes(h[:20]) + bytes(h[24:48])))
    return bytes(h) + raw[48:]


def _with_tail_version(raw: bytes, version: int) -> bytes:
    out = bytearray(raw)
    out[len(raw) - 68 + 3] = version
    out[-4:] = struct.pack("<I", zlib.crc32(bytes(out[48:-4])))
    return bytes(out)


@pytest.mark.parametrize("kind, expect", [
    ("kvc-version", "unsupported KVC version"),
    ("trailer-version", "trailer version"),
    ("model", "other model"),
    ("payload-version", "payload version"),
    ("quant", "quant bits"),
    ("ctx", "saved for ctx"),
])
def test_wrong_model_version_quant_or_ctx_is_rejected(tmp_path, original, caplog, kind, expect):
    name, raw = original
    if kind == "kvc-version":
        data = _with_header_field(raw, 3, 2)
    elif kind == "trailer-version":
        data = _with_tail_version(raw, 2)
    else:
        kw = {"model": dict(model_id=b"other"), "payload-version": dict(payload_version=9),
              "quant": dict(quant_bits=4), "ctx": dict(ctx=16384)}[kind]
        src = tmp_path / "src"
        e = make_store(src, **kw).store(TOKENS, TEXT, PAYLOAD, "cold")
        data = e.path.read_bytes()
        name = e.name
    d = tmp_path / "case"
    d.mkdir()
    (d / name).write_bytes(data)
    assert_rejected(d, name, data, caplog)
    assert expect in caplog.text


def test_a_ds4_c_file_is_rejected_not_deleted(tmp_path, caplog):
    text = b"ds4 wrote this"
    header = struct.pack("<3sBBBBBIIIIQQQ", b"KVC", 1, 2, 1, 0, 0, 600, 3, 8192, 0, 1, 2, 100)
    data = header + struct.pack("<I", len(text)) + text + bytes(100)
    name = hashlib.sha1(text).hexdigest() + ".kv"
    (tmp_path / name).write_bytes(data)
    with caplog.at_level(logging.INFO, logger="ds4_mlx.kvstore"):
        store = make_store(tmp_path)
        assert store.lookup(rendered_text=text + b"!") is None
    assert "ds4 (C) file" in caplog.text and (tmp_path / name).read_bytes() == data


def test_restore_falls_back_past_a_damaged_entry(tmp_path, original, caplog):
    store = make_store(tmp_path)
    shorter = store.store(TOKENS[:550], TEXT[:100], b"short payload", "cold")
    name, raw = original
    bad = bytearray(raw)
    bad[regions(raw)["payload"][0] + 10] ^= 0x40
    (tmp_path / name).write_bytes(bad)
    with caplog.at_level(logging.WARNING, logger="ds4_mlx.kvstore"):
        got = store.restore(rendered_text=TEXT + b"!")
    assert got.entry.name == shorter.name and bytes(got.payload) == b"short payload"
    assert "checksum mismatch" in caplog.text
    assert (tmp_path / name).read_bytes() == bytes(bad)
    assert store.lookup(rendered_text=TEXT + b"!").name == shorter.name  # the failure is remembered
    assert read_entry(shorter.path).hits == 1


# -- SIGKILL during a save -------------------------------------------------------------------------

CHILD = r"""
import os, signal, sys, time
import numpy as np
from ds4_mlx.engine import kvstore
from ds4_mlx.engine.kvstore import KVStore
from ds4_mlx.engine.kvstore_policy import KVStoreOptions

directory, mode, budget_mb, arg = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
MB = 1 << 20

def die(*_args, **_kw):
    os.kill(os.getpid(), signal.SIGKILL)

store = KVStore(directory, budget_mb, model_id=bytes(range(32)), quant_bits=2, ctx=65536,
                options=KVStoreOptions(min_tokens=1))
chunks = [np.full(MB, i % 251, dtype=np.uint8) for i in range(arg if mode == "slow" else 24)]

class Crc:  # kvstore's view of zlib: count (and maybe slow down) payload chunks
    seen = 0
    def crc32(self, data, value=0):
        if memoryview(data).nbytes == MB:
            Crc.seen += 1
            if mode == "mid-payload" and Crc.seen == arg:
                die()
            if mode == "slow":
                time.sleep(0.01)
        return zlib_crc32(data, value)

import zlib
zlib_crc32 = zlib.crc32
kvstore.zlib = Crc()
if mode == "before-rename":
    kvstore.os.replace = die
elif mode == "after-rename":
    kvstore._fsync_dir = die
elif mode == "mid-evict":
    real = kvstore.unlink_victim
    calls = []
    def unlink_then_die(item, score):
        calls.append(item)
        if len(calls) > arg:
            die()
        return real(item, score)
    kvstore.unlink_victim = unlink_then_die
print("go", flush=True)
store.store(list(range(1000)), b"the new entry", chunks, "continued")
print("done", flush=True)
"""

NEW_NAME = hashlib.sha1(b"the new entry").hexdigest() + ".kv"


def _new_payload(n_chunks: int) -> bytes:
    return b"".join(bytes([i % 251]) * (1 << 20) for i in range(n_chunks))


def _seed_entries(d: Path) -> dict[str, bytes]:
    store = make_store(d, ctx=65536, options=KVStoreOptions(min_tokens=1))
    out = {}
    for i in range(3):
        body = bytes(np.random.default_rng(i).integers(0, 256, 2 << 20, dtype=np.uint8))
        out[store.store([i] * 700, f"existing {i}", body, "cold").name] = body
    return out


def _check_after_kill(d: Path, existing: dict[str, bytes], n_chunks: int, may_evict: bool) -> str:
    # before any clean-up: a half-written save is invisible, whatever is listed is whole
    listed = {e.name for e in kvstore_scan.scan_dir(d).entries}
    assert not kvstore_scan.scan_dir(d).invalid
    assert listed <= set(existing) | {NEW_NAME}
    store = make_store(d, ctx=65536, budget_mb=1024, options=KVStoreOptions(min_tokens=1))
    names = set(os.listdir(d))
    assert not [n for n in names if ".tmp." in n], names  # temp files of the dead writer removed
    for name, body in existing.items():
        if name in names:
            assert bytes(store.load(read_entry(d / name)).payload) == body
        else:
            assert may_evict, f"{name} lost"
    if NEW_NAME in names:
        got = store.load(read_entry(d / NEW_NAME))
        assert got.tokens == list(range(1000)) and bytes(got.payload) == _new_payload(n_chunks)
        return "complete"
    return "absent"


def _run_child(d: Path, mode: str, budget_mb: float, arg: int, kill_after: float | None = None):
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(d), mode, str(budget_mb), str(arg)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "go", proc.stderr.read()
    if kill_after is not None:
        time.sleep(kill_after)
        proc.send_signal(signal.SIGKILL)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err


@pytest.mark.parametrize("mode, arg, expect", [
    ("mid-payload", 1, "absent"),
    ("mid-payload", 13, "absent"),
    ("before-rename", 0, "absent"),
    ("after-rename", 0, "complete"),
])
def test_sigkill_at_fixed_points_of_a_save(tmp_path, mode, arg, expect):
    existing = _seed_entries(tmp_path)
    code, _, err = _run_child(tmp_path, mode, 1024, arg)
    assert code == -signal.SIGKILL, err
    assert any(".tmp." in n for n in os.listdir(tmp_path)) == (expect == "absent")
    assert _check_after_kill(tmp_path, existing, 24, may_evict=False) == expect


def test_sigkill_while_making_room(tmp_path):
    existing = _seed_entries(tmp_path)  # 3 x ~2 MiB; the new 24 MiB entry needs 2 of them gone
    budget = (sum(os.path.getsize(tmp_path / n) for n in existing) + (24 << 20)) / 2**20 - 3.0
    code, _, err = _run_child(tmp_path, "mid-evict", budget, 1)
    assert code == -signal.SIGKILL, err
    assert len(set(os.listdir(tmp_path)) & set(existing)) == 2  # one victim removed, then killed
    assert _check_after_kill(tmp_path, existing, 24, may_evict=True) == "absent"


def _random_kills(tmp_path, runs: int, seed: int):
    rng = random.Random(seed)
    outcomes = []
    for i in range(runs):
        d = tmp_path / f"run{i}"
        d.mkdir()
        existing = _seed_entries(d)
        n_chunks = 40
        code, out, err = _run_child(d, "slow", 1024, n_chunks, kill_after=rng.uniform(0.0, 0.7))
        assert code in (0, -signal.SIGKILL), err
        outcomes.append(_check_after_kill(d, existing, n_chunks, may_evict=False))
    return outcomes


def test_sigkill_at_random_moments(tmp_path):
    outcomes = _random_kills(tmp_path, 4, seed=11)
    assert "absent" in outcomes  # at least one kill landed mid-write


@pytest.mark.slow
def test_sigkill_at_random_moments_many(tmp_path):
    _random_kills(tmp_path, 12, seed=12)
