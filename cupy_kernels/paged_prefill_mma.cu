// Paged prefill attention on the tensor cores (f16 / bf16; FlashAttention-2's loop structure).
//
// Same problem and arguments as ps_paged_prefill (paged_prefill.cu): query token i of a sequence
// with context L and q new tokens sits at position L - q + i and attends causally to positions
// 0 .. L - q + i, read from the paged cache through the block table.
//
// Grid (num_kv_heads * q_per_kv / G, num_seqs, cdiv(max_query_len, QT)), 128 threads = 4 warps.
// A thread block owns ROWS = 64 (query token, q head) rows of one KV head, QT tokens x G heads
// (row r = token r / G, head r % G: the group shares every K/V tile); warp w owns rows 16w..16w+15,
// one m16 tile. Q stays in registers as mma A fragments (unscaled: the scores are scaled in
// float32, so Q is never rounded twice). The block walks the context in KT = 64-token tiles of K
// and V staged in shared memory; per tile each warp computes S = Q K^T with m16n8k16 mma (f32
// accumulators), keeps an online softmax in registers (exp2, scale * log2(e) applied to S), turns
// P into f16/bf16 A fragments in registers (the S accumulator layout is the A layout of the next
// product) and accumulates O += P V with mma. Causal masking only on the tiles that reach a row's
// position; a warp skips the tiles and 8/16-token slices past its last row. The row sum l is kept
// per lane (its columns only) and reduced over the 4 lanes of a row once, before O / l.
//
// PIPE (the "mma_pipe" kernel): two shared-memory stages; the next K/V tile is fetched with cp.async
// while the warps compute on this one, as FlashAttention-2 does. Two stages of 64-token tiles fit the
// 48 KB of static shared memory only up to head 80, so larger heads pipeline 32-token tiles.
#include "common.cuh"

#define PS_MMA_THREADS 128
#ifndef PS_MMA_MIN_BLOCKS
#define PS_MMA_MIN_BLOCKS 2
#endif

namespace ps {

template <int HEAD, int G, int QT, bool PIPE>
struct MmaPrefillShape {
  static constexpr int NW = PS_MMA_THREADS / kWarp;
  static constexpr int ROWS = 16 * NW;        // one m16 tile per warp
  static constexpr int STAGES = PIPE ? 2 : 1;
  // context tokens per K/V tile: 64, unless two stages of them overflow static shared memory
  static constexpr int KT = STAGES * 2 * 64 * (HEAD + 8) * 2 <= 48 * 1024 ? 64 : 32;
  static constexpr int KSTEPS = HEAD / 16;    // k16 steps of Q K^T
  static constexpr int NT = KT / 8;           // n8 tiles of S
  static constexpr int DT = HEAD / 8;         // n8 tiles of O
  static constexpr int STRIDE = HEAD + 8;     // padded smem row (elements): conflict-free fragment loads
  static constexpr int CHUNKS = HEAD / 8;     // 16-byte vectors per K/V row
  static_assert(HEAD % 16 == 0, "head size must be a multiple of 16");
  static_assert(HEAD <= 128, "O, Q and S fragments of a larger head overflow the registers: SIMT kernel");
  static_assert(QT * G <= ROWS && QT >= 1, "QT tokens x G heads must fit the 64 rows");
};

}  // namespace ps

