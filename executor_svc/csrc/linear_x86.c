/* AVX2 and AVX-512 inner kernels of the linear layers (linear_cpu.c picks one at run time).
 *
 * float32 (row-major): 4 weight rows x T <= 4 tokens of dot products, the partial sums in
 *   registers for the whole row, the 4 rows of a token reduced together at the end, the next
 *   tile's rows prefetched (rows are short: the hardware prefetcher alone restarts on each).
 * bfloat16 / int8 (packed panels, ps_cpu.h): 64 outputs x T tokens of outer products: a
 *   64-byte load holds 16 outputs x 2 (bf16) or 4 (int8) inputs, multiplied with the token's
 *   matching inputs broadcast to every lane (vdpbf16ps / vpdpbusd on AVX-512), so there is no
 *   horizontal sum at all and each weight vector loaded serves every token of the tile.
 *   AVX2 widens bf16 to float32 for FMAs, and does int8 with vpmaddubsw on |x| and the weight
 *   with x's sign (pairs stay below 2 * 127 * 127: no saturation), then vpmaddwd.
 * The int8 sums are exact integers on every path; the float epilogue is (float)sum * scale *
 * sx (+ bias).
 */
#include "linear_tiles.h"

#ifdef PS_X86
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))
#define TGT_AVX2 __attribute__((target("avx2,fma")))
#define TGT_512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
#define TGT_512BF __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,avx512bf16")))
#define TGT_512VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,avx512vnni")))
/* Weight streams are prefetched into L2 (T1), not L1 (T0): each weight line is used once, and
 * T0 prefetches far enough ahead to cover DRAM latency fill the small L1 and evict the lines
 * that are reused (activations, outputs). Whole decode steps of the default model were 11-16%
 * faster at batch 1 with T1 in every format, and 0-11% at 16 and 48 rows (`python -m
 * benchmarks.executor_cpu roofline --variant t0=-DPS_PF_HINT=_MM_HINT_T0`, docs/PERF.md). The AVX2
 * bfloat16 and int8 kernels, which spend more instructions per weight byte (widening, sign
 * tricks), keep T0: the same at 1 row, 6-15% faster at 16 (a one-off kernel benchmark with `--isa
 * avx2`, since removed, with a second T1 build as the gauge of the harness's own spread). */
#ifndef PS_PF_HINT
#define PS_PF_HINT _MM_HINT_T1
#endif
#define PREFETCH(p) _mm_prefetch((const char *)(p), PS_PF_HINT)
#define PREFETCH_L1(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)

/* ------------------------------------------------------------------ float32, dot form */

