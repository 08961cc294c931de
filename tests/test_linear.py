"""DenseWeight / ExpertWeights: storage policy, DEFAULT fast path, and DS4_CPU bit-exactness.

The DS4_CPU references here are scalar re-statements of ds4.c's portable loops (per row, per block, in
ds4's order, with numpy float32 scalars so every operation rounds like C's float), written from ds4.c
independently of the vectorized code under test. DS4_CPU is expected to be *bit-identical* to them:
integer block sums are exact in both, and every float32 operation is the same operation on the same
operands in the same order. (Zero signs included: ds4 starts its accumulators at +0.0.)
"""

from __future__ import annotations

import ds4_mlx  # noqa: F401  (first: binds MLX to a fast BLAS before mlx.core loads)
import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.errors import LayoutError
from ds4_mlx.formats import quants
from ds4_mlx.formats.ggml_types import BLOCK_GEOMETRY, GGMLType
from ds4_mlx.formats.gguf import GGUFFile
from ds4_mlx.formats.iq2xxs_tables import IQ2XXS_GRID, KSIGNS_IQ2XS
from ds4_mlx.model import experts as experts_mod
from ds4_mlx.model import linear as linear_mod
from ds4_mlx.model import numerics as numerics_mod
from ds4_mlx.model.experts import ExpertCache
from ds4_mlx.model.experts import ExpertWeights
from ds4_mlx.model.linear import Backend, DenseWeight, q8_0_to_affine, resolve_backend
from ds4_mlx.model.ops import Numerics, ops_for
from fp_bounds import assert_within_matmul_bound

F32 = np.float32


def f32(v) -> np.float32:
    return np.float32(v)


def f16_at(b: np.ndarray, off: int) -> np.float32:
    return f32(np.frombuffer(bytes(b[off:off + 2]), dtype="<f2")[0])


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


# --------------------------------------------------------------------------------------------------
# scalar re-statements of ds4.c (portable branch)


