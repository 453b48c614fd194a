/* AVX2 and AVX-512 VNNI kernels of the block formats (layout and arithmetic: linear_blocks.h).
 *
 * A panel's 16 rows are the 16 lanes of a vector (two halves of 8 on AVX2), so a block's
 * quants load as 4 (Q4_0, Q4_1, Q4_K) or 8 (Q8_0) vectors of 16 rows x 4 inputs, multiplied with 4 of a
 * token's quantised inputs broadcast to every lane: no horizontal sums, and each vector loaded
 * serves every token of the call, against both 8-bit parts of its activations (linear_blocks.h).
 *   AVX-512 VNNI: vpdpbusd takes unsigned x signed bytes: Q4 nibbles are unsigned already (the
 *     -8 of Q4_0 is removed with 8 * the block's activation sum), Q8_0 weights are made unsigned
 *     by flipping their sign bit (+128, removed with 128 * the sum).
 *   AVX2: vpmaddubsw, unsigned x signed bytes into pairs of int16. Q4: nibbles x activations, a
 *     whole block summed in int16 (16 products of at most 15 * 127: no saturation), widened
 *     once. Q8_0: |w| x (x with w's sign), each pair at most 2 * 128 * 127, widened every time.
 * The integer sums are exact, and the float epilogue is linear_blocks.h's on every path.
 */
#include "linear_blocks.h"

#ifdef PS_X86
#include <immintrin.h>

#define INLINE static inline __attribute__((always_inline))
#define TGT_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TGT_512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,avx512vnni")))
/* Weights stream once: prefetched into L2 PS_PF_BYTES ahead (as linear_x86.c's, for its reasons). */
#ifndef PS_PF_HINT
#define PS_PF_HINT _MM_HINT_T1
#endif
#define PREFETCH(p) _mm_prefetch((const char *)(p), PS_PF_HINT)

/* ------------------------------------------------------------------ AVX-512 VNNI */

/* Sums of one panel (16 rows) for T tokens, into res[t]. */
TGT_512 INLINE void panel_512(const int wt, const int T, const ps_xblocks_t *x, const uint8_t *w, int nb,
                              __m512 *res) {
    const int qbytes = PS_BLK_QBYTES(wt);
    const __m512i m4 = _mm512_set1_epi8(15), flip = _mm512_set1_epi8((char)0x80);
    __m512 f[4];
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) f[t] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = PS_BLK_Q(wt, w, b);
        const int32_t *xq[4]; /* the block's q1 as 8 groups of 4, then q2 */
        __m512i a1[4], a2[4];
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            xq[t] = (const int32_t *)(x->q + t * x->ldq + b * 2 * PS_BLK);
            a1[t] = a2[t] = _mm512_setzero_si512();
        }
        if (wt == PS_W_Q8_0) {
#pragma GCC unroll 8
            for (int v = 0; v < 8; v++) {
                PREFETCH(blk + v * 64 + PS_PF_BYTES);
                const __m512i q = _mm512_xor_si512(_mm512_loadu_si512((const void *)(blk + v * 64)), flip);
#pragma GCC unroll 4
                for (int t = 0; t < T; t++) {
                    a1[t] = _mm512_dpbusd_epi32(a1[t], q, _mm512_set1_epi32(xq[t][v]));
                    a2[t] = _mm512_dpbusd_epi32(a2[t], q, _mm512_set1_epi32(xq[t][8 + v]));
                }
            }
        } else {
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) {
                PREFETCH(blk + v * 64 + PS_PF_BYTES);
                const __m512i raw = _mm512_loadu_si512((const void *)(blk + v * 64));
                const __m512i ql = _mm512_and_si512(raw, m4), qh = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
#pragma GCC unroll 4
                for (int t = 0; t < T; t++) {
                    a1[t] = _mm512_dpbusd_epi32(a1[t], ql, _mm512_set1_epi32(xq[t][v]));
                    a1[t] = _mm512_dpbusd_epi32(a1[t], qh, _mm512_set1_epi32(xq[t][4 + v]));
                    a2[t] = _mm512_dpbusd_epi32(a2[t], ql, _mm512_set1_epi32(xq[t][8 + v]));
                    a2[t] = _mm512_dpbusd_epi32(a2[t], qh, _mm512_set1_epi32(xq[t][12 + v]));
                }
            }
        }
        __m512 d, m;
        if (wt == PS_W_Q4_K) { /* d * sc and -(dmin * mn): exact */
            const uint8_t *sb = PS_QK_SUPER_AT(w, b);
            const int j = b % PS_QK_SUPER;
            if (!j) PREFETCH(sb + PS_QK_BYTES + PS_QK_SC); /* the next super-block's scales */
            const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sb + PS_QK_SC + 16 * j))));
            const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sb + PS_QK_MN + 16 * j))));
            d = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + PS_QK_D))), sc);
            m = _mm512_xor_ps(_mm512_set1_ps(-0.0f),
                              _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + PS_QK_DMIN))), mn));
        } else {
            if (wt == PS_W_Q4_1) PREFETCH(blk + qbytes + PS_PF_BYTES);
            d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + qbytes)));
            m = wt == PS_W_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + qbytes + 32))) : d;
        }
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            const int64_t xi = t * x->lds + b;
            /* 254 a1 + a2 */
            __m512i s = _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(a1[t], 8), _mm512_slli_epi32(a1[t], 1)),
                                         a2[t]);
            if (wt == PS_W_Q8_0) s = _mm512_sub_epi32(s, _mm512_set1_epi32(x->s[xi] * 128));
            if (wt == PS_W_Q4_0) s = _mm512_sub_epi32(s, _mm512_set1_epi32(x->s[xi] * 8));
            f[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(x->dx[xi])), f[t]);
            if (wt == PS_W_Q4_1 || wt == PS_W_Q4_K) f[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(x->dxs[xi]), f[t]);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) res[t] = f[t];
}

