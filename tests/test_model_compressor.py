"""The chunked compressor against a token-by-token reference written from spec §6.3, and the
canonical frontier state it must leave behind; plus ModelState serialisation."""

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
from ds4_mlx.model.state import CompressorState, InferenceError, ModelState

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


def _run_chunks(comp: Compressor, xs: np.ndarray, cuts: list[int], mode: Numerics) -> CompressorState:
    st = CompressorState.empty(comp.ratio, comp.dim, comp.coff)
    comp = copy.copy(comp)
    comp.ops = ops_for(mode)  # the same weights in the other numerics
    p = 0
    for c in cuts + [xs.shape[0]]:
        if c > p:
            _, st = comp(mx.array(xs[p:c]), p, st)
            p = c
    return st


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


def test_model_state_numpy_roundtrip_and_checks():
    cfg = _cfg()
    st = ModelState.empty(cfg)
    comp = _make(4, 256, seed=11)
    xs = np.random.default_rng(4).standard_normal((10, N_EMBD)).astype(np.float32)
    _, cs = comp(mx.array(xs), 0, st.layers[2].attn)
    st.layers[2].attn = cs
    st.layers[0].raw = mx.array(np.ones((8, 256), np.float32))
    st.n_tokens = 10
    for lay in st.layers:
        if lay.raw.shape[0] == 0:
            lay.raw = mx.zeros((8, 256))
    st.layers[2].index = CompressorState(mx.zeros((2, 128)), st.layers[2].index.kst, st.layers[2].index.gst)
    d = st.to_numpy()
    back = ModelState.from_numpy(cfg, d)
    d2 = back.to_numpy()
    assert d.keys() == d2.keys()
    for k in d:
        np.testing.assert_array_equal(d[k], d2[k])
    bad = dict(d)
    bad["layer.2.attn.rows"] = bad["layer.2.attn.rows"][:1]
    with pytest.raises(InferenceError, match="layer.2.attn.rows"):
        ModelState.from_numpy(cfg, bad)
    missing = dict(d)
    del missing["layer.3.attn.kst"]
    with pytest.raises(InferenceError, match="missing"):
        ModelState.from_numpy(cfg, missing)
