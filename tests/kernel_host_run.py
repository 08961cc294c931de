"""Run the GPU kernel sources on the host: g++ compiles them, in either dialect, with a small shim.

What the shim plays (a minimal harness; a stricter one with poisoned threadgroup memory, randomised
interleavings and sanitisers is being built in ``tests/kernel_shim/``):
* one threadgroup at a time, each thread of it a real host thread; ``threadgroup_barrier`` /
  ``__syncthreads`` are a barrier over the group, so a missing barrier races for real;
* SIMD groups of 32 lanes: ``simd_sum`` and ``__shfl_xor_sync`` exchange values through a per-group
  barrier, so a reduction reached by only some lanes deadlocks (the run has a timeout);
* threadgroup / ``__shared__`` memory as function statics (shared by the group's threads); the 8x8
  simdgroup matrices of Metal, each lane holding the whole matrix and storing its own two elements;
* built with ASan and UBSan (reads or writes past a buffer, misaligned typed loads abort the run),
  threadgroups run in a shuffled order and canaries follow the outputs, so a stray write shows;
* the signature MLX generates (template ints as ``template`` parameters for Metal, ``constexpr int``
  locals for CUDA), the launch geometry MLX uses (CUDA: ceil(grid / block) blocks of full size; the
  wrappers only launch whole threadgroups, so Metal sees the same).
The CUDA dialect runs through the same harness: its shuffles, barriers and the SIMT prefill branch are
executed with lanes as threads (no warp scheduling semantics beyond that).
"""

from __future__ import annotations

import subprocess
import textwrap
from dataclasses import dataclass

import numpy as np

from ds4_mlx.model import metal_kernels as mk

_CTYPES = {np.dtype(np.uint8): "uint8_t", np.dtype(np.float32): "float", np.dtype(np.int32): "int32_t"}

