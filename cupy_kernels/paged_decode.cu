// Paged attention for decode: one query token per sequence over its block table.
//
// Grid (num_kv_heads * q_per_kv / G, num_seqs, num_parts), 32 * WARPS threads. A thread block owns
// one KV head of one sequence (one context partition of it when split) and G of the q heads that
// share that KV head, so each K/V row is read from memory once for the whole group.
//
// Inside a warp, lanes form token groups of LPT lanes; a group reads one token's head row as
// 16-byte vectors (CPL vectors per lane, coalesced: LPT*16 contiguous bytes per token per load)
// and keeps its own online-softmax state. A warp walks tiles of TILE tokens, the warps
// interleave tiles, and token groups and warps are merged once at the end. q is held in
// registers pre-scaled by scale*log2(e), so the softmax uses exp2.
//
// Variants (template parameters after G; the defaults are the kernel the launcher's "auto" runs):
//   WARPS  warps per block (4 or 8: 8 gives a small grid more loads in flight per block);
//   TILEH  the tokens per lane per tile in halves of the default rule's (2): 4 doubles them (more
//          independent loads per lane), 1 halves them (fewer registers, so a pipelined kernel keeps
//          16 warps per SM);
//   PIPE   software pipelining: the K/V loads of the warp's next tile and the block-table entries
//          of the tile after it are issued before the current tile's dot products, softmax and V
//          accumulation, so memory latency overlaps compute instead of following it.
// Every variant reduces a token's contribution in the same per-tile way; they differ in which
// tokens a lane/warp sums together, so their results differ in the last bits, not in accuracy.
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
#define PS_DECODE_THREADS 128  // the reduce kernel, and the main kernel's default (4 warps)
#define PS_MAX_PARTS 1024

namespace ps {

__host__ __device__ constexpr int pick_lpt(int chunks, int vec, int g, int budget) {
  // Smallest power of two >= 4 (64 contiguous bytes per token per load) that keeps q in budget.
  // Never wider than the row itself (idle lanes would waste issue slots).
  int lpt = 4;
  while (lpt < kWarp && lpt < chunks && cdiv(chunks, lpt) * vec * g > budget) lpt *= 2;
  return lpt;
}

template <typename T, int HEAD, int G, int WARPS = 4, int TILEH = 2, bool PIPE = false>
struct DecodeShape {
  static constexpr int VEC = Cvt<T>::kVec;                 // elements per 16-byte vector
  static constexpr int CHUNKS = HEAD / VEC;                 // vectors per head row
  static constexpr int LPT = pick_lpt(CHUNKS, VEC, G, PS_DECODE_QBUDGET);  // lanes per token
  static constexpr int CPL = cdiv(CHUNKS, LPT);             // vectors per lane per token
  static constexpr int TPW = kWarp / LPT;                   // tokens a warp reads per step
  static constexpr int NT = cmax(1, cmin(4 * TILEH / CPL, PS_DECODE_NTG * TILEH / (2 * G))); // tokens per lane per tile
  static constexpr int TILE = NT * TPW;                     // tokens per warp per tile
  static constexpr int NW = WARPS;
  static constexpr int THREADS = WARPS * kWarp;
  // Floats a lane keeps live (q, accumulators, the K and V tile, logits; pipelined: a second tile
  // plus the next tiles' block-table entries and row offsets). Small enough -> ask for 16 resident
  // warps per SM (<= 128 registers, enough loads in flight), else 8.
  static constexpr int LIVE = 2 * G * CPL * VEC + 8 * NT * CPL + NT * G + (PIPE ? 8 * NT * CPL + 3 * NT : 0);
  static constexpr int MIN_BLOCKS = cmax(1, (LIVE <= 112 ? 4 : 2) * 4 / WARPS);
  static_assert(HEAD % VEC == 0, "head size must be a multiple of 16 bytes");
  static_assert(G >= 1 && G <= 8, "at most 8 q heads per thread block");
  static_assert(WARPS == 4 || WARPS == 8, "4 or 8 warps per block");
  static_assert(NW * G * (HEAD + 2) * 4 <= 48 * 1024, "the warp merge's shared memory exceeds 48 KiB");
};

// One warp tile in registers: per token slot, whether it is in range, and this lane's K and V vectors.
template <int NT, int CPL>
struct DecodeTile {
  bool valid[NT];
  uint4 k[NT][CPL], v[NT][CPL];
};

}  // namespace ps