/* 16 results of token t: (+ bias) (+ y), stored to the rows that exist. */
TGT_512 INLINE void store16(__m512 v, const ps_out_t *o, int t, int first) {
    const __mmask16 mk = o->m - first >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (o->m - first)) - 1);
    if (o->bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mk, o->bias + first));
    float *dst = o->y + t * o->ldy + first;
    if (o->accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(mk, dst), v);
    _mm512_mask_storeu_ps(dst, mk, v);
}

TGT_512 INLINE void unit_512_t(const int wt, const int T, const ps_xblocks_t *x, const uint8_t *w, int nb,
                               const ps_out_t *out) {
    for (int p = 0; p < 4 && out->o0 + 16 * p < out->m; p++) {
        __m512 res[4];
        panel_512(wt, T, x, w + p * PS_PANEL_BYTES(wt, nb), nb, res);
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) store16(res[t], out, t, out->o0 + 16 * p);
    }
}

#define DISPATCH(fn, wt, T, ...)                                                   \
    switch ((wt) * 8 + (T)) {                                                       \
    case PS_W_Q8_0 * 8 + 1: fn(PS_W_Q8_0, 1, __VA_ARGS__); break;                   \
    case PS_W_Q8_0 * 8 + 2: fn(PS_W_Q8_0, 2, __VA_ARGS__); break;                   \
    case PS_W_Q8_0 * 8 + 3: fn(PS_W_Q8_0, 3, __VA_ARGS__); break;                   \
    case PS_W_Q8_0 * 8 + 4: fn(PS_W_Q8_0, 4, __VA_ARGS__); break;                   \
    case PS_W_Q4_0 * 8 + 1: fn(PS_W_Q4_0, 1, __VA_ARGS__); break;                   \
    case PS_W_Q4_0 * 8 + 2: fn(PS_W_Q4_0, 2, __VA_ARGS__); break;                   \
    case PS_W_Q4_0 * 8 + 3: fn(PS_W_Q4_0, 3, __VA_ARGS__); break;                   \
    case PS_W_Q4_0 * 8 + 4: fn(PS_W_Q4_0, 4, __VA_ARGS__); break;                   \
    case PS_W_Q4_1 * 8 + 1: fn(PS_W_Q4_1, 1, __VA_ARGS__); break;                   \
    case PS_W_Q4_1 * 8 + 2: fn(PS_W_Q4_1, 2, __VA_ARGS__); break;                   \
    case PS_W_Q4_1 * 8 + 3: fn(PS_W_Q4_1, 3, __VA_ARGS__); break;                   \
    case PS_W_Q4_1 * 8 + 4: fn(PS_W_Q4_1, 4, __VA_ARGS__); break;                   \
    case PS_W_Q4_K * 8 + 1: fn(PS_W_Q4_K, 1, __VA_ARGS__); break;                   \
    case PS_W_Q4_K * 8 + 2: fn(PS_W_Q4_K, 2, __VA_ARGS__); break;                   \
    case PS_W_Q4_K * 8 + 3: fn(PS_W_Q4_K, 3, __VA_ARGS__); break;                   \
    default: fn(PS_W_Q4_K, 4, __VA_ARGS__); break;                                  \
    }

