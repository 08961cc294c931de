// Metal dialect of the ds4-mlx kernels (first part of every mx.fast.metal_kernel header).
// The kernel bodies and quant_common.h are written once against the DS4_* names below; the CUDA
// dialect (dialect_cuda.cuh) gives the same names their CUDA meaning, so one design runs on both.
#include <metal_stdlib>
#include <metal_simdgroup_matrix>
using namespace metal;

#define DS4_METAL 1
#define DS4_FN inline
#define DS4_GLOBAL device            // weights, activations, outputs (pointer qualifier)
#define DS4_TGP threadgroup          // pointer to threadgroup memory (in a parameter type)
#define DS4_THR thread               // pointer to a thread's registers
#define DS4_TG threadgroup           // staged tables and tiles
#define DS4_TABLE constant           // compile-time tables (read once per threadgroup, then staged)
#define DS4_BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
typedef ulong ds4_u64;

DS4_FN float ds4_half_bits_to_float(ushort h) { return float(as_type<half>(h)); }
DS4_FN float ds4_bits_to_float(uint v) { return as_type<float>(v); }
DS4_FN uint ds4_popcount(uint v) { return popcount(v); }
DS4_FN float ds4_lane_sum(float v) { return simd_sum(v); }
DS4_FN float ds4_exp(float v) { return precise::exp(v); }
