// kernels/ep_dispatch.cu — the expert-parallel all-to-all plan and its row gathers, on the device.
//
// The plan of one source's S rows over N ranks (runner/ep_dispatch.hpp: ep::plan_dispatch, the CPU
// oracle, gives the same outputs), in one block of kThreads threads, thread t owning the contiguous
// rows [t * chunk, (t + 1) * chunk):
//   1. every entry whose id is outside [0, E) gets gather_index -1;
//   2. for each destination d in order: each thread counts its rows with an id on d and their slots
//      on d, two block-wide exclusive scans turn the counts into positions after the rows (entries) of
//      ranks < d, and each thread writes its rows' send_rows, local send_ids and gather_index (the
//      entry's position among the returned entries) in ascending row order;
//   3. send_offsets[d + 1] / send_entry_offsets[d + 1] = the rows / entries for ranks <= d.
// Integer work in a fixed order: deterministic, and destination-major with ascending rows as the CPU
// plan defines it. NOTE: one block reads the ids N times; the plan is a few microseconds at decode and
// stays small next to the GEMMs at prefill (S * rows_top_k ids are at most a few MB, from L2).
//
// compact_entries lists a destination's entries with a local id in ascending order (the y rows it
// returns), in one block the same way.
//
// gather_rows copies whole rows by an index (the destinations' send buffers, or the combined y back
// into entry order) in the widest word that the row size and both pointers allow.
//
// The all-gather scheme's two element-wise kernels: localize_ids maps the gathered whole-layer ids to
// this rank's (-1 for another rank's expert), sum_partials adds the ranks' fp32 partial outputs in rank
// order (four elements per thread) and rounds once.
#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/launch.hpp"

namespace fp4moe::kernels {
namespace {

constexpr int kThreads = 1024;

// io::expert_range's split: ranks below rem hold base + 1 experts, the others base.
struct ExpertSplit {
  int base, rem;
  __device__ int first(int d) const { return d * base + min(d, rem); }
  __device__ int owner(int e, int num_experts) const {
    if (e < 0 || e >= num_experts) return -1;
    const int big = rem * (base + 1);
    return e < big ? e / (base + 1) : rem + (e - big) / base;
  }
};

__global__ void __launch_bounds__(kThreads) ep_plan_kernel(EpPlanArgs a) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  const ExpertSplit split{a.num_experts / a.ranks, a.num_experts % a.ranks};
  const int rk = a.rows_top_k;
  const int chunk = (a.num_rows + kThreads - 1) / kThreads;
  const int row_begin = min(a.num_rows, int(threadIdx.x) * chunk);
  const int row_end = min(a.num_rows, row_begin + chunk);
  for (int s = row_begin; s < row_end; ++s)
    for (int j = 0; j < rk; ++j)
      if (split.owner(a.ids[s * rk + j], a.num_experts) < 0) a.gather_index[s * rk + j] = -1;
  if (threadIdx.x == 0) a.send_offsets[0] = 0, a.send_entry_offsets[0] = 0;
  int base = 0, entry_base = 0;  // rows / entries sent to ranks < d (the same values in every thread)
  for (int d = 0; d < a.ranks; ++d) {
    int count = 0, entry_count = 0;
    for (int s = row_begin; s < row_end; ++s) {
      int mine = 0;
      for (int j = 0; j < rk; ++j) mine += split.owner(a.ids[s * rk + j], a.num_experts) == d;
      count += mine > 0;
      entry_count += mine;
    }
    int pos = 0, total = 0, entry_pos = 0, entry_total = 0;
    Scan(scan_storage).ExclusiveSum(count, pos, total);
    __syncthreads();  // scan_storage is reused by the next scan
    Scan(scan_storage).ExclusiveSum(entry_count, entry_pos, entry_total);
    __syncthreads();
    pos += base;
    entry_pos += entry_base;
    const int first = split.first(d);
    for (int s = row_begin; s < row_end; ++s) {
      bool here = false;
      for (int j = 0; j < rk; ++j) here |= split.owner(a.ids[s * rk + j], a.num_experts) == d;
      if (!here) continue;
      a.send_rows[pos] = s;
      for (int j = 0; j < rk; ++j) {
        const int e = a.ids[s * rk + j];
        const bool mine = split.owner(e, a.num_experts) == d;
        a.send_ids[pos * rk + j] = mine ? e - first : -1;
        if (mine) a.gather_index[s * rk + j] = entry_pos++;
      }
      ++pos;
    }
    base += total;
    entry_base += entry_total;
    if (threadIdx.x == 0) a.send_offsets[d + 1] = base, a.send_entry_offsets[d + 1] = entry_base;
  }
}

__global__ void __launch_bounds__(kThreads) compact_entries_kernel(CompactEntriesArgs a) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  const int chunk = (a.num_entries + kThreads - 1) / kThreads;
  const int begin = min(a.num_entries, int(threadIdx.x) * chunk), end = min(a.num_entries, begin + chunk);
  int count = 0;
  for (int e = begin; e < end; ++e) count += a.ids[e] >= 0;
  int pos = 0;
  Scan(scan_storage).ExclusiveSum(count, pos);
  for (int e = begin; e < end; ++e)
    if (a.ids[e] >= 0) a.list[pos++] = e;
}

