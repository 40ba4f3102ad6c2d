// kernels/expert_gemm_params.cuh — the kernel parameters shared by the two sm_90a expert GEMMs
// (sm90_expert_gemm_wgmma.cuh, sm90_expert_gemm_stream.cuh) and their launchers (expert_gemm_common.cuh).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "fp4moe/problem.hpp"

namespace fp4moe::kernels::expert_gemm {

enum class Epilogue : int { Gemm1Gated = 0, Gemm1Plain = 1, Gemm2 = 2 };

struct Params {
  const __nv_bfloat16* a;          // [rows, K]
  int rows;                        // rows of a (the bound of the activation copies)
  int num_experts;                 // E
  const uint8_t* w;                // prepacked
  const uint8_t* w_scale;          // prepacked
  const float* alpha;              // [E]
  const int32_t* expert_offsets;   // [E+1]
  const int32_t* tile_expert;      // [max_tiles]
  const int32_t* tile_row_start;   // [max_tiles]
  const int32_t* num_tiles;        // [1]
  int max_tiles;
  int n_ctas;                      // CTAs along N
  int K;                           // activation columns (unpadded)
  int groups;                      // N / 8
  int chunks;                      // padded K / 128
  int N;                           // weight rows
  Epilogue epilogue;
  // GEMM1
  ActivationParams act;
  int quantize;                    // 0: bf16(act), 1: NVFP4 q*sf with act_scale[e]
  const float* act_scale;          // [E]
  __nv_bfloat16* act_out;          // [T*k rows, out_cols]
  int out_cols;                    // I (GEMM1)
  const int32_t* a_row_to_entry;   // GEMM1 only: GEMM row r reads a[a_row_to_entry[r] / a_top_k]
  int a_top_k;                     //   (a un-permuted, [T, K]); nullptr: row r reads a[r]
  const float* bias;               // GEMM1: [E, N] w13_bias (rows [gate; up]) added to h before the
                                   //   activation, or nullptr
  // GEMM2
  const int32_t* row_to_entry;     // [rows]
  float* y;                        // [entries, N]
  __nv_bfloat16* out;              // top-1 only: [entries, N] finalized bf16 output instead of y
  const float* out_weights;        // [entries] finalize weights, or nullptr for unit weights
  int32_t* fin_counters;           // streaming GEMM2 only, top_k >= 2: [T][n_ctas] arrival counters of the
  int fin_top_k;                   //   fused finalize (y and out both written); nullptr: no fused finalize
};

}  // namespace fp4moe::kernels::expert_gemm
