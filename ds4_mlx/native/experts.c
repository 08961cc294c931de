/* Routed-expert matrix-vector products read in place from the quantized GGUF blocks.
 *
 * For a list of (expert, input row) pairs grouped by expert, y[p] = W_e . x_r computed directly
 * on the raw IQ2_XXS / Q2_K / Q4_K / MXFP4 blocks of the mmapped tensor: no copy of the slabs, no
 * float32 expert matrices. Two arithmetics, as in ds4_mlx/model/experts.py (its MLX-ops path is the
 * reference twin and its module docstring the specification):
 *
 *   ds4_pairs: ds4.c's CPU vec_dot of the block type x Q8_K (the activation is quantized by the
 *              caller): integer sums exact, float accumulation per super-block in ds4's order.
 *   ds4_f32_pairs (MXFP4 only): ds4_vec_dot_mxfp4_f32, float activations, one float32 sum per
 *              output element by element in ds4's order (ds4_mlx/model/mxfp4.py).
 *   f32_pairs: float32 dot products with the weights dequantized exactly as the MLX twins do
 *              (MXFP4: ds4's values); the summation order is our own (16 lanes, then a fixed tree),
 *              the same for every pair whatever the call holds, so results never depend on
 *              batching or threads.
 *
 * Build rules (ds4_mlx/native/__init__.py): -ffp-contract=off and never -ffast-math, because a
 * contracted a*b+c (FMA) or a reassociated sum changes bits. The loops are plain C written so
 * the compiler vectorizes them without reassociating anything.
 *
 * Work split: items are (expert group, tile of TILE output rows); thread t takes items t, t+n, ...
 * Each output element is computed entirely by one item, so the thread count cannot change bits.
 */

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"

#define DS4N_ABI 2
#define QK_K 256
#define TILE 8

enum { GGML_Q2_K = 10, GGML_Q4_K = 12, GGML_IQ2_XXS = 16, GGML_MXFP4 = 39 };

int ds4n_abi(void) { return DS4N_ABI; }

static uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* One row's integer weight codes and per-sub-block factors.
 * IQ2_XXS: q = signed grid value (+-8, 25, 43), sub-blocks of 32, ls = 2*(w>>28)+1.
 * Q2_K:    q = 2-bit code, sub-blocks of 16, sc = scales byte (low nibble scale, high nibble min).
 * Q4_K:    q = 4-bit code, sub-blocks of 32, sc = 6-bit scale, mn = 6-bit min.
 * d, dmin: per super-block halves as float. */
typedef struct {
    int8_t *q;
    int16_t *w;   /* ds4: q times its sub-block's integer scale (IQ2_XXS ls, Q2_K sc & 15, Q4_K sc) */
    int32_t *sc;  /* per sub-block */
    int32_t *mn;  /* per sub-block (Q2_K: sc >> 4, Q4_K: m) */
    float *d, *dmin; /* per super-block */
} row_codes;

