// kernels/permute.cu — expert-major, stable permutation of the (token, slot) entries, computed on the
// device without host synchronisation, plus the GEMM row-tile table.
//
// Entries are cut into chunks of kChunk; a block of 16 warps handles one chunk, warp w the w-th run of
// consecutive entries (256 in a full chunk; in the one-chunk kernel, the fewest multiple of 32 that
// covers the entries with 16 warps), 32 at a time. Ids outside [0, E) go to an extra bucket E placed after all
// experts: expert_offsets[E] counts the valid entries only, and those rows belong to no expert (the
// GEMMs skip them), but row_to_entry / entry_to_row stay full permutations.
//   at most 1024 entries (decode), one launch: permute_small_kernel (no histograms: counts per entry
//   warp, see kernels/permute_block.cuh); the route launch may permute up to 256 entries in its own
//   block instead (launch_route_permute, permute_small_block: the same result).
//   one chunk (T*k <= kChunk), one launch: permute_fused_kernel does every step below in one block.
//   Either way, the one-block kernel (small, fused or scan) also clears PermuteArgs::zero_words.
//   otherwise, three launches:
//     1. permute_count_kernel   per chunk: bucket counts -> scratch[chunk][E+1]
//     2. permute_scan_kernel    one block: per bucket, exclusive scan over chunks (in place); bucket
//                               totals -> exclusive scan -> expert_offsets; the tile table
//     3. permute_scatter_kernel per chunk: per-warp bucket counts (match_any), exclusive scan over the
//                               warps from expert_offsets + the chunk's base, then each warp ranks its
//                               entries in order (rank = lanes before it with the same bucket) and
//                               writes row_to_entry[row] = entry, entry_to_row[entry] = row.
// Every step is integer arithmetic in a fixed order: the result is deterministic and stable.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/dependent_launch.cuh"
#include "kernels/launch.hpp"
#include "kernels/permute_block.cuh"

namespace fp4moe::kernels {
namespace {

using permute_block::block_exclusive_scan2;
using permute_block::bucket_of;
using permute_block::clear_words;
using permute_block::kFull;
using permute_block::kMaxBuckets;
using permute_block::kMaxExperts;
using permute_block::kThreads;
using permute_block::kWarps;
constexpr int kStepsPerWarp = 8;
constexpr int kChunk = kWarps * kStepsPerWarp * 32;  // 4096 entries per block

struct PermuteShared {
  int32_t hist[kWarps][kMaxBuckets];  // per-warp bucket counts, then running row bases
  int32_t offsets[kMaxBuckets + 1];   // bucket start rows (fused kernel)
  int32_t tile_off[kMaxExperts + 1];  // first tile of each expert
  int32_t warp_sums[kWarps];
};

// Warp w's run: `steps` x 32 consecutive entries from chunk_begin + w * steps * 32 (steps <= kStepsPerWarp;
// the runs of the warps follow each other, so warp order is entry order). Its entries' buckets are
// loaded once, all before the first use (-1 past the chunk's end).
// NOTE (all loads first, runs over every warp): with 256-entry runs and one load per step between
// match_any rounds, a 512-entry permutation kept 2 of 16 warps busy for 8 dependent L2 round trips,
// twice (count, scatter): the ~11 us permute stage at 256..1024 entries.
struct RunBuckets {
  int b[kStepsPerWarp];
  int64_t first;  // entry of step 0, lane 0
  int steps;
};
__device__ __forceinline__ RunBuckets load_run(const int32_t* ids, int64_t chunk_begin, int64_t chunk_end, int steps,
                                               int num_experts) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  RunBuckets r;
  r.first = chunk_begin + static_cast<int64_t>(warp) * steps * 32;
  r.steps = steps;
#pragma unroll
  for (int s = 0; s < kStepsPerWarp; ++s) {
    const int64_t entry = r.first + s * 32 + lane;
    r.b[s] = (s < steps && entry < chunk_end) ? bucket_of(ids[entry], num_experts) : -1;
  }
  return r;
}

// Phase A: hist[w][b] = number of entries of warp w's run in bucket b. hist must be zeroed.
__device__ void count_runs(const RunBuckets& r, PermuteShared& sh) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int s = 0; s < kStepsPerWarp; ++s) {
    if (s >= r.steps) break;  // warp-uniform
    const int b = r.b[s];
    const unsigned same = __match_any_sync(kFull, b);
    if (b >= 0 && lane == __ffs(same) - 1) sh.hist[warp][b] += __popc(same);
    __syncwarp();
  }
}

// Phase B: hist[w][b] <- base(b) + sum of hist[w'][b] for w' < w.
template <typename BaseFn>
__device__ void scan_runs(int num_buckets, PermuteShared& sh, BaseFn base) {
  for (int b = threadIdx.x; b < num_buckets; b += kThreads) {
    int32_t running = base(b);
    for (int w = 0; w < kWarps; ++w) {
      const int32_t c = sh.hist[w][b];
      sh.hist[w][b] = running;
      running += c;
    }
  }
}

