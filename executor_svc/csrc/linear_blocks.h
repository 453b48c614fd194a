/* Linear layers on weights in llama.cpp's block formats (Q8_0, Q4_0, Q4_1 of 32 inputs; Q4_K of
 * 256), computed on the blocks: linear_blocks.c (activation quantisation, scalar kernel,
 * dispatch, row lookups) and linear_blocks_x86.c (AVX2, AVX-512 VNNI). Private to those files
 * and the hooks in linear_cpu.c.
 *
 * Packed layout (executor_svc/model/block_weights.py writes it from a GGUF tensor's blocks):
 * rows padded to mp = ceil(m / 64) * 64, inputs to nb = ceil(k / 32) blocks. Panel p holds rows
 * 16p .. 16p + 15, PS_PANEL_BYTES(wtype, nb) bytes from p * PS_PANEL_BYTES. Block b of a panel:
 *   quants at PS_BLK_Q(wtype, panel, b), in 64-byte vectors of 16 rows x 4 bytes: byte
 *   v * 64 + r * 4 + g is
 *     Q8_0: the int8 q of row r, input 32b + 4v + g (v < 8);
 *     Q4_*: q(32b + 4v + g) | q(32b + 16 + 4v + g) << 4, unsigned nibbles (v < 4), the pairing
 *           of Q4_0/Q4_1's own bytes;
 *   Q8_0, Q4_0, Q4_1: the quants are followed by the 16 rows' scales d (float16), and for Q4_1
 *     their offsets m (float16): a block is PS_BLK_BYTES.
 *   Q4_K: 8 blocks form a super-block (k a multiple of 256): their 8 x 256 bytes of quants, then
 *     per block the 16 rows' 6-bit scales sc (uint8, 8 x 16 bytes), then their 6-bit offsets mn
 *     (8 x 16), then the rows' super-block scales d and dmin (float16, 16 each): 2,368 bytes for
 *     16 x 256 weights (GGUF's Q4_K: 2,304).
 * A weight is d * q (Q8_0), d * (q - 8) (Q4_0), d * q + m (Q4_1), (d * sc) * q - dmin * mn (Q4_K):
 * GGUF's values, unchanged (d * sc and dmin * mn are exact in float32: 11 by 6 bits).
 *
 * Activations are quantised per token in blocks of 32, in two 8-bit parts: with d = max|x| / 127
 * and v = x / d, q1 = round(v) and q2 = round((v - q1) * 254), both in [-127, 127], so that
 * x = dx * (254 q1 + q2) with dx = d / 254, to 1/508 of d (one part alone, llama.cpp's Q8_0,
 * errs up to d / 2: on SmolLM2 that alone flipped 3% of the top-1 tokens of float32). Per block
 * s = sum (254 q1 + q2) and dxs = dx * s. A block's integer dot product is exact on every path;
 * it enters the float sum as
 *   acc = fma((float)isum, d_w * dx, acc), then for Q4_1 acc = fma(m, dxs, acc)
 *   (Q4_K: d_w = d * sc, then acc = fma(-(dmin * mn), dxs, acc)),
 * block after block in order (isum = sum w_q (254 q1 + q2), Q4_0's -8 and Q8_0 VNNI's +128
 * removed with s), so
 * every instruction set, thread count and batch composition gives the same bits. */
#ifndef PS_LINEAR_BLOCKS_H
#define PS_LINEAR_BLOCKS_H

#include <stdint.h>

#include "linear_tiles.h"
#include "ps_cpu.h"

#define PS_BLK 32
#define PS_BLK_QBYTES(wt) ((wt) == PS_W_Q8_0 ? 512 : 256)
/* (Q8_0, Q4_0, Q4_1: a block with its scales) */
#define PS_BLK_BYTES(wt) ((wt) == PS_W_Q8_0 ? 544 : (wt) == PS_W_Q4_0 ? 288 : 320)
#define PS_IS_BLOCKS(wt) ((wt) >= PS_W_Q8_0 && (wt) <= PS_W_Q4_K)
#define PS_QK_SUPER 8     /* Q4_K: blocks per super-block */
#define PS_QK_BYTES 2368  /* Q4_K: a panel's super-block */
#define PS_QK_SC (8 * 256)
#define PS_QK_MN (PS_QK_SC + 8 * 16)
#define PS_QK_D (PS_QK_MN + 8 * 16)
#define PS_QK_DMIN (PS_QK_D + 32)
#define PS_PANEL_BYTES(wt, nb) \
    ((wt) == PS_W_Q4_K ? (int64_t)((nb) / PS_QK_SUPER) * PS_QK_BYTES : (int64_t)(nb) * PS_BLK_BYTES(wt))
