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
