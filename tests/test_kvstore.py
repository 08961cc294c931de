"""Disk KV store (ds4_mlx.engine.kvstore): file format, keys, lookup, load, store, eviction, budget.

Fake payloads are random bytes; a fake clock drives timestamps. Layout checks read the bytes with
``struct`` at the offsets of ds4's header (spec §10.2) and of our documented trailer, independently
of the module's own parser.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import struct
import zlib
from dataclasses import replace

import numpy as np
import pytest

from ds4_mlx.engine import kvstore, kvstore_eviction, kvstore_format, kvstore_scan
from ds4_mlx.engine.kvstore import KVStore
from ds4_mlx.engine.kvstore_eviction import HIT_HALF_LIFE_SECONDS
from ds4_mlx.engine.kvstore_format import SaveReason, key_for_text, key_for_tokens, read_entry
from ds4_mlx.engine.kvstore_policy import KVStoreOptions
from ds4_mlx.errors import KVStoreError

MODEL = bytes(range(32))
OTHER_MODEL = bytes(range(1, 33))
T0 = 1_700_000_000


class Clock:
    def __init__(self, t: float = T0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def make_store(tmp_path, budget_mb=64, clock=None, **kw) -> KVStore:
    kw.setdefault("model_id", MODEL)
    kw.setdefault("quant_bits", 2)
    kw.setdefault("ctx", 65536)
    return KVStore(tmp_path, budget_mb, clock=clock or Clock(), **kw)


def toks(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 129280, n).tolist()


def payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed + 1000).integers(0, 256, n, dtype=np.uint8).tobytes()


def dir_bytes(d) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


def kv_files(d) -> list[str]:
    """The directory's names but the writers' lock file."""
    return sorted(n for n in os.listdir(d) if n != kvstore_scan.LOCK_NAME)


# -- format ----------------------------------------------------------------------------------


def test_file_layout_is_ds4_header_plus_documented_trailer(tmp_path):
    clock = Clock(T0 + 5)
    store = make_store(tmp_path, clock=clock, ctx=32768, payload_version=7)
    tokens = toks(600)
    text = "<｜User｜>hello\nworld ".encode() * 20 + b"\xe4\xb8"  # ends inside a UTF-8 character
    body = payload(5000)
    tool_map = {"call_a": "<｜DSML｜tool_calls>x</｜DSML｜tool_calls>", "call_b": "dsml b"}
    e = store.store(tokens, text, body, "continued", tool_map=tool_map)
    raw = e.path.read_bytes()
    assert e.path.name == hashlib.sha1(text).hexdigest() + ".kv"

    magic, ver, quant, reason, ext, reserved = struct.unpack_from("<3sBBBBB", raw, 0)
    n, hits, ctx, hcrc = struct.unpack_from("<IIII", raw, 8)
    created, last_used, pbytes = struct.unpack_from("<QQQ", raw, 24)
    assert (magic, ver, quant, reason, reserved) == (b"KVC", 1, 2, 2, 0)
    assert ext == 0x80 | 0x01  # ds4-mlx trailer + KTM tool map, token-text key
    assert (n, hits, ctx, created, last_used, pbytes) == (600, 0, 32768, T0 + 5, T0 + 5, 5000)
    assert hcrc == zlib.crc32(raw[:20] + raw[24:48])
    (text_len,) = struct.unpack_from("<I", raw, 48)
    assert text_len == len(text) and raw[52:52 + text_len] == text
    p0 = 52 + text_len
    assert raw[p0:p0 + 5000] == body

    # ds4's KTM block: "KTM", u8 1, u32 count, then (u32 id_len, u32 dsml_len, id, dsml)*
    k = p0 + 5000
    assert raw[k:k + 4] == b"KTM\x01" and struct.unpack_from("<I", raw, k + 4) == (2,)
    pos, seen = k + 8, {}
    for _ in range(2):
        il, dl = struct.unpack_from("<II", raw, pos)
        pos += 8
        seen[raw[pos:pos + il].decode()] = raw[pos + il:pos + il + dl].decode()
        pos += il + dl
    assert seen == tool_map

    # ds4-mlx trailer: tokens, then the 68-byte tail
    assert np.frombuffer(raw[pos:pos + 2400], "<u4").tolist() == tokens
    tail = raw[pos + 2400:]
    assert len(tail) == 68 and tail[:4] == b"KXM\x01"
    assert struct.unpack_from("<IB", tail, 4) == (7, 32)
    assert tail[9:12] == b"\0\0\0" and tail[12:44] == MODEL
    assert tail[44:64] == hashlib.sha1(raw[pos:pos + 2400]).digest()
    assert struct.unpack_from("<I", tail, 64)[0] == zlib.crc32(raw[48:-4])
    assert len(raw) == e.file_size == 48 + 4 + len(text) + 5000 + (pos - k) + 2400 + 68


def ds4_reader_accepts(path) -> bool:
    """ds4_kvstore_read_entry_file's acceptance test, written from its description."""
    raw = open(path, "rb").read()
    if len(raw) < 52 or raw[:4] != b"KVC\x01":
        return False
    quant, n = raw[4], struct.unpack_from("<I", raw, 8)[0]
    (pbytes,) = struct.unpack_from("<Q", raw, 40)
    (tlen,) = struct.unpack_from("<I", raw, 48)
    return n != 0 and quant in (2, 4) and len(raw) >= 52 + tlen + pbytes


