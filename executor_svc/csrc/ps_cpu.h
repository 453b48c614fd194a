/* Declarations shared by the CPU kernels in executor_svc/csrc (built into one library by
 * executor_svc/cpu_kernels.py). Everything here runs on the executor's compute thread or on the
 * OpenMP threads it starts; the "_region" functions are called from inside an OpenMP parallel
 * region by every thread of it (tid of nth) and use orphaned worksharing. */
#ifndef PS_CPU_H
#define PS_CPU_H

#include <stdint.h>
#include <string.h>

/* x86-64 with GCC or clang: the AVX2/AVX-512 kernels are built (target attributes) and picked
 * at run time (ps_isa_level). */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define PS_X86 1
#endif

#ifdef _OPENMP
#include <omp.h>
#define PS_TID() omp_get_thread_num()
#define PS_NTH() omp_get_num_threads()
#else
#define PS_TID() 0
#define PS_NTH() 1
#endif

#define PS_OK 0
#define PS_BAD_BLOCK 1   /* a block id outside [0, num_blocks) */
#define PS_BAD_LEN 2     /* seq_len < 1 or longer than its block table */
#define PS_NO_MEMORY 3
#define PS_BAD_ARG 4     /* a shape, type or size the kernels do not take */

/* Weight formats of a linear layer [m outputs, k inputs].
 * PS_W_F32: row-major [m, ldw] float32.
 * PS_W_BF16, PS_W_Q8: packed in panels of 16 output rows, the inputs interleaved in groups of
 *   G = 2 (bf16) or 4 (int8) so that 64 bytes hold 16 outputs x G inputs:
 *   w[(o / 16) * (kp / G) * 16 * G + (j / G) * 16 * G + (o % 16) * G + j % G] = W[o, j],
 *   with m padded to mp = ceil(m / 64) * 64 rows and k to kp = ceil(k / G) * G inputs (zeros).
 *   PS_W_Q8 is int8 with one float scale per output row (scale, wsum and bias hold mp values). */
#define PS_W_F32 0
#define PS_W_BF16 1
#define PS_W_Q8 2
/* llama.cpp's block formats, kept as the GGUF file stores them (per 32 inputs of a row a float16
 * scale, and for Q4_1 an offset; Q4_K: 6-bit scales and offsets per 32 inputs under float16 ones
 * per 256): their packed layout is in linear_blocks.h. scale and wsum are NULL, bias [mp] or NULL. */
#define PS_W_Q8_0 3
#define PS_W_Q4_0 4
#define PS_W_Q4_1 5
#define PS_W_Q4_K 6

/* A portable build (-DPS_PORTABLE, no -march: the executor image, built on one machine and run on
 * others) still gets AVX2/AVX-512 code: GCC/clang emit one clone per target and pick one at load
 * time from the running CPU's features. */
#if !defined(PS_CLONES) && defined(PS_PORTABLE) && defined(__x86_64__) && defined(__ELF__) && \
    ((defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 6) || (defined(__clang__) && __clang_major__ >= 14))
#define PS_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#elif !defined(PS_CLONES)
#define PS_CLONES
#endif

/* exp(x) for x in [-87, 88] (or NaN: the caller decides what that gives), in a form the compiler
 * vectorises (libm's expf is a call per element): x = k ln2 + r with |r| <= ln2/2, exp(r) by its
 * Taylor series to r^7 (truncation < 1e-8 relative; measured max error ~1-2 ulp), times 2^k built
 * in the exponent bits. The callers clamp (paged_decode_cpu.c, rowwise_cpu.c). */
static inline float ps_exp_clamped(float x) {
    const float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    const float r = (x - k * 0.693145751953125f) - k * 1.42860682030941723e-6f; /* ln2 in two parts */
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)(k == k ? k : 0.0f) + 127) << 23; /* k in [-126, 127]: a normal float */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* Instruction-set levels the kernels pick from at run time (ps_isa_level). */
#define PS_ISA_SCALAR 0
#define PS_ISA_AVX2 1     /* AVX2 + FMA */
#define PS_ISA_AVX512 2   /* AVX-512 F/BW/VL/DQ, with BF16 and VNNI where the CPU has them */

