"""The chunked compressor against a token-by-token reference written from spec §6.3, and the
canonical frontier state it must leave behind, as prefill chunks and as fixed-shape decode steps;
plus ModelCache serialisation."""

from __future__ import annotations

import copy

import ds4_mlx  # noqa: F401  (BLAS binding before mlx)
import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.formats.config import ModelConfig
from ds4_mlx.formats.ggml_types import GGMLType
from ds4_mlx.model.compressor import Compressor
from ds4_mlx.model.linear import DenseWeight
from ds4_mlx.model.ops import DEFAULT_OPS, Numerics, ops_for
from ds4_mlx.model.numerics import EMPTY_SCORE, f16_round, fp8_kv_round, indexer_qat
from ds4_mlx.model.rope import Rope, apply_rope
from ds4_mlx.errors import InferenceError
from ds4_mlx.model.cache import ChunkAt, CompressorLane, ModelCache, StepAt, capacity_for, state_layout

N_EMBD = 48


def _cfg() -> ModelConfig:
    return ModelConfig(n_layer=4, n_embd=N_EMBD, n_vocab=10, n_head=2, n_head_kv=1, head_dim=256, value_dim=256,
                       n_rot=64, q_lora_rank=32, o_lora_rank=16, n_out_group=2, n_expert=4, n_expert_used=2,
                       n_expert_shared=1, n_ff_exp=32, n_hash_layer=1, n_swa=8, n_indexer_head=2,
                       indexer_head_dim=128, indexer_top_k=4, n_hc=4, hc_sinkhorn_iter=20,
                       compress_ratios=(0, 0, 4, 128), swiglu_clamp=(10.0,) * 4)


def _make(ratio: int, dim: int, seed: int) -> Compressor:
    rng = np.random.default_rng(seed)
    cfg = _cfg()
    coff = 2 if ratio == 4 else 1
    w = lambda: DenseWeight("w", GGMLType.F32, (rng.standard_normal((coff * dim, N_EMBD)) * 0.3).astype(np.float32),
                            N_EMBD)
    ape = mx.array(rng.standard_normal((ratio, coff * dim)).astype(np.float32))
    norm = mx.array(rng.uniform(0.5, 1.5, dim).astype(np.float32))
    n_nope = cfg.n_nope if dim == cfg.head_dim else None
    return Compressor(w(), w(), ape, norm, ratio, dim, Rope(cfg, 2 if ratio == 4 else 3), n_nope, cfg.rms_eps,
                      coff, DEFAULT_OPS)


def _reference_stream(comp: Compressor, xs: np.ndarray) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Spec §6.3 literally: per token write its slot, emit on window end, shift the ratio-4 state.

    Pooling in float64; the emitted row then goes through the model's own norm/RoPE/rounding
    helpers (tested separately), so a difference here is a pooling / window / state bug.
    """
    R, D = comp.ratio, comp.dim
    coff = 2 if R == 4 else 1
    kst = np.zeros((coff * R, coff * D))
    gst = np.full((coff * R, coff * D), EMPTY_SCORE)
    k_all = np.array(comp.kv(mx.array(xs)), dtype=np.float64)
    g_all = np.array(comp.gate(mx.array(xs)), dtype=np.float64)
    ape = np.array(comp.ape, dtype=np.float64)
    rows = []
    for p in range(xs.shape[0]):
        row = R + p % R if R == 4 else p % R
        kst[row], gst[row] = k_all[p], g_all[p] + ape[p % R]
        if (p + 1) % R:
            continue
        if R == 4:
            k = np.concatenate([kst[0:4, :D], kst[4:8, D:]])
            g = np.concatenate([gst[0:4, :D], gst[4:8, D:]])
        else:
            k, g = kst, gst
        w = np.exp(g - g.max(axis=0))
        pooled = (w * k).sum(0) / w.sum(0)
        c = pooled / np.sqrt(np.mean(pooled ** 2) + 1e-6) * np.array(comp.norm, dtype=np.float64)
        cos, sin = comp.rope.tables(np.array([p + 1 - R]))
        c = apply_rope(mx.array(c[None].astype(np.float32)), cos, sin)
        c = fp8_kv_round(c, comp.n_nope) if comp.n_nope is not None else indexer_qat(c)
        rows.append(np.array(f16_round(c))[0])
        if R == 4:
            kst[0:4], gst[0:4] = kst[4:8].copy(), gst[4:8].copy()
    return rows, kst, gst


def _canonical(kst: np.ndarray, gst: np.ndarray, n: int, R: int) -> tuple[np.ndarray, np.ndarray]:
    """Clear the rows a streaming run leaves stale (spec §6.3 canonical frontier)."""
    kst, gst = kst.copy(), gst.copy()
    r = n % R
    lo, hi = (4 + r, 8) if R == 4 else (r, R)
    kst[lo:hi], gst[lo:hi] = 0.0, EMPTY_SCORE
    return kst, gst


class _Lane:
    """A lane's canonical state: rows (valid ones only), kst, gst."""

    def __init__(self, rows, kst, gst):
        self.rows, self.kst, self.gst = rows, kst, gst


