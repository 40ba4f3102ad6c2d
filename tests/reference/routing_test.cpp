// tests/reference/routing_test.cpp — reference::route, every method of docs/numerics.md, "Routing methods", on hand-computed
// examples: selection order and exact ties (lower id first), the weight formula of each method (the
// expected values come from plain formulas written out here), DeepSeekV3 group selection, bias and
// scaling factor, the NaN policy, and every argument error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "error_message.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/reference.hpp"

namespace fp4moe::reference {
namespace {

const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

double sig(double x) { return 1.0 / (1.0 + std::exp(-x)); }

RoutingParams params(RoutingMethod m, int k) {
  RoutingParams p;
  p.method = m;
  p.top_k = k;
  return p;
}

Routing route1(const RoutingParams& p, const std::vector<float>& logits,
               const std::vector<float>* bias = nullptr) {
  return route(p, 1, static_cast<int64_t>(logits.size()), logits.data(),
               bias != nullptr ? bias->data() : nullptr);
}

// |actual - expected| <= 1e-6 * |expected| (the acceptance tolerance of the weights).
void expect_rel(float actual, double expected, const char* what = "") {
  EXPECT_LE(std::fabs(static_cast<double>(actual) - expected), 1e-6 * std::fabs(expected))
      << what << " actual " << actual << " expected " << expected;
}

// ---- default -------------------------------------------------------------------------------------
TEST(RoutingDefault, SoftmaxOverAllExpertsAtTheSelectedIds) {
  const std::vector<float> s = {1.0f, 3.0f, 2.0f, 0.5f};
  const Routing r = route1(params(RoutingMethod::Default, 2), s);
  ASSERT_EQ(r.ids, (std::vector<int32_t>{1, 2}));
  const double z = std::exp(1.0) + std::exp(3.0) + std::exp(2.0) + std::exp(0.5);
  expect_rel(r.weights[0], std::exp(3.0) / z);
  expect_rel(r.weights[1], std::exp(2.0) / z);
}

TEST(RoutingDefault, ExactTiesGoToTheLowerId) {
  {
    const Routing r = route1(params(RoutingMethod::Default, 2), {2.0f, 5.0f, 5.0f, 5.0f, 1.0f});
    EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 2}));
    EXPECT_EQ(r.weights[0], r.weights[1]);
  }
  {
    const Routing r = route1(params(RoutingMethod::Default, 3), {0.0f, 0.0f, 0.0f, 0.0f});
    EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 1, 2}));
    for (float w : r.weights) EXPECT_EQ(w, 0.25f);
  }
  {  // the tie sits at the boundary of the selection: the lower id gets the last slot
    const Routing r = route1(params(RoutingMethod::Default, 2), {1.0f, 3.0f, 2.0f, 2.0f});
    EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 2}));
  }
}

TEST(RoutingDefault, LargeLogitsDoNotOverflow) {  // max-subtracted
  const Routing r = route1(params(RoutingMethod::Default, 2), {1000.0f, 999.0f, -1000.0f});
  ASSERT_EQ(r.ids, (std::vector<int32_t>{0, 1}));
  const double z = 1.0 + std::exp(-1.0);  // exp(-2000) vanishes
  expect_rel(r.weights[0], 1.0 / z);
  expect_rel(r.weights[1], std::exp(-1.0) / z);
}

TEST(Routing, SignedZerosAreTies) {
  const Routing r = route1(params(RoutingMethod::TopK, 2), {-0.0f, 0.0f});
  ASSERT_EQ(r.ids, (std::vector<int32_t>{0, 1}));
  EXPECT_TRUE(std::signbit(r.weights[0]));  // topk weights are the raw logits
  EXPECT_FALSE(std::signbit(r.weights[1]));
}

// ---- renormalize ---------------------------------------------------------------------------------
TEST(RoutingRenormalize, SoftmaxOverTheSelectedLogits) {
  const Routing r = route1(params(RoutingMethod::Renormalize, 2), {1.0f, 3.0f, 2.0f, 0.0f});
  ASSERT_EQ(r.ids, (std::vector<int32_t>{1, 2}));
  expect_rel(r.weights[0], 1.0 / (1.0 + std::exp(-1.0)));
  expect_rel(r.weights[1], std::exp(-1.0) / (1.0 + std::exp(-1.0)));
}

