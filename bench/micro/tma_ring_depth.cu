// bench/micro/tma_ring_depth.cu — is a small decode grid bound by the bytes its rings keep in flight, or
// by where those bytes lie? The streaming expert GEMM (kernels/sm90_expert_gemm_stream.cuh) streams each
// CTA's K chunks through a shared-memory ring: per chunk, one bulk tensor copy of the CTA's 16 row groups
// (512 B each, `chunks * 512` B apart in the prepacked layout [group][chunk][512 B]) and one of their
// scales (16 x 64 B, `chunks * 64` B apart), with `prefetch` chunks in flight. This kernel does the same
// copies with no decode and no MMA (each warp reads one word of the stage and optionally spins `work`
// cycles, a stand-in for the decode), so that its time per chunk at a given grid and depth is the
// memory side's share of the GEMM's. Two L2 flushes before each launch (column `flush`): `write` (a
// 256 MiB memset: the L2 is left dirty, and every line the ring's reads replace is written back first)
// and `read` (a 256 MiB read: the L2 is left clean). Three ways to fetch a chunk (column `layout`):
//   0 group-major, tensor copies  the kernels' layout and copies (2 copies per chunk)
//   1 chunk-major, tensor copies  [cta][chunk][16 groups x 512 B]: a chunk is 8 KB + 1 KB contiguous
//   2 group-major, 17 bulk copies one cp.async.bulk per row group (512 B) + one for the scales (1 KB,
//                                 contiguous: chunk-major)
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a bench/micro/tma_ring_depth.cu -o trd
//   ./trd            (a table over layouts, grids, depths, chunk counts and work; one line per case)
//
// Steps per CTA (256 threads, 8 warps; ring of kStages stages of 9 KB):
//   1. thread 0 initialises full[s] (1 arrival + the bytes) and empty[s] (8 arrivals: one per warp);
//   2. thread 0 issues chunks 0 .. prefetch-1;
//   3. per chunk c: thread 0 refills chunk c + prefetch once every warp is done with the stage's previous
//      chunk (empty[]), every warp waits for full[] of chunk c, reads one word, spins, arrives on empty[].
// Reading the output: grid 99-132 is a one-wave decode grid (T = 1, one CTA per SM); if its time per
// chunk falls with `prefetch`, bytes in flight bound the GEMM there; if layout 1 is faster than 0, the
// placement of a chunk's bytes in HBM does; `write` against `read` is the cost of the dirty L2.
// H200: layouts 0 and 1 within 3%; layout 2 1.3-1.6x
// slower at one CTA per SM (17 copies per chunk); 132 CTAs x 16 chunks, prefetch 2: write 12.99 us,
// read 10.75 us (4.1 us of it launch and events).
#include <cuda.h>  // CUtensorMap
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "../../runner/l2_flush.cuh"  // the bench's read flush
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

__device__ __forceinline__ void tensor_copy_3d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1,
                                               int c2) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
               "[%2];" ::"r"(dst),
               "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}

struct Maps {
  CUtensorMap w, scale;  // layout 0: (word, chunk, group) boxes of 16 groups; layout 1: (word, group * chunk, cta)
};

// Layout 0 and 2: weights [ctas * kGroups][chunks][512 B], scales [ctas * kGroups][chunks][64 B].
// Layout 1: weights [ctas][chunks][kGroups * 512 B], scales [ctas][chunks][kGroups * 64 B].
__global__ void __launch_bounds__(256) ring_kernel(const __grid_constant__ Maps maps, const uint8_t* weights,
                                                   const uint8_t* scales, int layout, int chunks, int prefetch,
                                                   int work, uint32_t* sink) {
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
    if (layout == 0) {
      tensor_copy_3d(dst, &maps.w, bar, 0, c, int(cta) * kGroups);
      tensor_copy_3d(dst + kGroups * kPieceBytes, &maps.scale, bar, 0, c, int(cta) * kGroups);
    } else if (layout == 1) {
      tensor_copy_3d(dst, &maps.w, bar, 0, c * kGroups, int(cta));
      tensor_copy_3d(dst + kGroups * kPieceBytes, &maps.scale, bar, 0, c * kGroups, int(cta));
    } else {
      for (int g = 0; g < kGroups; ++g)
        bulk_copy(dst + g * kPieceBytes, weights + ((cta * kGroups + g) * chunks + c) * kPieceBytes, kPieceBytes, bar);
      bulk_copy(dst + kGroups * kPieceBytes, scales + (cta * chunks + c) * kScaleBytes, kScaleBytes, bar);
    }
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

// cuTensorMapEncodeTiled from the driver (through the runtime: no link against libcuda).
void encode(CUtensorMap& map, const void* ptr, const cuuint64_t (&dims)[3], const cuuint64_t (&strides)[2],
            const cuuint32_t (&box)[3]) {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess) std::exit(1);
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = fn(&map, CU_TENSOR_MAP_DATA_TYPE_UINT32, 3, const_cast<void*>(ptr), dims, strides, box, elem_strides,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "cuTensorMapEncodeTiled: error %d\n", int(r));
    std::exit(1);
  }
}

