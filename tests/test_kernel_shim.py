"""The Metal kernels on the strict host shim (tests/kernel_shim): exact MLX-generated sources, address spaces
as types, threads as randomly interleaved fibers with real barriers and SIMD rendezvous, poisoned memory,
partial threadgroups, ASan + UBSan, alignment-checked loads; and planted faults it must catch.

Bound for kernel vs twin: both are float32 dot products of exactly decoded weights (the decoders are
checked bit for bit below), so each is within gamma = (n_in + 2) * 2^-24 of sum |w||x| of the exact value
whatever the summation order (the standard a-priori bound of float summation); the test checks the
kernel's wrapper output against the float64 value with that bound and against the twin with twice it.
"""

from __future__ import annotations

import itertools

import ds4_mlx  # noqa: F401  (first: binds MLX to a fast BLAS before mlx.core loads)
import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.formats.ggml_types import GGMLType
from ds4_mlx.formats.quants import dequantize_rows
from ds4_mlx.model import metal_kernels as mk
from kernel_shim import shim
from test_kernels import EXPERT_TYPES, random_rows

pytestmark = pytest.mark.skipif(shim.gxx() is None, reason="g++ (C++20) not found: host run of kernel sources")

OUT_DIMS = (1, 5, 61)
N_INS = (256, 512, 1280, 4096)
PAIRS = (1, 6, 17, 40)
U = 3  # expert slabs
EXPERT_KERNELS = {"expert_matvec": mk.expert_matvec_kernel, "expert_gather_mm": mk.expert_gather_mm_kernel}


def _case(qtype, out_dim, n_in, n_pairs, seed):
    rng = np.random.default_rng(seed)
    slabs = random_rows(rng, qtype, (U, out_dim), n_in)
    n_rows = max(2, n_pairs // 2)
    x = rng.standard_normal((n_rows, n_in)).astype(np.float32)
    slot = rng.integers(0, U, n_pairs)
    rows = rng.integers(0, n_rows, n_pairs)
    return slabs, x, slot, rows


def _exact(slabs, qtype, x, slot, rows):
    w = dequantize_rows(slabs, qtype).astype(np.float64)
    ref = np.stack([w[s] @ x[r].astype(np.float64) for s, r in zip(slot, rows)])
    scale = np.stack([np.abs(w[s]) @ np.abs(x[r]).astype(np.float64) for s, r in zip(slot, rows)])
    return ref, scale


def _check(got, twin, ref, scale, n_in, what):
    gamma = (n_in + 2) * 2.0**-24
    got = np.asarray(got, dtype=np.float64)
    bad = ~(np.abs(got - ref) <= gamma * scale)  # NaN (poison never overwritten) counts as bad
    assert not bad.any(), f"{what}: {bad.sum()} outputs off the exact value, e.g. {got[bad][:3]} vs {ref[bad][:3]}"
    bad = ~(np.abs(got - twin) <= 2 * gamma * scale)
    assert not bad.any(), f"{what}: {bad.sum()} outputs off the twin"


def _expert_cases(key, shapes):
    """[(label, fn, checker)] for the expert kernel `key` on `shapes` (qtype, out, n_in, P)."""
    cases = []
    for qtype, out_dim, n_in, n_pairs in shapes:
        slabs, x, slot, rows = _case(qtype, out_dim, n_in, n_pairs, hash((qtype, out_dim, n_in, n_pairs)) % 2**32)
        fn = (lambda s=slabs, q=qtype, xx=x, sl=slot, r=rows:
              EXPERT_KERNELS[key](mx.array(s), q, mx.array(xx), sl, r))

        def checker(got, s=slabs, q=qtype, xx=x, sl=slot, r=rows, n=n_in, lab=f"{key} {qtype.name} out={out_dim} "
                    f"n_in={n_in} P={n_pairs}"):
            twin = np.array(mk.expert_matmul_twin(mx.array(s), q, mx.array(xx), sl, r)).astype(np.float64)
            ref, scale = _exact(s, q, xx, sl, r)
            _check(got, twin, ref, scale, n, lab)

        cases.append((f"{key}/{qtype.name}/o{out_dim}/n{n_in}/p{n_pairs}", fn, checker))
    return cases


def _q8_cases(shapes):
    cases = []
    for out_dim, n_in, r in shapes:
        rng = np.random.default_rng(out_dim * 7919 + n_in + r)
        w = random_rows(rng, GGMLType.Q8_0, (out_dim,), n_in)
        x = rng.standard_normal((r, n_in)).astype(np.float32)
        fn = lambda w=w, x=x: mk.q8_0_matvec_kernel(mx.array(w), mx.array(x))  # noqa: E731

        def checker(got, w=w, x=x, n=n_in, lab=f"q8_0_matvec out={out_dim} n_in={n_in} R={r}"):
            wd = dequantize_rows(w, GGMLType.Q8_0).astype(np.float64)
            twin = np.array(mk.q8_0_matvec_twin(mx.array(w), mx.array(x))).astype(np.float64)
            _check(got, twin, x.astype(np.float64) @ wd.T, np.abs(x).astype(np.float64) @ np.abs(wd).T, n, lab)

        cases.append((f"q8_0/o{out_dim}/n{n_in}/r{r}", fn, checker))
    return cases


def run_cases(cases, opts=None, kernel_patch=None):
    """Record every case's launches, run them all in one shim process, replay and check each."""
    launches, counts = [], []
    for label, fn, _ in cases:
        got = shim.record(fn)
        for i, ln in enumerate(got):
            ln.label = f"{label}#{i}"
            if kernel_patch:
                ln.kernel = kernel_patch(ln.kernel)
        launches += got
        counts.append(len(got))
    result = shim.run(launches, opts)
    if result.failure:
        return result
    at = 0
    for (label, fn, checker), n in zip(cases, counts):
        outs = result.outputs[at:at + n]
        at += n
        checker(np.array(shim.replay(fn, outs)))
    return result


ALL_EXPERT_SHAPES = list(itertools.product(EXPERT_TYPES, OUT_DIMS, N_INS, PAIRS))


# --------------------------------------------------------------------------------------------------
# what MLX generates


def test_generated_source_follows_mlx_rules():
    """Decode (P = 6 pairs) passes the pair tables in `constant` memory, prefill (P = 17) in `device`."""
    sources = {}
    for p in (6, 17):
        slabs, x, slot, rows = _case(GGMLType.Q2_K, 5, 256, p, 0)
        (ln,) = shim.record(lambda: mk.expert_matvec_kernel(mx.array(slabs), GGMLType.Q2_K, mx.array(x), slot, rows))
        sources[p] = shim.generated_source(ln)
    assert "  const constant int32_t* pair_slot [[buffer(2)]]," in sources[6]
    assert "  const device int32_t* pair_slot [[buffer(2)]]," in sources[17]
    assert "  const device uint8_t* w [[buffer(0)]]," in sources[6]
    assert "  uint thread_index_in_simdgroup [[thread_index_in_simdgroup]]," in sources[6]
    assert '[[host_name("custom_kernel_ds4_expert_matvec__10_256_5_84_uint8_t_float_int32_tc_int32_tc_float")]]' \
        in sources[6]


# --------------------------------------------------------------------------------------------------
# every kernel on every shape


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(EXPERT_KERNELS))
def test_expert_kernels_on_all_shapes(key):
    result = run_cases(_expert_cases(key, ALL_EXPERT_SHAPES), shim.Options(seed=11))
    assert result.failure is None, f"{result.failed_label}: {result.failure}"


