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
// entries (decode stage times).
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

// ---- up to two entries per thread, counted by entry warps (the permute launch) ---------------------
// The same permutation as permute_small_block (the same rows, tiles and offsets: the order is stable
// by entry), for up to kWarpCountEntries = 2 * kThreads entries, with its O(n) loops per thread replaced by
// counts per entry warp (entry warp v: entries 32 v .. 32 v + 31; n <= 1024: 32 entry warps):
//   1. thread j holds the buckets of entries j and kThreads + j in registers (entry warps w and
//      kWarps + w for the threads of warp w); the block clears the [32][E+1] counts;
//   2. for each of its two entry warps, warp w: __match_any_sync groups its lanes by bucket; the lowest
//      lane of each group writes the group's size to counts[v][b] (one writer per (v, b): no atomics);
//   3. thread e < E: in = sum over the entry warps of counts[v][e], tiles = ceil(in / tile_rows); one
//      block scan of (in << 16 | tiles) (both sums <= 1536 fit 16 bits) gives the first row and the
//      first tile of every expert; bucket E (invalid ids) starts after every expert;
//   4. each entry: row = first row of its bucket + the entries of its bucket in the earlier entry warps
//      + its group's lanes below it.
// NOTE: permute_small_block's loops cost ~2.6 us of issue in one SM at n = 256 (129 bucket threads x
// 256 entries x 5 instructions, SASS count); here each entry reads at most 31 counts in step 4. From
// 257 to 512 entries it replaced permute_fused_kernel (a 16 x (E+1) histogram, ~10 block barriers:
// 7.5 us of stage time at qwen3-235b-a22b T = 64); the second entry per thread takes it to 1024 entries
// (permute_fused_kernel took 6-10 us at 1024 entries, T = 128 with top-8). Used by the permute launch
// only: in the route launch that permutes (kernels/route.cu) this form made the route stage faster but
// the qwen3 layers slower at T = 1 and 16 (A/B), not explained; there permute_small_block stays.
inline constexpr int kEntriesPerThread = 2;
inline constexpr int kWarpCountEntries = kEntriesPerThread * kThreads;  // permute_small_block_by_warp_counts's limit
inline constexpr int kEntryWarps = kWarpCountEntries / 32;
inline constexpr int kCountStride = (kMaxBuckets + 3) / 4 * 4;  // bytes per entry warp: whole words
struct WarpCountShared {
  alignas(16) uint8_t counts[kEntryWarps][kCountStride];  // [entry warp][bucket], <= 32: a byte
  int32_t first[kMaxBuckets];                                  // first row of each bucket
  // NOTE: 16-byte aligned: the scan reads warp_sums as LDS.128, which at first's end (0x2844) also read
  // first[512], a word other threads store after the scan (racecheck reported the overlap; SASS).
  alignas(16) int32_t warp_sums[kWarps];
};

// Every thread of a kThreads block calls it; T * k <= kWarpCountEntries (the launcher checks). The ids come
// from global memory through L2 (__ldcg): the route launch wrote them.
__device__ __forceinline__ void permute_small_block_by_warp_counts(const PermuteArgs& a, WarpCountShared& sh) {
  static_assert(kMaxExperts <= kThreads, "thread e holds expert e");
  static_assert(kWarpCountEntries + kMaxExperts < (1 << 16), "entries and tiles share one 32-bit scan value");
  const int E = a.num_experts, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int n = a.num_tokens * a.top_k;
  const int entry_warps = (n + 31) / 32;
  clear_words(a);
  // 1. the buckets of entries tid and kThreads + tid (both loads before any use); the counts cleared
  int32_t b[kEntriesPerThread];
  bool has[kEntriesPerThread];
#pragma unroll
  for (int q = 0; q < kEntriesPerThread; ++q) {
    const int j = q * kThreads + tid;
    has[q] = j < n;
    b[q] = has[q] ? bucket_of(__ldcg(a.topk_ids + j), E) : -1;
  }
  for (int i = tid; i < entry_warps * kCountStride / 4; i += kThreads) reinterpret_cast<uint32_t*>(&sh.counts[0][0])[i] = 0;
  __syncthreads();
  // 2. per entry warp, the lanes of each bucket (warp-uniform: v < entry_warps)
  unsigned peers[kEntriesPerThread] = {};
#pragma unroll
  for (int q = 0; q < kEntriesPerThread; ++q) {
    const int v = q * kWarps + warp;
    if (v < entry_warps) {
      const unsigned active = __ballot_sync(kFull, has[q]);
      if (has[q]) {
        peers[q] = __match_any_sync(active, b[q]);
        if (lane == __ffs(peers[q]) - 1) sh.counts[v][b[q]] = static_cast<uint8_t>(__popc(peers[q]));
      }
    }
  }
  __syncthreads();
  // 3. per expert: entries and tiles; one scan of both
  int32_t in = 0, tiles = 0;
  if (tid < E) {
    for (int v = 0; v < entry_warps; ++v) in += sh.counts[v][tid];
    tiles = (in + a.tile_rows - 1) / a.tile_rows;
  }
  int32_t total = 0;
  const int32_t prefix = block_exclusive_scan2((in << 16) | tiles, 0, total, sh.warp_sums);
  const int32_t first_row = prefix >> 16, first_tile = prefix & 0xFFFF;
  const int32_t valid = total >> 16;  // entries with an id in [0, E)
  if (tid < E) {
    a.expert_offsets[tid] = first_row;
    sh.first[tid] = first_row;
    for (int q = 0; q < tiles; ++q) {
      a.tile_expert[first_tile + q] = tid;
      a.tile_row_start[first_tile + q] = first_row + q * a.tile_rows;
    }
  }
  if (tid == 0) {
    a.expert_offsets[E] = valid;  // offsets[E] = the valid entries
    sh.first[E] = valid;          // invalid ids: rows after every expert
    *a.num_tiles = total & 0xFFFF;
  }
  __syncthreads();  // sh.first
  // 4. rows
#pragma unroll
  for (int q = 0; q < kEntriesPerThread; ++q) {
    if (!has[q]) continue;
    const int v = q * kWarps + warp, j = q * kThreads + tid;
    int32_t rank = __popc(peers[q] & ((1u << lane) - 1u));  // its group's lanes below it in its entry warp
    for (int w = 0; w < v; ++w) rank += sh.counts[w][b[q]];
    const int32_t row = sh.first[b[q]] + rank;
    a.row_to_entry[row] = j;
    a.entry_to_row[j] = row;
  }
}

}  // namespace fp4moe::kernels::permute_block
