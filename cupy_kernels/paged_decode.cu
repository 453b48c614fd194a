// Paged attention for decode: one query token per sequence over its block table.
//
// Grid (num_kv_heads * q_per_kv / G, num_seqs, num_parts), 128 threads. A thread block owns one
// KV head of one sequence (one context partition of it when split) and G of the q heads that
// share that KV head, so each K/V row is read from memory once for the whole group.
//
// Inside a warp, lanes form token groups of LPT lanes; a group reads one token's head row as
// 16-byte vectors (CPL vectors per lane, coalesced: LPT*16 contiguous bytes per token per load)
// and keeps its own online-softmax state. A warp walks tiles of TILE tokens, the 4 warps
// interleave tiles, and token groups and warps are merged once at the end. q is held in
// registers pre-scaled by scale*log2(e), so the softmax uses exp2.
//
// num_parts == 1: the whole context, the output is written directly.
// num_parts  > 1: partition z covers tokens [z*P, (z+1)*P); each writes a normalised partial
//                 output plus its max and sum, and ps_paged_decode_reduce combines them.
#include "common.cuh"

#ifndef PS_DECODE_QBUDGET
#define PS_DECODE_QBUDGET 32  // q floats held per lane (registers); bounds LPT from below
#endif
#ifndef PS_DECODE_NTG
#define PS_DECODE_NTG 16  // bound on (tokens per lane per tile) * G: logits held per lane
#endif
#define PS_DECODE_THREADS 128
#define PS_MAX_PARTS 1024

namespace ps {

__host__ __device__ constexpr int pick_lpt(int chunks, int vec, int g, int budget) {
  // Smallest power of two >= 4 (64 contiguous bytes per token per load) that keeps q in budget.
  // Never wider than the row itself (idle lanes would waste issue slots).
  int lpt = 4;
  while (lpt < kWarp && lpt < chunks && cdiv(chunks, lpt) * vec * g > budget) lpt *= 2;
  return lpt;
}

template <typename T, int HEAD, int G>
struct DecodeShape {
  static constexpr int VEC = Cvt<T>::kVec;                 // elements per 16-byte vector
  static constexpr int CHUNKS = HEAD / VEC;                 // vectors per head row
  static constexpr int LPT = pick_lpt(CHUNKS, VEC, G, PS_DECODE_QBUDGET);  // lanes per token
  static constexpr int CPL = cdiv(CHUNKS, LPT);             // vectors per lane per token
  static constexpr int TPW = kWarp / LPT;                   // tokens a warp reads per step
  static constexpr int NT = cmax(1, cmin(8 / CPL, PS_DECODE_NTG / G)); // tokens per lane per tile
  static constexpr int TILE = NT * TPW;                     // tokens per warp per tile
  static constexpr int NW = PS_DECODE_THREADS / kWarp;
  // Floats a lane keeps live (q, accumulators, the K and V tile, logits). Small enough -> ask for
  // 4 resident blocks (<= 128 registers, 16 warps per SM to keep loads in flight), else 2.
  static constexpr int LIVE = 2 * G * CPL * VEC + 8 * NT * CPL + NT * G;
  static constexpr int MIN_BLOCKS = LIVE <= 112 ? 4 : 2;
  static_assert(HEAD % VEC == 0, "head size must be a multiple of 16 bytes");
  static_assert(G >= 1 && G <= 8, "at most 8 q heads per thread block");
};

}  // namespace ps

template <typename T, int HEAD, int BS, int G>
__global__ void __launch_bounds__(PS_DECODE_THREADS, ps::DecodeShape<T, HEAD, G>::MIN_BLOCKS)
ps_paged_decode(T* __restrict__ out,              // [num_seqs, num_q_heads, HEAD] (num_parts == 1)
                float* __restrict__ part_out,     // [num_seqs, num_q_heads, num_parts, HEAD]
                float* __restrict__ part_max,     // [num_seqs, num_q_heads, num_parts] (log2 units)
                float* __restrict__ part_sum,     // [num_seqs, num_q_heads, num_parts]
                const T* __restrict__ query,      // [num_seqs, num_q_heads, HEAD], row stride q_stride
                const T* __restrict__ k_cache,    // [num_blocks, BS, num_kv_heads, HEAD]
                const T* __restrict__ v_cache,    // [num_blocks, BS, num_kv_heads, HEAD]
                const int* __restrict__ block_tables,  // [num_seqs, max_blocks]
                const int* __restrict__ seq_lens,      // [num_seqs]
                long long q_stride, int num_kv_heads, int q_per_kv, int max_blocks,
                int partition_size, float scale_log2) {
  using S = ps::DecodeShape<T, HEAD, G>;
  using C = ps::Cvt<T>;
  constexpr int NW = S::NW, LPT = S::LPT, CPL = S::CPL, VEC = S::VEC, NT = S::NT, TPW = S::TPW;
  __shared__ float sm_m[NW][G];
  __shared__ float sm_l[NW][G];
  __shared__ __align__(16) float sm_acc[NW][G][HEAD];

  const int groups_per_kv = q_per_kv / G;
  const int kvh = blockIdx.x / groups_per_kv;
  const int qh0 = kvh * q_per_kv + (blockIdx.x % groups_per_kv) * G;
  const int num_q_heads = num_kv_heads * q_per_kv;
  const int seq = blockIdx.y;
  const int part = blockIdx.z;
  const int num_parts = gridDim.z;
  const int seq_len = seq_lens[seq];
  const int start = num_parts == 1 ? 0 : part * partition_size;
  if (num_parts > 1 && start >= seq_len) return;  // this sequence has fewer partitions
  const int end = num_parts == 1 ? seq_len : min(seq_len, start + partition_size);

  const int warp = threadIdx.x / ps::kWarp, lane = threadIdx.x % ps::kWarp;
  const int gl = lane % LPT;  // lane within its token group: owns vectors gl, gl+LPT, ...
  const int tg = lane / LPT;  // token group within the warp

  float q[G][CPL][VEC];
  const T* qrow = query + seq * q_stride + static_cast<long long>(qh0) * HEAD;
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int j = 0; j < CPL; ++j) {
      const int c = gl + j * LPT;
      uint4 raw = c < S::CHUNKS ? ps::ldg16(qrow + g * HEAD + c * VEC) : ps::zero16();
      C::unpack(raw, q[g][j]);
#pragma unroll
      for (int e = 0; e < VEC; ++e) q[g][j][e] *= scale_log2;
    }

  float m[G], l[G], acc[G][CPL][VEC];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = ps::kNegBig;
    l[g] = 0.f;
