// Host model of the Metal execution environment that MLX's generated kernel sources need, strict
// enough to show GPU failure modes on a CPU (driven by tests/kernel_shim/shim.py).
//
// * Address spaces are types: the driver rewrites `device T` / `constant T` / `threadgroup T` to
//   shim::asp<space, T> (and drops `thread`, the default space), so handing a threadgroup or constant
//   pointer to a `device` parameter, or writing through `constant`, does not compile.
// * Every typed read and write through such a pointer checks the alignment Metal requires for T
//   (a wide load from a byte offset that is not a multiple of its size is an error, even though x86
//   would happily do it).
// * The threads of a threadgroup are fibers on one host thread, run in a seeded random order that also
//   switches at every threadgroup-memory access and device store; threadgroups are spread over real host
//   threads. threadgroup_barrier waits for every thread of the group (a thread that returned before it is
//   an error); SIMD operations are rendezvous of the live lanes of a simdgroup, and lanes that wait where
//   the others can never come (diverged) are reported instead of hanging. Threadgroup memory and outputs
//   start poisoned; a shuffle from an inactive lane reads poison.
// Failures print one "SHIM-FAIL" line and abort, so the driver can name them.
#pragma once

#include <array>
#include <atomic>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <ucontext.h>
#include <unistd.h>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define SHIM_ASAN 1
#else
#define SHIM_ASAN 0
#endif

typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
typedef _Float16 half;
static_assert(sizeof(ulong) == 8, "Metal's ulong is 64-bit");