/* [sum a, sum b, sum c, sum d] */
TGT_AVX2 INLINE __m128 reduce4_256(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

TGT_512 INLINE __m256 half512(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
}

/* Accumulators are named variables, one per (token, row or panel), never arrays: GCC keeps an
 * array of vectors in memory and stores every element back each iteration (measured: 16 stores
 * per 16 FMAs, half the float32 rate). T is a compile-time constant in every expansion, so the
 * `if (T > t)` blocks of absent tokens vanish. */
#define F32_ROWS(P, t, xv) \
    do { a##t##0 = P##fmadd_ps(xv, w0, a##t##0); a##t##1 = P##fmadd_ps(xv, w1, a##t##1); \
         a##t##2 = P##fmadd_ps(xv, w2, a##t##2); a##t##3 = P##fmadd_ps(xv, w3, a##t##3); } while (0)

TGT_AVX2 INLINE void f32_tile_avx2_t(const int T, const float *x, int64_t ldx, const float *const *w, int64_t ahead,
                                     int k, float *res) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00,
           a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
    int j = 0;
    for (; j + 8 <= k; j += 8) {
        if (ahead && !(j & 15)) /* (0: the rows are in cache already, a prefill's chunk) */
            for (int r = 0; r < 4; r++) PREFETCH(w[r] + j + ahead);
        const __m256 w0 = _mm256_loadu_ps(w[0] + j), w1 = _mm256_loadu_ps(w[1] + j),
                     w2 = _mm256_loadu_ps(w[2] + j), w3 = _mm256_loadu_ps(w[3] + j);
        F32_ROWS(_mm256_, 0, _mm256_loadu_ps(x + j));
        if (T > 1) F32_ROWS(_mm256_, 1, _mm256_loadu_ps(x + ldx + j));
        if (T > 2) F32_ROWS(_mm256_, 2, _mm256_loadu_ps(x + 2 * ldx + j));
        if (T > 3) F32_ROWS(_mm256_, 3, _mm256_loadu_ps(x + 3 * ldx + j));
    }
    _mm_storeu_ps(res, reduce4_256(a00, a01, a02, a03));
    if (T > 1) _mm_storeu_ps(res + 4, reduce4_256(a10, a11, a12, a13));
    if (T > 2) _mm_storeu_ps(res + 8, reduce4_256(a20, a21, a22, a23));
    if (T > 3) _mm_storeu_ps(res + 12, reduce4_256(a30, a31, a32, a33));
    for (int t = 0; t < T; t++)
        for (int jj = j; jj < k; jj++)
            for (int r = 0; r < 4; r++) res[t * 4 + r] += x[t * ldx + jj] * w[r][jj];
}

TGT_AVX2 void ps_f32_tile_avx2(int T, const float *x, int64_t ldx, const float *const *w, int64_t ahead, int k,
                               float *res) {
    switch (T) {
    case 1: f32_tile_avx2_t(1, x, ldx, w, ahead, k, res); break;
    case 2: f32_tile_avx2_t(2, x, ldx, w, ahead, k, res); break;
    case 3: f32_tile_avx2_t(3, x, ldx, w, ahead, k, res); break;
    default: f32_tile_avx2_t(4, x, ldx, w, ahead, k, res); break;
    }
}

TGT_512 INLINE void f32_tile_512_t(const int T, const float *x, int64_t ldx, const float *const *w, int64_t ahead,
                                   int k, float *res) {
    __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00,
           a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
    int j = 0;
    for (; j + 16 <= k; j += 16) {
        if (ahead) /* (0: the rows are in cache already, a prefill's chunk) */
            for (int r = 0; r < 4; r++) PREFETCH(w[r] + j + ahead);
        const __m512 w0 = _mm512_loadu_ps(w[0] + j), w1 = _mm512_loadu_ps(w[1] + j),
                     w2 = _mm512_loadu_ps(w[2] + j), w3 = _mm512_loadu_ps(w[3] + j);
        F32_ROWS(_mm512_, 0, _mm512_loadu_ps(x + j));
        if (T > 1) F32_ROWS(_mm512_, 1, _mm512_loadu_ps(x + ldx + j));
        if (T > 2) F32_ROWS(_mm512_, 2, _mm512_loadu_ps(x + 2 * ldx + j));
        if (T > 3) F32_ROWS(_mm512_, 3, _mm512_loadu_ps(x + 3 * ldx + j));
    }
    if (j < k) { /* the tail, masked: lanes past k load zeros */
        const __mmask16 m = (__mmask16)((1u << (k - j)) - 1);
        const __m512 w0 = _mm512_maskz_loadu_ps(m, w[0] + j), w1 = _mm512_maskz_loadu_ps(m, w[1] + j),
                     w2 = _mm512_maskz_loadu_ps(m, w[2] + j), w3 = _mm512_maskz_loadu_ps(m, w[3] + j);
        F32_ROWS(_mm512_, 0, _mm512_maskz_loadu_ps(m, x + j));
        if (T > 1) F32_ROWS(_mm512_, 1, _mm512_maskz_loadu_ps(m, x + ldx + j));
        if (T > 2) F32_ROWS(_mm512_, 2, _mm512_maskz_loadu_ps(m, x + 2 * ldx + j));
        if (T > 3) F32_ROWS(_mm512_, 3, _mm512_maskz_loadu_ps(m, x + 3 * ldx + j));
    }
#define F32_OUT(t) _mm_storeu_ps(res + 4 * t, reduce4_256(half512(a##t##0), half512(a##t##1), half512(a##t##2), \
                                                          half512(a##t##3)))
    F32_OUT(0);
    if (T > 1) F32_OUT(1);
    if (T > 2) F32_OUT(2);
    if (T > 3) F32_OUT(3);
#undef F32_OUT
}

TGT_512 void ps_f32_tile_512(int T, const float *x, int64_t ldx, const float *const *w, int64_t ahead, int k,
                             float *res) {
    switch (T) {
    case 1: f32_tile_512_t(1, x, ldx, w, ahead, k, res); break;
    case 2: f32_tile_512_t(2, x, ldx, w, ahead, k, res); break;
    case 3: f32_tile_512_t(3, x, ldx, w, ahead, k, res); break;
    default: f32_tile_512_t(4, x, ldx, w, ahead, k, res); break;
    }
}

/* 6 tokens x 4 rows, for prefills (24 accumulators, 4 weight vectors and one x in 29 of the 32
 * registers): fewer loads per FMA than 4 x 4. Each (token, row) sum is formed exactly as in
 * f32_tile_512_t (16 lanes over j in order, the masked tail, the same reduction tree), so a
 * row gets the same bits from either tile. res[t * 4 + r], t < 6. */
TGT_512 void ps_f32_tile6_512(const float *x, int64_t ldx, const float *const *w, int k, float *res) {
    __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00,
           a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00,
           a40 = a00, a41 = a00, a42 = a00, a43 = a00, a50 = a00, a51 = a00, a52 = a00, a53 = a00;
    int j = 0;
    for (; j + 16 <= k; j += 16) {
        const __m512 w0 = _mm512_loadu_ps(w[0] + j), w1 = _mm512_loadu_ps(w[1] + j),
                     w2 = _mm512_loadu_ps(w[2] + j), w3 = _mm512_loadu_ps(w[3] + j);
        F32_ROWS(_mm512_, 0, _mm512_loadu_ps(x + j));
        F32_ROWS(_mm512_, 1, _mm512_loadu_ps(x + ldx + j));
        F32_ROWS(_mm512_, 2, _mm512_loadu_ps(x + 2 * ldx + j));
        F32_ROWS(_mm512_, 3, _mm512_loadu_ps(x + 3 * ldx + j));
        F32_ROWS(_mm512_, 4, _mm512_loadu_ps(x + 4 * ldx + j));
        F32_ROWS(_mm512_, 5, _mm512_loadu_ps(x + 5 * ldx + j));
    }
    if (j < k) {
        const __mmask16 m = (__mmask16)((1u << (k - j)) - 1);
        const __m512 w0 = _mm512_maskz_loadu_ps(m, w[0] + j), w1 = _mm512_maskz_loadu_ps(m, w[1] + j),
                     w2 = _mm512_maskz_loadu_ps(m, w[2] + j), w3 = _mm512_maskz_loadu_ps(m, w[3] + j);
        F32_ROWS(_mm512_, 0, _mm512_maskz_loadu_ps(m, x + j));
        F32_ROWS(_mm512_, 1, _mm512_maskz_loadu_ps(m, x + ldx + j));
        F32_ROWS(_mm512_, 2, _mm512_maskz_loadu_ps(m, x + 2 * ldx + j));
        F32_ROWS(_mm512_, 3, _mm512_maskz_loadu_ps(m, x + 3 * ldx + j));
        F32_ROWS(_mm512_, 4, _mm512_maskz_loadu_ps(m, x + 4 * ldx + j));
        F32_ROWS(_mm512_, 5, _mm512_maskz_loadu_ps(m, x + 5 * ldx + j));
    }
#define F32_OUT(t) _mm_storeu_ps(res + 4 * t, reduce4_256(half512(a##t##0), half512(a##t##1), half512(a##t##2), \
                                                          half512(a##t##3)))
    F32_OUT(0);
    F32_OUT(1);
    F32_OUT(2);
    F32_OUT(3);
    F32_OUT(4);
    F32_OUT(5);
#undef F32_OUT
}

/* ------------------------------------------------------------------ epilogues */

/* 16 results of token t, panel p: (+ bias) (+ y), stored to the outputs that exist. */
TGT_512 INLINE void store16(__m512 v, const ps_out_t *o, int t, int p) {
    const int first = o->o0 + p * 16;
    if (first >= o->m) return;
    const __mmask16 mk = o->m - first >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (o->m - first)) - 1);
    if (o->bias) v = _mm512_add_ps(v, _mm512_loadu_ps(o->bias + first));
    float *dst = o->y + t * o->ldy + first;
    if (o->accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(mk, dst), v);
    _mm512_mask_storeu_ps(dst, mk, v);
}

TGT_512 INLINE __m512 dequant16(__m512i acc, const ps_out_t *o, int t, int p) {
    const int first = o->o0 + p * 16;
    const __m512i wsum = _mm512_loadu_si512((const void *)(o->wsum + first));
    const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, _mm512_slli_epi32(wsum, 7)));
    return _mm512_mul_ps(_mm512_mul_ps(f, _mm512_loadu_ps(o->scale + first)), _mm512_set1_ps(o->sx[t]));
}