// One warp per row, Word-sized copies (row_bytes a multiple of sizeof(Word), both pointers aligned to it).
template <typename Word>
__global__ void gather_rows_kernel(GatherRowsArgs a) {
  const int rows = a.device_count ? min(a.max_rows, *a.device_count) : a.max_rows;
  const int64_t words = a.row_bytes / int64_t(sizeof(Word));
  const int warps = int(gridDim.x * blockDim.x / 32);
  for (int i = int((blockIdx.x * blockDim.x + threadIdx.x) / 32); i < rows; i += warps) {
    const int from = a.index[i];
    if (from < 0) continue;
    const Word* src = static_cast<const Word*>(a.src) + int64_t(from) * words;
    Word* dst = static_cast<Word*>(a.dst) + int64_t(i) * words;
    for (int64_t w = threadIdx.x % 32; w < words; w += 32) dst[w] = src[w];
  }
}

bool aligned(const void* p, int64_t bytes, size_t word) {
  return bytes % int64_t(word) == 0 && reinterpret_cast<uintptr_t>(p) % word == 0;
}

}  // namespace

cudaError_t launch_ep_plan(const EpPlanArgs& a, cudaStream_t stream) {
  if (a.ranks < 1 || a.ranks > a.num_experts || a.rows_top_k < 1 || a.num_rows < 0) return cudaErrorInvalidValue;
  // NOTE: positions are int32: every sent slot (S * min(N, rows_top_k) * rows_top_k) must index in it.
  if (int64_t(a.num_rows) * std::min(a.ranks, a.rows_top_k) * a.rows_top_k >= (int64_t(1) << 31))
    return cudaErrorInvalidValue;
  ep_plan_kernel<<<1, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

__global__ void localize_ids_kernel(LocalizeIdsArgs a) {
  for (int i = int(blockIdx.x * blockDim.x + threadIdx.x); i < a.num_ids; i += int(gridDim.x * blockDim.x)) {
    const int id = a.ids[i];
    a.local[i] = id >= a.first_expert && id < a.first_expert + a.num_local_experts ? id - a.first_expert : -1;
  }
}

__global__ void sum_partials_kernel(SumPartialsArgs a) {
  const int64_t n4 = int64_t(a.num_tokens) * a.hidden_size / 4;
  const float4* partials = reinterpret_cast<const float4*>(a.partials);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x) {
    float4 sum = partials[i];
    for (int s = 1; s < a.ranks; ++s) {
      const float4 v = partials[int64_t(s) * n4 + i];
      sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
    }
    if (a.topk_ids) {
      const int t = int(i / (a.hidden_size / 4));
      bool invalid = false;
      for (int j = 0; j < a.top_k; ++j) {
        const int id = a.topk_ids[int64_t(t) * a.top_k + j];
        invalid |= id < 0 || id >= a.num_experts;
      }
      if (invalid) sum = make_float4(NAN, NAN, NAN, NAN);
    }
    if (a.out_f32) {
      reinterpret_cast<float4*>(a.out_f32)[i] = sum;
    } else {
      __nv_bfloat162* out = reinterpret_cast<__nv_bfloat162*>(a.out) + 2 * i;
      out[0] = __floats2bfloat162_rn(sum.x, sum.y);
      out[1] = __floats2bfloat162_rn(sum.z, sum.w);
    }
  }
}