namespace shim {

[[noreturn]] void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// ---------------------------------------------------------------------------------------------
// vectors (Metal layout: size and alignment of N lanes, 3 lanes padded to 4; packed_ = element align)

// Lanes by index (c[i]) and by name (.x .y .z .w, as Metal and CUDA spell them): a union, so both
// name the same storage.
template <class T, int N> struct vec_lanes { T c[N]; };
template <class T> struct vec_lanes<T, 2> { union { T c[2]; struct { T x, y; }; }; };
template <class T> struct vec_lanes<T, 3> { union { T c[3]; struct { T x, y, z; }; }; };
template <class T> struct vec_lanes<T, 4> { union { T c[4]; struct { T x, y, z, w; }; }; };

template <class T, int N, bool PACKED>
struct alignas(PACKED ? alignof(T) : (N == 3 ? 4 : N) * sizeof(T)) vec : vec_lanes<T, N> {
    using vec_lanes<T, N>::c;
    vec() = default;
    vec(T s) { for (int i = 0; i < N; ++i) c[i] = s; }
    template <class... A, class = std::enable_if_t<sizeof...(A) == N && (N > 1)>>
    vec(A... a) { const T v[N] = {T(a)...}; for (int i = 0; i < N; ++i) c[i] = v[i]; }
    template <class U, bool P2> explicit vec(const vec<U, N, P2>& o) { for (int i = 0; i < N; ++i) c[i] = T(o.c[i]); }
    template <bool P2> vec(const vec<T, N, P2>& o) { for (int i = 0; i < N; ++i) c[i] = o.c[i]; }
    T& operator[](int i) { return c[i]; }
    const T& operator[](int i) const { return c[i]; }
};
#define SHIM_VEC_OP(op)                                                                          \
    template <class T, int N, bool P> vec<T, N, false> operator op(vec<T, N, P> a, vec<T, N, P> b) { \
        vec<T, N, false> r; for (int i = 0; i < N; ++i) r.c[i] = a.c[i] op b.c[i]; return r; }       \
    template <class T, int N, bool P> vec<T, N, false> operator op(vec<T, N, P> a, T b) {           \
        vec<T, N, false> r; for (int i = 0; i < N; ++i) r.c[i] = a.c[i] op b; return r; }            \
    template <class T, int N, bool P> vec<T, N, false> operator op(T a, vec<T, N, P> b) {           \
        vec<T, N, false> r; for (int i = 0; i < N; ++i) r.c[i] = a op b.c[i]; return r; }
SHIM_VEC_OP(+) SHIM_VEC_OP(-) SHIM_VEC_OP(*) SHIM_VEC_OP(/) SHIM_VEC_OP(&) SHIM_VEC_OP(|) SHIM_VEC_OP(^)
SHIM_VEC_OP(>>) SHIM_VEC_OP(<<)
#undef SHIM_VEC_OP

// ---------------------------------------------------------------------------------------------
// address spaces

enum Space { DEVICE = 1, CONSTANT = 2, THREADGROUP = 3 };
const char* space_name(int s);
void check_align(const void* p, size_t align, size_t size, int space, const char* what);
void memory_point(int space, bool write);

template <class T> const char* type_name() { return __PRETTY_FUNCTION__; }

// One element of type T living in address space S. Layout-identical to T; reads and writes go through
// the checks. An aggregate, so `constant T table[] = {...}` still brace-initialises.
template <int S, class T>
struct asp {
    T v_;
    operator T() const {
        check_align(this, alignof(T), sizeof(T), S, type_name<T>());
        memory_point(S, false);
        return v_;
    }
    template <class U, class = std::enable_if_t<std::is_convertible_v<U, T>>>
    asp& operator=(const U& x) {
        static_assert(S != CONSTANT, "write through a `constant` pointer");
        check_align(this, alignof(T), sizeof(T), S, type_name<T>());
        memory_point(S, true);
        v_ = T(x);
        return *this;
    }
    asp& operator=(const asp& o) { return *this = T(o); }
#define SHIM_ASP_CASSIGN(op) \
    template <class U> asp& operator op##=(const U& x) { return *this = T(T(*this) op x); }
    SHIM_ASP_CASSIGN(+) SHIM_ASP_CASSIGN(-) SHIM_ASP_CASSIGN(*) SHIM_ASP_CASSIGN(/)
    SHIM_ASP_CASSIGN(&) SHIM_ASP_CASSIGN(|) SHIM_ASP_CASSIGN(^) SHIM_ASP_CASSIGN(<<) SHIM_ASP_CASSIGN(>>)
#undef SHIM_ASP_CASSIGN
};

// ---------------------------------------------------------------------------------------------
// threads of a threadgroup

struct uint3v { uint x, y, z; };

struct ThreadIds {
    uint3v thread_position_in_grid, thread_position_in_threadgroup, threadgroup_position_in_grid;
    uint3v threads_per_threadgroup, threadgroups_per_grid, threads_per_grid, grid_size, grid_origin;
    uint3v dispatch_threads_per_threadgroup;
    uint thread_index_in_threadgroup, thread_index_in_simdgroup, simdgroup_index_in_threadgroup;
    uint simdgroups_per_threadgroup, threads_per_simdgroup, thread_execution_width;
    uint thread_index_in_quadgroup, quadgroup_index_in_threadgroup, quadgroups_per_threadgroup;
    uint dispatch_simdgroups_per_threadgroup, dispatch_quadgroups_per_threadgroup;
};

constexpr int SIMD = 32;

// one per kernel instantiation: calls it with the launch's buffers and the thread's ids (generated)
using Thunk = void (*)(void* const* bufs, const ThreadIds& ids);
extern Thunk shim_thunks[];

// SIMD rendezvous payload: up to 16 bytes per lane
struct Lane16 { unsigned char b[16]; };

template <class T> Lane16 to16(const T& v) {
    static_assert(sizeof(T) <= 16);
    Lane16 l; std::memset(l.b, 0, 16); std::memcpy(l.b, &v, sizeof(T)); return l;
}
template <class T> T from16(const Lane16& l) { T v; std::memcpy(&v, l.b, sizeof(T)); return v; }

// Rendezvous of the live lanes of the calling simdgroup at SIMD op `site`; returns all lanes' values
// (`alive[i]` false: lane i has exited, its value is poison) and the caller's lane.
const Lane16* simd_exchange(const Lane16& mine, const char* site, const bool** alive, uint* lane);
void tg_barrier(const char* site);
void* tg_alloc(const char* key, size_t size, size_t align);
unsigned char poison_byte();
const ThreadIds& current_ids();  // the calling GPU thread's ids (CUDA's threadIdx & co.)

}  // namespace shim

