/* The hyper-connection mixer's combine matrix on the host: its Sinkhorn balancing.
 *
 * For each token t, from the mixer's logits mix[t] (2n + n*n floats) and its scale[3] / base[2n + n*n]:
 *   c[a][b] = exp(z[a][b] - max_b z[a][.])  with z = mix[2n + a*n + b] * scale[2] + base[2n + a*n + b]
 *   c = c * (1 / rowsum(c)) + eps;  c = c * (1 / (colsum(c) + eps))
 *   then iters - 1 times: c = c * (1 / (rowsum(c) + eps));  c = c * (1 / (colsum(c) + eps))
 * in float32, sums in index order: what ds4_mlx/model/hyper_connection.py computes with MLX ops in
 * DEFAULT numerics (up to expf's last bit and MLX's order of a 4-term sum); tests compare the two.
 *
 * Why: a decode step on MLX's CPU backend is bound by its graph's node count, and the Sinkhorn is a
 * chain of ~100 nodes per mixer (two mixers a layer) on the step's critical path, for a 4x4 matrix.
 * The decoder reads the mixer's logits to the host (24 floats) and computes this in a microsecond.
 * Build rules as experts.c (-ffp-contract=off, never -ffast-math).
 */

#include <math.h>
#include <stdint.h>

#define HC_MAX 16

int ds4n_hc_sinkhorn(const float *mix, int64_t n_tokens, int n, const float *scale, const float *base,
                     int iters, float eps, float *out) {
    if (n < 1 || n > HC_MAX || n_tokens < 0 || iters < 1) return -3;
    const int width = 2 * n + n * n;
    float c[HC_MAX * HC_MAX];
    for (int64_t t = 0; t < n_tokens; t++) {
        const float *m = mix + t * width + 2 * n;
        const float *bz = base + 2 * n;
        for (int a = 0; a < n; a++) {
            float mx = -INFINITY;
            for (int b = 0; b < n; b++) {
                const float z = m[a * n + b] * scale[2] + bz[a * n + b];
                c[a * n + b] = z;
                if (z > mx) mx = z;
            }
            float sum = 0.0f;
            for (int b = 0; b < n; b++) {
                c[a * n + b] = expf(c[a * n + b] - mx);
                sum += c[a * n + b];
            }
            const float inv = 1.0f / sum;
            for (int b = 0; b < n; b++) c[a * n + b] = c[a * n + b] * inv + eps;
        }
        for (int it = 0; it < iters; it++) {
            if (it > 0) {
                for (int a = 0; a < n; a++) {
                    float sum = 0.0f;
                    for (int b = 0; b < n; b++) sum += c[a * n + b];
                    const float inv = 1.0f / (sum + eps);
                    for (int b = 0; b < n; b++) c[a * n + b] = c[a * n + b] * inv;
                }
            }
            for (int b = 0; b < n; b++) {
                float sum = 0.0f;
                for (int a = 0; a < n; a++) sum += c[a * n + b];
                const float inv = 1.0f / (sum + eps);
                for (int a = 0; a < n; a++) c[a * n + b] = c[a * n + b] * inv;
            }
        }
        for (int k = 0; k < n * n; k++) out[t * n * n + k] = c[k];
    }
    return 0;
}
