/* A whole decode step of a Llama-family decoder stack on CPU in one call: for every layer
 * RMSNorm -> fused q/k/v projection -> rotary embedding -> K/V written to the paged cache ->
 * paged decode attention -> o projection added to the residual -> RMSNorm -> fused gate/up
 * projection -> SiLU(gate) * up -> down projection added to the residual; then the final norm
 * and, when the model descriptor has one, the LM head (every token's logits).
 *
 * Why one call: at batch 1 a step reads every weight once (a few milliseconds at memory
 * bandwidth), and the per-operator cost of running the same layer as ~40 torch operators from
 * Python is of the same order. Here the step is one OpenMP parallel region, and a layer has
 * four barriers, one after each projection and one after attention: for up to PRIVATE_MAX_N
 * tokens every thread computes the norms, SiLU and activation conversions of all tokens itself
 * (a few microseconds) instead of sharing them behind a barrier, and each attention unit applies
 * the rotary embedding and writes the K/V of its own heads before attending. On a machine whose
 * cores the executor shares with the scheduler, a thread the OS preempts stalls the others at
 * the next barrier, so fewer barriers is also steadier.
 *
 * A speculative verification runs here too: a sequence's k + 1 new tokens are k + 1 rows, each a
 * decode query over the sequence's table cut at its own position (store_first, below), so
 * verifying costs a decode step of k + 1 more rows instead of the per-operator path.
 *
 * The norms, rotary and SiLU are rowwise_cpu.c's, the projections linear_cpu.c's and attention
 * paged_decode_cpu.c's, the functions the per-operator path of other steps calls: a token's
 * result does not depend on which path ran it ("What a seed guarantees", docs/ARCHITECTURE.md).
 *
 * Activations, the residual stream, norms, rotary and softmax are float32 whatever the weight
 * type (ps_linear_t); the KV cache is float32 or bfloat16. One query token per sequence: token
 * t belongs to sequence t (row t of block_tables / seq_lens). The caller (executor_svc/
 * model/cpu_decode.py) checks the shapes; this file checks what indexes memory (slots, block
 * ids, lengths) and returns PS_BAD_BLOCK / PS_BAD_LEN instead of touching anything outside.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "ps_cpu.h"

typedef struct {
    ps_linear_t qkv, o, gate_up, down;
    const float *ln1, *ln2; /* [hidden] RMSNorm weights before attention and before the MLP */
    void *k_cache, *v_cache; /* [num_blocks, block_size, num_kv_heads, head_dim] of kv_type */
    ps_lora_t lora_qkv, lora_o, lora_gate_up, lora_down; /* LoRA adapters (a NULL: none) */
} ps_layer_t;

typedef struct {
    int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size, kv_type;
    int64_t num_blocks;
    float eps, attn_scale;
    const ps_layer_t *layers;
    const float *inv_freq;   /* [head_dim / 2] rotary inverse frequencies */
    const float *final_norm; /* [hidden] */
    ps_linear_t lm_head;     /* k = hidden, m = vocab; w NULL: the caller computes the logits */
    /* LoRA: each token's adapter slot [n] (-1: the base model) and the order the tokens' deltas are
     * computed in [n] (grouped by slot: a slot's matrices are read from cache); NULL: no adapters. */
    const int32_t *token_lora, *lora_order;
} ps_model_t;

#define ALIGN_F 16 /* floats: every buffer of the work area starts on a 64-byte boundary */
#define PRIVATE_MAX_N 16 /* tokens up to which each thread converts activations on its own */
#define CLAIM_STRIDE 16 /* int32s between chunk counters: one per 64-byte line, so threads claiming
                         * chunks of one call do not contend for the line of another's counter */

static inline int64_t up(int64_t v) { return (v + ALIGN_F - 1) / ALIGN_F * ALIGN_F; }

/* Linear calls of a step: four per layer and the LM head. */
static inline int64_t claim_count(const ps_model_t *M) { return 4 * (int64_t)M->num_layers + 1; }