template <typename T, int HEAD, int BS, int G, int QT, bool PIPE = false>
__global__ void __launch_bounds__(PS_MMA_THREADS, PS_MMA_MIN_BLOCKS)
ps_paged_prefill_mma(T* __restrict__ out,                   // [num_tokens, num_q_heads, HEAD] contiguous
                     const T* __restrict__ query,           // [num_tokens, num_q_heads, HEAD], row stride q_stride
                     const T* __restrict__ k_cache,         // [num_blocks, BS, num_kv_heads, HEAD]
                     const T* __restrict__ v_cache,         // [num_blocks, BS, num_kv_heads, HEAD]
                     const int* __restrict__ block_tables,  // [num_seqs, max_blocks]
                     const int* __restrict__ seq_lens,      // [num_seqs]
                     const int* __restrict__ query_start_loc,  // [num_seqs + 1]
                     long long q_stride, int num_kv_heads, int q_per_kv, int max_blocks, float scale_log2) {
  using S = ps::MmaPrefillShape<HEAD, G, QT, PIPE>;
  using C = ps::Cvt<T>;
  constexpr int KT = S::KT, NT = S::NT, DT = S::DT, KSTEPS = S::KSTEPS, STRIDE = S::STRIDE;
  __shared__ __align__(16) unsigned short sk_all[S::STAGES * KT * STRIDE];  // [STAGES][KT][STRIDE] f16/bf16 bits
  __shared__ __align__(16) unsigned short sv_all[S::STAGES * KT * STRIDE];

  const int groups_per_kv = q_per_kv / G;
  const int kvh = blockIdx.x / groups_per_kv;
  const int qh0 = kvh * q_per_kv + (blockIdx.x % groups_per_kv) * G;
  const int num_q_heads = num_kv_heads * q_per_kv;
  const int seq = blockIdx.y;
  const int q0 = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - q0;
  const int tok0 = (gridDim.z - 1 - blockIdx.z) * QT;  // the longest (last) query tiles start first
  if (tok0 >= q_len) return;
  const int ntok = min(QT, q_len - tok0);
  const int first_pos = seq_lens[seq] - q_len + tok0;
  const int kv_end = min(seq_lens[seq], first_pos + ntok);  // one past the last position any row sees

  const int warp = threadIdx.x / ps::kWarp, lane = threadIdx.x % ps::kWarp;
  const int gid = lane / 4, t4 = lane % 4;
  const int used_rows = ntok * G;  // rows r < used_rows are real (token < ntok, r < QT * G)
  const int wrow0 = warp * 16;
  const int wrow_last = min(wrow0 + 15, used_rows - 1);  // < wrow0: the warp has no real row
  const int wfirst = first_pos + wrow0 / G;              // smallest position among the warp's rows
  const int wlast = wrow_last >= wrow0 ? first_pos + wrow_last / G : -1;  // -1: the warp idles

  // The lane's two rows (gid, gid + 8 of the warp's tile) and their positions.
  int pos[2];
  bool real[2];
  long long qoff[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = wrow0 + gid + 8 * h;
    real[h] = r < used_rows;
    pos[h] = first_pos + r / G;
    qoff[h] = (q0 + tok0 + r / G) * q_stride + static_cast<long long>(qh0 + r % G) * HEAD;
  }

  // Q as A fragments: qf[ks] covers dims 16ks..16ks+15 (rows that are not real hold zeros).
  unsigned qf[KSTEPS][4];
#pragma unroll
  for (int ks = 0; ks < KSTEPS; ++ks)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int h = i & 1, d = ks * 16 + 2 * t4 + 8 * (i >> 1);
      qf[ks][i] = real[h] ? __ldg(reinterpret_cast<const unsigned*>(query + qoff[h] + d)) : 0u;
    }

  float o[DT][4];
