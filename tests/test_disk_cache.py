"""DiskCache (engine/disk_cache.py): ds4-server's lookup / cold / continued / evict rules on the tiny model.

Small settings so the frontiers fall inside short prompts: prefill chunk 32, alignment 32, continued
interval 50 (a step of ceil(50 / 32) * 32 = 64), min_tokens 32, trim 32. Every expected save point
below is worked out from ds4's rules by hand in the test; every reference state is an independent
cold prefill (``cold``). "Bit-identical" compares float32 bit patterns.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from ds4_mlx.engine.disk_cache import DiskCache
from ds4_mlx.engine.engine import Engine
from ds4_mlx.engine.kvstore_policy import KVStoreOptions

CHUNK = 32
CTX = 512
STEP = 64  # ceil(INTERVAL / CHUNK) * CHUNK
OPTS = KVStoreOptions(min_tokens=32, cold_max_tokens=30000, continued_interval_tokens=50,
                      boundary_trim_tokens=32, boundary_align_tokens=CHUNK)
MIB = 1024 * 1024


@pytest.fixture(scope="module")
def engine(tiny_model_path) -> Engine:
    return Engine.open(tiny_model_path)


@pytest.fixture(scope="module")
def prompt(oracle_dir) -> list[int]:
    doc = json.loads((oracle_dir / "golden" / "dev_long.json").read_text())
    return doc["prompt_tokens"]  # 733 ds4 token ids: BOS + Italian prose, no chat markers


def make_cold(engine):
    cache: dict[tuple, tuple] = {}

    def get(tokens: list[int]) -> tuple[np.ndarray, dict]:
        """(logits, state arrays) of a cold prefill of ``tokens`` with the test chunk."""
        key = tuple(tokens)
        if key not in cache:
            s = engine.new_session(ctx=CTX, chunk=CHUNK)
            s.sync(tokens)
            cache[key] = (s.logits(), s.snapshot().state.to_numpy())
        return cache[key]

    return get


@pytest.fixture(scope="module")
def cold(engine):
    return make_cold(engine)


def bits(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32)).view(np.uint32)


def same_bits(a, b) -> bool:
    return bits(a).shape == bits(b).shape and bool(np.array_equal(bits(a), bits(b)))


def same_state(state: dict, other: dict) -> bool:
    return state.keys() == other.keys() and all(same_bits(state[k], other[k]) for k in state if k != "n_tokens")


def close_logits(got, want) -> None:
    """Default numerics, a state reached by decode steps against a chunked prefill: equal up to
    rounding (tests/test_session.py's band: logit rms <= 0.06, argmax equal)."""
    rms = float(np.sqrt(np.mean((np.asarray(got, np.float64) - want) ** 2)))
    assert rms <= 0.06, rms
    assert int(np.argmax(got)) == int(np.argmax(want))


def summary(results) -> list[tuple[str, int, str]]:
    return [(r.reason, r.tokens, r.status) for r in results]


def stored_files(dc: DiskCache) -> dict[int, str]:
    return {e.tokens: e.reason.label for e in dc.store.entries()}


def loaded(engine, dc: DiskCache, n_tokens: int):
    """A fresh session holding the stored checkpoint of ``n_tokens`` tokens."""
    (entry,) = [e for e in dc.store.entries() if e.tokens == n_tokens]
    s = engine.new_session(ctx=CTX, chunk=CHUNK)
    s.load_payload(dc.store.load(entry).payload)
    return s


# -- continued checkpoints ------------------------------------------------------------------------------


def test_continued_frontiers_in_prefill_and_generation_then_resume(engine, prompt, cold, tmp_path):
    dc = DiskCache(engine, tmp_path / "kv", 64, ctx=CTX, options=OPTS)
    s = engine.new_session(ctx=CTX, chunk=CHUNK)
    rep = dc.sync(s, prompt[:200])
    # Fresh prompt of 200 tokens, no chat anchor: cold cut = (200 - 32) aligned down to 32 = 160.
    # Continued frontiers are the multiples of 64: 64 and 128 on the way to the cut, 192 after it.
    assert (rep.source, rep.cached_tokens, rep.hit_path, rep.refused) == ("none", 0, None, [])
    assert rep.effective_prompt == prompt[:200] and s.tokens == prompt[:200]
    assert summary(rep.saved) == [("continued", 64, "stored"), ("continued", 128, "stored"),
                                  ("cold", 160, "stored"), ("continued", 192, "stored")]
    # Segmenting the prefill at the frontiers (multiples of the chunk) changed nothing.
    want_logits, want_state = cold(prompt[:200])
    assert same_bits(s.logits(), want_logits) and same_state(s.snapshot().state.to_numpy(), want_state)

    # Generation (forced tokens): the only frontier in 201..260 is 256.
    saves = []
    for t in prompt[200:260]:
        s.eval(t)
        res = dc.after_eval(s)
        if res is not None:
            saves.append((s.pos, res))
        if s.pos == 256:
            live_256 = s.logits()
    assert [(pos, r.reason, r.tokens, r.status) for pos, r in saves] == [(256, "continued", 256, "stored")]
    assert stored_files(dc) == {64: "continued", 128: "continued", 160: "cold", 192: "continued",
                                256: "continued"}

    # Checkpoints written during prefill are cold prefills of their prefix, bit for bit.
    for n in (64, 128, 160, 192):
        got = loaded(engine, dc, n)
        assert got.tokens == prompt[:n]
        assert same_bits(got.logits(), cold(prompt[:n])[0])
        assert same_state(got.snapshot().state.to_numpy(), cold(prompt[:n])[1])
    # The one written during generation holds the state the live session had at 256.
    got = loaded(engine, dc, 256)
    assert got.tokens == prompt[:256] and same_bits(got.logits(), live_256)

    # A later run (new DiskCache on the same directory, new session) with a longer prompt resumes
    # from the newest continued checkpoint; 256..300 crosses no frontier, and no cold save is due.
    dc2 = DiskCache(engine, tmp_path / "kv", 64, ctx=CTX, options=OPTS)
    s2 = engine.new_session(ctx=CTX, chunk=CHUNK)
    rep2 = dc2.sync(s2, prompt[:300])
    assert (rep2.source, rep2.cached_tokens, rep2.saved) == ("disk-tokens", 256, [])
    assert rep2.hit_path is not None and rep2.hit_path.name == got_name(dc, 256)
    assert s2.tokens == prompt[:300] and dc2.last_saved(s2) == 256
    close_logits(s2.logits(), cold(prompt[:300])[0])  # 200..256 came from decode steps
    # ... and keeps saving at the next frontier during its own generation.
    for t in prompt[300:320]:
        s2.eval(t)
        res = dc2.after_eval(s2)
        assert (res is None) == (s2.pos != 320)
    assert stored_files(dc2)[320] == "continued"


def got_name(dc: DiskCache, n_tokens: int) -> str:
    return next(e.name for e in dc.store.entries() if e.tokens == n_tokens)


def test_resume_from_generation_checkpoint_is_bit_identical_in_ds4_cpu(tiny_model_path, prompt, tmp_path):
    """ds4-cpu numerics: every chunking (decode steps included) gives the same bits, so a resume
    from a checkpoint written during generation equals a cold prefill of the longer prompt."""
    eng = Engine.open(tiny_model_path, numerics="ds4-cpu")
    dc = DiskCache(eng, tmp_path / "kv", 64, ctx=CTX, options=OPTS)
    s = eng.new_session(ctx=CTX, chunk=CHUNK)
    rep = dc.sync(s, prompt[:120])
    # cold cut (120 - 32) aligned to 32 = 64, itself a continued frontier: written once, as cold.
    assert summary(rep.saved) == [("cold", 64, "stored")]
    results = []
    for t in prompt[120:130]:
        s.eval(t)
        results.append(dc.after_eval(s))
    assert [r.tokens if r else None for r in results] == [None] * 7 + [128, None, None]

    s2 = eng.new_session(ctx=CTX, chunk=CHUNK)
    rep2 = DiskCache(eng, tmp_path / "kv", 64, ctx=CTX, options=OPTS).sync(s2, prompt[:150])
    assert (rep2.source, rep2.cached_tokens) == ("disk-tokens", 128)
    ref = eng.new_session(ctx=CTX, chunk=CHUNK)
    ref.sync(prompt[:150])
    assert same_bits(s2.logits(), ref.logits())
    assert same_state(s2.snapshot().state.to_numpy(), ref.snapshot().state.to_numpy())


def test_unaligned_step_cuts_the_prefill_exactly_on_frontiers(engine, prompt, cold, tmp_path):
    """Alignment off: the step is the raw interval (48), not a multiple of the chunk; the prefill is
    still cut so each continued checkpoint holds exactly a multiple of 48 tokens."""
    opts = KVStoreOptions(min_tokens=32, cold_max_tokens=0, continued_interval_tokens=48,
                          boundary_align_tokens=0)
    dc = DiskCache(engine, tmp_path / "kv", 64, ctx=CTX, options=opts)
    s = engine.new_session(ctx=CTX, chunk=CHUNK)
    rep = dc.sync(s, prompt[:150])
    assert summary(rep.saved) == [("continued", 48, "stored"), ("continued", 96, "stored"),
                                  ("continued", 144, "stored")]
    for n in (48, 96, 144):
        got = loaded(engine, dc, n)
        assert got.tokens == prompt[:n]
        close_logits(got.logits(), cold(prompt[:n])[0])  # chunks [32, 48) etc. differ from cold's


# -- lookup by rendered text -----------------------------------------------------------------------------


def test_text_hit_continues_with_the_checkpoint_tokens(engine, prompt, tmp_path):
    """An entry whose tokens are *not* our tokenization of its text (here: the text tokenized five
    characters at a time) is found by its rendered text; the run continues from the stored tokens
    plus the tokenization of the rest of the text, as ds4 does."""
    tk = engine.tokenizer
    bos = tk.decode(prompt[:1])
    body = tk.decode(prompt[1:300])
    odd = prompt[:1]
    for i in range(0, len(body), 5):
        odd += tk.encode_rendered(body[i:i + 5])
    odd = odd[:128]
    key = tk.decode_bytes(odd).decode("utf-8")  # raises if the cut fell inside a character
    extra = " E poi la vecchia tornò a casa, stanca ma contenta."
    text = key + extra
    ours = tk.encode_rendered(text)
    assert key.startswith(bos) and tk.decode(ours) == text
    assert ours[:128] != odd and tk.encode_rendered(key) != odd  # really another tokenization

    dc = DiskCache(engine, tmp_path / "kv", 64, ctx=CTX, options=OPTS)
    src = engine.new_session(ctx=CTX, chunk=CHUNK)
    src.sync(odd)
    assert dc.save(src, "evict").stored

    s = engine.new_session(ctx=CTX, chunk=CHUNK)
    rep = dc.sync(s, ours)
    effective = odd + tk.encode_rendered(extra)
    assert (rep.source, rep.cached_tokens) == ("disk-text", 128)
    assert rep.effective_prompt == effective and s.tokens == effective
    ref = engine.new_session(ctx=CTX, chunk=CHUNK)
    ref.sync(effective)
    assert same_bits(s.logits(), ref.logits())  # resumed at 128, a chunk boundary, from a prefill
    # The same lookup given the rendered text directly (a server's chat rendering).
    s3 = engine.new_session(ctx=CTX, chunk=CHUNK)
    assert dc.sync(s3, ours, rendered_text=text).effective_prompt == effective


# -- refusals, budget, live and evict ---------------------------------------------------------------------


def test_damaged_files_fall_back_to_the_next_best(engine, prompt, cold, tmp_path):
    """A truncated file is invalid at the directory scan (its trailer is gone) and never offered; a
    flipped payload byte is only caught by the load's checksum: refused, and the next best loads."""
    dc = DiskCache(engine, tmp_path / "kv", 64, ctx=CTX, options=OPTS)
    src = engine.new_session(ctx=CTX, chunk=CHUNK)
    for n in (64, 128, 160):
        src.sync(prompt[:n])
        assert dc.save(src, "continued").stored
    entries = {e.tokens: e for e in dc.store.entries()}
    with open(entries[160].path, "r+b") as fh:
        fh.truncate(entries[160].file_size - 100)
    with open(entries[128].path, "r+b") as fh:
        fh.seek(entries[128].file_size // 2)
        byte = fh.read(1)[0]
        fh.seek(-1, 1)
        fh.write(bytes([byte ^ 0xFF]))

    dc2 = DiskCache(engine, tmp_path / "kv", 64, ctx=CTX, options=OPTS)
    s = engine.new_session(ctx=CTX, chunk=CHUNK)
    rep = dc2.sync(s, prompt[:200])
    assert (rep.source, rep.cached_tokens) == ("disk-tokens", 64)
    assert len(rep.refused) == 1 and rep.refused[0].startswith(str(entries[128].path))
    assert same_bits(s.logits(), cold(prompt[:200])[0])
    # The frontiers after the load (128, 192) are saved; 128 replaces the damaged file; the
    # truncated one stays on disk (the store only evicts it when room is needed).
    assert summary(rep.saved) == [("continued", 128, "stored"), ("continued", 192, "stored")]
    assert stored_files(dc2) == {64: "continued", 128: "continued", 192: "continued"}
    assert entries[160].path.exists()
    assert same_bits(loaded(engine, dc2, 128).logits(), cold(prompt[:128])[0])


def test_refused_payload_falls_back_to_cold_and_keeps_other_entries(engine, prompt, cold, tmp_path):
    """A payload saved by a session with another prefill chunk (64) is refused by our session
    (chunk 32): the file is marked unloadable (and kept), the run goes cold, unrelated entries stay."""
    dc = DiskCache(engine, tmp_path / "kv", 64, ctx=CTX, options=OPTS)
    other = engine.new_session(ctx=CTX, chunk=64)
    other.sync(prompt[:96])
    assert dc.save(other, "cold").stored
    unrelated = engine.new_session(ctx=CTX, chunk=CHUNK)
    unrelated.sync(prompt[:1] + prompt[400:440])
    assert dc.save(unrelated, "cold").stored
    before = {e.name for e in dc.store.entries()}

    s = engine.new_session(ctx=CTX, chunk=CHUNK)
    rep = dc.sync(s, prompt[:200])
    assert (rep.source, rep.cached_tokens, rep.hit_path) == ("none", 0, None)
    assert len(rep.refused) == 1 and "chunk" in rep.refused[0]
    assert summary(rep.saved) == [("continued", 64, "stored"), ("continued", 128, "stored"),
                                  ("cold", 160, "stored"), ("continued", 192, "stored")]
    assert same_bits(s.logits(), cold(prompt[:200])[0])
    assert before <= {e.name for e in dc.store.entries()}
    # Marked: the same store does not offer it again (the next best is the 64-token continued one).
    s2 = engine.new_session(ctx=CTX, chunk=CHUNK)
    rep2 = dc.sync(s2, prompt[:100])
    assert (rep2.source, rep2.cached_tokens, rep2.refused) == ("disk-tokens", 64, [])


def test_budget_is_respected(engine, prompt, tmp_path):
    probe = engine.new_session(ctx=CTX, chunk=CHUNK)
    probe.sync(prompt[:128])
    one = probe.payload_bytes()  # payload of a 128-token checkpoint; files add a few KiB
    budget_mb = 2.5 * one / MIB
    dc = DiskCache(engine, tmp_path / "kv", budget_mb, ctx=CTX, options=OPTS)
    s = engine.new_session(ctx=CTX, chunk=CHUNK)
    rep = dc.sync(s, prompt[:280])
    # cut (280 - 32) aligned down to 32 = 224; frontiers 64, 128, 192 before it, 256 after.
    assert summary(rep.saved) == [("continued", 64, "stored"), ("continued", 128, "stored"),
                                  ("continued", 192, "stored"), ("cold", 224, "stored"),
                                  ("continued", 256, "stored")]
    assert dc.store.total_bytes() <= budget_mb * MIB
    files = stored_files(dc)
    assert len(files) < 5 and files.get(256) == "continued"  # older ones evicted, the newest kept

    tiny = DiskCache(engine, tmp_path / "kv2", 0.5 * one / MIB, ctx=CTX, options=OPTS)
    s2 = engine.new_session(ctx=CTX, chunk=CHUNK)
    rep2 = tiny.sync(s2, prompt[:100])  # cold cut 64 (also the frontier, written once): does not fit
    assert summary(rep2.saved) == [("cold", 64, "skipped")]
    assert tiny.store.entries() == [] and s2.tokens == prompt[:100]


def test_live_extension_and_evict_save(engine, prompt, cold, tmp_path):
    dc = DiskCache(engine, tmp_path / "kv", 64, ctx=CTX, options=OPTS)
    s = engine.new_session(ctx=CTX, chunk=CHUNK)
    rep = dc.sync(s, prompt[:96])  # cut (96 - 32) = 64, also a frontier: one cold write
    assert summary(rep.saved) == [("cold", 64, "stored")]
    rep = dc.sync(s, prompt[:160])  # extends the live state; crosses the frontier 128
    assert (rep.source, rep.cached_tokens) == ("live", 96)
    assert summary(rep.saved) == [("continued", 128, "stored")]
    assert same_bits(s.logits(), cold(prompt[:160])[0])

    # A prompt that does not extend the live tokens: the live session is saved whole ("evict"),
    # then a miss; 61 tokens <= min + trim, so the cold save is the whole prompt.
    other = prompt[:1] + prompt[500:560]
    rep = dc.sync(s, other)
    assert rep.source == "none" and s.tokens == other
    assert summary(rep.saved) == [("evict", 160, "stored"), ("cold", 61, "stored")]
    assert same_bits(s.logits(), cold(other)[0])
    # The evicted conversation comes back from disk (61 is already stored: kept as is).
    rep = dc.sync(s, prompt[:200])
    assert (rep.source, rep.cached_tokens) == ("disk-tokens", 160)
    assert summary(rep.saved) == [("evict", 61, "stored"), ("continued", 192, "stored")]
    assert same_bits(s.logits(), cold(prompt[:200])[0])
    assert stored_files(dc) == {64: "cold", 128: "continued", 160: "evict", 61: "cold", 192: "continued"}


def test_session_snapshots_before_the_disk_only_when_asked(engine, prompt, cold, tmp_path):
    """The session decides what of its own state a target reuses (``Session.plan``). By default the
    disk cache takes only the live prefix from it, then ds4's order (evict, the store, compute);
    ``snapshots=True`` (the server's pool) restores the session's own snapshot before the disk."""
    dc = DiskCache(engine, tmp_path / "kv", 64, ctx=CTX, options=OPTS)
    s = engine.new_session(ctx=CTX, chunk=CHUNK)
    dc.sync(s, prompt[:96])  # stores the cold checkpoint of 64
    s.snapshot(keep=True)  # 96
    s.append(prompt[96:130])
    target = prompt[:100] + prompt[600:620]
    assert s.plan(target).snapshot.pos == 96 and s.plan(target, snapshots=False).source == "cold"
    rep = dc.sync(s, target, snapshots=True)
    assert (rep.source, rep.cached_tokens, summary(rep.saved)) == ("snapshot", 96, [])
    assert s.tokens == target and same_bits(s.logits(), cold(target)[0])
    s.append(prompt[620:630])
    other = prompt[:100] + prompt[650:660]
    rep = dc.sync(s, other)  # the snapshot at 96 is not used: the live state is saved, the disk hit
    assert (rep.source, rep.cached_tokens) == ("disk-tokens", 64)
    assert summary(rep.saved)[0] == ("evict", 130, "stored")
    assert s.tokens == other and same_bits(s.logits(), cold(other)[0])


def test_close_saves_the_whole_live_session(engine, prompt, tmp_path):
    dc = DiskCache(engine, tmp_path / "kv", 64, ctx=CTX, options=OPTS)
    s = engine.new_session(ctx=CTX, chunk=CHUNK)
    dc.sync(s, prompt[:20])  # below min_tokens: nothing saved
    assert dc.close(s) is None and dc.store.entries() == []
    for t in prompt[20:50]:
        s.eval(t)
        assert dc.after_eval(s) is None  # 50 < the first frontier
    res = dc.close(s)
    assert (res.reason, res.tokens, res.status) == ("shutdown", 50, "stored")
    assert stored_files(dc) == {50: "shutdown"}
