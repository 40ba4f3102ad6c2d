// kernels/expert_gemm.cu — launchers of the expert GEMMs (kernels/expert_gemm_sm90.cuh).
//
//   1. Check the arguments (cudaErrorInvalidValue on anything inconsistent: shapes, the prepacked
//      weights' shape, null or misaligned pointers).
//   2. Grid: max_tiles token tiles x CTAs along N (GEMM1 gated: 128 intermediate columns per CTA,
//      otherwise 256 weight rows), one dimension; CTAs past *num_tiles leave at once.
//   3. One kernel instantiation serves GEMM1 (gated or relu2, bf16 or NVFP4 output) and GEMM2.
#include <cuda_runtime.h>

#include <atomic>
#include <climits>
#include <cstdint>

#include "kernels/expert_gemm_common.cuh"
#include "kernels/expert_gemm_sm90.cuh"
#include "kernels/launch.hpp"

namespace fp4moe::kernels {
namespace {
using gemm_detail::aligned;
using gemm_detail::common_args_valid;
using gemm_detail::common_params;
}  // namespace

cudaError_t configure_expert_gemm() {
  // The shared-memory opt-in is set once per device.
  static std::atomic<uint64_t> configured{0};
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  const uint64_t bit = device < 64 ? (uint64_t{1} << device) : 0;
  if (bit != 0 && (configured.load() & bit)) return cudaSuccess;
  if (cudaError_t e = cudaFuncSetAttribute(sm90gemm::expert_gemm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(sm90gemm::kSmemBytes));
      e != cudaSuccess)
    return e;
  configured.fetch_or(bit);
  return cudaSuccess;
}

namespace {

cudaError_t launch(const sm90gemm::Params& p, int64_t cols_per_cta, int64_t cols, cudaStream_t stream) {
  using namespace sm90gemm;
  if (p.max_tiles == 0) return cudaSuccess;
  const int64_t n_ctas = (cols + cols_per_cta - 1) / cols_per_cta;
  const int64_t ctas = static_cast<int64_t>(p.max_tiles) * n_ctas;
  if (ctas > INT_MAX) return cudaErrorInvalidConfiguration;
  sm90gemm::Params q = p;
  q.n_ctas = static_cast<int>(n_ctas);
  if (cudaError_t e = configure_expert_gemm(); e != cudaSuccess) return e;
  expert_gemm_kernel<<<static_cast<unsigned>(ctas), kThreads, kSmemBytes, stream>>>(q);
  return cudaGetLastError();
}

}  // namespace

int gemm_tile_rows() { return sm90gemm::kTileRows; }

cudaError_t launch_gemm1_act(const Gemm1Args& args, cudaStream_t stream) {
  if (!common_args_valid(args)) return cudaErrorInvalidValue;
  const bool gated = args.activation.kind != Activation::Relu2;
  if (gated && args.N % 32 != 0) return cudaErrorInvalidValue;  // I = N/2 must be a multiple of 16
  const int64_t I = gated ? args.N / 2 : args.N;
  const bool quantize = args.mode != ActQuant::W4A16;
  if (args.max_tiles > 0) {
    if (!args.act || !aligned(args.act, 16)) return cudaErrorInvalidValue;
    if (quantize && !args.act_scale) return cudaErrorInvalidValue;
  }
  sm90gemm::Params p = common_params(args);
  p.epilogue = gated ? sm90gemm::Epilogue::Gemm1Gated : sm90gemm::Epilogue::Gemm1Plain;
  p.act = args.activation;
  p.quantize = quantize ? 1 : 0;
  p.act_scale = args.act_scale;
  p.act_out = args.act;
  p.out_cols = static_cast<int>(I);
  return launch(p, gated ? sm90gemm::kBlockN / 2 : sm90gemm::kBlockN, I, stream);
}

cudaError_t launch_gemm2(const Gemm2Args& args, cudaStream_t stream) {
  if (!common_args_valid(args)) return cudaErrorInvalidValue;
  if (args.max_tiles > 0 && (!args.row_to_entry || (!args.y && !args.out) || (args.y && !aligned(args.y, 4))))
    return cudaErrorInvalidValue;
  sm90gemm::Params p = common_params(args);
  p.epilogue = sm90gemm::Epilogue::Gemm2;
  p.row_to_entry = args.row_to_entry;
  p.y = args.y;
  p.out = args.out;
  p.out_weights = args.out_weights;
  p.out_cols = static_cast<int>(args.N);
  return launch(p, sm90gemm::kBlockN, args.N, stream);
}

}  // namespace fp4moe::kernels