/* 8 results (outputs first .. first + 7 of token t), AVX2. */
TGT_AVX2 INLINE void store8(__m256 v, const ps_out_t *o, int t, int first) {
    if (first >= o->m) return;
    if (o->bias) v = _mm256_add_ps(v, _mm256_loadu_ps(o->bias + first));
    float *dst = o->y + t * o->ldy + first;
    if (o->m - first >= 8) {
        if (o->accumulate) v = _mm256_add_ps(_mm256_loadu_ps(dst), v);
        _mm256_storeu_ps(dst, v);
        return;
    }
    float tmp[8];
    _mm256_storeu_ps(tmp, v);
    for (int i = 0; i < o->m - first; i++) dst[i] = o->accumulate ? dst[i] + tmp[i] : tmp[i];
}

TGT_AVX2 INLINE __m256 dequant8(__m256i acc, const ps_out_t *o, int t, int first) {
    const __m256 f = _mm256_cvtepi32_ps(acc);
    return _mm256_mul_ps(_mm256_mul_ps(f, _mm256_loadu_ps(o->scale + first)), _mm256_set1_ps(o->sx[t]));
}

/* ------------------------------------------------------------------ bfloat16 panels */

/* x: bf16 activations, rows ldx elements; read as pairs (one 32-bit broadcast per 2 inputs). */
#define PANELS(OP, t, xb) \
    do { a##t##0 = OP(a##t##0, xb, w0); a##t##1 = OP(a##t##1, xb, w1); \
         a##t##2 = OP(a##t##2, xb, w2); a##t##3 = OP(a##t##3, xb, w3); } while (0)

TGT_512BF INLINE void bf16_unit_512_t(const int T, const void *xv, int64_t ldx, const void *wv, int64_t pstride,
                                      int kp, const ps_out_t *out) {
    const uint32_t *x = xv;
    const uint16_t *w = wv;
    const int64_t lx = ldx / 2; /* pairs per activation row */
    __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00,
           a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
    for (int j = 0; j < kp / 2; j++) {
        const uint16_t *wj = w + (int64_t)j * 32;
        for (int p = 0; p < 4; p++) PREFETCH(wj + p * pstride + PS_PF_BYTES / 2);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)wj),
                       w1 = (__m512bh)_mm512_loadu_si512((const void *)(wj + pstride)),
                       w2 = (__m512bh)_mm512_loadu_si512((const void *)(wj + 2 * pstride)),
                       w3 = (__m512bh)_mm512_loadu_si512((const void *)(wj + 3 * pstride));
        PANELS(_mm512_dpbf16_ps, 0, (__m512bh)_mm512_set1_epi32((int)x[j]));
        if (T > 1) PANELS(_mm512_dpbf16_ps, 1, (__m512bh)_mm512_set1_epi32((int)x[lx + j]));
        if (T > 2) PANELS(_mm512_dpbf16_ps, 2, (__m512bh)_mm512_set1_epi32((int)x[2 * lx + j]));
        if (T > 3) PANELS(_mm512_dpbf16_ps, 3, (__m512bh)_mm512_set1_epi32((int)x[3 * lx + j]));
    }