cudaError_t launch_compact_entries(const CompactEntriesArgs& a, cudaStream_t stream) {
  if (a.num_entries < 0) return cudaErrorInvalidValue;
  if (a.num_entries == 0) return cudaSuccess;
  if (a.ids == nullptr || a.list == nullptr) return cudaErrorInvalidValue;
  compact_entries_kernel<<<1, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t launch_localize_ids(const LocalizeIdsArgs& a, cudaStream_t stream) {
  if (a.num_ids < 0 || a.num_local_experts < 0) return cudaErrorInvalidValue;
  if (a.num_ids == 0) return cudaSuccess;
  if (a.ids == nullptr || a.local == nullptr) return cudaErrorInvalidValue;
  constexpr int kBlock = 256;
  const int blocks = std::min((a.num_ids + kBlock - 1) / kBlock, 1024);
  localize_ids_kernel<<<blocks, kBlock, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t launch_sum_partials(const SumPartialsArgs& a, cudaStream_t stream) {
  if (a.ranks < 1 || a.num_tokens < 0 || a.hidden_size < 0 || a.hidden_size % 4 != 0) return cudaErrorInvalidValue;
  if ((a.out == nullptr) == (a.out_f32 == nullptr)) return cudaErrorInvalidValue;
  if (a.num_tokens == 0 || a.hidden_size == 0) return cudaSuccess;
  // NOTE: float4 loads of the partials and stores of fp32 out; bf16 out as pairs (4 bytes).
  if (a.partials == nullptr || !aligned(a.partials, 0, 16) || (a.out_f32 && !aligned(a.out_f32, 0, 16)) ||
      (a.out && !aligned(a.out, 0, 4)))
    return cudaErrorInvalidValue;
  constexpr int kBlock = 256;
  const int64_t n4 = int64_t(a.num_tokens) * a.hidden_size / 4;
  const int blocks = int(std::min<int64_t>((n4 + kBlock - 1) / kBlock, 4096));
  sum_partials_kernel<<<blocks, kBlock, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t launch_gather_rows(const GatherRowsArgs& a, cudaStream_t stream) {
  if (a.max_rows < 0 || a.row_bytes < 0) return cudaErrorInvalidValue;
  if (a.max_rows == 0 || a.row_bytes == 0) return cudaSuccess;
  constexpr int kBlock = 256, kRowsPerBlock = kBlock / 32;
  const int blocks = int(std::min<int64_t>((int64_t(a.max_rows) + kRowsPerBlock - 1) / kRowsPerBlock, 4096));
  const bool both16 = aligned(a.src, a.row_bytes, 16) && aligned(a.dst, a.row_bytes, 16);
  const bool both4 = aligned(a.src, a.row_bytes, 4) && aligned(a.dst, a.row_bytes, 4);
  if (both16) gather_rows_kernel<uint4><<<blocks, kBlock, 0, stream>>>(a);
  else if (both4) gather_rows_kernel<uint32_t><<<blocks, kBlock, 0, stream>>>(a);
  else gather_rows_kernel<uint8_t><<<blocks, kBlock, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace fp4moe::kernels
