// tests/reference/expert_parallel_test.cpp — expert parallelism in the reference: a rank runs its range
// of experts on the whole layer's routing mapped to local ids (precomputed, skip_foreign_ids): its
// entries' GEMM2 outputs are the whole layer's bit for bit, other ranks' entries add nothing, and the
// ranks' outputs sum to the whole layer's output up to the bf16 rounding of each partial (bf16
// partials) or up to fp32 summation order (fp32 partials, MoeResult::output_f32).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "error_message.hpp"
#include "fp4moe/case_file.hpp"
#include "fp4moe/checkpoint.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/presets.hpp"
#include "fp4moe/reference.hpp"
#include "layout_fixtures.hpp"

namespace fp4moe {
namespace {

class ExpertParallel : public ::testing::TestWithParam<ActQuant> {};

TEST_P(ExpertParallel, RanksSumToTheWholeLayer) {
  const MoeProblem p = preset("tiny", GetParam());  // E = 8, k = 2
  const int64_t T = 23, H = p.hidden, k = p.top_k(), E = p.num_experts;
  const io::MoeCase c = io::make_random_packed_case(p, T, 77);
  reference::MoeTrace whole;
  const reference::MoeResult full = reference::moe_forward(p, T, c.hidden_states.data(), c.router(), c.weights(), &whole);
  std::vector<double> sum(T * H, 0.0);
  std::vector<float> f32_sum(T * H, 0.0f);  // fp32, in rank order: what an fp32 all-reduce adds
  std::vector<int> owners(T * k, 0);
  for (int rank = 0; rank < 3; ++rank) {
    const auto [begin, end] = io::expert_range(E, rank, 3);
    const test::ExpertRangeWeights local(c, begin, end, full.topk_ids);
    reference::RouterInput router;
    router.topk_ids = local.local_ids.data();
    router.topk_weights = full.topk_weights.data();
    reference::MoeTrace trace;
    const reference::MoeResult out =
        reference::moe_forward(local.problem, T, c.hidden_states.data(), router, local.weights(), &trace);
    for (int64_t entry = 0; entry < T * k; ++entry) {
      const bool mine = local.local_ids[entry] >= 0;
      owners[entry] += mine;
      for (int64_t h = 0; h < H; ++h)
        ASSERT_EQ(trace.gemm2_out[entry * H + h], mine ? whole.gemm2_out[entry * H + h] : 0.0f)
            << "rank " << rank << " entry " << entry << " column " << h;
    }
    for (size_t i = 0; i < sum.size(); ++i) {
      sum[i] += format::bf16_to_float(out.output[i]);
      f32_sum[i] += out.output_f32[i];
    }
  }
  for (int n : owners) ASSERT_EQ(n, 1);  // every entry belongs to exactly one rank
  double num = 0, den = 0;
  for (size_t i = 0; i < sum.size(); ++i) {
    const double want = format::bf16_to_float(full.output[i]);
    num += (sum[i] - want) * (sum[i] - want);
    den += want * want;
  }
  EXPECT_LT(std::sqrt(num / den), 5e-3);
  // fp32 partials: the bound is what was added, sum_j |w_j * y_j|.
  std::vector<double> bound(T * H, 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j)
      for (int64_t h = 0; h < H; ++h)
        bound[t * H + h] += std::fabs(full.topk_weights[t * k + j] * whole.gemm2_out[(t * k + j) * H + h]);
  test::expect_partials_sum_to_the_layer(f32_sum, full, bound, 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Modes, ExpertParallel,
                         ::testing::Values(ActQuant::W4A16, ActQuant::W4A4Scalar, ActQuant::W4A4PerExpert));

TEST(ExpertParallelErrors, ForeignIdsNeedTheFlagAndPrecomputedRouting) {
  MoeProblem p = preset("tiny");
  p.routing.skip_foreign_ids = true;
  expect_error([&] { p.validate(); }, "skip_foreign_ids needs routing method precomputed");
  p.routing.method = RoutingMethod::Precomputed;
  p.num_experts = 1;  // k = 2 > E is fine: the ids are the whole layer's
  p.validate();
  const io::MoeCase c = io::make_random_packed_case(preset("tiny", ActQuant::W4A4Scalar), 2, 5);
  const test::ExpertRangeWeights local(c, 0, 4, {0, 3, 5, 0});  // token 1's second slot: another rank's
  reference::RouterInput router;
  router.topk_ids = local.local_ids.data();
  const std::vector<float> weights = {0.5f, 0.5f, 0.5f, 0.5f};
  router.topk_weights = weights.data();
  MoeProblem strict = local.problem;
  strict.routing.skip_foreign_ids = false;
  strict.routing.total_experts = 0;  // a plain precomputed problem
  expect_error([&] { reference::moe_forward(strict, 2, c.hidden_states.data(), router, local.weights()); },
               "must be an expert id in [0, 4), got -1");
  const reference::MoeResult r = reference::moe_forward(local.problem, 2, c.hidden_states.data(), router, local.weights());
  reference::MoeWeights below = local.weights();
  below.w13_input_scale_max =  // below this rank's own largest
      0.5f * *std::max_element(local.w13_input_scale.begin(), local.w13_input_scale.end());
  expect_error([&] { reference::moe_forward(local.problem, 2, c.hidden_states.data(), router, below); },
               "w13_input_scale_max must be 0 (unset) or a finite scale");
  for (int64_t h = 0; h < p.hidden; ++h) EXPECT_FALSE(std::isnan(format::bf16_to_float(r.output[p.hidden + h])));
}

}  // namespace
}  // namespace fp4moe
