/* Linear layers on Q8_0 / Q4_0 / Q4_1 / Q4_K blocks (layout and arithmetic: linear_blocks.h): the
 * activations' quantisation to blocks of 32, the scalar kernel, the split of a layer into units
 * of 64 rows, and row lookups (a quantised embedding table). The AVX2 and AVX-512 kernels are
 * in linear_blocks_x86.c; linear_cpu.c routes the PS_W_Q* types here.
 *
 * At batch 1 a layer is a matrix-vector product bound by reading its weights, so these formats
 * are there to read fewer bytes: 8.5 (Q8_0), 4.5 (Q4_0), 5 (Q4_1) or 4.6 (Q4_K) bits a weight
 * instead of 16 or 32. The weights are never expanded: each thread streams its units' blocks once per call, with
 * every token of the call (up to 4 at a time, from L1) against each block.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "linear_blocks.h"

#define ALIGN 64

static inline int64_t up64(int64_t v) { return (v + ALIGN - 1) / ALIGN * ALIGN; }
static inline int nblocks(int k) { return (k + PS_BLK - 1) / PS_BLK; }

/* Work area of n tokens: q [n, nb * 64] int8 (q1, q2 of each block), then dx, s, dxs [n, nb]. */
typedef struct {
    int8_t *q;
    float *dx;
    int32_t *s;
    float *dxs;
    int64_t ldq, lds;
} xwork_t;

static xwork_t xwork(void *work, int n, int k) {
    const int nb = nblocks(k);
    const int64_t q = up64((int64_t)n * nb * 2 * PS_BLK), f = up64((int64_t)n * nb * 4);
    char *base = work;
    return (xwork_t){(int8_t *)base, (float *)(base + q), (int32_t *)(base + q + f), (float *)(base + q + 2 * f),
                     (int64_t)nb * 2 * PS_BLK, nb};
}

int64_t ps_blocks_work_bytes(int n, int k) {
    const int nb = nblocks(k);
    return up64((int64_t)n * nb * 2 * PS_BLK) + 3 * up64((int64_t)n * nb * 4);
}

/* One token's row: blocks of 32 (the last padded with zeros), each with its own scale, in two
 * parts (linear_blocks.h). v = x / d is a division and each rounding takes a plain product, so
 * the compiler has no product and add to fuse into a differently rounded fma. rintf rounds half
 * to even (the default rounding mode); |v - q1| <= 1/2 is exact, so |q2| <= 127. */
static void quantize_row(const float *restrict x, int k, int8_t *restrict q, float *dx, int32_t *s, float *dxs) {
    for (int b = 0; b < nblocks(k); b++) {
        const int j0 = b * PS_BLK, len = k - j0 < PS_BLK ? k - j0 : PS_BLK;
        float amax = 0.0f;
        for (int j = 0; j < len; j++) {
            const float a = fabsf(x[j0 + j]);
            amax = a > amax || a != a ? a : amax; /* (a NaN sticks) */
        }
        int8_t *q1 = q + 2 * j0, *q2 = q1 + PS_BLK;
        if (!(amax <= 3.0e38f)) { /* NaN or inf: let it show in the outputs */
            ps_block_nonfinite(q1, dx + b, s + b, dxs + b);
            continue;
        }
        const float d = amax / 127.0f;
        float v[PS_BLK], r1[PS_BLK], r2[PS_BLK];
        for (int j = 0; j < PS_BLK; j++) v[j] = j < len && d > 0.0f ? x[j0 + j] / d : 0.0f;
        for (int j = 0; j < PS_BLK; j++) r1[j] = rintf(v[j]);
        for (int j = 0; j < PS_BLK; j++) r2[j] = rintf((v[j] - r1[j]) * 254.0f);
        int32_t sum = 0;
        for (int j = 0; j < PS_BLK; j++) {
            q1[j] = (int8_t)(int)r1[j];
            q2[j] = (int8_t)(int)r2[j];
            sum += 254 * q1[j] + q2[j];
        }
        ps_block_scales(d, sum, dx + b, s + b, dxs + b);
    }
}

