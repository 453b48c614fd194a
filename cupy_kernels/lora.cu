// LoRA deltas of every adapter in a step in two launches per projection (Punica's shrink/expand
// split): y[tok, lo:hi] += (x[tok] A[s]^T) B[s]^T with s = token_slots[tok], -1 = no adapter.
//
// The slots are stacked as executor_svc/lora/slots.py lays them out, float32, scaling folded in:
//   a      [num_slots, R, in]   a slot's used rank rows packed at the front (fused q/k/v or
//                               gate/up: each sub-projection's A rows one after another);
//   bt     [num_slots, R, out]  B^T, block-diagonal over the sub-projections (zeros elsewhere);
//   bounds [3, num_slots] int32 per slot (used rank rows, first output column, one past the last):
//                               a slot with used == 0 adds nothing to this projection.
// So one launch serves every adapter of the step, whatever slot each token has; tokens of one slot
// need not be adjacent. Accumulation is float32; y is read, the delta added in float32 and the sum
// rounded once to T (as `y.float() + delta` then `.to(T)` in the torch products).
//
// A block takes TOK consecutive tokens (1 for decode-sized steps, where the grid needs the blocks;
// PS_LORA_TILE for prefill-sized ones). When the tile's tokens share a slot (a prompt's tokens are
// adjacent) each element of A or B^T is loaded once for all of them (Punica's SGMV idea) instead of
// once per token (BGMV). Either way a token's sums run in one order (lane-strided, then the shuffle
// sum; rank rows in order), whatever its neighbours: its result does not depend on the batch.
#include "common.cuh"

#define PS_LORA_SHRINK_WARPS 4
#define PS_LORA_EXPAND_THREADS 128
#define PS_LORA_MAX_R 768  // 3 sub-projections x max_rank 256 (adapter.MAX_RANK)
#define PS_LORA_TILE 8     // tokens per block on prefill-sized steps

namespace ps {

// The slots of tokens [tok0, tok0 + nt): true when they are all `first`'s.
__device__ __forceinline__ bool same_slot(const int* token_slots, long long tok0, int nt) {
  const int s = token_slots[tok0];
  bool same = true;
  for (int t = 1; t < nt; ++t) same = same && token_slots[tok0 + t] == s;
  return same;
}

}  // namespace ps

// t[tok, j] = x[tok] . a[slot, j] for j < used[slot]. One warp per (tile, rank row j): lanes stride
// the input features (coalesced in x and in a's row), one running sum per token, then a shuffle sum.
// Entries j >= used are not written (the expand never reads them).
// Grid (cdiv(num_tokens, TOK), cdiv(R, PS_LORA_SHRINK_WARPS)), PS_LORA_SHRINK_WARPS * 32 threads.
template <typename T, int TOK>
__global__ void __launch_bounds__(PS_LORA_SHRINK_WARPS * 32) ps_lora_shrink(
    float* __restrict__ t,                  // [num_tokens, R]
    const T* __restrict__ x,                // [num_tokens, in] rows of x_stride elements
    const float* __restrict__ a,            // [num_slots, R, in]
    const int* __restrict__ bounds,         // [3, num_slots]
    const int* __restrict__ token_slots,    // [num_tokens]
    long long x_stride, int num_tokens, int num_slots, int R, int in) {
  using C = ps::Cvt<T>;
  const long long tok0 = static_cast<long long>(blockIdx.x) * TOK;
  const int nt = ps::cmin(TOK, num_tokens - static_cast<int>(tok0));
  const int j = blockIdx.y * PS_LORA_SHRINK_WARPS + static_cast<int>(threadIdx.x) / ps::kWarp;
  const int lane = static_cast<int>(threadIdx.x) % ps::kWarp;
  const float* rows[TOK];  // each token's row j of its slot's A, or nullptr (nothing to compute)
  bool any = false;
#pragma unroll
  for (int i = 0; i < TOK; ++i) {
    const int s = i < nt ? token_slots[tok0 + i] : -1;
    const bool live = s >= 0 && s < num_slots && j < bounds[s];
    rows[i] = live ? a + (static_cast<long long>(s) * R + j) * in : nullptr;
    any = any || live;
  }
  if (!any) return;  // (warp-uniform: no block barrier in this kernel)
  const bool shared = TOK > 1 && ps::same_slot(token_slots, tok0, nt);
  float acc[TOK];
#pragma unroll
  for (int i = 0; i < TOK; ++i) acc[i] = 0.0f;
  for (int k = lane; k < in; k += ps::kWarp) {
    if (shared) {  // one load of A for the tile
      const float av = __ldg(rows[0] + k);
#pragma unroll
      for (int i = 0; i < TOK; ++i)
        if (i < nt) acc[i] += C::to_f(x[(tok0 + i) * x_stride + k]) * av;
    } else {
#pragma unroll
      for (int i = 0; i < TOK; ++i)
        if (rows[i] != nullptr) acc[i] += C::to_f(x[(tok0 + i) * x_stride + k]) * __ldg(rows[i] + k);
    }
  }
#pragma unroll
  for (int i = 0; i < TOK; ++i) {
    const float sum = ps::warp_sum(acc[i]);
    if (lane == 0 && rows[i] != nullptr) t[(tok0 + i) * R + j] = sum;
  }
}