TEST(RoutingRenormalize, TopOneWeighsExactlyOne) {
  const Routing r = route1(params(RoutingMethod::Renormalize, 1), {-4.0f, 7.5f, 7.0f});
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1}));
  EXPECT_EQ(r.weights[0], 1.0f);
}

TEST(RoutingRenormalize, TiesGiveEqualWeights) {
  const Routing r = route1(params(RoutingMethod::Renormalize, 3), {0.5f, 2.0f, 2.0f, 2.0f, 2.0f});
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 2, 3}));
  for (float w : r.weights) expect_rel(w, 1.0 / 3.0);
}

// ---- renormalize_naive ---------------------------------------------------------------------------
TEST(RoutingRenormalizeNaive, SoftmaxThenDivideBySelectedSum) {
  const std::vector<float> s = {1.0f, 3.0f, 2.0f, 0.0f, -2.0f};
  const Routing r = route1(params(RoutingMethod::RenormalizeNaive, 3), s);
  ASSERT_EQ(r.ids, (std::vector<int32_t>{1, 2, 0}));
  double z = 0;
  for (float v : s) z += std::exp(static_cast<double>(v));
  const double p1 = std::exp(3.0) / z, p2 = std::exp(2.0) / z, p0 = std::exp(1.0) / z;
  expect_rel(r.weights[0], p1 / (p0 + p1 + p2));
  expect_rel(r.weights[1], p2 / (p0 + p1 + p2));
  expect_rel(r.weights[2], p0 / (p0 + p1 + p2));
}

TEST(RoutingRenormalizeNaive, AllExpertsSelectedIsThePlainSoftmax) {
  const std::vector<float> s = {0.25f, -1.0f, 2.0f};
  const Routing r = route1(params(RoutingMethod::RenormalizeNaive, 3), s);
  ASSERT_EQ(r.ids, (std::vector<int32_t>{2, 0, 1}));
  const double z = std::exp(0.25) + std::exp(-1.0) + std::exp(2.0);
  expect_rel(r.weights[0], std::exp(2.0) / z);
  expect_rel(r.weights[1], std::exp(0.25) / z);
  expect_rel(r.weights[2], std::exp(-1.0) / z);
}

// ---- topk ----------------------------------------------------------------------------------------
TEST(RoutingTopK, WeightsAreTheRawLogits) {
  const Routing r = route1(params(RoutingMethod::TopK, 3), {-1.0f, -3.0f, -2.0f, 4.0f});
  EXPECT_EQ(r.ids, (std::vector<int32_t>{3, 0, 2}));
  EXPECT_EQ(r.weights, (std::vector<float>{4.0f, -1.0f, -2.0f}));
}

// ---- sigmoid family ------------------------------------------------------------------------------
TEST(RoutingSigmoid, SigmoidOfTheSelectedLogits) {
  const Routing r = route1(params(RoutingMethod::Sigmoid, 3), {0.0f, 1.0f, -1.0f, 2.0f});
  ASSERT_EQ(r.ids, (std::vector<int32_t>{3, 1, 0}));
  expect_rel(r.weights[0], 1.0 / (1.0 + std::exp(-2.0)));
  expect_rel(r.weights[1], 1.0 / (1.0 + std::exp(-1.0)));
  EXPECT_EQ(r.weights[2], 0.5f);  // sigmoid(0) exactly
}

TEST(RoutingTopKSigmoid, TopKOnLogitsThenSigmoid) {
  const Routing r = route1(params(RoutingMethod::TopKSigmoid, 2), {-3.0f, 0.5f, 0.5f, -0.25f});
  ASSERT_EQ(r.ids, (std::vector<int32_t>{1, 2}));
  expect_rel(r.weights[0], 1.0 / (1.0 + std::exp(-0.5)));
  EXPECT_EQ(r.weights[0], r.weights[1]);
}