def test_expert_kernels_decode_and_partial_groups():
    """The quick slice: P = 6 (constant tables), out_dim 5 and 61 (partial threadgroups), every type."""
    shapes = [(q, o, n, p) for q in EXPERT_TYPES for (o, n, p) in ((5, 256, 6), (61, 1280, 6), (1, 512, 17))]
    for key in EXPERT_KERNELS:
        result = run_cases(_expert_cases(key, shapes), shim.Options(seed=3))
        assert result.failure is None, f"{result.failed_label}: {result.failure}"


@pytest.mark.slow
def test_q8_0_matvec_on_all_shapes():
    result = run_cases(_q8_cases(list(itertools.product(OUT_DIMS, N_INS, PAIRS))), shim.Options(seed=5))
    assert result.failure is None, f"{result.failed_label}: {result.failure}"


def test_weights_two_bytes_off_alignment():
    """Weights at base + 2: every typed read is alignment-checked, so a wide load would fail here."""
    shapes = [(q, 5, 512, 6) for q in EXPERT_TYPES]
    cases = _expert_cases("expert_matvec", shapes) + _expert_cases("expert_gather_mm", shapes)
    cases += _q8_cases([(5, 512, 2)])
    result = run_cases(cases, shim.Options(seed=7, offsets={"w": 2}))
    assert result.failure is None, f"{result.failed_label}: {result.failure}"


# --------------------------------------------------------------------------------------------------
# planted faults: mutated copies of the kernels that the shim must catch

_TG_REDUCE = """threadgroup float partial[128];
partial[thread_index_in_threadgroup] = acc;
threadgroup_barrier(mem_flags::mem_threadgroup);
if (lane == 0) {
    acc = 0.0f;
    for (uint l = 0; l < 32u; ++l) {
        acc += partial[thread_index_in_threadgroup + l];
    }
}"""
_Q8_BYTES = """    for (uint l = 0; l < 32u; ++l) {
        const uint b = blk[2u + l];"""
_Q8_WORDS = """    const device uint* q4 = (const device uint*)(blk + 2u);
    for (uint l = 0; l < 32u; ++l) {
        const uint b = (uint(q4[l / 4u]) >> (8u * (l % 4u))) & 255u;"""
