/* Linear layers on weights in llama.cpp's 32-element block formats (Q8_0, Q4_0, Q4_1), computed
 * on the blocks: linear_blocks.c (activation quantisation, scalar kernel, dispatch, row
 * lookups) and linear_blocks_x86.c (AVX2, AVX-512 VNNI). Private to those files and the hooks
 * in linear_cpu.c.
 *
 * Packed layout (executor_svc/model/block_weights.py writes it from a GGUF tensor's blocks):
 * rows padded to mp = ceil(m / 64) * 64, inputs to nb = ceil(k / 32) blocks. Panel p holds rows
 * 16p .. 16p + 15; its block b starts at byte (p * nb + b) * PS_BLK_BYTES(wtype):
 *   quants, in 64-byte vectors of 16 rows x 4 bytes: byte v * 64 + r * 4 + g is
 *     Q8_0: the int8 q of row r, input 32b + 4v + g (v < 8);
 *     Q4_*: q(32b + 4v + g) | q(32b + 16 + 4v + g) << 4, unsigned nibbles (v < 4), the pairing
 *           of GGUF's own bytes;
 *   then the 16 rows' scales d (float16), and for Q4_1 their offsets m (float16).
 * A weight is d * q (Q8_0), d * (q - 8) (Q4_0), d * q + m (Q4_1): GGUF's values, unchanged.
 *
 * Activations are quantised per token in blocks of 32, in two 8-bit parts: with d = max|x| / 127
 * and v = x / d, q1 = round(v) and q2 = round((v - q1) * 254), both in [-127, 127], so that
 * x = dx * (254 q1 + q2) with dx = d / 254, to 1/508 of d (one part alone, llama.cpp's Q8_0,
 * errs up to d / 2: on SmolLM2 that alone flipped 3% of the top-1 tokens of float32). Per block
 * s = sum (254 q1 + q2) and dxs = dx * s. A block's integer dot product is exact on every path;
 * it enters the float sum as
 *   acc = fma((float)isum, d_w * dx, acc), then for Q4_1 acc = fma(m, dxs, acc),
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
#define PS_BLK_BYTES(wt) ((wt) == PS_W_Q8_0 ? 544 : (wt) == PS_W_Q4_0 ? 288 : 320)
#define PS_IS_BLOCKS(wt) ((wt) >= PS_W_Q8_0 && (wt) <= PS_W_Q4_1)

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

/* The hooks linear_cpu.c calls for the block formats (same contracts as ps_linear_*). */
int64_t ps_blocks_work_bytes(int n, int k);
void ps_blocks_prep(const ps_linear_t *L, const float *x, int64_t ldx, int t0, int t1, int n, void *work);
void ps_blocks_compute(const ps_linear_t *L, int n, const void *work, float *y, int64_t ldy, int accumulate,
                       int isa);

#endif
