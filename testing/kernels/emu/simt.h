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
struct MmaSlot { unsigned a[4], b[2]; };  // one lane's A and B fragment registers
struct Block {
  std::unique_ptr<std::barrier<>> block;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  std::vector<unsigned long long> xchg;  // [warps * 32] shuffle exchange slots
  std::vector<MmaSlot> mma;              // [warps * 32] mma fragment exchange slots
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
        b.mma.assign(threads, MmaSlot{});
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
inline unsigned short __half_as_ushort(__half h) { return h.x; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.x; }

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32 as a warp-collective call: D = A B + C
// with A 16x16 (row-major), B 16x8 (column-major), C and D 16x8 float32. Every lane hands in its
// fragment registers laid out as the PTX ISA documents them (gid = lane / 4, t = lane % 4; a
// register's low 16 bits hold the element of lower column or k):
//   A: a[0] = (gid, 2t..2t+1), a[1] = (gid + 8, 2t..), a[2] = (gid, 2t + 8..), a[3] = (gid + 8, 2t + 8..)
//   B: b[0] = (k 2t..2t+1, n gid), b[1] = (k 2t + 8..2t + 9, n gid)
//   C/D: d[0..1] = (gid, 2t..2t+1), d[2..3] = (gid + 8, 2t..2t+1)
// The fragments meet in the per-warp exchange slots between two warp barriers; each lane then
// computes its own four outputs. Products of f16/bf16 values are exact in float32; they are summed in
// float32 in k order onto C.
namespace emu {
inline float mma_elem(unsigned word, int high, bool bf16) {
  const unsigned short h = static_cast<unsigned short>(high ? word >> 16 : word & 0xffffu);
  return bf16 ? __bfloat162float(__nv_bfloat16{h}) : __half2float(__half{h});
}

template <bool BF16>
inline void mma_m16n8k16(float* d, const unsigned* a, const unsigned* b) {
  const int base = warp() * 32, me = lane();
  MmaSlot& mine = blk->mma[base + me];
  for (int i = 0; i < 4; ++i) mine.a[i] = a[i];
  mine.b[0] = b[0];
  mine.b[1] = b[1];
  __syncwarp();
  const MmaSlot* s = &blk->mma[base];
  auto A = [&](int row, int col) {  // the lane and register that hold A[row][col]
    return mma_elem(s[(row % 8) * 4 + (col % 8) / 2].a[(row >= 8) + 2 * (col >= 8)], col & 1, BF16);
  };
  auto B = [&](int k, int n) { return mma_elem(s[n * 4 + (k % 8) / 2].b[k >= 8], k & 1, BF16); };
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int row = me / 4 + 8 * (i >= 2), col = 2 * (me % 4) + (i & 1);
    float acc = d[i];
    for (int k = 0; k < 16; ++k) acc += A(row, k) * B(k, col);
    out[i] = acc;
  }
  __syncwarp();  // every lane has read the slots before any lane's next mma overwrites them
  for (int i = 0; i < 4; ++i) d[i] = out[i];
}

// cp.async as the hardware may order it: a thread's copies land only when its cp.async.wait_group lets
// them (every group but the N newest), never at a barrier, so a kernel that reads a stage before
// waiting for it reads what was there before (and its test fails). The source is read at issue: the
// kernels never write what they copy. Each emulated thread is an OS thread of one block, so the
// thread-local queues start empty for every block.
struct AsyncCopy { void* dst; uint4 data; };
inline thread_local std::vector<std::vector<AsyncCopy>> async_groups;
inline thread_local std::vector<AsyncCopy> async_open;

inline void cp_async16(void* smem, const void* gmem, bool valid) {
  uint4 v{0u, 0u, 0u, 0u};
  if (valid) std::memcpy(&v, gmem, 16);
  async_open.push_back({smem, v});
}

inline void cp_async_commit() {
  async_groups.push_back(std::move(async_open));
  async_open.clear();
}

inline void cp_async_wait(int newest_in_flight) {
  while (async_groups.size() > static_cast<size_t>(newest_in_flight)) {
    for (const AsyncCopy& c : async_groups.front()) std::memcpy(c.dst, &c.data, 16);
    async_groups.erase(async_groups.begin());
  }
}
}  // namespace emu
#define PS_EMULATOR 1
