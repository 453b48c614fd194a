/* The inner kernels of linear_cpu.c, by instruction set (scalar in linear_cpu.c, AVX2 and
 * AVX-512 in linear_x86.c). Private to those two files. */
#ifndef PS_LINEAR_TILES_H
#define PS_LINEAR_TILES_H

#include <stdint.h>

#include "ps_cpu.h"

#define PS_PF_BYTES 1024 /* software prefetch distance along a weight stream */

/* float32 row-major, dot-product form: res[t * 4 + r] = x row t . w row r, for T <= 4 tokens
 * and 4 rows; `ahead` elements past each row pointer is the matching row of the next tile
 * (prefetched while this one is computed). */
typedef void (*ps_f32_tile_fn)(int T, const float *x, int64_t ldx, const float *const *w, int64_t ahead, int k,
                               float *res);

/* Where a packed unit (64 outputs: 4 panels of 16) writes T tokens' results. */
typedef struct {
    float *y;            /* row of the unit's first token */
    int64_t ldy;
    int accumulate;      /* add to y instead of overwriting it */
    int m, o0;           /* outputs in the layer; the unit's first output */
    const float *scale;  /* int8: [mp] */
    const int32_t *wsum; /* int8: [mp] */
    const float *bias;   /* [mp] or NULL */
    const float *sx;     /* int8: the activation scale of each of the T tokens */
} ps_out_t;

/* A packed unit: w points at its first panel, panels pstride elements apart, kp inputs.
 * x: the converted activations (see linear_cpu.c, prep_*) of T tokens, rows ldx elements apart. */
typedef void (*ps_unit_fn)(int T, const void *x, int64_t ldx, const void *w, int64_t pstride, int kp,
                           const ps_out_t *out);

#ifdef PS_X86
void ps_f32_tile_avx2(int T, const float *x, int64_t ldx, const float *const *w, int64_t ahead, int k, float *res);
void ps_f32_tile_512(int T, const float *x, int64_t ldx, const float *const *w, int64_t ahead, int k, float *res);
void ps_f32_tile6_512(const float *x, int64_t ldx, const float *const *w, int k, float *res); /* 6 tokens */
void ps_bf16_unit_avx2(int T, const void *x, int64_t ldx, const void *w, int64_t pstride, int kp, const ps_out_t *out);
void ps_bf16_unit_512(int T, const void *x, int64_t ldx, const void *w, int64_t pstride, int kp, const ps_out_t *out);
void ps_q8_unit_avx2(int T, const void *x, int64_t ldx, const void *w, int64_t pstride, int kp, const ps_out_t *out);
void ps_q8_unit_512(int T, const void *x, int64_t ldx, const void *w, int64_t pstride, int kp, const ps_out_t *out);
#define PS_UNIT_T_512 4  /* tokens per AVX-512 unit call: 16 accumulators (6 spilled registers and ran slower) */
#define PS_UNIT_T_AVX2 4
#endif
#define PS_UNIT_T_SCALAR 4

#endif