#pragma unroll
    for (int j = 0; j < CPL; ++j)
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[g][j][e] = 0.f;
  }

  const long long row_stride = static_cast<long long>(num_kv_heads) * HEAD;  // token to token
  const long long blk_stride = row_stride * BS;                                // block to block
  const int* bt = block_tables + static_cast<long long>(seq) * max_blocks;
  const long long lane_off = static_cast<long long>(kvh) * HEAD + gl * VEC;

  for (int base = start + warp * S::TILE; base < end; base += NW * S::TILE) {
    long long off[NT];
    bool valid[NT];
    uint4 kr[NT][CPL];
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      const int t = base + i * TPW + tg;
      valid[i] = t < end;
      off[i] = valid[i] ? static_cast<long long>(__ldg(bt + t / BS)) * blk_stride
                              + (t % BS) * row_stride + lane_off
                        : 0;
#pragma unroll
      for (int j = 0; j < CPL; ++j)
        kr[i][j] = (valid[i] && gl + j * LPT < S::CHUNKS) ? ps::ldg16(k_cache + off[i] + j * LPT * VEC)
                                                          : ps::zero16();
    }
    uint4 vr[NT][CPL];
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
      for (int j = 0; j < CPL; ++j)
        vr[i][j] = (valid[i] && gl + j * LPT < S::CHUNKS) ? ps::ldg16(v_cache + off[i] + j * LPT * VEC)
                                                          : ps::zero16();

    float s[NT][G];
#pragma unroll
    for (int i = 0; i < NT; ++i) {
#pragma unroll
      for (int g = 0; g < G; ++g) s[i][g] = 0.f;
#pragma unroll
      for (int j = 0; j < CPL; ++j) {
        float kf[VEC];
        C::unpack(kr[i][j], kf);
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
          for (int e = 0; e < VEC; ++e) s[i][g] = fmaf(q[g][j][e], kf[e], s[i][g]);
      }
#pragma unroll
      for (int g = 0; g < G; ++g) {
#pragma unroll
        for (int o = LPT / 2; o > 0; o >>= 1) s[i][g] += __shfl_xor_sync(0xffffffffu, s[i][g], o);
        if (!valid[i]) s[i][g] = ps::neg_inf();
      }
    }

#pragma unroll
    for (int g = 0; g < G; ++g) {
      float tmax = s[0][g];
#pragma unroll
      for (int i = 1; i < NT; ++i) tmax = fmaxf(tmax, s[i][g]);
      const float mn = fmaxf(m[g], tmax);
      const float alpha = exp2f(m[g] - mn);
      m[g] = mn;
      float psum = 0.f;
#pragma unroll
      for (int i = 0; i < NT; ++i) {
        s[i][g] = exp2f(s[i][g] - mn);  // now the unnormalised probability
        psum += s[i][g];
      }
      l[g] = l[g] * alpha + psum;
#pragma unroll
      for (int j = 0; j < CPL; ++j)
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[g][j][e] *= alpha;
    }

#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
      for (int j = 0; j < CPL; ++j) {
        float vf[VEC];
        C::unpack(vr[i][j], vf);
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[g][j][e] = fmaf(s[i][g], vf[e], acc[g][j][e]);
      }
  }

  // Merge the token groups of this warp (lanes differing in the bits above LPT).
#pragma unroll
  for (int o = LPT; o < ps::kWarp; o <<= 1) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[g], o);
      const float lo = __shfl_xor_sync(0xffffffffu, l[g], o);
      const float mn = fmaxf(m[g], mo);
      const float a = exp2f(m[g] - mn), b = exp2f(mo - mn);
      l[g] = l[g] * a + lo * b;
      m[g] = mn;