/* KV cache element types. */
#define PS_KV_F32 0
#define PS_KV_BF16 1

typedef struct {
    const void *w;        /* [m, ldw] row-major weights in the layout of wtype */
    const float *scale;   /* PS_W_Q8: [m] dequantisation scale per output row; else NULL */
    const int32_t *wsum;  /* PS_W_Q8: [m] sum of each row's int8 weights (the VNNI path's offset); else NULL */
    const float *bias;    /* [m] (PS_W_F32) or [mp] (packed formats), or NULL */
    int64_t ldw;          /* PS_W_F32: elements between consecutive rows of w; packed: unused */
    int32_t m, k, wtype, reserved;
} ps_linear_t;

/* A linear call's chunks of outputs are shared by the threads of a region through a counter:
 * each thread claims the chunk after the one it holds before computing that one, so it knows
 * where its next weights start and can prefetch them (a chunk is 16-64 rows; without that, each
 * starts with a stall on memory). The counter is 0 before the region, one per call. */
static inline int ps_claim(int32_t *counter) { return __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED); }

/* Prefetch into L2 the first `bytes` of `streams` weight streams, `stride` bytes apart. */
static inline void ps_prefetch_streams(const void *first, int streams, int64_t stride, int bytes) {
    for (int s = 0; s < streams; s++)
        for (int b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)first + s * stride + b, 0, 2);
}

/* Bytes of activation scratch one linear call of n tokens needs (converted/quantised inputs). */
int64_t ps_linear_work_bytes(int wtype, int n, int k);

/* y[t, o] (=|+=) sum_j x[t, j] w[o, j] * scale[o] + bias[o], for t < n, o < m.
 * x is float32 with rows ldx apart; the bfloat16 path rounds x to bfloat16 and the int8 path
 * quantises each row of x to int8 (symmetric, one scale per row) before the dot products.
 * Called by every thread of a parallel region; ends without a barrier. */
void ps_linear_region(const ps_linear_t *L, const float *x, int64_t ldx, int n, float *y, int64_t ldy,
                      int accumulate, void *work, int32_t *claim);

/* The two halves of ps_linear_region, for callers that convert the activations themselves:
 * prep converts rows [t0, t1) of n into work (any thread, any split); compute then reads them
 * (float32 reads x itself) from every thread of a region, taking chunks of outputs from a
 * shared counter (claim: see ps_claim); it ends without a barrier. */
void ps_linear_prep(const ps_linear_t *L, const float *x, int64_t ldx, int t0, int t1, int n, void *work);
void ps_linear_compute(const ps_linear_t *L, const float *x, int64_t ldx, int n, const void *work, float *y,
                       int64_t ldy, int accumulate, int32_t *claim);

/* The instruction-set level the kernels of a weight type use now (the CPU's best unless limited). */
int ps_isa_level(int wtype);

/* out[i, :k] = row ids[i] of a block-format layer's weights, dequantised (embedding lookups). */
int ps_blocks_rows(const ps_linear_t *L, const int64_t *ids, int n, float *out, int64_t ldo);

/* One projection's LoRA adapters, every slot (executor_svc/lora/slots.py): A [slots, rows, in] and
 * B^T [slots, rows, out], float32 or bfloat16 (dtype; scaling folded into B^T). segs [slots,
 * PS_LORA_MAX_SEGS, 4]: per sub-projection of a slot (q/k/v, gate/up) its rank rows [r0, r1) and
 * the outputs [c0, c1) they touch; a segment with r1 == r0 ends the list (an empty slot has none).
 * a NULL: no adapter on this projection. */
