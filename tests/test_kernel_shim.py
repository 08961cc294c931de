"""The GPU kernels on the strict host shim (tests/kernel_shim), in both dialects: exact generated sources
(MLX's own for Metal, MLX's build_kernel rules for CUDA), address spaces as types (Metal), threads as
randomly interleaved fibers with real barriers and SIMD / warp rendezvous, poisoned memory (NaN), the launch
geometry each backend uses, ASan + UBSan or canaries, alignment-checked loads, weights at +2 bytes; and
planted faults it must catch.

Bounds (the kernel author's, tests/test_kernels.py), per output, against the float64 value of the exactly
decoded weights: decode kernels (matvec, fused SwiGLU through ``swiglu_bound``) MATVEC_REL * S_m, the
prefill tiles GATHER_REL * S; the MLX-ops twin must sit within the same bound, so kernel and twin agree
within twice it. The block decoders are checked bit for bit.

Suite time (2 cores): each variant's executable is cached by content hash in the temp directory, and all
shapes of one test run in one process. The default run uses the optimised build without sanitizers for
the coverage slice and ASan + UBSan for a representative slice; the sweep (all pairs of shape values,
``DS4_MLX_KERNEL_SWEEP=full`` for the whole product) is ``slow``.
"""

from __future__ import annotations

import itertools
import os
import zlib

import ds4_mlx  # noqa: F401  (first: binds MLX to a fast BLAS before mlx.core loads)
import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.formats.ggml_types import GGMLType
from ds4_mlx.formats.quants import dequantize_rows
from ds4_mlx.model import metal_kernels as mk
from ds4_mlx.model import mxfp4
from kernel_shim import shim
from test_kernels import (EXPERT_TYPES, GATHER_REL, HOST_SHAPES, MATVEC_REL, abs_scale, pair_reference,
                          random_rows, split_scale, swiglu_bound)

pytestmark = pytest.mark.skipif(shim.gxx() is None, reason="g++ (C++20) not found: host run of kernel sources")

OUT_DIMS = (1, 5, 61)
N_INS = (256, 512, 1280, 4096)
PAIRS = (1, 6, 17, 40)
U = 3  # expert slabs
KERNELS = ("expert_matvec", "expert_swiglu", "expert_gather_mm", "q8_0_matvec")
ALL_TYPES = (*EXPERT_TYPES, GGMLType.Q8_0)
DIALECTS = shim.DIALECTS
# Suite time: every planted fault is its own compile, so in the default run the CUDA dialect shows the
# faults whose catching differs from Metal's (UBSan alignment instead of typed pointers, a const write
# instead of address-space types) and the rest of its fault list, like its ASan slice, runs with `slow`.
CUDA_SLOW = pytest.param("cuda", marks=pytest.mark.slow)


def _bad(got, ref, bound):
    return ~(np.abs(np.asarray(got, dtype=np.float64) - ref) <= bound)  # NaN (poison left) counts as bad