def test_header_stays_readable_by_ds4_style_tools(tmp_path):
    store = make_store(tmp_path, quant_bits=4)
    e = store.store(toks(700), "abc" * 300, payload(3000), "cold")
    assert ds4_reader_accepts(e.path)


def test_keys():
    assert key_for_text("abc") == hashlib.sha1(b"abc").hexdigest()
    assert key_for_text(b"\xff") == hashlib.sha1(b"\xff").hexdigest()
    assert key_for_tokens([1, 258, 2**32 - 1]) == hashlib.sha1(
        b"\x01\0\0\0" + b"\x02\x01\0\0" + b"\xff\xff\xff\xff").hexdigest()
    assert key_for_tokens(np.array([5, 6], dtype=np.int64)) == key_for_tokens([5, 6])
    assert KVStore.key_for_text("x") == key_for_text("x")
    with pytest.raises(KVStoreError, match="u32"):
        key_for_tokens([-1])
    with pytest.raises(KVStoreError, match="u32"):
        key_for_tokens([2**32])


def test_reason_codes_and_key_kinds(tmp_path):
    store = make_store(tmp_path)
    for i, (reason, kind, bits) in enumerate([("cold", "token-text", 0), ("evict", "responses-visible", 2),
                                              (SaveReason.SHUTDOWN, "thinking-visible", 4),
                                              (6, "token-text", 0)]):
        e = store.store(toks(600, i), f"text {i}" * 10, payload(100, i), reason, key_kind=kind)
        assert e.reason == SaveReason.parse(reason) and e.key_kind == kind
        assert e.path.read_bytes()[6] == 0x80 | bits
        assert e.path.read_bytes()[5] == int(SaveReason.parse(reason))
    with pytest.raises(KVStoreError, match="reason"):
        store.store(toks(600), "t", payload(10), "sometimes")
    with pytest.raises(KVStoreError, match="key_kind"):
        store.store(toks(600), "t", payload(10), "cold", key_kind="x")


def test_constructor_and_store_argument_checks(tmp_path):
    with pytest.raises(KVStoreError, match="quant_bits"):
        make_store(tmp_path, quant_bits=3)
    with pytest.raises(KVStoreError, match="model id"):
        make_store(tmp_path, model_id=b"")
    with pytest.raises(KVStoreError, match="model id"):
        make_store(tmp_path, model_id=bytes(33))
    with pytest.raises(KVStoreError, match="hex"):
        make_store(tmp_path, model_id="not hex")
    assert make_store(tmp_path, model_id="ab" * 20).model_id == b"\xab" * 20
    store = make_store(tmp_path, ctx=1000)
    with pytest.raises(KVStoreError, match="context size"):
        store.store(toks(1001), "t", payload(10), "cold")
    with pytest.raises(KVStoreError, match="empty payload"):
        store.store(toks(600), "t", b"", "cold")
    with pytest.raises(KVStoreError, match="0 tokens"):
        store.store([], "t", b"x", "cold")
    with pytest.raises(KVStoreError, match="tool id"):
        store.store(toks(600), "t", b"x", "cold", tool_map={"": "x"})
    with pytest.raises(KVStoreError, match="exactly one"):
        store.lookup()


def test_payload_as_chunks_and_typed_arrays(tmp_path):
    store = make_store(tmp_path)
    a = np.arange(100, dtype=np.float32)
    b = np.arange(7, dtype=np.uint32).reshape(7, 1)
    e = store.store(toks(600), "chunks", [a, memoryview(b"xyz"), b], "cold")
    _, _, got = store.load(e)
    assert bytes(got) == a.tobytes() + b"xyz" + b.tobytes()
    with pytest.raises(KVStoreError, match="contiguous"):
        store.store(toks(600), "chunks2", [np.arange(10)[::2]], "cold")


# -- lookup ----------------------------------------------------------------------------------