TEST(RoutingSigmoidRenorm, SigmoidDividedBySelectedSum) {
  const Routing r = route1(params(RoutingMethod::SigmoidRenorm, 2), {0.0f, 1.0f, -1.0f, 2.0f});
  ASSERT_EQ(r.ids, (std::vector<int32_t>{3, 1}));
  const double a = 1.0 / (1.0 + std::exp(-2.0)), b = 1.0 / (1.0 + std::exp(-1.0));
  expect_rel(r.weights[0], a / (a + b));
  expect_rel(r.weights[1], b / (a + b));
}

TEST(RoutingSigmoidRenorm, TinySumIsClampedTo1em20) {
  // sigmoid(-50) ~ 1.93e-22 each; their sum < 1e-20, so the denominator is 1e-20.
  const Routing r = route1(params(RoutingMethod::SigmoidRenorm, 2), {-50.0f, -50.0f, -60.0f});
  ASSERT_EQ(r.ids, (std::vector<int32_t>{0, 1}));
  const double s50 = 1.0 / (1.0 + std::exp(50.0));
  expect_rel(r.weights[0], s50 / 1e-20);  // ~0.0193, not 0.5
  expect_rel(r.weights[1], s50 / 1e-20);
  // sigmoid(-inf) = 0: weights 0, not NaN.
  const Routing z = route1(params(RoutingMethod::SigmoidRenorm, 2), {-kInf, -kInf});
  EXPECT_EQ(z.weights, (std::vector<float>{0.0f, 0.0f}));
}

// ---- llama4 --------------------------------------------------------------------------------------
TEST(RoutingLlama4, TopOneWithSigmoidWeight) {
  const Routing r = route1(params(RoutingMethod::Llama4, 1), {0.5f, -1.0f, 3.0f, 3.0f});
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2}));
  expect_rel(r.weights[0], 1.0 / (1.0 + std::exp(-3.0)));
  expect_error([] { route1(params(RoutingMethod::Llama4, 2), {0.0f, 1.0f}); }, "llama4");
}

// ---- deepseek_v3 ---------------------------------------------------------------------------------
RoutingParams dsv3(int k, int n_group, int topk_group, float scale) {
  RoutingParams p = params(RoutingMethod::DeepSeekV3, k);
  p.n_group = n_group;
  p.topk_group = topk_group;
  p.routed_scaling_factor = scale;
  return p;
}

// The weights formula, from the fp32 sigmoids of the selected logits.
std::vector<double> dsv3_weights(const std::vector<float>& s, const std::vector<int32_t>& ids,
                                 double scale) {
  double sum = 0;
  for (int32_t id : ids) sum += static_cast<float>(sig(s[id]));
  std::vector<double> w;
  for (int32_t id : ids) w.push_back(static_cast<float>(sig(s[id])) / (sum + 1e-20) * scale);
  return w;
}

TEST(RoutingDeepSeekV3, NoGroupsIsTopKOnSigmoid) {
  const std::vector<float> s = {0.1f, 2.0f, -1.0f, 1.5f, 0.3f, -0.2f};
  const Routing r = route1(dsv3(3, 1, 1, 1.0f), s);
  ASSERT_EQ(r.ids, (std::vector<int32_t>{1, 3, 4}));
  const auto w = dsv3_weights(s, r.ids, 1.0);
  for (int j = 0; j < 3; ++j) expect_rel(r.weights[j], w[j]);
  const double total = r.weights[0] + r.weights[1] + r.weights[2];
  EXPECT_NEAR(total, 1.0, 1e-6);
}

// Groups of 2: {0,1} {2,3} {4,5} {6,7}. The two largest experts (0 and 2) sit in groups whose second
// member is weak; groups 2 and 3 have the best sums of their top two and win.
const std::vector<float> kGroupLogits = {3.0f, -5.0f, 2.9f, -5.0f, 1.0f, 1.0f, 0.5f, 0.5f};