static void decode_row(int qtype, const uint8_t *row, int nb, const uint64_t *signed_grid, row_codes *c) {
    for (int i = 0; i < nb; i++) {
        int8_t *q = c->q + (size_t)i * QK_K;
        if (qtype == GGML_IQ2_XXS) {
            const uint8_t *b = row + (size_t)i * 66;
            c->d[i] = ds4n_half_to_float(b);
            for (int g = 0; g < 8; g++) {
                const uint8_t *gp = b + 2 + 8 * g;
                uint32_t w = le32(gp + 4);
                c->sc[i * 8 + g] = (int32_t)(2 * (w >> 28) + 1);
                for (int t = 0; t < 4; t++) {
                    uint32_t idx = ((uint32_t)gp[t] << 7) | ((w >> (7 * t)) & 127);
                    memcpy(q + 32 * g + 8 * t, &signed_grid[idx], 8);
                }
            }
        } else if (qtype == GGML_Q2_K) {
            const uint8_t *b = row + (size_t)i * 84;
            const uint8_t *qs = b + 16;
            for (int j = 0; j < 16; j++) {
                c->sc[i * 16 + j] = b[j] & 15;
                c->mn[i * 16 + j] = b[j] >> 4;
            }
            /* element 128h + 32j + l: bits 2j of qs[32h + l] */
            for (int h = 0; h < 2; h++)
                for (int j = 0; j < 4; j++)
                    for (int l = 0; l < 32; l++)
                        q[128 * h + 32 * j + l] = (int8_t)((qs[32 * h + l] >> (2 * j)) & 3);
            c->d[i] = ds4n_half_to_float(b + 80);
            c->dmin[i] = ds4n_half_to_float(b + 82);
        } else { /* Q4_K */
            const uint8_t *b = row + (size_t)i * 144;
            const uint8_t *s = b + 4, *qs = b + 16;
            for (int j = 0; j < 4; j++) {
                c->sc[i * 8 + j] = s[j] & 63;
                c->sc[i * 8 + 4 + j] = (s[8 + j] & 15) | ((s[j] >> 6) << 4);
                c->mn[i * 8 + j] = s[4 + j] & 63;
                c->mn[i * 8 + 4 + j] = (s[8 + j] >> 4) | ((s[4 + j] >> 6) << 4);
            }
            /* sub-block 2p + n: nibble n of qs[32p : 32p + 32] */
            for (int p = 0; p < 4; p++)
                for (int n = 0; n < 2; n++)
                    for (int l = 0; l < 32; l++)
                        q[64 * p + 32 * n + l] = (int8_t)((qs[32 * p + l] >> (4 * n)) & 15);
            c->d[i] = ds4n_half_to_float(b);
            c->dmin[i] = ds4n_half_to_float(b + 2);
        }
    }
}

/* Dequantized float row, value for value what dequantize_rows_mlx gives (two roundings where it
 * has two: the scale product, then the product with the code, then the offset subtraction). */
static void dequant_row(int qtype, int nb, const row_codes *c, const uint8_t *row, float *out) {
    for (int i = 0; i < nb; i++) {
        const int8_t *q = c->q + (size_t)i * QK_K;
        float *o = out + (size_t)i * QK_K;
        if (qtype == GGML_IQ2_XXS) {
            for (int g = 0; g < 8; g++) {
                uint32_t w = le32(row + (size_t)i * 66 + 2 + 8 * g + 4);
                float db = (c->d[i] * (0.5f + (float)(w >> 28))) * 0.25f;
                for (int l = 0; l < 32; l++) o[32 * g + l] = (float)q[32 * g + l] * db;
            }
        } else { /* K-quants: Q2_K has 16 sub-blocks of 16 (sub-block 8h + 2j' + s covers elements
                  * 128h + 32j' + 16s + [0, 16), i.e. 16 * index), Q4_K 8 of 32 */
            const int sub = qtype == GGML_Q2_K ? 16 : 32, ns = QK_K / sub;
            for (int j = 0; j < ns; j++) {
                float dl = c->d[i] * (float)c->sc[i * ns + j];
                float ml = c->dmin[i] * (float)c->mn[i * ns + j];
                for (int l = 0; l < sub; l++) {
                    float prod = (float)q[sub * j + l] * dl;
                    o[sub * j + l] = prod - ml;
                }
            }
        }
    }
}

/* MXFP4 (17-byte blocks of 32): w = e8m0(e) * value(code), ds4's tables (ds4_e8m0_to_f32,
 * ds4_mxfp4_values). The product is exact (or overflows to inf), so it is every path's value. Weight
 * k of the row goes to out[k * stride] in element order (low nibbles are elements 0..15, high ones
 * 16..31), or with ds4_order in ds4's summation order (each byte's low nibble, then its high one). */
static const float mxfp4_values[16] = {
    0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f,
};

