// bench/micro/weight_stream_pattern.cu — how fast can 16 warps per SM stream prepacked FP4 weights,
// by layout, with no decode or MMA? The streaming expert GEMM reads, per warp and K chunk, 512 B of
// each of two row groups; this measures that access pattern against more contiguous ones, with the
// same loads in flight per lane (4 chunks x 2 x 16 B), 256 threads per CTA, 2 CTAs per SM.
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a bench/micro/weight_stream_pattern.cu -o wsp
//   ./wsp [groups=60416] [chunks=56]     (defaults: deepseek-r1 GEMM1, 118 experts hit, K = 7168)
//
// Layouts (CTA b owns row groups 16b..16b+15, warp w the groups 16b+2w, 16b+2w+1, over all chunks):
//   group-major    (group, chunk): the prepacked layout; a warp reads 2 x 512 B 28 KB apart per chunk
//   pair-major     (pair, chunk, 2): a warp's 2 x 512 B of one chunk are adjacent (1 KB)
//   cta-major      (cta, chunk, 16): a CTA's 16 x 512 B of one chunk are adjacent (8 KB)
//   linear         each warp reads a contiguous range, 1 KB per step (the ideal)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda_check.cuh"  // CHECK

__device__ __forceinline__ uint4 ldg128(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

template <int kLayout>
__device__ __forceinline__ int64_t offset(int64_t cta, int warp, int half, int64_t chunk, int64_t chunks) {
  const int64_t group = cta * 16 + 2 * warp + half;
  if constexpr (kLayout == 0) return (group * chunks + chunk) * 512;
  if constexpr (kLayout == 1) return (((group / 2) * chunks + chunk) * 2 + half) * 512;
  if constexpr (kLayout == 2) return ((cta * chunks + chunk) * 16 + 2 * warp + half) * 512;
  // linear: warp (cta, w) owns [2 * chunks * 512) bytes, 1 KB per chunk step
  return ((cta * 8 + warp) * chunks + chunk) * 1024 + half * 512;
}

template <int kLayout>
__global__ void __launch_bounds__(256, 2) stream_kernel(const uint8_t* w, int chunks, uint32_t* sink) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t cta = blockIdx.x;
  uint32_t acc = 0;
  for (int c = 0; c < chunks; c += 4) {
    uint4 v[4][2];
#pragma unroll
    for (int d = 0; d < 4; ++d)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        v[d][h] = c + d < chunks ? ldg128(w + offset<kLayout>(cta, warp, h, c + d, chunks) + lane * 16)
                                 : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int d = 0; d < 4; ++d)
#pragma unroll
      for (int h = 0; h < 2; ++h) acc ^= v[d][h].x ^ v[d][h].y ^ v[d][h].z ^ v[d][h].w;
  }
  if (acc == 0x12345678u) sink[0] = acc;  // keeps the loads; practically never stores
}

int main(int argc, char** argv) {
  const int64_t groups = argc > 1 ? std::atoll(argv[1]) : 60416;
  const int chunks = argc > 2 ? std::atoi(argv[2]) : 56;
  const int64_t bytes = groups * chunks * 512;
  const int64_t ctas = groups / 16;
  uint8_t* w = nullptr;
  uint32_t* sink = nullptr;
  CHECK(cudaMalloc(&w, bytes));
  CHECK(cudaMalloc(&sink, 4));
  CHECK(cudaMemset(w, 0x5A, bytes));
  // A buffer larger than L2 rewritten between runs keeps the weights cold.
  const size_t flush_bytes = size_t{256} << 20;
  uint8_t* flush = nullptr;
  CHECK(cudaMalloc(&flush, flush_bytes));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  const char* names[4] = {"group-major (prepacked)", "pair-major", "cta-major", "linear"};
  std::printf("weights %.2f GB, %lld CTAs of 256 threads, %d chunks\n", bytes / 1e9, static_cast<long long>(ctas), chunks);
  for (int layout = 0; layout < 4; ++layout) {
    std::vector<float> ms;
    for (int rep = 0; rep < 12; ++rep) {
      CHECK(cudaMemsetAsync(flush, rep, flush_bytes));
      CHECK(cudaEventRecord(e0));
      switch (layout) {
        case 0: stream_kernel<0><<<ctas, 256>>>(w, chunks, sink); break;
        case 1: stream_kernel<1><<<ctas, 256>>>(w, chunks, sink); break;
        case 2: stream_kernel<2><<<ctas, 256>>>(w, chunks, sink); break;
        default: stream_kernel<3><<<ctas, 256>>>(w, chunks, sink); break;
      }
      CHECK(cudaGetLastError());
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      float t = 0;
      CHECK(cudaEventElapsedTime(&t, e0, e1));
      if (rep >= 2) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    const float med = ms[ms.size() / 2];
    std::printf("%-26s %8.1f us  %6.2f TB/s (read)\n", names[layout], med * 1e3, bytes / (med * 1e-3) / 1e12);
  }
  return 0;
}
