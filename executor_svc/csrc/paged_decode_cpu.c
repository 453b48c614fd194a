/* Fused paged decode attention on CPU (the CPU twin of cupy_kernels/paged_decode.cu).
 *
 * One query token per sequence. The unit of parallel work (OpenMP, torch's thread count) is a
 * sequence, or a sequence and a chunk of its KV heads when there are too few sequences for the
 * threads. It walks the sequence's blocks in place through its block table (no gather), scores
 * every cached key against the G query heads that share its KV head (GQA: each K/V row is read
 * once for the whole group), keeps a running max and sum per query head (online softmax, one
 * rescale per block), and accumulates the values. Queries, outputs and all arithmetic are
 * float32; the cache holds float32 or bfloat16 (widened exactly on load). With AVX2 or AVX-512,
 * head sizes 64 and 128 go to paged_decode_x86.c's units: the same bits, faster.
 *
 * Cache layout: [num_blocks, block_size, num_kv_heads, head_size], contiguous. Query and
 * output rows may be strided (row and head strides in elements; the head_size axis is
 * contiguous). Built by executor_svc/cpu_kernels.py with -O3 -march=native and no -ffast-math:
 * NaN and infinity must propagate as they do in torch's SDPA, so every reduction that should
 * vectorise spells out its own partial sums instead of licensing reassociation globally.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "paged_decode.h"

/* Bumped whenever a C signature changes; checked by the loader. */
int ps_abi_version(void) { return 5; }