typedef struct {
    float *qkv, *att, *gu, *cos, *sin, *attn_scratch, *sets;
    int32_t *lora_tiles; /* [n, 2]: ps_lora_tiles of the step */
    int32_t *claims;     /* the linear calls' chunk counters (ps_linear_compute), CLAIM_STRIDE apart */
    int64_t attn_scratch_floats, set_floats, h_off, act_off, work_off;
    int chunks, private_sets;
} layout_t;

/* Offsets of every buffer in the caller's work area (all floats); returns its size in floats.
 * "sets" are the norm output h [n, hidden], the MLP activation act [n, intermediate] and the
 * linear layers' converted activations: one per thread (private) or one shared. */
static int64_t plan(const ps_model_t *M, int n, int threads, float *base, layout_t *lo) {
    const int64_t qkv_w = (int64_t)(M->num_heads + 2 * M->num_kv_heads) * M->head_dim;
    const int64_t q_w = (int64_t)M->num_heads * M->head_dim;
    int64_t lin = M->lm_head.w ? ps_linear_work_bytes(M->lm_head.wtype, n, M->lm_head.k) : 0;
    for (int l = 0; l < M->num_layers; l++) {
        const ps_linear_t *ls[4] = {&M->layers[l].qkv, &M->layers[l].o, &M->layers[l].gate_up, &M->layers[l].down};
        for (int i = 0; i < 4; i++) {
            const int64_t b = ps_linear_work_bytes(ls[i]->wtype, n, ls[i]->k);
            lin = b > lin ? b : lin;
        }
    }
    lo->chunks = ps_decode_chunks(n, M->num_kv_heads, threads);
    lo->attn_scratch_floats =
        up(ps_decode_scratch_floats(M->num_heads, M->num_kv_heads, M->head_dim, M->block_size, lo->chunks));
    lo->private_sets = n <= PRIVATE_MAX_N;
    lo->h_off = 0;
    lo->act_off = up((int64_t)n * M->hidden);
    lo->work_off = lo->act_off + up((int64_t)n * M->intermediate);
    lo->set_floats = lo->work_off + up((lin + 3) / 4);
    const int64_t sizes[9] = {up(n * qkv_w), up(n * q_w), up((int64_t)n * 2 * M->intermediate),
                              up((int64_t)n * M->head_dim / 2), up((int64_t)n * M->head_dim / 2),
                              lo->attn_scratch_floats * threads, lo->set_floats * (lo->private_sets ? threads : 1),
                              up(2 * (int64_t)n), claim_count(M) * CLAIM_STRIDE};
    float *tiles = NULL, *claims = NULL;
    float **slots[9] = {&lo->qkv, &lo->att, &lo->gu, &lo->cos, &lo->sin, &lo->attn_scratch, &lo->sets, &tiles,
                        &claims};
    int64_t off = 0;
    for (int i = 0; i < 9; i++) {
        if (base) *slots[i] = base + off;
        off += sizes[i];
    }
    lo->lora_tiles = (int32_t *)tiles; /* (int32 and float are both 4 bytes) */
    lo->claims = (int32_t *)claims;
    return off;
}

int64_t ps_stack_work_bytes(const ps_model_t *M, int n, int num_threads) {
    layout_t lo;
    return plan(M, n, num_threads > 0 ? num_threads : 1, NULL, &lo) * (int64_t)sizeof(float);
}

static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40u) : (uint16_t)r;
}

static void store_kv(void *cache, int kv_type, int64_t at, const float *src, int count) {
    if (kv_type == PS_KV_F32) {
        memcpy((float *)cache + at, src, sizeof(float) * (size_t)count);
        return;
    }
    uint16_t *dst = (uint16_t *)cache + at;
    for (int i = 0; i < count; i++) dst[i] = bf16_round(src[i]);
}