#pragma unroll
  for (int dn = 0; dn < DT; ++dn) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.f;
  float m[2] = {ps::kNegBig, ps::kNegBig}, l[2] = {0.f, 0.f};  // l: this lane's columns only

  const long long row_stride = static_cast<long long>(num_kv_heads) * HEAD;
  const long long blk_stride = row_stride * BS;
  const int* bt = block_tables + static_cast<long long>(seq) * max_blocks;
  // Where context token t's 8-element chunk c lies in either cache.
  auto kv_offset = [&](int t, int c) {
    return static_cast<long long>(__ldg(bt + t / BS)) * blk_stride + (t % BS) * row_stride
           + static_cast<long long>(kvh) * HEAD + c * 8;
  };
  // PIPE: the tile at kv0 into its stage (kv0 / KT) % 2, in flight until a wait covers its group.
  auto fetch_async = [&](int kv0) {
    unsigned short* skd = sk_all + ((kv0 / KT) & 1) * KT * STRIDE;
    unsigned short* svd = sv_all + ((kv0 / KT) & 1) * KT * STRIDE;
    for (int idx = threadIdx.x; idx < KT * S::CHUNKS; idx += PS_MMA_THREADS) {
      const int tt = idx / S::CHUNKS, c = idx % S::CHUNKS, t = kv0 + tt;
      const bool in = t < kv_end;  // past kv_end: zeros (finite scores, masked)
      const long long off = in ? kv_offset(t, c) : 0;
      ps::cp_async16(skd + tt * STRIDE + c * 8, k_cache + off, in);
      ps::cp_async16(svd + tt * STRIDE + c * 8, v_cache + off, in);
    }
    ps::cp_async_commit();
  };
  if constexpr (PIPE) {
    if (kv_end > 0) fetch_async(0);
  }

  for (int kv0 = 0; kv0 < kv_end; kv0 += KT) {
    __syncthreads();  // every warp is done with the previous tile (PIPE: with the stage fetched next)
    if constexpr (PIPE) {
      if (kv0 + KT < kv_end) {
        fetch_async(kv0 + KT);
        ps::cp_async_wait<1>();  // this tile's group has landed; the next one's stays in flight
      } else {
        ps::cp_async_wait<0>();
      }
    } else {
      for (int idx = threadIdx.x; idx < KT * S::CHUNKS; idx += PS_MMA_THREADS) {
        const int tt = idx / S::CHUNKS, c = idx % S::CHUNKS, t = kv0 + tt;
        uint4 kq = ps::zero16(), vq = ps::zero16();  // past kv_end: zeros (finite scores, masked)
        if (t < kv_end) {
          const long long off = kv_offset(t, c);
          kq = ps::ldg16(k_cache + off);
          vq = ps::ldg16(v_cache + off);
        }
        *reinterpret_cast<uint4*>(sk_all + tt * STRIDE + c * 8) = kq;
        *reinterpret_cast<uint4*>(sv_all + tt * STRIDE + c * 8) = vq;
      }
    }
    __syncthreads();
    if (kv0 > wlast) continue;  // warp-uniform: the whole tile lies past the warp's rows
    const unsigned short* sk = sk_all + (PIPE ? ((kv0 / KT) & 1) * KT * STRIDE : 0);
    const unsigned short* sv = sv_all + (PIPE ? ((kv0 / KT) & 1) * KT * STRIDE : 0);

    // S = Q K^T: B fragment (k = dim, n = token) = two consecutive dims of one K row.
    float s[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
      if (kv0 + j * 8 > wlast) continue;  // warp-uniform; the mask below sets these to -inf
      const unsigned short* krow = sk + (j * 8 + gid) * STRIDE + 2 * t4;
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks) {
        const unsigned b[2] = {*reinterpret_cast<const unsigned*>(krow + ks * 16),
                               *reinterpret_cast<const unsigned*>(krow + ks * 16 + 8)};
        ps::mma_m16n8k16<T>(s[j], qf[ks], b);
      }
    }

    // Online softmax on the lane's two rows (elements 0-1: row gid, 2-3: row gid + 8).
    const bool diagonal = kv0 + KT - 1 > wfirst;  // some column may lie past some row's position
    float mx[2] = {ps::neg_inf(), ps::neg_inf()};
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = kv0 + j * 8 + 2 * t4 + (e & 1);
        float v = s[j][e] * scale_log2;
        if (diagonal && col > pos[e >> 1]) v = ps::neg_inf();
        s[j][e] = v;
        mx[e >> 1] = fmaxf(mx[e >> 1], v);
      }
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      const float mn = fmaxf(m[h], mx[h]);  // finite: m starts at kNegBig
      alpha[h] = exp2f(m[h] - mn);
      m[h] = mn;
      l[h] *= alpha[h];
    }
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[j][e] = exp2f(s[j][e] - m[e >> 1]);
        l[e >> 1] += s[j][e];
      }
#pragma unroll
    for (int dn = 0; dn < DT; ++dn) {
      o[dn][0] *= alpha[0]; o[dn][1] *= alpha[0];
      o[dn][2] *= alpha[1]; o[dn][3] *= alpha[1];
    }

    // O += P V over 16-token steps: P's A fragment is S tiles 2kk and 2kk + 1; the B fragment
    // (k = token, n = dim) pairs two V rows' elements of one dim.
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk) {
      if (kv0 + kk * 16 > wlast) continue;  // warp-uniform: P is zero there
      const unsigned a[4] = {C::pack2(s[2 * kk][0], s[2 * kk][1]), C::pack2(s[2 * kk][2], s[2 * kk][3]),
                             C::pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             C::pack2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
      const unsigned short* v0 = sv + (kk * 16 + 2 * t4) * STRIDE + gid;
#pragma unroll
      for (int dn = 0; dn < DT; ++dn) {
        const unsigned short* vp = v0 + dn * 8;
        const unsigned b[2] = {vp[0] | (static_cast<unsigned>(vp[STRIDE]) << 16),
                               vp[8 * STRIDE] | (static_cast<unsigned>(vp[9 * STRIDE]) << 16)};
        ps::mma_m16n8k16<T>(o[dn], a, b);
      }
    }
  }

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (!real[h]) continue;
    const int r = wrow0 + gid + 8 * h;
    const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
    T* orow = out + (static_cast<long long>(q0 + tok0 + r / G) * num_q_heads + qh0 + r % G) * HEAD + 2 * t4;
#pragma unroll
    for (int dn = 0; dn < DT; ++dn)
      *reinterpret_cast<unsigned*>(orow + dn * 8) = C::pack2(o[dn][2 * h] * inv, o[dn][2 * h + 1] * inv);
  }
}
