// A tiny SIMT emulator: runs pagedserve's CUDA kernel sources unchanged on the CPU (g++ -std=c++20),
// one OS thread per CUDA thread, thread blocks one after another. __shared__ becomes a function
// static (blocks never overlap), __syncthreads/__syncwarp are std::barrier waits and warp shuffles
// go through a per-warp exchange buffer between two barrier waits. Slow, but it executes the very
// code NVRTC compiles, so CI checks the kernels' indexing and numerics without a GPU.
#pragma once
#include <barrier>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct uint4 { unsigned x, y, z, w; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }

namespace emu {
struct Block {
  std::unique_ptr<std::barrier<>> block;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  std::vector<unsigned long long> xchg;  // [warps * 32] shuffle exchange slots
};
inline thread_local dim3 tidx, bidx;
inline thread_local Block* blk = nullptr;
inline dim3 gdim, bdim;

inline int lane() { return static_cast<int>(tidx.x % 32); }
inline int warp() { return static_cast<int>(tidx.x / 32); }

template <typename F>
void launch(dim3 grid, unsigned threads, F&& body) {
  if (threads % 32) throw std::runtime_error("emu: block size must be a multiple of 32");
  gdim = grid;
  bdim = dim3{threads, 1, 1};
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        Block b;
        b.block = std::make_unique<std::barrier<>>(threads);
        for (unsigned w = 0; w < threads / 32; ++w) b.warps.push_back(std::make_unique<std::barrier<>>(32));
        b.xchg.assign(threads, 0);
        std::vector<std::thread> pool;
        for (unsigned t = 0; t < threads; ++t)
          pool.emplace_back([&, t] {
            tidx = dim3{t, 0, 0};
            bidx = dim3{x, y, z};
            blk = &b;
            body();  // kernels return early only block-uniformly, so no barrier is left waiting
            blk = nullptr;
          });
        for (auto& th : pool) th.join();
      }
}
}  // namespace emu

#define threadIdx emu::tidx
#define blockIdx emu::bidx
#define gridDim emu::gdim
#define blockDim emu::bdim
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))

inline void __syncthreads() { emu::blk->block->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::blk->warps[emu::warp()]->arrive_and_wait(); }

template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int mask) {
  static_assert(sizeof(T) <= 8, "emu shuffle: at most 8 bytes");
  unsigned long long bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  const int base = emu::warp() * 32;
  emu::blk->xchg[base + emu::lane()] = bits;
  __syncwarp();
  bits = emu::blk->xchg[base + (emu::lane() ^ mask)];
  __syncwarp();
  T r;
  std::memcpy(&r, &bits, sizeof(T));
  return r;
}

template <typename T> inline T __ldg(const T* p) { return *p; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

// Half and bfloat16 storage types with the conversions the kernels use.
struct __half { unsigned short x; };
struct __half2 { __half a, b; };
struct __nv_bfloat16 { unsigned short x; };
inline __half __ushort_as_half(unsigned short u) { return __half{u}; }
inline float __half2float(__half h) { _Float16 f; std::memcpy(&f, &h.x, 2); return static_cast<float>(f); }
inline __half __float2half_rn(float v) { _Float16 f = static_cast<_Float16>(v); __half h; std::memcpy(&h.x, &f, 2); return h; }
inline float2 __half22float2(__half2 h) { return {__half2float(h.a), __half2float(h.b)}; }
inline float __bfloat162float(__nv_bfloat16 b) { return __uint_as_float(static_cast<unsigned>(b.x) << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float v) {
  unsigned u;
  std::memcpy(&u, &v, 4);
  if (std::isnan(v)) return __nv_bfloat16{0x7fc0};
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return __nv_bfloat16{static_cast<unsigned short>(u >> 16)};
}
