// Host model of the CUDA execution environment that MLX's generated cuda_kernel sources need: the
// CUDA dialect of the same strict shim (core in metal_shim.h, runtime in metal_shim_runtime.h).
//
// * MLX's generated translation unit (mlx/backend/cuda/custom_kernel.cpp, build_kernel) starts with
//   `#include "mlx/backend/cuda/device/utils.cuh"` and <cooperative_groups.h>; cuda_include/ holds
//   host stand-ins for those and <cuda_fp16.h> (only what the kernels use, so anything else fails to
//   compile instead of silently meaning something else).
// * Kernels are `__global__` functions with `const T*` inputs and `T*` outputs; threadIdx, blockIdx,
//   blockDim and gridDim read the calling fiber's ids. `__shared__` arrays become storage shared by the
//   block's fibers, poisoned (shim.py rewrites the declaration); `__syncthreads()` is the threadgroup
//   barrier (reached by all threads at the same site, none returned); `__shfl_xor_sync` is a rendezvous of
//   the warp's lanes (divergence detected, every lane named in the mask must be there).
// * Pointers are generic in CUDA, so address spaces are not types here; what C++ can still see is a
//   write through a `const` input (a compile error). Misaligned typed accesses are caught by UBSan's
//   alignment check, which the driver keeps on in every CUDA build.
#pragma once

#define SHIM_CUDA 1
#include "metal_shim.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __grid_constant__
#define __restrict__ __restrict

#define threadIdx (::shim::current_ids().thread_position_in_threadgroup)
#define blockIdx (::shim::current_ids().threadgroup_position_in_grid)
#define blockDim (::shim::current_ids().threads_per_threadgroup)
#define gridDim (::shim::current_ids().threadgroups_per_grid)
#define warpSize 32

#define __syncthreads() (::shim::tg_barrier(SHIM_SITE))

namespace shim {
template <class T> T shfl_xor_at(unsigned mask, T v, int m, const char* site) {
    const bool* alive;
    uint lane;
    const Lane16* all = simd_exchange(to16(v), site, &alive, &lane);
    for (int i = 0; i < SIMD; ++i)
        if (((mask >> i) & 1u) && !alive[i]) fail("__shfl_xor_sync at %s: lane %d is in the mask but has exited", site, i);
    if (!((mask >> lane) & 1u)) fail("__shfl_xor_sync at %s: the calling lane %u is not in its own mask", site, lane);
    const uint src = lane ^ uint(m);
    if (src >= uint(SIMD) || !alive[src] || !((mask >> src) & 1u)) {
        T p;
        std::memset(&p, poison_byte(), sizeof p);
        return p;
    }
    return from16<T>(all[src]);
}
}  // namespace shim
#define __shfl_xor_sync(mask, v, m) (::shim::shfl_xor_at((mask), (v), (m), SHIM_SITE))

static inline int __popc(unsigned v) { return __builtin_popcount(v); }
static inline float __uint_as_float(unsigned v) {
    float f;
    std::memcpy(&f, &v, sizeof f);
    return f;
}
