// kernels/stage_rows.cu — the activation rows that travel between the layer's separate stages
// (MoeRunner::prepare -> MoeRunner::experts; docs/architecture.md, "The layer as stages").
//
// prepare_rows_kernel (MoeRunner::prepare), one thread per 16-element block of one output row r:
//   1. the source token t = r / top_k when each (token, slot) entry has its own row, else t = r
//   2. x = hidden[t] (16 bf16), times bf16(w[entry]) rounded to bf16 with the router weight on the input
//   3. NVFP4 rows: quantize with the scalar input scale or the entry's expert's (kernels/nvfp4/codec.cuh),
//      store 8 packed bytes and the scale byte (linear or 128x4-swizzled; swizzled padding is zero);
//      bf16 rows: store x
// The arithmetic is gather_quantize's (kernels/quantize.cu), so the values the experts stage decodes
// are the GEMM1 operand of the fused forward, bit for bit.
//
// dequantize_rows_kernel (MoeRunner::experts on NVFP4 rows), one thread per block: the packed values
// and the scale byte -> 16 bf16 q * sf (exact in bf16), the A operand GEMM1 reads.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/dependent_launch.cuh"
#include "kernels/launch.hpp"
#include "kernels/nvfp4/codec.cuh"

namespace fp4moe::kernels {
namespace {

constexpr int kThreads = 256;

// The grid of a [rows, cols / 16] scale matrix: with the swizzled layout the padded one.
struct BlockGrid {
  int64_t rows, cols;  // of the grid, in 16-element blocks along cols
  int64_t blocks;      // real scale columns (cols of the data / 16)
  bool swizzled;
  __host__ __device__ BlockGrid(int64_t data_rows, int64_t data_cols, bool swz)
      : rows(swz ? (data_rows + 127) / 128 * 128 : data_rows),
        cols(swz ? (data_cols / nvfp4::kBlock + 3) / 4 * 4 : data_cols / nvfp4::kBlock),
        blocks(data_cols / nvfp4::kBlock),
        swizzled(swz) {}
  __device__ int64_t scale_offset(int64_t m, int64_t b) const {
    return swizzled ? nvfp4::swizzled_scale_offset(m, b, cols / 4) : m * blocks + b;
  }
  __host__ __device__ int64_t threads() const { return rows * cols; }
};

__global__ void __launch_bounds__(kThreads) prepare_rows_kernel(const PrepareRowsArgs a, const BlockGrid grid) {
  dependent_launch_prologue();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= grid.threads()) return;
  const int64_t r = i / grid.cols, b = i % grid.cols;
  const int64_t rows = a.per_entry ? int64_t(a.num_tokens) * a.top_k : a.num_tokens;
  const bool nvfp4_rows = a.mode != ActQuant::W4A16;
  if (r >= rows || b >= grid.blocks) {  // swizzled padding of the scale matrix
    if (nvfp4_rows) a.scales[grid.scale_offset(r, b)] = 0;
    return;
  }
  const int64_t t = a.per_entry ? r / a.top_k : r;
  const int64_t H = a.hidden_size;
  float v[16];
  nvfp4::load_bf16x16(a.hidden + t * H + b * nvfp4::kBlock, v);
  if (a.scale_by_weight) {
    const float wb = __bfloat162float(__float2bfloat16_rn(a.topk_weights[r]));
#pragma unroll
    for (int q = 0; q < 16; ++q) v[q] = __bfloat162float(__float2bfloat16_rn(__fmul_rn(v[q], wb)));
  }
  if (!nvfp4_rows) {
    nvfp4::store_bf16x16(static_cast<__nv_bfloat16*>(a.values) + r * H + b * nvfp4::kBlock, v);
    return;
  }
  float s = a.input_scale[0];
  if (a.mode == ActQuant::W4A4PerExpert) {  // NOTE: an out-of-range id poisons its own row only
    const int32_t e = a.topk_ids[r];
    s = (e >= 0 && e < a.num_experts) ? a.input_scale[e] : __uint_as_float(0x7FC00000u);
  }
  const float gs = nvfp4::global_inv_scale(s);
  const nvfp4::Block16 q = nvfp4::quantize_block16(v, gs, __fdiv_rn(1.0f, gs));
  *reinterpret_cast<uint2*>(static_cast<uint8_t*>(a.values) + r * (H / 2) + b * 8) = make_uint2(q.packed[0], q.packed[1]);
  a.scales[grid.scale_offset(r, b)] = static_cast<uint8_t>(q.sf);
}

__global__ void __launch_bounds__(kThreads)
    dequantize_rows_kernel(const uint8_t* __restrict__ packed, const uint8_t* __restrict__ scales, int64_t rows,
                           int64_t cols, const BlockGrid grid, __nv_bfloat16* __restrict__ out) {
  dependent_launch_prologue();
  const int64_t nb = grid.blocks;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= rows * nb) return;
  const int64_t m = i / nb, b = i % nb;
  const uint2 words = *reinterpret_cast<const uint2*>(packed + m * (cols / 2) + b * 8);
  nvfp4::Block16 q;
  q.packed[0] = words.x;
  q.packed[1] = words.y;
  q.sf = scales[grid.scale_offset(m, b)];
  float v[16];
  nvfp4::dequantize_block16(q, v);
  nvfp4::store_bf16x16(out + m * cols + b * nvfp4::kBlock, v);
}