/* A K/V element as float32: the cache holds float32, or bfloat16 (the upper half of a float32). */
static inline float kv_at(const void *p, int64_t i, const int bf16) {
    if (!bf16) return ((const float *)p)[i];
    const uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* 16 independent partial sums, then a fixed tree: vectorises to whole registers at any SIMD
 * width without -ffast-math (no reassociation the compiler has to invent), and is deterministic. */
static inline float dot(const float *restrict a, const void *restrict b, int64_t off, int n, const int bf16) {
    float p[16] = {0};
    int d = 0;
    for (; d + 16 <= n; d += 16)
        for (int l = 0; l < 16; l++) p[l] += a[d + l] * kv_at(b, off + d + l, bf16);
    float h8[8], h4[4];
    for (int l = 0; l < 8; l++) h8[l] = p[l] + p[l + 8];
    for (int l = 0; l < 4; l++) h4[l] = h8[l] + h8[l + 4];
    float s = (h4[0] + h4[2]) + (h4[1] + h4[3]);
    for (; d < n; d++) s += a[d] * kv_at(b, off + d, bf16);
    return s;
}

static inline void axpy(float *restrict y, float a, const void *restrict x, int64_t off, int n, const int bf16) {
#pragma omp simd
    for (int d = 0; d < n; d++) y[d] += a * kv_at(x, off + d, bf16);
}

/* One sequence, KV heads [h0, h1): the Q = (h1 - h0) * G query heads that read them.
 * Token-major: a block's rows for these heads are read front to back (one contiguous run per
 * token when the chunk is every head), which the hardware prefetcher follows.
 * scratch: ps_unit_t. */
static inline __attribute__((always_inline)) int one_unit(float *out, int64_t o_head, const float *q, int64_t q_head,
                    const void *k_cache, const void *v_cache, const int bf16, const int32_t *table, int seq_len,
                    int max_blocks, int h0, int h1, int G, int H_kv, int D, int B, int64_t num_blocks,
                    float scale, float *scratch) {
    const int Q = (h1 - h0) * G, qh0 = h0 * G;
    ps_unit_t u;
    if (!ps_unit_begin(&u, scratch, q, q_head, qh0, Q, D, B, seq_len, max_blocks, scale)) return PS_BAD_LEN;
    float *qs = u.qs, *acc = u.acc, *s = u.s;
    const int64_t tok_stride = (int64_t)H_kv * D; /* elements between consecutive slots */
    const int nblocks = (seq_len + B - 1) / B;
    for (int b = 0; b < nblocks; b++) {
        const int64_t blk = table[b];
        if (blk < 0 || blk >= num_blocks) return PS_BAD_BLOCK;
        const int n = (b == nblocks - 1) ? seq_len - b * B : B;
        const int64_t base = (blk * B) * tok_stride + (int64_t)h0 * D; /* element offset of the block's rows */
        for (int j = 0; j < n; j++) {
            const int64_t kr = base + j * tok_stride;
            for (int kh = 0, h = 0; kh < h1 - h0; kh++)
                for (int g = 0; g < G; g++, h++)
                    s[(size_t)h * B + j] = dot(qs + (size_t)h * D, k_cache, kr + kh * D, D, bf16);
        }
        for (int h = 0; h < Q; h += 4)
            ps_block_softmax(n, Q - h < 4 ? Q - h : 4, D, B, s + (size_t)h * B, u.m + h, u.l + h, acc + (size_t)h * D);
        for (int j = 0; j < n; j++) {
            const int64_t vr = base + j * tok_stride;
            for (int kh = 0, h = 0; kh < h1 - h0; kh++)
                for (int g = 0; g < G; g++, h++)
                    axpy(acc + (size_t)h * D, s[(size_t)h * B + j], v_cache, vr + kh * D, D, bf16);
        }
    }
    ps_unit_end(&u, out, o_head, qh0, Q, D);
    return PS_OK;
}


/* The common head sizes and both cache types as compile-time constants: the dot products and
 * updates unroll into whole registers. Any other size takes the same code with a run-time bound. */
PS_CLONES static int unit_for_head_size(float *out, int64_t o_head, const float *q, int64_t q_head,
                              const void *k_cache, const void *v_cache, int kv_type, const int32_t *table,
                              int seq_len, int max_blocks, int h0, int h1, int G, int H_kv, int D, int B,
                              int64_t num_blocks, float scale, float *scratch) {
#if defined(PS_DECODE_X86) && !defined(PS_NO_DECODE_X86) /* (a timed variant's switch: roofline --variant) */
    if (D == 64 || D == 128) {
        const int isa = ps_isa_level(PS_W_F32);
        const int use = isa == PS_ISA_AVX512 && B % 16 == 0 ? PS_ISA_AVX512
                        : isa >= PS_ISA_AVX2 && B % 8 == 0  ? PS_ISA_AVX2
                                                            : -1;
        if (use >= 0)
            return ps_decode_unit_x86(use, out, o_head, q, q_head, k_cache, v_cache, kv_type == PS_KV_BF16, table,
                                      seq_len, max_blocks, h0, h1, G, H_kv, D, B, num_blocks, scale, scratch);
    }
#endif
#define PS_UNIT(DC, BF) one_unit(out, o_head, q, q_head, k_cache, v_cache, BF, table, seq_len, max_blocks, h0, \
                                 h1, G, H_kv, DC, B, num_blocks, scale, scratch)
    if (kv_type == PS_KV_BF16) {
        switch (D) {
        case 64: return PS_UNIT(64, 1);
        case 128: return PS_UNIT(128, 1);
        default: return PS_UNIT(D, 1);
        }
    }
    switch (D) {
    case 64: return PS_UNIT(64, 0);
    case 128: return PS_UNIT(128, 0);
    default: return PS_UNIT(D, 0);
    }
#undef PS_UNIT
}

int ps_paged_decode_unit(float *out, int64_t o_head, const float *q, int64_t q_head, const void *k_cache,
                         const void *v_cache, int kv_type, const int32_t *table, int seq_len, int max_blocks,
                         int h0, int h1, int num_q_heads, int num_kv_heads, int head_size, int block_size,
                         int64_t num_blocks, float scale, float *scratch) {
    return unit_for_head_size(out, o_head, q, q_head, k_cache, v_cache, kv_type, table, seq_len, max_blocks, h0, h1,
                              num_q_heads / num_kv_heads, num_kv_heads, head_size, block_size, num_blocks, scale,
                              scratch);
}

/* Work units are (sequence, chunk of KV heads). Whole sequences read their blocks as one
 * contiguous run per token; split heads only when there are too few sequences to keep every
 * thread busy. Returns the number of chunks (1 .. num_kv_heads). */
