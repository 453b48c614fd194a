/* Linear layers on CPU: y = x W^T (* scale) (+ bias), weights in float32 (row-major), bfloat16
 * or int8 (packed panels, one scale per output row; layouts in ps_cpu.h), x float32 [n, k].
 *
 * Decoding one token per sequence makes these matrix-vector products over every weight of the
 * model: at small n the time is that of reading the weights from memory once, so each call
 * streams every weight exactly once, in chunks of consecutive rows (float32) or units of 64
 * outputs (packed formats) that the threads take in turn, with all n tokens (from L1/L2)
 * against each.
 *
 * The inner kernels by weight type and instruction set (chosen at run time, ps_isa_level; the
 * AVX2/AVX-512 ones are in linear_x86.c):
 *   float32   dot products, 4 rows x 4 tokens: AVX-512 FMA | AVX2 FMA | scalar
 *   bfloat16  x rounded to bf16; AVX-512 BF16 vdpbf16ps | AVX2: widened to f32, FMA | scalar
 *   int8      x quantised per row to int8 (symmetric, scale max|x|/127, round half to even);
 *             AVX-512 VNNI vpdpbusd (x biased to u8, the bias removed with the row's weight sum) |
 *             AVX2 vpmaddubsw | scalar: exact integer sums on every path.
 * Never -ffast-math (see paged_decode_cpu.c): the rounding tricks below rely on IEEE order.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "linear_blocks.h"
#include "linear_tiles.h"
#include "ps_cpu.h"

#ifdef PS_X86
#include <cpuid.h>
#endif

#define KPAD 64 /* converted activation rows are padded to this many elements */
/* Work is handed out in chunks (float32: this many rows; packed: one unit of 64 outputs) from a
 * shared counter rather than split up front: on a machine shared with the scheduler and other
 * processes a thread the OS preempts holds up one chunk, not a whole share of the matrix. */
#ifndef F32_CHUNK /* (overridable for a timed variant: executor_cpu roofline --variant NAME=-DF32_CHUNK=32) */
#define F32_CHUNK 16
#endif
/* Past this many tokens (prefills) a float32 chunk is F32_CHUNK_WIDE rows, its weights kept in L2,
 * and each 4-token tile of x is used by every row of the chunk before the next is loaded: x is
 * then read from memory once per chunk instead of once per 4 rows. Only the loop order changes,
 * not a single sum: each (token, row) is still one whole dot product of one tile call, so a row
 * gets the same bits as in a decode step. */
#define F32_WIDE_FROM 16
#define F32_CHUNK_WIDE 64

/* ------------------------------------------------------------------ CPU features */

static int g_limit = PS_ISA_AVX512;
static int g_feat = -1; /* bit 0 AVX2+FMA, 1 AVX-512 F/BW/VL/DQ, 2 AVX-512 BF16, 3 AVX-512 VNNI */

int ps_cpu_features(void) {
    if (g_feat >= 0) return g_feat;
    int f = 0;
#ifdef PS_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) f |= 1;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) f |= 2;
    if ((f & 2) && __builtin_cpu_supports("avx512bf16")) f |= 4;
    if ((f & 2) && __builtin_cpu_supports("avx512vnni")) f |= 8;
#endif
    g_feat = f;
    return f;
}

/* Cap the level every kernel may use (tests run each path on one machine). Returns the cap. */
int ps_set_isa_limit(int level) {
    g_limit = level < PS_ISA_SCALAR ? PS_ISA_SCALAR : level > PS_ISA_AVX512 ? PS_ISA_AVX512 : level;
    return g_limit;
}

int ps_isa_level(int wtype) {
    const int f = ps_cpu_features();
    int best = PS_ISA_SCALAR;
    if (f & 1) best = PS_ISA_AVX2;
    const int need = wtype == PS_W_BF16 ? 4 : wtype == PS_W_Q8 || PS_IS_BLOCKS(wtype) ? 8 : 0;
    if ((f & 2) && (f & need) == need) best = PS_ISA_AVX512;
    return best < g_limit ? best : g_limit;
}

/* ------------------------------------------------------------------ activations */

