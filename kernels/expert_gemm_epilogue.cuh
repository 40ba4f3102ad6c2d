// kernels/expert_gemm_epilogue.cuh — the epilogue arithmetic shared by the two sm_90a expert GEMMs:
// h = alpha[e] * (2^8 * acc) (epilogue_scale; the 2^8 undoes the decoded weights' 2^-8, see
// nvfp4/weight_layout.cuh), the GEMM1 activations (one IEEE fp32 operation per step, round to nearest
// even) and the GEMM1 epilogue's setup (gemm1_epilogue), which each kernel runs with its own loop over
// the staged tile (the wgmma kernel: Gemm1Items, the streaming kernel: Gemm1Pairs).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "fp4moe/problem.hpp"
#include "kernels/expert_gemm_params.cuh"
#include "kernels/nvfp4/codec.cuh"
#include "kernels/nvfp4/weight_layout.cuh"

namespace fp4moe::kernels::expert_gemm {

// NOTE: the kind is a template parameter so that the 16 elements of an epilogue item are straight-line
// code the compiler can interleave (a run-time switch per element serialised them on their loads).
// The activation is split in two: the denominator of the sigmoid (exp, no branches) for all 16
// elements first, then the IEEE division (whose slow-path branch ends a basic block) and the rest.
template <Activation K>
__device__ __forceinline__ float activation_denominator(const ActivationParams& a, float g) {
  if constexpr (K == Activation::SwiGLU) {
    return __fadd_rn(1.0f, expf(-g));
  } else if constexpr (K == Activation::SwiGLUOai) {
    const float gc = g > a.swiglu_limit ? a.swiglu_limit : g;  // min(g, L), NaN stays NaN
    return __fadd_rn(1.0f, expf(-__fmul_rn(a.swiglu_alpha, gc)));
  } else {
    return 1.0f;  // unused
  }
}
// The kinds that divide by the denominator: numerator / den is their one IEEE division.
template <Activation K>
inline constexpr bool kActivationDivides = K == Activation::SwiGLU || K == Activation::SwiGLUOai;
template <Activation K>
__device__ __forceinline__ float activation_numerator(float g) {
  return K == Activation::SwiGLU ? g : 1.0f;  // silu(g) = g / den; sigmoid = 1 / den
}
// The activation given quot = activation_numerator(g) / den (IEEE) for the dividing kinds.
template <Activation K>
__device__ __forceinline__ float activation_from_quotient(const ActivationParams& a, float g, float u, float quot) {
  if constexpr (K == Activation::SwiGLU) {
    return __fmul_rn(quot, u);
  } else if constexpr (K == Activation::GeGLU) {
    const float gelu = __fmul_rn(__fmul_rn(0.5f, g), __fadd_rn(1.0f, erff(__fmul_rn(g, 0.70710678118654752f))));
    return __fmul_rn(gelu, u);
  } else if constexpr (K == Activation::SwiGLUOai) {
    const float L = a.swiglu_limit;
    const float gc = g > L ? L : g;                     // min(g, L), NaN stays NaN
    const float uc = u > L ? L : (u < -L ? -L : u);     // clamp(u, -L, L), NaN stays NaN
    return __fmul_rn(__fmul_rn(gc, quot), __fadd_rn(uc, a.swiglu_beta));
  } else {  // Relu2
    const float r = g < 0.0f ? 0.0f : g;  // max(h, 0), NaN stays NaN
    return __fmul_rn(r, r);
  }
}
template <Activation K>
__device__ __forceinline__ float activation(const ActivationParams& a, float g, float u, float den) {
  const float quot = kActivationDivides<K> ? __fdiv_rn(activation_numerator<K>(g), den) : 0.0f;
  return activation_from_quotient<K>(a, g, u, quot);
}
__device__ __forceinline__ float epilogue_scale(float alpha, float acc) {
  return __fmul_rn(alpha, __fmul_rn(acc, nvfp4::kAccumulatorScale));  // the 2^8 is exact
}

// The GEMM1 epilogue of a CTA whose staged tile holds output columns [i0, i0 + cols_cta) of the tile's
// valid_rows token rows (from row_start): the valid columns, (w4a4) the re-quantization scale from
// act_scale (p.act_scale[expert], read by the caller), the expert's bias row (column i0 of gate; up
// out_cols later), then Loop::run<K> with the activation kind as a template parameter. Loop spreads
// the arithmetic over the CTA's threads: sm90gemm::Gemm1Items (the wgmma kernel) or sm90stream::Gemm1Pairs.
template <class Loop>
__device__ __forceinline__ void gemm1_epilogue(const Params& p, const float* stg, int i0, int cols_cta,
                                               int64_t row_start, int valid_rows, float act_scale, int expert) {
  const int cols = min(cols_cta, p.out_cols - i0);
  float gs = 0.0f, inv_gs = 0.0f;
  if (p.quantize) {
    gs = nvfp4::global_inv_scale(act_scale);
    inv_gs = __fdiv_rn(1.0f, gs);
  }
  const int64_t out_base = row_start * static_cast<int64_t>(p.out_cols) + i0;
  const float* bias = p.bias != nullptr ? p.bias + static_cast<int64_t>(expert) * p.N + i0 : nullptr;
  switch (p.act.kind) {
    case Activation::SwiGLU:
      Loop::template run<Activation::SwiGLU>(p, stg, bias, out_base, cols, valid_rows, gs, inv_gs);
      break;
    case Activation::GeGLU:
      Loop::template run<Activation::GeGLU>(p, stg, bias, out_base, cols, valid_rows, gs, inv_gs);
      break;
    case Activation::SwiGLUOai:
      Loop::template run<Activation::SwiGLUOai>(p, stg, bias, out_base, cols, valid_rows, gs, inv_gs);
      break;
    default: Loop::template run<Activation::Relu2>(p, stg, bias, out_base, cols, valid_rows, gs, inv_gs); break;
  }
}


}  // namespace fp4moe::kernels::expert_gemm