void ps_blocks_prep(const ps_linear_t *L, const float *x, int64_t ldx, int t0, int t1, int n, void *work) {
    const xwork_t w = xwork(work, n, L->k);
    void (*quantize)(const float *, int, int8_t *, float *, int32_t *, float *) = quantize_row;
#if defined(PS_X86) && !defined(PS_SCALAR_PREP) /* (a timed variant's switch: roofline --variant) */
    const int isa = ps_isa_level(L->wtype);
    if (isa == PS_ISA_AVX512) quantize = ps_blocks_quantize_512;
    if (isa == PS_ISA_AVX2) quantize = ps_blocks_quantize_avx2;
#endif
    for (int t = t0; t < t1; t++)
        quantize(x + (int64_t)t * ldx, L->k, w.q + t * w.ldq, w.dx + t * w.lds, w.s + t * w.lds, w.dxs + t * w.lds);
}

/* ------------------------------------------------------------------ scalar kernel */

static inline void store_one(float v, const ps_out_t *o, int t, int row) {
    if (o->bias) v += o->bias[row];
    float *dst = o->y + t * o->ldy + row;
    *dst = o->accumulate ? *dst + v : v;
}

/* Integer dot product of row r of a panel's block with one 32-byte part of the activations. */
static inline int32_t block_dot(int wt, const uint8_t *qb, int r, const int8_t *x) {
    int32_t sum = 0;
    if (wt == PS_W_Q8_0) {
        for (int v = 0; v < 8; v++)
            for (int g = 0; g < 4; g++) sum += (int32_t)(int8_t)qb[v * 64 + r * 4 + g] * x[4 * v + g];
        return sum;
    }
    for (int v = 0; v < 4; v++)
        for (int g = 0; g < 4; g++) {
            const uint8_t byte = qb[v * 64 + r * 4 + g];
            sum += (int32_t)(byte & 15) * x[4 * v + g] + (int32_t)(byte >> 4) * x[16 + 4 * v + g];
        }
    return sum;
}

/* Row r's scale of block b of a panel, and the offset a weight adds (weight = d * q + m; Q4_0:
 * d * (q - 8), m unused). Q4_K: d * sc and -(dmin * mn), both exact. */
static inline void block_dm(int wt, const uint8_t *panel, int b, int r, float *d, float *m) {
    uint16_t h[2];
    if (wt == PS_W_Q4_K) {
        const uint8_t *sb = PS_QK_SUPER_AT(panel, b);
        const int j = b % PS_QK_SUPER;
        memcpy(h, sb + PS_QK_D + 2 * r, 2);
        memcpy(h + 1, sb + PS_QK_DMIN + 2 * r, 2);
        *d = ps_f16(h[0]) * (float)sb[PS_QK_SC + 16 * j + r];
        *m = -(ps_f16(h[1]) * (float)sb[PS_QK_MN + 16 * j + r]);
        return;
    }
    const uint8_t *qb = PS_BLK_Q(wt, panel, b) + PS_BLK_QBYTES(wt);
    memcpy(h, qb + 2 * r, 2);
    memcpy(h + 1, qb + 32 + 2 * r, 2);
    *d = ps_f16(h[0]);
    *m = wt == PS_W_Q4_1 ? ps_f16(h[1]) : 0.0f;
}

static void blocks_unit_scalar(int wt, int T, const ps_xblocks_t *x, const uint8_t *w, int nb, const ps_out_t *out) {
    for (int p = 0; p < 4; p++) {
        const uint8_t *panel = w + p * PS_PANEL_BYTES(wt, nb);
        for (int t = 0; t < T; t++)
            for (int r = 0; r < 16; r++) {
                const int row = out->o0 + p * 16 + r;
                if (row >= out->m) break;
                float acc = 0.0f;
                for (int b = 0; b < nb; b++) {
                    const uint8_t *qb = PS_BLK_Q(wt, panel, b);
                    float d, m;
                    block_dm(wt, panel, b, r, &d, &m);
                    const int64_t xi = t * x->lds + b;
                    const int8_t *xq = x->q + t * x->ldq + b * 2 * PS_BLK;
                    int32_t isum = 254 * block_dot(wt, qb, r, xq) + block_dot(wt, qb, r, xq + PS_BLK);
                    if (wt == PS_W_Q4_0) isum -= 8 * x->s[xi];
                    acc = fmaf((float)isum, d * x->dx[xi], acc);
                    if (wt == PS_W_Q4_1 || wt == PS_W_Q4_K) acc = fmaf(m, x->dxs[xi], acc);
                }
                store_one(acc, out, t, row);
            }
    }
}

