"""GPU kernels for raw GGUF blocks (one design, Metal and CUDA dialects) and their MLX-ops twins.

Layers of checks:
* the twins (what the CPU backend runs) against numpy dequantization + float64 matmul;
* the kernel sources themselves, in both dialects, on the strict host shim: tests/test_kernel_shim.py
  (which uses the helpers and bounds defined here);
* the CUDA dialect compiled by nvcc as MLX's ``cuda_kernel`` would build it (skipped without nvcc);
* on a machine with a Metal or CUDA GPU, the real kernels against the references (skipped elsewhere).
"""

from __future__ import annotations

import shutil
import subprocess

import ds4_mlx  # noqa: F401  (first: binds MLX to a fast BLAS before mlx.core loads)
import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.errors import LayoutError
from ds4_mlx.formats.ggml_types import BLOCK_GEOMETRY, GGMLType
from ds4_mlx.formats.quants import dequantize_rows, quantize_q8_0
from ds4_mlx.model import metal_kernels as mk

EXPERT_TYPES = (GGMLType.IQ2_XXS, GGMLType.Q2_K, GGMLType.Q4_K, GGMLType.MXFP4)


def random_rows(rng: np.random.Generator, qtype: GGMLType, lead: tuple[int, ...], n_in: int) -> np.ndarray:
    """Random but valid blocks: random bytes with finite, moderate f16 scales (MXFP4: E8M0 scales
    2^-11..2^-7, where ds4's values and gguf-py's agree up to the sign of zero)."""
    elems, block_bytes = BLOCK_GEOMETRY[qtype]
    nb = n_in // elems
    if qtype == GGMLType.Q8_0:
        return quantize_q8_0(rng.standard_normal((*lead, n_in)).astype(np.float32))
    raw = rng.integers(0, 256, size=(*lead, nb, block_bytes), dtype=np.uint8)
    if qtype == GGMLType.MXFP4:
        raw[..., 0] = rng.integers(116, 121, size=(*lead, nb), dtype=np.uint8)
        return raw.reshape(*lead, nb * block_bytes)
    scale_offsets = {GGMLType.IQ2_XXS: (0,), GGMLType.Q2_K: (80, 82), GGMLType.Q4_K: (0, 2)}[qtype]
    for off in scale_offsets:
        d = (rng.uniform(0.5, 2.0, size=(*lead, nb)) * 1e-3).astype(np.float16)
        raw[..., off:off + 2] = d.view(np.uint8).reshape(*lead, nb, 2)
    return raw.reshape(*lead, nb * block_bytes)


def pair_reference(slabs: np.ndarray, qtype: GGMLType, x: np.ndarray, slot, rows) -> np.ndarray:
    w = dequantize_rows(slabs, qtype).astype(np.float64)
    return np.stack([w[s] @ x[r].astype(np.float64) for s, r in zip(slot, rows)]).astype(np.float32)


def close(a: np.ndarray, b: np.ndarray, scale: np.ndarray, rel: float = 2e-6) -> None:
    """Equal up to float32 summation order: |a - b| <= rel * sum |w| |x| (per output)."""
    assert a.shape == b.shape
    bad = np.abs(a.astype(np.float64) - b) > rel * scale + 1e-30
    assert not bad.any(), f"{bad.sum()} outputs differ; worst {np.abs(a - b).max()}"


def abs_scale(slabs, qtype, x, slot, rows) -> np.ndarray:
    w = np.abs(dequantize_rows(slabs, qtype).astype(np.float64))
    return np.stack([w[s] @ np.abs(x[r]).astype(np.float64) for s, r in zip(slot, rows)])


# --------------------------------------------------------------------------------------------------
# twins


@pytest.mark.parametrize("qtype", EXPERT_TYPES)
@pytest.mark.parametrize("n_pairs", [1, 6, 37])
def test_expert_matmul_twin_matches_numpy(qtype, n_pairs):
    rng = np.random.default_rng(int(qtype) * 100 + n_pairs)
    u, out_dim, n_in, n_rows = 5, 24, 512, 9
    slabs = random_rows(rng, qtype, (u, out_dim), n_in)
    x = rng.standard_normal((n_rows, n_in)).astype(np.float32)
    slot = rng.integers(0, u, n_pairs)
    rows = rng.integers(0, n_rows, n_pairs)
    got = np.array(mk.expert_matmul_twin(mx.array(slabs), qtype, mx.array(x), slot, rows))
    close(got, pair_reference(slabs, qtype, x, slot, rows), abs_scale(slabs, qtype, x, slot, rows))


