/* The paged decode unit of paged_decode_cpu.c with AVX-512 or AVX2, for head sizes 64 and 128
 * (paged_decode_cpu.c picks it at run time: ps_isa_level).
 *
 * one_unit spends most of its instructions on what is the same for every query head of a KV head
 * and every token of a block: it loads and widens a K/V row once per query head, keeps its
 * accumulators in memory, and ends each score with a horizontal sum of 16 partial sums. Here a K/V
 * row is loaded and widened once for up to 4 query heads, the accumulators stay in registers
 * through a block, and the partial sums of 16 (AVX-512) or 8 (AVX2) tokens' scores are reduced
 * together by a transposing tree. Every float operation is one that one_unit does, on the same
 * operands and in the same order (the trees add the lanes in dot()'s pairs; the softmax is the
 * same function), so the outputs are bit for bit one_unit's: the tests compare them.
 *
 * Written in GCC/clang vector types under target attributes rather than intrinsics: the compiler
 * picks the instructions from the lane patterns. Each instruction set has its own source (the
 * 16-lane one ran 4-8x slower than one_unit when compiled for AVX2: its permutes cross registers).
 */
#include "paged_decode.h"

#ifdef PS_DECODE_X86
#include <math.h>
#include <string.h>

#define TGT __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
#define INLINE static inline __attribute__((always_inline)) TGT
#define TGT2 __attribute__((target("avx2,fma")))
#define INLINE2 static inline __attribute__((always_inline)) TGT2

/* ---------------------------------------------------------------- AVX-512: 16 lanes */

typedef float v16f __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint16_t v32h __attribute__((vector_size(64)));

/* 16 K/V elements from element i as float32: bfloat16 is the upper half of a float32, so each
 * element is put above a zero half (one permute; measured 3-8% faster than widen-and-shift). */
