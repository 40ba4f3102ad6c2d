// tests/reference/expert_bias_test.cpp — optional expert biases (gpt-oss) in the reference: GEMM1's
// bias is one fp32 add after the global scale, before the activation; GEMM2's one fp32 add after the
// global scale, before the finalize's weighted sum; zero biases change nothing; non-finite biases and
// wrong sizes are refused; case files carry them; tensor-parallel ranks keep their rows of w13_bias and
// rank 0 alone adds w2_bias.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "error_message.hpp"
#include "fp4moe/case_file.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/presets.hpp"
#include "fp4moe/reference.hpp"
#include "fp4moe/weight_layout.hpp"
#include "layout_fixtures.hpp"
#include "test_dir.hpp"

namespace fp4moe {
namespace {

struct LayerRun {
  reference::MoeResult result;
  reference::MoeTrace trace;
};

LayerRun run(const io::MoeCase& c) {
  LayerRun r;
  r.result = reference::moe_forward(c.problem, c.num_tokens, c.hidden_states.data(), c.router(), c.weights(), &r.trace);
  return r;
}

MoeProblem oai_problem(ActQuant mode) {
  MoeProblem p = preset("tiny", mode);
  p.activation.kind = Activation::SwiGLUOai;  // gpt-oss: its experts carry biases
  return p;
}

class ExpertBias : public ::testing::TestWithParam<ActQuant> {};

TEST_P(ExpertBias, Gemm1BiasIsAddedAfterTheScaleAndBeforeTheActivation) {
  const MoeProblem p = oai_problem(GetParam());
  const int64_t T = 11, k = p.top_k(), N13 = p.w13_rows(), I = p.inter;
  io::MoeCase c = io::make_random_packed_case(p, T, 5);
  const LayerRun plain = run(c);
  io::add_random_expert_biases(c, 6);
  c.w2_bias.clear();  // GEMM1's bias alone
  const LayerRun biased = run(c);
  EXPECT_EQ(biased.result.topk_ids, plain.result.topk_ids);
  for (int64_t entry = 0; entry < T * k; ++entry) {
    const int64_t e = plain.result.topk_ids[entry];
    for (int64_t n = 0; n < N13; ++n)
      ASSERT_EQ(biased.trace.gemm1_out[entry * N13 + n], plain.trace.gemm1_out[entry * N13 + n] + c.w13_bias[e * N13 + n])
          << "entry " << entry << " row " << n;
    if (p.act_quant != ActQuant::W4A16) continue;  // w4a4: the activation is re-quantized (block scales)
    for (int64_t i = 0; i < I; ++i) {
      const float g = biased.trace.gemm1_out[entry * N13 + i], u = biased.trace.gemm1_out[entry * N13 + I + i];
      const float want = format::bf16_to_float(format::bf16_from_float(reference::apply_activation(p.activation, g, u)));
      ASSERT_EQ(biased.trace.act_out[entry * I + i], want) << "entry " << entry << " column " << i;
    }
  }
}

TEST_P(ExpertBias, Gemm2BiasIsAddedBeforeTheWeightedSum) {
  const MoeProblem p = oai_problem(GetParam());
  const int64_t T = 9, k = p.top_k(), H = p.hidden;
  io::MoeCase c = io::make_random_packed_case(p, T, 7);
  const LayerRun plain = run(c);
  io::add_random_expert_biases(c, 8);
  c.w13_bias.clear();  // GEMM2's bias alone
  const LayerRun biased = run(c);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      float acc = 0.0f;  // the finalize: acc = acc + w * y in slot order, y = alpha2 * acc2 + b
      for (int64_t j = 0; j < k; ++j) {
        const int64_t entry = t * k + j, e = plain.result.topk_ids[entry];
        const float y = plain.trace.gemm2_out[entry * H + h] + c.w2_bias[e * H + h];
        ASSERT_EQ(biased.trace.gemm2_out[entry * H + h], y) << "entry " << entry << " column " << h;
        acc = acc + plain.result.topk_weights[entry] * y;
      }
      ASSERT_EQ(biased.result.output_f32[t * H + h], acc) << "token " << t << " column " << h;
    }
}

TEST_P(ExpertBias, ZeroBiasesChangeNothing) {
  const MoeProblem p = oai_problem(GetParam());
  io::MoeCase c = io::make_random_packed_case(p, 13, 9);
  const LayerRun plain = run(c);
  c.w13_bias.assign(p.num_experts * p.w13_rows(), 0.0f);
  c.w2_bias.assign(p.num_experts * p.hidden, 0.0f);
  EXPECT_EQ(run(c).result.output, plain.result.output);
}

INSTANTIATE_TEST_SUITE_P(Modes, ExpertBias,
                         ::testing::Values(ActQuant::W4A16, ActQuant::W4A4Scalar, ActQuant::W4A4PerExpert));

TEST(ExpertBiasErrors, NonFiniteBiasesAreRefused) {
  io::MoeCase c = io::make_random_packed_case(preset("tiny"), 2, 1);
  io::add_random_expert_biases(c, 2);
  c.w13_bias[3 * c.problem.w13_rows() + 5] = std::nanf("");
  expect_error([&] { run(c); }, "weights.w13_bias[3, 5] is not finite");
  c.w13_bias[3 * c.problem.w13_rows() + 5] = 0.0f;
  c.w2_bias[7] = INFINITY;
  expect_error([&] { run(c); }, "weights.w2_bias[0, 7] is not finite");
}

TEST(ExpertBiasCaseFile, RoundTripsAndChecksShapes) {
  io::MoeCase c = io::make_random_case(preset("tiny"), 3);
  io::add_random_expert_biases(c, 4);
  const std::string path = test::test_file_path("expert_bias", ".safetensors");
  io::save_case(path, c);
  const io::MoeCase back = io::load_case(path);
  EXPECT_EQ(back.w13_bias, c.w13_bias);
  EXPECT_EQ(back.w2_bias, c.w2_bias);
  EXPECT_EQ(run(back).result.output, run(c).result.output);
  c.w2_bias.pop_back();
  expect_error([&] { io::save_case(path, c); }, "w2_bias has 2047 elements, expected E*H = 2048");
}

TEST(ExpertBiasTensorParallel, RanksKeepTheirW13RowsAndRankZeroAddsW2Bias) {
  const MoeProblem p = oai_problem(ActQuant::W4A4Scalar);
  const int64_t T = 17, H = p.hidden, k = p.top_k();
  io::MoeCase c = io::make_random_packed_case(p, T, 11);
  io::add_random_expert_biases(c, 12);
  reference::MoeTrace whole;
  const reference::MoeResult full = reference::moe_forward(p, T, c.hidden_states.data(), c.router(), c.weights(), &whole);
  std::vector<float> sum(T * H, 0.0f);
  std::vector<double> y_abs(T * k * H, 0.0);
  for (int r = 0; r < 2; ++r) {
    const io::TensorParallelShard s = io::tensor_parallel_shard(p, c.weights(), r, 2);
    EXPECT_EQ(s.w13_bias.size(), size_t(p.num_experts * 2 * (s.inter_end - s.inter_begin)));
    EXPECT_EQ(s.w2_bias.empty(), r != 0);
    reference::MoeTrace trace;
    const reference::MoeResult out = reference::moe_forward(s.problem, T, c.hidden_states.data(), c.router(), s.weights(), &trace);
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += out.output_f32[i];
    for (size_t i = 0; i < y_abs.size(); ++i) y_abs[i] += std::fabs(trace.gemm2_out[i]);
  }
  std::vector<double> bound(T * H, 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j)
      for (int64_t h = 0; h < H; ++h) bound[t * H + h] += std::fabs(full.topk_weights[t * k + j]) * y_abs[(t * k + j) * H + h];
  test::expect_partials_sum_to_the_layer(sum, full, bound, 2e-6);
}

}  // namespace
}  // namespace fp4moe