def _case(key, qtype, out_dim, n_in, n_pairs, dialect):
    """(label, fn, checker) for kernel ``key`` through its wrapper. For q8_0_matvec, n_pairs is the number
    of input rows (<= 4: matvec kernel, beyond: the tiled kernel)."""
    label = f"{dialect}/{key}/{qtype.name}/o{out_dim}/n{n_in}/p{n_pairs}"
    rng = np.random.default_rng(zlib.crc32(label.encode()))
    x_rows = max(2, n_pairs // 2)
    if key == "q8_0_matvec":
        w = random_rows(rng, GGMLType.Q8_0, (out_dim,), n_in)
        x = rng.standard_normal((n_pairs, n_in)).astype(np.float32)
        fn = lambda: mk.q8_0_matvec_kernel(mx.array(w), mx.array(x), dialect=dialect)  # noqa: E731
        twin = lambda: mk.q8_0_matvec_twin(mx.array(w), mx.array(x))  # noqa: E731
        slot, rows = np.zeros(n_pairs, np.int64), np.arange(n_pairs)
        slabs, x_all = w[None], x
        rel = MATVEC_REL if n_pairs <= mk.Q8_MATVEC_MAX_ROWS else GATHER_REL
        ref = pair_reference(slabs, qtype, x_all, slot, rows).astype(np.float64)
        bound = rel * split_scale(slabs, qtype, x_all, slot, rows)
    else:
        slabs = random_rows(rng, qtype, (U, out_dim), n_in)
        up = random_rows(rng, qtype, (U, out_dim), n_in)
        x = rng.standard_normal((x_rows, n_in)).astype(np.float32)
        slot = rng.integers(0, U, n_pairs)
        rows = rng.integers(0, x_rows, n_pairs)
        ref = pair_reference(slabs, qtype, x, slot, rows).astype(np.float64)
        if key == "expert_swiglu":
            ref_u = pair_reference(up, qtype, x, slot, rows).astype(np.float64)
            c = float(np.median(np.abs(ref))) + 1e-3  # about half the gates clamped
            fn = lambda: mk.expert_swiglu_kernel(mx.array(slabs), mx.array(up), qtype, mx.array(x), slot,  # noqa: E731
                                                 rows, c, dialect=dialect)
            twin = lambda: mk.expert_swiglu_twin(mx.array(slabs), mx.array(up), qtype, mx.array(x), slot,  # noqa: E731
                                                 rows, c)
            bound = swiglu_bound(ref, ref_u, MATVEC_REL * split_scale(slabs, qtype, x, slot, rows),
                                 MATVEC_REL * split_scale(up, qtype, x, slot, rows), c)
            gc = np.minimum(ref, c)
            ref = gc / (1.0 + np.exp(-gc)) * np.clip(ref_u, -c, c)
        else:
            kern = mk.expert_matvec_kernel if key == "expert_matvec" else mk.expert_gather_mm_kernel
            fn = lambda: kern(mx.array(slabs), qtype, mx.array(x), slot, rows, dialect=dialect)  # noqa: E731
            twin = lambda: mk.expert_matmul_twin(mx.array(slabs), qtype, mx.array(x), slot, rows)  # noqa: E731
            bound = (MATVEC_REL * split_scale(slabs, qtype, x, slot, rows) if key == "expert_matvec"
                     else GATHER_REL * abs_scale(slabs, qtype, x, slot, rows))

    def checker(got):
        bad = _bad(got, ref, bound)
        assert not bad.any(), (f"{label}: {bad.sum()} of {bad.size} outputs off the exact value, "
                               f"e.g. {np.asarray(got)[bad][:3]} vs {ref[bad][:3]}")
        tw = np.array(twin())
        assert not _bad(tw, ref, bound).any(), f"{label}: the twin is off the exact value"
        assert not _bad(got, tw, 2 * bound).any(), f"{label}: off the twin"

    return label, fn, checker


def cases(keys, shapes, dialect):
    """Cases for kernels ``keys`` on shapes (qtype, out_dim, n_in, P); Q8_0 only for q8_0_matvec."""
    out = []
    for key in keys:
        for qtype, o, n, p in shapes:
            if (key == "q8_0_matvec") == (qtype == GGMLType.Q8_0):
                out.append(_case(key, qtype, o, n, p, dialect))
    return out


def run_cases(case_list, opts=None, kernel_patch=None, launch_patch=None):
    """Record every case's launches, run them all in one shim process, replay and check each."""
    launches, counts = [], []
    for label, fn, _ in case_list:
        got = shim.record(fn)
        for i, ln in enumerate(got):
            ln.label = f"{label}#{i}"
            if kernel_patch:
                ln.kernel = kernel_patch(ln.kernel)
            if launch_patch:
                launch_patch(ln)
        launches += got
        counts.append(len(got))
    result = shim.run(launches, opts)
    if result.failure:
        return result
    at = 0
    for (label, fn, checker), n in zip(case_list, counts):
        outs = result.outputs[at:at + n]
        at += n
        checker(np.array(shim.replay(fn, outs)))
    return result


def _ok(result):
    assert result.failure is None, f"{result.failed_label}: {result.failure}"


# every out_dim, n_in and P at least once for every format and kernel (the twins' HOST_SHAPES slice), plus
# q8_0 on both sides of its matvec / tiled switch
SLICE = [(q, o, n, p) for q in ALL_TYPES for (o, n, p) in HOST_SHAPES]
SLICE_Q8_ROWS = [(GGMLType.Q8_0, 61, 512, 4), (GGMLType.Q8_0, 5, 256, 5)]
# The sweep: every (format, out_dim, n_in) with one pair count each, rotated so that every pair count
# meets every format, every out_dim and every n_in (all pairs of values covered: 48 cases per kernel,
# not the 192 of the full product, which took 4 of the suite's 20 minutes on 2 cores).
# DS4_MLX_KERNEL_SWEEP=full runs the whole product (before changing a kernel).
ALL_SHAPES = ([(q, o, n, PAIRS[(qi + oi + ni) % len(PAIRS)])
               for (qi, q), (oi, o), (ni, n) in itertools.product(enumerate(ALL_TYPES), enumerate(OUT_DIMS),
                                                                   enumerate(N_INS))]
              if os.environ.get("DS4_MLX_KERNEL_SWEEP") != "full"
              else list(itertools.product(ALL_TYPES, OUT_DIMS, N_INS, PAIRS)))


# --------------------------------------------------------------------------------------------------
# what MLX generates


def test_generated_metal_source_follows_mlx_rules():
    """Decode (P = 6 pairs) passes the pair tables in `constant` memory, prefill (P = 17) in `device`."""
    sources = {}
    for p in (6, 17):
        _, fn, _ = _case("expert_matvec", GGMLType.Q2_K, 5, 256, p, "metal")
        (ln,) = shim.record(fn)
        sources[p] = shim.generated_source(ln)
    assert "  const constant int32_t* pair_slot [[buffer(2)]]," in sources[6]
    assert "  const device int32_t* pair_slot [[buffer(2)]]," in sources[17]
    assert "  const device uint8_t* w [[buffer(0)]]," in sources[6]
    assert "  uint thread_index_in_threadgroup [[thread_index_in_threadgroup]]," in sources[6]
    assert '[[host_name("custom_kernel_ds4_expert_matvec__10_256_5_84_4_4_uint8_t_float_int32_tc_int32_tc_float")]]' \
        in sources[6]


def test_generated_cuda_source_follows_mlx_rules():
    """No constant space in CUDA: every input `const T*`; template ints as constexpr locals (build_kernel)."""
    _, fn, _ = _case("expert_matvec", GGMLType.Q2_K, 5, 256, 6, "cuda")
    (ln,) = shim.record(fn)
    assert ln.dialect == "cuda"
    src = shim.generated_source(ln)
    assert src.startswith(shim.CUDA_DEFAULT_HEADER + ln.kernel.header + "namespace mlx::core::cu {\n")
    assert ("__global__ void custom_kernel_ds4_expert_matvec_10_256_5_84_4_4(\n    const uint8_t* w,\n"
            "    const float* x,\n    const int32_t* pair_slot,\n    const int32_t* pair_row,\n    float* y) {\n"
            "  constexpr int QT = 10;\n") in src
    assert src.endswith("\n}\n\n} // namespace mlx::core::cu\n")


# --------------------------------------------------------------------------------------------------
# every kernel, both dialects


@pytest.mark.parametrize("dialect", DIALECTS)
def test_kernels_on_the_coverage_slice(dialect):
    """Every kernel and format at out_dim 1/5/61, n_in 256..4096, P 1..40 (optimised build, poison on)."""
    _ok(run_cases(cases(KERNELS, SLICE + SLICE_Q8_ROWS, dialect), shim.Options(seed=3, variant="plain")))


@pytest.mark.parametrize("dialect", ["metal", CUDA_SLOW])
def test_kernels_under_sanitizers_with_weights_two_bytes_off(dialect):
    """ASan + UBSan on a representative slice, weights at base + 2 (every typed read alignment-checked)."""
    shapes = [(q, 5, 512, 6) for q in ALL_TYPES] + [(GGMLType.IQ2_XXS, 61, 256, 17)]
    opts = shim.Options(seed=7, variant="asan", offsets={"w": 2, "wg": 2, "wu": 2})
    _ok(run_cases(cases(KERNELS, shapes, dialect), opts))


@pytest.mark.slow
@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("key", KERNELS)
def test_kernels_on_all_shapes(dialect, key):
    _ok(run_cases(cases([key], ALL_SHAPES, dialect), shim.Options(seed=11, variant="plain")))


# A test-only body: thread t of a 128-thread group decodes 8 weights of one row with ds4_deq8.
_DEQUANT_BODY = """
DS4_TG ds4_u64 ds4_grid[256];
DS4_TG uchar ds4_signs[128];
ds4_stage_iq2(ds4_grid, ds4_signs, ds4_tid, 128u);
DS4_BARRIER();
const uint row = ds4_gy;
const DS4_GLOBAL uchar* wrow = w + ulong(row) * ulong(ROW_BYTES);
float wv[8];
for (uint c = ds4_tid; c < uint(N_IN) / 8u; c += 128u) {
    ds4_deq8<QT>(wrow, c >> 2, c & 3u, ds4_grid, ds4_signs, wv);
    for (uint e = 0; e < 8u; ++e) {
        y[ulong(row) * ulong(N_IN) + 8u * c + e] = wv[e];
    }
}
"""


@pytest.mark.parametrize("dialect", DIALECTS)
def test_block_decoders_are_bit_exact(dialect):
    """ds4_deq8 (what the prefill tiles hold) reproduces numpy's dequantizers (MXFP4: ds4's values, the
    model's twin) bit for bit."""
    header, body = mk.kernel_sources("expert_matvec", dialect)
    prologue = body[:body.index(mk._read_kernel_file("expert_matvec.body"))]
    kdef = shim.KernelDef("ds4_deq_test", ("w",), ("y",), prologue + _DEQUANT_BODY, header, dialect=dialect)
    launches, wants = [], []
    rng = np.random.default_rng(99)
    for qtype in ALL_TYPES:
        for n_in in (256, 1280):
            w = random_rows(rng, qtype, (5,), n_in)
            launches.append(shim.Launch(kdef, [w], [("QT", int(qtype)), ("N_IN", n_in), ("ROW_BYTES", w.shape[1])],
                                        (128, 5, 1), (128, 1, 1), [(5, n_in)], [mx.float32],
                                        label=f"deq/{qtype.name}/{n_in}"))
            # MXFP4: ds4's values (code 8 is -0.0 there, +0.0 in gguf-py's, which dequantize_rows follows)
            wants.append(np.array(mxfp4.dequant_rows(mx.array(w))) if qtype == GGMLType.MXFP4
                         else dequantize_rows(w, qtype))
    result = shim.run(launches, shim.Options(seed=9, variant="plain"))
    _ok(result)
    for ln, (got,), want in zip(launches, result.outputs, wants):
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), ln.label