INLINE v16f ld16(const void *p, int64_t i, const int bf16) {
    v16f f;
    if (bf16) {
        v16h h;
        memcpy(&h, (const uint16_t *)p + i, sizeof h);
        const v16h z = {0};
        const v32h u = __builtin_shufflevector(z, h, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23, 8, 24,
                                               9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
        memcpy(&f, &u, sizeof f);
    } else {
        memcpy(&f, (const float *)p + i, sizeof f);
    }
    return f;
}

/* The transposing tree. Each level takes two vectors that hold tokens' partial sums in equal runs
 * of lanes and returns both sets, each run half as long, lane l of a run added to lane l + run/2:
 * dot()'s pairs (p[l] + p[l + 8], then + 4, then + 2, then + 1). After four levels over 16 tokens,
 * lane j holds token j's score. */
#define SV __builtin_shufflevector
INLINE v16f tree8(v16f a, v16f b) {
    return SV(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SV(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
INLINE v16f tree4(v16f a, v16f b) {
    return SV(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           SV(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
INLINE v16f tree2(v16f a, v16f b) {
    return SV(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           SV(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
}
INLINE v16f tree1(v16f a, v16f b) {
    return SV(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           SV(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#undef SV

/* Scores of GC query heads (qs: [GC, D] scaled) against the n rows of one KV head in a block (k:
 * element offset of row 0, rows `stride` apart), into s [GC, B] (lanes past n are 0, never read).
 * Each level of the tree runs as soon as its two halves exist, so few partials are live at once. */
INLINE void block_scores(const void *k_cache, const int bf16, int64_t k, int64_t stride, int n, const int GC,
                         const int D, int B, const float *qs, float *s) {
    enum { MAXC = 8 };
    const int C = D / 16;
    for (int j0 = 0; j0 < B; j0 += 16) {
        v16f oct[4][2];
        for (int t8 = 0; t8 < 2; t8++) {
            v16f quad[4][2];
            for (int t4 = 0; t4 < 2; t4++) {
                v16f pair[4][2];
                for (int t2 = 0; t2 < 2; t2++) {
                    v16f p[4][2]; /* [head][token]: the 16 partial sums of a score */
                    for (int t = 0; t < 2; t++) {
                        const int j = j0 + 8 * t8 + 4 * t4 + 2 * t2 + t;
                        v16f kr[MAXC];
                        if (j < n)
                            for (int c = 0; c < C; c++) kr[c] = ld16(k_cache, k + j * stride + 16 * c, bf16);
                        for (int g = 0; g < GC; g++) {
                            v16f part = {0};
                            if (j < n)
                                for (int c = 0; c < C; c++) {
                                    v16f qv;
                                    memcpy(&qv, qs + (size_t)g * D + 16 * c, sizeof qv);
                                    part += qv * kr[c];
                                }
                            p[g][t] = part;
                        }
                    }
                    for (int g = 0; g < GC; g++) pair[g][t2] = tree8(p[g][0], p[g][1]);
                }
                for (int g = 0; g < GC; g++) quad[g][t4] = tree4(pair[g][0], pair[g][1]);
            }
            for (int g = 0; g < GC; g++) oct[g][t8] = tree2(quad[g][0], quad[g][1]);
        }
        for (int g = 0; g < GC; g++) {
            const v16f sv = tree1(oct[g][0], oct[g][1]);
            memcpy(s + (size_t)g * B + j0, &sv, sizeof sv);
        }
    }
}

/* acc [GC, D] += the weights s [GC, B] times the n value rows, at most 16 vectors of accumulators
 * in registers at a time (CC of the C columns; CC divides C). */
INLINE void block_values(const void *v_cache, const int bf16, int64_t v, int64_t stride, int n, const int GC,
                         const int D, int B, const float *s, float *acc) {
    enum { MAXC = 8 };
    const int C = D / 16;
    const int CC = GC * C <= 16 ? C : (GC * (C / 2) <= 16 ? C / 2 : C / 4);
    for (int c0 = 0; c0 < C; c0 += CC) {
        v16f a[4][MAXC];
        for (int g = 0; g < GC; g++)
            for (int c = 0; c < CC; c++) memcpy(&a[g][c], acc + (size_t)g * D + 16 * (c0 + c), sizeof(v16f));
        for (int j = 0; j < n; j++) {
            v16f vr[MAXC];
            for (int c = 0; c < CC; c++) vr[c] = ld16(v_cache, v + j * stride + 16 * (c0 + c), bf16);
            for (int g = 0; g < GC; g++) {
                const float w = s[(size_t)g * B + j];
                for (int c = 0; c < CC; c++) a[g][c] += w * vr[c];
            }
        }
        for (int g = 0; g < GC; g++)
            for (int c = 0; c < CC; c++) memcpy(acc + (size_t)g * D + 16 * (c0 + c), &a[g][c], sizeof(v16f));
    }
}

/* Prefetch into L2 `rows` rows of `elems` K and V elements each, from element offset `first`,
 * `stride` elements apart, a row's K and V lines together: two passes of ps_prefetch_streams (all
 * K rows, then all V rows) ran up to 1.3x slower on caches that come from memory. */
static inline void prefetch_block(const void *k_cache, const void *v_cache, const int bf16, int64_t first,
                                  int64_t stride, int rows, int elems) {
    const int esz = bf16 ? 2 : 4;
    for (int j = 0; j < rows; j++) {
        const char *kr = (const char *)k_cache + (first + j * stride) * esz;
        const char *vr = (const char *)v_cache + (first + j * stride) * esz;
        for (int o = 0; o < elems * esz; o += 64) {
            __builtin_prefetch(kr + o, 0, 2);
            __builtin_prefetch(vr + o, 0, 2);
        }
    }
}

/* One pass of a KV head's block for GC of its query heads (scratch as in ps_unit_t, at the first
 * of them): a function per instruction set, head size, cache type and GC, from the tables below. */
typedef void (*heads_fn)(const void *k_cache, const void *v_cache, int64_t row0, int64_t stride, int n, int B,
                         const float *qs, float *acc, float *s, float *m, float *l);

#define HEADS_512(DC, BF, GC)                                                                                    \
    static TGT void heads512_##DC##_##BF##_##GC(const void *k_cache, const void *v_cache, int64_t row0,         \
                                                int64_t stride, int n, int B, const float *qs, float *acc,      \
                                                float *s, float *m, float *l) {                                  \
        block_scores(k_cache, BF, row0, stride, n, GC, DC, B, qs, s);                                           \
        ps_block_softmax(n, GC, DC, B, s, m, l, acc);                                                            \
        block_values(v_cache, BF, row0, stride, n, GC, DC, B, s, acc);                                          \
    }
#define TABLE(MAKE, DC, BF) MAKE(DC, BF, 1) MAKE(DC, BF, 2) MAKE(DC, BF, 3) MAKE(DC, BF, 4)
TABLE(HEADS_512, 64, 0)
TABLE(HEADS_512, 64, 1)
TABLE(HEADS_512, 128, 0)
TABLE(HEADS_512, 128, 1)

/* ---------------------------------------------------------------- AVX2: 8 lanes */

typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

INLINE2 v8f ld8(const void *p, int64_t i, const int bf16) {
    v8f f;
    if (bf16) {
        v8h h;
        memcpy(&h, (const uint16_t *)p + i, sizeof h);
        const v8h z = {0};
        const v16h u = __builtin_shufflevector(z, h, 0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
        memcpy(&f, &u, sizeof f);
    } else {
        memcpy(&f, (const float *)p + i, sizeof f);
    }
    return f;
}

/* The 8-lane tree over 8 tokens. A score's 16 partial sums are two vectors, p[0..7] and p[8..15]:
 * their sum is dot()'s first level. Then for two tokens' h8 (a, b): [a's h4 | b's h4]; then for
 * two such (tokens 0-1, 2-3): (h4[0] + h4[2], h4[1] + h4[3]) of tokens 0, 2 | 1, 3, within
 * 128-bit halves; then their sum for tokens 0, 2, 4, 6 | 1, 3, 5, 7, put in order at the end. */
#define SV __builtin_shufflevector
INLINE2 v8f tree4_8(v8f a, v8f b) { return SV(a, b, 0, 1, 2, 3, 8, 9, 10, 11) + SV(a, b, 4, 5, 6, 7, 12, 13, 14, 15); }
INLINE2 v8f tree2_8(v8f a, v8f b) { return SV(a, b, 0, 1, 8, 9, 4, 5, 12, 13) + SV(a, b, 2, 3, 10, 11, 6, 7, 14, 15); }
INLINE2 v8f tree1_8(v8f a, v8f b) {
    const v8f r = SV(a, b, 0, 2, 8, 10, 4, 6, 12, 14) + SV(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
    return SV(r, r, 0, 4, 1, 5, 2, 6, 3, 7);
}
#undef SV

INLINE2 void block_scores8(const void *k_cache, const int bf16, int64_t k, int64_t stride, int n, const int GC,
                           const int D, int B, const float *qs, float *s) {
    const int C = D / 16;
    for (int j0 = 0; j0 < B; j0 += 8) {
        v8f quad[4][2];
        for (int t4 = 0; t4 < 2; t4++) {
            v8f pair[4][2];
            for (int t2 = 0; t2 < 2; t2++) {
                v8f h8[4][2]; /* [head][token]: dot()'s p[l] + p[l + 8] */
                for (int t = 0; t < 2; t++) {
                    const int j = j0 + 4 * t4 + 2 * t2 + t;
                    v8f lo[4] = {{0}}, hi[4] = {{0}};
                    if (j < n)
                        for (int c = 0; c < C; c++) {
                            const v8f klo = ld8(k_cache, k + j * stride + 16 * c, bf16);
                            const v8f khi = ld8(k_cache, k + j * stride + 16 * c + 8, bf16);
                            for (int g = 0; g < GC; g++) {
                                v8f qlo, qhi;
                                memcpy(&qlo, qs + (size_t)g * D + 16 * c, sizeof qlo);
                                memcpy(&qhi, qs + (size_t)g * D + 16 * c + 8, sizeof qhi);
                                lo[g] += qlo * klo;
                                hi[g] += qhi * khi;
                            }
                        }
                    for (int g = 0; g < GC; g++) h8[g][t] = lo[g] + hi[g];
                }
                for (int g = 0; g < GC; g++) pair[g][t2] = tree4_8(h8[g][0], h8[g][1]);
            }
            for (int g = 0; g < GC; g++) quad[g][t4] = tree2_8(pair[g][0], pair[g][1]);
        }
        for (int g = 0; g < GC; g++) {
            const v8f sv = tree1_8(quad[g][0], quad[g][1]);
            memcpy(s + (size_t)g * B + j0, &sv, sizeof sv);
        }
    }
}

/* block_values with 8-lane accumulators, at most 12 of them in registers at a time. */
INLINE2 void block_values8(const void *v_cache, const int bf16, int64_t v, int64_t stride, int n, const int GC,
                           const int D, int B, const float *s, float *acc) {
    enum { MAXC = 16 };
    const int C = D / 8;
    const int fit = 12 / GC, CC = fit >= 8 ? (C < 8 ? C : 8) : fit >= 4 ? 4 : 2;
    for (int c0 = 0; c0 < C; c0 += CC) {
        v8f a[4][MAXC];
        for (int g = 0; g < GC; g++)
            for (int c = 0; c < CC; c++) memcpy(&a[g][c], acc + (size_t)g * D + 8 * (c0 + c), sizeof(v8f));
        for (int j = 0; j < n; j++) {
            v8f vr[MAXC];
            for (int c = 0; c < CC; c++) vr[c] = ld8(v_cache, v + j * stride + 8 * (c0 + c), bf16);
            for (int g = 0; g < GC; g++) {
                const float w = s[(size_t)g * B + j];
                for (int c = 0; c < CC; c++) a[g][c] += w * vr[c];
            }
        }
        for (int g = 0; g < GC; g++)
            for (int c = 0; c < CC; c++) memcpy(acc + (size_t)g * D + 8 * (c0 + c), &a[g][c], sizeof(v8f));
    }
}

#define HEADS_AVX2(DC, BF, GC)                                                                                   \
    static TGT2 void heads256_##DC##_##BF##_##GC(const void *k_cache, const void *v_cache, int64_t row0,        \
                                                 int64_t stride, int n, int B, const float *qs, float *acc,     \
                                                 float *s, float *m, float *l) {                                 \
        block_scores8(k_cache, BF, row0, stride, n, GC, DC, B, qs, s);                                          \
        ps_block_softmax(n, GC, DC, B, s, m, l, acc);                                                            \
        block_values8(v_cache, BF, row0, stride, n, GC, DC, B, s, acc);                                         \
    }
TABLE(HEADS_AVX2, 64, 0)
TABLE(HEADS_AVX2, 64, 1)
TABLE(HEADS_AVX2, 128, 0)
TABLE(HEADS_AVX2, 128, 1)
#undef TABLE

/* [instruction set][head size 64, 128][float32, bfloat16][GC - 1] */
#define ROW(P, DC, BF) {P##_##DC##_##BF##_1, P##_##DC##_##BF##_2, P##_##DC##_##BF##_3, P##_##DC##_##BF##_4}
static const heads_fn HEADS[2][2][2][4] = {
    {{ROW(heads512, 64, 0), ROW(heads512, 64, 1)}, {ROW(heads512, 128, 0), ROW(heads512, 128, 1)}},
    {{ROW(heads256, 64, 0), ROW(heads256, 64, 1)}, {ROW(heads256, 128, 0), ROW(heads256, 128, 1)}},
};
#undef ROW

/* ---------------------------------------------------------------- the unit */

int ps_decode_unit_x86(int isa, float *out, int64_t o_head, const float *q, int64_t q_head, const void *k_cache,
                       const void *v_cache, int bf16, const int32_t *table, int seq_len, int max_blocks, int h0,
                       int h1, int G, int H_kv, int D, int B, int64_t num_blocks, float scale, float *scratch) {
    if ((isa != PS_ISA_AVX512 && isa != PS_ISA_AVX2) || (D != 64 && D != 128) || B % (isa == PS_ISA_AVX512 ? 16 : 8))
        return PS_BAD_ARG;
    const heads_fn *fns = HEADS[isa == PS_ISA_AVX2][D == 128][bf16 != 0];
    ps_unit_t u;
    if (!ps_unit_begin(&u, scratch, q, q_head, h0 * G, (h1 - h0) * G, D, B, seq_len, max_blocks, scale))
        return PS_BAD_LEN;
    const int64_t tok_stride = (int64_t)H_kv * D;
    const int nblocks = (seq_len + B - 1) / B;
    for (int b = 0; b < nblocks; b++) {
        const int64_t blk = table[b];
        if (blk < 0 || blk >= num_blocks) return PS_BAD_BLOCK;
        const int n = (b == nblocks - 1) ? seq_len - b * B : B;
        /* A block's rows are read head by head, K and V in turn, which the hardware prefetchers
         * follow poorly, and the next block is anywhere in the cache: ask for this block's rows
         * and the next one's (into L2) before computing. Against either alone, at 1-2 threads:
         * up to 1.3x where the caches exceed L3, no slower where they fit. */
        prefetch_block(k_cache, v_cache, bf16, (blk * B) * tok_stride + (int64_t)h0 * D, tok_stride, B, (h1 - h0) * D);
        if (b + 1 < nblocks && table[b + 1] >= 0 && table[b + 1] < num_blocks)
            prefetch_block(k_cache, v_cache, bf16, (table[b + 1] * B) * tok_stride + (int64_t)h0 * D, tok_stride, B,
                           (h1 - h0) * D);
        for (int kh = h0; kh < h1; kh++) {
            const int64_t row0 = (blk * B) * tok_stride + (int64_t)kh * D;
            for (int h = (kh - h0) * G, end = h + G; h < end; h += 4)
                fns[(end - h < 4 ? end - h : 4) - 1](k_cache, v_cache, row0, tok_stride, n, B, u.qs + (size_t)h * D,
                                                     u.acc + (size_t)h * D, u.s + (size_t)h * B, u.m + h, u.l + h);
        }
    }
    ps_unit_end(&u, out, o_head, h0 * G, (h1 - h0) * G, D);
    return PS_OK;
}
#else
typedef int ps_paged_decode_x86_unused; /* (ISO C: a translation unit must declare something) */
#endif
