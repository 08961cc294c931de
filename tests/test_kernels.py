"""Metal kernels for raw GGUF blocks and their MLX-ops twins.

Three layers of checks:
* the twins (what the CPU backend runs) against numpy dequantization + float64 matmul;
* the kernel sources themselves, compiled on the host with g++ through a small shim that plays Metal's
  address-space keywords and a 32-lane simdgroup (one thread per lane, ``simd_sum`` through a barrier),
  launched over the same grid as ``mx.fast.metal_kernel`` would: the block decoders must equal numpy's
  dequantization bit for bit, and every kernel must equal its twin up to summation order;
* on a machine with Metal, the real kernels against their twins (skipped elsewhere).
"""

from __future__ import annotations

import shutil
import subprocess
import textwrap

import ds4_mlx  # noqa: F401  (first: binds MLX to a fast BLAS before mlx.core loads)
import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.errors import LayoutError
from ds4_mlx.formats.ggml_types import BLOCK_GEOMETRY, GGMLType
from ds4_mlx.formats.quants import dequantize_rows, quantize_q8_0
from ds4_mlx.model import metal_kernels as mk

EXPERT_TYPES = (GGMLType.IQ2_XXS, GGMLType.Q2_K, GGMLType.Q4_K)


def random_rows(rng: np.random.Generator, qtype: GGMLType, lead: tuple[int, ...], n_in: int) -> np.ndarray:
    """Random but valid blocks: random bytes with finite, moderate f16 scales."""
    elems, block_bytes = BLOCK_GEOMETRY[qtype]
    nb = n_in // elems
    if qtype == GGMLType.Q8_0:
        return quantize_q8_0(rng.standard_normal((*lead, n_in)).astype(np.float32))
    raw = rng.integers(0, 256, size=(*lead, nb, block_bytes), dtype=np.uint8)
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


def test_kernel_sources_fill_the_grid_table():
    header, body = mk.kernel_sources("expert_matvec")
    assert "@IQ2XXS_GRID@" not in header and header.count("UL,") == 255
    assert "simd_sum" in body and "thread_index_in_simdgroup" in body


# --------------------------------------------------------------------------------------------------
# the kernel sources on the host (g++ shim)

_SHIM = r"""
#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>
using host_thread = std::thread;  // before `thread` becomes an empty address-space keyword
#define device
#define constant
#define thread
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
typedef _Float16 half;
struct uint3 { uint x, y, z; };
template <class T, class U> static inline T as_type(U u) {
    static_assert(sizeof(T) == sizeof(U));
    T t;
    std::memcpy(&t, &u, sizeof t);
    return t;
}
static inline uint popcount(uint v) { return (uint)__builtin_popcount(v); }
// one simdgroup = 32 host threads; simd_sum meets all lanes at a barrier
static std::barrier<>* g_bar;
static float g_lanes[32];
static thread_local uint g_lane;
static inline float simd_sum(float v) {
    g_lanes[g_lane] = v;
    g_bar->arrive_and_wait();
    float s = 0.0f;
    for (int i = 0; i < 32; ++i) s += g_lanes[i];
    g_bar->arrive_and_wait();
    return s;
}
static std::vector<char> read_file(const char* path) {
    FILE* f = std::fopen(path, "rb");
    if (!f) { std::perror(path); std::exit(2); }
    std::fseek(f, 0, SEEK_END); long n = std::ftell(f); std::fseek(f, 0, SEEK_SET);
    std::vector<char> buf(n > 0 ? n : 1);
    if (n > 0 && std::fread(buf.data(), 1, n, f) != (size_t)n) { std::exit(3); }
    std::fclose(f);
    return buf;
}
"""

_CTYPES = {np.dtype(np.uint8): "uint8_t", np.dtype(np.float32): "float", np.dtype(np.int32): "int32_t"}

# A test-only body: every lane writes the decoded chunks of row `row` (grid y) it owns.
_DEQUANT_BODY = """
const uint lane = thread_index_in_simdgroup;
const uint row = thread_position_in_grid.y;
const device uchar* wrow = w + ulong(row) * ulong(ROW_BYTES);
float wv[32];
for (uint sub = lane; sub < uint(N_IN) / 32u; sub += 32u) {
    ds4_deq32(QT, wrow, sub, wv);
    for (uint l = 0; l < 32u; ++l) {
        y[ulong(row) * ulong(N_IN) + 32u * sub + l] = wv[l];
    }
}
"""


class HostKernel:
    """One kernel body + header compiled as a C++ function with MLX's generated signature."""

    def __init__(self, name, header, body, inputs, templates, out_shape, grid):
        self.name, self.header, self.body = name, header, body
        self.inputs, self.templates, self.out_shape, self.grid = inputs, templates, out_shape, grid