TEST(RoutingDeepSeekV3, GroupSelectionChangesTheChoice) {
  const Routing plain = route1(dsv3(2, 1, 1, 2.5f), kGroupLogits);
  EXPECT_EQ(plain.ids, (std::vector<int32_t>{0, 2}));
  const Routing grouped = route1(dsv3(2, 4, 2, 2.5f), kGroupLogits);
  EXPECT_EQ(grouped.ids, (std::vector<int32_t>{4, 5}));  // experts 4 and 5 tie: lower id first
  expect_rel(grouped.weights[0], 1.25);  // sig(1) / (2 sig(1)) * 2.5
  expect_rel(grouped.weights[1], 1.25);
  // Three groups kept: {0,1} (0.9526 + 0.0067) beats {2,3} (0.9478 + 0.0067); then top-2 by score.
  const Routing three = route1(dsv3(2, 4, 3, 2.5f), kGroupLogits);
  EXPECT_EQ(three.ids, (std::vector<int32_t>{0, 4}));
  const auto w = dsv3_weights(kGroupLogits, three.ids, 2.5);
  expect_rel(three.weights[0], w[0]);
  expect_rel(three.weights[1], w[1]);
}

TEST(RoutingDeepSeekV3, GroupScoreIsTheSumOfTheTopTwo) {
  // Groups of 4. By max, group 0 would win; by the sum of all, group 2; by the top two, group 1.
  const std::vector<float> s = {4.0f,  -6.0f, -6.0f, -6.0f,   // top2 0.9845, max 0.982, sum 0.987
                                0.1f,  0.1f,  -6.0f, -6.0f,   // top2 1.0500, max 0.525, sum 1.055
                                -0.5f, -0.5f, -0.5f, -0.5f};  // top2 0.7550, max 0.378, sum 1.510
  const Routing r = route1(dsv3(1, 3, 1, 1.0f), s);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{4}));
  expect_rel(r.weights[0], 1.0);
}

TEST(RoutingDeepSeekV3, GroupTiesGoToTheLowerGroup) {
  // Both groups score sig(1) + sig(0); the lower group is kept, then expert 0 (sig(1)) wins.
  const Routing r = route1(dsv3(1, 2, 1, 1.0f), {1.0f, 0.0f, 0.0f, 1.0f});
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0}));
  const Routing r2 = route1(dsv3(2, 2, 1, 1.0f), {0.0f, 1.0f, 1.0f, 0.0f});
  EXPECT_EQ(r2.ids, (std::vector<int32_t>{1, 0}));
}

TEST(RoutingDeepSeekV3, BiasChoosesButDoesNotWeigh) {
  const std::vector<float> s = {1.0f, 0.0f, 0.5f, -1.0f};
  const std::vector<float> bias = {0.0f, 0.0f, 0.0f, 1.0f};
  const Routing r = route1(dsv3(2, 1, 1, 2.5f), s, &bias);
  ASSERT_EQ(r.ids, (std::vector<int32_t>{3, 0}));  // c3 = sig(-1) + 1 = 1.269 > c0 = 0.731
  // sig(-1) + sig(1) = 1: the weights are the sigmoids themselves times 2.5.
  expect_rel(r.weights[0], 2.5 * sig(-1.0));
  expect_rel(r.weights[1], 2.5 * sig(1.0));
  // Without bias, expert 3 would be last.
  EXPECT_EQ(route1(dsv3(2, 1, 1, 2.5f), s).ids, (std::vector<int32_t>{0, 2}));
}

TEST(RoutingDeepSeekV3, BiasEntersTheGroupScores) {
  const std::vector<float> s = {1.0f, 1.0f, 0.0f, 0.0f};
  const std::vector<float> bias = {0.0f, 0.0f, 1.0f, 1.0f};
  const Routing r = route1(dsv3(1, 2, 1, 3.0f), s, &bias);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2}));
  expect_rel(r.weights[0], 3.0);  // sig(0) / (sig(0) + 1e-20) * 3
}

TEST(RoutingDeepSeekV3, ChoiceScoreIsAnFp32Add) {
  // sig + 1e8 rounds to 1e8 in fp32 for both experts: a tie, so the lower id comes first even
  // though sig(1) > sig(0). (In double, expert 1 would win.)
  const std::vector<float> s = {0.0f, 1.0f};
  const std::vector<float> bias = {1e8f, 1e8f};
  EXPECT_EQ(route1(dsv3(2, 1, 1, 1.0f), s, &bias).ids, (std::vector<int32_t>{0, 1}));
}

