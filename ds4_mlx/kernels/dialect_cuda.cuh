// CUDA dialect of the ds4-mlx kernels (first part of every mx.fast.cuda_kernel header): the DS4_*
// names of quant_common.h and the kernel bodies, with their CUDA meaning (a warp is the SIMD group).
#include <cuda_fp16.h>

#define DS4_CUDA 1
#define DS4_FN __device__ __forceinline__
#define DS4_GLOBAL
#define DS4_TGP                      // __shared__ is a storage class, not a pointer qualifier
#define DS4_THR
#define DS4_TG __shared__
#define DS4_TABLE __device__ const
#define DS4_BARRIER() __syncthreads()
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long long ds4_u64;
typedef unsigned long ulong;  // as sys/types.h has it (LP64: 64 bits), so the two may meet

DS4_FN float ds4_half_bits_to_float(ushort h) { return __half2float(__ushort_as_half(h)); }
DS4_FN float ds4_bits_to_float(uint v) { return __uint_as_float(v); }
DS4_FN uint ds4_popcount(uint v) { return (uint)__popc(v); }
// butterfly over the 32 lanes of the warp: every lane ends with the full sum (as Metal's simd_sum)
DS4_FN float ds4_lane_sum(float v) {
    for (int m = 16; m > 0; m >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, m);
    }
    return v;
}
DS4_FN float ds4_exp(float v) { return expf(v); }