static inline int64_t padded(int k) { return ((int64_t)k + KPAD - 1) / KPAD * KPAD; }

int64_t ps_linear_work_bytes(int wtype, int n, int k) {
    if (wtype == PS_W_BF16) return (int64_t)n * padded(k) * 4; /* bf16 rows, or float32 rows (AVX2, scalar) */
    if (wtype == PS_W_Q8) return ((int64_t)n * 4 + KPAD - 1) / KPAD * KPAD + (int64_t)n * padded(k);
    if (PS_IS_BLOCKS(wtype)) return ps_blocks_work_bytes(n, k);
    return 0;
}

/* Round to nearest even, as torch's .to(torch.bfloat16); NaN stays NaN (quiet). */
static inline uint16_t bf16_of(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40u) : (uint16_t)r;
}

static inline float f32_of_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static void to_bf16_row(const float *restrict x, int k, uint16_t *restrict out) {
    int j = 0;
    for (; j < k; j++) out[j] = bf16_of(x[j]);
    for (; j < padded(k); j++) out[j] = 0;
}

static void to_bf16_f32_row(const float *restrict x, int k, float *restrict out) {
    int j = 0;
    for (; j < k; j++) out[j] = f32_of_bf16(bf16_of(x[j]));
    for (; j < padded(k); j++) out[j] = 0.0f;
}

/* Symmetric per-row int8: q = round_half_even(x * 127 / max|x|), in [-127, 127]. The rounding
 * is the float trick (x + 1.5 * 2^23) - 1.5 * 2^23, exact for |x| <= 2^22 and the same on
 * every instruction set; a row of zeros (or one with NaN/inf) quantises with scale 0 / NaN. */
static float to_q8_row(const float *restrict x, int k, int8_t *restrict out) {
    float amax = 0.0f;
    for (int j = 0; j < k; j++) {
        const float a = fabsf(x[j]);
        amax = a > amax ? a : amax;
    }
    if (!(amax <= 3.0e38f)) { /* NaN or inf: let it show in the output */
        memset(out, 0, (size_t)padded(k));
        return amax != amax ? amax : (float)NAN;
    }
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int j = 0;
    for (; j < k; j++) {
        const float r = (x[j] * inv + 12582912.0f) - 12582912.0f;
        out[j] = (int8_t)(int)r;
    }
    for (; j < padded(k); j++) out[j] = 0;
    return amax / 127.0f;
}

/* ------------------------------------------------------------------ scalar kernels */

static void f32_tile_scalar(int T, const float *x, int64_t ldx, const float *const *w, int64_t ahead, int k,
                            float *res) {
    (void)ahead;
    for (int t = 0; t < T; t++)
        for (int r = 0; r < 4; r++) {
            float p[8] = {0};
            int j = 0;
            for (; j + 8 <= k; j += 8)
                for (int l = 0; l < 8; l++) p[l] += x[t * ldx + j + l] * w[r][j + l];
            float s = ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]));
            for (; j < k; j++) s += x[t * ldx + j] * w[r][j];
            res[t * 4 + r] = s;
        }
}

static void store_scalar(float v, const ps_out_t *o, int t, int out) {
    if (o->bias) v += o->bias[out];
    float *dst = o->y + t * o->ldy + out;
    *dst = o->accumulate ? *dst + v : v;
}

/* x: float32 rows of bf16-rounded values. */
static void bf16_unit_scalar(int T, const void *xv, int64_t ldx, const void *wv, int64_t pstride, int kp,
                             const ps_out_t *out) {
    const float *x = xv;
    for (int p = 0; p < 4; p++) {
        const uint16_t *w = (const uint16_t *)wv + p * pstride;
        for (int t = 0; t < T; t++) {
            float acc[16] = {0};
            for (int j = 0; j < kp / 2; j++)
                for (int l = 0; l < 16; l++)
                    acc[l] += x[t * ldx + 2 * j] * f32_of_bf16(w[j * 32 + 2 * l]) +
                              x[t * ldx + 2 * j + 1] * f32_of_bf16(w[j * 32 + 2 * l + 1]);
            for (int l = 0; l < 16 && out->o0 + p * 16 + l < out->m; l++) store_scalar(acc[l], out, t, out->o0 + p * 16 + l);
        }
    }
}

