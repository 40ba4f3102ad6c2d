// tests/io/weight_layout_test.cpp — canonical_expert_weights: swizzled scales and [up; gate] rows come
// back bit for bit in the canonical layout; bad options are errors that say why. Tensor-parallel shards:
// each rank is a plain layer whose outputs sum to the whole layer's.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "error_message.hpp"
#include "fp4moe/case_file.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/presets.hpp"
#include "fp4moe/reference.hpp"
#include "fp4moe/weight_layout.hpp"
#include "layout_fixtures.hpp"

namespace fp4moe {
namespace {

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
  io::MoeCase c = io::make_random_packed_case(p, 1, 6);
  io::add_random_expert_biases(c, 6);
  const test::SwizzledUpGateWeights other(c);
  ASSERT_NE(other.w13_bias, c.w13_bias);
  const io::CanonicalExpertWeights w =
      io::canonical_expert_weights(p, other.weights(c), {.scales_swizzled = true, .w13_up_gate = true});
  EXPECT_EQ(w.w13, c.w13);
  EXPECT_EQ(w.w13_scale, c.w13_scale);
  EXPECT_EQ(w.w2_scale, c.w2_scale);
  EXPECT_EQ(w.w13_bias, c.w13_bias);  // the bias's [up; gate] halves swapped back too
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

// ---- tensor parallelism ------------------------------------------------------------------------------
namespace fp4moe {
namespace {

TEST(TensorParallel, RangesSplitTheIntermediateSizeInWholeScaleBlocks) {
  EXPECT_EQ(io::tensor_parallel_range(2048, 0, 8), std::make_pair(int64_t(0), int64_t(256)));
  EXPECT_EQ(io::tensor_parallel_range(2048, 7, 8), std::make_pair(int64_t(1792), int64_t(2048)));
  EXPECT_EQ(io::tensor_parallel_range(96, 0, 1), std::make_pair(int64_t(0), int64_t(96)));
  // gpt-oss-120b: 180 blocks over 8 ranks, the first 4 hold 23.
  EXPECT_EQ(io::tensor_parallel_range(2880, 0, 8), std::make_pair(int64_t(0), int64_t(368)));
  EXPECT_EQ(io::tensor_parallel_range(2880, 3, 8), std::make_pair(int64_t(1104), int64_t(1472)));
  EXPECT_EQ(io::tensor_parallel_range(2880, 4, 8), std::make_pair(int64_t(1472), int64_t(1824)));
  EXPECT_EQ(io::tensor_parallel_range(2880, 7, 8), std::make_pair(int64_t(2528), int64_t(2880)));
  expect_error([] { io::tensor_parallel_range(32, 0, 3); }, "I = 32 must be a multiple of 16 with at least tp_size = 3 blocks");
  expect_error([] { io::tensor_parallel_range(40, 0, 2); }, "I = 40 must be a multiple of 16");
  expect_error([] { io::tensor_parallel_range(2048, 2, 2); }, "tp_rank must be in [0, 2), got 2");
  expect_error([] { io::tensor_parallel_range(2048, 0, 0); }, "tp_size must be >= 1, got 0");
}

struct TpCase {
  ActQuant mode;
  Activation activation;
  int size;
};

class TensorParallelLayer : public ::testing::TestWithParam<TpCase> {};

// Each rank's layer is a plain MoE layer with its share of I: its GEMM2 input is the whole layer's restricted
// to its columns, bit for bit; its y sums to the whole y up to fp32 order; its bf16 outputs sum to the
// whole output up to the rounding of each partial.
TEST_P(TensorParallelLayer, RanksSumToTheWholeLayer) {
  const TpCase tc = GetParam();
  MoeProblem p = preset("tiny", tc.mode);
  p.activation.kind = tc.activation;
  const int64_t T = 19, H = p.hidden, I = p.inter, k = p.top_k();
  const io::MoeCase c = io::make_random_packed_case(p, T, 40 + tc.size);
  reference::MoeTrace whole;
  const reference::MoeResult full = reference::moe_forward(p, T, c.hidden_states.data(), c.router(), c.weights(), &whole);
  std::vector<double> y_sum(T * k * H, 0.0), out_sum(T * H, 0.0), y_abs(T * k * H, 0.0);
  std::vector<float> out_f32_sum(T * H, 0.0f);  // fp32, in rank order: what an fp32 all-reduce adds
  for (int r = 0; r < tc.size; ++r) {
    const io::TensorParallelShard s = io::tensor_parallel_shard(p, c.weights(), r, tc.size);
    const int64_t part = s.inter_end - s.inter_begin;
    ASSERT_EQ(s.problem.inter, part);
    reference::MoeTrace trace;
    const reference::MoeResult out =
        reference::moe_forward(s.problem, T, c.hidden_states.data(), c.router(), s.weights(), &trace);
    EXPECT_EQ(out.topk_ids, full.topk_ids);
    for (int64_t row = 0; row < T * k; ++row)
      for (int64_t i = 0; i < part; ++i)
        ASSERT_EQ(trace.act_out[row * part + i], whole.act_out[row * I + s.inter_begin + i])
            << "rank " << r << " row " << row << " column " << i;
    for (size_t i = 0; i < y_sum.size(); ++i) {
      y_sum[i] += trace.gemm2_out[i];
      y_abs[i] += std::fabs(trace.gemm2_out[i]);
    }
    for (size_t i = 0; i < out_sum.size(); ++i) {
      out_sum[i] += format::bf16_to_float(out.output[i]);
      out_f32_sum[i] += out.output_f32[i];
      ASSERT_EQ(out.output[i], format::bf16_from_float(out.output_f32[i])) << "rank " << r << " element " << i;
    }
  }
  for (size_t i = 0; i < y_sum.size(); ++i)
    ASSERT_NEAR(y_sum[i], whole.gemm2_out[i], 1e-6 * y_abs[i] + 1e-30) << "y element " << i;
  // fp32 partials: the bound is what was added, sum_j |w_j| * sum_ranks |y_j|.
  std::vector<double> bound(T * H, 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j)
      for (int64_t h = 0; h < H; ++h)
        bound[t * H + h] += std::fabs(full.topk_weights[t * k + j]) * y_abs[(t * k + j) * H + h];
  test::expect_partials_sum_to_the_layer(out_f32_sum, full, bound, 2e-6);  // y itself sums in another order
  double num = 0, den = 0;
  for (size_t i = 0; i < out_sum.size(); ++i) {
    const double want = format::bf16_to_float(full.output[i]);
    num += (out_sum[i] - want) * (out_sum[i] - want);
    den += want * want;
  }
  EXPECT_LT(std::sqrt(num / den), 5e-3);  // each rank's partial output is rounded to bf16 once
}

INSTANTIATE_TEST_SUITE_P(Modes, TensorParallelLayer,
                         ::testing::Values(TpCase{ActQuant::W4A16, Activation::SwiGLU, 2},
                                           TpCase{ActQuant::W4A4Scalar, Activation::SwiGLU, 4},
                                           TpCase{ActQuant::W4A4Scalar, Activation::SwiGLU, 3},  // 48, 48, 32
                                           TpCase{ActQuant::W4A4PerExpert, Activation::SwiGLUOai, 2},
                                           TpCase{ActQuant::W4A4Scalar, Activation::Relu2, 8},
                                           TpCase{ActQuant::W4A16, Activation::GeGLU, 1}));

TEST(TensorParallel, ShardErrorsNameTheTensor) {
  const MoeProblem p = preset("tiny", ActQuant::W4A4Scalar);
  const io::MoeCase c = io::make_random_packed_case(p, 1, 3);
  reference::MoeWeights w = c.weights();
  w.w2_input_scale = nullptr;
  expect_error([&] { io::tensor_parallel_shard(p, w, 0, 2); }, "w2_input_scale is null (act_quant w4a4_scalar needs it)");
  expect_error([&] { io::tensor_parallel_shard(p, c.weights(), 0, 9); }, "with at least tp_size = 9 blocks of 16");
}

}  // namespace
}  // namespace fp4moe