static float e8m0_to_f32(uint8_t e) {
    const uint32_t bits = e == 0 ? 0x00400000u : (uint32_t)e << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static void mxfp4_row(const uint8_t *row, int n_in, float *out, size_t stride, int ds4_order) {
    for (int b = 0; b < n_in / 32; b++) {
        const uint8_t *blk = row + (size_t)b * 17;
        const float d = e8m0_to_f32(blk[0]);
        for (int j = 0; j < 16; j++) {
            const size_t lo = ds4_order ? (size_t)(32 * b + 2 * j) : (size_t)(32 * b + j);
            const size_t hi = ds4_order ? lo + 1 : lo + 16;
            out[lo * stride] = d * mxfp4_values[blk[1 + j] & 15];
            out[hi * stride] = d * mxfp4_values[blk[1 + j] >> 4];
        }
    }
}

/* q times its integer sub-block scale: one 256-long integer dot per super-block then gives
 * sum_j scale_j * sum(q * y) over the sub-blocks j exactly (the same integer, fewer reductions). */
static void scale_codes(int qtype, int nb, row_codes *c) {
    const int sub = qtype == GGML_Q2_K ? 16 : 32;
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < QK_K / sub; j++) {
            const int16_t f = (int16_t)c->sc[i * (QK_K / sub) + j];
            const int8_t *q = c->q + (size_t)i * QK_K + j * sub;
            int16_t *w = c->w + (size_t)i * QK_K + j * sub;
            for (int l = 0; l < sub; l++) w[l] = (int16_t)(q[l] * f);
        }
}

static int32_t dot_i16_256(const int16_t *a, const int16_t *b) {
    int32_t s = 0;
    for (int l = 0; l < QK_K; l++) s += (int32_t)a[l] * (int32_t)b[l];
    return s;
}

/* Float dot product in a fixed order: 16 lanes over the row, then a fixed tree. */
static float dot_f32(const float *a, const float *b, int n) {
    float acc[16];
    for (int l = 0; l < 16; l++) acc[l] = 0.0f;
    for (int i = 0; i < n; i += 16)
        for (int l = 0; l < 16; l++) acc[l] += a[i + l] * b[i + l];
    for (int w = 8; w >= 1; w >>= 1)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
}

/* ds4.c's vec_dot of one decoded row with one Q8_K row (module docstring of experts.py). */
static float ds4_dot(int qtype, int nb, const row_codes *c, const int16_t *xq, const float *xd,
                     const int32_t *bsums) {
    float sumf = 0.0f;
    for (int i = 0; i < nb; i++) {
        const int32_t dot = dot_i16_256(c->w + (size_t)i * QK_K, xq + (size_t)i * QK_K);
        if (qtype == GGML_IQ2_XXS) {
            const int32_t bsum = dot; /* sum_g ls_g * sum_32(grid * q8) */
            float d = c->d[i] * xd[i];
            sumf = sumf + d * (float)bsum;
        } else {
            const int32_t isum = dot; /* sum_j sc_j * sum(q * q8) */
            int32_t summs = 0;
            if (qtype == GGML_Q2_K) {
                for (int j = 0; j < 16; j++) summs += c->mn[i * 16 + j] * bsums[i * 16 + j];
            } else {
                for (int j = 0; j < 8; j++)
                    summs += c->mn[i * 8 + j] * (bsums[i * 16 + 2 * j] + bsums[i * 16 + 2 * j + 1]);
            }
            float dall = xd[i] * c->d[i];
            float dm = xd[i] * c->dmin[i];
            float a = dall * (float)isum;
            float b = dm * (float)summs;
            sumf = sumf + (a - b);
        }
    }
    return qtype == GGML_IQ2_XXS ? 0.125f * sumf : sumf;
}

typedef struct {
    int qtype, out_dim, n_in, nb, ds4; /* ds4 with MXFP4: ds4_vec_dot_mxfp4_f32 on xp */
    const uint8_t *base;
    int64_t expert_stride, row_stride;
    const int64_t *uniq, *bounds, *order, *rows;
    int64_t n_groups, tiles_per_group;
    const float *x;      /* f32: [R, n_in]; ds4 MXFP4: the same rows in ds4's summation order */
    const int16_t *xq;   /* ds4: [R, n_in], the Q8_K codes widened */
    const float *xd;     /* ds4: [R, nb] */
    const int32_t *bsums;/* ds4: [R, n_in / 16] */
    const uint64_t *signed_grid;
    float *y;            /* [P, out_dim] */
    int n_threads;
} job;