static int check_model(const ps_model_t *M) {
    if (!M || M->num_layers < 1 || M->hidden < 1 || M->num_heads < 1 || M->num_kv_heads < 1 ||
        M->num_heads % M->num_kv_heads || M->head_dim < 2 || M->head_dim % 2 || M->intermediate < 1 ||
        M->block_size < 1 || M->num_blocks < 1 || (M->kv_type != PS_KV_F32 && M->kv_type != PS_KV_BF16) ||
        !M->layers || !M->inv_freq || !M->final_norm)
        return PS_BAD_ARG;
    if (M->lm_head.w && (M->lm_head.k != M->hidden || M->lm_head.m < 1)) return PS_BAD_ARG;
    const int qkv = (M->num_heads + 2 * M->num_kv_heads) * M->head_dim, q = M->num_heads * M->head_dim;
    for (int l = 0; l < M->num_layers; l++) {
        const ps_layer_t *L = &M->layers[l];
        if (L->qkv.k != M->hidden || L->qkv.m != qkv || L->o.k != q || L->o.m != M->hidden ||
            L->gate_up.k != M->hidden || L->gate_up.m != 2 * M->intermediate || L->down.k != M->intermediate ||
            L->down.m != M->hidden || !L->ln1 || !L->ln2 || !L->k_cache || !L->v_cache)
            return PS_BAD_ARG;
        if (M->token_lora && (ps_lora_check(&L->lora_qkv, L->qkv.k, L->qkv.m) ||
                              ps_lora_check(&L->lora_o, L->o.k, L->o.m) ||
                              ps_lora_check(&L->lora_gate_up, L->gate_up.k, L->gate_up.m) ||
                              ps_lora_check(&L->lora_down, L->down.k, L->down.m)))
            return PS_BAD_ARG;
    }
    return PS_OK;
}

/* A projection's LoRA deltas, after its outputs are complete (the barrier before): the step's
 * tiles (tokens of one slot, ps_lora_tiles) shared out, with the worksharing loop's barrier at the
 * end. Every thread evaluates the same condition, so all or none enter the loop. */
#define LORA_DELTAS(M, ntiles, tiles, P, xin, ldx, yout, ldy)                                          \
    do {                                                                                               \
        if ((ntiles) > 0 && (P).a) {                                                                   \
            _Pragma("omp for schedule(static)") for (int k_ = 0; k_ < (ntiles); k_++) {                 \
                const int32_t *toks_ = (M)->lora_order + (tiles)[2 * k_];                               \
                ps_lora_tile(&(P), (M)->token_lora[toks_[0]], toks_, (tiles)[2 * k_ + 1], (xin), (ldx),  \
                             (yout), (ldy));                                                           \
            }                                                                                          \
        }                                                                                              \
    } while (0)

/* Token loops of a stage: every thread over all tokens (private sets: no barrier), or the
 * tokens shared out (one set) with the worksharing loop's barrier at the end. */
#define FOR_TOKENS(priv, n, t, body)                                                  \
    do {                                                                              \
        if (priv) {                                                                   \
            for (int t = 0; t < (n); t++) body                                        \
        } else {                                                                      \
            _Pragma("omp for schedule(static)") for (int t = 0; t < (n); t++) body    \
        }                                                                             \
    } while (0)

/* Rotary and K/V store for KV heads [h0, h1) of token i. */
static void rope_store_unit(const ps_model_t *M, const ps_layer_t *L, const layout_t *lo, int i, int h0, int h1,
                            const int64_t *slots) {
    const int D = M->head_dim, half = D / 2, G = M->num_heads / M->num_kv_heads;
    const int q_w = M->num_heads * D, kv_w = M->num_kv_heads * D, qkv_w = q_w + 2 * kv_w;
    float *row = lo->qkv + (int64_t)i * qkv_w;
    const float *cs = lo->cos + (int64_t)i * half, *sn = lo->sin + (int64_t)i * half;
    ps_rope(row + (int64_t)h0 * G * D, (h1 - h0) * G, D, cs, sn);
    ps_rope(row + q_w + (int64_t)h0 * D, h1 - h0, D, cs, sn);
    if (slots[i] >= 0) {
        const int64_t at = slots[i] * kv_w + (int64_t)h0 * D;
        store_kv(L->k_cache, M->kv_type, at, row + q_w + (int64_t)h0 * D, (h1 - h0) * D);
        store_kv(L->v_cache, M->kv_type, at, row + q_w + kv_w + (int64_t)h0 * D, (h1 - h0) * D);
    }
}

