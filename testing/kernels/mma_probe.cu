// One m16n8k16 product per warp through ps::mma_m16n8k16, fragments loaded straight from the PTX
// ISA's layout formulas (gid = lane / 4, t = lane % 4). Tests run it on the emulator and on a GPU
// against a plain matrix product: a wrong layout in either the emulator or the kernels' use of it shows.
#include "common.cuh"

template <typename T>
__global__ void ps_mma_probe(float* d,                  // [warps, 16, 8]
                             const unsigned short* a,   // [warps, 16, 16] row-major f16/bf16 bits
                             const unsigned short* b,   // [warps, 16, 8] (k, n) row-major bits
                             const float* c) {          // [warps, 16, 8]
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32, gid = lane / 4, t = lane % 4;
  a += w * 256;
  b += w * 128;
  c += w * 128;
  d += w * 128;
  unsigned af[4], bf[2];
  float acc[4];
  for (int i = 0; i < 4; ++i) {  // a[i]: row gid (+8 if i odd), columns 2t, 2t+1 (+8 if i >= 2)
    const unsigned short* p = a + (gid + 8 * (i & 1)) * 16 + 2 * t + 8 * (i >> 1);
    af[i] = p[0] | (static_cast<unsigned>(p[1]) << 16);
  }
  for (int j = 0; j < 2; ++j) {  // b[j]: k rows 2t, 2t+1 (+8 if j), column gid
    const unsigned short* p = b + (2 * t + 8 * j) * 8 + gid;
    bf[j] = p[0] | (static_cast<unsigned>(p[8]) << 16);
  }
  for (int i = 0; i < 4; ++i) acc[i] = c[(gid + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)];
  ps::mma_m16n8k16<T>(acc, af, bf);
  for (int i = 0; i < 4; ++i) d[(gid + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)] = acc[i];
}