def _run_chunks(comp: Compressor, xs: np.ndarray, cuts: list[int], mode: Numerics) -> _Lane:
    n = xs.shape[0]
    lane = CompressorLane.empty(comp.ratio, comp.dim, comp.coff, capacity_for(n))
    comp = copy.copy(comp)
    comp.ops = ops_for(mode)  # the same weights in the other numerics
    p = 0
    for c in cuts + [n]:
        if c > p:
            lane.at = ChunkAt(p, c - p, comp.ops)
            comp(mx.array(xs[p:c]), lane)
            p = c
    return _Lane(*lane.state(n))


def _run_steps(comp: Compressor, xs: np.ndarray) -> _Lane:
    """Token by token through the fixed-shape step (what the compiled decode runs), uncompiled."""
    n, R = xs.shape[0], comp.ratio
    lane = CompressorLane.empty(R, comp.dim, comp.coff, capacity_for(n))
    for p in range(n):
        c, s = comp.rope.tables(np.array([p - p % R]))
        lane.at = StepAt(mx.array(p, dtype=mx.int32), None, None, c, s, closes=p % R == R - 1)
        comp(mx.array(xs[p:p + 1]), lane)
    assert lane.rows.shape[0] == capacity_for(n) // R  # fixed shapes: the buffer never changes size
    return _Lane(*lane.state(n))