def _host_source(kernels: list[HostKernel]) -> str:
    parts = [_SHIM]
    headers_done = set()
    for k in kernels:
        if k.header not in headers_done:
            parts.append(k.header)
            headers_done.add(k.header)
    dispatch = []
    for idx, k in enumerate(kernels):
        params = [f"const device {_CTYPES[a.dtype]}* {n}" for n, a in k.inputs]
        params.append("device float* y")
        attrs = []
        for attr, typ in (("thread_position_in_grid", "uint3"), ("thread_index_in_simdgroup", "uint")):
            if attr in k.body:
                attrs.append(f"{typ} {attr}")
        consts = "".join(f"    constexpr int {n} = {v};\n" for n, v in k.templates)
        parts.append(f"static void kernel_{idx}({', '.join(params + attrs)}) {{\n{consts}{k.body}\n}}\n")
        loads, args = [], []
        for j, (n, a) in enumerate(k.inputs):
            loads.append(f"auto in{j} = read_file(argv[{2 + j}]);")
            args.append(f"(const {_CTYPES[a.dtype]}*)in{j}.data()")
        gx, gy, gz = k.grid
        call_attrs = []
        if "thread_position_in_grid" in k.body:
            call_attrs.append("uint3{lane, gy, gz}")
        if "thread_index_in_simdgroup" in k.body:
            call_attrs.append("lane")
        n_out = int(np.prod(k.out_shape))
        dispatch.append(textwrap.dedent(f"""
            if (which == {idx}) {{
                {' '.join(loads)}
                std::vector<float> out({n_out}, -12345.0f);
                std::vector<host_thread> lanes;
                for (uint lane = 0; lane < 32; ++lane) {{
                    lanes.emplace_back([&, lane] {{
                        g_lane = lane;
                        for (uint gz = 0; gz < {gz}u; ++gz)
                            for (uint gy = 0; gy < {gy}u; ++gy)
                                kernel_{idx}({', '.join(args + ['out.data()'] + call_attrs)});
                    }});
                }}
                for (auto& t : lanes) t.join();
                FILE* f = std::fopen(argv[{2 + len(k.inputs)}], "wb");
                std::fwrite(out.data(), sizeof(float), out.size(), f);
                std::fclose(f);
                return 0;
            }}"""))
    parts.append("int main(int argc, char** argv) {\n  std::barrier<> bar(32);\n  g_bar = &bar;\n"
                 "  int which = std::atoi(argv[1]);\n" + "\n".join(dispatch) + "\n  return 1;\n}\n")
    return "\n".join(parts)


