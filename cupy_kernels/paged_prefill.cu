// Paged attention for a chunk of query tokens (prefill, chunked prefill, prefix-cache hits).
//
// Query token i of a sequence with context L (this step's tokens included) and q new tokens sits
// at position L - q + i and attends causally to positions 0 .. L - q + i, all read straight from
// the paged cache (the new tokens were written there by reshape_and_cache first): no gather into
// a contiguous copy.
//
// Grid (num_kv_heads * q_per_kv / G, num_seqs, cdiv(max_query_len, QT)), 128 threads. A thread
// block owns QT query tokens x G q heads of one KV head: ROWS = QT * G rows, RPW per warp. It
// walks the context in tiles of KT tokens staged in shared memory (K and V, read once per tile
// for all rows). For a row, lane j scores token j of the tile; an online softmax (exp2, q
// pre-scaled by scale*log2(e)) keeps the row's state; lanes then own dimension pairs of the
// output for the P.V product.
#include "common.cuh"

#define PS_PREFILL_THREADS 128
#ifndef PS_PREFILL_MIN_BLOCKS
#define PS_PREFILL_MIN_BLOCKS 2  // a floor on residency: stops ptxas trading registers for spills
#endif
#ifndef PS_PREFILL_SCORE_UNROLL
#define PS_PREFILL_SCORE_UNROLL 4
#endif
#ifndef PS_PREFILL_PV_UNROLL
#define PS_PREFILL_PV_UNROLL 2
#endif
#ifndef PS_PREFILL_SMEM
#define PS_PREFILL_SMEM 46080  // static shared memory budget per block (< 48 KiB)
#endif

namespace ps {

template <typename T, int HEAD, int G, int QT>
struct PrefillShape {
  static constexpr int NW = PS_PREFILL_THREADS / kWarp;
  static constexpr int VEC = Cvt<T>::kVec;
  static constexpr int CHUNKS = HEAD / VEC;                       // 16-byte vectors per row
  static constexpr int ROWS = QT * G;                              // (token, head) rows per block
  static constexpr int RPW = cdiv(ROWS, NW);                       // rows per warp
  static constexpr int ROW_BYTES = HEAD * (int)sizeof(T) + 16;     // padded: conflict-free lanes
  static constexpr int Q_BYTES = ROWS * HEAD * 4;
  static constexpr int P_BYTES = NW * RPW * kWarp * 4;
  static constexpr int KT = cmin(kWarp, (PS_PREFILL_SMEM - Q_BYTES - P_BYTES) / (2 * ROW_BYTES));
  static constexpr int PAIRS = HEAD / 2;                           // output dims come in pairs
  static constexpr int PPL = cdiv(PAIRS, kWarp);                   // pairs per lane
  static_assert(HEAD % VEC == 0, "head size must be a multiple of 16 bytes");
  static_assert(KT >= 8, "shared-memory budget leaves too small a K/V tile");
  static_assert(RPW <= 4, "at most 16 rows per block");
};

}  // namespace ps