int ps_decode_chunks(int num_seqs, int num_kv_heads, int threads) {
    int chunks = 1;
    while (chunks < num_kv_heads && (int64_t)num_seqs * chunks < 4 * (int64_t)threads) chunks++;
    const int per_chunk = (num_kv_heads + chunks - 1) / chunks;
    return (num_kv_heads + per_chunk - 1) / per_chunk;
}

int64_t ps_decode_scratch_floats(int num_q_heads, int num_kv_heads, int head_size, int block_size, int chunks) {
    const int per_chunk = (num_kv_heads + chunks - 1) / chunks;
    const int G = num_q_heads / num_kv_heads;
    return (int64_t)per_chunk * G * (2 * (int64_t)head_size + block_size + 2);
}

/* Every thread of a parallel region calls this with its own scratch (NULL: its allocation
 * failed; the thread then takes no unit and reports PS_NO_MEMORY); ends with a barrier.
 * Returns PS_OK or the first error this thread saw. */
int ps_paged_decode_region(float *out, int64_t o_row, int64_t o_head, const float *query, int64_t q_row,
                           int64_t q_head, const void *k_cache, const void *v_cache, int kv_type,
                           const int32_t *block_tables, int64_t bt_row, int max_blocks,
                           const int32_t *seq_lens, const int64_t *rows, const int64_t *seqs, int num_seqs,
                           int num_q_heads, int num_kv_heads, int head_size, int block_size,
                           int64_t num_blocks, float scale, float *scratch, int chunks) {
    const int G = num_q_heads / num_kv_heads;
    const int per_chunk = (num_kv_heads + chunks - 1) / chunks;
    const int64_t units = (int64_t)num_seqs * chunks;
    int mine = scratch ? PS_OK : PS_NO_MEMORY;
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; u++) {
        if (mine != PS_OK) continue;
        const int64_t i = u / chunks;
        const int h0 = (int)(u % chunks) * per_chunk;
        const int h1 = h0 + per_chunk < num_kv_heads ? h0 + per_chunk : num_kv_heads;
        const int64_t sq = rows ? seqs[i] : i, r = rows ? rows[i] : i;
        mine = unit_for_head_size(out + r * o_row, o_head, query + r * q_row, q_head, k_cache, v_cache, kv_type,
                                  block_tables + sq * bt_row, seq_lens[sq], max_blocks, h0, h1, G, num_kv_heads,
                                  head_size, block_size, num_blocks, scale, scratch);
    }
    return mine;
}

/* rows[i]: the query/output row of decode sequence i; seqs[i]: its index into seq_lens and
 * block_tables (both NULL: row i is sequence i). Returns PS_OK or the first error seen (the
 * output is then undefined). */
int ps_paged_decode(float *out, int64_t o_row, int64_t o_head, const float *query, int64_t q_row,
                    int64_t q_head, const void *k_cache, const void *v_cache, int kv_type,
                    const int32_t *block_tables, int64_t bt_row, int max_blocks,
                    const int32_t *seq_lens, const int64_t *rows, const int64_t *seqs, int num_seqs,
                    int num_q_heads, int num_kv_heads, int head_size, int block_size,
                    int64_t num_blocks, float scale, int num_threads) {
    const int threads = num_threads > 0 ? num_threads : 1;
    if (kv_type != PS_KV_F32 && kv_type != PS_KV_BF16) return PS_BAD_ARG;
    const int chunks = ps_decode_chunks(num_seqs, num_kv_heads, threads);
    const size_t scratch_floats =
        (size_t)ps_decode_scratch_floats(num_q_heads, num_kv_heads, head_size, block_size, chunks);
    int status = PS_OK;
#pragma omp parallel num_threads(threads)
    {
        float *scratch = malloc(sizeof(float) * scratch_floats);
        const int mine = ps_paged_decode_region(out, o_row, o_head, query, q_row, q_head, k_cache, v_cache,
                                                kv_type, block_tables, bt_row, max_blocks, seq_lens, rows, seqs,
                                                num_seqs, num_q_heads, num_kv_heads, head_size, block_size,
                                                num_blocks, scale, scratch, chunks);
        free(scratch);
        if (mine != PS_OK) {
#pragma omp critical
            if (status == PS_OK) status = mine;
        }
    }
    return status;
}
