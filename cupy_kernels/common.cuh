// Helpers shared by pagedserve's CUDA kernels.
//
// Every .cu file here compiles under both nvcc (the CI compile test) and NVRTC (CuPy RawModule
// at run time), so nothing below may include a host header: only cuda_fp16.h / cuda_bf16.h,
// which both toolchains provide. The Python side pastes this file in place of the #include.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace ps {

constexpr int kWarp = 32;

__host__ __device__ constexpr int cdiv(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ constexpr int cmin(int a, int b) { return a < b ? a : b; }
__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// Running maxima start at a finite "minus infinity", so exp2(m_old - m_new) never sees
// (-inf) - (-inf) = NaN when a whole tile is masked.
constexpr float kNegBig = -1.0e30f;

// Conversions between the storage type T and float (accumulation is always float32).
template <typename T> struct Cvt;

template <> struct Cvt<float> {
  static constexpr int kVec = 4;  // elements per 16-byte vector
  static __device__ __forceinline__ void unpack(const uint4& v, float* f) {
    f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
  }
  static __device__ __forceinline__ float2 pair(const float* p) {
    return *reinterpret_cast<const float2*>(p);
  }
  static __device__ __forceinline__ float to_f(float x) { return x; }
  static __device__ __forceinline__ float from_f(float x) { return x; }
};

template <> struct Cvt<__half> {
  static constexpr int kVec = 8;
  static __device__ __forceinline__ void unpack2(unsigned w, float* f) {
    f[0] = __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)));
    f[1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
  }
  static __device__ __forceinline__ void unpack(const uint4& v, float* f) {
    unpack2(v.x, f); unpack2(v.y, f + 2); unpack2(v.z, f + 4); unpack2(v.w, f + 6);
  }
  static __device__ __forceinline__ float2 pair(const __half* p) {
    return __half22float2(*reinterpret_cast<const __half2*>(p));
  }
  static __device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_f(float x) { return __float2half_rn(x); }
  // Two floats rounded into one 32-bit register, lo in the low half (an mma operand or a pair store).
  static __device__ __forceinline__ unsigned pack2(float lo, float hi) {
    return static_cast<unsigned>(__half_as_ushort(from_f(lo))) | (static_cast<unsigned>(__half_as_ushort(from_f(hi))) << 16);
  }
};

template <> struct Cvt<__nv_bfloat16> {
  static constexpr int kVec = 8;
  // bf16 is the top half of a float32: widening is a shift or a mask.
  static __device__ __forceinline__ void unpack2(unsigned w, float* f) {
    f[0] = __uint_as_float(w << 16);
    f[1] = __uint_as_float(w & 0xffff0000u);
  }
  static __device__ __forceinline__ void unpack(const uint4& v, float* f) {
    unpack2(v.x, f); unpack2(v.y, f + 2); unpack2(v.z, f + 4); unpack2(v.w, f + 6);
  }
  static __device__ __forceinline__ float2 pair(const __nv_bfloat16* p) {
    float f[2];
    unpack2(*reinterpret_cast<const unsigned*>(p), f);
    return make_float2(f[0], f[1]);
  }
  static __device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_f(float x) { return __float2bfloat16_rn(x); }
  static __device__ __forceinline__ unsigned pack2(float lo, float hi) {
    return static_cast<unsigned>(__bfloat16_as_ushort(from_f(lo)))
           | (static_cast<unsigned>(__bfloat16_as_ushort(from_f(hi))) << 16);
  }
};

__device__ __forceinline__ uint4 ldg16(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

__device__ __forceinline__ uint4 zero16() { return make_uint4(0u, 0u, 0u, 0u); }

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// d += a b on the tensor cores: mma.sync.aligned.m16n8k16.row.col.f32.T.T.f32, one warp, every lane
// holding its fragment registers in the PTX ISA's layout (described with the emulator's version in
// testing/kernels/emu/simt.h). Needs sm_80+. Under the SIMT emulator the same call is a warp-collective
// C++ function, so kernel sources stay identical.
template <typename T> struct MmaName;
template <> struct MmaName<__half> { static constexpr bool kBf16 = false; };
template <> struct MmaName<__nv_bfloat16> { static constexpr bool kBf16 = true; };

template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
#ifdef PS_EMULATOR
  emu::mma_m16n8k16<MmaName<T>::kBf16>(d, a, b);
#else
  if constexpr (MmaName<T>::kBf16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#endif
}

// cp.async (sm_80+): 16 bytes from global to shared memory without a register round trip, issued
// now and landed when the thread waits for its group (``valid`` false: 16 zero bytes, nothing read).
// The emulator defers each copy to the wait that covers it, so a tile read before its wait reads the
// previous contents there too.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
#ifdef PS_EMULATOR
  emu::cp_async16(smem, gmem, valid);
#else
  unsigned dst;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(dst) : "l"(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0)
               : "memory");
#endif
}

// Closes the group of this thread's copies issued since the last commit.
__device__ __forceinline__ void cp_async_commit() {
#ifdef PS_EMULATOR
  emu::cp_async_commit();
#else
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most N of this thread's committed groups (the newest) are still in flight. Other
// threads' copies are visible only after a __syncthreads() that follows their waits.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifdef PS_EMULATOR
  emu::cp_async_wait(N);
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

}  // namespace ps