// Phase C: rows of the warp's run, in entry order.
__device__ void scatter_runs(const RunBuckets& r, PermuteShared& sh, int32_t* row_to_entry, int32_t* entry_to_row) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const unsigned lower = (1u << lane) - 1u;
#pragma unroll
  for (int s = 0; s < kStepsPerWarp; ++s) {
    if (s >= r.steps) break;  // warp-uniform
    const int b = r.b[s];
    const unsigned same = __match_any_sync(kFull, b);
    int32_t base = 0;
    if (b >= 0) base = sh.hist[warp][b];
    __syncwarp();
    if (b >= 0) {
      const int64_t entry = r.first + s * 32 + lane;
      const int32_t row = base + __popc(same & lower);
      if (lane == __ffs(same) - 1) sh.hist[warp][b] = base + __popc(same);
      row_to_entry[row] = static_cast<int32_t>(entry);
      entry_to_row[entry] = row;
    }
    __syncwarp();
  }
}

__device__ void zero_hist(int num_buckets, PermuteShared& sh) {
  for (int i = threadIdx.x; i < kWarps * num_buckets; i += kThreads) sh.hist[i / num_buckets][i % num_buckets] = 0;
}

// From the bucket offsets (offsets[0..E], offsets[E] = valid entries): expert_offsets and the tile
// table. Every thread of the block calls it.
__device__ void write_offsets_and_tiles(const int32_t* offsets, int num_experts, int tile_rows,
                                        const PermuteArgs& a, PermuteShared& sh) {
  for (int e = threadIdx.x; e <= num_experts; e += kThreads) a.expert_offsets[e] = offsets[e];
  // tiles per expert, two experts per thread (E <= 512 <= 2 * kThreads)
  int32_t nt[2];
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int e = 2 * threadIdx.x + q;
    nt[q] = e < num_experts ? (offsets[e + 1] - offsets[e] + tile_rows - 1) / tile_rows : 0;
  }
  int32_t total = 0;
  const int32_t first = block_exclusive_scan2(nt[0], nt[1], total, sh.warp_sums);
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int e = 2 * threadIdx.x + q;
    if (e < num_experts) sh.tile_off[e] = first + (q == 1 ? nt[0] : 0);
  }
  if (threadIdx.x == 0) {
    sh.tile_off[num_experts] = total;
    *a.num_tiles = total;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < total; i += kThreads) {
    // the last expert whose first tile is <= i (experts without tiles share their successor's start)
    int lo = 0, hi = num_experts - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (sh.tile_off[mid] <= i) lo = mid;
      else hi = mid - 1;
    }
    a.tile_expert[i] = lo;
    a.tile_row_start[i] = offsets[lo] + (i - sh.tile_off[lo]) * tile_rows;
  }
}

// ---- one chunk: everything in one block ------------------------------------------------------------
__global__ void __launch_bounds__(kThreads) permute_fused_kernel(const PermuteArgs a) {
  dependent_launch_prologue();
  __shared__ PermuteShared sh;
  const int E = a.num_experts, nb = E + 1;
  const int64_t n = static_cast<int64_t>(a.num_tokens) * a.top_k;
  // n <= kChunk: the fewest steps that cover n with every warp (at most kStepsPerWarp)
  const int steps = static_cast<int>((n + kWarps * 32 - 1) / (kWarps * 32));
  const RunBuckets run = load_run(a.topk_ids, 0, n, steps, E);  // before the clearing stores
  clear_words(a);
  zero_hist(nb, sh);
  __syncthreads();
  count_runs(run, sh);
  __syncthreads();
  // bucket totals, two buckets per thread (nb <= 513 <= 2 * kThreads), scanned into offsets
  int32_t cnt[2];
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int b = 2 * threadIdx.x + q;
    cnt[q] = 0;
    if (b < nb)
      for (int w = 0; w < kWarps; ++w) cnt[q] += sh.hist[w][b];
  }
  int32_t total = 0;
  const int32_t first = block_exclusive_scan2(cnt[0], cnt[1], total, sh.warp_sums);
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int b = 2 * threadIdx.x + q;
    if (b < nb) sh.offsets[b] = first + (q == 1 ? cnt[0] : 0);
  }
  __syncthreads();
  write_offsets_and_tiles(sh.offsets, E, a.tile_rows, a, sh);
  scan_runs(nb, sh, [&](int b) { return sh.offsets[b]; });
  __syncthreads();
  scatter_runs(run, sh, a.row_to_entry, a.entry_to_row);
}

// ---- few entries (T*k <= permute_block::kWarpCountEntries): permute_small_block_by_warp_counts -----

__global__ void __launch_bounds__(kThreads) permute_small_kernel(const PermuteArgs a) {
  dependent_launch_prologue();
  __shared__ permute_block::WarpCountShared sh;
  permute_block::permute_small_block_by_warp_counts(a, sh);
}

