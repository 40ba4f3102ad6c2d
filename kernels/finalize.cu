// kernels/finalize.cu — out[t] = bf16(sum_j w[t,j] * (y[t*k+j] + b[id])) (b: the optional expert bias;
// docs/numerics.md, "The layer, step by step").
//
// One thread per 8 consecutive columns of one token: for each slot j in order it accumulates 8 fp32
// of y[t*k+j] as acc = acc + w * y with separately rounded fp32 operations (__fmul_rn / __fadd_rn:
// never contracted into an FMA), starting from acc = 0 like the CPU reference, the loads of up to 8
// slots issued before the first add; then one 16-byte store of 8 bf16 (RNE), or with out_f32 two of
// the 8 fp32 sums (partial outputs that the caller adds before rounding). No atomics:
// deterministic. The slots and the store are nvfp4::finalize_token8 / store_bf16x8, which GEMM2's
// fused finalize uses too.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/dependent_launch.cuh"
#include "kernels/launch.hpp"
#include "kernels/nvfp4/codec.cuh"

namespace fp4moe::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kCols = 8;  // columns per thread (nvfp4::finalize_token8)

__global__ void __launch_bounds__(kThreads) finalize_kernel(const FinalizeArgs a) {
  dependent_launch_prologue();
  const int64_t H = a.hidden_size, groups = H / kCols;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= static_cast<int64_t>(a.num_tokens) * groups) return;
  const int64_t t = i / groups, c = (i % groups) * kCols;
  const int k = a.top_k;
  float acc[kCols];
#pragma unroll
  for (int q = 0; q < kCols; ++q) acc[q] = 0.0f;
  // NOTE: an out-of-range precomputed id has no GEMM row, so y[entry] was never written: the token's
  // row becomes NaN (bad input poisons its own token only) instead of reading garbage, or, with
  // skip_foreign_ids (expert parallelism: another rank's expert), the slot is left out of the sum.
  nvfp4::finalize_token8<8>(acc, k, t * k, a.unit_weights ? nullptr : a.topk_weights, a.topk_ids, a.num_experts,
                            a.y + c, H, a.skip_foreign_ids, a.bias != nullptr ? a.bias + c : nullptr);
  if (a.out_f32 != nullptr) {
    float4* dst = reinterpret_cast<float4*>(a.out_f32 + t * H + c);
    dst[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    dst[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
  } else {
    nvfp4::store_bf16x8(a.out + t * H + c, acc);
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) % 16) == 0; }

}  // namespace

cudaError_t launch_finalize(const FinalizeArgs& a, cudaStream_t stream) {
  // H is a multiple of 16 at the API; 8 columns per thread only need H % 8 == 0.
  if (a.num_tokens < 0 || a.top_k < 1 || a.hidden_size < 0 || a.hidden_size % kCols != 0)
    return cudaErrorInvalidValue;
  const int64_t threads = static_cast<int64_t>(a.num_tokens) * (a.hidden_size / kCols);
  if (threads == 0) return cudaSuccess;
  if (a.y == nullptr || (a.out == nullptr) == (a.out_f32 == nullptr) || (!a.unit_weights && a.topk_weights == nullptr))
    return cudaErrorInvalidValue;
  if (a.bias != nullptr && (a.topk_ids == nullptr || a.num_experts < 1 || !aligned16(a.bias))) return cudaErrorInvalidValue;
  if (!aligned16(a.y) || !aligned16(a.out != nullptr ? static_cast<const void*>(a.out) : a.out_f32))
    return cudaErrorMisalignedAddress;
  const int64_t blocks = (threads + kThreads - 1) / kThreads;
  if (blocks > 0x7FFFFFFF) return cudaErrorInvalidValue;
  return launch_dependent(finalize_kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0, stream, a);
}

}  // namespace fp4moe::kernels