#define BF16_OUT(t) do { store16(a##t##0, out, t, 0); store16(a##t##1, out, t, 1); \
                         store16(a##t##2, out, t, 2); store16(a##t##3, out, t, 3); } while (0)
    BF16_OUT(0);
    if (T > 1) BF16_OUT(1);
    if (T > 2) BF16_OUT(2);
    if (T > 3) BF16_OUT(3);
#undef BF16_OUT
}

TGT_512BF void ps_bf16_unit_512(int T, const void *x, int64_t ldx, const void *w, int64_t pstride, int kp,
                                const ps_out_t *out) {
    switch (T) {
    case 1: bf16_unit_512_t(1, x, ldx, w, pstride, kp, out); break;
    case 2: bf16_unit_512_t(2, x, ldx, w, pstride, kp, out); break;
    case 3: bf16_unit_512_t(3, x, ldx, w, pstride, kp, out); break;
    default: bf16_unit_512_t(4, x, ldx, w, pstride, kp, out); break; /* PS_UNIT_T_512 */
    }
}

/* x: float32 activations already rounded to bf16 values. One panel (16 outputs) at a time
 * (16 ymm registers: 8 accumulators, the widened weights, the broadcasts). */
TGT_AVX2 INLINE void bf16_unit_avx2_t(const int T, const void *xv, int64_t ldx, const void *wv, int64_t pstride,
                                      int kp, const ps_out_t *out) {
    const float *x = xv;
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    for (int p = 0; p < 4; p++) {
        const uint16_t *w = (const uint16_t *)wv + p * pstride;
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
        for (int j = 0; j < kp / 2; j++) {
            const uint16_t *wj = w + (int64_t)j * 32;
            PREFETCH_L1(wj + PS_PF_BYTES / 2);
            const __m256i r0 = _mm256_loadu_si256((const __m256i *)wj), r1 = _mm256_loadu_si256((const __m256i *)(wj + 16));
            const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(r0, 16)), o0 = _mm256_castsi256_ps(_mm256_and_si256(r0, hi));
            const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(r1, 16)), o1 = _mm256_castsi256_ps(_mm256_and_si256(r1, hi));
#define BF16_TOKEN(t)                                                                                    \
    do {                                                                                                 \
        const __m256 xe = _mm256_broadcast_ss(x + t * ldx + 2 * j), xo = _mm256_broadcast_ss(x + t * ldx + 2 * j + 1); \
        a##t##0 = _mm256_fmadd_ps(xo, o0, _mm256_fmadd_ps(xe, e0, a##t##0));                             \
        a##t##1 = _mm256_fmadd_ps(xo, o1, _mm256_fmadd_ps(xe, e1, a##t##1));                             \
    } while (0)
            BF16_TOKEN(0);
            if (T > 1) BF16_TOKEN(1);
            if (T > 2) BF16_TOKEN(2);
            if (T > 3) BF16_TOKEN(3);
#undef BF16_TOKEN
        }
        const int first = out->o0 + p * 16;
