/* Dense Q8_0 matrix-vector products read in place from the GGUF blocks (the output head).
 *
 * y[t][r] = sum over the row's blocks b and their 32 codes j of (d_rb * q_rbj) * x[t][32b + j], in
 * float32: the weight is the value DEFAULT numerics dequantize (the f16 scale as float times the
 * code, one rounding), multiplied by the activation, added into one of 32 lanes (lane j); after the
 * last block the lanes fold as s[i] = (l[i] + l[8+i]) + (l[16+i] + l[24+i]) (i < 8), then
 * ((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7)). Every row is summed in this one order whatever
 * the thread count or the instruction set, so the AVX2 loop and the portable one give the same bits
 * (tests/test_native_dense.py checks both against a numpy twin of this order).
 *
 * Why: MLX's CPU backend multiplies a dense weight as float32 (a Q8_0 matrix held as float32 is 3.8x
 * its GGUF bytes), and for one token the output head is a read of the whole matrix: 129280 rows x
 * n_embd. Reading the Q8_0 blocks instead moves 34/128 of the bytes (the tiny model's head: 70 MB
 * a token instead of 265 MB) and holds no float32 copy at all (2 GiB on the real model).
 *
 * Build rules as experts.c: -ffp-contract=off, never -ffast-math (a fused multiply-add or a
 * reassociated sum would change bits). DS4N_PORTABLE forces the portable loop (the tests build it).
 */

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"

#if defined(__AVX2__) && defined(__F16C__) && !defined(DS4N_PORTABLE)
#include <immintrin.h>
#define DS4N_Q8_AVX2 1
#endif

#define QK8_0 32
#define Q8_0_BYTES 34

static float fold(const float l[32]) {
    float s[8];
    for (int i = 0; i < 8; i++) s[i] = (l[i] + l[8 + i]) + (l[16 + i] + l[24 + i]);
    return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}

#ifdef DS4N_Q8_AVX2
static float row_dot(const uint8_t *row, const float *x, int nb) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (size_t)b * Q8_0_BYTES;
        uint16_t h;
        memcpy(&h, blk, 2);
        /* the hardware conversion: exact, as ds4n_half_to_float (both quiet a NaN) */
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(h));
        const __m128i qa = _mm_loadu_si128((const __m128i *)(blk + 2));
        const __m128i qb = _mm_loadu_si128((const __m128i *)(blk + 18));
        const float *xb = x + (size_t)b * QK8_0;
        const __m256 w0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(qa)));
        const __m256 w1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(qa, 8))));
        const __m256 w2 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(qb)));
        const __m256 w3 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(qb, 8))));
        a0 = _mm256_add_ps(a0, _mm256_mul_ps(w0, _mm256_loadu_ps(xb)));
        a1 = _mm256_add_ps(a1, _mm256_mul_ps(w1, _mm256_loadu_ps(xb + 8)));
        a2 = _mm256_add_ps(a2, _mm256_mul_ps(w2, _mm256_loadu_ps(xb + 16)));
        a3 = _mm256_add_ps(a3, _mm256_mul_ps(w3, _mm256_loadu_ps(xb + 24)));
    }
    float l[32];
    _mm256_storeu_ps(l, a0);
    _mm256_storeu_ps(l + 8, a1);
    _mm256_storeu_ps(l + 16, a2);
    _mm256_storeu_ps(l + 24, a3);
    return fold(l);
}
#else
static float row_dot(const uint8_t *row, const float *x, int nb) {
    float l[32] = {0};
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (size_t)b * Q8_0_BYTES;
        const float d = ds4n_half_to_float(blk);
        const int8_t *q = (const int8_t *)(blk + 2);
        const float *xb = x + (size_t)b * QK8_0;
        for (int j = 0; j < QK8_0; j++) l[j] = l[j] + (d * (float)q[j]) * xb[j];
    }
    return fold(l);
}
#endif

typedef struct {
    const uint8_t *base;
    int64_t row_stride;
    int64_t n_rows;
    int n_in, n_x;
    const float *x;
    float *y;
    int64_t r0, r1;
} q8_job;

static void *q8_worker(void *argp) {
    const q8_job *j = (const q8_job *)argp;
    const int nb = j->n_in / QK8_0;
    for (int64_t r = j->r0; r < j->r1; r++) {
        const uint8_t *row = j->base + r * j->row_stride;
        for (int t = 0; t < j->n_x; t++)
            j->y[(int64_t)t * j->n_rows + r] = row_dot(row, j->x + (int64_t)t * j->n_in, nb);
    }
    return NULL;
}

/* Below this many weight bytes a thread's start and join cost more than its share of the work. */
#define Q8_BYTES_PER_THREAD (1 << 20)

/* y [n_x, n_rows] = x [n_x, n_in] times the Q8_0 rows at base (row r at base + r * row_stride).
 * Returns 0, or <0 on bad arguments. Rows are split in contiguous ranges, one per thread. */
int ds4n_q8_0_rows(const uint8_t *base, int64_t row_stride, int64_t n_rows, int n_in, int n_x,
                   const float *x, float *y, int n_threads) {
    if (n_in < QK8_0 || n_in % QK8_0 || n_rows < 0 || n_x < 0) return -3;
    if (row_stride < (int64_t)(n_in / QK8_0) * Q8_0_BYTES) return -3;
    int64_t nt = n_threads < 1 ? 1 : n_threads;
    const int64_t bytes = n_rows * (int64_t)(n_in / QK8_0) * Q8_0_BYTES;
    if (bytes / Q8_BYTES_PER_THREAD < nt) nt = bytes / Q8_BYTES_PER_THREAD > 0 ? bytes / Q8_BYTES_PER_THREAD : 1;
    if (nt > 64) nt = 64;
    pthread_t th[64];
    q8_job jobs[64];
    int started[64] = {0};
    for (int64_t t = 0; t < nt; t++)
        jobs[t] = (q8_job){base, row_stride, n_rows, n_in, n_x, x, y, n_rows * t / nt, n_rows * (t + 1) / nt};
    for (int64_t t = 1; t < nt; t++) started[t] = pthread_create(&th[t], NULL, q8_worker, &jobs[t]) == 0;
    q8_worker(&jobs[0]);
    for (int64_t t = 1; t < nt; t++) {
        if (started[t])
            pthread_join(th[t], NULL);
        else
            q8_worker(&jobs[t]); /* a thread that could not start: its rows run here */
    }
    return 0;
}