#define SHIM_STR2(x) #x
#define SHIM_STR(x) SHIM_STR2(x)
#define SHIM_SITE __FILE__ ":" SHIM_STR(__LINE__)

#ifndef SHIM_CUDA
// ---------------------------------------------------------------------------------------------
// Metal names

typedef shim::uint3v uint3;  // the ids; other uint vectors have no named lanes in this shim
typedef shim::vec<uint, 2, false> uint2;
typedef shim::vec<uint, 4, false> uint4;
typedef shim::vec<uint, 4, true> packed_uint4;
typedef shim::vec<uint, 2, true> packed_uint2;
typedef half float16_t;
#define SHIM_VEC_NAMES(T, name)                                          \
    typedef shim::vec<T, 2, false> name##2;                             \
    typedef shim::vec<T, 3, false> name##3;                             \
    typedef shim::vec<T, 4, false> name##4;                             \
    typedef shim::vec<T, 2, true> packed_##name##2;                     \
    typedef shim::vec<T, 3, true> packed_##name##3;                     \
    typedef shim::vec<T, 4, true> packed_##name##4;
SHIM_VEC_NAMES(float, float) SHIM_VEC_NAMES(half, half) SHIM_VEC_NAMES(int, int)
SHIM_VEC_NAMES(short, short) SHIM_VEC_NAMES(ushort, ushort) SHIM_VEC_NAMES(ulong, ulong) SHIM_VEC_NAMES(long, long)
SHIM_VEC_NAMES(char, char) SHIM_VEC_NAMES(uchar, uchar)
#undef SHIM_VEC_NAMES

namespace metal {
template <class T, class U> static inline T as_type(U u) {
    static_assert(sizeof(T) == sizeof(U), "as_type between types of different sizes");
    T t;
    std::memcpy(&t, &u, sizeof t);
    return t;
}
static inline uint popcount(uint v) { return (uint)__builtin_popcount(v); }
static inline ulong popcount(ulong v) { return (ulong)__builtin_popcountl(v); }
static inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
static inline float min(float a, float b) { return std::fmin(a, b); }
static inline float max(float a, float b) { return std::fmax(a, b); }
static inline uint min(uint a, uint b) { return a < b ? a : b; }
static inline uint max(uint a, uint b) { return a > b ? a : b; }
static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline float clamp(float v, float lo, float hi) { return std::fmin(std::fmax(v, lo), hi); }
static inline float abs(float v) { return std::fabs(v); }
static inline float exp(float v) { return std::exp(v); }
static inline float precise_divide(float a, float b) { return a / b; }
namespace precise { static inline float exp(float v) { return std::exp(v); } }
template <class T, int N, bool P> T dot(shim::vec<T, N, P> a, shim::vec<T, N, P> b) {
    T s = T(0); for (int i = 0; i < N; ++i) s += a.c[i] * b.c[i]; return s;
}

namespace mem_flags { enum Flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 }; }
inline mem_flags::Flags operator|(mem_flags::Flags a, mem_flags::Flags b) {
    return mem_flags::Flags(int(a) | int(b));
}