bool aligned(const void* p, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(p) % bytes) == 0; }

unsigned grid_for(int64_t threads) { return static_cast<unsigned>((threads + kThreads - 1) / kThreads); }

}  // namespace

cudaError_t launch_prepare_rows(const PrepareRowsArgs& a, cudaStream_t stream) {
  if (a.num_tokens < 0 || a.top_k < 1 || a.hidden_size < 0 || a.hidden_size % nvfp4::kBlock != 0)
    return cudaErrorInvalidValue;
  const int64_t rows = a.per_entry ? int64_t(a.num_tokens) * a.top_k : a.num_tokens;
  if (rows == 0 || a.hidden_size == 0) return cudaSuccess;
  const bool nvfp4_rows = a.mode != ActQuant::W4A16;
  if (a.hidden == nullptr || a.values == nullptr || (nvfp4_rows && (a.scales == nullptr || a.input_scale == nullptr)))
    return cudaErrorInvalidValue;
  // Per-entry quantities are indexed by the row: only per-entry rows may carry them.
  if ((a.scale_by_weight || a.mode == ActQuant::W4A4PerExpert) && !a.per_entry) return cudaErrorInvalidValue;
  if (a.scale_by_weight && a.topk_weights == nullptr) return cudaErrorInvalidValue;
  if (a.mode == ActQuant::W4A4PerExpert && (a.topk_ids == nullptr || a.num_experts < 1)) return cudaErrorInvalidValue;
  if (!aligned(a.hidden, 16) || !aligned(a.values, nvfp4_rows ? 8 : 16)) return cudaErrorMisalignedAddress;
  const BlockGrid grid(rows, a.hidden_size, nvfp4_rows && a.scale_layout == ScaleLayout::Swizzled128x4);
  if (grid_for(grid.threads()) > 0x7FFFFFFFu) return cudaErrorInvalidValue;
  return launch_dependent(prepare_rows_kernel, dim3(grid_for(grid.threads())), dim3(kThreads), 0, stream, a, grid);
}

cudaError_t launch_dequantize_rows(const uint8_t* packed, const uint8_t* scales, ScaleLayout layout, int64_t rows,
                                   int64_t cols, __nv_bfloat16* out, cudaStream_t stream) {
  if (rows < 0 || cols < 0 || cols % nvfp4::kBlock != 0) return cudaErrorInvalidValue;
  if (rows == 0 || cols == 0) return cudaSuccess;
  if (packed == nullptr || scales == nullptr || out == nullptr) return cudaErrorInvalidValue;
  if (!aligned(packed, 8) || !aligned(out, 16)) return cudaErrorMisalignedAddress;
  const BlockGrid grid(rows, cols, layout == ScaleLayout::Swizzled128x4);
  const int64_t threads = rows * grid.blocks;
  if (grid_for(threads) > 0x7FFFFFFFu) return cudaErrorInvalidValue;
  return launch_dependent(dequantize_rows_kernel, dim3(grid_for(threads)), dim3(kThreads), 0, stream, packed, scales,
                          rows, cols, grid, out);
}

}  // namespace fp4moe::kernels
