// reference/layer_scales.hpp — the per-expert fp32 factors of the two GEMMs (docs/numerics.md, steps 3-6),
// shared by the layer (moe.cpp) and its rounding slack (rounding_slack.cpp).
#pragma once

#include <vector>

#include "fp4moe/reference.hpp"

namespace fp4moe::reference::detail {

struct LayerScales {
  std::vector<float> a_scale;  // [E] the GEMM1 input's NVFP4 scale (1 in w4a16)
  std::vector<float> alpha1;   // [E] h = alpha1 * acc (+ w13_bias)
  std::vector<float> alpha2;   // [E] y = alpha2 * acc (+ w2_bias)
};

// Arguments as moe_forward has checked them.
LayerScales layer_scales(const MoeProblem& problem, const MoeWeights& weights);

}  // namespace fp4moe::reference::detail