template <typename T, int HEAD, int BS, int G, int QT>
__global__ void __launch_bounds__(PS_PREFILL_THREADS, PS_PREFILL_MIN_BLOCKS)
ps_paged_prefill(T* __restrict__ out,                   // [num_tokens, num_q_heads, HEAD] contiguous
                 const T* __restrict__ query,           // [num_tokens, num_q_heads, HEAD], row stride q_stride
                 const T* __restrict__ k_cache,         // [num_blocks, BS, num_kv_heads, HEAD]
                 const T* __restrict__ v_cache,         // [num_blocks, BS, num_kv_heads, HEAD]
                 const int* __restrict__ block_tables,  // [num_seqs, max_blocks]
                 const int* __restrict__ seq_lens,      // [num_seqs]
                 const int* __restrict__ query_start_loc,  // [num_seqs + 1]
                 long long q_stride, int num_kv_heads, int q_per_kv, int max_blocks, float scale_log2) {
  using S = ps::PrefillShape<T, HEAD, G, QT>;
  using C = ps::Cvt<T>;
  constexpr int NW = S::NW, RPW = S::RPW, KT = S::KT, VEC = S::VEC, PPL = S::PPL;
  constexpr int kPvUnroll = PS_PREFILL_PV_UNROLL;
  constexpr int kScoreUnroll = PS_PREFILL_SCORE_UNROLL;
  __shared__ __align__(16) float sq[S::ROWS][HEAD];
  __shared__ __align__(16) unsigned char sk[KT * S::ROW_BYTES];
  __shared__ __align__(16) unsigned char sv[KT * S::ROW_BYTES];
  __shared__ float sp[NW][RPW][ps::kWarp];

  const int groups_per_kv = q_per_kv / G;
  const int kvh = blockIdx.x / groups_per_kv;
  const int qh0 = kvh * q_per_kv + (blockIdx.x % groups_per_kv) * G;
  const int num_q_heads = num_kv_heads * q_per_kv;
  const int seq = blockIdx.y;
  const int q0 = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - q0;
  const int tok0 = blockIdx.z * QT;
  if (tok0 >= q_len) return;
  const int ntok = min(QT, q_len - tok0);
  const int first_pos = seq_lens[seq] - q_len + tok0;  // position of this block's first query token
  const int kv_end = min(seq_lens[seq], first_pos + ntok);  // one past the last position any row sees

  for (int idx = threadIdx.x; idx < S::ROWS * HEAD; idx += PS_PREFILL_THREADS) {
    const int r = idx / HEAD, d = idx % HEAD, tok = r / G, g = r % G;
    float v = 0.f;
    if (tok < ntok)
      v = C::to_f(query[(q0 + tok0 + tok) * q_stride + static_cast<long long>(qh0 + g) * HEAD + d]) * scale_log2;
    sq[r][d] = v;
  }

  const int warp = threadIdx.x / ps::kWarp, lane = threadIdx.x % ps::kWarp;
  bool row_ok[RPW];
  int pos[RPW];
  float m[RPW], l[RPW], acc[RPW][PPL][2];
#pragma unroll
  for (int rr = 0; rr < RPW; ++rr) {
    const int r = warp * RPW + rr;
    row_ok[rr] = r < S::ROWS && r / G < ntok;  // uniform across the warp
    pos[rr] = first_pos + r / G;
    m[rr] = ps::kNegBig;
    l[rr] = 0.f;
#pragma unroll
    for (int pp = 0; pp < PPL; ++pp) acc[rr][pp][0] = acc[rr][pp][1] = 0.f;
  }

  const long long row_stride = static_cast<long long>(num_kv_heads) * HEAD;
  const long long blk_stride = row_stride * BS;
  const int* bt = block_tables + static_cast<long long>(seq) * max_blocks;
  const unsigned char* krow = sk + min(lane, KT - 1) * S::ROW_BYTES;

  for (int kv0 = 0; kv0 < kv_end; kv0 += KT) {
    __syncthreads();  // the previous tile (and the q rows, first time) are settled
    for (int idx = threadIdx.x; idx < KT * S::CHUNKS; idx += PS_PREFILL_THREADS) {
      const int tt = idx / S::CHUNKS, c = idx % S::CHUNKS, t = kv0 + tt;
      uint4 kq = ps::zero16(), vq = ps::zero16();
      if (t < kv_end) {
        const long long off = static_cast<long long>(__ldg(bt + t / BS)) * blk_stride + (t % BS) * row_stride
                              + static_cast<long long>(kvh) * HEAD + c * VEC;
        kq = ps::ldg16(k_cache + off);
        vq = ps::ldg16(v_cache + off);
      }
      *reinterpret_cast<uint4*>(sk + tt * S::ROW_BYTES + c * 16) = kq;
      *reinterpret_cast<uint4*>(sv + tt * S::ROW_BYTES + c * 16) = vq;
    }
    __syncthreads();

    float s[RPW];
#pragma unroll
    for (int rr = 0; rr < RPW; ++rr) s[rr] = 0.f;
#pragma unroll kScoreUnroll
    for (int c = 0; c < S::CHUNKS; ++c) {
      float kf[VEC];
      C::unpack(*reinterpret_cast<const uint4*>(krow + c * 16), kf);
#pragma unroll
      for (int rr = 0; rr < RPW; ++rr) {
        const float* qr = &sq[min(warp * RPW + rr, S::ROWS - 1)][c * VEC];
#pragma unroll
        for (int e = 0; e < VEC; e += 4) {
          const float4 qv = *reinterpret_cast<const float4*>(qr + e);
          s[rr] = fmaf(qv.x, kf[e], s[rr]);
          s[rr] = fmaf(qv.y, kf[e + 1], s[rr]);
          s[rr] = fmaf(qv.z, kf[e + 2], s[rr]);
          s[rr] = fmaf(qv.w, kf[e + 3], s[rr]);
        }
      }
    }

#pragma unroll
    for (int rr = 0; rr < RPW; ++rr) {
      if (!row_ok[rr]) {
        sp[warp][rr][lane] = 0.f;
        continue;
      }
      const float sc = (lane < KT && kv0 + lane <= pos[rr]) ? s[rr] : ps::neg_inf();
      const float mn = fmaxf(m[rr], ps::warp_max(sc));
      const float alpha = exp2f(m[rr] - mn);
      const float p = exp2f(sc - mn);
      l[rr] = l[rr] * alpha + ps::warp_sum(p);
      m[rr] = mn;
#pragma unroll
      for (int pp = 0; pp < PPL; ++pp) {
        acc[rr][pp][0] *= alpha;
        acc[rr][pp][1] *= alpha;
      }
      sp[warp][rr][lane] = p;
    }
    __syncwarp();

    const int jmax = min(KT, kv_end - kv0);
#pragma unroll kPvUnroll
    for (int j = 0; j < jmax; ++j) {
      const T* vrow = reinterpret_cast<const T*>(sv + j * S::ROW_BYTES);
#pragma unroll
      for (int pp = 0; pp < PPL; ++pp) {
        const int pi = lane + pp * ps::kWarp;
        if (pi < S::PAIRS) {
          const float2 v2 = C::pair(vrow + 2 * pi);
#pragma unroll
          for (int rr = 0; rr < RPW; ++rr) {
            const float pr = sp[warp][rr][j];
            acc[rr][pp][0] = fmaf(pr, v2.x, acc[rr][pp][0]);
            acc[rr][pp][1] = fmaf(pr, v2.y, acc[rr][pp][1]);
          }
        }
      }
    }
  }

#pragma unroll
  for (int rr = 0; rr < RPW; ++rr) {
    if (!row_ok[rr]) continue;
    const int r = warp * RPW + rr;
    const float inv = l[rr] > 0.f ? 1.f / l[rr] : 0.f;
    T* o = out + (static_cast<long long>(q0 + tok0 + r / G) * num_q_heads + qh0 + r % G) * HEAD;
#pragma unroll
    for (int pp = 0; pp < PPL; ++pp) {
      const int pi = lane + pp * ps::kWarp;
      if (pi < S::PAIRS) {
        o[2 * pi] = C::from_f(acc[rr][pp][0] * inv);
        o[2 * pi + 1] = C::from_f(acc[rr][pp][1] * inv);
      }
    }
  }
}