// ---- several chunks ------------------------------------------------------------------------------
__global__ void __launch_bounds__(kThreads) permute_count_kernel(const PermuteArgs a) {
  dependent_launch_prologue();
  __shared__ int32_t counts[kMaxBuckets];
  const int E = a.num_experts, nb = E + 1;
  const int64_t n = static_cast<int64_t>(a.num_tokens) * a.top_k;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kChunk;
  const int64_t end = begin + kChunk < n ? begin + kChunk : n;
  for (int b = threadIdx.x; b < nb; b += kThreads) counts[b] = 0;
  __syncthreads();
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) atomicAdd(&counts[bucket_of(a.topk_ids[i], E)], 1);
  __syncthreads();
  int32_t* out = static_cast<int32_t*>(a.scratch) + static_cast<int64_t>(blockIdx.x) * nb;
  for (int b = threadIdx.x; b < nb; b += kThreads) out[b] = counts[b];
}

__global__ void __launch_bounds__(kThreads) permute_scan_kernel(const PermuteArgs a, int num_chunks) {
  dependent_launch_prologue();
  __shared__ PermuteShared sh;
  const int E = a.num_experts, nb = E + 1;
  clear_words(a);
  int32_t* scratch = static_cast<int32_t*>(a.scratch);
  int32_t cnt[2];
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int b = 2 * threadIdx.x + q;
    int32_t running = 0;
    if (b < nb) {
      for (int c = 0; c < num_chunks; ++c) {
        int32_t* p = scratch + static_cast<int64_t>(c) * nb + b;
        const int32_t v = *p;
        *p = running;  // the chunk's first row within the bucket
        running += v;
      }
    }
    cnt[q] = running;
  }
  int32_t total = 0;
  const int32_t first = block_exclusive_scan2(cnt[0], cnt[1], total, sh.warp_sums);
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int b = 2 * threadIdx.x + q;
    if (b < nb) sh.offsets[b] = first + (q == 1 ? cnt[0] : 0);
  }
  __syncthreads();
  write_offsets_and_tiles(sh.offsets, E, a.tile_rows, a, sh);
}

__global__ void __launch_bounds__(kThreads) permute_scatter_kernel(const PermuteArgs a) {
  dependent_launch_prologue();
  __shared__ PermuteShared sh;
  const int E = a.num_experts, nb = E + 1;
  const int64_t n = static_cast<int64_t>(a.num_tokens) * a.top_k;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kChunk;
  const int64_t end = begin + kChunk < n ? begin + kChunk : n;
  const int32_t* chunk_base = static_cast<const int32_t*>(a.scratch) + static_cast<int64_t>(blockIdx.x) * nb;
  zero_hist(nb, sh);
  __syncthreads();
  count_runs(load_run(a.topk_ids, begin, end, kStepsPerWarp, E), sh);
  __syncthreads();
  // expert_offsets[E] is the start of the invalid-id bucket
  scan_runs(nb, sh, [&](int b) { return a.expert_offsets[b] + chunk_base[b]; });
  __syncthreads();
  // NOTE: loaded again rather than kept: held across the scan, the run's registers spilled here.
  scatter_runs(load_run(a.topk_ids, begin, end, kStepsPerWarp, E), sh, a.row_to_entry, a.entry_to_row);
}

int64_t num_chunks(int64_t num_entries) { return (num_entries + kChunk - 1) / kChunk; }

}  // namespace

size_t permute_scratch_bytes(int64_t num_entries, int64_t num_experts) {
  if (num_entries <= kChunk) return 0;  // the fused path needs no scratch
  return static_cast<size_t>(num_chunks(num_entries) * (num_experts + 1)) * sizeof(int32_t);
}

cudaError_t launch_permute(const PermuteArgs& a, cudaStream_t stream) {
  if (!permute_block::permute_args_valid(a)) return cudaErrorInvalidValue;
  const int64_t n = static_cast<int64_t>(a.num_tokens) * a.top_k;
  // NOTE: T = 0 still launches the small kernel: expert_offsets (all zero) and num_tiles (0) must be
  // written for the GEMMs that follow.
  if (n <= permute_block::kWarpCountEntries) return launch_dependent(permute_small_kernel, dim3(1), dim3(kThreads), 0, stream, a);
  if (n <= kChunk) return launch_dependent(permute_fused_kernel, dim3(1), dim3(kThreads), 0, stream, a);
  if (a.scratch == nullptr) return cudaErrorInvalidValue;
  const int64_t chunks = num_chunks(n);
  const dim3 grid(static_cast<unsigned>(chunks)), block(kThreads);
  if (cudaError_t e = launch_dependent(permute_count_kernel, grid, block, 0, stream, a); e != cudaSuccess) return e;
  if (cudaError_t e = launch_dependent(permute_scan_kernel, dim3(1), block, 0, stream, a, static_cast<int>(chunks));
      e != cudaSuccess)
    return e;
  return launch_dependent(permute_scatter_kernel, grid, block, 0, stream, a);
}

}  // namespace fp4moe::kernels