def test_q8_0_matvec_twin_matches_numpy():
    rng = np.random.default_rng(8)
    w = random_rows(rng, GGMLType.Q8_0, (40,), 256)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    got = np.array(mk.q8_0_matvec_twin(mx.array(w), mx.array(x)))
    wd = dequantize_rows(w, GGMLType.Q8_0).astype(np.float64)
    close(got, (x.astype(np.float64) @ wd.T), np.abs(x).astype(np.float64) @ np.abs(wd).T)


def test_twin_rejects_bad_pairs():
    rng = np.random.default_rng(0)
    slabs = mx.array(random_rows(rng, GGMLType.Q2_K, (2, 4), 256))
    x = mx.zeros((3, 256))
    with pytest.raises(LayoutError, match="out of range"):
        mk.expert_matmul_twin(slabs, GGMLType.Q2_K, x, [0, 2], [0, 1])
    with pytest.raises(LayoutError, match="input rows"):
        mk.expert_matmul_twin(slabs, GGMLType.Q2_K, mx.zeros((3, 512)), [0], [0])


def test_gather_tiles_cover_pairs_by_expert():
    slot = np.array([2, 0, 2, 2, 1, 0, 2, 2, 2, 2, 2, 2, 2, 0])
    order, inverse, t_slot, t_start, t_count = mk.gather_tiles(slot, tile=4)
    assert np.array_equal(order[inverse], np.arange(slot.size))
    assert (t_count <= 4).all() and t_count.sum() == slot.size
    covered = np.concatenate([order[s:s + c] for s, c in zip(t_start, t_count)])
    assert sorted(covered.tolist()) == list(range(slot.size))
    for s, a, c in zip(t_slot, t_start, t_count):
        assert (slot[order[a:a + c]] == s).all()


def test_swiglu_twin_is_the_models_clamped_swiglu():
    g = mx.array(np.array([-30.0, -1.0, 0.0, 0.5, 3.0, 12.0], dtype=np.float32))
    u = mx.array(np.array([5.0, -20.0, 1.0, -0.25, 9.0, 2.0], dtype=np.float32))
    c = 7.0
    gd, ud = np.array(g, dtype=np.float64), np.array(u, dtype=np.float64)
    gc = np.minimum(gd, c)
    want = gc / (1.0 + np.exp(-gc)) * np.clip(ud, -c, c)
    got = np.array(mk.swiglu_twin(g, u, c))
    assert np.allclose(got, want, rtol=1e-6, atol=1e-7)


def test_kernel_wrappers_reject_bad_input():
    rng = np.random.default_rng(5)
    slabs = mx.array(random_rows(rng, GGMLType.Q2_K, (2, 4), 256))
    x = mx.zeros((3, 256))
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(LayoutError, match="clamp"):
            mk.expert_swiglu_twin(slabs, slabs, GGMLType.Q2_K, x, [0], [0], bad)
        with pytest.raises(LayoutError, match="clamp"):
            mk.expert_swiglu_kernel(slabs, slabs, GGMLType.Q2_K, x, [0], [0], bad)
    with pytest.raises(LayoutError, match="differ"):
        mk.expert_swiglu_kernel(slabs, slabs[:1], GGMLType.Q2_K, x, [0], [0], 7.0)
    with pytest.raises(LayoutError, match="out of range"):
        mk.expert_matvec_kernel(slabs, GGMLType.Q2_K, x, [2], [0])
    with pytest.raises(LayoutError, match="weights must be"):
        mk.q8_0_matvec_kernel(mx.zeros((2, 2, 34), dtype=mx.uint8), x)
    with pytest.raises(ValueError, match="dialect"):
        mk.kernel_sources("expert_matvec", "opencl")


def test_kernel_sources_fill_the_grid_table_in_both_dialects():
    for dialect in mk.DIALECTS:
        header, body = mk.kernel_sources("expert_matvec", dialect)
        assert "@IQ2XXS_GRID@" not in header and header.count("UL,") == 255
        assert "ds4_lane_sum" in body and "ds4_tid" in body
    assert "thread_index_in_threadgroup" in mk.kernel_sources("expert_gather_mm", "metal")[1]
    assert "threadIdx.x" in mk.kernel_sources("expert_gather_mm", "cuda")[1]


