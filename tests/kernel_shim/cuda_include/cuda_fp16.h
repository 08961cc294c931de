// host stand-in for <cuda_fp16.h> (tests/kernel_shim/cuda_shim.h): what the kernels use, bit-exact
#pragma once
#include <cstring>
typedef _Float16 __half;
static inline float __half2float(__half h) { return float(h); }
static inline __half __ushort_as_half(unsigned short u) { __half h; std::memcpy(&h, &u, 2); return h; }
