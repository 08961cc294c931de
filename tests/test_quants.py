"""GGML quant blocks: bit-exactness against gguf-py, MLX twins, ds4.c activation quantizers and dot products.

The independent references here are gguf-py (dequantizers, Q8_0 quantizer) and per-element scalar
re-statements of ds4.c's C loops written with numpy float32 scalars and Python ints.
"""

from __future__ import annotations

import ds4_mlx  # noqa: F401  (binds MLX to a fast BLAS before mlx is imported)

from fractions import Fraction

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from ds4_mlx.errors import QuantError
from ds4_mlx.formats import iq2xxs_tables
from ds4_mlx.formats.ggml_types import BLOCK_GEOMETRY, GGMLType
from ds4_mlx.formats.quants import fma_f32
from ds4_mlx.quants import (
    dequantize,
    dequantize_rows,
    quantize_q8_0,
    quantize_q8_0_activation,
    quantize_q8_0_activation_mlx,
    quantize_q8_k_activation,
    quantize_q8_k_activation_mlx,
    vec_dot_iq2_xxs_q8_k,
    vec_dot_q2_k_q8_k,
    vec_dot_q8_0_q8_0,
)

N_BLOCKS = 10_240
BLOCK_FORMATS = ["Q8_0", "Q2_K", "Q4_K", "IQ2_XXS", "MXFP4"]
PLAIN_FORMATS = ["F32", "F16", "BF16"]

# byte offsets of the f16 scales inside each block
F16_SCALE_OFFSETS = {"Q8_0": (0,), "Q2_K": (80, 82), "Q4_K": (0, 2), "IQ2_XXS": (0,)}
EDGE_F16 = [
    0x0000,  # +0
    0x8000,  # -0
    0x3C00,  # 1
    0xBC00,  # -1
    0x0001,  # smallest subnormal
    0x03FF,  # largest subnormal
    0x8001,  # negative subnormal
    0x0400,  # smallest normal
    0x7BFF,  # max
    0xFBFF,  # -max
    0x7C00,  # inf
    0xFC00,  # -inf
    0x7E00,  # quiet NaN
    0x7C01,  # signalling NaN (payload must survive the conversion)
    0xFD55,  # negative NaN with payload
]


def _random_blocks(name: str, n_blocks: int, seed: int) -> np.ndarray:
    """Random block bytes, the first blocks' scales replaced by every pair of edge values."""
    _, block_bytes = BLOCK_GEOMETRY[GGMLType[name]]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    if name == "MXFP4":
        blocks[:256, 0] = np.arange(256, dtype=np.uint8)  # every e8m0 exponent, 0..255
        blocks[256:512, 0] = np.array([0, 1, 2, 127, 128, 253, 254, 255] * 32, dtype=np.uint8)
        blocks[256:512, 1:] = 0xFF  # all the largest negative codes with extreme scales
        return blocks
    edges = np.array(EDGE_F16, dtype=np.uint16)
    offsets = F16_SCALE_OFFSETS[name]
    k = len(edges)
    for i, off in enumerate(offsets):
        # block b gets edge (b // k**i) % k at scale i: all combinations of edge values across scales
        idx = (np.arange(k ** len(offsets)) // k**i) % k
        vals = edges[idx]
        blocks[: len(vals), off] = (vals & 0xFF).astype(np.uint8)
        blocks[: len(vals), off + 1] = (vals >> 8).astype(np.uint8)
    return blocks


def _gguf(raw: np.ndarray, name: str) -> np.ndarray:
    with np.errstate(all="ignore"):  # NaN/inf scales are part of the test data
        return gguf_dequantize(raw, gguf.GGMLQuantizationType[name]).astype(np.float32, copy=False)


def _bits(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, dtype=np.float32)).view(np.uint32)


# ---------------------------------------------------------------------------------------------------
# tables


def test_iq2xxs_tables_match_gguf():
    gguf.quants.IQ2_XXS.init_grid()
    ref_grid = gguf.quants.IQ2_XXS.grid.reshape(256, 8)
    assert np.array_equal(iq2xxs_tables.grid_bytes().astype(np.float32), ref_grid)
    assert bytes(iq2xxs_tables.KSIGNS_IQ2XS) == gguf.quants.IQ2_XXS.ksigns
    assert iq2xxs_tables.KMASK_IQ2XS == (1, 2, 4, 8, 16, 32, 64, 128)
    assert set(np.unique(iq2xxs_tables.grid_bytes())) == {8, 25, 43}


# ---------------------------------------------------------------------------------------------------
# dequantization vs gguf-py