def ref_quantize_q8_0_act(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """quantize_q8_0_activation: per 32, d = amax / 127, id = 1 / d, q = lrintf(x * id) clamped."""
    n = x.size
    q = np.zeros(n, np.int64)
    ds = np.zeros(n // 32, np.float32)
    for b in range(n // 32):
        blk = x[32 * b:32 * b + 32]
        amax = f32(0)
        for v in blk:
            if abs(v) > amax:
                amax = f32(abs(v))
        d = f32(amax / f32(127))
        idv = f32(f32(1) / d) if d != 0 else f32(0)
        ds[b] = d
        for i, v in enumerate(blk):
            q[32 * b + i] = min(127, max(-128, int(np.rint(f32(v * idv)))))
    return q, ds


def ref_quantize_q8_k_act(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ds4_quantize_row_q8_K: per 256, max = first value of largest |x|, iscale = -127 / max."""
    n = x.size
    q = np.zeros(n, np.int64)
    ds = np.zeros(n // 256, np.float32)
    for b in range(n // 256):
        blk = x[256 * b:256 * b + 256]
        amax, vmax = f32(0), f32(0)
        for v in blk:
            if abs(v) > amax:
                amax, vmax = f32(abs(v)), v
        if amax == 0:
            continue
        iscale = f32(f32(-127) / vmax)
        for i, v in enumerate(blk):
            q[256 * b + i] = min(127, max(-128, int(np.rint(f32(iscale * v)))))
        ds[b] = f32(f32(1) / iscale)
    return q, ds


def ref_dot_q8_0(row: np.ndarray, x: np.ndarray) -> np.float32:
    """dot_q8_0_row: acc += (f16(w.d) * x.d) * (float)isum, block by block from 0.0f."""
    xq, xd = ref_quantize_q8_0_act(x)
    acc = f32(0)
    for b in range(x.size // 32):
        blk = row[34 * b:34 * b + 34]
        wq = blk[2:].view(np.int8).astype(np.int64)
        isum = int((wq * xq[32 * b:32 * b + 32]).sum())
        acc = f32(acc + f32(f32(f16_at(blk, 0) * xd[b]) * f32(isum)))
    return acc


def ref_dot_f16(row: np.ndarray, x: np.ndarray) -> np.float32:
    """dot_f16_row: acc += f16_to_f32(w[i]) * x[i], i = 0, 1, ... from 0.0f."""
    acc = f32(0)
    for w, v in zip(row.astype(np.float32), x):
        acc = f32(acc + f32(w * v))
    return acc


def ref_dot_f32(row: np.ndarray, x: np.ndarray) -> np.float32:
    """matvec_f32_worker: double acc += (double)w[i] * x[i]; (float)acc."""
    acc = 0.0
    for w, v in zip(row, x):
        acc += float(w) * float(v)
    return f32(acc)


def ref_dot_iq2_xxs(row: np.ndarray, x: np.ndarray) -> np.float32:
    """ds4_vec_dot_iq2_xxs_q8_K (portable): bsum += sumi * (2 * (aux1 >> 28) + 1) per group of 32,
    sumf += (f16(x.d) * y.d) * (float)bsum per block, result 0.125f * sumf."""
    q8, yd = ref_quantize_q8_k_act(x)
    sumf = f32(0)
    for i in range(x.size // 256):
        blk = row[66 * i:66 * i + 66]
        d = f32(f16_at(blk, 0) * yd[i])
        bsum = 0
        for ib32 in range(8):
            grp = blk[2 + 8 * ib32:10 + 8 * ib32]
            aux1 = int(grp[4]) | int(grp[5]) << 8 | int(grp[6]) << 16 | int(grp[7]) << 24
            ls = 2 * (aux1 >> 28) + 1
            sumi = 0
            for l in range(4):
                grid = IQ2XXS_GRID[int(grp[l])]
                signs = KSIGNS_IQ2XS[(aux1 >> (7 * l)) & 127]
                for k in range(8):
                    v = (grid >> (8 * k)) & 0xFF
                    if signs & (1 << k):
                        v = -v
                    sumi += v * int(q8[256 * i + 32 * ib32 + 8 * l + k])
            bsum += sumi * ls
        sumf = f32(sumf + f32(d * f32(bsum)))
    return f32(f32(0.125) * sumf)


def ref_dot_q2_k(row: np.ndarray, x: np.ndarray) -> np.float32:
    """ds4_vec_dot_q2_K_q8_K (portable), with its pointer walk over q2 / q8 / scales."""
    q8, yd = ref_quantize_q8_k_act(x)
    sumf = f32(0)
    for i in range(x.size // 256):
        blk = row[84 * i:84 * i + 84]
        sc, qs = blk[0:16], blk[16:80]
        y = q8[256 * i:256 * i + 256]
        bsums = [int(y[16 * j:16 * j + 16].sum()) for j in range(16)]
        summs = sum(bsums[j] * (int(sc[j]) >> 4) for j in range(16))
        dall = f32(yd[i] * f16_at(blk, 80))
        dmin = f32(yd[i] * f16_at(blk, 82))
        isum, is_, q2o, q8o = 0, 0, 0, 0
        for _ in range(2):
            shift = 0
            for _ in range(4):
                for half in range(2):
                    dd = int(sc[is_]) & 15
                    is_ += 1
                    isuml = sum(((int(qs[q2o + 16 * half + l]) >> shift) & 3) * int(y[q8o + 16 * half + l])
                                for l in range(16))
                    isum += dd * isuml
                shift += 2
                q8o += 32
            q2o += 32
        sumf = f32(sumf + f32(f32(dall * f32(isum)) - f32(dmin * f32(summs))))
    return sumf


def ref_dot_q4_k(row: np.ndarray, x: np.ndarray) -> np.float32:
    """DS4_CPU's Q4_K (ds4's May tree had no CPU Q4_K dot; b0309611's ds4_vec_dot_q4_K_q8_K is this):
    isum = sum_b sc_b * sum(nibble * q8), summs = sum_b m_b * sum(q8),
    sumf += (y.d * d) * isum - (y.d * dmin) * summs per block."""
    q8, yd = ref_quantize_q8_k_act(x)
    sumf = f32(0)
    for i in range(x.size // 256):
        blk = row[144 * i:144 * i + 144]
        sc = [int(v) for v in blk[4:16]]
        isum, summs = 0, 0
        for b in range(8):
            if b < 4:
                s, m = sc[b] & 63, sc[b + 4] & 63
            else:
                s = (sc[b + 4] & 15) | ((sc[b - 4] >> 6) << 4)
                m = (sc[b + 4] >> 4) | ((sc[b] >> 6) << 4)
            qs = blk[16 + 32 * (b // 2):16 + 32 * (b // 2) + 32].astype(np.int64)
            nib = (qs >> (4 * (b % 2))) & 15
            y = q8[256 * i + 32 * b:256 * i + 32 * b + 32]
            isum += s * int((nib * y).sum())
            summs += m * int(y.sum())
        dall = f32(yd[i] * f16_at(blk, 0))
        dmin = f32(yd[i] * f16_at(blk, 2))
        sumf = f32(sumf + f32(f32(dall * f32(isum)) - f32(dmin * f32(summs))))
    return sumf


def ref_dot_mxfp4(row: np.ndarray, x: np.ndarray) -> np.float32:
    """ds4_vec_dot_mxfp4_f32 (ds4.c b0309611) on float activations, ds4's e8m0 and value tables:
    ``sumf += d * values[q & 15] * y[j]; sumf += d * values[q >> 4] * y[j + 16]`` per byte j."""
    values = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    sumf = f32(0)
    for b in range(x.size // 32):
        blk = row[17 * b:17 * b + 17]
        e = int(blk[0])
        d = np.array([0x00400000 if e == 0 else e << 23], dtype=np.uint32).view(np.float32)[0]
        for j in range(16):
            q = int(blk[1 + j])
            sumf = f32(sumf + f32(f32(d * f32(values[q & 15])) * x[32 * b + j]))
            sumf = f32(sumf + f32(f32(d * f32(values[q >> 4])) * x[32 * b + j + 16]))
    return sumf


REF_DOT = {GGMLType.IQ2_XXS: ref_dot_iq2_xxs, GGMLType.Q2_K: ref_dot_q2_k, GGMLType.Q4_K: ref_dot_q4_k,
           GGMLType.MXFP4: ref_dot_mxfp4}


# --------------------------------------------------------------------------------------------------
# helpers


def random_blocks(rng, qtype: GGMLType, lead: tuple[int, ...], n_in: int) -> np.ndarray:
    elems, block_bytes = BLOCK_GEOMETRY[qtype]
    nb = n_in // elems
    raw = rng.integers(0, 256, size=(*lead, nb, block_bytes), dtype=np.uint8)
    if qtype == GGMLType.MXFP4:  # E8M0 scales 2^-17..2^2
        raw[..., 0] = rng.integers(110, 130, size=(*lead, nb)).astype(np.uint8)
        return raw.reshape(*lead, nb * block_bytes)
    offsets = {GGMLType.IQ2_XXS: (0,), GGMLType.Q2_K: (80, 82), GGMLType.Q4_K: (0, 2), GGMLType.Q8_0: (0,)}[qtype]
    for off in offsets:
        d = (rng.uniform(0.2, 2.0, size=(*lead, nb)) * rng.choice([1e-3, 3e-2], size=(*lead, nb))).astype(np.float16)
        raw[..., off:off + 2] = d.view(np.uint8).reshape(*lead, nb, 2)
    return raw.reshape(*lead, nb * block_bytes)


def activations(rng, shape) -> np.ndarray:
    """Gaussian rows with per-row scales spread over decades, some exact ties, and one zero block."""
    x = rng.standard_normal(shape).astype(np.float32) * (10.0 ** rng.uniform(-3, 2, size=(*shape[:-1], 1))).astype(F32)
    x[..., 5] = x[..., 3]  # equal values: the same rounding decision twice
    x.reshape(-1, shape[-1])[0, :32] = 0.0  # an all-zero quantization block
    return x


def dense(qtype: GGMLType, raw: np.ndarray, n_in: int, **kw) -> DenseWeight:
    return DenseWeight("w", qtype, raw, n_in, **kw)


def experts(qtype: GGMLType, raw: np.ndarray, n_in: int, **kw) -> ExpertWeights:
    e = ExpertWeights("e", qtype, raw, n_in, **kw)
    e.cache = ExpertCache(0)  # no sharing between tests unless a test asks for it
    return e


# --------------------------------------------------------------------------------------------------
# backend policy and Q8_0 -> affine


def test_a_weight_built_without_the_plan_takes_the_cpu_forms(monkeypatch):
    """Nothing below the loader reads the device (#23): with no backend a weight holds the CPU form
    (float32, right on any device) even where the machine is a GPU; the loader passes its plan's."""
    from ds4_mlx.model import load_plan

    monkeypatch.setattr(load_plan, "detect_backend", lambda: "cuda")
    assert resolve_backend(None) is Backend.CPU
    raw = np.zeros((4, 34), np.uint8)
    assert DenseWeight("w", GGMLType.Q8_0, raw, 32).form == "float32"
    assert DenseWeight("w", GGMLType.Q8_0, raw, 32, backend="cuda").form == "affine"
    assert DenseWeight("w", GGMLType.Q8_0, raw, 32, backend="metal", use_kernels=True).form == "blocks"
    assert DenseWeight("w", GGMLType.F16, np.zeros((4, 32), np.float16), 32, backend="cuda").form == "half"
    assert DenseWeight("w", GGMLType.Q8_0, raw, 32, backend="cuda").rows(1, 3).form == "affine"


def test_resolve_backend_names():
    assert resolve_backend("metal") is Backend.METAL and resolve_backend(Backend.CPU) is Backend.CPU
    assert resolve_backend("cuda") is Backend.CUDA and Backend.CUDA.gpu and not Backend.CPU.gpu
    with pytest.raises(ValueError):
        resolve_backend("rocm")


def test_q8_0_to_affine_is_lossless():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 256)).astype(np.float32)
    raw = quants.quantize_q8_0(x).reshape(64, 8, 34)
    raw[0, :, 2:] = np.array([-128, 127, 0, -1] * 8, dtype=np.int8).view(np.uint8)  # code extremes
    d = raw[:, :, 0:2].copy().view("<f2")
    d[1, 0] = np.float16(6e-8)  # f16 subnormal
    d[2, 1] = np.float16(0.0)
    d[3] = -d[3]  # negative scales
    d[4, 2] = np.float16(65504.0)  # largest f16
    raw[:, :, 0:2] = d.view(np.uint8).reshape(64, 8, 2)
    raw = raw.reshape(64, 8 * 34)
    wq, scales, biases = q8_0_to_affine(raw)
    got = mx.dequantize(wq, scales, biases, group_size=32, bits=8)
    assert got.dtype == mx.float32
    want = quants.dequantize_rows(raw, GGMLType.Q8_0)
    # equal as values (d*(q+128) - 128d gives +0.0 where the Q8_0 product d*0 may be -0.0)
    assert np.array_equal(np.array(got), want)


@pytest.mark.parametrize("backend", ["cpu", "metal"])
def test_backend_decides_storage(backend):
    rng = np.random.default_rng(2)
    raw = quants.quantize_q8_0(rng.standard_normal((48, 128)).astype(np.float32))
    w = dense(GGMLType.Q8_0, raw, 128, backend=backend)
    x = rng.standard_normal((3, 128)).astype(np.float32)
    y = np.array(w(mx.array(x)))
    wd = quants.dequantize_rows(raw, GGMLType.Q8_0).astype(np.float64)
    np.testing.assert_allclose(y, x @ wd.T, rtol=0, atol=1e-5 * np.abs(x).sum(1, keepdims=True).max())
    if backend == "cpu":
        assert w._dense_t is not None and w._affine is None and w._dense is None
    else:  # mx.quantized_matmul on the affine form (it also runs on the CPU, slowly)
        assert w._affine is not None and w._dense is None


# --------------------------------------------------------------------------------------------------
# DEFAULT numerics


@pytest.mark.parametrize("qtype", [GGMLType.Q8_0, GGMLType.F16, GGMLType.F32])
def test_default_matches_float64_matmul(qtype):
    rng = np.random.default_rng(int(qtype))
    out_dim, n_in = 40, 96
    wf = rng.standard_normal((out_dim, n_in)).astype(np.float32)
    raw = {GGMLType.Q8_0: quants.quantize_q8_0(wf), GGMLType.F16: wf.astype(np.float16), GGMLType.F32: wf}[qtype]
    w = dense(qtype, raw, n_in, backend="cpu")
    x = rng.standard_normal((2, 3, n_in)).astype(np.float32)
    y = np.array(w(mx.array(x)))
    assert y.shape == (2, 3, out_dim) and y.dtype == np.float32
    wd = quants.dequantize_rows(raw, GGMLType.Q8_0) if qtype == GGMLType.Q8_0 else np.asarray(raw, np.float32)
    ref = x.astype(np.float64) @ wd.astype(np.float64).T
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", [GGMLType.Q8_0, GGMLType.F16, GGMLType.F32])
def test_cpu_transposed_operand_gives_the_same_product(qtype):
    # The CPU fast path multiplies the transposed copy (sgemm NN, faster for one token) instead of
    # the row-major weight (sgemm NT). The operand is the same numbers (asserted bit for bit); the
    # products are the same sums in an order OpenBLAS picks per form, kernel family and thread split
    # (equal bits on Haswell kernels, not on every machine's), so they are held to the float32 bound.
    rng = np.random.default_rng(11 + int(qtype))
    out_dim, n_in = 1000, 96
    wf = rng.standard_normal((out_dim, n_in)).astype(np.float32)
    raw = {GGMLType.Q8_0: quants.quantize_q8_0(wf), GGMLType.F16: wf.astype(np.float16), GGMLType.F32: wf}[qtype]
    w = dense(qtype, raw, n_in, backend="cpu")
    assert np.array_equal(np.array(w.dense_t()), np.array(w.dense()).T)
    for T in (1, 3, 64, 130):
        x = mx.array(rng.standard_normal((T, n_in)).astype(np.float32))
        assert_within_matmul_bound(np.array(w(x)), np.array(mx.matmul(x, w.dense().T)), x, w.dense(), f"T={T}")


@pytest.mark.parametrize("numerics", ["default", "ds4-cpu"])
def test_grouped_product_is_each_groups_rows_alone(numerics):
    """The attention's grouped low-rank output (``ops.grouped_linear``): one batched matmul on the CPU
    backend in default numerics, group by group in ds4-cpu; either way each group's result is the
    bits of its row slice multiplied alone (what the attention computed before, and ds4's order)."""
    rng = np.random.default_rng(4)
    G, rows, n_in = 8, 96, 512
    raw = quants.quantize_q8_0(rng.standard_normal((G * rows, n_in)).astype(np.float32))
    w = dense(GGMLType.Q8_0, raw, n_in, backend="cpu")
    ops = ops_for(Numerics(numerics))
    for L in (1, 3, 37):
        x = mx.array(rng.standard_normal((L, G, n_in)).astype(np.float32))
        got = np.array(ops.grouped_linear(w, x))
        assert got.shape == (L, G * rows)
        for g, part in enumerate(w.groups(G)):
            alone = np.array(ops.linear(part, x[:, g]))
            assert np.array_equal(got[:, g * rows:(g + 1) * rows].view(np.uint32), alone.view(np.uint32)), (L, g)
    with pytest.raises(LayoutError, match="do not split into 7 groups"):
        w.groups(7)
    with pytest.raises(LayoutError, match="does not fit"):
        w.grouped(mx.zeros((1, G, n_in - 32)))


_BUILD_PEAK = r"""
import sys
import numpy as np
import ds4_mlx
import mlx.core as mx
from ds4_mlx.formats import quants
from ds4_mlx.formats.ggml_types import GGMLType
from ds4_mlx.model.linear import DenseWeight

def kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])

out_dim, n_in = 8192, 4096  # 128 MiB as float32
rng = np.random.default_rng(0)
raw = rng.integers(0, 256, (out_dim, n_in // 32, 34), dtype=np.uint8)
raw[:, :, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)  # finite scales
raw = raw.reshape(out_dim, -1)
w = DenseWeight("w", GGMLType.Q8_0, raw, n_in, "cpu")
form = sys.argv[1]
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM to the current RSS
before = kib("VmRSS")
a = {"dense_t": w.dense_t, "dense": w.dense, "ds4": lambda: w._ds4_q8_0()[0]}[form]()
mx.eval(a)
peak = kib("VmHWM") - before
want = quants.dequantize_rows(raw[:7], GGMLType.Q8_0)
if form == "ds4":  # the int8 codes [nb, 32, out] and the block scales [nb, out]
    wq, wd = (np.array(t) for t in w._ds4_q8_0())
    got = (wq[:, :, :7] * wd[:, None, :7]).reshape(-1, 7).T
else:
    got = np.array(a)[:, :7].T if form == "dense_t" else np.array(a)[:7]
assert np.array_equal(got, want)
print(peak)
"""


@pytest.mark.parametrize("form", ["dense_t", "dense", "ds4"])
def test_float32_cache_is_built_without_a_second_copy(form):
    # mx.array(numpy) copies: building the whole float32 matrix in numpy first held it twice at the
    # peak (2 GiB more for the real model's output head; ds4-cpu's int8-codes-as-float32 form three
    # times). Built through a view of the MLX buffer, the peak is the matrix plus one ~16 MiB slab.
    import os
    import subprocess
    import sys

    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS")
    run = subprocess.run([sys.executable, "-c", _BUILD_PEAK, form], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    peak_mib = int(run.stdout.split()[-1]) / 1024
    assert 128 <= peak_mib < 128 * 1.4, f"building a 128 MiB float32 cache peaked at +{peak_mib:.0f} MiB"


def test_rows_share_caches_and_match_parent():
    rng = np.random.default_rng(5)
    raw = quants.quantize_q8_0(rng.standard_normal((64, 64)).astype(np.float32))
    w = dense(GGMLType.Q8_0, raw, 64, backend="cpu")
    part = w.rows(16, 40).rows(4, 10)  # rows 20..29 of the parent
    assert part.shape == (6, 64) and part.name == "w[20:26]"
    x = mx.array(rng.standard_normal((3, 64)).astype(np.float32))
    for numerics in Numerics:
        full = np.array(ops_for(numerics).linear(w, x))
        got = np.array(ops_for(numerics).linear(part, x))
        if numerics is Numerics.DS4_CPU:
            # integer block sums (exact in any order) and ds4's fixed per-row float order: bit-exact
            np.testing.assert_array_equal(got, full[:, 20:26])
        else:
            # DEFAULT is one BLAS GEMM, [3, 64] x [64, 64]^T vs [3, 64] x [6, 64]^T: OpenBLAS may pick
            # other kernels / blockings for other shapes (and threads), summing the 64 products in
            # another order (measured: 9.5e-7 apart on a loaded 2-core machine). Any two orders of a
            # float32 sum of n products are within 2*gamma(n-1)*sum|x*w| of each other
            # (gamma(k) = k*u/(1-k*u), u = 2^-24; Higham, Accuracy and Stability, §3.1) — a rounding
            # bound, ~1e-5 here; rows taken from the wrong place would be O(1) off.
            assert_within_matmul_bound(got, full[:, 20:26], x, np.array(w.dense())[20:26], "rows 20..25")
    assert part._dense is None and part._ds4 is None and w._dense is not None and w._ds4 is not None
    with pytest.raises(LayoutError, match="row range"):
        w.rows(10, 65)


def test_dense_rejects_bad_input():
    rng = np.random.default_rng(6)
    with pytest.raises(LayoutError, match="not a dense matmul type"):
        dense(GGMLType.Q2_K, random_blocks(rng, GGMLType.Q2_K, (4,), 256), 256)
    with pytest.raises(LayoutError, match="do not hold"):
        dense(GGMLType.Q8_0, np.zeros((4, 35), np.uint8), 32)
    w = dense(GGMLType.F32, np.zeros((4, 32), np.float32), 32)
    with pytest.raises(LayoutError, match="last axis must be 32"):
        w(mx.zeros((2, 31)))


# --------------------------------------------------------------------------------------------------
# DS4_CPU numerics, dense


def test_mlx_cumsum_is_a_sequential_scan():
    """DS4_CPU relies on it for small F16/F32 products: pairwise summation would give other bits."""
    rng = np.random.default_rng(7)
    a = (rng.standard_normal((5, 3, 700)) * 10.0 ** rng.uniform(-4, 4, (5, 3, 700))).astype(np.float32)
    seq = np.zeros((5, 3), np.float32)
    for i in range(a.shape[-1]):
        seq = seq + a[..., i]
    assert not np.array_equal(a.sum(-1), seq)  # the data does distinguish summation orders
    assert np.array_equal(np.array(mx.cumsum(mx.array(a), axis=-1))[..., -1], seq)


@pytest.mark.parametrize("chunk", [None, 1000])
def test_ds4_q8_0_bit_exact(monkeypatch, chunk):
    if chunk is not None:  # force several token chunks
        monkeypatch.setattr(linear_mod, "DS4_CHUNK_ELEMENTS", chunk)
    rng = np.random.default_rng(8)
    out_dim, n_in, T = 12, 160, 4
    raw = quants.quantize_q8_0(rng.standard_normal((out_dim, n_in)).astype(np.float32) * 0.05)
    x = activations(rng, (T, n_in))
    y = np.array(dense(GGMLType.Q8_0, raw, n_in).ds4_cpu(mx.array(x)))
    ref = np.array([[ref_dot_q8_0(raw[o], x[t]) for o in range(out_dim)] for t in range(T)])
    assert np.array_equal(bits(y), bits(ref))


@pytest.mark.parametrize("qtype", [GGMLType.F16, GGMLType.F32])
@pytest.mark.parametrize("branch", ["scan", "loop"])
def test_ds4_f16_f32_bit_exact(monkeypatch, qtype, branch):
    monkeypatch.setattr(numerics_mod, "_LOOP_MIN_OUTPUTS", 0 if branch == "loop" else 1 << 30)
    rng = np.random.default_rng(9)
    out_dim, n_in, T = 10, 300, 3
    wf = (rng.standard_normal((out_dim, n_in)) * 10.0 ** rng.uniform(-3, 1, (out_dim, 1))).astype(np.float32)
    raw = wf.astype(np.float16) if qtype == GGMLType.F16 else wf
    x = activations(rng, (T, n_in))
    x[2] = 0.0
    raw[0] = -np.abs(raw[0])  # with a zero input its products are -0.0: ds4's sum is +0.0
    y = np.array(dense(qtype, raw, n_in).ds4_cpu(mx.array(x)))
    ref_fn = ref_dot_f16 if qtype == GGMLType.F16 else ref_dot_f32
    ref = np.array([[ref_fn(raw[o], x[t]) for o in range(out_dim)] for t in range(T)], dtype=np.float32)
    assert np.array_equal(bits(y), bits(ref))
    assert bits(y)[2, 0] == 0  # +0.0


def test_ds4_dense_on_tiny_model(tiny_model_path):
    f = GGUFFile(tiny_model_path)
    rng = np.random.default_rng(10)
    for name in ("blk.0.attn_q_a.weight", "blk.2.attn_q_b.weight", "blk.2.attn_output_b.weight",
                 "blk.2.hc_attn_fn.weight", "blk.2.attn_compressor_kv.weight", "blk.3.ffn_gate_inp.weight"):
        w = DenseWeight.from_gguf(f, name)
        raw = f.tensor_array(name)
        x = activations(rng, (3, w.shape[1]))
        y = np.array(w.ds4_cpu(mx.array(x)))
        if w.qtype == GGMLType.Q8_0:
            # every row against the vectorized re-statement, a few against the scalar one
            q, d = quants.quantize_q8_0_activation(x)
            assert np.array_equal(bits(y), bits(quants.vec_dot_q8_0_q8_0(raw, q, d))), name
            ref_fn = ref_dot_q8_0
        else:
            ref_fn = ref_dot_f16
        for o in rng.choice(w.shape[0], 3, replace=False):
            ref = np.array([ref_fn(raw[o], x[t]) for t in range(3)], dtype=np.float32)
            assert np.array_equal(bits(y[:, o]), bits(ref)), (name, o)
        # and the fast path is the same function up to float rounding
        y0 = np.array(w(mx.array(x)))
        assert np.abs(y0 - y).max() <= 0.05 * np.abs(y0).max() + 1e-6, name


# --------------------------------------------------------------------------------------------------
# experts


def expert_reference(raw, qtype, x, ids) -> np.ndarray:
    T, k = ids.shape
    out = np.zeros((T, k, raw.shape[1]))
    for t in range(T):
        for j in range(k):
            w = quants.dequantize_rows(raw[ids[t, j]], qtype).astype(np.float64)
            out[t, j] = w @ x[t, j if x.shape[1] > 1 else 0].astype(np.float64)
    return out


@pytest.mark.parametrize("qtype", [GGMLType.IQ2_XXS, GGMLType.Q2_K, GGMLType.Q4_K, GGMLType.MXFP4])
@pytest.mark.parametrize("T,kx", [(1, 1), (1, 3), (6, 1), (6, 3)])
def test_experts_default_matches_numpy(qtype, T, kx):
    rng = np.random.default_rng(int(qtype) * 10 + T + kx)
    n_expert, out_dim, n_in, k = 7, 16, 512, 3
    raw = random_blocks(rng, qtype, (n_expert, out_dim), n_in)
    ids = np.stack([rng.choice(n_expert, k, replace=False) for _ in range(T)])
    x = rng.standard_normal((T, kx, n_in)).astype(np.float32)
    e = experts(qtype, raw, n_in, backend="cpu")
    y = np.array(e(mx.array(x), ids))
    assert y.shape == (T, k, out_dim)
    ref = expert_reference(raw, qtype, x, ids)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    # only the selected experts were read, once each
    assert e.bytes_read == e.bytes_selected == len(np.unique(ids)) * e.expert_nbytes
    assert e.expert_nbytes == out_dim * raw.shape[2]


def test_expert_cache_reads_each_expert_once():
    rng = np.random.default_rng(11)
    raw = random_blocks(rng, GGMLType.Q2_K, (8, 8), 256)
    e = experts(GGMLType.Q2_K, raw, 256, backend="cpu", native=False)  # the cache serves the MLX path
    e.cache = ExpertCache(2 * 8 * 256 * 4)  # room for two dense experts
    x = mx.array(rng.standard_normal((1, 1, 256)).astype(np.float32))
    y1 = np.array(e(x, np.array([[3, 5]])))
    assert e.bytes_read == 2 * e.expert_nbytes
    y2 = np.array(e(x, np.array([[5, 3]])))  # both cached
    assert e.bytes_read == 2 * e.expert_nbytes and e.bytes_selected == 4 * e.expert_nbytes
    np.testing.assert_array_equal(y2, y1[:, ::-1])
    e(x, np.array([[1, 3]]))  # 1 is read, the least recently used (5) is evicted
    assert e.bytes_read == 3 * e.expert_nbytes and e.cache.nbytes <= e.cache.limit_bytes
    e(x, np.array([[5]]))
    assert e.bytes_read == 4 * e.expert_nbytes
    assert e.calls == 4 and e.pairs == 7


@pytest.mark.parametrize("qtype", [GGMLType.IQ2_XXS, GGMLType.Q2_K, GGMLType.Q4_K, GGMLType.MXFP4])
@pytest.mark.parametrize("kx", [1, 3])
def test_experts_ds4_bit_exact(monkeypatch, qtype, kx):
    monkeypatch.setattr(experts_mod, "DS4_CHUNK_ELEMENTS", 4096)  # several row chunks per expert
    rng = np.random.default_rng(int(qtype) * 7 + kx)
    n_expert, out_dim, n_in, T, k = 6, 5, 512, 3, 3
    raw = random_blocks(rng, qtype, (n_expert, out_dim), n_in)
    ids = np.array([[0, 4, 2], [4, 1, 0], [5, 4, 3]])
    x = activations(rng, (T, kx, n_in))
    y = np.array(experts(qtype, raw, n_in).ds4_cpu(mx.array(x), ids))
    ref_fn = REF_DOT[qtype]
    ref = np.array([[[ref_fn(raw[ids[t, j], o], x[t, j if kx > 1 else 0]) for o in range(out_dim)]
                     for j in range(k)] for t in range(T)], dtype=np.float32)
    assert np.array_equal(bits(y), bits(ref))
    # the MLX-ops twin too (the default above is the native code when a compiler is there)
    twin = np.array(experts(qtype, raw, n_in, native=False).ds4_cpu(mx.array(x), ids))
    assert np.array_equal(bits(twin), bits(ref))


def test_iq2_xxs_ds4_block_sum_beyond_2_24():
    """Largest grid points, ls = 31, all signs +, same-signed inputs: each block's integer sum passes 2**24,
    so (float)bsum rounds; only an exact integer sum rounded once gives ds4's bits."""
    gmax = int(np.argmax([sum((v >> (8 * k)) & 0xFF for k in range(8)) for v in IQ2XXS_GRID]))
    blk = np.zeros(66, np.uint8)
    blk[0:2] = np.array([np.float16(0.01)]).view(np.uint8)
    for g in range(8):
        blk[2 + 8 * g:6 + 8 * g] = gmax
        blk[6 + 8 * g:10 + 8 * g] = np.array([15 << 28], dtype="<u4").view(np.uint8)  # ls = 31, all signs +
    raw = np.tile(blk, (1, 1, 2)).reshape(1, 1, 132)
    rng = np.random.default_rng(0)
    x = rng.uniform(0.36, 0.40, size=(1, 1, 512)).astype(np.float32)
    # the data must tell an exact integer sum from float32 sums of the eight per-group terms
    q8, _ = ref_quantize_q8_k_act(x[0, 0])
    grid = np.array([(IQ2XXS_GRID[gmax] >> (8 * k)) & 0xFF for k in range(8)] * 4)
    discriminates = False
    for i in range(2):
        groups = [31 * int((grid * q8[256 * i + 32 * g:256 * i + 32 * g + 32]).sum()) for g in range(8)]
        assert abs(sum(groups)) > 2 ** 24
        acc = f32(0)
        for v in groups:
            acc = f32(acc + f32(v))
        discriminates |= acc != f32(sum(groups))
    assert discriminates
    y = np.array(experts(GGMLType.IQ2_XXS, raw, 512).ds4_cpu(mx.array(x), np.array([[0]])))
    assert bits(y)[0, 0, 0] == bits(np.array([ref_dot_iq2_xxs(raw[0, 0], x[0, 0])]))[0]


def test_experts_ds4_on_tiny_model(tiny_model_path):
    f = GGUFFile(tiny_model_path)
    rng = np.random.default_rng(12)
    for name in ("blk.3.ffn_gate_exps.weight", "blk.3.ffn_down_exps.weight"):
        e = ExpertWeights.from_gguf(f, name)
        e.cache = ExpertCache(0)
        raw = f.tensor_array(name)
        n_expert, out_dim, n_in = e.shape
        T, k = 4, 4
        ids = np.stack([rng.choice(n_expert, k, replace=False) for _ in range(T)])
        kx = 1 if "gate" in name else k
        x = activations(rng, (T, kx, n_in))
        y = np.array(e.ds4_cpu(mx.array(x), ids))
        dot = quants.vec_dot_iq2_xxs_q8_k if e.qtype == GGMLType.IQ2_XXS else quants.vec_dot_q2_k_q8_k
        for t in range(T):
            for j in range(k):
                q, d = quants.quantize_q8_k_activation(x[t, j if kx > 1 else 0])
                assert np.array_equal(bits(y[t, j]), bits(dot(raw[ids[t, j]], q, d))), (name, t, j)
        ref_fn = REF_DOT[e.qtype]
        for o in rng.choice(out_dim, 2, replace=False):
            ref = ref_fn(raw[ids[1, 2], o], x[1, 2 if kx > 1 else 0])
            assert bits(np.array([y[1, 2, o]]))[0] == bits(np.array([ref]))[0], (name, o)
        y0 = np.array(e(mx.array(x), ids))
        ref = expert_reference(raw, e.qtype, x, ids)
        np.testing.assert_allclose(y0, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
        assert np.abs(y - ref).max() < 0.05 * np.abs(ref).max()


def test_experts_reject_bad_input():
    rng = np.random.default_rng(13)
    raw = random_blocks(rng, GGMLType.Q2_K, (4, 8), 256)
    e = experts(GGMLType.Q2_K, raw, 256)
    x = mx.zeros((2, 1, 256))
    with pytest.raises(LayoutError, match="outside 0..3"):
        e(x, np.array([[0, 4], [1, 2]]))
    with pytest.raises(LayoutError, match="does not fit"):
        e(mx.zeros((2, 3, 256)), np.array([[0, 1], [1, 2]]))
    with pytest.raises(LayoutError, match=r"\[T, k\]"):
        e(x, np.array([0, 1]))
    with pytest.raises(LayoutError, match="not a routed-expert type"):
        experts(GGMLType.Q8_0, np.zeros((4, 8, 34), np.uint8), 32)
    assert np.array(e(mx.zeros((0, 1, 256)), np.zeros((0, 2), np.int64))).shape == (0, 2, 8)


def test_grouped_dense_expert_path_is_bit_identical(monkeypatch):
    """Evaluating experts in memory-bounded groups gives the bits of the one-shot call."""
    from ds4_mlx.model import experts as ex
    from ds4_mlx.synth import q2_k_random_blocks

    rng = np.random.default_rng(5)
    n_exp, out_dim, n_in = 12, 64, 256
    raw = q2_k_random_blocks(rng, n_exp * out_dim, 0.05).reshape(n_exp, out_dim, -1)
    w = ex.ExpertWeights("t.ffn_down_exps.weight", ex.GGMLType.Q2_K, raw, n_in, backend="cpu", use_kernels=False)
    w.cache = ex.ExpertCache(0)
    x = mx.array(rng.standard_normal((40, 1, n_in)).astype(np.float32))
    ids = rng.integers(0, n_exp, (40, 4))
    whole = np.array(w(x, ids))
    w.group_bytes = 3 * out_dim * n_in * 4  # 3 experts per group (a load passes DS4_MLX_EXPERT_GROUP_MB's)
    grouped = np.array(w(x, ids))
    assert np.unique(ids).size > 3
    assert np.array_equal(whole.view(np.uint32), grouped.view(np.uint32))
