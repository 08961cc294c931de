"""MXFP4 routed experts as ds4 reads them (``ds4_mlx.model.mxfp4``): the weights against gguf-py's and
MLX's own ``mode="mxfp4"`` decoders on every (scale, code) pair, and ds4's float dot in both branches of
the sequential sum. (The native products, the GPU kernels and the expert calls are checked with the
other types: tests/test_native_experts.py, test_kernel_shim.py, test_linear.py.)"""

from __future__ import annotations

import ds4_mlx  # noqa: F401  (first: binds MLX to a fast BLAS before mlx.core loads)
import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize

from ds4_mlx.errors import LayoutError
from ds4_mlx.formats.ggml_types import GGMLType
from ds4_mlx.model import mxfp4
from ds4_mlx.model import numerics as numerics_mod
from ds4_mlx.model.experts import ExpertCache, ExpertWeights
from test_linear import activations, bits, random_blocks, ref_dot_mxfp4

DS4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _every_scale_and_code() -> np.ndarray:
    """256 blocks, block e with scale byte e and the 32 codes 0..15, 0..15 (each code as a low and a
    high nibble)."""
    raw = np.zeros((256, 17), dtype=np.uint8)
    raw[:, 0] = np.arange(256)
    raw[:, 1:] = (np.arange(16) | (np.arange(16) << 4)).astype(np.uint8)
    return raw


def _ds4_reference(raw: np.ndarray) -> np.ndarray:
    """ds4_e8m0_to_f32(e) * ds4_mxfp4_values[code], written from ds4.c's two tables."""
    out = np.empty((raw.shape[0], 32), dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for b, blk in enumerate(raw):
            e = int(blk[0])
            d = np.array([0x00400000 if e == 0 else e << 23], dtype=np.uint32).view(np.float32)[0]
            for j in range(16):
                out[b, j] = d * np.float32(DS4_VALUES[blk[1 + j] & 15])
                out[b, j + 16] = d * np.float32(DS4_VALUES[blk[1 + j] >> 4])
    return out


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b)) and np.array_equal(bits(a)[~nan], bits(b)[~nan]))


def test_weights_are_ds4s_on_every_scale_and_code():
    raw = _every_scale_and_code()
    want = _ds4_reference(raw)
    for got in (mxfp4.dequant_rows(mx.array(raw)), mxfp4.dequant_rows(mx.array(raw.reshape(1, -1))),
                mxfp4.expert_rows_mlx(mx.array(raw), GGMLType.MXFP4)):
        assert _same(np.array(got).reshape(256, 32), want)
    # the data holds what the claims are about: subnormal weights (e = 0), -0.0 (code 8), NaN (0 * inf)
    assert want[0, 1] == np.float32(2.0 ** -128) and np.signbit(want[127, 8]) and np.isnan(want[255, 0])


def test_ds4s_weights_are_gguf_pys_but_for_zero_signs_and_scale_255():
    """gguf-py (ggml: doubled integers times 2^(e-128)) agrees bit for bit on scales 0..254 except the
    sign of code 8's zero; at 255 ggml's scale is 2^127 where ds4's is +inf."""
    raw = _every_scale_and_code()
    with np.errstate(all="ignore"):
        ref = gguf_dequantize(raw.reshape(-1), gguf.GGMLQuantizationType.MXFP4).astype(np.float32).reshape(256, 32)
    ours = np.array(mxfp4.dequant_rows(mx.array(raw)))
    code8 = np.zeros(32, bool)
    code8[[8, 24]] = True
    assert np.array_equal(bits(ours[:255, ~code8]), bits(ref[:255, ~code8]))
    assert (ours[:255, code8] == 0).all() and (ref[:255, code8] == 0).all()
    assert np.signbit(ours[:255, code8]).all() and not np.signbit(ref[:255, code8]).any()
    assert np.isinf(ours[255, [1, 17]]).all() and ref[255, 1] == np.float32(2.0 ** 127)


def _mlx_mxfp4(raw: np.ndarray) -> tuple[mx.array, mx.array]:
    """GGUF MXFP4 rows [R, nb*17] -> MLX's mxfp4 (uint32 words of 8 codes, element i at bits 4 (i % 8);
    uint8 scales): the codes and scale bytes unchanged, only the nibbles re-paired."""
    R, nb = raw.shape[0], raw.shape[1] // 17
    b = raw.reshape(R, nb, 17)
    codes = np.concatenate([b[..., 1:] & 15, b[..., 1:] >> 4], axis=-1)  # element order
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return mx.array(np.ascontiguousarray(packed.reshape(R, nb * 16)).view("<u4")), mx.array(b[..., 0].copy())


def test_mlx_mxfp4_holds_the_gguf_bytes_losslessly():
    """MLX's mode="mxfp4" takes the GGUF codes and E8M0 scales as they are (re-paired nibbles): its
    dequantize gives ds4's weights bit for bit, scales 0 and 255 included."""
    rng = np.random.default_rng(4)
    raw = np.concatenate([_every_scale_and_code(), rng.integers(0, 256, (256, 17), dtype=np.uint8)])
    raw = raw.reshape(32, 16 * 17)  # rows of 16 blocks
    try:
        w, s = _mlx_mxfp4(raw)
        got = np.array(mx.dequantize(w, s, None, group_size=32, bits=4, mode="mxfp4", dtype=mx.float32))
    except (TypeError, ValueError) as exc:
        pytest.skip(f"this MLX has no mxfp4 mode ({exc})")
    assert _same(got, np.array(mxfp4.dequant_rows(mx.array(raw))))


@pytest.mark.parametrize("branch", ["scan", "loop"])
def test_ds4_cpu_twin_is_ds4s_float_dot_in_both_sum_branches(monkeypatch, branch):
    """The MLX twin of ds4_vec_dot_mxfp4_f32 (native off), through the one-cumsum branch and the
    step-by-step loop of ``sequential_outer_sum``, against the scalar reference."""
    monkeypatch.setattr(numerics_mod, "_LOOP_MIN_OUTPUTS", 0 if branch == "loop" else 1 << 30)
    rng = np.random.default_rng(21)
    n_expert, out_dim, n_in = 4, 3, 96  # MXFP4 needs no 256-wide super-blocks
    raw = random_blocks(rng, GGMLType.MXFP4, (n_expert, out_dim), n_in)
    raw[0, 0, 0], raw[1, 1, 17] = 0, 254  # a subnormal scale; one that overflows for |value| >= 2
    ids = np.array([[0, 3], [1, 0], [2, 1]])
    x = activations(rng, (3, 1, n_in))
    e = ExpertWeights("e", GGMLType.MXFP4, raw, n_in, backend="cpu", use_kernels=False, native=False)
    e.cache = ExpertCache(0)
    y = np.array(e.ds4_cpu(mx.array(x), ids))
    with np.errstate(over="ignore", invalid="ignore"):  # the scale-254 row overflows, as in ds4
        ref = np.array([[[ref_dot_mxfp4(raw[ids[t, j], o], x[t, 0]) for o in range(out_dim)] for j in range(2)]
                        for t in range(3)], dtype=np.float32)
    assert _same(y, ref)


def test_rows_that_are_not_whole_blocks_are_refused():
    with pytest.raises(LayoutError, match="17-byte blocks"):
        mxfp4.dequant_rows(mx.zeros((2, 18), dtype=mx.uint8))
    with pytest.raises(LayoutError, match="MXFP4 rows of 34 bytes do not hold 96 values"):
        ExpertWeights("e", GGMLType.MXFP4, np.zeros((1, 2, 34), np.uint8), 96)