@pytest.mark.parametrize("name", BLOCK_FORMATS)
def test_block_dequant_bit_exact_numpy_and_mlx(name):
    elems, block_bytes = BLOCK_GEOMETRY[GGMLType[name]]
    blocks = _random_blocks(name, N_BLOCKS, seed=BLOCK_FORMATS.index(name))
    ref = _gguf(blocks.reshape(-1, 16 * block_bytes), name).reshape(-1)

    flat = dequantize(blocks.reshape(-1), name, N_BLOCKS * elems)
    assert flat.dtype == np.float32 and flat.shape == (N_BLOCKS * elems,)
    assert np.array_equal(_bits(flat), _bits(ref))

    rows = blocks.reshape(-1, 16 * block_bytes)  # 16 blocks per row
    out_rows = dequantize_rows(rows, name)
    assert out_rows.shape == (N_BLOCKS // 16, 16 * elems)
    assert np.array_equal(_bits(out_rows).reshape(-1), _bits(ref))

    mlx_rows = dequantize_rows(mx.array(rows), name)
    assert isinstance(mlx_rows, mx.array) and mlx_rows.dtype == mx.float32
    assert np.array_equal(_bits(np.array(mlx_rows)).reshape(-1), _bits(ref))

    mlx_flat = dequantize(mx.array(blocks.reshape(-1)), name, N_BLOCKS * elems)
    assert isinstance(mlx_flat, mx.array) and mlx_flat.shape == (N_BLOCKS * elems,)
    assert np.array_equal(_bits(np.array(mlx_flat)), _bits(ref))


def test_edge_scales_are_really_exercised():
    # guard against the edge blocks silently not containing what the exactness test claims
    out = dequantize_rows(_random_blocks("Q8_0", 512, seed=1)[:, :], "Q8_0")
    assert np.isnan(out).any() and np.isinf(out).any() and (out == 0).all(axis=1).any()
    mx_out = dequantize_rows(_random_blocks("MXFP4", 512, seed=1), "MXFP4")
    tiny = np.abs(mx_out[np.isfinite(mx_out) & (mx_out != 0)]).min()
    assert tiny == np.float32(2.0**-128)  # e8m0 = 0 gives a float32 subnormal scale
    assert np.isinf(mx_out).any()  # 12 * 2**127 overflows


@pytest.mark.parametrize("name", PLAIN_FORMATS)
def test_plain_formats_bit_exact(name):
    rng = np.random.default_rng(7)
    elems = 65536
    _, nbytes = BLOCK_GEOMETRY[GGMLType[name]]
    raw = rng.integers(0, 256, size=elems * nbytes, dtype=np.uint8)
    if name in ("F16", "BF16"):
        raw[: 2 * 65536] = np.arange(65536, dtype=np.uint16).view(np.uint8)  # every half / bfloat16 bit pattern
    ref = _gguf(raw.reshape(1, -1), name).reshape(-1)
    out = dequantize(raw, name, elems)
    assert np.array_equal(_bits(out), _bits(ref))
    mlx_out = dequantize(mx.array(raw), name, elems)
    assert np.array_equal(_bits(np.array(mlx_out)), _bits(ref))
    mlx_rows = dequantize_rows(mx.array(raw.reshape(64, -1)), name)
    assert mlx_rows.shape == (64, elems // 64)
    assert np.array_equal(_bits(np.array(mlx_rows)).reshape(-1), _bits(ref))


def test_i32_and_input_kinds():
    vals = np.array([0, 1, -1, 2**31 - 1, -(2**31), 123456], dtype="<i4")
    raw = vals.tobytes()
    for data in (raw, bytearray(raw), memoryview(raw), np.frombuffer(raw, np.uint8)):
        out = dequantize(data, "i32", 6)
        assert out.dtype == np.int32 and np.array_equal(out, vals)
    out = dequantize(mx.array(np.frombuffer(raw, np.uint8)), GGMLType.I32, 6)
    assert out.dtype == mx.int32 and np.array_equal(np.array(out), vals)
    # type given as id, lower-case name, enum: same result
    q = quantize_q8_0(np.linspace(-3, 3, 64, dtype=np.float32))
    a = dequantize(q, 8, 64)
    assert np.array_equal(a, dequantize(q.tobytes(), "q8_0", 64))
    assert np.array_equal(a, dequantize(q, GGMLType.Q8_0, 64))
    # typed F16 rows are read as their bytes
    halves = np.arange(-8, 8, dtype=np.float16).reshape(2, 8)
    assert np.array_equal(dequantize_rows(halves, "F16"), halves.astype(np.float32))
    # leading axes are kept
    rows3 = np.stack([q.reshape(2, 34)] * 3)
    assert dequantize_rows(rows3, "Q8_0").shape == (3, 2, 32)
    assert dequantize_rows(mx.array(rows3), "Q8_0").shape == (3, 2, 32)


# ---------------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize("as_mlx", [False, True])
def test_errors(as_mlx):
    def data(n):
        arr = np.zeros(n, np.uint8)
        return mx.array(arr) if as_mlx else arr

    with pytest.raises(QuantError, match="unknown GGML type 'NOPE'"):
        dequantize(data(34), "NOPE", 32)
    with pytest.raises(QuantError, match="unknown GGML type 99"):
        dequantize(data(34), 99, 32)
    with pytest.raises(QuantError, match="Q5_K .*not supported"):
        dequantize(data(176), "Q5_K", 256)
    with pytest.raises(QuantError, match=r"IQ2_XXS: 512 elements need 132 bytes .*found 131 bytes"):
        dequantize(data(131), "IQ2_XXS", 512)
    with pytest.raises(QuantError, match=r"Q8_0: 32 elements need 34 bytes .*found 68 bytes"):
        dequantize(data(68), "Q8_0", 32)
    with pytest.raises(QuantError, match="Q2_K: 300 elements is not a multiple of the block size 256"):
        dequantize(data(84), "Q2_K", 300)
    with pytest.raises(QuantError, match="F32: 16 elements need 64 bytes"):
        dequantize(data(63), "F32", 16)
    with pytest.raises(QuantError, match="non-negative"):
        dequantize(data(0), "F32", -1)
    with pytest.raises(QuantError, match=r"Q4_K: row of 150 bytes .*expected a multiple of 144, found 150"):
        dequantize_rows(data(300).reshape(2, 150), "Q4_K")


def test_quantizer_and_dot_errors():
    with pytest.raises(QuantError, match="not a multiple of the block size 32"):
        quantize_q8_0(np.zeros(40, np.float32))
    with pytest.raises(QuantError, match="not a multiple of the block size 256"):
        quantize_q8_k_activation(np.zeros(300, np.float32))
    with pytest.raises(QuantError, match="not a multiple of the block size 256"):
        quantize_q8_k_activation_mlx(mx.zeros((300,)))
    with pytest.raises(QuantError, match="must be bytes-like"):
        dequantize([1, 2, 3], "F32", 1)
    w = np.zeros((2, 84), np.uint8)
    q, d = quantize_q8_k_activation(np.ones(256, np.float32))
    with pytest.raises(QuantError, match="activation length 128 != weight row length 256"):
        vec_dot_q2_k_q8_k(w, q[:128], d)
    with pytest.raises(QuantError, match="scales have shape"):
        vec_dot_q2_k_q8_k(w, q, np.ones(2, np.float32))
    with pytest.raises(QuantError, match="must be int8"):
        vec_dot_q2_k_q8_k(w, q.astype(np.int16), d)


# ---------------------------------------------------------------------------------------------------
# Q8_0 weight quantizer vs gguf-py


def test_quantize_q8_0_matches_gguf():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((64, 1024)) * rng.lognormal(0, 3, size=(64, 1))).astype(np.float32)
    special = np.zeros((8, 1024), np.float32)
    special[1, :32] = np.arange(-16, 16, dtype=np.float32) + 0.5  # amax 15.5
    special[2, :32] = 127.0
    special[2, 1:32] = np.arange(31, dtype=np.float32) - 15.5  # d = 1, ties at .5: away from zero
    special[3] = 1e6  # d = 7874: fits f16
    special[4] = -1e9  # d overflows f16 -> inf
    special[5] = 1e-6  # subnormal f16 d
    special[6, ::2] = -3.0
    special[7] = rng.standard_normal(1024).astype(np.float32) * 1e-30
    x = np.concatenate([x, special])
    ours = quantize_q8_0(x)
    with np.errstate(all="ignore"):  # the -1e9 row overflows the f16 scale on purpose
        ref = gguf_quantize(x, gguf.GGMLQuantizationType.Q8_0)
    assert ours.dtype == np.uint8 and ours.shape == (72, 1024 // 32 * 34)
    assert np.array_equal(ours, ref)
    # and ties really were rounded away from zero
    blk = dequantize(ours[64 + 2, :34], "Q8_0", 32)
    assert blk[1] == -16.0 and blk[2] == -15.0 and blk[16] == -1.0 and blk[17] == 1.0 and blk[31] == 15.0


# ---------------------------------------------------------------------------------------------------
# ds4.c activation quantizers vs a per-element re-statement of the C loops


def _c_lrintf(v: np.float32) -> int:
    # Python's round() on a float is round-half-even, as lrintf in the default rounding mode. A non-finite
    # product (only from non-finite or ~1e-38 inputs) is "integer indefinite" on x86-64, which (int) makes 0.
    if not np.isfinite(v):
        return 0
    return int(round(float(v)))


def _ref_q8_0_activation(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = x.size
    nb = (n + 31) // 32
    q = np.zeros(nb * 32, np.int8)
    d = np.zeros(nb, np.float32)
    for b in range(nb):
        blk = x[b * 32 : min(n, b * 32 + 32)]
        amax = np.float32(0)
        for v in blk:
            if abs(v) > amax:
                amax = abs(v)
        scale = np.float32(amax / np.float32(127))
        inv = np.float32(np.float32(1) / scale) if scale != 0 else np.float32(0)
        d[b] = scale
        for i, v in enumerate(blk):
            q[b * 32 + i] = max(-128, min(127, _c_lrintf(np.float32(v * inv))))
    return q[:n], d


def _ref_q8_k_activation(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    nb = x.size // 256
    q = np.zeros(x.size, np.int8)
    d = np.zeros(nb, np.float32)
    for b in range(nb):
        blk = x[b * 256 : b * 256 + 256]
        vmax = np.float32(0)
        amax = np.float32(0)
        for v in blk:
            if abs(v) > amax:
                amax = abs(v)
                vmax = v
        if amax == 0:
            continue
        iscale = np.float32(np.float32(-127) / vmax)
        for i, v in enumerate(blk):
            q[b * 256 + i] = max(-128, min(127, _c_lrintf(np.float32(iscale * v))))
        d[b] = np.float32(np.float32(1) / iscale)
    return q, d


def _activation_cases() -> list[np.ndarray]:
    rng = np.random.default_rng(11)
    cases = []
    cases.append((rng.standard_normal(512) * 3).astype(np.float32))
    cases.append(np.zeros(512, np.float32))  # all zeros
    neg = rng.uniform(-1, 1, 512).astype(np.float32)
    neg[5] = -40.0  # a negative element dominates block 0 ...
    neg[300] = -7.25  # ... and block 1
    cases.append(neg)
    ties = np.zeros(512, np.float32)
    ties[0] = 127.0  # Q8_0: d = 1, reciprocal 1; Q8_K: iscale = -1
    ties[1:64] = np.arange(63, dtype=np.float32) - 31.5  # every .5 tie, both signs
    ties[32] = 127.0
    ties[256] = -127.0  # Q8_K block 1: iscale = +1, ties survive unchanged
    ties[257:320] = np.arange(63, dtype=np.float32) - 30.5
    cases.append(ties)
    pm = rng.standard_normal(512).astype(np.float32)
    pm[10], pm[20] = 9.0, -9.0  # equal magnitudes: the first one sets the sign of d
    pm[270], pm[280] = -9.0, 9.0
    cases.append(pm)
    nan = rng.standard_normal(512).astype(np.float32)
    nan[3] = np.nan  # ignored by the max scan
    cases.append(nan)
    tiny = (rng.standard_normal(512) * 1e-38).astype(np.float32)  # subnormal scales
    cases.append(tiny)
    # ties through an inexact reciprocal: amax 476.25 gives d = 3.75 (Q8_0) and iscale = -+1/3.75 (Q8_K);
    # x = 3.75 * (k + 0.5) makes x / d an exact tie, while ds4's x * (1/d) often lands just off it
    thirds = np.zeros(512, np.float32)
    for base, sign in ((0, 1.0), (256, -1.0)):
        thirds[base + 1 : base + 200] = (np.arange(199, dtype=np.float32) - 99.0 + 0.5) * 3.75
        thirds[base : base + 256 : 32] = sign * 476.25  # every Q8_0 block has that amax too
    cases.append(thirds)
    return cases


N_ACTIVATION_CASES = len(_activation_cases())


@pytest.mark.parametrize("case", range(N_ACTIVATION_CASES))
def test_q8_0_activation_matches_c_loop(case):
    x = _activation_cases()[case]
    with np.errstate(all="ignore"):
        ref_q, ref_d = _ref_q8_0_activation(x)
    q, d = quantize_q8_0_activation(x)
    assert q.dtype == np.int8 and d.dtype == np.float32
    finite = ~np.isnan(x)  # the NaN element itself is platform-defined in C
    assert np.array_equal(q[finite], ref_q[finite]) and np.array_equal(_bits(d), _bits(ref_d))
    mq, md = quantize_q8_0_activation_mlx(mx.array(x))
    assert np.array_equal(np.array(mq), q) and np.array_equal(_bits(np.array(md)), _bits(d))


@pytest.mark.parametrize("case", range(N_ACTIVATION_CASES))
def test_q8_k_activation_matches_c_loop(case):
    x = _activation_cases()[case]
    with np.errstate(all="ignore"):
        ref_q, ref_d = _ref_q8_k_activation(x)
    q, d = quantize_q8_k_activation(x)
    assert q.dtype == np.int8 and d.dtype == np.float32 and d.shape == (2,)
    finite = ~np.isnan(x)
    assert np.array_equal(q[finite], ref_q[finite]) and np.array_equal(_bits(d), _bits(ref_d))
    mq, md = quantize_q8_k_activation_mlx(mx.array(x))
    assert np.array_equal(np.array(mq), q) and np.array_equal(_bits(np.array(md)), _bits(d))


def test_activation_tie_semantics():
    x = _activation_cases()[3]
    q, _ = quantize_q8_0_activation(x)
    # block 0 has d = 1: -31.5 -> -32, -30.5 -> -30, 0.5 -> 0, 1.5 -> 2 (half to even)
    assert list(q[1:4]) == [-32, -30, -30] and q[32 + 0] == 127
    qk, dk = quantize_q8_k_activation(x)
    assert dk[0] == np.float32(-1.0) and qk[0] == -127 and qk[1] == 32  # iscale = -1 flips signs
    assert dk[1] == np.float32(1.0) and qk[256] == -127 and list(qk[257:260]) == [-30, -30, -28]


def test_activation_quantizers_batched_and_partial_block():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 2, 512)).astype(np.float32)
    q, d = quantize_q8_k_activation(x)
    assert q.shape == (3, 2, 512) and d.shape == (3, 2, 2)
    q1, d1 = quantize_q8_k_activation(x[1, 1])
    assert np.array_equal(q[1, 1], q1) and np.array_equal(d[1, 1], d1)
    mq, md = quantize_q8_k_activation_mlx(mx.array(x))
    assert np.array_equal(np.array(mq), q) and np.array_equal(np.array(md), d)
    # ds4 quantizes a short last Q8_0 block over its own elements
    y = rng.standard_normal(70).astype(np.float32)
    q, d = quantize_q8_0_activation(y)
    rq, rd = _ref_q8_0_activation(y)
    assert q.shape == (70,) and d.shape == (3,)
    assert np.array_equal(q, rq) and np.array_equal(d, rd)
    mq, md = quantize_q8_0_activation_mlx(mx.array(y))
    assert np.array_equal(np.array(mq), q) and np.array_equal(np.array(md), d)


def test_activation_quantizers_random_bulk_numpy_vs_mlx():
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((64, 4096)) * rng.lognormal(0, 2, size=(64, 1))).astype(np.float32)
    x[::7, ::13] = np.round(x[::7, ::13])  # more exact ties after scaling by 1
    for fn, fn_mlx in (
        (quantize_q8_0_activation, quantize_q8_0_activation_mlx),
        (quantize_q8_k_activation, quantize_q8_k_activation_mlx),
    ):
        q, d = fn(x)
        mq, md = fn_mlx(mx.array(x))
        assert np.array_equal(np.array(mq), q) and np.array_equal(_bits(np.array(md)), _bits(d))
    q, d = quantize_q8_k_activation(x[0])
    rq, rd = _ref_q8_k_activation(x[0])
    assert np.array_equal(q, rq) and np.array_equal(d, rd)


# ---------------------------------------------------------------------------------------------------
# ds4.c scalar dot products vs per-element re-statements of the C loops


def _f16(lo: int, hi: int) -> np.float32:
    return np.float32(np.array([int(lo) | (int(hi) << 8)], np.uint16).view(np.float16)[0])


def _ref_dot_q8_0(row: np.ndarray, q: np.ndarray, d: np.ndarray) -> np.float32:
    acc = np.float32(0)
    for b in range(row.size // 34):
        blk = row[b * 34 : b * 34 + 34]
        isum = sum(int(w) * int(a) for w, a in zip(blk[2:].view(np.int8), q[b * 32 : b * 32 + 32]))
        acc = np.float32(acc + np.float32(np.float32(_f16(blk[0], blk[1]) * d[b]) * np.float32(isum)))
    return acc


def _ref_dot_q2_k(row: np.ndarray, q: np.ndarray, d: np.ndarray) -> np.float32:
    sumf = np.float32(0)
    for i in range(row.size // 84):
        blk = row[i * 84 : i * 84 + 84]
        sc, q2 = blk[0:16], blk[16:80]
        q8 = q[i * 256 : i * 256 + 256].astype(int)
        bsums = [int(q8[16 * j : 16 * j + 16].sum()) for j in range(16)]
        summs = sum(bsums[j] * (int(sc[j]) >> 4) for j in range(16))
        dall = np.float32(d[i] * _f16(blk[80], blk[81]))
        dmin = np.float32(d[i] * _f16(blk[82], blk[83]))
        isum, is_, pos = 0, 0, 0
        for k in range(2):
            shift = 0
            for _ in range(4):
                for half in range(2):
                    scale = int(sc[is_]) & 15
                    is_ += 1
                    part = sum(
                        int(q8[pos + 16 * half + l]) * ((int(q2[32 * k + 16 * half + l]) >> shift) & 3)
                        for l in range(16)
                    )
                    isum += scale * part
                shift += 2
                pos += 32
        sumf = np.float32(sumf + np.float32(np.float32(dall * np.float32(isum)) - np.float32(dmin * np.float32(summs))))
    return sumf


def _iq2_xxs_group_sums(row: np.ndarray, q: np.ndarray, d: np.ndarray):
    """Per 256-element block: (f16(w.d) * y.d as f32, [(exact integer dot of one group of 32 signed grid
    values with its activations, the group's 4-bit scale)] * 8). ds4's portable and NEON loops compute
    the same integers; they differ only in how they scale and add them up."""
    grid = iq2xxs_tables.IQ2XXS_GRID
    ksigns = iq2xxs_tables.KSIGNS_IQ2XS
    for i in range(row.size // 66):
        blk = row[i * 66 : i * 66 + 66]
        dd = np.float32(_f16(blk[0], blk[1]) * d[i])
        q8 = q[i * 256 : i * 256 + 256].astype(int)
        groups = []
        for ib in range(8):
            g = blk[2 + 8 * ib : 2 + 8 * ib + 8]
            aux1 = int(g[4]) | int(g[5]) << 8 | int(g[6]) << 16 | int(g[7]) << 24
            sumi = 0
            for l in range(4):
                signs = ksigns[(aux1 >> (7 * l)) & 127]
                mags = grid[int(g[l])]
                for k in range(8):
                    v = (mags >> (8 * k)) & 0xFF
                    v = -v if signs & (1 << k) else v
                    sumi += v * int(q8[32 * ib + 8 * l + k])
            groups.append((sumi, aux1 >> 28))
        yield dd, groups


def _ref_dot_iq2_xxs(row: np.ndarray, q: np.ndarray, d: np.ndarray) -> np.float32:
    """Portable: integer block sum of sumi * (2 * scale + 1), then 0.125 * sum of dd * bsum."""
    sumf = np.float32(0)
    for dd, groups in _iq2_xxs_group_sums(row, q, d):
        bsum = sum(sumi * (2 * s + 1) for sumi, s in groups)
        sumf = np.float32(sumf + np.float32(dd * np.float32(bsum)))
    return np.float32(np.float32(0.125) * sumf)


def _weights(name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random blocks with finite, moderate f16 scales (as real weights have)."""
    elems, block_bytes = BLOCK_GEOMETRY[GGMLType[name]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // elems, block_bytes), dtype=np.uint8)
    for off in F16_SCALE_OFFSETS[name]:
        scale = (rng.uniform(0.5, 2, size=raw.shape[:2]) * 2.0**-8).astype(np.float16).view(np.uint16)
        raw[..., off] = scale & 0xFF
        raw[..., off + 1] = scale >> 8
    return raw.reshape(rows, -1)


DOT_CASES = [
    ("Q8_0", vec_dot_q8_0_q8_0, _ref_dot_q8_0, quantize_q8_0_activation),
    ("Q2_K", vec_dot_q2_k_q8_k, _ref_dot_q2_k, quantize_q8_k_activation),
    ("IQ2_XXS", vec_dot_iq2_xxs_q8_k, _ref_dot_iq2_xxs, quantize_q8_k_activation),
]


@pytest.mark.parametrize("name,fn,ref,quant", DOT_CASES, ids=[c[0] for c in DOT_CASES])
def test_vec_dot_matches_c_loop(name, fn, ref, quant):
    rows, cols = 5, 512
    w = _weights(name, rows, cols, seed=21)
    rng = np.random.default_rng(22)
    x = (rng.standard_normal((2, cols)) * 4).astype(np.float32)
    x[1, :256] *= 1000  # the two activation blocks of row 1 differ in scale by 1000
    q, d = quant(x)
    out = fn(w, q, d)
    assert out.shape == (2, rows) and out.dtype == np.float32
    expect = np.array([[ref(w[r], q[t], d[t]) for r in range(rows)] for t in range(2)], np.float32)
    assert np.array_equal(_bits(out), _bits(expect))
    assert np.array_equal(fn(w, q[1], d[1]), out[1])  # single activation vector -> [rows]
    # semantics: the quantized dot is the float dot of the dequantized operands (up to float32 rounding)
    xq = q.astype(np.float64) * np.repeat(d, q.shape[-1] // d.shape[-1], axis=-1)
    wf = dequantize_rows(w, name).astype(np.float64)
    exact = xq @ wf.T
    scale = np.abs(xq) @ np.abs(wf).T
    assert (np.abs(out - exact) <= 1e-5 * scale).all()


def test_iq2_xxs_dot_large_integer_sums_round_like_c():
    # the largest grid point, positive signs, top group scale (ls = 31), q8 = 127: the integer sum of one
    # block exceeds 2**24, so ds4's (float)bsum conversion rounds (to nearest even)
    grid = [np.frombuffer(int(g).to_bytes(8, "little"), np.uint8).astype(int) for g in iq2xxs_tables.IQ2XXS_GRID]
    grid_idx = int(np.argmax([g.sum() for g in grid]))
    blk = np.zeros(66, np.uint8)
    blk[0:2] = np.array([1.0], np.float16).view(np.uint8)
    for g in range(8):
        blk[2 + 8 * g : 2 + 8 * g + 4] = grid_idx
        blk[2 + 8 * g + 4 : 2 + 8 * g + 8] = np.array([0xF0000000], "<u4").view(np.uint8)
    q = np.full(256, 127, np.int8)
    q[int(np.argmax(grid[grid_idx] % 2))] = 126  # lower the product of an odd grid value: the sum turns odd
    bsum = 31 * sum(int(grid[grid_idx][e % 8]) * int(q[e]) for e in range(256))
    assert bsum > 2**24 and float(np.float32(bsum)) != bsum
    d = np.array([1.0], np.float32)
    expected = np.float32(np.float32(0.125) * np.float32(bsum))
    assert vec_dot_iq2_xxs_q8_k(blk[None, :], q, d)[0] == expected
    assert vec_dot_iq2_xxs_q8_k(blk[None, :], q, d)[0] == _ref_dot_iq2_xxs(blk, q, d)


# ---------------------------------------------------------------------------------------------------
# the NEON branch of the same kernels (vfmaq = fused multiply-add)


def _round_f32(x: Fraction) -> np.float32:
    """Exact rational -> nearest float32 (ties to even), normal or subnormal; no overflow handling."""
    if x == 0:
        return np.float32(0)
    sign = -1 if x < 0 else 1
    x = abs(x)
    e = x.numerator.bit_length() - x.denominator.bit_length()
    while Fraction(2) ** e > x:
        e -= 1
    while Fraction(2) ** (e + 1) <= x:
        e += 1
    quantum = Fraction(2) ** max(e - 23, -149)
    m = round(x / quantum)  # Fraction.__round__ ties to even
    return np.float32(sign * float(m * quantum))


def _fma(a, b, c) -> np.float32:
    return _round_f32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))


def test_fma_f32_is_correctly_rounded():
    rng = np.random.default_rng(31)
    a = rng.standard_normal(2000).astype(np.float32)
    b = rng.standard_normal(2000).astype(np.float32)
    c = (rng.standard_normal(2000) * 10.0 ** rng.integers(-6, 6, 2000)).astype(np.float32)
    # double-rounding trap: a*b + c lies just above a float32 midpoint, below float64 resolution
    a[0] = b[0] = np.float32(1 + 2.0**-12)
    c[0] = np.float32(2.0**-60)
    a[1], b[1], c[1] = np.float32(3e-20), np.float32(2e-20), np.float32(-1e-45)  # subnormal result
    out = fma_f32(a, b, c)
    expect = np.array([_fma(x, y, z) for x, y, z in zip(a, b, c)], np.float32)
    assert np.array_equal(_bits(out), _bits(expect))
    assert out[0] == np.float32(1 + 2.0**-11 + 2.0**-23)  # naive float64-then-float32 gives 1 + 2**-11
    assert np.float32(np.float64(a[0]) * np.float64(b[0]) + np.float64(c[0])) != out[0]


def _ref_dot_q8_0_neon(row: np.ndarray, q: np.ndarray, d: np.ndarray) -> np.float32:
    acc = [[np.float32(0)] * 4, [np.float32(0)] * 4]
    for b in range(row.size // 34):
        blk = row[b * 34 : b * 34 + 34]
        wq = blk[2:].view(np.int8).astype(int)
        xq = q[b * 32 : b * 32 + 32].astype(int)
        scale = np.float32(_f16(blk[0], blk[1]) * d[b])
        for k in range(4):
            lane = sum(wq[i] * xq[i] for i in (*range(4 * k, 4 * k + 4), *range(16 + 4 * k, 16 + 4 * k + 4)))
            acc[b % 2][k] = _fma(np.float32(lane), scale, acc[b % 2][k])
    v = [np.float32(acc[0][k] + acc[1][k]) for k in range(4)]
    return np.float32(np.float32(v[0] + v[1]) + np.float32(v[2] + v[3]))


def _ref_dot_q2_k_neon(row: np.ndarray, q: np.ndarray, d: np.ndarray) -> np.float32:
    total = np.float32(0)
    for i in range(row.size // 84):
        blk = row[i * 84 : i * 84 + 84]
        sc, q2 = blk[0:16].astype(int), blk[16:80].astype(int)
        q8 = q[i * 256 : i * 256 + 256].astype(int)
        dd = np.float32(d[i] * _f16(blk[80], blk[81]))
        mm = np.float32(-d[i] * _f16(blk[82], blk[83]))
        summs = sum(int(q8[16 * j : 16 * j + 16].sum()) * (sc[j] >> 4) for j in range(16))
        total = np.float32(total + np.float32(mm * np.float32(summs)))
        isum = 0
        for e in range(256):  # element 128h + 32j + l uses bits 2j of qs[32h + l], scale of sub-block e // 16
            h, j, l = e // 128, (e % 128) // 32, e % 32
            isum += (sc[e // 16] & 15) * ((q2[32 * h + l] >> (2 * j)) & 3) * q8[e]
        total = np.float32(total + np.float32(dd * np.float32(isum)))
    return total


def _ref_dot_iq2_xxs_neon(row: np.ndarray, q: np.ndarray, d: np.ndarray) -> np.float32:
    """NEON: float sums of sumi * (0.5 + scale), even and odd groups apart, then 0.25 * sum of dd * (s1 + s2)."""
    sumf = np.float32(0)
    for dd, groups in _iq2_xxs_group_sums(row, q, d):
        s12 = [np.float32(0), np.float32(0)]
        for ib, (p, s) in enumerate(groups):
            s12[ib % 2] = np.float32(s12[ib % 2] + np.float32(np.float32(p) * np.float32(0.5 + s)))
        sumf = np.float32(sumf + np.float32(dd * np.float32(s12[0] + s12[1])))
    return np.float32(np.float32(0.25) * sumf)


NEON_REFS = {"Q8_0": _ref_dot_q8_0_neon, "Q2_K": _ref_dot_q2_k_neon, "IQ2_XXS": _ref_dot_iq2_xxs_neon}


@pytest.mark.parametrize("name,fn,ref,quant", DOT_CASES, ids=[c[0] for c in DOT_CASES])
def test_vec_dot_neon_variant_matches_c_loop(name, fn, ref, quant):
    rows, cols = 4, 768 if name == "Q8_0" else 512  # Q8_0: 24 blocks, an even count and both lane vectors
    w = _weights(name, rows, cols, seed=41)
    rng = np.random.default_rng(42)
    x = (rng.standard_normal((2, cols)) * 4).astype(np.float32)
    q, d = quant(x)
    out = fn(w, q, d, variant="neon")
    expect = np.array([[NEON_REFS[name](w[r], q[t], d[t]) for r in range(rows)] for t in range(2)], np.float32)
    assert np.array_equal(_bits(out), _bits(expect))
    scalar = fn(w, q, d)
    np.testing.assert_allclose(out, scalar, rtol=1e-4, atol=1e-6)  # same value, other rounding order
    if name == "IQ2_XXS":
        assert np.array_equal(out, scalar)  # all NEON partial sums are exact here (see the docstring)
    else:
        assert (out != scalar).any()  # the data tells the two orders apart


def test_vec_dot_odd_block_count_neon_q8_0():
    w = _weights("Q8_0", 3, 96, seed=5)  # 3 blocks: the last one goes to the first lane vector
    q, d = quantize_q8_0_activation(np.random.default_rng(6).standard_normal(96).astype(np.float32))
    out = vec_dot_q8_0_q8_0(w, q, d, variant="neon")
    expect = np.array([_ref_dot_q8_0_neon(w[r], q, d) for r in range(3)], np.float32)
    assert np.array_equal(_bits(out), _bits(expect))
    with pytest.raises(QuantError, match="unknown dot-product variant 'avx'"):
        vec_dot_q8_0_q8_0(w, q, d, variant="avx")


# ---------------------------------------------------------------------------------------------------
# real tensors: the oracle's tiny model (same tensor types and layouts as DS4 Flash)


def test_tiny_model_tensors_match_gguf(tiny_model_path):
    from ds4_mlx.formats.gguf import GGUFFile  # gguf-py's own reader takes seconds on the vocab metadata

    seen: dict[str, int] = {}
    with GGUFFile(tiny_model_path) as f:
        for info in f.tensors.values():
            qt = info.ggml_type
            if seen.get(qt.name, 0) >= 2 or info.n_elements > (1 << 21):  # skip the huge embedding/output
                continue
            seen[qt.name] = seen.get(qt.name, 0) + 1
            raw = f.tensor_array(info.name)  # typed for F32/F16/I32, uint8 rows (..., row_bytes) for block types
            flat = dequantize(f.tensor_data(info.name), qt, info.n_elements)
            rows = dequantize_rows(raw, qt)
            if qt == GGMLType.I32:
                assert np.array_equal(flat, raw.reshape(-1)) and np.array_equal(rows, raw)
                continue
            with np.errstate(all="ignore"):
                ref = gguf_dequantize(raw, gguf.GGMLQuantizationType(int(qt)))
            assert rows.shape == ref.shape == info.shape, info.name
            assert np.array_equal(_bits(rows), _bits(ref)), info.name
            assert np.array_equal(_bits(flat), _bits(ref).reshape(-1)), info.name
            if raw.dtype == np.uint8:
                mlx_rows = dequantize_rows(mx.array(raw), qt)
                assert np.array_equal(_bits(np.array(mlx_rows)), _bits(ref)), info.name
    assert {"F32", "F16", "Q8_0", "Q2_K", "IQ2_XXS", "I32"} <= set(seen)