# --------------------------------------------------------------------------------------------------
# planted faults: mutated copies of the kernels that the shim must catch, in both dialects (the kernel
# bodies and quant_common.h are shared, so each mutation is one edit that both dialects compile)


def _outcome(case_list, opts, kernel_patch=None, launch_patch=None):
    """None when the mutated kernels pass every check, else what caught them."""
    try:
        result = run_cases(case_list, opts, kernel_patch=kernel_patch, launch_patch=launch_patch)
    except AssertionError as e:  # off the exact value or the twin
        return f"wrong result: {str(e).splitlines()[0]}"
    return result.failure


FAST = dict(variant="check")


@pytest.mark.parametrize("dialect", ["metal", CUDA_SLOW])
def test_fault_off_by_one_is_caught(dialect):
    """The prefill k loop one step too far reads past the weights: ASan in the sanitizer build."""
    patch = lambda k: k.patched("sub < uint(N_IN) / 32u", "sub <= uint(N_IN) / 32u")  # noqa: E731
    caught = _outcome(cases(["expert_gather_mm"], [(GGMLType.Q2_K, 5, 256, 17)], dialect),
                      shim.Options(seed=1, variant="asan"), patch)
    assert caught and "heap-buffer-overflow" in caught, caught


@pytest.mark.parametrize("dialect", ["metal", CUDA_SLOW])
def test_fault_off_by_one_output_row_is_caught(dialect):
    """The decode kernel writing one row past its valid rows: past the output end (canary) or a neighbour."""
    patch = lambda k: k.patched("if (lane == 0u && r < nvalid)", "if (lane == 0u && r <= nvalid)")  # noqa: E731
    caught = _outcome(cases(["expert_matvec"], [(GGMLType.Q4_K, 5, 256, 6)], dialect),
                      shim.Options(seed=1, variant="plain"), patch)
    assert caught and ("write past the end" in caught or "wrong result" in caught), caught