typedef struct {
    const void *a, *bt;
    const int32_t *segs;
    int32_t slots, rows, in, out, dtype, reserved;
} ps_lora_t;

#define PS_LORA_F32 0
#define PS_LORA_BF16 1
#define PS_LORA_MAX_ROWS 768 /* three fused sub-projections of rank 256 */
#define PS_LORA_MAX_SEGS 3
#define PS_LORA_TILE 3 /* tokens of one slot computed together (each weight loaded once for them; 4 measured slower) */

/* PS_OK when P (NULL a: no adapter) fits a projection of `in` inputs and `out` outputs and its
 * segments stay inside its tensors; else PS_BAD_ARG. */
int ps_lora_check(const ps_lora_t *P, int in, int out);

/* Cuts the tokens, in `order` (grouped by slot), into tiles of at most PS_LORA_TILE tokens of one
 * slot: tiles[2 i] = first position in order, tiles[2 i + 1] = count; tokens of slot -1 (the base
 * model) get none. Returns the number of tiles (at most n). */
int ps_lora_tiles(const int32_t *token_lora, const int32_t *order, int n, int32_t *tiles);

/* For each of the nt (<= PS_LORA_TILE) tokens: y[tok] += (x[tok] A[slot]^T) B^T[slot] over the
 * slot's segments; x rows ldx apart, y rows ldy apart. A token's sums run in one order whatever
 * else its tile or step holds. */
void ps_lora_tile(const ps_lora_t *P, int slot, const int32_t *tokens, int nt, const float *x, int64_t ldx,
                  float *y, int64_t ldy);

/* One work unit of paged decode attention: sequence row `row` of query/out, KV heads [h0, h1).
 * scratch: ps_decode_scratch_floats() floats of the calling thread. */
int ps_paged_decode_unit(float *out, int64_t o_head, const float *q, int64_t q_head, const void *k_cache,
                         const void *v_cache, int kv_type, const int32_t *table, int seq_len, int max_blocks,
                         int h0, int h1, int num_q_heads, int num_kv_heads, int head_size, int block_size,
                         int64_t num_blocks, float scale, float *scratch);

/* Paged decode attention for sequences [all of them], from inside a parallel region. scratch:
 * this thread's, ps_decode_scratch_floats() floats. */
int ps_paged_decode_region(float *out, int64_t o_row, int64_t o_head, const float *query, int64_t q_row,
                           int64_t q_head, const void *k_cache, const void *v_cache, int kv_type,
                           const int32_t *block_tables, int64_t bt_row, int max_blocks,
                           const int32_t *seq_lens, const int64_t *rows, const int64_t *seqs, int num_seqs,
                           int num_q_heads, int num_kv_heads, int head_size, int block_size,
                           int64_t num_blocks, float scale, float *scratch, int chunks);
int ps_decode_chunks(int num_seqs, int num_kv_heads, int threads);
int64_t ps_decode_scratch_floats(int num_q_heads, int num_kv_heads, int head_size, int block_size, int chunks);

/* Row-wise operations (rowwise_cpu.c), shared by the decode stack and the per-operator path so
 * that both compute a token's activations bit for bit alike. */
/* out = w * (x / sqrt(mean(x^2) + eps)), as transformers' LlamaRMSNorm in float32 (out may be x). */
void ps_rms_norm(const float *x, const float *w, int d, float eps, float *out);
/* cs[i], sn[i] = cos, sin of position * inv_freq[i], for i < half. */
void ps_rope_cos_sin(int64_t position, const float *inv_freq, int half, float *cs, float *sn);
/* x [heads, D] rotated in place ("rotate half", as HF Llama): pairs (d, d + D/2). */
void ps_rope(float *x, int heads, int D, const float *cs, const float *sn);
/* out = SiLU(gate) * up, elementwise over d. */
void ps_silu_mul(const float *gate, const float *up, int d, float *out);

#endif