// y[tok, c] = T(y[tok, c] + sum_{j < used} t[tok, j] * bt[slot, j, c]) for c in [lo, hi) of the
// token's slot. One thread per output column (consecutive threads, consecutive columns: bt's rows
// are read coalesced), the tile's t rows staged in shared memory. Block y covers columns
// [lo + y * PS_LORA_EXPAND_THREADS, ...) of each token's range: the grid's y extent is the widest
// slot range in the launch. Grid (cdiv(num_tokens, TOK), cdiv(width, PS_LORA_EXPAND_THREADS)).
template <typename T, int TOK>
__global__ void __launch_bounds__(PS_LORA_EXPAND_THREADS) ps_lora_expand(
    T* __restrict__ y,                      // [num_tokens, out] rows of y_stride elements
    const float* __restrict__ t,            // [num_tokens, R] (from ps_lora_shrink)
    const float* __restrict__ bt,           // [num_slots, R, out]
    const int* __restrict__ bounds,         // [3, num_slots]
    const int* __restrict__ token_slots,    // [num_tokens]
    long long y_stride, int num_tokens, int num_slots, int R, int out) {
  using C = ps::Cvt<T>;
  __shared__ float ts[TOK][PS_LORA_MAX_R];
  const long long tok0 = static_cast<long long>(blockIdx.x) * TOK;
  const int nt = ps::cmin(TOK, num_tokens - static_cast<int>(tok0));
  const int offset = static_cast<int>(blockIdx.y) * PS_LORA_EXPAND_THREADS;
  int used[TOK], col[TOK], hi[TOK];  // per token: rank rows, this thread's column, range end
  const float* cols[TOK];            // per token: its slot's B^T at column 0, or nullptr
  int most = 0;
#pragma unroll
  for (int i = 0; i < TOK; ++i) {
    const int s = i < nt ? token_slots[tok0 + i] : -1;
    const bool valid = s >= 0 && s < num_slots;
    used[i] = valid ? ps::cmin(bounds[s], R) : 0;
    col[i] = valid ? bounds[num_slots + s] + offset : 0;
    hi[i] = valid ? ps::cmin(bounds[2 * num_slots + s], out) : 0;
    if (used[i] <= 0 || col[i] >= hi[i]) used[i] = 0;  // nothing of this token in this block
    cols[i] = used[i] ? bt + static_cast<long long>(s) * R * out : nullptr;
    most = ps::cmax(most, used[i]);
  }
  if (most == 0) return;  // (block-uniform, before the barrier)
#pragma unroll
  for (int i = 0; i < TOK; ++i)  // (constant trip counts keep the per-token arrays in registers)
    for (int j = threadIdx.x; j < used[i]; j += PS_LORA_EXPAND_THREADS) ts[i][j] = t[(tok0 + i) * R + j];
  __syncthreads();
  const bool shared = TOK > 1 && ps::same_slot(token_slots, tok0, nt);  // then used, col, hi agree too
  float acc[TOK];
#pragma unroll
  for (int i = 0; i < TOK; ++i) acc[i] = 0.0f;
  const int c0 = col[0] + static_cast<int>(threadIdx.x);
  for (int j = 0; j < most; ++j) {
    if (shared) {  // one load of B^T for the tile
      if (c0 >= hi[0]) break;
      const float b = __ldg(cols[0] + static_cast<long long>(j) * out + c0);
#pragma unroll
      for (int i = 0; i < TOK; ++i)
        if (i < nt) acc[i] += ts[i][j] * b;
    } else {
#pragma unroll
      for (int i = 0; i < TOK; ++i) {
        const int c = col[i] + static_cast<int>(threadIdx.x);
        if (j < used[i] && c < hi[i]) acc[i] += ts[i][j] * __ldg(cols[i] + static_cast<long long>(j) * out + c);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < TOK; ++i) {
    const int c = col[i] + static_cast<int>(threadIdx.x);
    if (used[i] && c < hi[i]) {
      T* yr = y + (tok0 + i) * y_stride + c;
      *yr = C::from_f(C::to_f(*yr) + acc[i]);
    }
  }
}
