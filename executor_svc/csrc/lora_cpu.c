/* LoRA deltas on CPU: what the fused decode stack adds after each projection of a step whose
 * tokens run under adapters (decode_stack_cpu.c). A decode step holds a few tokens per adapter:
 * the tokens are cut into tiles of up to PS_LORA_TILE tokens of one slot (ps_lora_tiles), and a
 * tile's deltas are two passes over its slot's A and B^T, each weight loaded once for all the
 * tile's tokens: u[t] = A x[t] (rank-sized), then y[t] += u[t] B^T, sub-projection by
 * sub-projection (a fused q/k/v or gate/up slot is block-diagonal: each sub's rank rows touch only
 * its own output columns, so the zeros between are never read). The slot tensors are float32 or
 * bfloat16 (half the bytes; widened exactly to float32 as they are read); sums are float32.
 *
 * Each token's sums run in one fixed order whatever its tile holds: 16 partial sums (vector lanes)
 * added in one order at the end for a dot product, the rank rows one after another for the
 * output, so a token's delta does not depend on the other tokens of its step. The compiler
 * vectorises the fixed-width lane loops (AVX-512, AVX2 or SSE: the build's -march, or the clones
 * of a portable build picked at load time); nothing is reassociated. */
#include <stdint.h>
#include <string.h>

#include "ps_cpu.h"

#define LANES 16
#if PS_LORA_TILE != 3
#error "ps_lora_tile's cases are written for PS_LORA_TILE 3"
#endif
#define INLINE static inline __attribute__((always_inline))

/* 16 floats: GCC/clang lower these to one AVX-512 register, two AVX2 or four SSE ones, whichever
 * the build (or the clone running) targets. */
typedef float v16 __attribute__((vector_size(4 * LANES)));
typedef uint16_t h16 __attribute__((vector_size(2 * LANES)));
typedef uint32_t w16 __attribute__((vector_size(4 * LANES)));