typedef struct {
    const job *j;
    int t;
    int failed;
} worker_arg;

static void *worker(void *argp) {
    worker_arg *a = (worker_arg *)argp;
    const job *j = a->j;
    const int nb = j->nb, n_in = j->n_in;
    const int mxfp4 = j->qtype == GGML_MXFP4; /* float weights only: no codes, no scales */
    const int codes = !mxfp4, wide = j->ds4 && !mxfp4, floats = !j->ds4 || mxfp4;
    size_t nsub = (size_t)nb * 16;
    row_codes c[TILE];
    int8_t *qbuf = codes ? malloc((size_t)TILE * n_in) : NULL;
    int16_t *wbuf16 = wide ? malloc(sizeof(int16_t) * TILE * (size_t)n_in) : NULL;
    int32_t *ibuf = codes ? malloc(sizeof(int32_t) * TILE * nsub * 2) : NULL;
    float *fbuf = codes ? malloc(sizeof(float) * TILE * (size_t)nb * 2) : NULL;
    float *wbuf = floats ? malloc(sizeof(float) * TILE * (size_t)n_in) : NULL;
    if ((codes && (!qbuf || !ibuf || !fbuf)) || (floats && !wbuf) || (wide && !wbuf16)) {
        free(qbuf); free(wbuf16); free(ibuf); free(fbuf); free(wbuf);
        a->failed = 1;
        return NULL;
    }
    for (int r = 0; r < TILE && codes; r++) {
        c[r].q = qbuf + (size_t)r * n_in;
        c[r].w = wbuf16 ? wbuf16 + (size_t)r * n_in : NULL;
        c[r].sc = ibuf + (size_t)r * nsub * 2;
        c[r].mn = c[r].sc + nsub;
        c[r].d = fbuf + (size_t)r * nb * 2;
        c[r].dmin = c[r].d + nb;
    }
    const int64_t n_items = j->n_groups * j->tiles_per_group;
    for (int64_t item = a->t; item < n_items; item += j->n_threads) {
        const int64_t g = item / j->tiles_per_group;
        const int r0 = (int)(item % j->tiles_per_group) * TILE;
        const int nr = j->out_dim - r0 < TILE ? j->out_dim - r0 : TILE;
        const uint8_t *slab = j->base + j->uniq[g] * j->expert_stride;
        if (mxfp4 && j->ds4) {
            /* the tile transposed, [n_in][TILE] in ds4's order: the sums of the TILE rows advance
             * together, each one still strictly in its own order (rows past nr are zeros) */
            for (int r = 0; r < TILE; r++) {
                if (r < nr)
                    mxfp4_row(slab + (int64_t)(r0 + r) * j->row_stride, n_in, wbuf + r, TILE, 1);
                else
                    for (int k = 0; k < n_in; k++) wbuf[(size_t)k * TILE + r] = 0.0f;
            }
            for (int64_t k = j->bounds[g]; k < j->bounds[g + 1]; k++) {
                const int64_t p = j->order[k];
                const float *xp = j->x + j->rows[p] * n_in;
                float acc[TILE];
                for (int r = 0; r < TILE; r++) acc[r] = 0.0f;
                for (int e = 0; e < n_in; e++) {
                    const float *w = wbuf + (size_t)e * TILE;
                    const float xv = xp[e];
                    for (int r = 0; r < TILE; r++) acc[r] = acc[r] + w[r] * xv;
                }
                float *yp = j->y + p * j->out_dim + r0;
                for (int r = 0; r < nr; r++) yp[r] = acc[r];
            }
            continue;
        }
        for (int r = 0; r < nr; r++) {
            const uint8_t *row = slab + (int64_t)(r0 + r) * j->row_stride;
            if (mxfp4) {
                mxfp4_row(row, n_in, wbuf + (size_t)r * n_in, 1, 0);
                continue;
            }
            decode_row(j->qtype, row, nb, j->signed_grid, &c[r]);
            if (j->ds4)
                scale_codes(j->qtype, nb, &c[r]);
            else
                dequant_row(j->qtype, nb, &c[r], row, wbuf + (size_t)r * n_in);
        }
        for (int64_t k = j->bounds[g]; k < j->bounds[g + 1]; k++) {
            const int64_t p = j->order[k], xr = j->rows[p];
            float *yp = j->y + p * j->out_dim + r0;
            if (j->ds4) {
                const int16_t *xq = j->xq + xr * n_in;
                const float *xd = j->xd + xr * nb;
                const int32_t *bs = j->bsums + xr * (n_in / 16);
                for (int r = 0; r < nr; r++) yp[r] = ds4_dot(j->qtype, nb, &c[r], xq, xd, bs);
            } else {
                const float *x = j->x + xr * n_in;
                for (int r = 0; r < nr; r++) yp[r] = dot_f32(wbuf + (size_t)r * n_in, x, n_in);
            }
        }
    }
    free(qbuf); free(wbuf16); free(ibuf); free(fbuf); free(wbuf);
    return NULL;
}