/* x: s8 rows. */
static void q8_unit_scalar(int T, const void *xv, int64_t ldx, const void *wv, int64_t pstride, int kp,
                           const ps_out_t *out) {
    const int8_t *x = xv;
    for (int p = 0; p < 4; p++) {
        const int8_t *w = (const int8_t *)wv + p * pstride;
        for (int t = 0; t < T; t++) {
            int32_t acc[16] = {0};
            for (int j = 0; j < kp / 4; j++)
                for (int l = 0; l < 16; l++)
                    for (int g = 0; g < 4; g++) acc[l] += (int32_t)x[t * ldx + 4 * j + g] * (int32_t)w[j * 64 + 4 * l + g];
            for (int l = 0; l < 16 && out->o0 + p * 16 + l < out->m; l++) {
                const int o = out->o0 + p * 16 + l;
                store_scalar((float)acc[l] * out->scale[o] * out->sx[t], out, t, o);
            }
        }
    }
}

/* ------------------------------------------------------------------ one thread's share */

/* y rows t0 .. t0 + T - 1, outputs r .. r + 3 (those < m) (+)= res (+ bias). */
static inline void f32_store(const ps_linear_t *L, float *y, int64_t ldy, int accumulate, int t0, int T, int r,
                             const float *res) {
    const int R = L->m - r < 4 ? L->m - r : 4;
    for (int t = 0; t < T; t++) {
        float *yt = y + (int64_t)(t0 + t) * ldy + r;
        const float *rt = res + t * 4;
        if (R == 4) { /* branch-free, so it vectorises; the same two roundings per output */
            float v[4];
            for (int i = 0; i < 4; i++) v[i] = L->bias ? rt[i] + L->bias[r + i] : rt[i];
            if (accumulate)
                for (int i = 0; i < 4; i++) yt[i] += v[i];
            else
                for (int i = 0; i < 4; i++) yt[i] = v[i];
            continue;
        }
        for (int i = 0; i < R; i++) {
            float v = rt[i];
            if (L->bias) v += L->bias[r + i];
            yt[i] = accumulate ? yt[i] + v : v;
        }
    }
}

static inline void f32_row_ptrs(const ps_linear_t *L, int r, const float **w) {
    for (int i = 0; i < 4; i++) /* rows past m repeat the last one; their results are dropped */
        w[i] = (const float *)L->w + (int64_t)(r + i < L->m ? r + i : L->m - 1) * L->ldw;
}

/* Rows [r0, r1) against all n tokens. next_r: the first row of the chunk this thread computes
 * next (< 0: none), whose first tile the last tile here prefetches instead of the rows after r1,
 * which another thread may be reading already. */
static void f32_rows(const ps_linear_t *L, const float *x, int64_t ldx, int n, float *y, int64_t ldy, int accumulate,
                     int r0, int r1, int next_r, int isa) {
    const int k = L->k;
    ps_f32_tile_fn tile = f32_tile_scalar;
#ifdef PS_X86
    if (isa == PS_ISA_AVX512) tile = ps_f32_tile_512;
    else if (isa == PS_ISA_AVX2) tile = ps_f32_tile_avx2;
#endif
    float res[24];
    const float *w[4];
    if (n <= F32_WIDE_FROM) { /* decode: 4 weight rows against every token, the next rows prefetched */
        for (int r = r0; r < r1; r += 4) {
            f32_row_ptrs(L, r, w);
            const int64_t ahead = r + 4 < r1 ? 4 * L->ldw : next_r >= 0 ? (int64_t)(next_r - r) * L->ldw : 0;
            for (int t0 = 0; t0 < n; t0 += 4) {
                const int T = n - t0 < 4 ? n - t0 : 4;
                tile(T, x + (int64_t)t0 * ldx, ldx, w, ahead, k, res);
                f32_store(L, y, ldy, accumulate, t0, T, r, res);
            }
        }
        return;
    }
    for (int t0 = 0; t0 < n;) { /* prefill: a tile of tokens against every row of the chunk (in L2) */
#ifdef PS_X86
        const int six = isa == PS_ISA_AVX512 && n - t0 >= 6;
#else
        const int six = 0;
#endif
        const int T = six ? 6 : n - t0 < 4 ? n - t0 : 4;
        for (int r = r0; r < r1; r += 4) {
            f32_row_ptrs(L, r, w);
#ifdef PS_X86
            if (six) ps_f32_tile6_512(x + (int64_t)t0 * ldx, ldx, w, k, res);
            else
#endif
                tile(T, x + (int64_t)t0 * ldx, ldx, w, 0, k, res);
            f32_store(L, y, ldy, accumulate, t0, T, r, res);
        }
        t0 += T;
    }
}