def test_lookup_longest_text_prefix(tmp_path):
    store = make_store(tmp_path)
    short = store.store(toks(512, 1), "transcript prefix", payload(10), "cold")
    long = store.store(toks(768, 2), "transcript prefix with sampled token bytes", payload(10), "cold")
    prompt = "transcript prefix with sampled token bytes and suffix"
    assert store.lookup(rendered_text=prompt) == long
    assert store.lookup(rendered_text="transcript prefix and more") == short
    assert store.lookup(rendered_text="transcript prefiX") is None
    assert store.lookup(rendered_text="transcript prefix") == short  # the whole prompt is stored
    assert store.lookup(rendered_text=prompt, min_tokens=769) is None
    assert store.lookup(rendered_text=prompt, min_tokens=600) == long
    assert store.lookup(rendered_text=prompt.encode()) == long


def test_lookup_text_prefix_is_bytewise(tmp_path):
    store = make_store(tmp_path)
    cut = "é".encode()[:1]  # a stored text may end inside a UTF-8 character (b"\xc3")
    e = store.store(toks(600), b"abc" + cut, payload(10), "cold")
    assert store.lookup(rendered_text="abcé tail") == e
    assert store.lookup(rendered_text="abcè tail") == e  # "è" = c3 a8 also starts with c3
    assert store.lookup(rendered_text="abcd tail") is None
    assert store.lookup(rendered_text=b"abc" + cut) == e


def test_lookup_by_tokens(tmp_path):
    clock = Clock()
    store = make_store(tmp_path, clock=clock)
    base = toks(2000, 3)
    e600 = store.store(base[:600], "a", payload(10), "cold")
    e1500 = store.store(base[:1500], "b", payload(10), "continued")
    store.store(toks(1800, 4), "c", payload(10), "cold")  # not a prefix
    assert store.lookup(tokens=base) == e1500
    assert store.lookup(tokens=base[:1499]) == e600
    assert store.lookup(tokens=np.array(base[:1500], dtype=np.int32)) == e1500
    assert store.lookup(tokens=base[:599]) is None
    changed = list(base)
    changed[700] += 1
    assert store.lookup(tokens=changed) == e600
    # same tokens under two key texts: the more recently used wins
    clock.t += 10
    twin = store.store(base[:1500], "b'", payload(10), "evict")
    assert store.lookup(tokens=base) == twin
    clock.t += 10
    store.load(e1500)
    assert store.lookup(tokens=base).name == e1500.name


def test_lookup_skips_incompatible_entries_with_logged_reason(tmp_path, caplog):
    base = toks(3000, 5)
    text = "x" * 4000
    variants = {
        "other model": dict(model_id=OTHER_MODEL),
        "payload version": dict(payload_version=2),
        "quant bits": dict(quant_bits=4),
        "saved for ctx": dict(ctx=131072),
    }
    for i, (_, kw) in enumerate(variants.items()):
        make_store(tmp_path, **kw).store(base[:1000 + 100 * i], text[:1000 + 100 * i], payload(10), "cold")
    ok = make_store(tmp_path).store(base[:600], text[:600], payload(10), "cold")
    store = make_store(tmp_path)
    with caplog.at_level(logging.INFO, logger="ds4_mlx.kvstore"):
        assert store.lookup(rendered_text=text) == ok
        assert store.lookup(tokens=base) == ok
    log = caplog.text
    for why in variants:
        assert why in log
    # a snapshot saved at a smaller context loads into a larger one
    big = make_store(tmp_path, ctx=262144)
    assert big.lookup(rendered_text=text).tokens == 1300  # the ctx=131072 one
    assert make_store(tmp_path, quant_bits=4).lookup(rendered_text=text).tokens == 1200
    assert make_store(tmp_path, accept_other_quant=True).lookup(rendered_text=text).tokens == 1200
    with pytest.raises(kvstore_format.KVFileRejected, match="other model"):
        store.load(read_entry(next(p for p in tmp_path.glob("*.kv") if p.name != ok.name and
                                   read_entry(p).model_id == OTHER_MODEL)))


# -- load ------------------------------------------------------------------------------------


def test_load_returns_contents_and_counts_hits(tmp_path):
    clock = Clock()
    store = make_store(tmp_path, clock=clock)
    tokens, body = toks(900), payload(12345)
    e = store.store(tokens, "some text", body, "cold", tool_map={"id1": "d1"})
    clock.t += 100
    loaded = store.load(store.lookup(tokens=tokens))
    t, text, p = loaded
    assert (t, text, bytes(p)) == (tokens, b"some text", body)
    assert loaded.tool_map == {"id1": "d1"} and not loaded.consumed
    again = read_entry(e.path)
    assert (again.hits, again.last_used, again.created_at) == (1, T0 + 100, T0)
    clock.t += 50
    store.load(again)
    again = read_entry(e.path)  # the header crc was rewritten with the hit: still valid
    assert (again.hits, again.last_used) == (2, T0 + 150)
    assert again.same_snapshot(e)