@pytest.mark.parametrize("dialect", ["metal", CUDA_SLOW])
def test_fault_missing_barrier_is_caught(dialect):
    """Without the barrier between staging the tiles and multiplying them, threads read tile entries not
    yet written (poisoned NaN) under the interleaving."""
    anchor = "    DS4_BARRIER();\n#if DS4_METAL\n    for (uint kk"
    patch = lambda k: k.patched(anchor, anchor.replace("    DS4_BARRIER();\n", ""))  # noqa: E731
    caught = _outcome(cases(["expert_gather_mm"], [(GGMLType.Q4_K, 5, 256, 17)], dialect),
                      shim.Options(seed=2, **FAST), patch)
    assert caught and "wrong result" in caught, caught


_Q8_HALVES = "const uint a = ds4_ld16(blk + 2u + e);"
_Q8_WORD = "const uint a = *(const DS4_GLOBAL uint*)(blk + 2u + e) & 0xffffu;"
_Q4K_SCALES = "const float d = ds4_f16_at(blk);\n        const float dmin = ds4_f16_at(blk + 2);"
_Q4K_WORD = ("const uint dd = *(const DS4_GLOBAL uint*)blk;\n        const float d = ds4_half_bits_to_float(ushort(dd));\n"
             "        const float dmin = ds4_half_bits_to_float(ushort(dd >> 16));")