TGT_512 void ps_blocks_unit_512(int wt, int T, const ps_xblocks_t *x, const uint8_t *w, int nb, const ps_out_t *out) {
    DISPATCH(unit_512_t, wt, T, x, w, nb, out)
}

/* ------------------------------------------------------------------ AVX2 */

/* Sums of half h (rows 8h .. 8h + 7) of one panel for T tokens, into res[t]. */
TGT_AVX2 INLINE void half_avx2(const int wt, const int T, const ps_xblocks_t *x, const uint8_t *w, int nb, int h,
                               __m256 *res) {
    const int qbytes = PS_BLK_QBYTES(wt);
    const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256 f[4];
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) f[t] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = PS_BLK_Q(wt, w, b);
        const int32_t *xq[4]; /* the block's q1 as 8 groups of 4, then q2 */
        __m256i a1[4], a2[4];
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            xq[t] = (const int32_t *)(x->q + t * x->ldq + b * 2 * PS_BLK);
            a1[t] = a2[t] = _mm256_setzero_si256();
        }
        if (wt == PS_W_Q8_0) {
#pragma GCC unroll 8
            for (int v = 0; v < 8; v++) {
                if (!h) PREFETCH(blk + v * 64 + PS_PF_BYTES);
                const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + v * 64 + 32 * h));
                const __m256i aq = _mm256_abs_epi8(q);
#pragma GCC unroll 4
                for (int t = 0; t < T; t++) {
                    const __m256i s1 = _mm256_sign_epi8(_mm256_set1_epi32(xq[t][v]), q);
                    const __m256i s2 = _mm256_sign_epi8(_mm256_set1_epi32(xq[t][8 + v]), q);
                    a1[t] = _mm256_add_epi32(a1[t], _mm256_madd_epi16(_mm256_maddubs_epi16(aq, s1), ones));
                    a2[t] = _mm256_add_epi32(a2[t], _mm256_madd_epi16(_mm256_maddubs_epi16(aq, s2), ones));
                }
            }
        } else {
            __m256i p1[4], p2[4];
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) p1[t] = p2[t] = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) {
                if (!h) PREFETCH(blk + v * 64 + PS_PF_BYTES);
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + v * 64 + 32 * h));
                const __m256i ql = _mm256_and_si256(raw, m4), qh = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
#pragma GCC unroll 4
                for (int t = 0; t < T; t++) {
                    p1[t] = _mm256_add_epi16(p1[t], _mm256_maddubs_epi16(ql, _mm256_set1_epi32(xq[t][v])));
                    p1[t] = _mm256_add_epi16(p1[t], _mm256_maddubs_epi16(qh, _mm256_set1_epi32(xq[t][4 + v])));
                    p2[t] = _mm256_add_epi16(p2[t], _mm256_maddubs_epi16(ql, _mm256_set1_epi32(xq[t][8 + v])));
                    p2[t] = _mm256_add_epi16(p2[t], _mm256_maddubs_epi16(qh, _mm256_set1_epi32(xq[t][12 + v])));
                }
            }
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) {
                a1[t] = _mm256_madd_epi16(p1[t], ones);
                a2[t] = _mm256_madd_epi16(p2[t], ones);
            }
        }
        __m256 d, m;
        if (wt == PS_W_Q4_K) { /* d * sc and -(dmin * mn): exact */
            const uint8_t *sb = PS_QK_SUPER_AT(w, b);
            const int j = b % PS_QK_SUPER;
            if (!j && !h) PREFETCH(sb + PS_QK_BYTES + PS_QK_SC);
            const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sb + PS_QK_SC + 16 * j + 8 * h))));
            const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sb + PS_QK_MN + 16 * j + 8 * h))));
            d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + PS_QK_D + 16 * h))), sc);
            m = _mm256_xor_ps(_mm256_set1_ps(-0.0f),
                              _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + PS_QK_DMIN + 16 * h))), mn));
        } else {
            if (wt == PS_W_Q4_1 && !h) PREFETCH(blk + qbytes + PS_PF_BYTES);
            d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + qbytes + 16 * h)));
            m = wt == PS_W_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + qbytes + 32 + 16 * h))) : d;
        }
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            const int64_t xi = t * x->lds + b;
            __m256i s = _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(a1[t], 8), _mm256_slli_epi32(a1[t], 1)),
                                         a2[t]);
            if (wt == PS_W_Q4_0) s = _mm256_sub_epi32(s, _mm256_set1_epi32(x->s[xi] * 8));
            f[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(x->dx[xi])), f[t]);
            if (wt == PS_W_Q4_1 || wt == PS_W_Q4_K) f[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(x->dxs[xi]), f[t]);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) res[t] = f[t];
}