@pytest.mark.parametrize("ratio,dim", [(4, 256), (4, 128), (128, 256)])
def test_compressor_matches_streaming_reference(ratio, dim):
    comp = _make(ratio, dim, seed=ratio + dim)
    n = 3 * ratio + ratio // 2 + 1 if ratio == 128 else 23
    xs = np.random.default_rng(5).standard_normal((n, N_EMBD)).astype(np.float32)
    ref_rows, ref_k, ref_g = _reference_stream(comp, xs)
    for mode in Numerics:
        for cuts in ([], [1, 2, 3, 9], list(range(1, n)), [ratio - 1, ratio + 1]):
            st = _run_chunks(comp, xs, cuts, mode)
            rows = np.array(st.rows)
            assert rows.shape == (n // ratio, dim)
            # Rows are FP8/FP4-rounded: a float64-vs-float32 difference in the pooled value may move an
            # element by one quantum on a near-tie; everything else must agree to float32 precision.
            ref = np.stack(ref_rows)
            close = np.isclose(rows, ref, rtol=1e-5, atol=1e-6)
            assert close.mean() > 0.995, f"{mode} cuts={cuts}: {np.count_nonzero(~close)} elements differ"
            kc, gc = _canonical(ref_k, ref_g, n, ratio)
            np.testing.assert_allclose(np.array(st.kst), kc, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(np.array(st.gst), gc, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("ratio,dim", [(4, 256), (128, 256)])
def test_compressor_chunking_is_exact_in_ds4_mode(ratio, dim):
    """Every chunking runs the same per-window arithmetic, so DS4_CPU results are bit-identical."""
    comp = _make(ratio, dim, seed=7)
    n = 2 * ratio + 3 if ratio == 128 else 37
    xs = np.random.default_rng(9).standard_normal((n, N_EMBD)).astype(np.float32)
    base = _run_chunks(comp, xs, [], Numerics.DS4_CPU)
    for cuts in (list(range(1, n)), [5, 6, 17], [ratio, ratio + 2]):
        st = _run_chunks(comp, xs, cuts, Numerics.DS4_CPU)
        for a, b in ((st.rows, base.rows), (st.kst, base.kst), (st.gst, base.gst)):
            np.testing.assert_array_equal(np.array(a), np.array(b))


def test_ratio4_first_window_has_no_previous_half():
    """Window 0's previous-window slots are empty: changing nothing but the first-half projection
    of tokens 0..3 leaves row 0 unchanged, and it does change row 1 (which pools them)."""
    comp = _make(4, 256, seed=3)
    xs = np.random.default_rng(2).standard_normal((8, N_EMBD)).astype(np.float32)
    st = _run_chunks(comp, xs, [], Numerics.DEFAULT)
    w = np.array(comp.kv.dense())
    w2 = w.copy()
    w2[:256] *= -1.5  # first-half columns (previous-window lane)
    comp2 = Compressor(DenseWeight("w", GGMLType.F32, w2, N_EMBD), comp.gate, comp.ape, comp.norm, 4, 256,
                       comp.rope, comp.n_nope, comp.eps, comp.coff, DEFAULT_OPS)
    st2 = _run_chunks(comp2, xs, [], Numerics.DEFAULT)
    np.testing.assert_array_equal(np.array(st.rows)[0], np.array(st2.rows)[0])
    assert not np.array_equal(np.array(st.rows)[1], np.array(st2.rows)[1])


@pytest.mark.parametrize("ratio,dim", [(4, 256), (4, 128), (128, 256)])
def test_compressor_steps_match_streaming_reference(ratio, dim):
    """The decode step's path through the same ``Compressor.__call__``: open-window rows written
    every step, the frontier left canonical."""
    comp = _make(ratio, dim, seed=ratio + dim)
    n = ratio + ratio // 2 + 1 if ratio == 128 else 23
    xs = np.random.default_rng(5).standard_normal((n, N_EMBD)).astype(np.float32)
    ref_rows, ref_k, ref_g = _reference_stream(comp, xs)
    st = _run_steps(comp, xs)
    rows = np.array(st.rows)
    assert rows.shape == (n // ratio, dim)
    close = np.isclose(rows, np.stack(ref_rows), rtol=1e-5, atol=1e-6)
    assert close.mean() > 0.995, f"{np.count_nonzero(~close)} elements differ"
    kc, gc = _canonical(ref_k, ref_g, n, ratio)
    np.testing.assert_allclose(np.array(st.kst), kc, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.array(st.gst), gc, rtol=1e-6, atol=1e-5)


def _random_state(cfg: ModelConfig, n: int, seed: int) -> list[mx.array]:
    rng = np.random.default_rng(seed)
    return [mx.array(rng.standard_normal(spec.shape).astype(np.float32)) for spec in state_layout(cfg, n)]


@pytest.mark.parametrize("n", [0, 3, 10, 4095, 4096, 4097])
def test_model_cache_state_roundtrip_and_checks(n):
    cfg = _cfg()
    arrays = _random_state(cfg, n, seed=n)
    cache = ModelCache.from_state(cfg, n, arrays)
    assert cache.n_tokens == n and cache.capacity == capacity_for(max(n - 1, 0))
    for a, b in zip(cache.state, arrays):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    d = cache.to_numpy()
    back = ModelCache.from_numpy(cfg, d)
    d2 = back.to_numpy()
    assert d.keys() == d2.keys()
    for k in d:
        np.testing.assert_array_equal(d[k], d2[k])
    if n < 10:
        return
    bad = dict(d)
    bad["layer.2.attn.rows"] = bad["layer.2.attn.rows"][:1]
    with pytest.raises(InferenceError, match="layer.2.attn.rows"):
        ModelCache.from_numpy(cfg, bad)
    missing = dict(d)
    del missing["layer.3.attn.kst"]
    with pytest.raises(InferenceError, match="missing"):
        ModelCache.from_numpy(cfg, missing)
    with pytest.raises(InferenceError, match="n_tokens is -1"):
        ModelCache.from_numpy(cfg, {**d, "n_tokens": np.array(-1)})
    with pytest.raises(InferenceError, match="arrays, expected"):
        ModelCache.from_state(cfg, n, arrays[:-1])


def test_model_cache_copy_is_an_independent_snapshot():
    """Updating a cache (every update rebinds its arrays) never changes a copy taken before; growth
    pads the row buffers without changing the canonical state."""
    cfg = _cfg()
    cache = ModelCache.from_state(cfg, 10, _random_state(cfg, 10, seed=1))
    snap = cache.copy()
    before = [np.array(a) for a in snap.state]
    comp = _make(4, 256, seed=11)
    lc = cache.layers[2]
    lc.bind(ChunkAt(10, 6, DEFAULT_OPS))
    comp(mx.array(np.ones((6, N_EMBD), np.float32)), lc.attn)
    lc.update_raw(mx.array(np.full((6, 256), 2.0, np.float32)))
    cache.advance(16)
    cache.reserve(2 * cache.capacity - 1)  # the last position the call writes
    assert cache.capacity == 2 * snap.capacity and cache.layers[2].attn.rows.shape[0] == 2 * 4096 // 4
    assert snap.n_tokens == 10 and cache.n_tokens == 16
    for a, b in zip(snap.state, before):
        np.testing.assert_array_equal(np.array(a), b)
    # the raw window keeps the last n_swa = 8 rows, oldest first: positions 8, 9 then the six new ones
    raw = np.array(cache.layers[2].state[0])
    np.testing.assert_array_equal(raw[:2], before[sum(len(l.state) for l in snap.layers[:2])][-2:])
    np.testing.assert_array_equal(raw[2:], np.full((6, 256), 2.0, np.float32))
    assert cache.nbytes > snap.nbytes
    for c in (cache, snap):  # the serialised size: the canonical arrays, whatever the capacity
        assert c.state_nbytes == sum(a.nbytes for a in c.state) < c.nbytes
