// tests/io/weight_layout_test.cpp — canonical_expert_weights: swizzled scales and [up; gate] rows come
// back bit for bit in the canonical layout; bad options are errors that say why.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "error_message.hpp"
#include "fp4moe/case_file.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/presets.hpp"
#include "fp4moe/weight_layout.hpp"

namespace fp4moe {
namespace {

// [gate; up] <-> [up; gate]: swaps the two halves of every expert's rows of `v` (row_bytes per row).
std::vector<uint8_t> swap_halves(std::vector<uint8_t> v, const MoeProblem& p, int64_t row_bytes) {
  const int64_t N13 = p.w13_rows(), I = p.inter;
  for (int64_t e = 0; e < p.num_experts; ++e) {
    auto first = v.begin() + e * N13 * row_bytes;
    std::swap_ranges(first, first + I * row_bytes, first + I * row_bytes);
  }
  return v;
}

TEST(WeightLayout, CanonicalInputIsCopiedUnchanged) {
  const MoeProblem p = preset("tiny");
  const io::MoeCase c = io::make_random_packed_case(p, 1, 5);
  const io::CanonicalExpertWeights w = io::canonical_expert_weights(p, c.weights(), {});
  EXPECT_EQ(w.w13, c.w13);
  EXPECT_EQ(w.w13_scale, c.w13_scale);
  EXPECT_EQ(w.w2_scale, c.w2_scale);
}

TEST(WeightLayout, SwizzledScalesAndUpGateRowsComeBackCanonical) {
  const MoeProblem p = preset("tiny");
  const io::MoeCase c = io::make_random_packed_case(p, 1, 6);
  const int64_t E = p.num_experts, H = p.hidden, I = p.inter, N13 = p.w13_rows();
  const std::vector<uint8_t> w13 = swap_halves(c.w13, p, H / 2);
  const std::vector<uint8_t> w13_scale = swap_halves(c.w13_scale, p, H / 16);
  std::vector<uint8_t> w13_swz(format::swizzled_scales_size(E, N13, H / 16));
  std::vector<uint8_t> w2_swz(format::swizzled_scales_size(E, H, I / 16));
  format::scales_linear_to_swizzled(w13_scale.data(), E, N13, H / 16, w13_swz.data());
  format::scales_linear_to_swizzled(c.w2_scale.data(), E, H, I / 16, w2_swz.data());
  reference::MoeWeights in = c.weights();
  in.w13 = w13.data();
  in.w13_scale = w13_swz.data();
  in.w2_scale = w2_swz.data();

  const io::CanonicalExpertWeights w = io::canonical_expert_weights(p, in, {.scales_swizzled = true, .w13_up_gate = true});
  EXPECT_EQ(w.w13, c.w13);
  EXPECT_EQ(w.w13_scale, c.w13_scale);
  EXPECT_EQ(w.w2_scale, c.w2_scale);
}

TEST(WeightLayout, ErrorsNameTheTensorOrOption) {
  MoeProblem p = preset("tiny");
  const io::MoeCase c = io::make_random_packed_case(p, 1, 7);
  reference::MoeWeights w = c.weights();
  w.w2_scale = nullptr;
  expect_error([&] { io::canonical_expert_weights(p, w, {}); }, "w2_scale is null");
  p.activation.kind = Activation::Relu2;  // w13 then has I rows: the case's first half serves
  expect_error([&] { io::canonical_expert_weights(p, c.weights(), {.w13_up_gate = true}); },
               "w13_up_gate needs a gated activation");
}

}  // namespace
}  // namespace fp4moe
