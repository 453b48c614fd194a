/* LoRA deltas on CPU, one token at a time: what the fused decode stack adds after each projection
 * of a step whose tokens run under adapters (decode_stack_cpu.c). A decode step holds a few tokens
 * per adapter, so a token's delta is two matrix-vector products over its slot's A and B^T, both
 * read once per token from cache when the caller orders the tokens by slot.
 *
 * The dot products keep 16 partial sums (vector lanes) added in one fixed order at the end: the
 * compiler vectorises them without reassociating, and a token's delta does not depend on the
 * other tokens of its step. */
#include <stdint.h>

#include "ps_cpu.h"

PS_CLONES static float dot(const float *a, const float *x, int k) {
    float acc[16] = {0};
    int i = 0;
    for (; i + 16 <= k; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += a[i + j] * x[i + j];
    for (int j = 0; i < k; i++, j++) acc[j] += a[i] * x[i];
    float s = 0.0f;
    for (int j = 0; j < 16; j++) s += acc[j];
    return s;
}

PS_CLONES static void axpy(float *y, const float *b, float u, int n) {
    for (int c = 0; c < n; c++) y[c] += u * b[c];
}

void ps_lora_token(const ps_lora_t *P, int slot, const float *x, float *y) {
    if (!P->a || slot < 0 || slot >= P->slots) return;
    const int used = P->used[slot], lo = P->lo[slot], hi = P->hi[slot];
    if (used <= 0 || used > P->rows || used > PS_LORA_MAX_ROWS || lo < 0 || hi > P->out || lo >= hi) return;
    const float *A = P->a + (int64_t)slot * P->rows * P->in;
    const float *Bt = P->bt + (int64_t)slot * P->rows * P->out;
    float u[PS_LORA_MAX_ROWS];
    for (int r = 0; r < used; r++) u[r] = dot(A + (int64_t)r * P->in, x, P->in);
    for (int r = 0; r < used; r++) axpy(y + lo, Bt + (int64_t)r * P->out + lo, u[r], hi - lo);
}
