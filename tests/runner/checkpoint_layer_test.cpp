// tests/runner/checkpoint_layer_test.cpp — a checkpoint's MoE layer (fixtures in both formats and the
// four model namings) through the GPU path agrees with the CPU reference within the layer tolerance
// of docs/numerics.md (ids identical, relative L2 < 5e-3).
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

TEST(CheckpointLayer, SmallFixturesOnGpuMatchTheReference) {
  std::string why;
  if (!cuda_device_available(&why)) GTEST_SKIP() << why;
  const std::string root = std::string(FP4MOE_TEST_TMPDIR) + "/gpu_fixtures";
  std::filesystem::create_directories(root);
  for (io::CheckpointFormat format : {io::CheckpointFormat::ModelOpt, io::CheckpointFormat::CompressedTensors}) {
    for (io::ModelFamily family : {io::ModelFamily::DeepSeekV3, io::ModelFamily::Qwen3Moe, io::ModelFamily::Llama4,
                                   io::ModelFamily::Mixtral}) {
      const std::string label = std::string(io::to_string(format)) + "/" + std::string(io::to_string(family));
      io::FixtureOptions o;
      o.format = format;
      o.family = family;
      o.hidden = 256;
      o.inter = 128;
      o.num_experts = 16;
      o.top_k = family == io::ModelFamily::Llama4 ? 1 : 4;
      o.up_scale_2_factor = 1.5f;  // exercises the w1/w3 scale fusion
      const std::string dir = root + "/" + std::string(io::to_string(format)) + "_" + std::string(io::to_string(family));
      const io::Fixture fx = io::write_fixture(dir, o);
      const io::Checkpoint ckpt = io::Checkpoint::open(dir);
      const int64_t layer = fx.layers.begin()->first;
      const io::MoeLayerWeights w = ckpt.load_layer(layer);
      const int64_t T = 45;
      const io::MoeCase c = w.to_case(io::random_hidden_states(T, w.problem.hidden, 5), T);
      const reference::MoeResult ref =
          reference::moe_forward(c.problem, c.num_tokens, c.hidden_states.data(), c.router(), c.weights());
      const reference::MoeResult gpu = run_case_on_gpu(c);
      ASSERT_EQ(gpu.topk_ids, ref.topk_ids) << label;
      double num = 0, den = 0;
      for (size_t i = 0; i < ref.output.size(); ++i) {
        const double g = format::bf16_to_float(gpu.output[i]), r = format::bf16_to_float(ref.output[i]);
        ASSERT_FALSE(std::isnan(g)) << label << " element " << i;
        num += (g - r) * (g - r);
        den += r * r;
      }
      EXPECT_LT(std::sqrt(num / den), 5e-3) << label;
    }
  }
}

}  // namespace
}  // namespace fp4moe
