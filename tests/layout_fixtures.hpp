// tests/layout_fixtures.hpp — a case's weights in the other input layout that weight preparation
// accepts: 128x4-swizzled block scales and w13 rows [up; gate] (FlashInfer's order).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "fp4moe/case_file.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/reference.hpp"

namespace fp4moe::test {

// [gate; up] <-> [up; gate]: swaps the two halves of every expert's rows of `v` (row_bytes per row).
inline std::vector<uint8_t> swap_gate_up(std::vector<uint8_t> v, const MoeProblem& p, int64_t row_bytes) {
  const int64_t N13 = p.w13_rows(), I = p.inter;
  for (int64_t e = 0; e < p.num_experts; ++e) {
    auto first = v.begin() + e * N13 * row_bytes;
    std::swap_ranges(first, first + I * row_bytes, first + I * row_bytes);
  }
  return v;
}

struct SwizzledUpGateWeights {
  std::vector<uint8_t> w13, w13_scale, w2_scale;  // [up; gate] rows; swizzled scales

  explicit SwizzledUpGateWeights(const io::MoeCase& c) {
    const MoeProblem& p = c.problem;
    const int64_t E = p.num_experts, H = p.hidden, I = p.inter, N13 = p.w13_rows();
    w13 = swap_gate_up(c.w13, p, H / 2);
    const std::vector<uint8_t> w13_linear = swap_gate_up(c.w13_scale, p, H / 16);
    w13_scale.resize(format::swizzled_scales_size(E, N13, H / 16));
    w2_scale.resize(format::swizzled_scales_size(E, H, I / 16));
    format::scales_linear_to_swizzled(w13_linear.data(), E, N13, H / 16, w13_scale.data());
    format::scales_linear_to_swizzled(c.w2_scale.data(), E, H, I / 16, w2_scale.data());
  }
  // The case's weights with these three tensors in their place (views; valid while both live).
  reference::MoeWeights weights(const io::MoeCase& c) const {
    reference::MoeWeights w = c.weights();
    w.w13 = w13.data();
    w.w13_scale = w13_scale.data();
    w.w2_scale = w2_scale.data();
    return w;
  }
};

}  // namespace fp4moe::test