#define threadgroup_barrier(flags) (::shim::tg_barrier(__FILE__ ":" SHIM_STR(__LINE__)))
#define simdgroup_barrier(flags) ((void)::shim::simd_exchange({}, __FILE__ ":" SHIM_STR(__LINE__), nullptr, nullptr))
template <class T> T simd_sum_at(T v, const char* site) {
    const bool* alive; uint lane;
    const shim::Lane16* all = shim::simd_exchange(shim::to16(v), site, &alive, &lane);
    T s = T(0);
    for (int i = 0; i < shim::SIMD; ++i) if (alive[i]) s += shim::from16<T>(all[i]);
    return s;
}
template <class T> T simd_max_at(T v, const char* site) {
    const bool* alive; uint lane;
    const shim::Lane16* all = shim::simd_exchange(shim::to16(v), site, &alive, &lane);
    T s = v;
    for (int i = 0; i < shim::SIMD; ++i) if (alive[i] && shim::from16<T>(all[i]) > s) s = shim::from16<T>(all[i]);
    return s;
}
template <class T> T simd_min_at(T v, const char* site) {
    const bool* alive; uint lane;
    const shim::Lane16* all = shim::simd_exchange(shim::to16(v), site, &alive, &lane);
    T s = v;
    for (int i = 0; i < shim::SIMD; ++i) if (alive[i] && shim::from16<T>(all[i]) < s) s = shim::from16<T>(all[i]);
    return s;
}
// a read from an inactive lane (or out of the simdgroup) yields poison
template <class T> T simd_read_lane(T v, const char* site, int (*pick)(uint, uint), uint arg) {
    const bool* alive; uint lane;
    const shim::Lane16* all = shim::simd_exchange(shim::to16(v), site, &alive, &lane);
    const int src = pick(lane, arg);
    if (src < 0 || src >= shim::SIMD || !alive[src]) {
        T p; std::memset(&p, shim::poison_byte(), sizeof p); return p;
    }
    return shim::from16<T>(all[src]);
}
inline int lane_abs(uint, uint a) { return int(a); }
inline int lane_down(uint l, uint d) { return int(l + d); }
inline int lane_up(uint l, uint d) { return int(l) - int(d); }
inline int lane_xor(uint l, uint m) { return int(l ^ m); }
template <class T> T simd_prefix_exclusive_sum_at(T v, const char* site) {
    const bool* alive; uint lane;
    const shim::Lane16* all = shim::simd_exchange(shim::to16(v), site, &alive, &lane);
    T s = T(0);
    for (uint i = 0; i < lane; ++i) if (alive[i]) s += shim::from16<T>(all[i]);
    return s;
}
}  // namespace metal
using namespace metal;

#define simd_sum(v) ::metal::simd_sum_at((v), SHIM_SITE)
#define simd_max(v) ::metal::simd_max_at((v), SHIM_SITE)
#define simd_min(v) ::metal::simd_min_at((v), SHIM_SITE)
#define simd_prefix_exclusive_sum(v) ::metal::simd_prefix_exclusive_sum_at((v), SHIM_SITE)
#define simd_shuffle(v, l) ::metal::simd_read_lane((v), SHIM_SITE, ::metal::lane_abs, uint(l))
#define simd_broadcast(v, l) ::metal::simd_read_lane((v), SHIM_SITE, ::metal::lane_abs, uint(l))
#define simd_shuffle_down(v, d) ::metal::simd_read_lane((v), SHIM_SITE, ::metal::lane_down, uint(d))
#define simd_shuffle_up(v, d) ::metal::simd_read_lane((v), SHIM_SITE, ::metal::lane_up, uint(d))
#define simd_shuffle_xor(v, m) ::metal::simd_read_lane((v), SHIM_SITE, ::metal::lane_xor, uint(m))