/* Attention of KV heads [h0, h1) of token i over its table cut at seq_lens[i]. */
static int attend_unit(const ps_model_t *M, const ps_layer_t *L, const layout_t *lo, int i, int h0, int h1,
                       const int32_t *block_tables, int64_t bt_row, int max_blocks, const int32_t *seq_lens,
                       float *scratch) {
    const int D = M->head_dim, q_w = M->num_heads * D, qkv_w = q_w + 2 * M->num_kv_heads * D;
    return ps_paged_decode_unit(lo->att + (int64_t)i * q_w, D, lo->qkv + (int64_t)i * qkv_w, D, L->k_cache,
                                L->v_cache, M->kv_type, block_tables + (int64_t)i * bt_row, seq_lens[i], max_blocks,
                                h0, h1, M->num_heads, M->num_kv_heads, D, M->block_size, M->num_blocks,
                                M->attn_scale, scratch);
}

/* x [n, hidden]: the tokens' embeddings in, the final-normed hidden states out. positions [n]
 * (rotary), slots [n] (cache slot of each new K/V; < 0: not written), block_tables
 * [n, bt_row] with max_blocks valid columns, seq_lens [n] (context including the new token).
 * logits [n, lm_head.m]: written when the model has an LM head (else may be NULL).
 * store_first: some rows read K/V that other rows of the step write (several new tokens of one
 * sequence, as a speculative verification has: each row its own decode query over its table cut
 * at its position). Then every row's K/V is stored before any row attends, one barrier more per
 * layer; otherwise each unit stores and attends at once. The arithmetic is the same either way. */
