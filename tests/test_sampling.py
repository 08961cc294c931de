"""The vectorised sampler against a literal, loop-by-loop restatement of ds4's C sampler."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ds4_mlx.engine.sampling import SamplingParams, XorShiftRng, argmax, sample, top_logprobs, token_logprob

f32 = np.float32


def ref_rng_next(state):
    x = state[0] or 0x9E3779B97F4A7C15
    x ^= x >> 12
    x ^= (x << 25) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 27
    state[0] = x
    return (x * 0x2545F4914F6CDD1D) & 0xFFFFFFFFFFFFFFFF


def ref_uniform(state):
    return f32(((ref_rng_next(state) >> 40) & 0xFFFFFF) / 16777216.0)


def ref_argmax(logits):
    best, best_v = 0, f32(-1e30)
    for i, v in enumerate(logits):
        if v > best_v:
            best, best_v = i, v
    return best


def ref_sample(logits, T, top_k, top_p, min_p, state):
    """Statement by statement from ds4.c sample_top_p_min_p / sample_full_vocab (float32 throughout)."""
    T = f32(T)
    if T <= 0:
        return ref_argmax(logits)
    if top_p <= 0 or top_p > 1:
        top_p = 1.0
    if min_p < 0:
        min_p = 0.0
    top_p, min_p = f32(top_p), f32(min_p)
    if top_k <= 0:
        mx, best, finite = f32(-1e30), 0, 0
        for i, v in enumerate(logits):
            if not math.isfinite(v):
                continue
            finite += 1
            if v > mx:
                mx, best = v, i
        if finite == 0:
            return ref_argmax(logits)
        if top_p >= 1:
            total = f32(0)
            for v in logits:
                if not math.isfinite(v):
                    continue
                p = np.exp(f32((v - mx) / T))
                if p < min_p:
                    continue
                total = f32(total + p)
            if total <= 0:
                return best
            r = f32(ref_uniform(state) * total)
            for i, v in enumerate(logits):
                if not math.isfinite(v):
                    continue
                p = np.exp(f32((v - mx) / T))
                if p < min_p:
                    continue
                r = f32(r - p)
                if r <= 0:
                    return i
            return best
        cand, total = [], f32(0)
        for i, v in enumerate(logits):
            if not math.isfinite(v):
                continue
            p = np.exp(f32((v - mx) / T))
            cand.append((i, v, p))
            total = f32(total + p)
        cand.sort(key=lambda c: -c[1])  # stable, like glibc's merge sort
        ids = [c[0] for c in cand]
        probs = [c[2] for c in cand]
    else:
        order = sorted((i for i, v in enumerate(logits) if math.isfinite(v)), key=lambda i: -logits[i])
        ids = order[: min(top_k, 1024)]
        if not ids:
            return ref_argmax(logits)
        mx = logits[ids[0]]
        probs = [np.exp(f32((logits[i] - mx) / T)) for i in ids]
        total = f32(0)
        for p in probs:
            total = f32(total + p)
    min_prob = f32(f32(probs[0] / total) * min_p)
    fsum, n = f32(0), 0
    for i, p in enumerate(probs):
        if i > 0 and f32(p / total) < min_prob:
            break
        fsum = f32(fsum + p)
        n += 1
        if f32(fsum / total) >= top_p:
            break
    r = f32(ref_uniform(state) * fsum)
    for i in range(n):
        r = f32(r - probs[i])
        if r <= 0:
            return ids[i]
    return ids[n - 1]


def test_rng_matches_reference_sequence():
    rng, state = XorShiftRng(12345), [12345]
    for _ in range(1000):
        assert rng.next_u64() == ref_rng_next(state)
    zero = XorShiftRng(0)
    zero.state = 0
    assert zero.next_u64() == ref_rng_next([0])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(1.0, 1.0, 0.05, 0),
        SamplingParams(0.7, 1.0, 0.0, 0),
        SamplingParams(1.3, 0.9, 0.05, 0),
        SamplingParams(1.0, 0.5, 0.1, 0),
        SamplingParams(0.8, 1.0, 0.05, 40),
        SamplingParams(1.0, 0.8, 0.0, 7),
        SamplingParams(1.0, 1.7, -1.0, 0),  # out-of-range knobs are clamped as ds4 does
    ],
)
def test_sample_equals_literal_ds4_restatement(params):
    gen = np.random.default_rng(7)
    for trial in range(25):
        logits = (gen.standard_normal(300) * 2).astype(np.float32)
        if trial % 5 == 0:
            logits[gen.integers(0, 300, 10)] = -np.inf
        if trial % 7 == 0:
            logits[:20] = logits[20]  # ties
        seed = 1000 + trial
        rng = XorShiftRng(seed)
        state = [seed]
        for _ in range(5):
            got = sample(logits, params, rng)
            want = ref_sample(list(logits), params.temperature, params.top_k, params.top_p, params.min_p, state)
            assert got == want
            assert rng.state == state[0]


def test_greedy_is_first_maximum():
    x = np.array([1.0, 3.0, 3.0, -np.inf, np.nan], dtype=np.float32)
    assert argmax(x) == 1
    assert sample(x, SamplingParams(temperature=0.0), XorShiftRng(1)) == 1


def test_min_p_concentrates_on_dominant_token():
    x = np.full(1000, -10.0, dtype=np.float32)
    x[123] = 10.0
    rng = XorShiftRng(99)
    assert {sample(x, SamplingParams(), rng) for _ in range(50)} == {123}


def test_top_logprobs_matches_float64_softmax():
    gen = np.random.default_rng(3)
    x = gen.standard_normal(5000).astype(np.float32)
    x[10] = x[11] = x.max() + 1  # tie: lower id first
    top = top_logprobs(x, 20)
    assert [t.id for t in top[:2]] == [10, 11]
    want = x.astype(np.float64) - np.log(np.sum(np.exp(x.astype(np.float64))))
    order = np.argsort(-x, kind="stable")[:20]
    assert [t.id for t in top] == order.tolist()
    for t in top:
        assert t.logprob == pytest.approx(want[t.id], abs=1e-6)
    assert token_logprob(x, 7).logprob == pytest.approx(want[7], abs=1e-6)


# --- the partial sort: the same draws as the full stable argsort it replaced -------------------------


def full_sort_sample(logits, params, rng):
    """``sample`` as it was with a full stable argsort of the vocabulary (the oracle of the prefix sort).
    A frozen copy on purpose, ``filter_sorted`` included: an oracle built from the package's current
    pieces would change along with them and could no longer catch a change in the draws."""
    from ds4_mlx.engine.sampling import TOP_K_CAP, _draw

    def filter_sorted(probs, total, top_p, min_p):
        rel = probs / total
        min_prob = np.float32(rel[0] * np.float32(min_p))
        below = np.flatnonzero(rel[1:] < min_prob)
        n = int(below[0]) + 1 if below.size else probs.size
        cums = np.add.accumulate(probs[:n], dtype=np.float32)
        reach = np.flatnonzero(cums / total >= np.float32(top_p))
        if reach.size:
            n = min(n, int(reach[0]) + 1)
        return max(n, 1)

    x = np.asarray(logits, dtype=np.float32).reshape(-1)
    T = float(params.temperature)
    if T <= 0.0:
        return argmax(x)
    top_p = float(params.top_p)
    if top_p <= 0.0 or top_p > 1.0:
        top_p = 1.0
    min_p = max(float(params.min_p), 0.0)
    temp = np.float32(T)
    finite = np.isfinite(x)
    if not finite.any():
        return argmax(x)
    ids = np.flatnonzero(finite)
    vals = x[ids]
    if params.top_k > 0:
        k = min(int(params.top_k), TOP_K_CAP, vals.size)
        order = np.argsort(-vals, kind="stable")[:k]
        ids, vals = ids[order], vals[order]
        probs = np.exp((vals - vals[0]) / temp).astype(np.float32)
        total = np.add.accumulate(probs, dtype=np.float32)[-1]
        if not (total > 0 and np.isfinite(total)):
            return int(ids[0])
        n = filter_sorted(probs, total, top_p, min_p)
        hit = _draw(probs[:n], np.add.accumulate(probs[:n], dtype=np.float32)[-1], rng)
        return int(ids[hit if hit is not None else n - 1])
    best = int(ids[np.argmax(vals)])
    probs = np.exp((vals - x[best]) / temp).astype(np.float32)
    if top_p >= 1.0:
        keep = probs >= np.float32(min_p)
        ids, probs = ids[keep], probs[keep]
        total = np.add.accumulate(probs, dtype=np.float32)[-1] if probs.size else np.float32(0)
        if not (total > 0 and np.isfinite(total)):
            return best
        hit = _draw(probs, total, rng)
        return int(ids[hit]) if hit is not None else best
    total = np.add.accumulate(probs, dtype=np.float32)[-1]
    if not (total > 0 and np.isfinite(total)):
        return best
    order = np.argsort(-vals, kind="stable")
    ids, probs = ids[order], probs[order]
    n = filter_sorted(probs, total, top_p, min_p)
    kept_total = np.add.accumulate(probs[:n], dtype=np.float32)[-1]
    hit = _draw(probs[:n], kept_total, rng)
    return int(ids[hit if hit is not None else n - 1])


def _hostile_logits(gen, n):
    """Logit vectors built to break a partial sort: ties at every cut, -inf/+inf/NaN, flat rows."""
    base = (gen.standard_normal(n) * 3).astype(np.float32)
    out = {"normal": base, "all_equal": np.full(n, 0.5, np.float32),
           "coarse_ties": np.round(base).astype(np.float32),  # ~15 distinct values: ties everywhere
           "flat_tail": np.where(np.arange(n) % 97 == 0, base, np.float32(-2.0)).astype(np.float32),
           "peaked": np.where(np.arange(n) == n // 3, np.float32(40.0), base).astype(np.float32),
           "signed_zeros": np.where(np.arange(n) % 2 == 0, np.float32(0.0), np.float32(-0.0)).astype(np.float32)}
    holes = base.copy()
    holes[gen.integers(0, n, n // 10)] = -np.inf
    holes[gen.integers(0, n, 5)] = np.nan
    out["inf_nan"] = holes
    plus = base.copy()
    plus[[7, 11]] = np.inf
    out["plus_inf"] = plus  # +inf is not finite: dropped like -inf
    out["nearly_flat"] = (np.float32(1.0) + gen.integers(0, 3, n).astype(np.float32) * np.float32(1e-7))
    return out


@pytest.mark.parametrize("prefix,margin", [(1, 1.02), (3, 0.0), (16, 0.3), (1024, 1.02)])
def test_prefix_sort_draws_like_full_sort(monkeypatch, prefix, margin):
    import ds4_mlx.engine.sampling as sampling

    # small prefixes and margins: guesses that miss the cut, so the fallback to the full sort runs too
    monkeypatch.setattr(sampling, "SORT_PREFIX", prefix)
    monkeypatch.setattr(sampling, "_MASS_MARGIN", margin)
    gen = np.random.default_rng(prefix)
    n = 5000
    # top-p 0.99: with the 1.02 margin the histogram's mass never reaches the target (k_top = all)
    grid = [SamplingParams(t, p, m, k) for t in (1.0, 0.05, 7.0) for p in (0.95, 0.99, 0.5, 1e-6, 1.0)
            for m in (0.05, 0.0, 1.0, 2.0) for k in (0, 1, 40, n, 10 * n)]
    for name, logits in _hostile_logits(gen, n).items():
        for i, params in enumerate(grid):
            seed = 77 + i
            rng_a, rng_b = XorShiftRng(seed), XorShiftRng(seed)
            for _ in range(3):
                got, want = sample(logits, params, rng_a), full_sort_sample(logits, params, rng_b)
                assert got == want, (name, params)
                assert rng_a.state == rng_b.state


def test_top_logprobs_prefix_equals_full_sort():
    gen = np.random.default_rng(3)
    x = np.round(gen.standard_normal(3000) * 2).astype(np.float32)  # many ties
    x[gen.integers(0, 3000, 50)] = -np.inf
    for k in (1, 5, 20, 2999, 5000):
        ids = np.flatnonzero(np.isfinite(x))
        want = ids[np.argsort(-x[ids], kind="stable")[:k]]
        assert [s.id for s in top_logprobs(x, k)] == [int(i) for i in want]