#pragma unroll
      for (int j = 0; j < CPL; ++j)
#pragma unroll
        for (int e = 0; e < VEC; ++e)
          acc[g][j][e] = acc[g][j][e] * a + __shfl_xor_sync(0xffffffffu, acc[g][j][e], o) * b;
    }
  }
  if (tg == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (gl == 0) {
        sm_m[warp][g] = m[g];
        sm_l[warp][g] = l[g];
      }
#pragma unroll
      for (int j = 0; j < CPL; ++j) {
        const int c = gl + j * LPT;
        if (c < S::CHUNKS)
#pragma unroll
          for (int e = 0; e < VEC; ++e) sm_acc[warp][g][c * VEC + e] = acc[g][j][e];
      }
    }
  }
  __syncthreads();

  // Merge the warps; each thread finishes some (head, dim) outputs.
  for (int idx = threadIdx.x; idx < G * HEAD; idx += PS_DECODE_THREADS) {
    const int g = idx / HEAD, d = idx % HEAD;
    float mx = sm_m[0][g];
#pragma unroll
    for (int w = 1; w < NW; ++w) mx = fmaxf(mx, sm_m[w][g]);
    float lsum = 0.f, o = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float f = exp2f(sm_m[w][g] - mx);
      lsum += sm_l[w][g] * f;
      o += sm_acc[w][g][d] * f;
    }
    const float val = lsum > 0.f ? o / lsum : 0.f;
    const long long row = static_cast<long long>(seq) * num_q_heads + qh0 + g;
    if (num_parts == 1) {
      out[row * HEAD + d] = C::from_f(val);
    } else {
      const long long p = row * num_parts + part;
      part_out[p * HEAD + d] = val;
      if (d == 0) {
        part_max[p] = mx;
        part_sum[p] = lsum;
      }
    }
  }
}

// Combines the partitions of the split version. Grid (num_q_heads, num_seqs), 128 threads.
template <typename T, int HEAD>
__global__ void __launch_bounds__(PS_DECODE_THREADS, 2)
ps_paged_decode_reduce(T* __restrict__ out,                 // [num_seqs, num_q_heads, HEAD]
                       const float* __restrict__ part_out,  // [num_seqs, num_q_heads, num_parts, HEAD]
                       const float* __restrict__ part_max,  // [num_seqs, num_q_heads, num_parts]
                       const float* __restrict__ part_sum,  // [num_seqs, num_q_heads, num_parts]
                       const int* __restrict__ seq_lens,    // [num_seqs]
                       int num_parts, int partition_size) {
  using C = ps::Cvt<T>;
  constexpr int NW = PS_DECODE_THREADS / ps::kWarp;
  __shared__ float weights[PS_MAX_PARTS];
  __shared__ float red[NW];
  const int num_q_heads = gridDim.x;
  const long long row = static_cast<long long>(blockIdx.y) * num_q_heads + blockIdx.x;
  const int warp = threadIdx.x / ps::kWarp, lane = threadIdx.x % ps::kWarp;
  const int n = min(num_parts, ps::cdiv(seq_lens[blockIdx.y], partition_size));
  const long long base = row * num_parts;
  if (n <= 1) {
    // One partition: its normalised output as it is, the bits a single pass writes (rescaling by its
    // own sum would round again): a sequence's result then depends on its length, not on whether a
    // longer neighbour split the launch.
    for (int d = threadIdx.x; d < HEAD; d += PS_DECODE_THREADS)
      out[row * HEAD + d] = C::from_f(n == 1 ? part_out[base * HEAD + d] : 0.f);  // (no keys: 0, as below)
    return;
  }

  float mx = ps::neg_inf();
  for (int p = threadIdx.x; p < n; p += PS_DECODE_THREADS) mx = fmaxf(mx, part_max[base + p]);
  mx = ps::warp_max(mx);
  if (lane == 0) red[warp] = mx;
  __syncthreads();
  mx = red[0];
#pragma unroll
  for (int w = 1; w < NW; ++w) mx = fmaxf(mx, red[w]);
  __syncthreads();  // everyone has read red before it is reused

  float total = 0.f;
  for (int p = threadIdx.x; p < n; p += PS_DECODE_THREADS) {
    const float w = part_sum[base + p] * exp2f(part_max[base + p] - mx);
    weights[p] = w;
    total += w;
  }
  total = ps::warp_sum(total);
  if (lane == 0) red[warp] = total;
  __syncthreads();
  total = 0.f;
#pragma unroll
  for (int w = 0; w < NW; ++w) total += red[w];
  const float inv = total > 0.f ? 1.f / total : 0.f;

  for (int d = threadIdx.x; d < HEAD; d += PS_DECODE_THREADS) {
    float o = 0.f;
    for (int p = 0; p < n; ++p) o = fmaf(weights[p], part_out[(base + p) * HEAD + d], o);
    out[row * HEAD + d] = C::from_f(o * inv);
  }
}