def run_on_host(kernels: list[HostKernel], tmp_path) -> list[np.ndarray]:
    src = tmp_path / "kernels.cpp"
    exe = tmp_path / "kernels"
    src.write_text(_host_source(kernels))
    proc = subprocess.run(["g++", "-std=c++20", "-O1", "-pthread", "-w", str(src), "-o", str(exe)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = []
    for idx, k in enumerate(kernels):
        paths = []
        for j, (n, a) in enumerate(k.inputs):
            p = tmp_path / f"k{idx}_{n}.bin"
            np.ascontiguousarray(a).tofile(p)
            paths.append(str(p))
        out = tmp_path / f"k{idx}_y.bin"
        subprocess.run([str(exe), str(idx), *paths, str(out)], check=True, timeout=120)
        results.append(np.fromfile(out, dtype=np.float32).reshape(k.out_shape))
    return results


needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ (C++20) not found: host run of kernel sources")


@needs_gxx
def test_kernel_sources_on_host(tmp_path):
    rng = np.random.default_rng(1234)
    header = mk.kernel_sources("expert_matvec")[0]
    kernels, checks = [], []

    # block decoders: bit-exact against numpy for every format (two row lengths: one and two chunks per lane)
    for qtype in (*EXPERT_TYPES, GGMLType.Q8_0):
        for n_in in (512, 2048):
            w = random_rows(rng, qtype, (6,), n_in)
            kernels.append(HostKernel("deq", header, _DEQUANT_BODY, [("w", w)],
                                      [("QT", int(qtype)), ("N_IN", n_in), ("ROW_BYTES", w.shape[1])],
                                      (6, n_in), (32, 6, 1)))
            checks.append(("exact", dequantize_rows(w, qtype)))

    # expert matvec and gathered matmul against the twin
    for qtype in EXPERT_TYPES:
        u, out_dim, n_in, n_rows = 3, 7, 2048 if qtype == GGMLType.IQ2_XXS else 512, 4
        slabs = random_rows(rng, qtype, (u, out_dim), n_in)
        x = rng.standard_normal((n_rows, n_in)).astype(np.float32)
        row_bytes = slabs.shape[2]
        for key, n_pairs in (("expert_matvec", 5), ("expert_gather_mm", 21)):
            slot = rng.integers(0, u, n_pairs)
            rows = rng.integers(0, n_rows, n_pairs)
            twin = np.array(mk.expert_matmul_twin(mx.array(slabs), qtype, mx.array(x), slot, rows))
            tmpl = [("QT", int(qtype)), ("N_IN", n_in), ("N_OUT", out_dim), ("ROW_BYTES", row_bytes)]
            if key == "expert_matvec":
                inputs = [("w", slabs), ("x", x), ("pair_slot", slot.astype(np.int32)),
                          ("pair_row", rows.astype(np.int32))]
                kernels.append(HostKernel(key, header, mk.kernel_sources(key)[1], inputs, tmpl,
                                          (n_pairs, out_dim), (32, out_dim, n_pairs)))
                checks.append(("close", twin, abs_scale(slabs, qtype, x, slot, rows)))
            else:
                order, inverse, t_slot, t_start, t_count = mk.gather_tiles(slot, tile=mk.GATHER_TILE)
                inputs = [("w", slabs), ("x", x), ("tile_slot", t_slot), ("tile_start", t_start),
                          ("tile_count", t_count), ("rows", rows[order].astype(np.int32))]
                kernels.append(HostKernel(key, header, mk.kernel_sources(key)[1], inputs,
                                          tmpl + [("TP", mk.GATHER_TILE)], (n_pairs, out_dim),
                                          (32, out_dim, t_slot.size)))
                # the kernel writes pairs in sorted order; the wrapper applies `inverse`
                checks.append(("close_sorted", twin[order], abs_scale(slabs, qtype, x, slot, rows)[order]))

    # Q8_0 matvec against its twin
    w = random_rows(rng, GGMLType.Q8_0, (9,), 1024)
    x = rng.standard_normal((2, 1024)).astype(np.float32)
    kernels.append(HostKernel("q8", header, mk.kernel_sources("q8_0_matvec")[1], [("w", w), ("x", x)],
                              [("N_IN", 1024), ("N_OUT", 9), ("ROW_BYTES", w.shape[1])], (2, 9), (32, 9, 2)))
    twin = np.array(mk.q8_0_matvec_twin(mx.array(w), mx.array(x)))
    wd = np.abs(dequantize_rows(w, GGMLType.Q8_0)).astype(np.float64)
    checks.append(("close", twin, np.abs(x).astype(np.float64) @ wd.T))

    outputs = run_on_host(kernels, tmp_path)
    for k, got, check in zip(kernels, outputs, checks):
        if check[0] == "exact":
            assert np.array_equal(got.view(np.uint32), check[1].view(np.uint32)), k.templates
        else:
            close(got, check[1], check[2])


# --------------------------------------------------------------------------------------------------
# the real kernels (Metal only)

needs_metal = pytest.mark.skipif(not mx.metal.is_available(),
                                 reason="Metal is not available: MLX custom kernels need an Apple GPU")


@needs_metal
@pytest.mark.metal
@pytest.mark.parametrize("qtype", EXPERT_TYPES)
@pytest.mark.parametrize("n_pairs", [1, 6, 40])
def test_expert_kernels_match_twin(qtype, n_pairs):
    rng = np.random.default_rng(int(qtype) + n_pairs)
    u, out_dim, n_in, n_rows = 4, 64, 1024, 12
    slabs = random_rows(rng, qtype, (u, out_dim), n_in)
    x = rng.standard_normal((n_rows, n_in)).astype(np.float32)
    slot = rng.integers(0, u, n_pairs)
    rows = rng.integers(0, n_rows, n_pairs)
    scale = abs_scale(slabs, qtype, x, slot, rows)
    twin = np.array(mk.expert_matmul_twin(mx.array(slabs), qtype, mx.array(x), slot, rows))
    for fn in (mk.expert_matvec_kernel, mk.expert_gather_mm_kernel, mk.expert_matmul_kernel):
        got = np.array(fn(mx.array(slabs), qtype, mx.array(x), slot, rows))
        close(got, twin.astype(np.float64), scale, rel=1e-5)


@needs_metal
@pytest.mark.metal
def test_q8_0_kernel_matches_twin():
    rng = np.random.default_rng(3)
    w = random_rows(rng, GGMLType.Q8_0, (300,), 4096)
    x = rng.standard_normal((2, 4096)).astype(np.float32)
    twin = np.array(mk.q8_0_matvec_twin(mx.array(w), mx.array(x)))
    got = np.array(mk.q8_0_matvec_kernel(mx.array(w), mx.array(x)))
    wd = np.abs(dequantize_rows(w, GGMLType.Q8_0)).astype(np.float64)
    close(got, twin.astype(np.float64), np.abs(x).astype(np.float64) @ wd.T, rel=1e-5)