/* 8 results of token t (rows first .. first + 7), AVX2. */
TGT_AVX2 INLINE void store8(__m256 v, const ps_out_t *o, int t, int first) {
    if (first >= o->m) return;
    float tmp[8];
    _mm256_storeu_ps(tmp, v);
    float *dst = o->y + t * o->ldy + first;
    for (int i = 0; i < 8 && first + i < o->m; i++) {
        float r = tmp[i];
        if (o->bias) r += o->bias[first + i];
        dst[i] = o->accumulate ? dst[i] + r : r;
    }
}

TGT_AVX2 INLINE void unit_avx2_t(const int wt, const int T, const ps_xblocks_t *x, const uint8_t *w, int nb,
                                 const ps_out_t *out) {
    for (int p = 0; p < 4 && out->o0 + 16 * p < out->m; p++)
        for (int h = 0; h < 2; h++) {
            __m256 res[4];
            half_avx2(wt, T, x, w + p * PS_PANEL_BYTES(wt, nb), nb, h, res);
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) store8(res[t], out, t, out->o0 + 16 * p + 8 * h);
        }
}

TGT_AVX2 void ps_blocks_unit_avx2(int wt, int T, const ps_xblocks_t *x, const uint8_t *w, int nb,
                                  const ps_out_t *out) {
    DISPATCH(unit_avx2_t, wt, T, x, w, nb, out)
}

/* ------------------------------------------------------------------ activations */

/* linear_blocks.c's quantize_row in vectors: per element the same operations (x / d, rint,
 * (v - q1) * 254, rint), the same rule for NaN and inf, exact integer sums: the same bytes and
 * scales (the tests compare the layers' outputs on every path bit for bit). Lanes past k load as
 * zeros, which quantise to 0 as the scalar code's padding does. */
