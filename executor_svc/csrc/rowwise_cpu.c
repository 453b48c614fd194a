/* Row-wise float32 operations of a Llama layer: RMSNorm, the rotary embedding (its cos/sin
 * table and the rotation) and SiLU(gate) * up. The fused decode stack (decode_stack_cpu.c)
 * and the per-operator path of every other step (executor_svc/model/cpu_layers.py, through
 * the ps_*_rows entry points) call these same functions, compiled once here: a token's
 * activations are then bit-identical whichever path computed them, and whatever else is in
 * its step (a prefill, a chunk, a cache hit, decode neighbours). Each row is computed on its
 * own, in one fixed order; the _rows entry points only share rows out among threads.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "ps_cpu.h"

/* exp(x) for any float: clamped to [-87, 88] (the result then underflows to ~1e-38 or stays below
 * FLT_MAX); NaN stays NaN. */
static inline float exp_any(float x0) {
    float x = x0 < -87.0f ? -87.0f : x0;
    x = x > 88.0f ? 88.0f : x;
    return x0 != x0 ? x0 : ps_exp_clamped(x);
}

void ps_rms_norm(const float *x, const float *restrict w, int d, float eps, float *out) {
    float p[16] = {0};
    int i = 0;
    for (; i + 16 <= d; i += 16)
        for (int l = 0; l < 16; l++) p[l] += x[i + l] * x[i + l];
    float ss = 0.0f;
    for (int l = 0; l < 16; l++) ss += p[l];
    for (; i < d; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)d + eps);
    for (i = 0; i < d; i++) out[i] = w[i] * (x[i] * r);
}

void ps_rope_cos_sin(int64_t position, const float *inv_freq, int half, float *cs, float *sn) {
    for (int i = 0; i < half; i++) {
        const float f = (float)position * inv_freq[i];
        cs[i] = cosf(f);
        sn[i] = sinf(f);
    }
}

void ps_rope(float *x, int heads, int D, const float *cs, const float *sn) {
    const int half = D / 2;
    for (int h = 0; h < heads; h++) {
        float *v = x + (int64_t)h * D;
        for (int d = 0; d < half; d++) {
            const float a = v[d], b = v[d + half];
            v[d] = a * cs[d] - b * sn[d];
            v[d + half] = b * cs[d] + a * sn[d];
        }
    }
}

void ps_silu_mul(const float *restrict gate, const float *restrict up, int d, float *restrict out) {
    for (int i = 0; i < d; i++) out[i] = gate[i] / (1.0f + exp_any(-gate[i])) * up[i];
}

/* ------------------------------------------------------------------ row batches (ctypes) */

/* Rows are shared out only when there are enough of them to pay for waking the threads. */
#define ROWS_PER_THREAD 8
static inline int row_threads(int n, int threads) {
    const int most = n / ROWS_PER_THREAD;
    return threads < most ? (threads > 1 ? threads : 1) : (most > 1 ? most : 1);
}

void ps_rms_norm_rows(const float *x, int64_t ldx, int n, const float *w, int d, float eps, float *out,
                      int64_t ldo, int threads) {
#pragma omp parallel for schedule(static) num_threads(row_threads(n, threads))
    for (int t = 0; t < n; t++) ps_rms_norm(x + (int64_t)t * ldx, w, d, eps, out + (int64_t)t * ldo);
}

/* cs, sn: [n, half] tables of the positions. */
void ps_rope_cos_sin_rows(const int64_t *positions, int n, const float *inv_freq, int half, float *cs, float *sn) {
    for (int t = 0; t < n; t++)
        ps_rope_cos_sin(positions[t], inv_freq, half, cs + (int64_t)t * half, sn + (int64_t)t * half);
}

/* Rotates the first `heads` heads of each row (q then k heads, as a fused q/k/v row holds them). */
void ps_rope_rows(float *x, int64_t ldx, int n, int heads, int D, const float *cs, const float *sn, int threads) {
    const int half = D / 2;
#pragma omp parallel for schedule(static) num_threads(row_threads(n, threads))
    for (int t = 0; t < n; t++)
        ps_rope(x + (int64_t)t * ldx, heads, D, cs + (int64_t)t * half, sn + (int64_t)t * half);
}

/* gu: rows of [gate (d) | up (d)]. */
void ps_silu_mul_rows(const float *gu, int64_t ldg, int n, int d, float *out, int64_t ldo, int threads) {
#pragma omp parallel for schedule(static) num_threads(row_threads(n, threads))
    for (int t = 0; t < n; t++) ps_silu_mul(gu + (int64_t)t * ldg, gu + (int64_t)t * ldg + d, d, out + (int64_t)t * ldo);
}