TEST(RoutingDeepSeekV3, ScalingFactorScalesTheWeights) {
  const std::vector<float> s = {0.3f, -0.7f, 1.1f, 0.2f};
  const Routing one = route1(dsv3(2, 2, 2, 1.0f), s);
  const Routing scaled = route1(dsv3(2, 2, 2, 2.5f), s);
  EXPECT_EQ(one.ids, scaled.ids);
  EXPECT_EQ(one.ids, (std::vector<int32_t>{2, 0}));
  const auto w = dsv3_weights(s, one.ids, 2.5);
  for (int j = 0; j < 2; ++j) {
    expect_rel(scaled.weights[j], w[j]);
    expect_rel(scaled.weights[j], 2.5 * static_cast<double>(one.weights[j]));
  }
}

TEST(RoutingDeepSeekV3, BiasIsIgnoredByOtherMethods) {
  const std::vector<float> s = {1.0f, 0.0f};
  const std::vector<float> bias = {0.0f, 5.0f};
  EXPECT_EQ(route1(params(RoutingMethod::Sigmoid, 1), s, &bias).ids, (std::vector<int32_t>{0}));
}

// ---- several tokens ------------------------------------------------------------------------------
TEST(Routing, TokensAreIndependentRows) {
  const std::vector<float> s = {1.0f, 2.0f, 3.0f,   // token 0
                                3.0f, 2.0f, 1.0f,   // token 1
                                2.0f, 2.0f, 2.0f};  // token 2
  const Routing r = route(params(RoutingMethod::TopK, 2), 3, 3, s.data(), nullptr);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2, 1, 0, 1, 0, 1}));
  EXPECT_EQ(r.weights, (std::vector<float>{3, 2, 3, 2, 2, 2}));
}

TEST(Routing, ZeroTokensGiveEmptyResults) {
  const Routing r = route(params(RoutingMethod::Renormalize, 2), 0, 4, nullptr, nullptr);
  EXPECT_TRUE(r.ids.empty());
  EXPECT_TRUE(r.weights.empty());
}

// Many exact ties: the selection equals a stable sort by descending logit (an independent rule).
TEST(Routing, SelectionMatchesStableSortOnManyTies) {
  std::mt19937 rng(7);
  const int T = 300, E = 64, k = 8;
  std::vector<float> s(T * E);
  for (auto& v : s) v = static_cast<float>(static_cast<int>(rng() % 5) - 2);
  for (RoutingMethod m : {RoutingMethod::Default, RoutingMethod::Renormalize,
                          RoutingMethod::RenormalizeNaive, RoutingMethod::TopK,
                          RoutingMethod::Sigmoid, RoutingMethod::SigmoidRenorm,
                          RoutingMethod::TopKSigmoid, RoutingMethod::DeepSeekV3}) {
    const Routing r = route(params(m, k), T, E, s.data(), nullptr);
    for (int t = 0; t < T; ++t) {
      std::vector<int32_t> order(E);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](int32_t a, int32_t b) { return s[t * E + a] > s[t * E + b]; });
      for (int j = 0; j < k; ++j)
        ASSERT_EQ(r.ids[t * k + j], order[j]) << "method " << static_cast<int>(m) << " token " << t;
    }
  }
}