INLINE v16 load_f32(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* 16 slot weights from element i on, widened to float32 when bfloat16 (exact: the upper half). */
INLINE v16 load_w(const void *p, int64_t i, int bf16) {
    if (!bf16) return load_f32((const float *)p + i);
    h16 h;
    memcpy(&h, (const uint16_t *)p + i, sizeof h);
    const w16 bits = __builtin_convertvector(h, w16) << 16;
    v16 v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

INLINE float widen(const void *p, int64_t i, int bf16) {
    if (!bf16) return ((const float *)p)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* u[t][r] = A[r] . x[t] for r < used, t < NT (NT and bf16 constants after inlining): lane j of
 * token t sums elements j, j + 16, ... in order (the tail's into lanes 0, 1, ...), then the lanes
 * are added 0 to 15. */
INLINE void tile_dots(const void *A, int bf16, int in, int used, const float *const *x, const int NT,
                      float (*u)[PS_LORA_MAX_ROWS]) {
    for (int r = 0; r < used; r++) {
        const int64_t row = (int64_t)r * in;
        v16 acc[PS_LORA_TILE];
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) acc[t] = (v16){0};
        int i = 0;
        for (; i + LANES <= in; i += LANES) {
            const v16 a = load_w(A, row + i, bf16);
#pragma GCC unroll 4
            for (int t = 0; t < NT; t++) acc[t] += a * load_f32(x[t] + i);
        }
        for (int t = 0; t < NT; t++) {
            float lanes[LANES];
            memcpy(lanes, &acc[t], sizeof lanes);
            for (int k = i, j = 0; k < in; k++, j++) lanes[j] += widen(A, row + k, bf16) * x[t][k];
            float s = 0.0f;
            for (int j = 0; j < LANES; j++) s += lanes[j];
            u[t][r] = s;
        }
    }
}

/* y[t][c0:c1] += sum over r in [r0, r1) of u[t][r] B^T[r][c0:c1], r in order. */
INLINE void tile_outputs(const void *Bt, int bf16, int out, int r0, int r1, int c0, int c1,
                         float (*u)[PS_LORA_MAX_ROWS], float *const *y, const int NT) {
    int c = c0;
    for (; c + LANES <= c1; c += LANES) {
        v16 acc[PS_LORA_TILE];
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) acc[t] = load_f32(y[t] + c);
        for (int r = r0; r < r1; r++) {
            const v16 b = load_w(Bt, (int64_t)r * out + c, bf16);
#pragma GCC unroll 4
            for (int t = 0; t < NT; t++) acc[t] += u[t][r] * b;
        }
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) memcpy(y[t] + c, &acc[t], sizeof acc[t]);
    }
    for (; c < c1; c++)
        for (int t = 0; t < NT; t++) {
            float v = y[t][c];
            for (int r = r0; r < r1; r++) v += u[t][r] * widen(Bt, (int64_t)r * out + c, bf16);
            y[t][c] = v;
        }
}

INLINE void tile(const ps_lora_t *P, int slot, const float *const *x, float *const *y, const int NT,
                 const int bf16) {
    const int32_t *seg = P->segs + (int64_t)slot * PS_LORA_MAX_SEGS * 4;
    const int esize = bf16 ? 2 : 4;
    const char *A = (const char *)P->a + (int64_t)slot * P->rows * P->in * esize;
    const char *Bt = (const char *)P->bt + (int64_t)slot * P->rows * P->out * esize;
    int used = 0;
    for (int s = 0; s < PS_LORA_MAX_SEGS && seg[4 * s + 1] > seg[4 * s]; s++)
        used = seg[4 * s + 1] > used ? seg[4 * s + 1] : used; /* (every segment's rows get their u) */
    float u[PS_LORA_TILE][PS_LORA_MAX_ROWS];
    tile_dots(A, bf16, P->in, used, x, NT, u);
    for (int s = 0; s < PS_LORA_MAX_SEGS && seg[4 * s + 1] > seg[4 * s]; s++)
        tile_outputs(Bt, bf16, P->out, seg[4 * s], seg[4 * s + 1], seg[4 * s + 2], seg[4 * s + 3], u, y, NT);
}

#define TILE_CASES(BF)                                  \
    switch (nt) {                                       \
    case 1: tile(P, slot, xs, ys, 1, BF); break;        \
    case 2: tile(P, slot, xs, ys, 2, BF); break;        \
    default: tile(P, slot, xs, ys, 3, BF);              \
    }

int ps_lora_check(const ps_lora_t *P, int in, int out) {
    if (!P->a) return PS_OK;
    if (!P->bt || !P->segs || P->slots < 1 || P->rows < 1 || P->rows > PS_LORA_MAX_ROWS || P->in != in ||
        P->out != out || (P->dtype != PS_LORA_F32 && P->dtype != PS_LORA_BF16))
        return PS_BAD_ARG;
    for (int64_t k = 0; k < (int64_t)P->slots * PS_LORA_MAX_SEGS; k++) {
        const int32_t *g = P->segs + 4 * k;
        if (g[1] == g[0]) continue;
        if (g[0] < 0 || g[1] < g[0] || g[1] > P->rows || g[2] < 0 || g[3] <= g[2] || g[3] > out) return PS_BAD_ARG;
    }
    return PS_OK;
}

PS_CLONES void ps_lora_tile(const ps_lora_t *P, int slot, const int32_t *tokens, int nt, const float *x,
                            int64_t ldx, float *y, int64_t ldy) {
    if (!P->a || slot < 0 || slot >= P->slots || nt < 1 || nt > PS_LORA_TILE) return;
    const float *xs[PS_LORA_TILE];
    float *ys[PS_LORA_TILE];
    for (int t = 0; t < nt; t++) {
        xs[t] = x + (int64_t)tokens[t] * ldx;
        ys[t] = y + (int64_t)tokens[t] * ldy;
    }
    if (P->dtype == PS_LORA_BF16) {
        TILE_CASES(1)
    } else {
        TILE_CASES(0)
    }
}

int ps_lora_tiles(const int32_t *token_lora, const int32_t *order, int n, int32_t *tiles) {
    int count = 0;
    for (int k = 0; k < n;) {
        const int slot = token_lora[order[k]];
        int end = k + 1;
        while (end < n && end - k < PS_LORA_TILE && token_lora[order[end]] == slot) end++;
        if (slot >= 0) {
            tiles[2 * count] = k;
            tiles[2 * count + 1] = end - k;
            count++;
        }
        k = end;
    }
    return count;
}