def test_launches_are_whole_threadgroups():
    # no partial threadgroups: Metal would drop the missing threads, CUDA would run them; the bodies
    # are written for full groups (barriers) and guard rows instead
    for out_dim in (1, 5, 61, 2048, 4096):
        grid, group = mk.matvec_launch(out_dim, 6)
        assert grid[0] % group[0] == 0 and grid[0] // 32 * mk.MATVEC_ROWS >= out_dim
        grid, group = mk.gather_launch(out_dim, 3)
        assert grid[0] % group[0] == 0 and grid[0] // group[0] * mk.GATHER_ROWS >= out_dim
    assert mk.GATHER_TILE % 8 == 0 and mk.GATHER_TILE <= 32  # the body's result tile reuses wt[32 * 32]


# --------------------------------------------------------------------------------------------------
# bounds the kernels are held to (on the host shim, tests/test_kernel_shim.py, and on a GPU below)

# Bounds, per output (S = sum_k |w_k| |x_k|, S_m = the same with |w| replaced by |d q| + |dmin m|):
# prefill tiles hold the twin's exact weights, only the summation order differs -> 4e-6 S;
# decode kernels also reassociate the block scale and fold the minimum -> 1e-5 S_m.
GATHER_REL = 4e-6
MATVEC_REL = 1e-5

# every out_dim (1, 5, 61), n_in (256, 512, 1280, 4096) and P (1, 6, 17, 40) appears, for every format
HOST_SHAPES = [(1, 256, 1), (5, 512, 6), (61, 1280, 17), (5, 4096, 40)]


def split_scale(slabs, qtype, x, slot, rows) -> np.ndarray:
    """S_m: sum_k (|d q_k| + |dmin m|) |x_k| (K-quants), else sum_k |w_k| |x_k|."""
    w = dequantize_rows(slabs, qtype).astype(np.float64)
    if qtype in (GGMLType.Q2_K, GGMLType.Q4_K):
        z = slabs.copy()
        nb = z.shape[-1] // BLOCK_GEOMETRY[qtype][1]
        zb = z.reshape(*z.shape[:-1], nb, BLOCK_GEOMETRY[qtype][1])
        zb[..., 16:80 if qtype == GGMLType.Q2_K else 144] = 0  # codes 0: w = -dmin m
        w0 = dequantize_rows(zb.reshape(z.shape), qtype).astype(np.float64)
        w = np.abs(w - w0) + np.abs(w0)
    w = np.abs(w)
    return np.stack([w[s] @ np.abs(x[r]).astype(np.float64) for s, r in zip(slot, rows)])


def swiglu_bound(g, u, bg, bu, c):
    """|swiglu(g + dg, u + du) - swiglu(g, u)| for |dg| <= bg, |du| <= bu (silu' <= 1.1), plus exp's ulps."""
    gc = np.minimum(g, c)
    silu = gc / (1.0 + np.exp(-gc))
    uc = np.clip(u, -c, c)
    return 1.1 * np.abs(uc) * bg + (np.abs(silu) + 1.1 * bg) * bu + 4e-7 * np.abs(silu * uc) + 1e-30


# --------------------------------------------------------------------------------------------------
# CUDA dialect: compile every kernel with nvcc, in the form MLX's cuda_kernel generates


def cuda_kernel_source(key: str, templates, input_types, name_suffix: str = "") -> str:
    """The translation unit ``mx.fast.cuda_kernel`` builds (MLX's device utils header aside)."""
    spec = mk.KERNELS[key]
    header, body = mk.kernel_sources(key, "cuda")
    params = [f"    const {t}* {n}" for n, t in zip(spec.input_names, input_types)]
    params += [f"    float* {o}" for o in spec.output_names]
    consts = "".join(f"  constexpr int {n} = {v};\n" for n, v in templates)
    return (f"__global__ void {spec.name}{name_suffix}(\n" + ",\n".join(params) + ") {\n" + consts + "\n"
            + body + "\n}\n"), header


