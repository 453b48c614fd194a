// Fused elementwise layers of the decoder: each replaces a chain of small torch ops (one launch and
// one round trip through memory per op) with one launch that reads its inputs once.
//
// Rounding follows the eager torch path op by op (executor_svc/model/llama.py, rope.py), so that a
// model switched to these kernels keeps its greedy output: every intermediate torch would store in
// the storage type T is rounded to T here too, and arithmetic runs in float32 as torch's does.
// Templated on T only; one block (PS_FUSED_THREADS threads) per token row.
#include "common.cuh"

#define PS_FUSED_THREADS 256

namespace ps {

// Sum of one float per thread over the block, the same order for every row: lanes by xor-shuffle,
// then the warps' partial sums in warp order by thread 0. All threads get the total.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[PS_FUSED_THREADS / kWarp];
  __shared__ float total;
  v = warp_sum(v);
  if (threadIdx.x % kWarp == 0) partial[threadIdx.x / kWarp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.0f;
    for (int w = 0; w < PS_FUSED_THREADS / kWarp; ++w) s += partial[w];
    total = s;
  }
  __syncthreads();
  return total;
}

}  // namespace ps

// residual += delta (rounded to T, as `x = x + attn(...)`), then out = weight * T(rms_norm(residual)).
// delta == nullptr: a plain RMSNorm of `residual` (the first layer's input norm), residual untouched.
// `out` may alias `delta`: each element is read and written by the same thread, passes apart.
// Grid (num_rows), PS_FUSED_THREADS threads.
template <typename T>
__global__ void __launch_bounds__(PS_FUSED_THREADS) ps_add_rms_norm(
    T* out,                          // [num_rows, hidden]
    T* __restrict__ residual,        // [num_rows, hidden], updated in place when delta is given
    const T* delta,                  // [num_rows, hidden] or nullptr
    const T* __restrict__ weight,    // [hidden]
    int hidden, float eps) {
  using C = ps::Cvt<T>;
  const long long row = static_cast<long long>(blockIdx.x) * hidden;
  float sq = 0.0f;
  for (int i = threadIdx.x; i < hidden; i += PS_FUSED_THREADS) {
    float r = C::to_f(residual[row + i]);
    if (delta != nullptr) {
      const T sum = C::from_f(r + C::to_f(delta[row + i]));
      residual[row + i] = sum;
      r = C::to_f(sum);
    }
    sq += r * r;
  }
  const float inv = rsqrtf(ps::block_sum(sq) / static_cast<float>(hidden) + eps);
  for (int i = threadIdx.x; i < hidden; i += PS_FUSED_THREADS) {
    const T normed = C::from_f(C::to_f(residual[row + i]) * inv);
    out[row + i] = C::from_f(C::to_f(weight[i]) * C::to_f(normed));
  }
}

// out = T(silu(gate)) * up over gate_up = [gate | up] (the merged gate/up projection's output).
// Grid (num_rows), PS_FUSED_THREADS threads.
template <typename T>
__global__ void __launch_bounds__(PS_FUSED_THREADS) ps_silu_and_mul(
    T* __restrict__ out,             // [num_rows, inter]
    const T* __restrict__ gate_up,   // [num_rows, 2 * inter]
    int inter) {
  using C = ps::Cvt<T>;
  const long long in_row = static_cast<long long>(blockIdx.x) * 2 * inter;
  const long long out_row = static_cast<long long>(blockIdx.x) * inter;
  for (int i = threadIdx.x; i < inter; i += PS_FUSED_THREADS) {
    const float g = C::to_f(gate_up[in_row + i]);
    const T act = C::from_f(g / (1.0f + expf(-g)));
    out[out_row + i] = C::from_f(C::to_f(act) * C::to_f(gate_up[in_row + inter + i]));
  }
}

// Rotary embedding ("rotate half" form) of one token's q and k heads in place, then the token's
// rotated keys and its values written to their cache slot. cos/sin are computed in float32 from
// the position and the inverse frequencies and rounded to T, as RotaryEmbedding.cos_sin does.
// A negative slot rotates but writes nothing (a padding token). Grid (num_tokens).
template <typename T>
__global__ void __launch_bounds__(PS_FUSED_THREADS) ps_rope_and_cache(
    T* __restrict__ query,                 // [num_tokens, num_q_heads, head] rows of q_stride elements
    T* __restrict__ key,                   // [num_tokens, num_kv_heads, head] rows of kv_stride
    const T* __restrict__ value,           // [num_tokens, num_kv_heads, head] rows of kv_stride
    T* __restrict__ k_cache,               // [num_slots, num_kv_heads, head]
    T* __restrict__ v_cache,               // [num_slots, num_kv_heads, head]
    const long long* __restrict__ positions,     // [num_tokens]
    const long long* __restrict__ slot_mapping,  // [num_tokens]
    const float* __restrict__ inv_freq,          // [head / 2]
    long long q_stride, long long kv_stride, int num_q_heads, int num_kv_heads, int head) {
  using C = ps::Cvt<T>;
  const long long t = blockIdx.x;
  const int half = head / 2;
  const float pos = static_cast<float>(positions[t]);
  const long long slot = slot_mapping[t];
  const int pairs = (num_q_heads + num_kv_heads) * half;
  for (int p = threadIdx.x; p < pairs; p += PS_FUSED_THREADS) {
    const int h = p / half, j = p % half;
    const bool is_q = h < num_q_heads;
    T* x = is_q ? query + t * q_stride + static_cast<long long>(h) * head
                : key + t * kv_stride + static_cast<long long>(h - num_q_heads) * head;
    const float f = pos * inv_freq[j];
    const float c = C::to_f(C::from_f(cosf(f))), s = C::to_f(C::from_f(sinf(f)));
    const float x1 = C::to_f(x[j]), x2 = C::to_f(x[j + half]);
    // x * cos + rotate_half(x) * sin, each product rounded to T before the sum (torch's order).
    const T lo = C::from_f(C::to_f(C::from_f(x1 * c)) + C::to_f(C::from_f(-x2 * s)));
    const T hi = C::from_f(C::to_f(C::from_f(x2 * c)) + C::to_f(C::from_f(x1 * s)));
    x[j] = lo;
    x[j + half] = hi;
    if (!is_q && slot >= 0) {
      T* kd = k_cache + (slot * num_kv_heads + (h - num_q_heads)) * head;
      kd[j] = lo;
      kd[j + half] = hi;
    }
  }
  if (slot < 0) return;
  const T* vs = value + t * kv_stride;
  T* vd = v_cache + slot * num_kv_heads * head;
  for (int i = threadIdx.x; i < num_kv_heads * head; i += PS_FUSED_THREADS) vd[i] = vs[i];
}