_COMMON = r"""
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
using host_thread = std::thread;
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
struct uint3 { uint x, y, z; };
static std::barrier<>* g_group_bar;
static std::vector<std::barrier<>*> g_sg_bar;
static float g_slots[1024];
static thread_local uint g_tid;
static inline void host_group_barrier() { g_group_bar->arrive_and_wait(); }
static inline float host_exchange(float v, uint src) {
    g_slots[g_tid] = v;
    g_sg_bar[g_tid / 32]->arrive_and_wait();
    const float r = g_slots[src];
    g_sg_bar[g_tid / 32]->arrive_and_wait();
    return r;
}
static inline float host_simd_sum(float v) {
    g_slots[g_tid] = v;
    g_sg_bar[g_tid / 32]->arrive_and_wait();
    float s = 0.0f;
    for (uint i = 0; i < 32; ++i) s += g_slots[(g_tid & ~31u) + i];
    g_sg_bar[g_tid / 32]->arrive_and_wait();
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

_METAL_SHIM = r"""
#define device
#define constant
#define thread
#define threadgroup
typedef _Float16 half;
struct ulong2 { ulong x, y; ulong2(ulong a, ulong b) : x(a), y(b) {} };
template <class T, class U> static inline T as_type(U u) {
    static_assert(sizeof(T) == sizeof(U)); T t; std::memcpy(&t, &u, sizeof t); return t;
}
static inline uint popcount(uint v) { return (uint)__builtin_popcount(v); }
namespace precise { static inline float exp(float v) { return std::exp(v); } }
namespace mem_flags { constexpr int mem_threadgroup = 1; }
static inline void threadgroup_barrier(int) { host_group_barrier(); }
static inline float simd_sum(float v) { return host_simd_sum(v); }
struct simdgroup_float8x8 { float m[8][8]; };
template <class T, int R, int C> static inline simdgroup_float8x8 make_filled_simdgroup_matrix(T v) {
    simdgroup_float8x8 a; for (int i = 0; i < 8; ++i) for (int j = 0; j < 8; ++j) a.m[i][j] = v; return a;
}
static inline void simdgroup_load(simdgroup_float8x8& a, const float* p, ulong stride,
                                  ulong2 origin = ulong2(0, 0), bool transpose = false) {
    for (int i = 0; i < 8; ++i)
        for (int j = 0; j < 8; ++j)
            a.m[i][j] = transpose ? p[(origin.y + j) * stride + origin.x + i] : p[(origin.y + i) * stride + origin.x + j];
}
static inline void simdgroup_store(const simdgroup_float8x8& a, float* p, ulong stride) {
    const uint lane = g_tid & 31u;  // each lane owns two of the 64 elements
    for (uint e = 2 * lane; e < 2 * lane + 2; ++e) p[(e / 8) * stride + e % 8] = a.m[e / 8][e % 8];
}
static inline void simdgroup_multiply_accumulate(simdgroup_float8x8& d, const simdgroup_float8x8& a,
                                                 const simdgroup_float8x8& b, const simdgroup_float8x8& c) {
    simdgroup_float8x8 r;
    for (int i = 0; i < 8; ++i)
        for (int j = 0; j < 8; ++j) {
            float s = c.m[i][j];
            for (int k = 0; k < 8; ++k) s += a.m[i][k] * b.m[k][j];
            r.m[i][j] = s;
        }
    d = r;
}
"""

_CUDA_SHIM = r"""
#define __device__
#define __forceinline__ inline
typedef _Float16 __half;
static thread_local uint3 threadIdx, blockIdx;
static inline float __half2float(__half h) { return float(h); }
static inline __half __ushort_as_half(ushort u) { __half h; std::memcpy(&h, &u, 2); return h; }
static inline int __popc(uint v) { return __builtin_popcount(v); }
static inline void __syncthreads() { host_group_barrier(); }
static inline float __shfl_xor_sync(uint, float v, int m) { return host_exchange(v, g_tid ^ (uint)m); }
"""


@dataclass
class HostLaunch:
    """One kernel launch: key (``mk.KERNELS``) or a custom (name, body); inputs, templates, grid, group."""

    key: str
    inputs: list            # [(name, np.ndarray)]
    templates: list         # [(name, int)]
    out_shape: tuple
    grid: tuple
    group: tuple
    body: str | None = None


def _strip_includes(src: str) -> str:
    return "\n".join(l for l in src.splitlines()
                     if not l.startswith("#include") and not l.startswith("using namespace metal"))


def host_source(launches: list[HostLaunch], dialect: str) -> str:
    shim = _METAL_SHIM if dialect == "metal" else _CUDA_SHIM
    header = _strip_includes(mk.kernel_sources("expert_matvec", dialect)[0])
    parts = [_COMMON, shim, header]
    if dialect == "metal":
        # threadgroup arrays become statics shared by the group's host threads
        parts.append("#undef DS4_TG\n#define DS4_TG static\n")
    else:
        parts.append("#undef DS4_TG\n#define DS4_TG static\n")
    dispatch = []
    for idx, ln in enumerate(launches):
        body = ln.body if ln.body is not None else mk.kernel_sources(ln.key, dialect)[1]
        params = [f"const {_CTYPES[a.dtype]}* {n}" for n, a in ln.inputs] + ["float* y"]
        if dialect == "metal":
            attrs = ["uint3 threadgroup_position_in_grid", "uint thread_index_in_threadgroup"]
            tparams = ", ".join(f"int {n}" for n, _ in ln.templates)
            parts.append(f"template <{tparams}>\nstatic void kernel_{idx}({', '.join(params + attrs)}) {{\n"
                         f"{body}\n}}\n")
            call_t = "<" + ", ".join(str(v) for _, v in ln.templates) + ">"
            call_attrs = ["uint3{gx, gy, gz}", "tid"]
        else:
            consts = "".join(f"    constexpr int {n} = {v};\n" for n, v in ln.templates)
            parts.append(f"static void kernel_{idx}({', '.join(params)}) {{\n{consts}{body}\n}}\n")
            call_t = ""
            call_attrs = []
        loads = " ".join(f"auto in{j} = read_file(argv[{2 + j}]);" for j in range(len(ln.inputs)))
        args = [f"(const {_CTYPES[a.dtype]}*)in{j}.data()" for j, (_, a) in enumerate(ln.inputs)]
        nt = int(np.prod(ln.group))
        ngx, ngy, ngz = (-(-g // t) for g, t in zip(ln.grid, ln.group))
        set_idx = ("threadIdx = uint3{tid, 0, 0}; blockIdx = uint3{gx, gy, gz};" if dialect == "cuda" else "")
        n_out = int(np.prod(ln.out_shape))
        dispatch.append(textwrap.dedent(f"""
            if (which == {idx}) {{
                {loads}
                std::vector<float> out({n_out} + 64, -12345.0f);
                std::barrier<> gbar({nt});
                g_group_bar = &gbar;
                std::vector<std::barrier<>*> sgb;
                for (uint s = 0; s < {max(1, nt // 32)}u; ++s) sgb.push_back(new std::barrier<>(32));
                g_sg_bar = sgb;
                // threadgroups in a shuffled order (a stray write into another group's outputs is then
                // overwritten or not depending on order, so it shows); canaries after the outputs
                std::vector<uint> order({ngx * ngy * ngz});
                for (uint i = 0; i < order.size(); ++i) order[i] = i;
                uint64_t seed = 0x9e3779b97f4a7c15ull ^ {idx}u;
                for (size_t i = order.size(); i > 1; --i) {{
                    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
                    std::swap(order[i - 1], order[(seed >> 33) % i]);
                }}
                std::vector<host_thread> threads;
                for (uint tid = 0; tid < {nt}u; ++tid) {{
                    threads.emplace_back([&, tid] {{
                        g_tid = tid;
                        for (uint g : order) {{
                            const uint gx = g % {ngx}u, gy = (g / {ngx}u) % {ngy}u, gz = g / ({ngx}u * {ngy}u);
                            {set_idx}
                            kernel_{idx}{call_t}({', '.join(args + ['out.data()'] + call_attrs)});
                            host_group_barrier();  // next group reuses the threadgroup memory
                        }}
                    }});
                }}
                for (auto& t : threads) t.join();
                for (auto* b : sgb) delete b;
                for (size_t i = {n_out}; i < out.size(); ++i)
                    if (out[i] != -12345.0f) {{ std::fprintf(stderr, "write past the output end\\n"); return 4; }}
                out.resize({n_out});
                FILE* f = std::fopen(argv[{2 + len(ln.inputs)}], "wb");
                std::fwrite(out.data(), sizeof(float), out.size(), f);
                std::fclose(f);
                return 0;
            }}"""))
    parts.append("int main(int argc, char** argv) {\n  int which = std::atoi(argv[1]);\n"
                 + "\n".join(dispatch) + "\n  return 1;\n}\n")
    return "\n".join(parts)


def run_on_host(launches: list[HostLaunch], dialect: str, tmp_path, timeout: float = 300) -> list[np.ndarray]:
    """Compile the launches into one executable and run each; returns the outputs (float32)."""
    src = tmp_path / f"kernels_{dialect}.cpp"
    exe = tmp_path / f"kernels_{dialect}"
    src.write_text(host_source(launches, dialect))
    proc = subprocess.run(["g++", "-std=c++20", "-O1", "-ffp-contract=off", "-pthread", "-Wall",
                           "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                           "-Wno-unused-variable", "-Wno-unused-but-set-variable", "-Wno-unused-function",
                           str(src), "-o", str(exe)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    results = []
    for idx, ln in enumerate(launches):
        paths = []
        for j, (n, a) in enumerate(ln.inputs):
            p = tmp_path / f"{dialect}{idx}_{n}.bin"
            np.ascontiguousarray(a).tofile(p)
            paths.append(str(p))
        out = tmp_path / f"{dialect}{idx}_y.bin"
        subprocess.run([str(exe), str(idx), *paths, str(out)], check=True, timeout=timeout)
        results.append(np.fromfile(out, dtype=np.float32).reshape(ln.out_shape))
    return results
