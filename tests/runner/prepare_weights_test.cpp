// tests/runner/prepare_weights_test.cpp — prepare_weights accepts the layouts checkpoints come in:
// 128x4-swizzled scales and [up; gate] w13 rows give the same layer as the canonical layout.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <vector>

#include "fp4moe/case_file.hpp"
#include "fp4moe/presets.hpp"
#include "fp4moe/runner.hpp"
#include "layout_fixtures.hpp"
#include "runner/layer_buffers.hpp"

namespace fp4moe {
namespace {

// Runs `c` through a runner prepared from `w` with `options`; returns the bf16 output bits.
std::vector<uint16_t> run_prepared(const io::MoeCase& c, const reference::MoeWeights& w, const WeightPrepOptions& options) {
  const MoeProblem& p = c.problem;
  auto runner = MoeRunner::create(p, c.num_tokens);
  const Status s = runner->prepare_weights(w, options);
  EXPECT_TRUE(s.ok()) << s.message;
  const test::LayerBuffers buf(p, c.num_tokens, *runner);
  EXPECT_EQ(buf.upload(c), cudaSuccess);
  EXPECT_EQ(buf.poison_output(), cudaSuccess);
  const Status f = runner->forward(nullptr, buf.args);
  EXPECT_TRUE(f.ok()) << f.message;
  cudaError_t copied;
  std::vector<uint16_t> result = buf.output(&copied);
  EXPECT_EQ(copied, cudaSuccess);
  return result;
}

TEST(LayerPrepare, SwizzledScalesAndUpGateRowsGiveTheSameLayer) {
  std::string why;
  if (!cuda_device_available(&why)) GTEST_SKIP() << why;
  const MoeProblem p = preset("tiny", ActQuant::W4A4Scalar);
  const io::MoeCase c = io::make_random_packed_case(p, 50, 31);
  const std::vector<uint16_t> canonical = run_prepared(c, c.weights(), {});
  // The same weights with 128x4-swizzled scales and [up; gate] rows.
  const test::SwizzledUpGateWeights other(c);
  const reference::MoeWeights w = other.weights(c);
  WeightPrepOptions options;
  options.scales_swizzled = true;
  options.w13_up_gate = true;
  EXPECT_EQ(run_prepared(c, w, options), canonical);
}

}  // namespace
}  // namespace fp4moe
