// bench/micro/tma_ring_depth.cu — is a small decode grid bound by the bytes its rings keep in flight?
// The streaming expert GEMM (kernels/expert_gemm_stream_sm90.cuh) streams each CTA's K chunks through a
// shared-memory ring: per chunk, 16 bulk copies of 512 B (the CTA's 16 row groups, one chunk each,
// `chunks * 512` B apart in the prepacked layout) and 1 KB of scales, with `prefetch` chunks in flight.
// This kernel does the same copies with no decode and no MMA (each warp reads one word of the stage and
// optionally spins `work` cycles, a stand-in for the decode), so that its time per chunk at a given
// grid and depth is the memory side's share of the GEMM's.
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a bench/micro/tma_ring_depth.cu -o trd
//   ./trd            (a table over grids, depths, chunk counts and work; one line per case)
//
// Steps per CTA (256 threads, 8 warps; ring of kStages stages of 9 KB):
//   1. thread 0 initialises full[s] (1 arrival + the bytes) and empty[s] (8 arrivals: one per warp);
//   2. thread 0 issues chunks 0 .. prefetch-1;
//   3. per chunk c: thread 0 refills chunk c + prefetch once every warp is done with the stage's previous
//      chunk (empty[]), every warp waits for full[] of chunk c, reads one word, spins, arrives on empty[].
// Reading the output: grid 96-132 is a one-wave decode grid (T = 1, one CTA per SM); if its time per
// chunk falls with `prefetch`, bytes in flight bound the GEMM there.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda_check.cuh"  // CHECK

constexpr int kStages = 8;
constexpr int kGroups = 16;                               // row groups per CTA
constexpr int kPieceBytes = 512;                          // one row group's weights of one chunk
constexpr int kScaleBytes = 1024;                         // the CTA's scales of one chunk
constexpr int kStageBytes = kGroups * kPieceBytes + kScaleBytes;  // 9 KB
constexpr int kSmemBytes = kStages * kStageBytes + 2 * kStages * 8;

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared.b64 p, [%0], %1;\n @!p bra W;\n}" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// weights: [ctas * kGroups][chunks][512 B]; scales: [ctas][chunks][1 KB].
__global__ void __launch_bounds__(256) ring_kernel(const uint8_t* weights, const uint8_t* scales, int chunks,
                                                   int prefetch, int work, uint32_t* sink) {
  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t base = smem_u32(smem);
  const uint32_t full = base + kStages * kStageBytes, empty = full + kStages * 8;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t cta = blockIdx.x;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full + 8 * s, 1);
      mbar_init(empty + 8 * s, 8);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  auto issue = [&](int c) {  // chunk c into stage c % kStages (thread 0)
    const int s = c % kStages;
    const uint32_t dst = base + s * kStageBytes, bar = full + 8 * s;
    mbar_expect_tx(bar, kStageBytes);
    for (int g = 0; g < kGroups; ++g)
      bulk_copy(dst + g * kPieceBytes, weights + ((cta * kGroups + g) * chunks + c) * kPieceBytes, kPieceBytes, bar);
    bulk_copy(dst + kGroups * kPieceBytes, scales + (cta * chunks + c) * kScaleBytes, kScaleBytes, bar);
  };
  if (tid == 0)
    for (int c = 0; c < prefetch && c < chunks; ++c) issue(c);
  uint32_t acc = 0;
  for (int c = 0; c < chunks; ++c) {
    const int n = c + prefetch;
    if (tid == 0 && n < chunks) {
      // The stage of chunk n held chunk n - kStages: wait until every warp is done with it.
      if (n >= kStages) mbar_wait(empty + 8 * (n % kStages), ((n / kStages) - 1) & 1);
      issue(n);
    }
    const int s = c % kStages;
    mbar_wait(full + 8 * s, (c / kStages) & 1);
    acc += *reinterpret_cast<const volatile uint32_t*>(smem + s * kStageBytes + (warp * 32 + lane) * 4 % kStageBytes);
    if (work > 0) {
      const long long t0 = clock64();
      while (clock64() - t0 < work) {
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(empty + 8 * s);
  }
  if (acc == 0x12345678u) sink[0] = acc;  // keeps the reads
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaFuncSetAttribute(ring_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  const int max_ctas = 4 * sms, max_chunks = 56;
  uint8_t *w, *sc, *flush;
  uint32_t* sink;
  const size_t w_bytes = size_t(max_ctas) * kGroups * max_chunks * kPieceBytes;
  const size_t s_bytes = size_t(max_ctas) * max_chunks * kScaleBytes;
  const size_t flush_bytes = size_t(256) << 20;
  CHECK(cudaMalloc(&w, w_bytes));
  CHECK(cudaMalloc(&sc, s_bytes));
  CHECK(cudaMalloc(&flush, flush_bytes));
  CHECK(cudaMalloc(&sink, 4));
  CHECK(cudaMemset(w, 1, w_bytes));
  CHECK(cudaMemset(sc, 2, s_bytes));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  {  // the launch and event overhead inside every time below: the same grid with no chunks
    std::vector<float> ms;
    for (int rep = 0; rep < 12; ++rep) {
      CHECK(cudaEventRecord(a));
      ring_kernel<<<sms, 256, kSmemBytes>>>(w, sc, 0, 2, 0, sink);
      CHECK(cudaEventRecord(b));
      CHECK(cudaEventSynchronize(b));
      float t;
      CHECK(cudaEventElapsedTime(&t, a, b));
      ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    std::printf("no chunks (launch + events): %.2f us\n", 1e3 * ms[ms.size() / 2]);
  }
  std::printf("%6s %7s %9s %5s %10s %10s %12s\n", "ctas", "chunks", "prefetch", "work", "us", "TB/s", "us/chunk");
  for (int ctas : {sms * 3 / 4, sms, 2 * sms, 4 * sms})
    for (int chunks : {16, 56})
      for (int work : {0, 600})
        for (int prefetch : {1, 2, 3, 4, 6}) {
          std::vector<float> ms;
          for (int rep = 0; rep < 12; ++rep) {
            CHECK(cudaMemsetAsync(flush, rep, flush_bytes));  // weights cold in HBM, as in the bench
            CHECK(cudaEventRecord(a));
            ring_kernel<<<ctas, 256, kSmemBytes>>>(w, sc, chunks, prefetch, work, sink);
            CHECK(cudaEventRecord(b));
            CHECK(cudaEventSynchronize(b));
            float t;
            CHECK(cudaEventElapsedTime(&t, a, b));
            if (rep >= 2) ms.push_back(t);
          }
          CHECK(cudaGetLastError());
          std::sort(ms.begin(), ms.end());
          const double us = 1e3 * ms[ms.size() / 2];
          const double bytes = double(ctas) * chunks * kStageBytes;
          std::printf("%6d %7d %9d %5d %10.2f %10.2f %12.3f\n", ctas, chunks, prefetch, work, us, bytes / us * 1e-6,
                      us / chunks);
        }
  return 0;
}
