// kernels/permute_block.cuh — the parts of the permutation (kernels/permute.cu) that one block of
// kPermuteThreads threads runs: the block scan, the clearing of PermuteArgs::zero_words, and the whole
// permutation of at most kPermuteSmallEntries entries (permute_small_block). permute.cu's kernels use
// them, and so does the route launch that permutes in its one block (kernels/route.cu,
// launch_route_permute): both give the same bits.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "kernels/launch.hpp"

namespace fp4moe::kernels::permute_block {

inline constexpr int kWarps = 16;
inline constexpr int kThreads = kWarps * 32;          // the block size every function here assumes
inline constexpr int kMaxExperts = 512;
inline constexpr int kMaxBuckets = kMaxExperts + 1;   // + the bucket of invalid ids
inline constexpr int kSmallEntries = 256;             // permute_small_block's limit (O(n) loops per thread)
inline constexpr unsigned kFull = 0xFFFFFFFFu;
static_assert(kMaxExperts <= kThreads, "permute_small_block: thread e owns expert e's tiles");

// The argument checks of every permutation launch (launch_permute, launch_route_permute).
inline bool permute_args_valid(const PermuteArgs& a) {
  if (a.num_tokens < 0 || a.top_k < 1 || a.num_experts < 1 || a.num_experts > kMaxExperts || a.tile_rows < 1)
    return false;
  const int64_t n = static_cast<int64_t>(a.num_tokens) * a.top_k;
  if (n > INT32_MAX) return false;
  if (a.expert_offsets == nullptr || a.num_tiles == nullptr) return false;
  for (int r = 0; r < PermuteArgs::kZeroRanges; ++r)
    if (a.zero_count[r] < 0 || (a.zero_count[r] > 0 && a.zero_words[r] == nullptr)) return false;
  return n == 0 || (a.topk_ids != nullptr && a.row_to_entry != nullptr && a.entry_to_row != nullptr &&
                    a.tile_expert != nullptr && a.tile_row_start != nullptr);
}

__device__ __forceinline__ int bucket_of(int32_t id, int num_experts) {
  return (id >= 0 && id < num_experts) ? id : num_experts;
}

// Exclusive scan over the block of two values per thread (a0 then a1, thread order). Returns the
// prefix of a0 (a1's is that + a0) and the block total. Contains __syncthreads.
__device__ __forceinline__ int32_t block_exclusive_scan2(int32_t a0, int32_t a1, int32_t& total, int32_t* warp_sums) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int32_t local = a0 + a1;
  int32_t incl = local;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int32_t v = __shfl_up_sync(kFull, incl, off);
    if (lane >= off) incl += v;
  }
  __syncthreads();  // warp_sums may still be read by a previous scan
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  int32_t warp_prefix = 0;
  total = 0;
  for (int w = 0; w < kWarps; ++w) {
    const int32_t s = warp_sums[w];
    if (w < warp) warp_prefix += s;
    total += s;
  }
  return warp_prefix + incl - local;
}

// PermuteArgs::zero_words, by the one block of a permutation.
__device__ __forceinline__ void clear_words(const PermuteArgs& a) {
#pragma unroll
  for (int r = 0; r < PermuteArgs::kZeroRanges; ++r)
    for (int64_t i = threadIdx.x; i < a.zero_count[r]; i += kThreads) a.zero_words[r][i] = 0;
}

// ---- few entries (T*k <= kSmallEntries): no per-warp histograms ------------------------------------
// The histogram kernel's ~10 block barriers, its 16 x (E+1) histogram and the per-bucket scan over the
// warps are a fixed cost of a few us at decode (qwen3-30b-a3b T = 1: ~5.4 us, one block, ncu). With at
// most kSmallEntries entries every count is a loop over the entries' buckets in shared memory:
//   1. thread j < n loads entry j's bucket into shared memory;
//   2. thread e (every bucket e <= E) counts the entries below and in its bucket (broadcast reads):
//      expert_offsets[e] = first row of bucket e, tiles = ceil(count / tile_rows);
//   3. one block scan of the tile counts; thread e writes its expert's tiles;
//   4. thread j < n: entry j's row = first row of its bucket + the entries before j in the same bucket,
//      so the order is the histogram kernel's (stable, by entry).
// NOTE: steps 2 and 4 cost O(n) shared-memory reads per thread (n <= 256: ~1 us each, estimated from
// the instruction count); the histogram path's barriers cost a fixed 8-9 us of stage time at 64-1024
// entries (decode stage times, docs/perf.md fifteenth session).
// The ids are read through L2 (__ldcg) when they come from global memory: another kernel, or another
// warp of the block, wrote them. The route launch passes its shared-memory copy instead (no round trip).
struct SmallShared {
  int32_t bucket[kSmallEntries];
  int32_t first[kMaxBuckets];  // first row of each bucket
  int32_t warp_sums[kWarps];
};

// Every thread of a kThreads block calls it; T * k <= kSmallEntries (the launchers check). ids_shared:
// the block's own copy of a.topk_ids in shared memory (the route launch), or nullptr (read from global).
__device__ __forceinline__ void permute_small_block(const PermuteArgs& a, SmallShared& sh,
                                                    const int32_t* ids_shared = nullptr) {
  static_assert(kSmallEntries <= kThreads, "thread j loads entry j");
  const int E = a.num_experts, tid = threadIdx.x;
  const int n = a.num_tokens * a.top_k;
  clear_words(a);
  if (tid < n) sh.bucket[tid] = bucket_of(ids_shared != nullptr ? ids_shared[tid] : __ldcg(a.topk_ids + tid), E);
  __syncthreads();
  int32_t tiles = 0;  // of expert tid (E <= kThreads: thread e < E has bucket e; thread 0 also has bucket E = 512)
  for (int e = tid; e <= E; e += kThreads) {
    int32_t below = 0, in = 0;
#pragma unroll 4
    for (int j = 0; j < n; ++j) {
      const int32_t b = sh.bucket[j];
      below += b < e ? 1 : 0;
      in += b == e ? 1 : 0;
    }
    a.expert_offsets[e] = below;  // offsets[E] = the valid entries
    sh.first[e] = below;
    if (e < E) tiles = (in + a.tile_rows - 1) / a.tile_rows;
  }
  int32_t total = 0;
  const int32_t first_tile = block_exclusive_scan2(tiles, 0, total, sh.warp_sums);  // also orders sh.first
  if (tid == 0) *a.num_tiles = total;
  for (int q = 0; q < tiles; ++q) {
    a.tile_expert[first_tile + q] = tid;
    a.tile_row_start[first_tile + q] = sh.first[tid] + q * a.tile_rows;
  }
  if (tid < n) {
    const int32_t b = sh.bucket[tid];
    int32_t rank = 0;  // entries before this one in its bucket
#pragma unroll 4
    for (int j = 0; j < tid; ++j) rank += sh.bucket[j] == b ? 1 : 0;
    const int32_t row = sh.first[b] + rank;
    a.row_to_entry[row] = tid;
    a.entry_to_row[tid] = row;
  }
}

}  // namespace fp4moe::kernels::permute_block
