// KV-cache maintenance kernels. They move whole head rows and blocks as 16-byte vectors, so one
// compiled version serves every dtype (rows are HEAD * sizeof(T) bytes, a multiple of 16).
#include "common.cuh"

// Writes each new token's keys and values into its cache slot. Grid (num_tokens), any block size.
// A token's [num_kv_heads, HEAD] keys are contiguous in the source (row stride key_stride_vec,
// in 16-byte vectors) and in the cache (slot * row_vecs).
extern "C" __global__ void ps_reshape_and_cache(
    const uint4* __restrict__ key,            // [num_tokens, num_kv_heads, HEAD]
    const uint4* __restrict__ value,          // [num_tokens, num_kv_heads, HEAD]
    uint4* __restrict__ k_cache,              // [num_blocks * block_size, num_kv_heads, HEAD]
    uint4* __restrict__ v_cache,              // [num_blocks * block_size, num_kv_heads, HEAD]
    const long long* __restrict__ slot_mapping,  // [num_tokens]; negative: skip the token
    long long key_stride_vec, long long value_stride_vec, int row_vecs) {
  const long long t = blockIdx.x;
  const long long slot = slot_mapping[t];
  if (slot < 0) return;
  const uint4* ks = key + t * key_stride_vec;
  const uint4* vs = value + t * value_stride_vec;
  uint4* kd = k_cache + slot * row_vecs;
  uint4* vd = v_cache + slot * row_vecs;
  for (int i = threadIdx.x; i < row_vecs; i += blockDim.x) {
    kd[i] = ks[i];
    vd[i] = vs[i];
  }
}

// Copy-on-write: block[dst] = block[src] for every pair in every cache tensor (all layers, keys
// and values) in one launch. Grid (num_caches, num_pairs). The launcher guarantees no block is
// both a source and a destination, so the order of the copies does not matter.
extern "C" __global__ void ps_copy_blocks(
    const unsigned long long* __restrict__ cache_ptrs,  // [num_caches] device addresses
    const long long* __restrict__ pairs,                // [num_pairs, 2] (src, dst)
    long long block_vecs) {
  uint4* base = reinterpret_cast<uint4*>(cache_ptrs[blockIdx.x]);
  const long long src = pairs[2 * static_cast<long long>(blockIdx.y)];
  const long long dst = pairs[2 * static_cast<long long>(blockIdx.y) + 1];
  const uint4* s = base + src * block_vecs;
  uint4* d = base + dst * block_vecs;
  for (long long i = threadIdx.x; i < block_vecs; i += blockDim.x) d[i] = s[i];
}