/* Bytes of one panel (16 outputs) of a bfloat16 or int8 layer: its k inputs padded to whole groups. */
static int64_t padded_panel_bytes(const ps_linear_t *L) {
    const int q8 = L->wtype == PS_W_Q8, g = q8 ? 4 : 2;
    return (int64_t)(L->k + g - 1) / g * g * 16 * (q8 ? 1 : 2);
}

static void packed_units(const ps_linear_t *L, const void *xp, int64_t ldxp, const float *sx, int n, float *y,
                         int64_t ldy, int accumulate, int u0, int u1, int isa) {
    const int q8 = L->wtype == PS_W_Q8;
    const int64_t pbytes = padded_panel_bytes(L), pstride = pbytes / (q8 ? 1 : 2); /* elements per panel */
    const int kp = (int)(pstride / 16);
    const size_t xb = q8 ? 1 : (isa == PS_ISA_AVX512 ? 2 : 4); /* bytes per converted activation */
    ps_unit_fn unit = q8 ? q8_unit_scalar : bf16_unit_scalar;
    int tmax = PS_UNIT_T_SCALAR;
#ifdef PS_X86
    if (isa == PS_ISA_AVX512) {
        unit = q8 ? ps_q8_unit_512 : ps_bf16_unit_512;
        tmax = PS_UNIT_T_512;
    } else if (isa == PS_ISA_AVX2) {
        unit = q8 ? ps_q8_unit_avx2 : ps_bf16_unit_avx2;
        tmax = PS_UNIT_T_AVX2;
    }
#endif
    for (int u = u0; u < u1; u++) {
        const void *w = (const char *)L->w + (int64_t)u * 4 * pbytes;
        for (int t0 = 0; t0 < n; t0 += tmax) {
            const int T = n - t0 < tmax ? n - t0 : tmax;
            const ps_out_t out = {y + (int64_t)t0 * ldy, ldy, accumulate, L->m, u * 64, L->scale, L->wsum, L->bias,
                                  sx ? sx + t0 : NULL};
            unit(T, (const char *)xp + (size_t)t0 * (size_t)ldxp * xb, ldxp, w, pstride, kp, &out);
        }
    }
}

/* Where the converted activations of n tokens live in a work area (see ps_linear_work_bytes). */
static float *q8_scales(void *work) { return work; }
static void *prepped_rows(int wt, void *work, int n) {
    return wt == PS_W_Q8 ? (char *)work + ((int64_t)n * 4 + KPAD - 1) / KPAD * KPAD : work;
}

void ps_linear_prep(const ps_linear_t *L, const float *x, int64_t ldx, int t0, int t1, int n, void *work) {
    if (PS_IS_BLOCKS(L->wtype)) {
        ps_blocks_prep(L, x, ldx, t0, t1, n, work);
        return;
    }
    const int wt = L->wtype, k = L->k, isa = ps_isa_level(wt);
    const int64_t ldxp = padded(k);
    void *rows = prepped_rows(wt, work, n);
    for (int t = t0; t < t1; t++) {
        const float *xt = x + (int64_t)t * ldx;
        if (wt == PS_W_BF16) {
            if (isa == PS_ISA_AVX512) to_bf16_row(xt, k, (uint16_t *)rows + t * ldxp);
            else to_bf16_f32_row(xt, k, (float *)rows + t * ldxp);
        } else if (wt == PS_W_Q8) {
            int8_t *row = (int8_t *)rows + t * ldxp;
            q8_scales(work)[t] = to_q8_row(xt, k, row);
            if (isa == PS_ISA_AVX512) /* u8 = q + 128 for vpdpbusd (the padding too: w is 0 there) */
                for (int64_t j = 0; j < ldxp; j++) row[j] = (int8_t)((uint8_t)row[j] ^ 0x80u);
        }
    }
}