// ---- NaN policy ----------------------------------------------------------------------------------
TEST(RoutingNaN, NaNRanksBelowEveryNumberAndPoisonsOnlyItsToken) {
  const std::vector<float> s = {kNaN, 1.0f, 2.0f, kNaN,   // token 0
                                0.0f, 1.0f, 2.0f, 3.0f};  // token 1
  const Routing d = route(params(RoutingMethod::Default, 3), 2, 4, s.data(), nullptr);
  EXPECT_EQ(d.ids, (std::vector<int32_t>{2, 1, 0, 3, 2, 1}));
  for (int j = 0; j < 3; ++j) EXPECT_TRUE(std::isnan(d.weights[j])) << j;  // softmax mixes the NaN in
  const double z = 1.0 + std::exp(1.0) + std::exp(2.0) + std::exp(3.0);
  expect_rel(d.weights[3], std::exp(3.0) / z);
  expect_rel(d.weights[4], std::exp(2.0) / z);
  expect_rel(d.weights[5], std::exp(1.0) / z);

  const Routing t = route(params(RoutingMethod::TopK, 3), 2, 4, s.data(), nullptr);
  EXPECT_EQ(t.weights[0], 2.0f);
  EXPECT_EQ(t.weights[1], 1.0f);
  EXPECT_TRUE(std::isnan(t.weights[2]));
}

TEST(RoutingNaN, MinusInfinityRanksAboveNaN) {
  const Routing r = route1(params(RoutingMethod::TopK, 1), {kNaN, -kInf});
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1}));
  const Routing all = route1(params(RoutingMethod::Renormalize, 2), {kNaN, kNaN, kNaN});
  EXPECT_EQ(all.ids, (std::vector<int32_t>{0, 1}));
  EXPECT_TRUE(std::isnan(all.weights[0]));
}

TEST(RoutingNaN, DeepSeekV3NaNScoreRanksLast) {
  const Routing r = route1(dsv3(2, 1, 1, 1.0f), {kNaN, -3.0f, 0.5f});
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2, 1}));
  const auto w = dsv3_weights({kNaN, -3.0f, 0.5f}, r.ids, 1.0);
  expect_rel(r.weights[0], w[0]);
  // A NaN bias makes that expert's score NaN.
  const std::vector<float> bias = {0.0f, 0.0f, kNaN};
  EXPECT_EQ(route1(dsv3(2, 1, 1, 1.0f), {kNaN, -3.0f, 0.5f}, &bias).ids,
            (std::vector<int32_t>{1, 0}));
}

// ---- errors --------------------------------------------------------------------------------------
TEST(RoutingErrors, EveryBadArgumentIsNamed) {
  const std::vector<float> s(8, 0.0f);
  expect_error([&] { route(params(RoutingMethod::Precomputed, 1), 1, 8, s.data(), nullptr); },
               "precomputed");
  expect_error([&] { route(params(RoutingMethod::TopK, 0), 1, 8, s.data(), nullptr); },
               "top_k must be in [1, num_experts = 8], got 0");
  expect_error([&] { route(params(RoutingMethod::TopK, 9), 1, 8, s.data(), nullptr); },
               "top_k must be in [1, num_experts = 8], got 9");
  expect_error([&] { route(params(RoutingMethod::TopK, 1), -1, 8, s.data(), nullptr); },
               "num_tokens must be >= 0, got -1");
  expect_error([&] { route(params(RoutingMethod::TopK, 1), 1, 0, s.data(), nullptr); },
               "num_experts must be in [1, 2^31), got 0");
  expect_error([&] { route(params(RoutingMethod::TopK, 1), 2, 8, nullptr, nullptr); },
               "logits is null");
  expect_error([&] { route(dsv3(1, 3, 1, 1.0f), 1, 8, s.data(), nullptr); },
               "n_group must be >= 1 and divide num_experts = 8, got 3");
  expect_error([&] { route(dsv3(1, 0, 1, 1.0f), 1, 8, s.data(), nullptr); }, "n_group");
  expect_error([&] { route(dsv3(1, 4, 5, 1.0f), 1, 8, s.data(), nullptr); },
               "topk_group must be in [1, n_group = 4], got 5");
  expect_error([&] { route(dsv3(1, 8, 2, 1.0f), 1, 8, s.data(), nullptr); },
               "each group needs >= 2 experts");
  expect_error([&] { route(dsv3(5, 4, 2, 1.0f), 1, 8, s.data(), nullptr); },
               "top_k must be <= topk_group * (num_experts / n_group) = 4, got 5");
  expect_error([&] { route(dsv3(1, 1, 1, kNaN), 1, 8, s.data(), nullptr); },
               "routed_scaling_factor must be finite");
}

}  // namespace
}  // namespace fp4moe::reference