#define BF16_STORE(t) do { store8(a##t##0, out, t, first); store8(a##t##1, out, t, first + 8); } while (0)
        BF16_STORE(0);
        if (T > 1) BF16_STORE(1);
        if (T > 2) BF16_STORE(2);
        if (T > 3) BF16_STORE(3);
#undef BF16_STORE
    }
}

TGT_AVX2 void ps_bf16_unit_avx2(int T, const void *x, int64_t ldx, const void *w, int64_t pstride, int kp,
                                const ps_out_t *out) {
    switch (T) {
    case 1: bf16_unit_avx2_t(1, x, ldx, w, pstride, kp, out); break;
    case 2: bf16_unit_avx2_t(2, x, ldx, w, pstride, kp, out); break;
    case 3: bf16_unit_avx2_t(3, x, ldx, w, pstride, kp, out); break;
    default: bf16_unit_avx2_t(4, x, ldx, w, pstride, kp, out); break;
    }
}

/* ------------------------------------------------------------------ int8 panels */

/* x: u8 (q + 128), 4 inputs per 32-bit broadcast; the +128 is removed with 128 * wsum. */
TGT_512VNNI INLINE void q8_unit_512_t(const int T, const void *xv, int64_t ldx, const void *wv, int64_t pstride,
                                      int kp, const ps_out_t *out) {
    const uint32_t *x = xv;
    const int8_t *w = wv;
    const int64_t lx = ldx / 4; /* 4-input groups per activation row */
    __m512i a00 = _mm512_setzero_si512(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00,
            a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
    for (int j = 0; j < kp / 4; j++) {
        const int8_t *wj = w + (int64_t)j * 64;
        for (int p = 0; p < 4; p++) PREFETCH(wj + p * pstride + PS_PF_BYTES);
        const __m512i w0 = _mm512_loadu_si512((const void *)wj), w1 = _mm512_loadu_si512((const void *)(wj + pstride)),
                      w2 = _mm512_loadu_si512((const void *)(wj + 2 * pstride)),
                      w3 = _mm512_loadu_si512((const void *)(wj + 3 * pstride));
        PANELS(_mm512_dpbusd_epi32, 0, _mm512_set1_epi32((int)x[j]));
        if (T > 1) PANELS(_mm512_dpbusd_epi32, 1, _mm512_set1_epi32((int)x[lx + j]));
        if (T > 2) PANELS(_mm512_dpbusd_epi32, 2, _mm512_set1_epi32((int)x[2 * lx + j]));
        if (T > 3) PANELS(_mm512_dpbusd_epi32, 3, _mm512_set1_epi32((int)x[3 * lx + j]));
    }
#define Q8_ONE(t, p) do { if (out->o0 + p * 16 < out->m) store16(dequant16(a##t##p, out, t, p), out, t, p); } while (0)
#define Q8_OUT(t) do { Q8_ONE(t, 0); Q8_ONE(t, 1); Q8_ONE(t, 2); Q8_ONE(t, 3); } while (0)
    Q8_OUT(0);
    if (T > 1) Q8_OUT(1);
    if (T > 2) Q8_OUT(2);
    if (T > 3) Q8_OUT(3);
#undef Q8_OUT
#undef Q8_ONE
}

TGT_512VNNI void ps_q8_unit_512(int T, const void *x, int64_t ldx, const void *w, int64_t pstride, int kp,
                                const ps_out_t *out) {
    switch (T) {
    case 1: q8_unit_512_t(1, x, ldx, w, pstride, kp, out); break;
    case 2: q8_unit_512_t(2, x, ldx, w, pstride, kp, out); break;
    case 3: q8_unit_512_t(3, x, ldx, w, pstride, kp, out); break;
    default: q8_unit_512_t(4, x, ldx, w, pstride, kp, out); break; /* PS_UNIT_T_512 */
    }
}

/* x: s8, 4 inputs per broadcast. One panel at a time: 2 x 8 outputs. */
TGT_AVX2 INLINE void q8_unit_avx2_t(const int T, const void *xv, int64_t ldx, const void *wv, int64_t pstride,
                                    int kp, const ps_out_t *out) {
    const int32_t *x = xv;
    const __m256i ones = _mm256_set1_epi16(1);
    const int64_t lx = ldx / 4;
    for (int p = 0; p < 4; p++) {
        const int8_t *w = (const int8_t *)wv + p * pstride;
        __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00,
                a31 = a00;
        for (int j = 0; j < kp / 4; j++) {
            const int8_t *wj = w + (int64_t)j * 64;
            PREFETCH_L1(wj + PS_PF_BYTES);
            const __m256i r0 = _mm256_loadu_si256((const __m256i *)wj), r1 = _mm256_loadu_si256((const __m256i *)(wj + 32));
#define Q8_TOKEN(t)                                                                                       \
    do {                                                                                                  \
        const __m256i xb = _mm256_set1_epi32(x[t * lx + j]), ax = _mm256_sign_epi8(xb, xb);             \
        a##t##0 = _mm256_add_epi32(a##t##0, _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(r0, xb)), ones)); \
        a##t##1 = _mm256_add_epi32(a##t##1, _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(r1, xb)), ones)); \
    } while (0)
            Q8_TOKEN(0);
            if (T > 1) Q8_TOKEN(1);
            if (T > 2) Q8_TOKEN(2);
            if (T > 3) Q8_TOKEN(3);
#undef Q8_TOKEN
        }
        const int first = out->o0 + p * 16;
        if (first >= out->m) continue;
#define Q8_STORE(t) do { store8(dequant8(a##t##0, out, t, first), out, t, first); \
                         store8(dequant8(a##t##1, out, t, first + 8), out, t, first + 8); } while (0)
        Q8_STORE(0);
        if (T > 1) Q8_STORE(1);
        if (T > 2) Q8_STORE(2);
        if (T > 3) Q8_STORE(3);
#undef Q8_STORE
    }
}

TGT_AVX2 void ps_q8_unit_avx2(int T, const void *x, int64_t ldx, const void *w, int64_t pstride, int kp,
                              const ps_out_t *out) {
    switch (T) {
    case 1: q8_unit_avx2_t(1, x, ldx, w, pstride, kp, out); break;
    case 2: q8_unit_avx2_t(2, x, ldx, w, pstride, kp, out); break;
    case 3: q8_unit_avx2_t(3, x, ldx, w, pstride, kp, out); break;
    default: q8_unit_avx2_t(4, x, ldx, w, pstride, kp, out); break;
    }
}

#else
typedef int ps_linear_x86_unused; /* (ISO C: a translation unit must declare something) */
#endif
