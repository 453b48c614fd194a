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
#include "common.cuh"

#define PS_LORA_SHRINK_WARPS 4
#define PS_LORA_EXPAND_THREADS 128
#define PS_LORA_MAX_R 768  // 3 sub-projections x max_rank 256 (adapter.MAX_RANK)

// t[tok, j] = x[tok] . a[slot, j] for j < used[slot]. One warp per (token, rank row): lanes stride
// the input features (coalesced in x and in a's row), four partial sums each for loads in flight,
// then a shuffle sum. Entries j >= used are not written (the expand never reads them).
// Grid (num_tokens, cdiv(R, PS_LORA_SHRINK_WARPS)), PS_LORA_SHRINK_WARPS * 32 threads.
template <typename T>
__global__ void __launch_bounds__(PS_LORA_SHRINK_WARPS * 32) ps_lora_shrink(
    float* __restrict__ t,                  // [num_tokens, R]
    const T* __restrict__ x,                // [num_tokens, in] rows of x_stride elements
    const float* __restrict__ a,            // [num_slots, R, in]
    const int* __restrict__ bounds,         // [3, num_slots]
    const int* __restrict__ token_slots,    // [num_tokens]
    long long x_stride, int num_slots, int R, int in) {
  using C = ps::Cvt<T>;
  const long long tok = blockIdx.x;
  const int slot = token_slots[tok];
  if (slot < 0 || slot >= num_slots) return;  // (block-uniform)
  const int j = blockIdx.y * PS_LORA_SHRINK_WARPS + static_cast<int>(threadIdx.x) / ps::kWarp;
  if (j >= bounds[slot]) return;  // (warp-uniform: no block barrier below)
  const int lane = static_cast<int>(threadIdx.x) % ps::kWarp;
  const T* xr = x + tok * x_stride;
  const float* ar = a + (static_cast<long long>(slot) * R + j) * in;
  float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
  int k = lane;
  for (; k + 3 * ps::kWarp < in; k += 4 * ps::kWarp) {
    s0 += C::to_f(xr[k]) * __ldg(ar + k);
    s1 += C::to_f(xr[k + ps::kWarp]) * __ldg(ar + k + ps::kWarp);
    s2 += C::to_f(xr[k + 2 * ps::kWarp]) * __ldg(ar + k + 2 * ps::kWarp);
    s3 += C::to_f(xr[k + 3 * ps::kWarp]) * __ldg(ar + k + 3 * ps::kWarp);
  }
  for (; k < in; k += ps::kWarp) s0 += C::to_f(xr[k]) * __ldg(ar + k);
  const float sum = ps::warp_sum((s0 + s1) + (s2 + s3));
  if (lane == 0) t[tok * R + j] = sum;
}

// y[tok, c] = T(y[tok, c] + sum_{j < used} t[tok, j] * bt[slot, j, c]) for c in [lo, hi) of the
// token's slot. One thread per output column (consecutive threads, consecutive columns: bt's rows
// are read coalesced), the token's t row staged in shared memory. Block y covers columns
// [lo + y * PS_LORA_EXPAND_THREADS, ...): the grid's y extent is the widest slot range in the launch.
// Grid (num_tokens, cdiv(width, PS_LORA_EXPAND_THREADS)), PS_LORA_EXPAND_THREADS threads.
template <typename T>
__global__ void __launch_bounds__(PS_LORA_EXPAND_THREADS) ps_lora_expand(
    T* __restrict__ y,                      // [num_tokens, out] rows of y_stride elements
    const float* __restrict__ t,            // [num_tokens, R] (from ps_lora_shrink)
    const float* __restrict__ bt,           // [num_slots, R, out]
    const int* __restrict__ bounds,         // [3, num_slots]
    const int* __restrict__ token_slots,    // [num_tokens]
    long long y_stride, int num_slots, int R, int out) {
  using C = ps::Cvt<T>;
  __shared__ float ts[PS_LORA_MAX_R];
  const long long tok = blockIdx.x;
  const int slot = token_slots[tok];
  if (slot < 0 || slot >= num_slots) return;
  const int used = ps::cmin(bounds[slot], R), lo = bounds[num_slots + slot];
  const int hi = ps::cmin(bounds[2 * num_slots + slot], out);
  const int first = lo + static_cast<int>(blockIdx.y) * PS_LORA_EXPAND_THREADS;
  if (used <= 0 || first >= hi) return;  // (block-uniform, before the barrier)
  for (int j = threadIdx.x; j < used; j += PS_LORA_EXPAND_THREADS) ts[j] = t[tok * R + j];
  __syncthreads();
  const int c = first + static_cast<int>(threadIdx.x);
  if (c >= hi) return;
  const float* b = bt + static_cast<long long>(slot) * R * out + c;
  float s0 = 0.0f, s1 = 0.0f;
  int j = 0;
  for (; j + 1 < used; j += 2) {
    s0 += ts[j] * __ldg(b + static_cast<long long>(j) * out);
    s1 += ts[j + 1] * __ldg(b + static_cast<long long>(j + 1) * out);
  }
  if (j < used) s0 += ts[j] * __ldg(b + static_cast<long long>(j) * out);
  T* yr = y + tok * y_stride + c;
  *yr = C::from_f(C::to_f(*yr) + (s0 + s1));
}
