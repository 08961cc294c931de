"""Engine session: sync / rewind / snapshots / payloads on the oracle's tiny model.

Every reference is a session computed independently (a cold prefill, or a session that never
stopped); "bit-identical" claims compare the float32 bit patterns.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

import ds4_mlx
from ds4_mlx.engine.payload import PayloadError
from ds4_mlx.engine.sampling import SamplingParams, XorShiftRng, argmax, sample, top_logprobs
from ds4_mlx.engine.session import RESUME_PREFILL_MIN, RebuildNeeded, Session
from ds4_mlx.errors import InferenceError


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return ds4_mlx.load(tiny_model_path).network


@pytest.fixture(scope="module")
def prompt(oracle_dir) -> list[int]:
    doc = json.loads((oracle_dir / "golden" / "dev_long.json").read_text())
    return doc["prompt_tokens"]  # 733 ds4 token ids (BOS + Italian prose)


@pytest.fixture(scope="module")
def cold(model, prompt):
    """Cold prefills with the 64-token chunk, memoised by length (the reference for sync)."""
    cache: dict[tuple, Session] = {}

    def get(tokens: list[int]) -> Session:
        key = tuple(tokens)
        if key not in cache:
            s = Session(model, 1024, chunk=64)
            s.sync(tokens)
            cache[key] = s
        return cache[key]

    return get


def bits(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32)).view(np.uint32)


def same_bits(a, b) -> bool:
    return bits(a).shape == bits(b).shape and bool(np.array_equal(bits(a), bits(b)))


def same_state(s1: Session, s2: Session) -> bool:
    a, b = s1.snapshot().state.to_numpy(), s2.snapshot().state.to_numpy()
    return a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a if k != "n_tokens")


# -- restoring a snapshot or a payload continues exactly ------------------------------------------------


@pytest.mark.parametrize("k", [127, 128, 129, 132, 134])
def test_restore_continues_like_never_stopped(model, prompt, k):
    """Prefix ends inside / on the ratio-128 window boundary (127, 128, 129) and on / inside a
    ratio-4 window (132, 134); the continuation is a 12-token chunk then one decode step, so the
    first ratio-128 row (tokens 0..127) is emitted after the restore for k = 127."""
    ref = Session(model, 1024)
    ref.sync(prompt[:k])
    snap = ref.snapshot()
    blob = io.BytesIO()
    ref.save_payload(blob)
    ref.append(prompt[k:k + 12])
    want1 = ref.logits()
    ref.eval(prompt[k + 12])
    want2 = ref.logits()

    other = Session(model, 2048)  # another session, elsewhere first
    other.sync(prompt[400:430])
    other.restore(snap)
    assert other.pos == k and other.tokens == prompt[:k]
    other.append(prompt[k:k + 12])
    assert same_bits(other.logits(), want1)
    other.eval(prompt[k + 12])
    assert same_bits(other.logits(), want2)

    loaded = Session(model, 2048)  # payload saved at ctx 1024 loads into ctx 2048
    assert loaded.load_payload(blob.getvalue()) == k
    assert loaded.tokens == prompt[:k]
    assert same_bits(loaded.logits(), snap.logits)
    assert all(same_bits(v, snap.state.to_numpy()[key]) for key, v in loaded.snapshot().state.to_numpy().items()
               if key != "n_tokens")
    loaded.append(prompt[k:k + 12])
    assert same_bits(loaded.logits(), want1)
    loaded.eval(prompt[k + 12])
    assert same_bits(loaded.logits(), want2)


def test_payload_file_round_trip(model, prompt, tmp_path):
    s = Session(model, 512)
    s.sync(prompt[:140])
    path = tmp_path / "s.payload"
    with open(path, "wb") as fh:
        written = s.save_payload(fh)
    assert written == path.stat().st_size == s.payload_bytes()
    t = Session(model, 512)
    assert t.load_payload_file(path) == 140
    assert same_state(s, t) and same_bits(s.logits(), t.logits())


# -- sync against a cold prefill -----------------------------------------------------------------------


def test_sync_extends_aligned_prefix_bit_identical_to_cold(model, prompt, cold):
    s = Session(model, 1024, chunk=64)
    assert s.sync(prompt[:128]).source == "cold"
    st = s.sync(prompt[:300])
    assert (st.reused, st.computed, st.source, st.path) == (128, 172, "live", "prefill")
    ref = cold(prompt[:300])
    assert same_bits(s.logits(), ref.logits()) and same_state(s, ref)
    # prefill reached the chunk boundaries 64..256; the last two are kept for restores
    assert s.checkpoints() == [192, 256]


def test_sync_extends_unaligned_prefix_close_to_cold(model, prompt, cold):
    """Resuming at 100 runs the chunk [100, 128) where a cold prefill runs [64, 128): the default
    numerics' matmuls round differently for other row counts, so the result is equal only up to
    rounding. Bound: the oracle README's band for ds4 against itself on short prompts (logit rms
    <= 0.06; a real error gives rms ~ 1), argmax equal."""
    s = Session(model, 1024, chunk=64)
    s.sync(prompt[:100])
    st = s.sync(prompt[:300])
    assert (st.reused, st.computed) == (100, 200)
    got, want = s.logits(), cold(prompt[:300]).logits()
    rms = float(np.sqrt(np.mean((got.astype(np.float64) - want) ** 2)))
    assert rms <= 0.06, rms
    assert argmax(got) == argmax(want)


def test_sync_diverging_restores_checkpoint_bit_identical_to_cold(model, prompt, cold):
    s = Session(model, 1024, chunk=64)
    s.sync(prompt[:300])
    target = prompt[:200] + prompt[500:560]
    st = s.sync(target)
    assert (st.source, st.reused, st.computed) == ("snapshot", 192, 68)
    assert s.tokens == target
    ref = cold(target)
    assert same_bits(s.logits(), ref.logits()) and same_state(s, ref)


def test_sync_diverging_before_any_checkpoint_rebuilds(model, prompt, cold):
    s = Session(model, 1024, chunk=64)
    s.sync(prompt[:300])
    before = (s.tokens, s.logits())
    target = prompt[:100] + prompt[600:640]
    with pytest.raises(RebuildNeeded):
        s.sync(target, allow_rebuild=False)
    assert s.tokens == before[0] and same_bits(s.logits(), before[1])  # untouched
    st = s.sync(target)
    assert (st.source, st.reused, st.computed) == ("cold", 0, 140)
    assert same_bits(s.logits(), cold(target).logits())


def test_plan_is_what_sync_does_and_changes_nothing(model, prompt):
    """``plan`` is the one reuse decision: it touches nothing, and ``sync`` then does exactly it
    (live extension, a snapshot, a rebuild; without snapshots only the live state or token 0)."""
    s = Session(model, 1024, chunk=64)
    s.sync(prompt[:300])
    s.snapshot(keep=True)
    s.append(prompt[300:310])
    # automatic checkpoints at 192 and 256 (the last two chunk ends), kept: 300
    cases = [(prompt[:200] + prompt[500:520], ("snapshot", 192, 28, 192, False)),
             (prompt[:330], ("live", 310, 20, None, False)),
             (prompt[:305] + prompt[600:610], ("snapshot", 300, 15, 300, False)),
             (prompt[:50] + prompt[600:610], ("cold", 0, 60, None, True))]
    for target, want in cases:
        live, logits = s.tokens, s.logits()
        p = s.plan(target)
        assert (p.source, p.reused, p.computed, p.snapshot and p.snapshot.pos, p.rebuild) == want
        assert s.tokens == live and same_bits(s.logits(), logits)
        if p.source == "snapshot":
            assert s.plan(target, snapshots=False).source == "cold"
        st = s.sync(target)
        assert (st.source, st.reused, st.computed) == (p.source, p.reused, p.computed)
        assert s.tokens == target
        s.sync(prompt[:310])


def test_defaults_follow_the_load_not_the_environment_later(tiny_model_path, model, monkeypatch):
    """``DS4_MLX_RESUME_PREFILL_MIN`` and ``DS4_MLX_COMPILE`` are read once, at load (``LoadPlan``):
    a session takes the load's values (explicit arguments win), not the variables' values now."""
    from ds4_mlx.errors import LayoutError
    from ds4_mlx.model import load_plan

    assert model.load_plan.resume_prefill_min == RESUME_PREFILL_MIN == 2
    monkeypatch.setenv("DS4_MLX_RESUME_PREFILL_MIN", "5")
    monkeypatch.setenv("DS4_MLX_COMPILE", "0")
    s = Session(model, 64)
    assert (s.resume_prefill_min, s.compiled) == (2, True)
    later = ds4_mlx.load(tiny_model_path).network
    assert (later.load_plan.resume_prefill_min, later.load_plan.compile) == (5, False)
    s = Session(later, 64)
    assert (s.resume_prefill_min, s.compiled) == (5, False)
    s = Session(later, 64, resume_prefill_min=3, compile=True)
    assert (s.resume_prefill_min, s.compiled) == (3, True)
    for bad, why in (("two", "is not an integer"), ("0", "must be >= 1")):
        monkeypatch.setenv("DS4_MLX_RESUME_PREFILL_MIN", bad)
        with pytest.raises(LayoutError, match=f"DS4_MLX_RESUME_PREFILL_MIN='{bad}' {why}"):
            load_plan.resolve(detect=lambda: "cpu")


def test_sync_to_shorter_prefix_uses_checkpoint(model, prompt, cold):
    s = Session(model, 1024, chunk=64)
    s.sync(prompt[:300])
    st = s.sync(prompt[:256])  # exactly a checkpoint: nothing computed
    assert (st.source, st.reused, st.computed, st.path) == ("snapshot", 256, 0, "none")
    assert same_bits(s.logits(), cold(prompt[:256]).logits())


def test_rewind_restores_kept_snapshot(model, prompt):
    s = Session(model, 1024, chunk=64)
    s.sync(prompt[:150])
    kept = s.snapshot(keep=True)
    s.sync(prompt[:300])
    # the same path without stopping: state after 150, then 20 more tokens in one chunk
    ref = Session(model, 1024, chunk=64)
    ref.sync(prompt[:150])
    ref.sync(prompt[:170])
    st = s.rewind(170)
    assert (st.source, st.reused, st.computed) == ("snapshot", 150, 20)
    assert s.pos == 170 and s.tokens == prompt[:170]
    assert same_bits(s.logits(), ref.logits()) and same_state(s, ref)
    st = s.rewind(150)
    assert (st.source, st.computed) == ("snapshot", 0)
    assert same_bits(s.logits(), kept.logits)
    assert s.rewind(150).path == "none"
    s.rewind(0)
    assert s.pos == 0 and s.tokens == []
    with pytest.raises(InferenceError):
        s.logits()
    with pytest.raises(InferenceError):
        s.rewind(1)


def test_decode_below_crossover(model, prompt):
    assert RESUME_PREFILL_MIN == 2
    s = Session(model, 1024, resume_prefill_min=4)
    s.sync(prompt[:130])
    base = s.snapshot()
    st = s.sync(prompt[:133])
    assert (st.path, st.computed) == ("decode", 3)
    ref = Session(model, 1024)
    ref.restore(base)
    for t in prompt[130:133]:
        ref.eval(t)
    assert same_bits(s.logits(), ref.logits())
    assert s.sync(prompt[:140]).path == "prefill"
    d = Session(model, 1024)
    d.restore(base)
    assert d.sync(prompt[:131]).path == "decode"
    assert d.sync(prompt[:133]).path == "prefill"


def test_next_token_helpers_and_errors(model, prompt):
    s = Session(model, 64)
    s.sync(prompt[:20])
    lg = s.logits()
    assert s.argmax() == argmax(lg)
    assert s.top_logprobs(5) == top_logprobs(lg, 5)
    p = SamplingParams(temperature=0.8, top_p=0.9)
    assert s.sample(p, XorShiftRng(7)) == sample(lg, p, XorShiftRng(7))
    assert s.common_prefix(prompt[:10] + [1, 2]) == 10
    with pytest.raises(InferenceError):
        s.sync([])
    with pytest.raises(InferenceError, match="does not fit ctx"):
        s.sync(prompt[:64])
    with pytest.raises(InferenceError, match="outside the vocabulary"):
        s.sync(prompt[:5] + [model.config.n_vocab])
    with pytest.raises(InferenceError, match="context overflow"):
        s.append(prompt[20:70])
    big = Session(model, 1024)
    big.sync(prompt[:70])
    with pytest.raises(InferenceError, match="does not fit ctx"):
        s.restore(big.snapshot())
    blob = io.BytesIO()
    big.save_payload(blob)
    with pytest.raises(PayloadError, match="ctx 1024"):
        s.load_payload(blob.getvalue())
    assert s.tokens == prompt[:20] and same_bits(s.logits(), lg)  # a refused load changes nothing
    with pytest.raises(PayloadError, match="no tokens"):
        Session(model, 64).payload_bytes()


@pytest.mark.slow
def test_ds4_cpu_numerics_any_resume_point_bit_identical(tiny_model_path, prompt):
    """In the ds4-cpu numerics every row is computed on its own, so chunking never shows."""
    m = ds4_mlx.load(tiny_model_path, numerics="ds4-cpu").network
    a = Session(m, 512, chunk=64)
    a.sync(prompt[:45])
    a.sync(prompt[:150])
    b = Session(m, 512, chunk=64)
    b.sync(prompt[:150])
    assert same_bits(a.logits(), b.logits()) and same_state(a, b)


def test_prefill_of_0_1_still_works_with_a_deprecation_warning(model, prompt):
    """0.1's ``Session.prefill(tokens)`` went away without a word; it is back for one release as
    ``append`` with a DeprecationWarning naming the replacement (CHANGELOG.md)."""
    old, new = Session(model, 256, chunk=64), Session(model, 256, chunk=64)
    with pytest.warns(DeprecationWarning, match=r"Session\.append"):
        stats = old.prefill(prompt[:40])
    new.append(prompt[:40])
    assert stats.computed == 40 and old.tokens == new.tokens == prompt[:40]
    assert same_bits(old.logits(), new.logits())