_CUDA_INPUT_TYPES = {
    "expert_matvec": ("uint8_t", "float", "int32_t", "int32_t"),
    "expert_swiglu": ("uint8_t", "uint8_t", "float", "int32_t", "int32_t", "float"),
    "expert_gather_mm": ("uint8_t", "float", "int32_t", "int32_t", "int32_t", "int32_t"),
}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found: CUDA compile check")
def test_cuda_kernels_compile_with_nvcc(tmp_path):
    kernels, header = [], None
    for key, types in _CUDA_INPUT_TYPES.items():
        for qtype in (*EXPERT_TYPES, GGMLType.Q8_0):
            if key == "expert_swiglu" and qtype == GGMLType.Q8_0:
                continue
            elems, block_bytes = BLOCK_GEOMETRY[qtype]
            tm = [("QT", int(qtype)), ("N_IN", 4096), ("N_OUT", 2048), ("ROW_BYTES", 4096 // elems * block_bytes)]
            tm += ([("TP", mk.GATHER_TILE)] if key == "expert_gather_mm"
                   else [("NSG", mk.MATVEC_SIMDGROUPS), ("NR", mk.MATVEC_ROWS)])
            src, header = cuda_kernel_source(key, tm, types, f"_{qtype.name}")
            kernels.append(src)
    tu = ("#include <cstdint>\n#include <cooperative_groups.h>\n" + header
          + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n" + "\n".join(kernels)
          + "\n} // namespace mlx::core::cu\n")
    src = tmp_path / "ds4_kernels.cu"
    src.write_text(tu)
    proc = subprocess.run(["nvcc", "-arch=sm_90", "--ptx", "-Werror", "all-warnings", str(src), "-o",
                           str(tmp_path / "ds4_kernels.ptx")], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    ptx = (tmp_path / "ds4_kernels.ptx").read_text()
    assert ptx.count(".entry") == len(kernels)


# --------------------------------------------------------------------------------------------------
# the real kernels (Metal or CUDA GPU only)

_GPU_DIALECTS = mk.available_dialects()
needs_gpu = pytest.mark.skipif(not _GPU_DIALECTS, reason="no Metal or CUDA GPU: MLX custom kernels cannot run")


@needs_gpu
@pytest.mark.metal
@pytest.mark.parametrize("qtype", EXPERT_TYPES)
@pytest.mark.parametrize("shape", HOST_SHAPES)
def test_gpu_kernels_match_twin(qtype, shape):
    out_dim, n_in, P = shape
    rng = np.random.default_rng(int(qtype) + P)
    u, n_rows = 4, 12
    slabs = random_rows(rng, qtype, (u, out_dim), n_in)
    up = random_rows(rng, qtype, (u, out_dim), n_in)
    x = rng.standard_normal((n_rows, n_in)).astype(np.float32)
    slot = rng.integers(0, u, P)
    rows = rng.integers(0, n_rows, P)
    ref = pair_reference(slabs, qtype, x, slot, rows).astype(np.float64)
    s_m = split_scale(slabs, qtype, x, slot, rows)
    for dialect in _GPU_DIALECTS:
        for fn, rel in ((mk.expert_matvec_kernel, MATVEC_REL), (mk.expert_gather_mm_kernel, GATHER_REL),
                        (mk.expert_matmul_kernel, MATVEC_REL)):
            got = np.array(fn(mx.array(slabs), qtype, mx.array(x), slot, rows, dialect=dialect))
            assert (np.abs(got - ref) <= rel * s_m * 4 + 1e-30).all(), (dialect, fn.__name__)
        ref_u = pair_reference(up, qtype, x, slot, rows).astype(np.float64)
        c = float(np.median(np.abs(ref))) + 1e-3
        got = np.array(mk.expert_swiglu_kernel(mx.array(slabs), mx.array(up), qtype, mx.array(x), slot, rows, c,
                                               dialect=dialect))
        gc = np.minimum(ref, c)
        want = gc / (1.0 + np.exp(-gc)) * np.clip(ref_u, -c, c)
        bound = swiglu_bound(ref, ref_u, 4 * MATVEC_REL * s_m, 4 * MATVEC_REL * split_scale(up, qtype, x, slot, rows), c)
        assert (np.abs(got - want) <= bound).all(), (dialect, "swiglu")


@needs_gpu
@pytest.mark.metal
@pytest.mark.parametrize("n_rows", [1, 3, 17])
def test_gpu_q8_0_kernel_matches_twin(n_rows):
    rng = np.random.default_rng(3)
    w = random_rows(rng, GGMLType.Q8_0, (300,), 4096)
    x = rng.standard_normal((n_rows, 4096)).astype(np.float32)
    wd = dequantize_rows(w, GGMLType.Q8_0).astype(np.float64)
    ref = x.astype(np.float64) @ wd.T
    scale = np.abs(x).astype(np.float64) @ np.abs(wd).T
    for dialect in _GPU_DIALECTS:
        got = np.array(mk.q8_0_matvec_kernel(mx.array(w), mx.array(x), dialect=dialect))
        assert (np.abs(got - ref) <= 4 * MATVEC_REL * scale).all(), dialect