/* Below this many weight elements touched per thread (decoded rows plus dot products) a thread's
 * start and join cost more than its share of the work, and on a busy machine far more (measured
 * at the tiny model's dims: 0.6 ms a call on one thread, 1.2 ms median / 3 ms p90 on two). */
#define WORK_PER_THREAD (1 << 21)

static int run(job *j) {
    const int64_t n_items = j->n_groups * j->tiles_per_group;
    int nt = j->n_threads < 1 ? 1 : j->n_threads;
    const int64_t work = (j->n_groups + j->bounds[j->n_groups]) * (int64_t)j->out_dim * j->n_in;
    if (work / WORK_PER_THREAD < nt) nt = (int)(work / WORK_PER_THREAD > 0 ? work / WORK_PER_THREAD : 1);
    if (nt > 64) nt = 64;
    if (nt > n_items) nt = (int)(n_items > 0 ? n_items : 1);
    j->n_threads = nt;
    pthread_t th[64];
    worker_arg args[64];
    int started[64] = {0};
    for (int t = 0; t < nt; t++) {
        args[t].j = j;
        args[t].t = t;
        args[t].failed = 0;
    }
    for (int t = 1; t < nt; t++) started[t] = pthread_create(&th[t], NULL, worker, &args[t]) == 0;
    worker(&args[0]);
    /* a thread that could not start: its items run here, in the calling thread */
    for (int t = 1; t < nt; t++)
        if (!started[t]) worker(&args[t]);
    int failed = args[0].failed;
    for (int t = 1; t < nt; t++) {
        if (started[t]) pthread_join(th[t], NULL);
        failed |= args[t].failed;
    }
    return failed ? -1 : 0;
}

static int check(int qtype, int out_dim, int n_in) {
    if (qtype == GGML_MXFP4) return out_dim < 1 || n_in < 32 || n_in % 32 ? -3 : 0;
    if (qtype != GGML_IQ2_XXS && qtype != GGML_Q2_K && qtype != GGML_Q4_K) return -2;
    if (out_dim < 1 || n_in < QK_K || n_in % QK_K) return -3;
    return 0;
}

/* Pairs grouped by expert: group g (expert uniq[g]) holds pairs order[bounds[g] .. bounds[g+1]);
 * pair p reads input row rows[p] and writes y[p]. Returns 0, or <0 on bad arguments / no memory. */
