// kernels/quantize.cu — NVFP4 activation quantization (bit-identical to format::quantize_nvfp4 and
// format::scales_linear_to_swizzled) and the permuted gather that builds the GEMM1 A operand.
//
// quantize_nvfp4_kernel: one thread per 16-element block. It loads the block's 16 bf16 with two 16-byte
// loads, quantizes them (kernels/nvfp4/codec.cuh), stores the 8 packed bytes with one 8-byte store
// and the scale byte at its linear or 128x4-swizzled offset. In the swizzled layout the grid covers
// the padded [ceil(rows/128)*128, ceil(cols/16/4)*4] scale matrix, and the threads of padding
// positions write a zero scale byte.
//
// gather_quantize_kernel: one CTA per token t (its k row offsets and per-copy scales in shared memory,
// top_k <= 32): x = hidden[t] is read once and written to the k permuted rows entry_to_row[t*k + j].
// w4a16 writes x (times bf16(w[entry]) rounded to bf16 when scale_by_weight), w4a4 the q*sf values
// of NVFP4(x) with input_scale[0] (scalar mode: quantized once for the k copies) or
// input_scale[topk_ids[entry]] (per-expert mode: quantized per copy) — q*sf is exact in bf16. Entries
// whose expert id is out of range take a NaN scale in per-expert mode (the token is poisoned; memory
// stays safe).
// NOTE: the permuted rows of one token lie in k different experts; reading hidden per permuted row
// read every token k times from HBM (hidden is larger than L2 at prefill sizes).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/dependent_launch.cuh"
#include "kernels/launch.hpp"
#include "kernels/nvfp4/codec.cuh"

namespace fp4moe::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kGatherThreads = 128;  // per token: H = 2048..7168 is 128..448 blocks of 16
constexpr int kMaxGatherTopK = 32;   // the router's limit (kernels/route.cu)

__global__ void __launch_bounds__(kThreads)
    quantize_nvfp4_kernel(const __nv_bfloat16* __restrict__ x, int64_t rows, int64_t cols,
                          const float* __restrict__ input_scale, uint8_t* __restrict__ packed,
                          uint8_t* __restrict__ scales, bool swizzled) {
  dependent_launch_prologue();
  const int64_t nb = cols / nvfp4::kBlock;                  // scale columns
  const int64_t grid_cols = swizzled ? (nb + 3) / 4 * 4 : nb;
  const int64_t grid_rows = swizzled ? (rows + 127) / 128 * 128 : rows;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= grid_rows * grid_cols) return;
  const int64_t m = i / grid_cols, b = i % grid_cols;
  const int64_t scale_at = swizzled ? nvfp4::swizzled_scale_offset(m, b, grid_cols / 4) : m * nb + b;
  if (m >= rows || b >= nb) {  // swizzled padding
    scales[scale_at] = 0;
    return;
  }
  float v[16];
  nvfp4::load_bf16x16(x + m * cols + b * nvfp4::kBlock, v);
  const float gs = nvfp4::global_inv_scale(*input_scale);
  const float inv_gs = __fdiv_rn(1.0f, gs);
  const nvfp4::Block16 q = nvfp4::quantize_block16(v, gs, inv_gs);
  *reinterpret_cast<uint2*>(packed + m * (cols / 2) + b * 8) = make_uint2(q.packed[0], q.packed[1]);
  scales[scale_at] = static_cast<uint8_t>(q.sf);
}