/* ------------------------------------------------------------------ a layer */

void ps_blocks_compute(const ps_linear_t *L, int n, const void *work, float *y, int64_t ldy, int accumulate,
                       int isa, int32_t *claim) {
    const int wt = L->wtype, nb = nblocks(L->k);
    const xwork_t xw = xwork((void *)work, n, L->k);
    ps_blocks_unit_fn unit = blocks_unit_scalar;
#ifdef PS_X86
    if (isa == PS_ISA_AVX512) unit = ps_blocks_unit_512;
    else if (isa == PS_ISA_AVX2) unit = ps_blocks_unit_avx2;
#else
    (void)isa;
#endif
    const int64_t unit_bytes = 4 * PS_PANEL_BYTES(wt, nb);
    const int units = (L->m + 63) / 64;
    for (int u = ps_claim(claim), next; u < units; u = next) {
        next = ps_claim(claim);
        if (next < units) /* the next unit's start (its panels are one stream, prefetched ahead as read) */
            ps_prefetch_streams((const uint8_t *)L->w + next * unit_bytes, 1, 0, PS_PF_BYTES);
        const uint8_t *w = (const uint8_t *)L->w + u * unit_bytes;
        for (int t0 = 0; t0 < n; t0 += 4) {
            const int T = n - t0 < 4 ? n - t0 : 4;
            const ps_xblocks_t xb = {xw.q + t0 * xw.ldq, xw.ldq, xw.dx + t0 * xw.lds, xw.s + t0 * xw.lds,
                                     xw.dxs + t0 * xw.lds, xw.lds};
            const ps_out_t out = {y + (int64_t)t0 * ldy, ldy, accumulate, L->m, u * 64, NULL, NULL, L->bias, NULL};
            unit(wt, T, &xb, w, nb, &out);
        }
    }
}

/* ------------------------------------------------------------------ row lookups */

/* out[i, :k] = row ids[i] of the layer's weights as float32 (GGUF's dequantised values: d * q,
 * d * (q - 8), d * q + m, (d * sc) * q - dmin * mn). PS_BAD_ARG for an id outside [0, m). */
int ps_blocks_rows(const ps_linear_t *L, const int64_t *ids, int n, float *out, int64_t ldo) {
    if (!L || !PS_IS_BLOCKS(L->wtype) || !L->w || L->k < 1 || n < 0 || ldo < L->k) return PS_BAD_ARG;
    if (L->wtype == PS_W_Q4_K && L->k % (PS_BLK * PS_QK_SUPER)) return PS_BAD_ARG;
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= L->m) return PS_BAD_ARG;
    const int wt = L->wtype, nb = nblocks(L->k);
    for (int i = 0; i < n; i++) {
        const int64_t id = ids[i], r = id % 16;
        const uint8_t *panel = (const uint8_t *)L->w + (id / 16) * PS_PANEL_BYTES(wt, nb);
        float *o = out + i * ldo;
        for (int b = 0; b < nb; b++) {
            const uint8_t *qb = PS_BLK_Q(wt, panel, b);
            float d, m;
            block_dm(wt, panel, b, (int)r, &d, &m);
            float v[PS_BLK];
            for (int j = 0; j < PS_BLK; j++) {
                const int vi = (j % 16) / 4, g = j % 4;
                if (wt == PS_W_Q8_0) {
                    v[j] = d * (float)(int8_t)qb[(j / 4) * 64 + r * 4 + g];
                    continue;
                }
                const uint8_t byte = qb[vi * 64 + r * 4 + g];
                const int q = j < 16 ? byte & 15 : byte >> 4;
                v[j] = wt == PS_W_Q4_0 ? d * (float)(q - 8) : ps_unfused(d * (float)q) + m;
            }
            const int len = L->k - b * PS_BLK < PS_BLK ? L->k - b * PS_BLK : PS_BLK;
            memcpy(o + b * PS_BLK, v, sizeof(float) * (size_t)len);
        }
    }
    return PS_OK;
}
