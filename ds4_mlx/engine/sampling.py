"""Next-token selection and log-probabilities, matching ds4's sampler (ds4.c sample_top_p_min_p).

The arithmetic is float32 and the sums are sequential, as in ds4, so a given seed draws the same
token ds4 would draw from the same logits (up to expf's last bit). Greedy (temperature <= 0) is the
first index of the maximum, which is what the test vectors use.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import numpy as np

_MASK64 = (1 << 64) - 1
_ZERO_STATE = 0x9E3779B97F4A7C15
TOP_K_CAP = 1024


class XorShiftRng:
    """ds4's xorshift64* generator; a zero state is replaced by the golden-ratio constant."""

    def __init__(self, seed: int | None = None):
        if seed is None or seed == 0:
            # ds4 CLI: time ^ pid<<32 ^ clock when no --seed is given
            seed = (int(time.time()) ^ (os.getpid() << 32) ^ time.perf_counter_ns()) & _MASK64
        self.state = seed & _MASK64

    def next_u64(self) -> int:
        x = self.state or _ZERO_STATE
        x ^= x >> 12
        x = (x ^ (x << 25)) & _MASK64
        x ^= x >> 27
        self.state = x
        return (x * 0x2545F4914F6CDD1D) & _MASK64

    def uniform(self) -> np.float32:
        """24 high bits → float32 in [0, 1)."""
        return np.float32(((self.next_u64() >> 40) & 0xFFFFFF) / 16777216.0)


@dataclass(frozen=True)
class SamplingParams:
    """ds4 defaults: temperature 1, top-p 1, min-p 0.05, top-k off."""

    temperature: float = 1.0
    top_p: float = 1.0
    min_p: float = 0.05
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def argmax(logits: np.ndarray) -> int:
    """First index of the maximum (ds4 uses strict '>' from -1e30; NaN never wins)."""
    x = np.asarray(logits, dtype=np.float32)
    masked = np.where(np.isnan(x), -np.inf, x)
    best = int(np.argmax(masked))
    if not masked[best] > -1e30:
        return 0
    return best


def _draw(probs: np.ndarray, total: np.float32, rng: XorShiftRng) -> int | None:
    """Index i of the first prefix whose sequential float32 subtraction from U·total reaches <= 0."""
    r = np.float32(rng.uniform() * total)
    walk = np.subtract.accumulate(np.concatenate(([r], probs)).astype(np.float32))[1:]
    hit = np.flatnonzero(walk <= 0)
    return int(hit[0]) if hit.size else None


def _filter_sorted(probs: np.ndarray, total: np.float32, top_p: float, min_p: float,
                   complete: bool = True) -> int | None:
    """How many of the descending-sorted candidates survive min-p then top-p (at least one).

    ``complete=False``: ``probs`` is only a prefix of the sorted candidates; then None when neither
    cut falls inside it (the caller sorts a longer prefix). Both cuts read the prefix left to right
    (the first candidate below min-p, the first cumulative sum reaching top-p), so a cut found in a
    prefix is the cut of the whole list.
    """
    rel = probs / total
    min_prob = np.float32(rel[0] * np.float32(min_p))
    below = np.flatnonzero(rel[1:] < min_prob)
    n = int(below[0]) + 1 if below.size else probs.size
    cums = np.add.accumulate(probs[:n], dtype=np.float32)
    reach = np.flatnonzero(cums / total >= np.float32(top_p))
    if reach.size:
        n = min(n, int(reach[0]) + 1)
    elif not below.size and not complete:
        return None
    return max(n, 1)


# The fewest of the largest logits the top-p path sorts first.
SORT_PREFIX = 1024
# Margin on the top-p mass in the guess below (float64 bucket sums vs ds4's float32 running sum).
_MASS_MARGIN = 1.02