/* Block b of a panel: its quants, and (Q4_K) its super-block. */
#define PS_QK_SUPER_AT(panel, b) ((panel) + (int64_t)((b) / PS_QK_SUPER) * PS_QK_BYTES)
#define PS_BLK_Q(wt, panel, b) \
    ((wt) == PS_W_Q4_K ? PS_QK_SUPER_AT(panel, b) + ((b) % PS_QK_SUPER) * 256 : (panel) + (int64_t)(b) * PS_BLK_BYTES(wt))

/* The quantised activations of tokens t0 .. t0 + T - 1: row t's block b at q + t * ldq + 64 b
 * (q1 then q2, 32 bytes each), its dx, s, dxs at dx/s/dxs + t * lds + b. */
typedef struct {
    const int8_t *q;
    int64_t ldq;
    const float *dx;
    const int32_t *s;
    const float *dxs;
    int64_t lds;
} ps_xblocks_t;

/* One unit (64 rows: 4 panels) of a block-format layer for T <= 4 tokens; w at its first panel;
 * results (+ bias) stored or added through out (ps_out_t of linear_tiles.h: y, ldy, accumulate,
 * m, o0, bias). */
typedef void (*ps_blocks_unit_fn)(int wtype, int T, const ps_xblocks_t *x, const uint8_t *w, int nb,
                                  const ps_out_t *out);

#ifdef PS_X86
void ps_blocks_unit_avx2(int wtype, int T, const ps_xblocks_t *x, const uint8_t *w, int nb, const ps_out_t *out);
void ps_blocks_unit_512(int wtype, int T, const ps_xblocks_t *x, const uint8_t *w, int nb, const ps_out_t *out);
/* One token's row of k activations quantised (linear_blocks.c's quantize_row, the same bytes):
 * q [nb * 64] (q1, q2 of each block), dx, s, dxs [nb]. */
void ps_blocks_quantize_avx2(const float *x, int k, int8_t *q, float *dx, int32_t *s, float *dxs);
void ps_blocks_quantize_512(const float *x, int k, int8_t *q, float *dx, int32_t *s, float *dxs);
#endif

/* float16 bits -> float (exact for every value). */
static inline float ps_f16(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1f) bits = sign | 0x7f800000u | (man << 13);  /* inf, NaN */
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) bits = sign;
    else { /* subnormal: normalise */
        int e = -1;
        uint32_t mm = man;
        do { mm <<= 1; e++; } while (!(mm & 0x400u));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((mm & 0x3ffu) << 13);
    }
    float f;
    __builtin_memcpy(&f, &bits, sizeof f);
    return f;
}

/* v as rounded: keeps the compiler from fusing the product v into a following add (GCC's
 * default -ffp-contract=fast would), so a result matches the reference's two roundings. */
static inline float ps_unfused(float v) {
#if defined(__GNUC__) && defined(__x86_64__)
    __asm__("" : "+x"(v));
    return v;
#else
    volatile float keep = v;
    return keep;
#endif
}

/* A block of activations holding NaN or inf, or a finite value past 3e38 (the quantisers' rule):
 * quants 0 and NaN scales, so that the value shows in every output it reaches. */
static inline void ps_block_nonfinite(int8_t *q1, float *dx, int32_t *s, float *dxs) {
    __builtin_memset(q1, 0, 2 * PS_BLK);
    *dx = *dxs = __builtin_nanf("");
    *s = 0;
}

/* A quantised block's scales from its step d (amax / 127) and the integer sum of 254 q1 + q2. */
static inline void ps_block_scales(float d, int32_t sum, float *dx, int32_t *s, float *dxs) {
    *dx = d / 254.0f;
    *s = sum;
    *dxs = *dx * (float)sum;
}

/* The hooks linear_cpu.c calls for the block formats (same contracts as ps_linear_*). */
int64_t ps_blocks_work_bytes(int n, int k);
void ps_blocks_prep(const ps_linear_t *L, const float *x, int64_t ldx, int t0, int t1, int n, void *work);
void ps_blocks_compute(const ps_linear_t *L, int n, const void *work, float *y, int64_t ldy, int accumulate,
                       int isa, int32_t *claim);

#endif