def test_consumed_entries_are_deleted_after_load(tmp_path, caplog):
    store = make_store(tmp_path, options=KVStoreOptions(cold_max_tokens=1000))
    big = store.store(toks(1001), "big", payload(10), "continued")
    small = store.store(toks(1000), "small", payload(10), "cold")
    with caplog.at_level(logging.INFO, logger="ds4_mlx.kvstore"):
        assert store.load(big).consumed
    assert "consumed" in caplog.text
    assert not big.path.exists()
    assert not store.load(small).consumed and small.path.exists()
    # cold_max_tokens = 0 disables consumption
    keep = make_store(tmp_path, options=KVStoreOptions(cold_max_tokens=0))
    e = keep.store(toks(40000), "huge", payload(10), "continued")
    assert not keep.load(e).consumed and e.path.exists()


def test_load_rejects_a_file_changed_since_lookup(tmp_path):
    store = make_store(tmp_path)
    e = store.store(toks(600), "text", payload(100), "cold")
    os.remove(e.path)
    other = make_store(tmp_path, payload_version=1)
    other.store(toks(601), "text", payload(100), "cold")
    with pytest.raises(kvstore_format.KVFileRejected, match="changed"):
        store.load(e)


def test_mark_unloadable_makes_restore_fall_back(tmp_path):
    store = make_store(tmp_path)
    store.store(toks(600, 1), "ab", payload(10), "cold")
    best = store.store(toks(700, 1), "abc", payload(10), "cold")
    got = store.restore(rendered_text="abcd")
    assert got.entry.name == best.name
    store.mark_unloadable(got.entry, "payload shape mismatch")
    assert store.restore(rendered_text="abcd").entry.tokens == 600
    assert best.path.exists()


def test_store_replaces_a_same_text_file_whose_payload_was_refused(tmp_path):
    """A same-text file is normally kept as is (ds4); one our loader refused would then be reported
    as stored while no later run could load it, so it is rewritten with the new payload."""
    store = make_store(tmp_path)
    old = store.store(toks(700, 1), "abc", payload(10), "cold")
    got = store.restore(rendered_text="abcd")
    store.mark_unloadable(got.entry, "payload made with another prefill chunk")
    new = store.store(toks(700, 1), "abc", payload(12), "cold")
    assert new is not None and new.name == old.name
    again = store.restore(rendered_text="abcd")
    assert again is not None and bytes(again.payload) == bytes(payload(12))


# -- store -----------------------------------------------------------------------------------