def _guess_prefix(probs: np.ndarray, total: np.float32, top_p: float, min_p: float) -> int:
    """How many of the largest candidates probably hold the min-p / top-p cut (a guess only: the
    caller checks it). Min-p keeps about the candidates with probs >= min_p (probs is 1 at the
    maximum); top-p needs the candidates down to the power-of-two bucket of probs where the mass
    of the buckets above reaches top_p of the total (one pass: exponent histogram weighted by
    probs). The cut comes at the first of the two; one more candidate so it falls inside.
    A very flat distribution needs most of the vocabulary: then everything."""
    n = probs.size
    k_min = int(np.count_nonzero(probs >= np.float32(min_p))) + 1 if min_p > 0.0 else n
    if k_min <= SORT_PREFIX:
        return SORT_PREFIX  # the usual peaked case: no need to look at the mass
    # probs in [0, 1] (float32): 127 - the exponent field is 0 for 1.0, 1 for [0.5, 1), ..., 127 for
    # zeros and subnormals
    bucket = 127 - (np.ascontiguousarray(probs, dtype=np.float32).view(np.int32) >> 23)
    mass = np.cumsum(np.bincount(bucket, weights=probs, minlength=128))
    reach = np.flatnonzero(mass >= float(total) * top_p * _MASS_MARGIN)
    k_top = int(np.count_nonzero(bucket <= reach[0])) + 1 if reach.size else n
    k = max(SORT_PREFIX, min(k_min, k_top))
    return n if 2 * k > n else k  # most of the vocabulary: partitioning first would only add cost


def _sorted_prefix(vals: np.ndarray, k: int) -> np.ndarray:
    """Exactly the first m >= min(k, vals.size) indices of ``np.argsort(-vals, kind="stable")``
    (descending, ties in index order), without sorting the rest: everything >= the k-th largest
    value (all its ties included) comes first in that order, and its indices are taken in ascending
    order before a stable sort, so ties keep the full sort's order. ``vals`` holds no NaN."""
    if k >= vals.size:
        return np.argsort(-vals, kind="stable")
    kth = np.partition(vals, vals.size - k)[vals.size - k]
    sel = np.flatnonzero(vals >= kth)
    return sel[np.argsort(-vals[sel], kind="stable")]


def sample(logits: np.ndarray, params: SamplingParams, rng: XorShiftRng) -> int:
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
        order = _sorted_prefix(vals, k)[:k]
        ids, vals = ids[order], vals[order]
        probs = np.exp((vals - vals[0]) / temp).astype(np.float32)
        total = np.add.accumulate(probs, dtype=np.float32)[-1]
        if not (total > 0 and np.isfinite(total)):
            return int(ids[0])
        n = _filter_sorted(probs, total, top_p, min_p)
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
    # ds4 sorts every candidate; only the prefix up to the min-p / top-p cut matters, which is
    # usually a few dozen tokens out of 129280 (a full stable argsort costs ~14 ms a token).
    # Sort a guessed prefix that holds the cut; if the cut lies beyond it, sort everything.
    order = _sorted_prefix(vals, _guess_prefix(probs, total, top_p, min_p))
    n = _filter_sorted(probs[order], total, top_p, min_p, complete=order.size == vals.size)
    if n is None:
        order = _sorted_prefix(vals, vals.size)
        n = _filter_sorted(probs[order], total, top_p, min_p)
    ids, probs = ids[order], probs[order]
    kept_total = np.add.accumulate(probs[:n], dtype=np.float32)[-1]
    hit = _draw(probs[:n], kept_total, rng)
    return int(ids[hit if hit is not None else n - 1])


@dataclass(frozen=True)
class TokenScore:
    id: int
    logit: float
    logprob: float


def log_softmax_denominator(logits: np.ndarray) -> float:
    """max + log Σ exp(l - max) over finite logits, in float64 as ds4 does."""
    x = np.asarray(logits, dtype=np.float32)
    fin = x[np.isfinite(x)]
    if fin.size == 0:
        return math.nan
    m = float(fin.max())
    return m + math.log(float(np.sum(np.exp(fin.astype(np.float64) - m))))


def top_logprobs(logits: np.ndarray, k: int) -> list[TokenScore]:
    """The k best finite logits, descending (ties: lower id first), with float64 log-probabilities."""
    x = np.asarray(logits, dtype=np.float32).reshape(-1)
    if k <= 0:
        return []
    ids = np.flatnonzero(np.isfinite(x))
    if ids.size == 0:
        return []
    # stable: equal logits keep the lower id first, like ds4's insertion top-k
    part = ids[_sorted_prefix(x[ids], k)[:k]]
    logsum = log_softmax_denominator(x)
    return [TokenScore(int(i), float(x[i]), float(np.float32(float(x[i]) - logsum))) for i in part]


def token_logprob(logits: np.ndarray, token: int) -> TokenScore:
    x = np.asarray(logits, dtype=np.float32).reshape(-1)
    return TokenScore(int(token), float(x[token]), float(np.float32(float(x[token]) - log_softmax_denominator(x))))
