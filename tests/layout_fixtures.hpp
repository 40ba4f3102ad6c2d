// tests/layout_fixtures.hpp — a case's weights in other forms: the other input layout that weight
// preparation accepts (128x4-swizzled block scales, w13 rows [up; gate] as in FlashInfer), and one
// expert-parallel rank's share (a contiguous range of experts, with the routing mapped to it), and the
// check that ranks' fp32 partial outputs add up to the whole layer's.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "fp4moe/case_file.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/reference.hpp"

namespace fp4moe::test {

// [gate; up] <-> [up; gate]: swaps the two halves of every expert's rows of `v` (row_elems per row;
// an empty v stays empty).
template <typename T>
std::vector<T> swap_gate_up(std::vector<T> v, const MoeProblem& p, int64_t row_elems) {
  const int64_t N13 = p.w13_rows(), I = p.inter;
  for (int64_t e = 0; e < p.num_experts && !v.empty(); ++e) {
    auto first = v.begin() + e * N13 * row_elems;
    std::swap_ranges(first, first + I * row_elems, first + I * row_elems);
  }
  return v;
}

struct SwizzledUpGateWeights {
  std::vector<uint8_t> w13, w13_scale, w2_scale;  // [up; gate] rows; swizzled scales
  std::vector<float> w13_bias;                    // [up; gate] rows (empty without biases)

  explicit SwizzledUpGateWeights(const io::MoeCase& c) {
    const MoeProblem& p = c.problem;
    const int64_t E = p.num_experts, H = p.hidden, I = p.inter, N13 = p.w13_rows();
    w13 = swap_gate_up(c.w13, p, H / 2);
    w13_bias = swap_gate_up(c.w13_bias, p, 1);
    const std::vector<uint8_t> w13_linear = swap_gate_up(c.w13_scale, p, H / 16);
    w13_scale.resize(format::swizzled_scales_size(E, N13, H / 16));
    w2_scale.resize(format::swizzled_scales_size(E, H, I / 16));
    format::scales_linear_to_swizzled(w13_linear.data(), E, N13, H / 16, w13_scale.data());
    format::scales_linear_to_swizzled(c.w2_scale.data(), E, H, I / 16, w2_scale.data());
  }
  // The case's weights with these tensors in their place (views; valid while both live).
  reference::MoeWeights weights(const io::MoeCase& c) const {
    reference::MoeWeights w = c.weights();
    w.w13 = w13.data();
    w.w13_scale = w13_scale.data();
    w.w2_scale = w2_scale.data();
    if (!w13_bias.empty()) w.w13_bias = w13_bias.data();
    return w;
  }
};

// Experts [begin, end) of a case: their weights, the whole layer's max GEMM1 input scale, and the case's
// routing mapped to local ids (another rank's expert: -1), for a precomputed problem with
// skip_foreign_ids. `routing_ids` / `routing_weights` are the whole layer's [T, k] routing.
struct ExpertRangeWeights {
  MoeProblem problem;  // num_experts = end - begin, precomputed routing, skip_foreign_ids
  std::vector<uint8_t> w13, w13_scale, w2, w2_scale;
  std::vector<float> w13_scale_2, w13_input_scale, w2_scale_2, w2_input_scale;
  float w13_input_scale_max = 0.0f;
  std::vector<float> w13_bias, w2_bias;  // the range's rows, or empty
  std::vector<int32_t> local_ids;  // [T, k]

  ExpertRangeWeights(const io::MoeCase& c, int64_t begin, int64_t end, const std::vector<int32_t>& routing_ids) {
    const MoeProblem& p = c.problem;
    problem = p.expert_parallel_rank(end - begin);
    auto range = [&](const auto& v) {
      const size_t per = v.size() / size_t(p.num_experts);
      return std::vector<typename std::decay_t<decltype(v)>::value_type>(v.begin() + begin * per, v.begin() + end * per);
    };
    w13 = range(c.w13);
    w13_scale = range(c.w13_scale);
    w2 = range(c.w2);
    w2_scale = range(c.w2_scale);
    w13_scale_2 = range(c.w13_scale_2);
    w13_input_scale = range(c.w13_input_scale);
    w2_scale_2 = range(c.w2_scale_2);
    w2_input_scale = range(c.w2_input_scale);
    w13_bias = range(c.w13_bias);
    w2_bias = range(c.w2_bias);
    w13_input_scale_max = c.w13_input_scale.empty() ? 0.0f  // MXFP4 / w4a16 without input scales
                                                    : *std::max_element(c.w13_input_scale.begin(), c.w13_input_scale.end());
    local_ids.resize(routing_ids.size());
    for (size_t i = 0; i < routing_ids.size(); ++i)
      local_ids[i] = routing_ids[i] >= begin && routing_ids[i] < end ? routing_ids[i] - int32_t(begin) : -1;
  }
  reference::MoeWeights weights() const {
    reference::MoeWeights v{w13.data(), w13_scale.data(), w13_scale_2.data(), w13_input_scale.data(),
                            w2.data(),  w2_scale.data(),  w2_scale_2.data(),  w2_input_scale.data(),
                            w13_input_scale_max};
    v.w13_bias = w13_bias.empty() ? nullptr : w13_bias.data();
    v.w2_bias = w2_bias.empty() ? nullptr : w2_bias.data();
    return v;
  }
};

// The ranks' fp32 partial outputs added in fp32 (`sum`, [T, H]) against the whole layer: within
// tolerance * bound[i] of its fp32 sums (bound: the magnitudes that were added, so the difference is
// fp32 summation order only) and, rounded once to bf16, its output except where that order moves a
// value across a rounding boundary: by one ulp, on at most 1% of the elements.
inline void expect_partials_sum_to_the_layer(const std::vector<float>& sum, const reference::MoeResult& full,
                                             const std::vector<double>& bound, double tolerance) {
  ASSERT_EQ(sum.size(), full.output_f32.size());
  ASSERT_EQ(bound.size(), sum.size());
  size_t moved = 0;
  for (size_t i = 0; i < sum.size(); ++i) {
    ASSERT_NEAR(sum[i], full.output_f32[i], tolerance * bound[i] + 1e-30) << "output element " << i;
    const float got = format::bf16_to_float(format::bf16_from_float(sum[i]));
    const float want = format::bf16_to_float(full.output[i]);
    if (got != want) {
      ++moved;
      ASSERT_LE(std::fabs(got - want), std::ldexp(1.0f, std::ilogb(want) - 7)) << "output element " << i;
    }
  }
  EXPECT_LE(moved, sum.size() / 100);
}

}  // namespace fp4moe::test