_Q4K_BYTES = "w[l] = ds * float((uint(qs[l]) >> shift) & 15u) - dm;"
_Q4K_WORDS = "w[l] = ds * float((((uint(((const device uint*)qs)[l / 4u]) >> (8u * (l % 4u))) & 255u) >> shift) & 15u) - dm;"


def _outcome(cases, patch, opts):
    """None when the mutated kernels pass every check, else what caught them."""
    try:
        result = run_cases(cases, opts, kernel_patch=patch)
    except AssertionError as e:  # twin mismatch
        return f"twin mismatch: {str(e).splitlines()[0]}"
    return result.failure


def _matvec(shapes):
    return _expert_cases("expert_matvec", shapes)


def test_fault_off_by_one_is_caught():
    patch = lambda k: k.patched("sub < uint(N_IN) / 32u", "sub <= uint(N_IN) / 32u")  # noqa: E731
    caught = _outcome(_matvec([(GGMLType.Q2_K, 5, 256, 6)]), patch, shim.Options(seed=1))
    assert caught and ("heap-buffer-overflow" in caught or "twin mismatch" in caught), caught


def test_fault_missing_barrier_is_caught():
    cases = _matvec([(GGMLType.Q4_K, 5, 512, 6)])
    good = lambda k: k.patched("acc = simd_sum(acc);", _TG_REDUCE)  # noqa: E731
    # the threadgroup-memory reduction with its barrier is correct on the shim ...
    assert _outcome(cases, good, shim.Options(seed=2, variant="check")) is None
    # ... and without it, lanes read partial sums not yet written (poisoned NaN) under the interleaving
    bad = lambda k: good(k).patched("threadgroup_barrier(mem_flags::mem_threadgroup);\n", "")  # noqa: E731
    caught = _outcome(cases, bad, shim.Options(seed=2, variant="check"))
    assert caught and "twin mismatch" in caught, caught


def test_fault_unaligned_wide_load_is_caught():
    patch = lambda k: k.patched(_Q8_BYTES, _Q8_WORDS, where="header")  # noqa: E731
    caught = _outcome(_q8_cases([(5, 256, 1)]), patch, shim.Options(seed=3, variant="check"))
    assert caught and "misaligned 4-byte access in device memory" in caught, caught


def test_fault_wide_load_aligned_only_to_the_buffer_is_caught_at_offset_two():
    """Q4_K codes read as words are aligned from an aligned base, so only the +2 variant exposes them."""
    patch = lambda k: k.patched(_Q4K_BYTES, _Q4K_WORDS, where="header")  # noqa: E731
    cases = _matvec([(GGMLType.Q4_K, 5, 256, 6)])
    assert _outcome(cases, patch, shim.Options(seed=4, variant="check")) is None
    caught = _outcome(cases, patch, shim.Options(seed=4, variant="check", offsets={"w": 2}))
    assert caught and "misaligned 4-byte access" in caught, caught


def test_fault_wrong_address_space_is_caught():
    """A `device` view of the pair table compiles for prefill but not for decode, where MLX passes it in
    `constant` memory (fewer than 8 elements); a threadgroup array handed to a `device` pointer never does."""
    as_device = lambda k: k.patched("pair_slot[p]", "slots[p]").patched(  # noqa: E731
        "const device float* xr", "const device int32_t* slots = pair_slot;\nconst device float* xr")
    opts = shim.Options(seed=5, variant="check")
    caught = _outcome(_matvec([(GGMLType.Q2_K, 5, 256, 6)]), as_device, opts)
    assert caught and "cannot convert ‘const shim::asp<2, int>*’ to ‘const shim::asp<1, int>*’" in caught, caught
    assert _outcome(_matvec([(GGMLType.Q2_K, 5, 256, 17)]), as_device, opts) is None
    tg_as_device = lambda k: k.patched("acc = simd_sum(acc);", _TG_REDUCE + "\nconst device float* view = partial;")  # noqa: E731
    caught = _outcome(_matvec([(GGMLType.Q2_K, 5, 256, 17)]), tg_as_device, opts)
    assert caught and "shim::asp<3, float>" in caught and "g++ rejected" in caught, caught


def test_fault_diverged_simd_lanes_are_caught():
    """Half the lanes reduce at one SIMD op, half at another: a rendezvous that can never complete."""
    patch = lambda k: k.patched("acc = simd_sum(acc);",  # noqa: E731
                                "if (lane < 16u) {\n    acc = simd_sum(acc);\n} else {\n    acc = simd_max(acc);\n}")
    caught = _outcome(_matvec([(GGMLType.Q2_K, 1, 256, 1)]), patch, shim.Options(seed=6, variant="check"))
    assert caught and "diverged SIMD lanes" in caught, caught
