// tests/runner/checkpoint_gpt_oss_layer_test.cpp — a gpt-oss (MXFP4) checkpoint layer (the fixture in
// the published layout: interleaved gate/up, biases, router bias) through the GPU path agrees with the
// CPU reference on the loaded layer within the layer tolerance of docs/numerics.md (ids identical,
// relative L2 < 5e-3), whole and as a tensor-parallel rank.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>

#include "fp4moe/bench.hpp"
#include "fp4moe/checkpoint.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/reference.hpp"
#include "fp4moe/runner.hpp"

namespace fp4moe {
namespace {

double relative_l2(const std::vector<uint16_t>& got, const std::vector<uint16_t>& want, const std::string& label) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double g = format::bf16_to_float(got[i]), r = format::bf16_to_float(want[i]);
    EXPECT_FALSE(std::isnan(g)) << label << " element " << i;
    num += (g - r) * (g - r);
    den += r * r;
  }
  return std::sqrt(num / den);
}

TEST(CheckpointLayer, GptOssFixtureOnGpuMatchesTheReference) {
  std::string why;
  if (!cuda_device_available(&why)) GTEST_SKIP() << why;
  const std::string dir = std::string(FP4MOE_TEST_TMPDIR) + "/gpu_fixtures/gpt_oss";
  std::filesystem::create_directories(dir);
  io::FixtureOptions o;
  o.format = io::CheckpointFormat::Mxfp4;
  o.family = io::ModelFamily::GptOss;
  o.num_layers = 1;
  o.hidden = 256;
  o.inter = 128;
  o.num_experts = 16;
  o.top_k = 4;
  io::write_fixture(dir, o);
  const io::Checkpoint ckpt = io::Checkpoint::open(dir);
  const int64_t T = 45;
  const std::vector<uint16_t> x = io::random_hidden_states(T, o.hidden, 5);
  const io::MoeLayerWeights w = ckpt.load_layer(0);
  ASSERT_EQ(w.problem.weight_format, WeightFormat::MXFP4);
  const io::MoeCase c = w.to_case(x, T);
  const reference::MoeResult ref =
      reference::moe_forward(c.problem, c.num_tokens, c.hidden_states.data(), c.router(), c.weights());
  const reference::MoeResult gpu = run_case_on_gpu(c);
  ASSERT_EQ(gpu.topk_ids, ref.topk_ids);
  EXPECT_LT(relative_l2(gpu.output, ref.output, "whole layer"), 5e-3);
  // Tensor-parallel rank 1 of 2 (no down bias there): the GPU against the reference on the same rank.
  io::LoadOptions lo;
  lo.tp_rank = 1;
  lo.tp_size = 2;
  const io::MoeLayerWeights r1 = ckpt.load_layer(0, lo);
  ASSERT_TRUE(r1.w2_bias.empty());
  const io::MoeCase c1 = r1.to_case(x, T);
  const reference::MoeResult ref1 =
      reference::moe_forward(c1.problem, c1.num_tokens, c1.hidden_states.data(), c1.router(), c1.weights());
  const reference::MoeResult gpu1 = run_case_on_gpu(c1);
  ASSERT_EQ(gpu1.topk_ids, ref1.topk_ids);
  EXPECT_LT(relative_l2(gpu1.output, ref1.output, "tp rank 1"), 5e-3);
}

}  // namespace
}  // namespace fp4moe
