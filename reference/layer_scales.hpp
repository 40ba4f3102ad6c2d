// reference/layer_scales.hpp — the per-expert fp32 factors of the two GEMMs (docs/numerics.md, steps 3-6),
// the decode of an expert's weight rows and the bf16 rounding, shared by the layer (moe.cpp) and its
// rounding slack (rounding_slack.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "fp4moe/format.hpp"
#include "fp4moe/reference.hpp"

namespace fp4moe::reference::detail {

struct LayerScales {
  std::vector<float> a_scale;  // [E] the GEMM1 input's NVFP4 scale (1 in w4a16)
  std::vector<float> alpha1;   // [E] h = alpha1 * acc (+ w13_bias)
  std::vector<float> alpha2;   // [E] y = alpha2 * acc (+ w2_bias)
};

// Arguments as moe_forward has checked them.
LayerScales layer_scales(const MoeProblem& problem, const MoeWeights& weights);

// Rows [n0, n1) of expert e of a weight tensor [E, N, K] (codes [E, N, K/2], block scales by the format)
// as fp32 values, into out [n1 - n0, K].
inline void decode_expert_rows(WeightFormat wf, const uint8_t* w, const uint8_t* w_scale, int64_t e, int64_t n0,
                               int64_t n1, int64_t N, int64_t K, float* out) {
  const int64_t row = e * N + n0;
  if (wf == WeightFormat::MXFP4) {
    format::dequantize_mxfp4(w + row * (K / 2), w_scale + row * (K / format::kMxfp4BlockSize), n1 - n0, K, out);
  } else {
    format::dequantize_nvfp4(w + row * (K / 2), w_scale + row * (K / format::kBlockSize), n1 - n0, K, out);
  }
}

inline float bf16_round(float x) { return format::bf16_to_float(format::bf16_from_float(x)); }

}  // namespace fp4moe::reference::detail