template <typename T, int HEAD, int BS, int G, int WARPS = 4, int TILEH = 2, bool PIPE = false>
__global__ void __launch_bounds__(WARPS * ps::kWarp, ps::DecodeShape<T, HEAD, G, WARPS, TILEH, PIPE>::MIN_BLOCKS)
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
  using S = ps::DecodeShape<T, HEAD, G, WARPS, TILEH, PIPE>;
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

  using Tile = ps::DecodeTile<NT, CPL>;

  // Block-table entries of the tokens this lane reads in the tile at `base` (0 past the end).
  auto load_blocks = [&](int base, int (&blk)[NT]) {
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      const int t = base + i * TPW + tg;
      blk[i] = t < end ? __ldg(bt + t / BS) : 0;
    }
  };
  // The tile's K and V vectors of this lane (zeros past the end: no memory traffic).
  auto load_kv = [&](int base, const int (&blk)[NT], Tile& tile) {
    long long off[NT];
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      const int t = base + i * TPW + tg;
      tile.valid[i] = t < end;
      off[i] = tile.valid[i] ? static_cast<long long>(blk[i]) * blk_stride + (t % BS) * row_stride + lane_off : 0;
#pragma unroll
      for (int j = 0; j < CPL; ++j)
        tile.k[i][j] = (tile.valid[i] && gl + j * LPT < S::CHUNKS) ? ps::ldg16(k_cache + off[i] + j * LPT * VEC)
                                                                   : ps::zero16();
    }
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
      for (int j = 0; j < CPL; ++j)
        tile.v[i][j] = (tile.valid[i] && gl + j * LPT < S::CHUNKS) ? ps::ldg16(v_cache + off[i] + j * LPT * VEC)
                                                                   : ps::zero16();
  };
  // Logits, the online-softmax update and the V accumulation of one loaded tile.
  auto consume = [&](const Tile& tile) {
    float s[NT][G];
#pragma unroll
    for (int i = 0; i < NT; ++i) {
#pragma unroll
      for (int g = 0; g < G; ++g) s[i][g] = 0.f;
#pragma unroll
      for (int j = 0; j < CPL; ++j) {
        float kf[VEC];
        C::unpack(tile.k[i][j], kf);
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
          for (int e = 0; e < VEC; ++e) s[i][g] = fmaf(q[g][j][e], kf[e], s[i][g]);
      }
#pragma unroll
      for (int g = 0; g < G; ++g) {
#pragma unroll
        for (int o = LPT / 2; o > 0; o >>= 1) s[i][g] += __shfl_xor_sync(0xffffffffu, s[i][g], o);
        if (!tile.valid[i]) s[i][g] = ps::neg_inf();
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
        C::unpack(tile.v[i][j], vf);
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[g][j][e] = fmaf(s[i][g], vf[e], acc[g][j][e]);
      }
  };

  constexpr int STEP = NW * S::TILE;  // tokens between a warp's consecutive tiles
  if constexpr (PIPE) {
    // Three stages in flight: block-table entries two tiles ahead, K/V one tile ahead, compute.
    int base = start + warp * S::TILE;
    int blk[NT];
    Tile cur;
    load_blocks(base, blk);
    load_kv(base, blk, cur);
    load_blocks(base + STEP, blk);
    for (; base < end; base += STEP) {
      Tile next;
      load_kv(base + STEP, blk, next);
      load_blocks(base + 2 * STEP, blk);
      consume(cur);
      cur = next;
    }
  } else {
    for (int base = start + warp * S::TILE; base < end; base += STEP) {
      int blk[NT];
      Tile tile;
      load_blocks(base, blk);
      load_kv(base, blk, tile);
      consume(tile);
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
  for (int idx = threadIdx.x; idx < G * HEAD; idx += S::THREADS) {
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
