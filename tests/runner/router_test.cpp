// tests/runner/router_test.cpp — GpuRouter (routing alone, for expert parallelism) against the CPU
// reference: ids identical, weights within 1e-6 relative (docs/numerics.md), every method, fp32 and
// bf16 logits, outputs poisoned first; and its argument errors.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "fp4moe/format.hpp"
#include "fp4moe/reference.hpp"
#include "fp4moe/runner.hpp"
#include "runner/device_buffer.hpp"

namespace fp4moe {
namespace {

struct RouterCase {
  RoutingParams params;
  int64_t experts;
  std::string name;
};

std::vector<RouterCase> router_cases() {
  std::vector<RouterCase> v;
  for (RoutingMethod m : {RoutingMethod::Default, RoutingMethod::Renormalize, RoutingMethod::RenormalizeNaive,
                          RoutingMethod::TopK, RoutingMethod::Sigmoid, RoutingMethod::SigmoidRenorm,
                          RoutingMethod::TopKSigmoid}) {
    RoutingParams p;
    p.method = m;
    p.top_k = 8;
    v.push_back({p, 128, std::string(to_string(m))});
  }
  RoutingParams llama4;
  llama4.method = RoutingMethod::Llama4;
  llama4.top_k = 1;
  v.push_back({llama4, 16, "llama4"});
  RoutingParams ds;
  ds.method = RoutingMethod::DeepSeekV3;
  ds.top_k = 8;
  ds.n_group = 8;
  ds.topk_group = 4;
  ds.routed_scaling_factor = 2.5f;
  v.push_back({ds, 256, "deepseek_v3"});
  return v;
}

class GpuRouterMethod : public ::testing::TestWithParam<RouterCase> {};

TEST_P(GpuRouterMethod, MatchesReference) {
  std::string why;
  if (!cuda_device_available(&why)) GTEST_SKIP() << why;
  const RouterCase rc = GetParam();
  const int64_t E = rc.experts, k = rc.params.top_k;
  const auto router = GpuRouter::create(rc.params, E);
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  for (int64_t T : {0, 1, 17, 300}) {
    for (LogitsDType dtype : {LogitsDType::F32, LogitsDType::BF16}) {
      std::vector<float> logits(T * E), bias(E);
      std::vector<uint16_t> logits_bf16(T * E);
      for (size_t i = 0; i < logits.size(); ++i) {
        logits_bf16[i] = format::bf16_from_float(normal(rng));
        logits[i] = dtype == LogitsDType::BF16 ? format::bf16_to_float(logits_bf16[i]) : normal(rng);
      }
      for (float& b : bias) b = 0.1f * normal(rng);
      const bool with_bias = rc.params.method == RoutingMethod::DeepSeekV3;
      const reference::Routing ref = reference::route(rc.params, T, E, logits.data(), with_bias ? bias.data() : nullptr);
      DeviceBuffer d_logits(logits.size() * 4, "test"), d_bias(E * 4, "test"), d_ids(T * k * 4, "test"),
          d_weights(T * k * 4, "test");
      const void* src = dtype == LogitsDType::BF16 ? static_cast<const void*>(logits_bf16.data()) : logits.data();
      ASSERT_EQ(cudaMemcpy(d_logits.ptr, src, T * E * (dtype == LogitsDType::BF16 ? 2 : 4), cudaMemcpyHostToDevice),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpy(d_bias.ptr, bias.data(), E * 4, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemset(d_ids.ptr, 0xFF, T * k * 4), cudaSuccess);  // poisoned: -1 ids, NaN weights
      ASSERT_EQ(cudaMemset(d_weights.ptr, 0xFF, T * k * 4), cudaSuccess);
      const Status s = router->route(nullptr, T, d_logits.ptr, dtype, with_bias ? d_bias.as<float>() : nullptr,
                                     d_ids.as<int32_t>(), d_weights.as<float>());
      ASSERT_TRUE(s.ok()) << s.message;
      std::vector<int32_t> ids(T * k);
      std::vector<float> weights(T * k);
      ASSERT_EQ(cudaMemcpy(ids.data(), d_ids.ptr, ids.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(weights.data(), d_weights.ptr, weights.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      const std::string label = rc.name + " T=" + std::to_string(T) + (dtype == LogitsDType::BF16 ? " bf16" : " f32");
      ASSERT_EQ(ids, ref.ids) << label;
      for (size_t i = 0; i < weights.size(); ++i)
        ASSERT_NEAR(weights[i], ref.weights[i], 1e-6 * std::fabs(ref.weights[i]) + 1e-30) << label << " weight " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Methods, GpuRouterMethod, ::testing::ValuesIn(router_cases()),
                         [](const auto& info) { return info.param.name; });

TEST(GpuRouterErrors, ArgumentsAreChecked) {
  RoutingParams p;
  p.method = RoutingMethod::Precomputed;
  EXPECT_THROW(GpuRouter::create(p, 8), Error);  // nothing to route
  p.method = RoutingMethod::Renormalize;
  p.top_k = 9;
  EXPECT_THROW(GpuRouter::create(p, 8), Error);  // k > E
  std::string why;
  if (!cuda_device_available(&why)) GTEST_SKIP() << why;
  p.top_k = 2;
  const auto router = GpuRouter::create(p, 8);
  DeviceBuffer buf(4096, "test");
  // A bias is accepted and ignored by every method but deepseek_v3 (routing_uses_bias).
  char* base = buf.as<char>();
  const Status bias = router->route(nullptr, 4, base, LogitsDType::F32, reinterpret_cast<const float*>(base + 1024),
                                    reinterpret_cast<int32_t*>(base + 2048), reinterpret_cast<float*>(base + 3072));
  EXPECT_TRUE(bias.ok()) << bias.message;
  const Status null = router->route(nullptr, 4, nullptr, LogitsDType::F32, nullptr, buf.as<int32_t>(), buf.as<float>());
  EXPECT_NE(null.message.find("logits is null"), std::string::npos) << null.message;
  EXPECT_TRUE(router->route(nullptr, 0, nullptr, LogitsDType::F32, nullptr, nullptr, nullptr).ok());
}

}  // namespace
}  // namespace fp4moe
