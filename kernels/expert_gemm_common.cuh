// kernels/expert_gemm_common.cuh — argument checks, kernel parameters and the weight maps shared by the
// launchers of the expert GEMMs (expert_gemm.cu: the wgmma kernel, expert_gemm_stream.cu: the streaming kernel).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cuda_runtime.h>

#include <atomic>
#include <climits>
#include <cstdint>

#include "kernels/expert_gemm_params.cuh"
#include "kernels/launch.hpp"
#include "kernels/nvfp4/weight_layout.cuh"

namespace fp4moe::kernels::gemm_detail {

inline bool aligned(const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// Runs configure() (kernel attributes such as the shared-memory opt-in) once per device: `done` holds
// one bit per device ordinal < 64 (ordinals past 63 configure on every call).
template <class Configure>
cudaError_t once_per_device(std::atomic<uint64_t>& done, Configure&& configure) {
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  const uint64_t bit = device < 64 ? (uint64_t{1} << device) : 0;
  if (bit != 0 && (done.load() & bit)) return cudaSuccess;
  if (cudaError_t e = configure(); e != cudaSuccess) return e;
  done.fetch_or(bit);
  return cudaSuccess;
}

// cuTensorMapEncodeTiled from the driver (through the runtime: no link against libcuda).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      f = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// dims/strides innermost first; strides (bytes) of dims 1..rank-1.
inline cudaError_t encode_map(CUtensorMap& map, CUtensorMapDataType type, int rank, const void* base,
                              const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,
                              CUtensorMapSwizzle swizzle) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint32_t elem_strides[5] = {1, 1, 1, 1, 1};
  const CUresult r = encode(&map, type, static_cast<cuuint32_t>(rank), const_cast<void*>(base), dims, strides, box,
                            elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// The weight and scale maps of both kernels (as 32-bit words: 128 (weights) or 16 (scales) words per
// (group, chunk)); the box of one chunk covers `slots` row groups: gated GEMM1 [slots/2 gate groups]
// [slots/2 up groups] (5-D: word, chunk, group within the half, half, expert), otherwise `slots`
// consecutive groups (4-D: word, chunk, group, expert). Groups past the expert's are zero-filled.
inline cudaError_t encode_weight_maps(const expert_gemm::Params& p, int slots, CUtensorMap& w_map,
                                      CUtensorMap& scale_map) {
  const cuuint64_t chunks = static_cast<cuuint64_t>(p.chunks), groups = static_cast<cuuint64_t>(p.groups);
  const cuuint64_t experts = static_cast<cuuint64_t>(p.num_experts);
  const bool gated = p.epilogue == expert_gemm::Epilogue::Gemm1Gated;
  for (int which = 0; which < 2; ++which) {
    const cuuint64_t bytes = which == 0 ? nvfp4::kChunkBytes : nvfp4::kChunkScaleBytes;
    const void* base = which == 0 ? static_cast<const void*>(p.w) : static_cast<const void*>(p.w_scale);
    CUtensorMap& map = which == 0 ? w_map : scale_map;
    const cuuint32_t words = static_cast<cuuint32_t>(bytes / 4);
    cudaError_t e;
    if (gated) {  // (word, chunk, group within the half, half, expert): slots [gate groups][up groups]
      const cuuint64_t half = groups / 2;
      const cuuint64_t dims[5] = {words, chunks, half, 2, experts};
      const cuuint64_t strides[4] = {bytes, bytes * chunks, bytes * chunks * half, bytes * chunks * groups};
      const cuuint32_t box[5] = {words, 1, static_cast<cuuint32_t>(slots / 2), 2, 1};
      e = encode_map(map, CU_TENSOR_MAP_DATA_TYPE_UINT32, 5, base, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_NONE);
    } else {  // (word, chunk, group, expert): `slots` consecutive groups
      const cuuint64_t dims[4] = {words, chunks, groups, experts};
      const cuuint64_t strides[3] = {bytes, bytes * chunks, bytes * chunks * groups};
      const cuuint32_t box[4] = {words, 1, static_cast<cuuint32_t>(slots), 1};
      e = encode_map(map, CU_TENSOR_MAP_DATA_TYPE_UINT32, 4, base, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_NONE);
    }
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

// Shapes, the prepacked weights' shape, null or misaligned pointers (nothing is checked past the
// shapes when max_tiles == 0: nothing will be launched).
inline bool common_args_valid(const ExpertGemmArgs& a) {
  const PrepackedWeights& pw = a.weights;
  if (a.K <= 0 || a.K % 16 != 0 || a.N <= 0 || a.N % 16 != 0 || a.K > INT_MAX / 2 || a.N > INT_MAX / 2) return false;
  if (a.num_experts <= 0 || a.max_tiles < 0 || a.max_tiles > INT_MAX) return false;
  if (pw.num_experts != a.num_experts || pw.rows != a.N || pw.cols != a.K ||
      pw.padded_cols != (a.K + nvfp4::kChunkK - 1) / nvfp4::kChunkK * nvfp4::kChunkK)
    return false;
  if (a.rows < 0 || a.rows > INT_MAX) return false;
  if (a.max_tiles == 0) return true;  // nothing will be launched
  if (a.rows == 0) return false;      // tiles but no rows
  if (!a.a || !a.w || !a.w_scale || !a.alpha || !a.expert_offsets || !a.tile_expert || !a.tile_row_start ||
      !a.num_tiles)
    return false;
  return aligned(a.a, 16) && aligned(a.w, 16) && aligned(a.w_scale, 16);
}

inline expert_gemm::Params common_params(const ExpertGemmArgs& a) {
  expert_gemm::Params p{};
  p.a = a.a;
  p.rows = static_cast<int>(a.rows);
  p.num_experts = a.num_experts;
  p.w = a.w;
  p.w_scale = a.w_scale;
  p.alpha = a.alpha;
  p.expert_offsets = a.expert_offsets;
  p.tile_expert = a.tile_expert;
  p.tile_row_start = a.tile_row_start;
  p.num_tiles = a.num_tiles;
  p.max_tiles = static_cast<int>(a.max_tiles);
  p.K = static_cast<int>(a.K);
  p.N = static_cast<int>(a.N);
  p.groups = static_cast<int>(a.N / nvfp4::kRowsPerGroup);
  p.chunks = static_cast<int>(a.weights.padded_cols / nvfp4::kChunkK);
  return p;
}

// GEMM1's checks and kernel parameters (both kernels): false on an invalid argument.
inline bool gemm1_params(const Gemm1Args& args, expert_gemm::Params& p) {
  if (!common_args_valid(args)) return false;
  const bool gated = args.activation.kind != Activation::Relu2;
  if (gated && args.N % 32 != 0) return false;  // I = N/2 must be a multiple of 16
  const bool quantize = args.mode != ActQuant::W4A16;
  if (args.a_row_to_entry && args.a_top_k < 1) return false;
  if (args.max_tiles > 0) {
    if (!args.act || !aligned(args.act, 16)) return false;
    if (quantize && !args.act_scale) return false;
  }
  p = common_params(args);
  p.epilogue = gated ? expert_gemm::Epilogue::Gemm1Gated : expert_gemm::Epilogue::Gemm1Plain;
  p.act = args.activation;
  p.quantize = quantize ? 1 : 0;
  p.act_scale = args.act_scale;
  p.act_out = args.act;
  p.out_cols = static_cast<int>(gated ? args.N / 2 : args.N);  // I
  p.a_row_to_entry = args.a_row_to_entry;
  p.a_top_k = args.a_top_k;
  p.bias = args.bias;
  return true;
}

// GEMM2's checks and kernel parameters (both kernels): false on an invalid argument.
inline bool gemm2_params(const Gemm2Args& args, expert_gemm::Params& p) {
  if (!common_args_valid(args)) return false;
  if (args.max_tiles > 0 && (!args.row_to_entry || (!args.y && !args.out) || (args.y && !aligned(args.y, 16))))
    return false;
  p = common_params(args);
  p.epilogue = expert_gemm::Epilogue::Gemm2;
  p.row_to_entry = args.row_to_entry;
  p.y = args.y;
  p.out = args.out;
  p.out_weights = args.out_weights;
  p.out_cols = static_cast<int>(args.N);
  if (args.finalize_counters) {  // the fused finalize writes y and out (16-byte stores of 8 bf16)
    if (args.finalize_top_k < 2) return false;
    if (args.max_tiles > 0 && (!args.y || !args.out || !aligned(args.out, 16))) return false;
    p.fin_counters = args.finalize_counters;
    p.fin_top_k = args.finalize_top_k;
  }
  return true;
}

}  // namespace fp4moe::kernels::gemm_detail