int ds4n_f32_pairs(int qtype, const uint8_t *base, int64_t expert_stride, int64_t row_stride,
                   int out_dim, int n_in, int64_t n_groups, const int64_t *uniq, const int64_t *bounds,
                   const int64_t *order, const int64_t *rows, const float *x, const uint64_t *signed_grid,
                   float *y, int n_threads) {
    int rc = check(qtype, out_dim, n_in);
    if (rc) return rc;
    job j = {qtype, out_dim, n_in, n_in / QK_K, 0, base, expert_stride, row_stride, uniq, bounds, order, rows,
             n_groups, (out_dim + TILE - 1) / TILE, x, NULL, NULL, NULL, signed_grid, y, n_threads};
    return run(&j);
}

/* ds4-cpu numerics of MXFP4 (ds4_vec_dot_mxfp4_f32): x float32 [n_rows, n_in]; any other type -2. */
int ds4n_ds4_f32_pairs(int qtype, const uint8_t *base, int64_t expert_stride, int64_t row_stride,
                       int out_dim, int n_in, int64_t n_groups, const int64_t *uniq, const int64_t *bounds,
                       const int64_t *order, const int64_t *rows, int64_t n_rows, const float *x, float *y,
                       int n_threads) {
    if (qtype != GGML_MXFP4) return -2;
    int rc = check(qtype, out_dim, n_in);
    if (rc) return rc;
    /* the rows in ds4's order once, shared by every pair: 32b + j, then 32b + j + 16 */
    float *xp = malloc(sizeof(float) * (size_t)(n_rows > 0 ? n_rows : 1) * n_in);
    if (!xp) return -1;
    for (int64_t r = 0; r < n_rows; r++)
        for (int b = 0; b < n_in / 32; b++)
            for (int i = 0; i < 16; i++) {
                xp[r * n_in + 32 * b + 2 * i] = x[r * n_in + 32 * b + i];
                xp[r * n_in + 32 * b + 2 * i + 1] = x[r * n_in + 32 * b + 16 + i];
            }
    job j = {qtype, out_dim, n_in, 0, 1, base, expert_stride, row_stride, uniq, bounds, order, rows,
             n_groups, (out_dim + TILE - 1) / TILE, xp, NULL, NULL, NULL, NULL, y, n_threads};
    rc = run(&j);
    free(xp);
    return rc;
}

/* The same in ds4-cpu numerics; xq/xd: the Q8_K activation rows [R, n_in] / [R, n_in/256]. */
int ds4n_ds4_pairs(int qtype, const uint8_t *base, int64_t expert_stride, int64_t row_stride,
                   int out_dim, int n_in, int64_t n_groups, const int64_t *uniq, const int64_t *bounds,
                   const int64_t *order, const int64_t *rows, int64_t n_rows, const int8_t *xq, const float *xd,
                   const uint64_t *signed_grid, float *y, int n_threads) {
    if (qtype == GGML_MXFP4) return -2; /* its ds4 dot takes float activations: ds4n_ds4_f32_pairs */
    int rc = check(qtype, out_dim, n_in);
    if (rc) return rc;
    /* sums of 16 activation codes (Q8_K's bsums), shared by every pair of a row */
    int32_t *bsums = malloc(sizeof(int32_t) * (size_t)(n_rows > 0 ? n_rows : 1) * (n_in / 16));
    int16_t *x16 = malloc(sizeof(int16_t) * (size_t)(n_rows > 0 ? n_rows : 1) * n_in);
    if (!bsums || !x16) {
        free(bsums); free(x16);
        return -1;
    }
    for (int64_t l = 0; l < n_rows * n_in; l++) x16[l] = xq[l];
    for (int64_t r = 0; r < n_rows; r++)
        for (int s = 0; s < n_in / 16; s++) {
            int32_t acc = 0;
            for (int l = 0; l < 16; l++) acc += xq[r * n_in + 16 * s + l];
            bsums[r * (n_in / 16) + s] = acc;
        }
    job j = {qtype, out_dim, n_in, n_in / QK_K, 1, base, expert_stride, row_stride, uniq, bounds, order, rows,
             n_groups, (out_dim + TILE - 1) / TILE, NULL, x16, xd, bsums, signed_grid, y, n_threads};
    rc = run(&j);
    free(bsums);
    free(x16);
    return rc;
}
