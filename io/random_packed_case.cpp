// io/random_packed_case.cpp — random NVFP4 cases drawn in the packed domain (see case_file.hpp).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "fp4moe/case_file.hpp"
#include "fp4moe/format.hpp"

namespace fp4moe::io {

MoeCase make_random_packed_case(const MoeProblem& p, int64_t T, uint64_t seed) {
  std::mt19937_64 rng(seed);
  MoeCase c;
  c.problem = p;
  c.num_tokens = T;
  const int64_t E = p.num_experts, H = p.hidden, I = p.inter, N13 = p.w13_rows(), k = p.top_k();
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> scale_code(0x30, 0x48);  // e4m3 values 2^-1 .. 2^2
  std::uniform_real_distribution<float> spread(0.8f, 1.2f);
  c.hidden_states.resize(T * H);
  float amax = 0;
  for (auto& v : c.hidden_states) {
    const float x = normal(rng);
    v = format::bf16_from_float(x);
    amax = std::max(amax, std::fabs(format::bf16_to_float(v)));
  }
  if (p.routing.method == RoutingMethod::Precomputed) {
    c.topk_ids.resize(T * k);
    c.topk_weights.resize(T * k);
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int32_t> all(E);
      for (int64_t e = 0; e < E; ++e) all[e] = static_cast<int32_t>(e);
      std::shuffle(all.begin(), all.end(), rng);
      for (int64_t j = 0; j < k; ++j) {
        c.topk_ids[t * k + j] = all[j];
        c.topk_weights[t * k + j] = std::fabs(normal(rng));
      }
    }
  } else {
    c.router_logits.resize(T * E);
    for (auto& v : c.router_logits) v = normal(rng);
    if (p.routing.method == RoutingMethod::DeepSeekV3) {
      c.routing_bias.resize(E);
      for (auto& v : c.routing_bias) v = 0.1f * normal(rng);
    }
  }
  auto fill = [&](std::vector<uint8_t>& w, std::vector<uint8_t>& s, int64_t rows, int64_t cols) {
    w.resize(E * rows * cols / 2);
    s.resize(E * rows * cols / 16);
    for (size_t i = 0; i + 8 <= w.size(); i += 8) {  // 8 random bytes per draw: presets are GBs
      const uint64_t r = rng();
      std::memcpy(&w[i], &r, 8);
    }
    for (auto& b : s) b = static_cast<uint8_t>(scale_code(rng));
  };
  fill(c.w13, c.w13_scale, N13, H);
  fill(c.w2, c.w2_scale, H, I);
  c.w13_scale_2.resize(E);
  c.w2_scale_2.resize(E);
  c.w13_input_scale.resize(E);
  c.w2_input_scale.resize(E);
  for (int64_t e = 0; e < E; ++e) {
    c.w13_scale_2[e] = 0.02f / (3.4f * 1.6f) * spread(rng);
    c.w2_scale_2[e] = 0.02f / (3.4f * 1.6f) * spread(rng);
    c.w13_input_scale[e] = std::max(amax, 1.0f) / (6.0f * 448.0f) * spread(rng);
    c.w2_input_scale[e] = 8.0f / (6.0f * 448.0f) * spread(rng);
  }
  return c;
}

}  // namespace fp4moe::io
