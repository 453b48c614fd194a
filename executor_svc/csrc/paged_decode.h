/* What the two files of the CPU paged decode kernel share (paged_decode_cpu.c: the portable unit,
 * the dispatch and the parallel drivers; paged_decode_x86.c: the AVX2 and AVX-512 units). Private to
 * them. */
#ifndef PS_PAGED_DECODE_H
#define PS_PAGED_DECODE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "ps_cpu.h"

/* exp(x) for x <= 0 (a score minus the running max) or NaN: below -87 (exp < 1.7e-38) it
 * returns 0, as for -inf; NaN stays NaN. */
static inline float ps_exp_nonpos(float x0) {
    const float x = x0 < -87.0f ? -87.0f : x0;
    const float e = ps_exp_clamped(x);
    return x0 < -87.0f ? 0.0f : e;
}

/* A unit's scratch (ps_decode_scratch_floats): for its Q query heads, qs [Q, D] the queries times
 * the softmax scale, acc [Q, D] the weighted values, s [Q, B] a block's scores, m [Q] the running
 * max and l [Q] the running sum of the weights. */
typedef struct {
    float *qs, *acc, *s, *m, *l;
} ps_unit_t;

/* Lays out the scratch and loads query heads [qh0, qh0 + Q); 0 when seq_len is not within
 * 1 .. max_blocks * B. */
static inline int ps_unit_begin(ps_unit_t *u, float *scratch, const float *q, int64_t q_head, int qh0, int Q,
                                int D, int B, int seq_len, int max_blocks, float scale) {
    u->qs = scratch;
    u->acc = u->qs + (size_t)Q * D;
    u->s = u->acc + (size_t)Q * D;
    u->m = u->s + (size_t)Q * B;
    u->l = u->m + Q;
    if (seq_len < 1 || (int64_t)(seq_len - 1) / B >= max_blocks) return 0;
    for (int h = 0; h < Q; h++) {
        const float *qh = q + (int64_t)(qh0 + h) * q_head;
        for (int d = 0; d < D; d++) u->qs[(size_t)h * D + d] = qh[d] * scale;
        u->m[h] = -INFINITY;
        u->l[h] = 0.0f;
    }
    memset(u->acc, 0, sizeof(float) * (size_t)Q * D);
    return 1;
}

/* out's query heads [qh0, qh0 + Q) = acc / l. */
static inline void ps_unit_end(const ps_unit_t *u, float *out, int64_t o_head, int qh0, int Q, int D) {
    for (int h = 0; h < Q; h++) {
        float *oh = out + (int64_t)(qh0 + h) * o_head;
        const float inv = 1.0f / u->l[h];
        for (int d = 0; d < D; d++) oh[d] = u->acc[(size_t)h * D + d] * inv;
    }
}

/* The online-softmax update of a block for GC <= 4 query heads (s [GC, B]: the scores of n tokens;
 * m, l [GC]; acc [GC, D]): the scores become weights, m and l move on, acc is rescaled. The heads'
 * running max and sum are interleaved so that their chains of dependent operations overlap; each
 * head's still runs in token order. */
static inline __attribute__((always_inline)) void ps_block_softmax(int n, const int GC, const int D, int B, float *s,
                                                                  float *m, float *l, float *acc) {
    float bm[4], sum[4], corr[4];
    for (int g = 0; g < GC; g++) bm[g] = -INFINITY, sum[g] = 0.0f;
    for (int j = 0; j < n; j++)
        for (int g = 0; g < GC; g++) {
            const float x = s[(size_t)g * B + j];
            bm[g] = x > bm[g] ? x : bm[g]; /* a NaN score never wins; it makes l NaN below */
        }
    for (int g = 0; g < GC; g++) {
        const float m_new = bm[g] > m[g] ? bm[g] : m[g];
        corr[g] = (m[g] == -INFINITY) ? 0.0f : expf(m[g] - m_new);
        m[g] = m_new;
        float *sh = s + (size_t)g * B;
        for (int j = 0; j < n; j++) sh[j] = ps_exp_nonpos(sh[j] - m_new);
    }
    for (int j = 0; j < n; j++)
        for (int g = 0; g < GC; g++) sum[g] += s[(size_t)g * B + j];
    for (int g = 0; g < GC; g++) {
        if (corr[g] != 1.0f)
            for (int d = 0; d < D; d++) acc[(size_t)g * D + d] *= corr[g];
        l[g] = l[g] * corr[g] + sum[g];
    }
}

/* The x86 units are written with __builtin_shufflevector: GCC 12 or later, or clang. An older
 * compiler builds the portable unit alone (the same bits, slower). */
#if defined(PS_X86) && defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define PS_DECODE_X86 1
#endif
#endif

#ifdef PS_DECODE_X86
/* The portable unit (one_unit) for head_size 64 or 128 with AVX-512 (block_size a multiple of 16)
 * or AVX2 (of 8): the same bits (paged_decode_x86.c). isa: PS_ISA_AVX512 or PS_ISA_AVX2, which the
 * CPU must have; PS_BAD_ARG for any other shape. */
int ps_decode_unit_x86(int isa, float *out, int64_t o_head, const float *q, int64_t q_head, const void *k_cache,
                       const void *v_cache, int bf16, const int32_t *table, int seq_len, int max_blocks, int h0,
                       int h1, int G, int H_kv, int D, int B, int64_t num_blocks, float scale, float *scratch);
#endif

#endif