// `threadgroup T name[N]...;` in a kernel body becomes this: storage shared by the group, poisoned
#define SHIM_TG_DECL(T, name, extents)                                                       \
    using shim_tg_type_##name = T extents;                                                   \
    shim_tg_type_##name& name = *static_cast<shim_tg_type_##name*>(                          \
        ::shim::tg_alloc(SHIM_SITE ":" #name, sizeof(shim_tg_type_##name), alignof(shim_tg_type_##name)))

// ---------------------------------------------------------------------------------------------
// simdgroup matrices (8x8, <metal_simdgroup_matrix>). On the GPU the 64 elements are spread over the 32
// lanes, two each, and load / store / multiply are collective. Here every lane keeps the whole matrix:
// a load is a rendezvous where each lane reads its own two elements through the checked pointers (so
// alignment, poison and ASan see the real per-lane accesses) and all lanes receive all 64; a store writes
// only the lane's own two elements; multiply_accumulate computes D = A B + C in plain fp32 (each product
// and each sum rounded, k in order, no fused multiply-add: the build uses -ffp-contract=off), identically
// on every lane. Lanes that reach a matrix op at different sites, or with lanes of the simdgroup gone,
// fail like any diverged SIMD op.
namespace metal {
template <class T, int C, int R> struct simdgroup_matrix { T m[R][C]; };
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;

template <class T, int C, int R> simdgroup_matrix<T, C, R> make_filled_simdgroup_matrix(T v) {
    simdgroup_matrix<T, C, R> a;
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < C; ++j) a.m[i][j] = v;
    return a;
}

inline const shim::Lane16* simdgroup_matrix_rendezvous(const shim::Lane16& mine, const char* site, uint* lane) {
    const bool* alive;
    const shim::Lane16* all = shim::simd_exchange(mine, site, &alive, lane);
    for (int i = 0; i < shim::SIMD; ++i)
        if (!alive[i]) shim::fail("simdgroup matrix op at %s with lane %d of the simdgroup inactive", site, i);
    return all;
}

// element e (row e / C, column e % C) of the matrix belongs to lane e / 2
template <int S, class T, int C, int R>
void simdgroup_load_at(const char* site, simdgroup_matrix<T, C, R>& d, const shim::asp<S, T>* src, ulong stride = C,
                       ulong2 origin = ulong2(0, 0), bool transpose = false) {
    static_assert(R * C == 2 * shim::SIMD, "8x8 matrices only");
    const uint me = shim::current_ids().thread_index_in_simdgroup;
    T mine[2];
    for (int k = 0; k < 2; ++k) {
        const uint e = 2 * me + uint(k), i = e / C, j = e % C;
        // element (i, j) of the loaded matrix: row i, column j of the source (or its transpose)
        const ulong r = transpose ? j : i, c = transpose ? i : j;
        mine[k] = src[(origin.y + r) * stride + origin.x + c];
    }
    uint lane;
    const shim::Lane16* all = simdgroup_matrix_rendezvous(shim::to16(mine), site, &lane);
    for (int l = 0; l < shim::SIMD; ++l) {
        const auto two = shim::from16<std::array<T, 2>>(all[l]);
        for (int k = 0; k < 2; ++k) d.m[(2 * l + k) / C][(2 * l + k) % C] = two[k];
    }
}

template <int S, class T, int C, int R>
void simdgroup_store_at(const char* site, const simdgroup_matrix<T, C, R>& a, shim::asp<S, T>* dst, ulong stride = C,
                        ulong2 origin = ulong2(0, 0), bool transpose = false) {
    static_assert(S != shim::CONSTANT, "simdgroup_store to `constant` memory");
    uint lane;
    simdgroup_matrix_rendezvous(shim::Lane16{}, site, &lane);
    for (int k = 0; k < 2; ++k) {
        const uint e = 2 * lane + uint(k), i = e / C, j = e % C;
        const ulong r = transpose ? j : i, c = transpose ? i : j;
        dst[(origin.y + r) * stride + origin.x + c] = a.m[i][j];
    }
}

template <class T, int C, int R>
void simdgroup_multiply_accumulate(simdgroup_matrix<T, C, R>& d, const simdgroup_matrix<T, C, R>& a,
                                   const simdgroup_matrix<T, C, R>& b, const simdgroup_matrix<T, C, R>& c) {
    static_assert(R == C, "square matrices only");
    simdgroup_matrix<T, C, R> r;
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < C; ++j) {
            T s = c.m[i][j];
            for (int k = 0; k < C; ++k) s = T(s + T(a.m[i][k] * b.m[k][j]));
            r.m[i][j] = s;
        }
    d = r;
}
template <class T, int C, int R>
void simdgroup_multiply(simdgroup_matrix<T, C, R>& d, const simdgroup_matrix<T, C, R>& a,
                        const simdgroup_matrix<T, C, R>& b) {
    simdgroup_multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<T, C, R>(T(0)));
}
}  // namespace metal

#define simdgroup_load(...) ::metal::simdgroup_load_at(SHIM_SITE, __VA_ARGS__)
#define simdgroup_store(...) ::metal::simdgroup_store_at(SHIM_SITE, __VA_ARGS__)
#endif  // SHIM_CUDA
