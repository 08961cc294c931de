"""Elementwise numerics of the model (ds4_mlx.model.numerics, rope, hyper_connection) against
independent numpy implementations written from the spec (§4, §5)."""

from __future__ import annotations

import math
import platform

import ds4_mlx  # noqa: F401  (binds MLX to the fast BLAS before mlx is imported)
import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.formats.config import ModelConfig
from ds4_mlx.model import numerics as nm
from ds4_mlx.model.hyper_connection import HyperConnection
from ds4_mlx.model.linear import DenseWeight
from ds4_mlx.model.ops import Numerics, ops_for
from ds4_mlx.formats.ggml_types import GGMLType
from ds4_mlx.model.rope import Rope, apply_rope

RNG = np.random.default_rng(1234)


# -- low-precision round trips: brute-force nearest code search ---------------------------------------

def _e4m3_values() -> np.ndarray:
    """Values of codes 0..126 (127 is NaN): e = c >> 3, m = c & 7."""
    out = []
    for c in range(127):
        e, m = c >> 3, c & 7
        out.append(m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(out)


def _nearest_code(a: float, values: np.ndarray) -> float:
    """Nearest value; on an exact tie the even code wins."""
    d = np.abs(values - a)
    best = np.flatnonzero(d == d.min())
    if len(best) > 1:
        best = [b for b in best if b % 2 == 0]
    return float(values[best[0]])


def _ref_block_round(x: np.ndarray, block: int, vmax: float, floor: float, values: np.ndarray) -> np.ndarray:
    out = np.empty_like(x, dtype=np.float64)
    for b0 in range(0, x.shape[-1], block):
        blk = x[b0:b0 + block].astype(np.float64)
        amax = max(np.abs(blk).max(), floor)
        scale = 2.0 ** math.ceil(math.log2(np.float32(np.float32(amax) / np.float32(vmax))))
        for i, v in enumerate(blk):
            q = min(max(v / scale, -vmax), vmax)
            out[b0 + i] = math.copysign(_nearest_code(abs(q), values), q) * scale
    return out


def _random_rows(n: int, width: int) -> np.ndarray:
    """Rows with widely varying block magnitudes plus planted exact ties and extremes."""
    x = RNG.standard_normal((n, width)) * np.exp(RNG.uniform(-8, 8, size=(n, width // 32, 1))).repeat(32, -1).reshape(n, width)
    return x.astype(np.float32)


def test_fp8_e4m3_matches_code_search():
    x = _random_rows(24, 192)
    # block with exact midpoints between adjacent codes (scale 1: amax 448)
    x[0, :64] = np.float32(448.0)
    x[0, 1:9] = [1.0 + 1 / 16, 1.0 + 3 / 16, 2.0 ** -9 * 0.5, 2.0 ** -9 * 1.5, 240.0, 232.0, -17.0, 0.0]
    x[1, 64:128] = 0.0  # all-zero block: amax floor
    got = np.array(nm.fp8_e4m3_round(mx.array(x)))
    vals = _e4m3_values()
    for r in range(x.shape[0]):
        ref = _ref_block_round(x[r], 64, 448.0, 1e-4, vals)
        np.testing.assert_array_equal(got[r], ref.astype(np.float32), err_msg=f"row {r}")


def test_fp8_kv_round_leaves_rotary_tail():
    x = _random_rows(3, 256)
    got = np.array(nm.fp8_kv_round(mx.array(x), 192))
    np.testing.assert_array_equal(got[:, 192:], x[:, 192:])
    assert not np.array_equal(got[:, :192], x[:, :192])


def test_fp4_e2m1_matches_code_search():
    x = _random_rows(16, 128)
    # amax 6 -> scale 1: exact midpoints between E2M1 values (ties go to the even code)
    x[0, :32] = np.array([6, .25, .75, 1.25, 1.75, 2.5, 3.5, 5, -5, -0.25] + [0.1] * 22, dtype=np.float32)
    got = np.array(nm.fp4_e2m1_round(mx.array(x)))
    vals = np.array([0, .5, 1, 1.5, 2, 3, 4, 6])
    for r in range(x.shape[0]):
        ref = _ref_block_round(x[r], 32, 6.0, 7.052966104933725e-38, vals)
        np.testing.assert_array_equal(got[r], ref.astype(np.float32), err_msg=f"row {r}")


def test_hadamard128_is_scaled_sylvester_matrix():
    h = np.array([[(-1) ** bin(i & j).count("1") for j in range(128)] for i in range(128)], dtype=np.float64)
    x = RNG.standard_normal((5, 128)).astype(np.float32)
    got = np.array(nm.hadamard128(mx.array(x)))
    ref = x.astype(np.float64) @ h.T / math.sqrt(128)
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6 * np.abs(ref).max())
    # H/sqrt(128) is its own inverse
    back = np.array(nm.hadamard128(mx.array(got)))
    np.testing.assert_allclose(back, x, atol=1e-5)


def test_f16_round_is_ieee_half():
    x = (RNG.standard_normal(1000) * 100).astype(np.float32)
    x[:4] = [65519.0, 65520.0, 1e-8, -2.0 ** -24 * 1.5]
    with np.errstate(over="ignore"):
        ref = x.astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(np.array(nm.f16_round(mx.array(x))), ref)


@pytest.mark.parametrize("mode", list(Numerics))
def test_rms_norm(mode):
    x = (RNG.standard_normal((7, 300)) * 3).astype(np.float32)
    w = RNG.standard_normal(300).astype(np.float32)
    got = np.array(ops_for(mode).rms_norm(mx.array(x), mx.array(w), 1e-6))
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt(np.mean(x64 ** 2, axis=-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(got, ref, rtol=2e-6, atol=1e-6)
    if mode is Numerics.DS4_CPU:
        # ds4's exact recipe: Σx² in double, mean to float, 1/sqrtf(mean + eps), (x * s) * w in float
        mean = (np.sum(x64 * x64, axis=-1, keepdims=True) / 300).astype(np.float32)
        s = np.float32(1) / np.sqrt(mean + np.float32(1e-6))
        np.testing.assert_array_equal(got, (x * s) * w)


def test_sequential_sum_is_left_to_right():
    x = (RNG.standard_normal((3, 257, 4)) * np.exp(RNG.uniform(-10, 10, (3, 257, 4)))).astype(np.float32)
    acc = np.zeros((3, 4), np.float32)
    for i in range(257):
        acc = acc + x[:, i]
    np.testing.assert_array_equal(np.array(nm.sequential_sum(mx.array(x), axis=1)), acc)


def test_expf_glibc_bit_exact():
    """ds4's oracle ran on glibc; its expf is reproduced from the algorithm (checked against the C
    library where there is one, else against the correctly rounded value it almost always equals)."""
    import ctypes
    import ctypes.util

    x = np.concatenate([RNG.uniform(-110, 95, 20000), RNG.uniform(-6, 0, 20000),
                        [-np.inf, np.inf, 0.0, -1e30, 88.72, 88.73, -103.9, -104.1, -87.4]]).astype(np.float32)
    got = np.array(nm.expf_glibc(mx.array(x)))
    name = ctypes.util.find_library("m")
    lib = ctypes.CDLL(name) if name else None
    if lib is not None and platform.libc_ver()[0] == "glibc":
        lib.expf.restype, lib.expf.argtypes = ctypes.c_float, [ctypes.c_float]
        ref = np.array([lib.expf(float(v)) for v in x], dtype=np.float32)
        np.testing.assert_array_equal(got, ref)
    else:
        with np.errstate(over="ignore"):
            ref = np.exp(x.astype(np.float64)).astype(np.float32)
        assert np.mean(got == ref) > 0.999


def test_softplus_and_sigmoid():
    x = np.array([-30, -20.5, -5, -0.1, 0, 0.1, 5, 19.9, 20.5, 40], dtype=np.float32)
    for mode in Numerics:
        # DS4_CPU rounds exp/log1p once from float64 (libm-like); MLX's own float32 exp is ~1e-6 off.
        rtol = 5e-7 if mode is Numerics.DS4_CPU else 3e-6
        sp = np.array(ops_for(mode).softplus(mx.array(x)))
        np.testing.assert_allclose(sp, np.logaddexp(0, x.astype(np.float64)), rtol=rtol, atol=1e-30)
        sg = np.array(ops_for(mode).sigmoid_stable(mx.array(x)))
        np.testing.assert_allclose(sg, 1 / (1 + np.exp(-x.astype(np.float64))), rtol=rtol)


# -- RoPE ---------------------------------------------------------------------------------------------

def _cfg(**kw) -> ModelConfig:
    base = dict(n_layer=4, n_embd=64, n_vocab=10, n_head=2, n_head_kv=1, head_dim=256, value_dim=256, n_rot=64,
                q_lora_rank=32, o_lora_rank=16, n_out_group=2, n_expert=4, n_expert_used=2, n_expert_shared=1,
                n_ff_exp=32, n_hash_layer=1, n_swa=8, n_indexer_head=2, indexer_head_dim=128, indexer_top_k=4,
                n_hc=4, hc_sinkhorn_iter=20, compress_ratios=(0, 0, 4, 128), swiglu_clamp=(10.0,) * 4)
    base.update(kw)
    return ModelConfig(**base)


def _ref_theta(p: int, il: int) -> np.ndarray:
    """Spec §4.5 in float64: θ_i = p·b^(-2i/64), YaRN blend on compressed layers."""
    i = np.arange(32)
    if il < 2:
        return p * 10000.0 ** (-2 * i / 64)
    th = p * 160000.0 ** (-2 * i / 64)
    corr = lambda n: 64 * math.log(65536 / (2 * math.pi * n)) / (2 * math.log(160000))
    lo, hi = max(0, math.floor(corr(32))), min(63, math.ceil(corr(1)))
    assert (lo, hi) == (15, 25)
    ramp = 1 - np.clip((i - lo) / max(0.001, hi - lo), 0, 1)
    return th / 16 * (1 - ramp) + th * ramp


@pytest.mark.parametrize("il", [0, 2, 3])
def test_rope_angles_and_rotation(il):
    cfg = _cfg()
    rope = Rope(cfg, il)
    pos = np.array([0, 1, 7, 1000, 65535, 300000])
    th = rope.angles(pos)
    for r, p in enumerate(pos):
        ref = _ref_theta(int(p), il)
        # the iterated float32 product drifts by a few ulps per pair; cos/sin see only that
        np.testing.assert_allclose(th[r], ref, rtol=2e-5, atol=1e-6)
    x = RNG.standard_normal((len(pos), 3, 256)).astype(np.float32)
    cos, sin = rope.tables(pos)
    y = np.array(apply_rope(mx.array(x), cos, sin))
    np.testing.assert_array_equal(y[..., :192], x[..., :192])
    t = np.asarray(th, dtype=np.float64)[:, None, :]
    x0, x1 = x[..., 192::2].astype(np.float64), x[..., 193::2].astype(np.float64)
    np.testing.assert_allclose(y[..., 192::2], x0 * np.cos(t) - x1 * np.sin(t), atol=2e-6)
    np.testing.assert_allclose(y[..., 193::2], x0 * np.sin(t) + x1 * np.cos(t), atol=2e-6)
    icos, isin = rope.tables(pos, inverse=True)
    back = np.array(apply_rope(mx.array(y), icos, isin))
    np.testing.assert_allclose(back, x, atol=2e-6)


# -- hyper-connection split (Sinkhorn) ----------------------------------------------------------------

def _ref_split(mix: np.ndarray, scale: np.ndarray, base: np.ndarray, iters: int = 20, eps: float = 1e-6):
    """Spec §5.2 in float64 for one token."""
    sig = lambda z: 1 / (1 + np.exp(-z))
    pre = sig(mix[:4] * scale[0] + base[:4]) + eps
    post = 2 * sig(mix[4:8] * scale[1] + base[4:8])
    m = (mix[8:] * scale[2] + base[8:]).reshape(4, 4)
    m = np.exp(m - m.max(axis=1, keepdims=True))
    m = m / m.sum(axis=1, keepdims=True) + eps
    m = m / (m.sum(axis=0, keepdims=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(axis=1, keepdims=True) + eps)
        m = m / (m.sum(axis=0, keepdims=True) + eps)
    return pre, post, m


@pytest.mark.parametrize("mode", list(Numerics))
def test_hc_split_and_post(mode):
    T, D = 5, 16
    fn = DenseWeight("hc_fn", GGMLType.F32, RNG.standard_normal((24, 4 * D)).astype(np.float32), 4 * D)
    scale = RNG.uniform(0.5, 2, 3).astype(np.float32)
    base = RNG.standard_normal(24).astype(np.float32)
    hc = HyperConnection(fn, mx.array(scale), mx.array(base), 4, 20, 1e-6, 1e-6, ops_for(mode))
    mix = RNG.standard_normal((T, 24)).astype(np.float32)
    pre, post = (np.array(a) for a in hc.gains(mx.array(mix)))
    comb = np.array(hc.comb(mx.array(mix)))
    for t in range(T):
        rp, rq, rm = _ref_split(mix[t].astype(np.float64), scale, base)
        np.testing.assert_allclose(pre[t], rp, rtol=1e-6)
        np.testing.assert_allclose(post[t], rq, rtol=1e-6)
        np.testing.assert_allclose(comb[t], rm, rtol=1e-5, atol=1e-7)
    H = RNG.standard_normal((T, 4, D)).astype(np.float32)
    f = RNG.standard_normal((T, D)).astype(np.float32)
    out = np.array(hc.post(mx.array(f), mx.array(H), mx.array(post), mx.array(comb)))
    ref = post[:, :, None] * f[:, None, :] + np.einsum("tsd,tse->tde", comb.astype(np.float64), H)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    # pre step: flat RMSNorm -> mixer -> weighted stream sum
    x, _, _ = hc.pre(mx.array(H))
    flat = H.reshape(T, -1).astype(np.float64)
    flat = flat / np.sqrt(np.mean(flat ** 2, axis=1, keepdims=True) + 1e-6)
    mix2 = flat @ np.array(fn.dense()).T.astype(np.float64)
    for t in range(T):
        rp, _, _ = _ref_split(mix2[t], scale, base)
        np.testing.assert_allclose(np.array(x)[t], (rp[:, None] * H[t]).sum(0), rtol=1e-4, atol=1e-5)