def test_store_skips_short_prefixes_and_oversized_files(tmp_path):
    store = make_store(tmp_path)
    assert store.store(toks(511), "t", payload(10), "cold") is None
    assert kv_files(tmp_path) == []
    # file = 52 + text + payload + tokens*4 + 68; needed = file + ceil(file / 100)
    n, text = 600, b"t" * 28
    fixed = 52 + len(text) + 4 * n + 68
    budget = 40000
    fits = max(p for p in range(budget) if p + fixed + -(-(p + fixed) // 100) <= budget)
    tight = make_store(tmp_path, budget_mb=budget / 2**20)
    assert tight.store(toks(n), text, payload(fits + 1), "cold") is None
    e = tight.store(toks(n), text, payload(fits), "cold")
    assert e is not None and e.file_size == fixed + fits


def test_store_same_text_keeps_existing_file(tmp_path):
    clock = Clock()
    store = make_store(tmp_path, clock=clock)
    first = store.store(toks(600, 1), "same text", payload(100, 1), "cold")
    store.load(first)
    clock.t += 10
    again = store.store(toks(600, 2), "same text", payload(100, 2), "continued")
    assert again.name == first.name and again.hits == 1 and again.reason == SaveReason.COLD
    assert bytes(store.load(again).payload) == payload(100, 1)
    # a new tool map rewrites the file, keeping its hit count and creation time
    clock.t += 10
    newer = store.store(toks(600, 2), "same text", payload(100, 2), "evict", tool_map={"i": "d"})
    assert (newer.hits, newer.created_at, newer.reason) == (2, T0, SaveReason.EVICT)
    loaded = store.load(newer)
    assert loaded.tool_map == {"i": "d"} and bytes(loaded.payload) == payload(100, 2)


def test_store_never_overwrites_another_models_checkpoint(tmp_path):
    # Two models share the directory; the file name is the text's hash alone (ds4's scheme).
    other = make_store(tmp_path, model_id=OTHER_MODEL)
    theirs = other.store(toks(600), "shared text", payload(100, 1), "cold")
    store = make_store(tmp_path)
    with pytest.raises(kvstore_format.KVSaveSkipped, match="another model's checkpoint"):
        store.store(toks(600), "shared text", payload(100, 2), "cold")
    assert store.lookup(rendered_text="shared text") is None  # not ours to load either
    assert bytes(other.load(other.lookup(rendered_text="shared text")).payload) == payload(100, 1)
    assert read_entry(theirs.path).model_id == OTHER_MODEL


def test_store_replaces_same_name_incompatible_or_damaged_file(tmp_path, caplog):
    older = make_store(tmp_path, payload_version=0)
    theirs = older.store(toks(600), "shared text", payload(100, 1), "cold")
    store = make_store(tmp_path)
    with caplog.at_level(logging.INFO, logger="ds4_mlx.kvstore"):
        mine = store.store(toks(600), "shared text", payload(100, 2), "cold")
    assert mine.name == theirs.name and mine.payload_version == 1 and "payload version" in caplog.text
    raw = bytearray(mine.path.read_bytes())
    raw[200] ^= 1
    mine.path.write_bytes(raw)
    fixed = store.store(toks(600), "shared text", payload(100, 3), "cold")
    assert bytes(store.load(fixed).payload) == payload(100, 3)


def test_store_same_name_when_the_budget_cannot_hold_both(tmp_path):
    # budget fits one ~30 KB file with headroom, not two
    store = make_store(tmp_path, budget_mb=40000 / 2**20)
    first = store.store(toks(600), "key", payload(25000, 1), "cold")
    kept = store.store(toks(600), "key", payload(25000, 2), "cold", tool_map={"i": "d"})
    assert kept.name == first.name and not kept.has_tool_map  # no room to rewrite atomically
    assert bytes(store.load(kept).payload) == payload(25000, 1)
    raw = bytearray(first.path.read_bytes())
    raw[100] ^= 1  # damage it: now it is removed first, then replaced
    first.path.write_bytes(raw)
    fresh = store.store(toks(600), "key", payload(25000, 3), "cold")
    assert bytes(store.load(fresh).payload) == payload(25000, 3)
    assert dir_bytes(tmp_path) <= store.budget


def test_store_leaves_no_temp_file_on_write_error(tmp_path, monkeypatch):
    store = make_store(tmp_path)
    keep = store.store(toks(600, 1), "keep", payload(100), "cold")

    def fail_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kvstore.os, "fsync", fail_fsync)
    with pytest.raises(KVStoreError, match="No space left"):
        store.store(toks(600, 2), "new", payload(100), "cold")
    monkeypatch.undo()
    assert kv_files(tmp_path) == [keep.name]
    assert bytes(store.load(keep).payload) == payload(100)


def test_open_removes_dead_writers_temp_files(tmp_path):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    pid = int(dead.stdout)
    stale = tmp_path / f"{'a' * 40}.kv.tmp.{pid}"
    live = tmp_path / f"{'b' * 40}.kv.tmp.{os.getppid()}"
    other = tmp_path / "notes.txt"
    for p in (stale, live, other):
        p.write_bytes(b"partial")
    make_store(tmp_path)
    assert not stale.exists() and live.exists() and other.exists()


# -- eviction --------------------------------------------------------------------------------
#
# ds4 HEAD's order is pinned by running the ds4-derived cases under KVStoreOptions.ds4_head();
# ds4-mlx's two factors (anchor x2, superseded continued demoted) have their own cases below.

DS4_HEAD = KVStoreOptions.ds4_head()
MODES = {"ds4-head": DS4_HEAD, "ds4-mlx": KVStoreOptions()}


def _sized_store(store, n_tokens, size, text, seed=0, reason="cold"):
    """Store a checkpoint whose file is exactly ``size`` bytes."""
    t = text.encode()
    fixed = 52 + len(t) + 4 * n_tokens + 68
    return store.store(toks(n_tokens, seed), t, payload(size - fixed, seed), reason)


@pytest.mark.parametrize("mode", MODES)
def test_eviction_removes_lowest_token_density_first(tmp_path, mode):
    store = make_store(tmp_path, options=MODES[mode])
    low = _sized_store(store, 600, 20000, "low", 1)  # 0.03 tokens/byte
    high = _sized_store(store, 2000, 20000, "high", 2)  # 0.1 tokens/byte
    tight = make_store(tmp_path, budget_mb=30000 / 2**20, options=MODES[mode])  # open evicts, like ds4
    assert not low.path.exists() and high.path.exists()
    assert tight.total_bytes() <= tight.budget


def test_eviction_protects_the_new_file_and_keeps_continued_frontiers(tmp_path):
    clock = Clock()
    store = make_store(tmp_path, budget_mb=45000 / 2**20, clock=clock, options=DS4_HEAD)
    cold = _sized_store(store, 600, 20000, "cold", 1, "cold")
    cont = _sized_store(store, 2048, 20000, "cont", 2, "continued")  # a prefix-ish frontier
    # the new file has the lowest density of all, yet the older cold file goes (ds4's protection)
    new = _sized_store(store, 520, 20000, "new", 3, "evict")
    assert new.path.exists() and cont.path.exists() and not cold.path.exists()


def test_eviction_order_uses_decayed_hits_and_last_use(tmp_path):
    clock = Clock()
    store = make_store(tmp_path, clock=clock, options=DS4_HEAD)
    a = _sized_store(store, 1000, 20000, "a", 1)
    b = _sized_store(store, 1000, 20000, "b", 2)
    for _ in range(4):
        store.load(read_entry(a.path))  # a: 4 hits at T0
    scan = kvstore_scan.scan_dir(tmp_path)
    order = [e.name for e, _ in kvstore_eviction.eviction_order(scan.entries, T0, options=DS4_HEAD)]
    assert order == [b.name, a.name]
    # 14 half-lives later a's hits are worth nothing; b used more recently -> a is older, goes first
    clock.t = T0 + 14 * HIT_HALF_LIFE_SECONDS
    store.load(read_entry(b.path))
    clock.t += 1
    scan = kvstore_scan.scan_dir(tmp_path)
    order = [e.name for e, _ in kvstore_eviction.eviction_order(scan.entries, clock.t, options=DS4_HEAD)]
    assert order == [a.name, b.name]
    # after 1 half-life from use, 4 hits count as 2: score (2 + 1) * tokens / size
    e = read_entry(a.path)
    later = e.last_used + HIT_HALF_LIFE_SECONDS
    assert kvstore_eviction.entry_score(e, later, DS4_HEAD).score == pytest.approx(3 * 1000 / 20000)
    # ds4-mlx: a is a cold anchor, so the same base counts twice
    s = kvstore_eviction.entry_score(e, later, KVStoreOptions())
    assert s.base == pytest.approx(3 * 1000 / 20000) and s.score == pytest.approx(2 * 3 * 1000 / 20000)
    assert s.note == "anchor x2"


@pytest.mark.parametrize("mode", MODES)
def test_eviction_ties_go_to_older_last_use(tmp_path, mode):
    clock = Clock()
    store = make_store(tmp_path, clock=clock, options=MODES[mode])
    old = _sized_store(store, 1000, 20000, "old", 1)
    clock.t += 60
    young = _sized_store(store, 1000, 20000, "young", 2)
    removed = kvstore_eviction.evict_to_budget(tmp_path, 30000, clock.t, options=MODES[mode])
    assert [r.path.name for r in removed] == [old.name] and young.path.exists()


@pytest.mark.parametrize("mode", MODES)
def test_damaged_files_are_evicted_first_but_count_toward_the_budget(tmp_path, mode):
    store = make_store(tmp_path, options=MODES[mode])
    good = _sized_store(store, 600, 20000, "good", 1)
    bad = _sized_store(store, 4000, 20000, "bad", 2)
    raw = bytearray(bad.path.read_bytes())
    raw[0] = ord("X")
    bad.path.write_bytes(raw)
    assert kvstore_scan.scan_dir(tmp_path).total_bytes == 40000
    make_store(tmp_path, budget_mb=45000 / 2**20, options=MODES[mode])  # fits: nothing removed
    assert bad.path.exists()
    make_store(tmp_path, budget_mb=30000 / 2**20, options=MODES[mode])
    assert not bad.path.exists() and good.path.exists()


# ds4-mlx: anchors x2 --------------------------------------------------------------------------


@pytest.mark.parametrize("reason", ["cold", "evict", "shutdown"])
def test_anchor_survives_a_denser_fresh_continued_entry(tmp_path, reason):
    # Same file size, both fresh with 0 hits: densities 1024/S vs 1200/S, so ds4 HEAD keeps the
    # continued one; x2 makes the anchor 2048/S > 1200/S. Budget: one file only.
    size = 20000
    for mode, survivor in (("ds4-mlx", "anchor"), ("ds4-head", "cont")):
        d = tmp_path / mode
        store = make_store(d, options=MODES[mode])
        files = {"anchor": _sized_store(store, 1024, size, "anchor", 1, reason),
                 "cont": _sized_store(store, 1200, size, "cont", 2, "continued")}
        make_store(d, budget_mb=(size + 16) / 2**20, options=MODES[mode])  # open evicts
        assert [k for k, e in files.items() if e.path.exists()] == [survivor], mode


def test_continued_entry_needs_a_real_hit_to_outrank_an_anchor(tmp_path):
    clock = Clock()
    store = make_store(tmp_path, clock=clock)
    anchor = _sized_store(store, 1024, 20000, "anchor", 1, "cold")
    cont = _sized_store(store, 1200, 20000, "cont", 2, "continued")
    store.load(read_entry(cont.path))  # 1 fresh hit: (1 + 1) * 1200 > 2 * (0 + 1) * 1024
    make_store(tmp_path, budget_mb=20016 / 2**20, clock=clock)
    assert cont.path.exists() and not anchor.path.exists()


# ds4-mlx: superseded continued entries are demoted ---------------------------------------------


def _prefix_family(store, clock, reason_long="continued", long_size=30000):
    """U: an unrelated continued entry (oldest); P: continued, prefix of L; L: newer, extends P.
    U and P have the same shape (1000 tokens, 20000 bytes)."""
    base = toks(3000, 7)
    u = store.store(toks(1000, 8), b"U", payload(20000 - 52 - 1 - 4000 - 68, 8), "continued")
    clock.t += 60
    p = store.store(base[:1000], b"P", payload(20000 - 52 - 1 - 4000 - 68, 9), "continued")
    clock.t += 60
    long = store.store(base, b"L", payload(long_size - 52 - 1 - 12000 - 68, 10), reason_long)
    clock.t += 60
    return u, p, long


def test_superseded_continued_is_evicted_before_an_unrelated_one_of_the_same_shape(tmp_path):
    for mode, victim in (("ds4-mlx", "P"), ("ds4-head", "U")):  # ds4: equal scores, older U goes
        clock = Clock()
        d = tmp_path / mode
        store = make_store(d, clock=clock, options=MODES[mode])
        u, p, long = _prefix_family(store, clock)
        scores = kvstore_eviction.eviction_scores(kvstore_scan.scan_dir(d).entries, clock.t, MODES[mode])
        assert scores[u.name].score == pytest.approx(1000 / 20000)
        if mode == "ds4-mlx":
            assert scores[p.name].superseded_by == (long.name,)
            assert scores[p.name].score == pytest.approx(0.02 * 1000 / 20000)
            assert scores[p.name].note == f"superseded x0.02 by {long.name}"
        else:
            assert scores[p.name].score == scores[u.name].score
        removed = kvstore_eviction.evict_to_budget(d, 20000 + 30000, clock.t, options=MODES[mode])
        assert [r.path.name for r in removed] == [{"P": p, "U": u}[victim].name]
        assert long.path.exists()


def test_store_counts_the_file_being_written_as_the_superseder(tmp_path):
    # Room for the long file is made before it exists; P must still be the one to go.
    for mode, victim in (("ds4-mlx", "P"), ("ds4-head", "U")):
        clock = Clock()
        d = tmp_path / mode
        store = make_store(d, budget_mb=55000 / 2**20, clock=clock, options=MODES[mode])
        u, p, long = _prefix_family(store, clock)
        assert long is not None and long.path.exists()
        gone = [k for k, e in (("P", p), ("U", u)) if not e.path.exists()]
        assert gone == [victim], mode


def test_superseded_entry_with_hits_is_demoted_less(tmp_path):
    clock = Clock()
    store = make_store(tmp_path, clock=clock)
    u, p, long = _prefix_family(store, clock)
    store.load(read_entry(p.path))
    clock.t += HIT_HALF_LIFE_SECONDS  # 1 hit, half-life later: 0.5 effective hits
    s = kvstore_eviction.eviction_scores(kvstore_scan.scan_dir(tmp_path).entries, clock.t)[p.name]
    assert s.base == pytest.approx(1.5 * 1000 / 20000)
    assert s.superseded_factor == 0.25 and s.score == pytest.approx(0.25 * 1.5 * 1000 / 20000)
    clock.t += 14 * HIT_HALF_LIFE_SECONDS  # decayed below 0.01: counts as never hit again
    s = kvstore_eviction.eviction_scores(kvstore_scan.scan_dir(tmp_path).entries, clock.t)[p.name]
    assert s.superseded_factor == 0.02


def test_only_continued_entries_are_demoted_and_anchors_keep_their_bonus(tmp_path):
    clock = Clock()
    store = make_store(tmp_path, clock=clock)
    base = toks(3000, 7)
    cold = store.store(base[:1000], b"C", payload(15000, 1), "cold")
    clock.t += 60
    long = store.store(base, b"L", payload(15000, 2), "continued")
    s = kvstore_eviction.eviction_scores(kvstore_scan.scan_dir(tmp_path).entries, clock.t)
    assert s[cold.name].superseded_by == () and s[cold.name].score == pytest.approx(2 * s[cold.name].base)
    assert s[long.name].score == s[long.name].base


def test_superseder_must_be_newer_same_model_and_intact(tmp_path):
    clock = Clock()
    base = toks(3000, 7)
    store = make_store(tmp_path, clock=clock)
    older = store.store(base, b"older", payload(15000, 1), "evict")  # extends P but predates it
    clock.t += 60
    p = store.store(base[:1000], b"P", payload(15000, 2), "continued")
    clock.t += 60
    other = make_store(tmp_path, clock=clock, model_id=OTHER_MODEL)
    other.store(base[:2000], b"other model", payload(15000, 3), "evict")
    newer_pv = make_store(tmp_path, clock=clock, payload_version=2)
    newer_pv.store(base[:2500], b"other payload version", payload(15000, 4), "evict")
    s = kvstore_eviction.eviction_scores(kvstore_scan.scan_dir(tmp_path).entries, clock.t)
    assert s[p.name].superseded_by == () and s[p.name].score == s[p.name].base
    # a newer same-model extension whose stored tokens are damaged does not count either
    good = store.store(base[:1500], b"newer", payload(15000, 5), "evict")
    s = kvstore_eviction.eviction_scores(kvstore_scan.scan_dir(tmp_path).entries, clock.t)
    assert s[p.name].superseded_by == (good.name,)
    raw = bytearray(good.path.read_bytes())
    raw[len(raw) - 68 - 4 * 1500 + 8] ^= 1  # a token in the trailer (only the file crc covers it)
    good.path.write_bytes(raw)
    assert kvstore_scan.scan_dir(tmp_path).entries  # still passes the cheap checks
    s = kvstore_eviction.eviction_scores(kvstore_scan.scan_dir(tmp_path).entries, clock.t)
    assert s[p.name].superseded_by == ()


def test_demoted_entry_regains_its_score_when_its_superseder_goes_first(tmp_path):
    # L is so sparse (1100 tokens in 2 MB: 0.00055) that it goes before P even demoted (0.001);
    # then P is no longer superseded: back to 0.05, tied with U, and the older U goes first.
    clock = Clock()
    store = make_store(tmp_path, clock=clock)
    base = toks(1100, 7)
    u = store.store(toks(1000, 8), b"U", payload(20000 - 52 - 1 - 4000 - 68, 8), "continued")
    clock.t += 60
    p = store.store(base[:1000], b"P", payload(20000 - 52 - 1 - 4000 - 68, 9), "continued")
    clock.t += 60
    long = store.store(base, b"L", payload(2_000_000 - 52 - 1 - 4400 - 68, 10), "continued")
    order = kvstore_eviction.eviction_order(kvstore_scan.scan_dir(tmp_path).entries, clock.t)
    assert [e.name for e, _ in order] == [long.name, u.name, p.name]
    assert [s.score for _, s in order] == pytest.approx([1100 / 2_000_000, 1000 / 20000, 1000 / 20000])
    # while L exists, P is demoted, never deleted for it: under budget nothing goes
    assert kvstore_eviction.evict_to_budget(tmp_path, 10**7, clock.t) == [] and p.path.exists()
    removed = kvstore_eviction.evict_to_budget(tmp_path, 20000, clock.t)
    assert [r.path.name for r in removed] == [long.name, u.name] and p.path.exists()


def test_supersession_reads_only_trailer_tokens_and_only_when_evicting(tmp_path, monkeypatch):
    clock = Clock()
    store = make_store(tmp_path, clock=clock)
    u, p, long = _prefix_family(store, clock)
    reads = []
    real_pread = os.pread

    def pread(fd, n, offset):
        reads.append((n, offset))
        return real_pread(fd, n, offset)

    monkeypatch.setattr(kvstore.os, "pread", pread)
    kvstore_eviction.eviction_scores(kvstore_scan.scan_dir(tmp_path).entries, clock.t)
    size = long.file_size
    assert reads == [(4 * 3000, size - 68 - 4 * 3000)]  # L's stored tokens; nothing of U or P
    reads.clear()
    store.store(toks(600, 11), b"fits", payload(100, 11), "continued")  # under budget: no scoring
    store.evict()
    assert reads == []


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_budget_is_never_exceeded(tmp_path, monkeypatch, seed, mode):
    rng = random.Random(seed)
    budget = rng.randrange(30_000, 150_000)
    clock = Clock()
    store = make_store(tmp_path, budget_mb=budget / 2**20, clock=clock,
                       options=replace(MODES[mode], min_tokens=1, cold_max_tokens=0))
    real_replace = os.replace
    peaks = []

    def checked_replace(src, dst):
        peaks.append(dir_bytes(tmp_path))  # every .kv file plus the finished temp file
        return real_replace(src, dst)

    monkeypatch.setattr(kvstore.os, "replace", checked_replace)
    stored = 0
    for i in range(120):
        clock.t += rng.randrange(0, 4 * HIT_HALF_LIFE_SECONDS)
        n = rng.randrange(1, 3000)
        size = rng.choice([rng.randrange(1, 2000), rng.randrange(1, budget)])
        text = f"{rng.randrange(40)}-".encode() * rng.randrange(1, 50)  # repeats exercise same-key paths
        # few token seeds: sequences of one seed are prefixes of each other (superseded entries)
        e = store.store(toks(n, i % 4), text, payload(size, i), rng.choice(["cold", "continued", "evict"]))
        file_bytes = 52 + len(text) + size + 4 * n + 68
        if e is None:
            assert file_bytes + -(-file_bytes // 100) > budget
        else:
            stored += 1
        if rng.random() < 0.3:
            hit = store.lookup(rendered_text=text + b"tail")
            if hit is not None:
                store.load(hit)
        assert dir_bytes(tmp_path) <= budget
    assert stored > 20 and peaks and max(peaks) <= budget