_MISALIGNED = {"metal": "misaligned 4-byte access in device memory", "cuda": "misaligned address"}


@pytest.mark.parametrize("dialect", DIALECTS)
def test_fault_unaligned_wide_load_is_caught(dialect):
    """Q8_0 codes start 2 bytes into a 34-byte block: a 4-byte load there is misaligned."""
    patch = lambda k: k.patched(_Q8_HALVES, _Q8_WORD, where="header")  # noqa: E731
    caught = _outcome(cases(["q8_0_matvec"], [(GGMLType.Q8_0, 5, 256, 1)], dialect), shim.Options(seed=3, **FAST),
                      patch)
    assert caught and _MISALIGNED[dialect] in caught, caught


@pytest.mark.parametrize("dialect", ["metal", CUDA_SLOW])
def test_fault_wide_load_aligned_only_to_the_buffer_is_caught_at_offset_two(dialect):
    """Q4_K's d and dmin read as one word are aligned from an aligned base (144-byte blocks), so only the
    +2 variant exposes them."""
    patch = lambda k: k.patched(_Q4K_SCALES, _Q4K_WORD, where="header", count=2)  # noqa: E731
    case_list = cases(["expert_matvec"], [(GGMLType.Q4_K, 5, 256, 6)], dialect)
    assert _outcome(case_list, shim.Options(seed=4, **FAST), patch) is None
    caught = _outcome(case_list, shim.Options(seed=4, offsets={"w": 2}, **FAST), patch)
    assert caught and _MISALIGNED[dialect] in caught, caught