// One CTA per token t: the k copies' row offsets (and, per copy, the scale and weight) once per CTA in
// shared memory, then the row strided over the threads (adjacent threads, adjacent addresses):
//   w4a16 without weights: a copy, one 16-byte word (8 bf16) per thread and step, so each warp store
//                          writes 512 contiguous bytes to each of the k rows;
//   otherwise:             one 16-element block (two 16-byte words) per thread and step.
// NOTE: one thread per block with a flat 64-bit index paid two 64-bit divisions per 16 elements,
// about as many instructions as the quantization itself; re-reading entry_to_row per copy inside the
// loop cost one dependent global load per store (it may alias a1 for the compiler).
__global__ void __launch_bounds__(kGatherThreads) gather_quantize_kernel(const GatherArgs a) {
  __shared__ int64_t row_off[kMaxGatherTopK];   // element offset of copy j's permuted row in a1
  __shared__ float copy_gs[kMaxGatherTopK];     // per copy: NVFP4 global scale (w4a4 per copy)
  __shared__ float copy_inv_gs[kMaxGatherTopK];
  __shared__ float copy_weight[kMaxGatherTopK]; // per copy: bf16(router weight) (scale_by_weight)
  dependent_launch_prologue();
  const int nb = a.hidden_size / nvfp4::kBlock;
  const int k = a.top_k;
  const int64_t t = blockIdx.x;
  const __nv_bfloat16* src = a.hidden + t * a.hidden_size;
  const int64_t entry0 = t * k;  // entries t*k .. t*k + k-1
  const bool quantize = a.mode != ActQuant::W4A16;
  // Per copy: the router weight on the input, or the copy's expert's input scale.
  const bool per_copy = a.scale_by_weight || a.mode == ActQuant::W4A4PerExpert;
  auto scales_of = [&](float s, float& gs, float& inv_gs) {
    gs = nvfp4::global_inv_scale(s);
    inv_gs = __fdiv_rn(1.0f, gs);
  };
  if (threadIdx.x < k) {
    const int j = threadIdx.x;
    const int64_t entry = entry0 + j;
    row_off[j] = static_cast<int64_t>(a.entry_to_row[entry]) * a.hidden_size;
    if (a.scale_by_weight) copy_weight[j] = __bfloat162float(__float2bfloat16_rn(a.topk_weights[entry]));
    if (a.mode == ActQuant::W4A4PerExpert) {
      const int32_t e = a.topk_ids[entry];
      scales_of((e >= 0 && e < a.num_experts) ? a.input_scale[e] : __uint_as_float(0x7FC00000u), copy_gs[j],
                copy_inv_gs[j]);
    }
  }
  __syncthreads();

  if (!quantize && !a.scale_by_weight) {  // w4a16: the row itself into the k rows
    const int words = a.hidden_size / 8;
    const uint4* in = reinterpret_cast<const uint4*>(src);
    for (int w = threadIdx.x; w < words; w += kGatherThreads) {
      const uint4 v = in[w];
      for (int j = 0; j < k; ++j) reinterpret_cast<uint4*>(a.a1 + row_off[j])[w] = v;
    }
    return;
  }
  float gs = 0.0f, inv_gs = 0.0f;
  if (a.mode == ActQuant::W4A4Scalar) scales_of(a.input_scale[0], gs, inv_gs);  // one scale for every copy
  for (int b = threadIdx.x; b < nb; b += kGatherThreads) {
    float x[16];
    nvfp4::load_bf16x16(src + b * nvfp4::kBlock, x);
    if (!per_copy) {  // w4a4 scalar: quantized once for the k copies
      nvfp4::fake_quantize_block16(x, gs, inv_gs);
      for (int j = 0; j < k; ++j) nvfp4::store_bf16x16(a.a1 + row_off[j] + b * nvfp4::kBlock, x);
      continue;
    }
    for (int j = 0; j < k; ++j) {
      float v[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) v[i] = x[i];
      if (a.scale_by_weight) {
        const float wb = copy_weight[j];
#pragma unroll
        for (int i = 0; i < 16; ++i) v[i] = __bfloat162float(__float2bfloat16_rn(__fmul_rn(v[i], wb)));
      }
      if (quantize) {
        if (a.mode == ActQuant::W4A4Scalar) nvfp4::fake_quantize_block16(v, gs, inv_gs);  // weight, then quantize
        else nvfp4::fake_quantize_block16(v, copy_gs[j], copy_inv_gs[j]);
      }
      nvfp4::store_bf16x16(a.a1 + row_off[j] + b * nvfp4::kBlock, v);
    }
  }
}

bool aligned(const void* p, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(p) % bytes) == 0; }

unsigned grid_for(int64_t threads) { return static_cast<unsigned>((threads + kThreads - 1) / kThreads); }

}  // namespace

cudaError_t launch_quantize_nvfp4(const __nv_bfloat16* x, int64_t rows, int64_t cols,
                                  const float* input_scale, uint8_t* packed, uint8_t* scales,
                                  ScaleLayout layout, cudaStream_t stream) {
  if (rows < 0 || cols < 0 || cols % nvfp4::kBlock != 0) return cudaErrorInvalidValue;
  if (rows == 0 || cols == 0) return cudaSuccess;  // no scales either: the swizzled size is 0 too
  if (x == nullptr || input_scale == nullptr || packed == nullptr || scales == nullptr)
    return cudaErrorInvalidValue;
  if (!aligned(x, 16) || !aligned(packed, 8)) return cudaErrorMisalignedAddress;
  const bool swizzled = layout == ScaleLayout::Swizzled128x4;
  const int64_t nb = cols / nvfp4::kBlock;
  const int64_t threads = swizzled ? (rows + 127) / 128 * 128 * ((nb + 3) / 4 * 4) : rows * nb;
  if (grid_for(threads) > 0x7FFFFFFFu) return cudaErrorInvalidValue;
  return launch_dependent(quantize_nvfp4_kernel, dim3(grid_for(threads)), dim3(kThreads), 0, stream, x, rows, cols,
                          input_scale, packed, scales, swizzled);
}

cudaError_t launch_gather_quantize(const GatherArgs& a, cudaStream_t stream) {
  if (a.num_tokens < 0 || a.top_k < 1 || a.top_k > kMaxGatherTopK || a.hidden_size < 0 || a.hidden_size % nvfp4::kBlock != 0)
    return cudaErrorInvalidValue;
  const int64_t rows = static_cast<int64_t>(a.num_tokens) * a.top_k;
  const int64_t threads = rows * (a.hidden_size / nvfp4::kBlock);
  if (threads == 0) return cudaSuccess;
  if (a.hidden == nullptr || a.entry_to_row == nullptr || a.a1 == nullptr) return cudaErrorInvalidValue;
  if (a.scale_by_weight && a.topk_weights == nullptr) return cudaErrorInvalidValue;
  if (a.mode != ActQuant::W4A16 && a.input_scale == nullptr) return cudaErrorInvalidValue;
  if (a.mode == ActQuant::W4A4PerExpert && (a.topk_ids == nullptr || a.num_experts < 1))
    return cudaErrorInvalidValue;
  if (!aligned(a.hidden, 16) || !aligned(a.a1, 16)) return cudaErrorMisalignedAddress;
  if (rows > 0x7FFFFFFF) return cudaErrorInvalidValue;
  return launch_dependent(gather_quantize_kernel, dim3(static_cast<unsigned>(a.num_tokens)), dim3(kGatherThreads), 0,
                          stream, a);
}

}  // namespace fp4moe::kernels