TGT_512 void ps_blocks_quantize_512(const float *x, int k, int8_t *q, float *dx, int32_t *s, float *dxs) {
    const __m512 sign = _mm512_set1_ps(-0.0f), k254 = _mm512_set1_ps(254.0f);
    const __m512i k254i = _mm512_set1_epi32(254);
    const int R = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    for (int b = 0; b < (k + PS_BLK - 1) / PS_BLK; b++) {
        const int j0 = b * PS_BLK, len = k - j0 < PS_BLK ? k - j0 : PS_BLK;
        const __mmask16 m0 = len >= 16 ? 0xFFFF : (__mmask16)((1u << len) - 1);
        const __mmask16 m1 = len >= 32 ? 0xFFFF : len > 16 ? (__mmask16)((1u << (len - 16)) - 1) : 0;
        const __m512 x0 = _mm512_maskz_loadu_ps(m0, x + j0), x1 = _mm512_maskz_loadu_ps(m1, x + j0 + 16);
        const int nan = _mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(x1, x1, _CMP_UNORD_Q);
        const float amax =
            _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, x0), _mm512_andnot_ps(sign, x1)));
        int8_t *q1 = q + 2 * j0, *q2 = q1 + PS_BLK;
        if (nan || !(amax <= 3.0e38f)) {
            ps_block_nonfinite(q1, dx + b, s + b, dxs + b);
            continue;
        }
        const float d = amax / 127.0f;
        __m512 v0 = _mm512_setzero_ps(), v1 = v0;
        if (d > 0.0f) {
            v0 = _mm512_div_ps(x0, _mm512_set1_ps(d));
            v1 = _mm512_div_ps(x1, _mm512_set1_ps(d));
        }
        const __m512 r10 = _mm512_roundscale_ps(v0, R), r11 = _mm512_roundscale_ps(v1, R);
        const __m512 r20 = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(v0, r10), k254), R);
        const __m512 r21 = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(v1, r11), k254), R);
        const __m512i a0 = _mm512_cvtps_epi32(r10), a1 = _mm512_cvtps_epi32(r11);
        const __m512i c0 = _mm512_cvtps_epi32(r20), c1 = _mm512_cvtps_epi32(r21);
        _mm_storeu_si128((__m128i *)q1, _mm512_cvtepi32_epi8(a0));
        _mm_storeu_si128((__m128i *)(q1 + 16), _mm512_cvtepi32_epi8(a1));
        _mm_storeu_si128((__m128i *)q2, _mm512_cvtepi32_epi8(c0));
        _mm_storeu_si128((__m128i *)(q2 + 16), _mm512_cvtepi32_epi8(c1));
        const __m512i sum = _mm512_add_epi32(_mm512_add_epi32(_mm512_mullo_epi32(a0, k254i), c0),
                                             _mm512_add_epi32(_mm512_mullo_epi32(a1, k254i), c1));
        ps_block_scales(d, _mm512_reduce_add_epi32(sum), dx + b, s + b, dxs + b);
    }
}

/* 32 int32 in [-127, 127] (four vectors of 8, in order) to 32 bytes. */
TGT_AVX2 INLINE void store_bytes_avx2(int8_t *dst, const __m256i *v) {
    /* packs work within 128-bit lanes: bytes come out as 4-groups a0 b0 c0 d0 | a1 b1 c1 d1 */
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_si256((__m256i *)dst, _mm256_permutevar8x32_epi32(bytes, order));
}

TGT_AVX2 void ps_blocks_quantize_avx2(const float *x, int k, int8_t *q, float *dx, int32_t *s, float *dxs) {
    const __m256 sign = _mm256_set1_ps(-0.0f), k254 = _mm256_set1_ps(254.0f);
    const __m256i k254i = _mm256_set1_epi32(254), iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const int R = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    for (int b = 0; b < (k + PS_BLK - 1) / PS_BLK; b++) {
        const int j0 = b * PS_BLK, len = k - j0 < PS_BLK ? k - j0 : PS_BLK;
        __m256 xv[4], amax8 = _mm256_setzero_ps();
        int nan = 0;
        for (int i = 0; i < 4; i++) {
            const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(len - 8 * i), iota);
            xv[i] = len == PS_BLK ? _mm256_loadu_ps(x + j0 + 8 * i) : _mm256_maskload_ps(x + j0 + 8 * i, live);
            nan |= _mm256_movemask_ps(_mm256_cmp_ps(xv[i], xv[i], _CMP_UNORD_Q));
            amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, xv[i]));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
        int8_t *q1 = q + 2 * j0, *q2 = q1 + PS_BLK;
        if (nan || !(amax <= 3.0e38f)) {
            ps_block_nonfinite(q1, dx + b, s + b, dxs + b);
            continue;
        }
        const float d = amax / 127.0f;
        __m256i i1[4], i2[4], sum = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            const __m256 v = d > 0.0f ? _mm256_div_ps(xv[i], _mm256_set1_ps(d)) : _mm256_setzero_ps();
            const __m256 r1 = _mm256_round_ps(v, R);
            i1[i] = _mm256_cvtps_epi32(r1);
            i2[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(v, r1), k254), R));
            sum = _mm256_add_epi32(sum, _mm256_add_epi32(_mm256_mullo_epi32(i1[i], k254i), i2[i]));
        }
        store_bytes_avx2(q1, i1);
        store_bytes_avx2(q2, i2);
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
        ps_block_scales(d, _mm_cvtsi128_si32(t), dx + b, s + b, dxs + b);
    }
}

#else
typedef int ps_linear_blocks_x86_unused; /* (ISO C: a translation unit must declare something) */
#endif