def test_fault_wrong_address_space_is_caught_metal():
    """A `device` view of the pair table compiles for prefill-sized tables but not for decode, where MLX
    passes it in `constant` memory (fewer than 8 elements); the staged threadgroup table handed to a
    `device` pointer never compiles."""
    as_device = lambda k: k.patched("pair_slot[p]", "slots[p]", count=1).patched(  # noqa: E731
        "const uint row0", "const DS4_GLOBAL int* slots = pair_slot;\nconst uint row0")
    opts = shim.Options(seed=5, **FAST)
    caught = _outcome(cases(["expert_matvec"], [(GGMLType.Q2_K, 5, 256, 6)], "metal"), opts, as_device)
    assert caught and "cannot convert ‘const shim::asp<2, int>*’ to ‘const shim::asp<1, int>*’" in caught, caught
    assert _outcome(cases(["expert_matvec"], [(GGMLType.Q2_K, 5, 256, 17)], "metal"), opts, as_device) is None
    tg_as_device = lambda k: k.patched(  # noqa: E731
        "const uint row0", "const DS4_GLOBAL ds4_u64* gview = ds4_grid;\nconst uint row0")
    caught = _outcome(cases(["expert_matvec"], [(GGMLType.Q2_K, 5, 256, 17)], "metal"), opts, tg_as_device)
    assert caught and "shim::asp<3, long unsigned int>" in caught and "g++ rejected" in caught, caught


_CONST_WRITE = {"metal": "discards qualifiers", "cuda": "assignment of read-only location"}


@pytest.mark.parametrize("dialect", DIALECTS)
def test_fault_write_through_an_input_is_caught(dialect):
    """CUDA's analogue of the wrong address space (its pointers are generic): storing into an input, here
    the fused kernel writing its result over the activations. MLX declares inputs `const` in both dialects,
    so it fails to compile, as it would in nvcc / the Metal compiler."""
    patch = lambda k: k.patched("y[ulong(p) * ulong(N_OUT) + ulong(row0 + r)] = ds4_swiglu",  # noqa: E731
                                "x[ulong(p) * ulong(N_OUT) + ulong(row0 + r)] = ds4_swiglu")
    caught = _outcome(cases(["expert_swiglu"], [(GGMLType.Q2_K, 5, 256, 6)], dialect), shim.Options(seed=6, **FAST),
                      patch)
    assert caught and "g++ rejected" in caught and _CONST_WRITE[dialect] in caught, caught


@pytest.mark.parametrize("dialect", ["metal", CUDA_SLOW])
def test_fault_partial_threadgroup_is_caught(dialect):
    """The decode kernels stage the IQ2 tables with a stride of the whole group, so they need whole groups:
    an exact grid (fewer threads than the group) leaves table entries poisoned. Metal cuts the last group
    short; MLX's CUDA launch makes the block min(threadgroup, grid) threads; both are modelled."""
    def exact_grid(ln):
        nr = dict(ln.template)["NR"]
        ln.grid = ((dict(ln.template)["N_OUT"] + nr - 1) // nr * 32, *ln.grid[1:])

    case_list = cases(["expert_matvec"], [(GGMLType.IQ2_XXS, 5, 256, 6)], dialect)
    caught = _outcome(case_list, shim.Options(seed=8, **FAST), launch_patch=exact_grid)
    assert caught and "wrong result" in caught, caught