int ps_decode_stack(const ps_model_t *M, float *x, int n, const int64_t *positions, const int64_t *slots,
                    const int32_t *block_tables, int64_t bt_row, int max_blocks, const int32_t *seq_lens,
                    float *logits, void *work, int64_t work_bytes, int num_threads, int store_first) {
    const int threads = num_threads > 0 ? num_threads : 1;
    if (check_model(M) != PS_OK || n < 0 || (M->lm_head.w && !logits)) return PS_BAD_ARG;
    if (work_bytes < ps_stack_work_bytes(M, n, threads)) return PS_NO_MEMORY;
    if (n == 0) return PS_OK;
    const int64_t total_slots = M->num_blocks * M->block_size;
    for (int t = 0; t < n; t++)
        if (slots[t] >= total_slots) return PS_BAD_BLOCK;
    if (M->token_lora && !M->lora_order) return PS_BAD_ARG;
    if (M->token_lora)
        for (int k = 0; k < n; k++)
            if (M->lora_order[k] < 0 || M->lora_order[k] >= n) return PS_BAD_ARG;
    layout_t lo;
    plan(M, n, threads, work, &lo);
    memset(lo.claims, 0, sizeof(int32_t) * CLAIM_STRIDE * (size_t)claim_count(M));
    const int ntiles = M->token_lora ? ps_lora_tiles(M->token_lora, M->lora_order, n, lo.lora_tiles) : 0;
    const int32_t *tiles = lo.lora_tiles;
    const int H = M->hidden, D = M->head_dim, half = D / 2, I = M->intermediate, priv = lo.private_sets;
    const int q_w = M->num_heads * D, qkv_w = q_w + 2 * M->num_kv_heads * D;
    const int chunks = lo.chunks, per_chunk = (M->num_kv_heads + chunks - 1) / chunks;
    int status = PS_OK;
#pragma omp parallel num_threads(threads)
    {
        const int tid = PS_TID();
        float *scratch = lo.attn_scratch + lo.attn_scratch_floats * tid;
        float *set = lo.sets + (priv ? lo.set_floats * tid : 0);
        float *h = set + lo.h_off, *act = set + lo.act_off;
        void *lw = set + lo.work_off;
        int mine = PS_OK;
#pragma omp for schedule(static)
        for (int t = 0; t < n; t++)
            ps_rope_cos_sin(positions[t], M->inv_freq, half, lo.cos + (int64_t)t * half, lo.sin + (int64_t)t * half);
        for (int l = 0; l < M->num_layers; l++) {
            const ps_layer_t *L = &M->layers[l];
            int32_t *claim = lo.claims + 4 * CLAIM_STRIDE * l; /* this layer's four counters */
            FOR_TOKENS(priv, n, t, {
                ps_rms_norm(x + (int64_t)t * H, L->ln1, H, M->eps, h + (int64_t)t * H);
                ps_linear_prep(&L->qkv, h, H, t, t + 1, n, lw);
            });
            ps_linear_compute(&L->qkv, h, H, n, lw, lo.qkv, qkv_w, 0, claim);
#pragma omp barrier
            LORA_DELTAS(M, ntiles, tiles, L->lora_qkv, h, H, lo.qkv, qkv_w);
            if (store_first) {
#pragma omp for schedule(static)
                for (int64_t u = 0; u < (int64_t)n * chunks; u++) {
                    const int i = (int)(u / chunks), h0 = (int)(u % chunks) * per_chunk;
                    rope_store_unit(M, L, &lo, i, h0, h0 + per_chunk < M->num_kv_heads ? h0 + per_chunk
                                                                                       : M->num_kv_heads, slots);
                }  /* (the worksharing loop's barrier: every K/V stored before any row attends) */
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t u = 0; u < (int64_t)n * chunks; u++) {
                const int i = (int)(u / chunks), h0 = (int)(u % chunks) * per_chunk;
                const int h1 = h0 + per_chunk < M->num_kv_heads ? h0 + per_chunk : M->num_kv_heads;
                if (!store_first) rope_store_unit(M, L, &lo, i, h0, h1, slots);
                const int st = attend_unit(M, L, &lo, i, h0, h1, block_tables, bt_row, max_blocks, seq_lens, scratch);
                mine = mine != PS_OK ? mine : st;
            }
            FOR_TOKENS(priv, n, t, { ps_linear_prep(&L->o, lo.att, q_w, t, t + 1, n, lw); });
            ps_linear_compute(&L->o, lo.att, q_w, n, lw, x, H, 1, claim + CLAIM_STRIDE);
#pragma omp barrier
            LORA_DELTAS(M, ntiles, tiles, L->lora_o, lo.att, q_w, x, H);
            FOR_TOKENS(priv, n, t, {
                ps_rms_norm(x + (int64_t)t * H, L->ln2, H, M->eps, h + (int64_t)t * H);
                ps_linear_prep(&L->gate_up, h, H, t, t + 1, n, lw);
            });
            ps_linear_compute(&L->gate_up, h, H, n, lw, lo.gu, 2 * I, 0, claim + 2 * CLAIM_STRIDE);
#pragma omp barrier
            LORA_DELTAS(M, ntiles, tiles, L->lora_gate_up, h, H, lo.gu, 2 * I);
            FOR_TOKENS(priv, n, t, {
                ps_silu_mul(lo.gu + (int64_t)t * 2 * I, lo.gu + (int64_t)t * 2 * I + I, I, act + (int64_t)t * I);
                ps_linear_prep(&L->down, act, I, t, t + 1, n, lw);
            });
            ps_linear_compute(&L->down, act, I, n, lw, x, H, 1, claim + 3 * CLAIM_STRIDE);
#pragma omp barrier
            LORA_DELTAS(M, ntiles, tiles, L->lora_down, act, I, x, H);
        }
#pragma omp for schedule(static)
        for (int t = 0; t < n; t++) ps_rms_norm(x + (int64_t)t * H, M->final_norm, H, M->eps, x + (int64_t)t * H);
        if (M->lm_head.w) {
            FOR_TOKENS(priv, n, t, { ps_linear_prep(&M->lm_head, x, H, t, t + 1, n, lw); });
            ps_linear_compute(&M->lm_head, x, H, n, lw, logits, M->lm_head.m, 0,
                              lo.claims + 4 * CLAIM_STRIDE * (int64_t)M->num_layers);
        }
        if (mine != PS_OK) {
#pragma omp critical
            if (status == PS_OK) status = mine;
        }
    }
    return status;
}