// The maps of one layout for `ctas` CTAs of `chunks` chunks each.
Maps make_maps(int layout, const uint8_t* w, const uint8_t* sc, int ctas, int chunks) {
  Maps m{};
  if (layout == 1) {  // (word, chunk, cta) with a chunk of kGroups * 128 words: box = one whole chunk
    // NOTE: a box dimension holds at most 256 elements: the chunk's 2048 words are a box of 16 rows of 128.
    encode(m.w, w, {128, cuuint64_t(kGroups) * chunks, cuuint64_t(ctas)},
           {512, cuuint64_t(kGroups) * chunks * 512}, {128, kGroups, 1});
    encode(m.scale, sc, {16, cuuint64_t(kGroups) * chunks, cuuint64_t(ctas)},
           {64, cuuint64_t(kGroups) * chunks * 64}, {16, kGroups, 1});
  } else {  // (word, chunk, group): box = kGroups groups of one chunk
    encode(m.w, w, {128, cuuint64_t(chunks), cuuint64_t(ctas) * kGroups}, {512, cuuint64_t(chunks) * 512},
           {128, 1, kGroups});
    encode(m.scale, sc, {16, cuuint64_t(chunks), cuuint64_t(ctas) * kGroups}, {64, cuuint64_t(chunks) * 64},
           {16, 1, kGroups});
  }
  return m;
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
  // Times one launch per rep after an L2 flush (weights cold in HBM, as in the bench); median of 10.
  CHECK(cudaMemset(flush, 0, flush_bytes));
  auto time_us = [&](const Maps& maps, int layout, int ctas, int chunks, int prefetch, int work, bool read_flush) {
    std::vector<float> ms;
    for (int rep = 0; rep < 12; ++rep) {
      if (read_flush) fp4moe::l2flush::launch_read(flush, flush_bytes, sink, sms, 0);
      else CHECK(cudaMemsetAsync(flush, rep, flush_bytes));
      CHECK(cudaEventRecord(a));
      ring_kernel<<<ctas, 256, kSmemBytes>>>(maps, w, sc, layout, chunks, prefetch, work, sink);
      CHECK(cudaEventRecord(b));
      CHECK(cudaEventSynchronize(b));
      float t;
      CHECK(cudaEventElapsedTime(&t, a, b));
      if (rep >= 2) ms.push_back(t);
    }
    CHECK(cudaGetLastError());
    std::sort(ms.begin(), ms.end());
    return 1e3 * ms[ms.size() / 2];
  };
  const Maps warm = make_maps(0, w, sc, sms, 16);
  for (int i = 0; i < 20; ++i) time_us(warm, 0, 4 * sms, 56, 2, 0, false);  // the clocks up before the first row
  // The launch and event overhead inside every time below: the same grid with no chunks.
  std::printf("no chunks (launch + events): %.2f us\n", time_us(warm, 0, sms, 0, 2, 0, true));
  std::printf("%6s %6s %6s %7s %9s %5s %10s %10s %12s\n", "flush", "layout", "ctas", "chunks", "prefetch", "work", "us",
              "TB/s", "us/chunk");
  for (int ctas : {sms * 3 / 4, sms, 2 * sms, 4 * sms})
    for (int chunks : {16, 56})
      for (int layout : {0, 1, 2}) {
        const Maps maps = make_maps(layout, w, sc, ctas, chunks);
        for (bool read_flush : {false, true})
          for (int work : {0, 600})
            for (int prefetch : {1, 2, 4, 6}) {
              if ((work > 0 || layout > 0) && prefetch != 2) continue;
              const double us = time_us(maps, layout, ctas, chunks, prefetch, work, read_flush);
              const double bytes = double(ctas) * chunks * kStageBytes;
              std::printf("%6s %6d %6d %7d %9d %5d %10.2f %10.2f %12.3f\n", read_flush ? "read" : "write", layout, ctas,
                          chunks, prefetch, work, us, bytes / us * 1e-6, us / chunks);
            }
      }
  return 0;
}