void ps_linear_compute(const ps_linear_t *L, const float *x, int64_t ldx, int n, const void *work, float *y,
                       int64_t ldy, int accumulate, int32_t *claim) {
    const int wt = L->wtype, isa = ps_isa_level(wt);
    if (PS_IS_BLOCKS(wt)) {
        ps_blocks_compute(L, n, work, y, ldy, accumulate, isa, claim);
        return;
    }
    if (wt == PS_W_F32) {
        const int rows = n > F32_WIDE_FROM ? F32_CHUNK_WIDE : F32_CHUNK;
        const int chunks = (L->m + rows - 1) / rows;
        for (int c = ps_claim(claim), next; c < chunks; c = next) { /* (the last tile prefetches `next`) */
            next = ps_claim(claim);
            const int r1 = (c + 1) * rows < L->m ? (c + 1) * rows : L->m;
            f32_rows(L, x, ldx, n, y, ldy, accumulate, c * rows, r1, next < chunks ? next * rows : -1, isa);
        }
        return;
    }
    const void *rows = prepped_rows(wt, (void *)work, n);
    const float *sx = wt == PS_W_Q8 ? q8_scales((void *)work) : NULL;
    const int units = (L->m + 63) / 64;
    const int64_t pbytes = padded_panel_bytes(L);
    for (int u = ps_claim(claim), next; u < units; u = next) {
        next = ps_claim(claim);
        if (next < units) /* the start of each of the next unit's 4 panels (the kernels prefetch the rest) */
            ps_prefetch_streams((const char *)L->w + (int64_t)next * 4 * pbytes, 4, pbytes, PS_PF_BYTES);
        packed_units(L, rows, padded(L->k), sx, n, y, ldy, accumulate, u, u + 1, isa);
    }
}

void ps_linear_region(const ps_linear_t *L, const float *x, int64_t ldx, int n, float *y, int64_t ldy,
                      int accumulate, void *work, int32_t *claim) {
    if (L->wtype != PS_W_F32) {
#pragma omp for schedule(static)
        for (int t = 0; t < n; t++) ps_linear_prep(L, x, ldx, t, t + 1, n, work);
        /* (the loop's barrier: every row is converted before any is read) */
    }
    ps_linear_compute(L, x, ldx, n, work, y, ldy, accumulate, claim);
}

static int check_linear(const ps_linear_t *L) {
    if (!L || !L->w || L->m < 1 || L->k < 1 || L->wtype < PS_W_F32 || L->wtype > PS_W_Q4_K ||
        (L->wtype == PS_W_F32 && L->ldw < L->k))
        return PS_BAD_ARG;
    if (L->wtype == PS_W_Q8 && (!L->scale || !L->wsum)) return PS_BAD_ARG;
    if (L->wtype == PS_W_Q4_K && L->k % 256) return PS_BAD_ARG; /* whole super-blocks */
    return PS_OK;
}

/* One linear layer as its own parallel region (the prefill path and the LM head). */
int ps_linear(const ps_linear_t *L, const float *x, int64_t ldx, int n, float *y, int64_t ldy, int accumulate,
              void *work, int64_t work_bytes, int num_threads) {
    if (check_linear(L) != PS_OK || n < 0 || ldx < L->k || ldy < L->m) return PS_BAD_ARG;
    if (work_bytes < ps_linear_work_bytes(L->wtype, n, L->k)) return PS_NO_MEMORY;
    if (n == 0) return PS_OK;
    int32_t claim = 0;
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
    ps_linear_region(L, x, ldx, n, y, ldy, accumulate, work, &claim);
    return PS_OK;
}
