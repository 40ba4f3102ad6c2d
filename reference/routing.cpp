// reference/routing.cpp — the routing methods (docs/numerics.md, "Routing methods") on the CPU (oracle of the GPU router).
//
// Per token t (logits s = row t of [T, E], fp32):
//   1. Selection: the k best experts by a choice score, best first. The choice score is the raw
//      logit s for every method except DeepSeekV3 (softmax and sigmoid are strictly monotone, so
//      this is the same choice, without the ties that rounding the transformed value would make).
//      Order: larger first; equal scores (also +0 vs -0) go to the lower expert id; NaN ranks below
//      every number, -inf included, and NaNs among themselves go by id. A NaN logit therefore
//      never displaces a number, and the token's weights come out NaN wherever the method mixes the
//      NaN into them (softmax over E, ...): it poisons that token only.
//   2. Weights, with every transcendental (exp, sigmoid) computed in double from the fp32 logit and
//      every weight rounded once to fp32:
//        default            softmax over all E (max-subtracted, double), taken at the selected ids
//        renormalize        softmax over the k selected logits
//        renormalize_naive  p = softmax over E; w_j = p_j / sum_sel p        (all double)
//        topk               w = s
//        sigmoid, topk_sigmoid, llama4 (k = 1)    w = sigmoid(s)
//        sigmoid_renorm     w_j = sig_j / max(sum_sel sig, 1e-20)          (double sig)
//        deepseek_v3        sig_e = float(sigmoid(s_e)); c_e = sig_e + bias_e (fp32; bias 0 when
//                           absent). n_group > 1: group score = (largest c) + (second largest c) of
//                           the group in fp32; keep the topk_group best groups (ties: lower group
//                           id); select top-k by c among the experts of the kept groups. n_group == 1:
//                           top-k by c over all E. w_j = sig_j / (sum_sel sig + 1e-20) * scale, double.
//      Sums run in slot order (or expert order over E) in double.
// The routing bias is used by deepseek_v3 only; other methods ignore it (routing_uses_bias).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "fp4moe/error.hpp"
#include "fp4moe/reference.hpp"
#include "reference/parallel.hpp"

namespace fp4moe::reference {
namespace {

// The selection order of step 1: true when (a, ia) is chosen before (b, ib).
inline bool ranks_before(float a, int32_t ia, float b, int32_t ib) {
  const bool a_nan = std::isnan(a), b_nan = std::isnan(b);
  if (a_nan != b_nan) return b_nan;  // a number before a NaN
  if (!a_nan && a != b) return a > b;
  return ia < ib;
}

// Writes the k best of `candidates` (indices into `score`) into out[0..k), best first.
// `candidates` is reordered.
void select_top_k(const float* score, std::vector<int32_t>& candidates, int k, int32_t* out) {
  auto before = [score](int32_t a, int32_t b) { return ranks_before(score[a], a, score[b], b); };
  std::partial_sort(candidates.begin(), candidates.begin() + k, candidates.end(), before);
  std::copy(candidates.begin(), candidates.begin() + k, out);
}

inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

void check_route_args(const RoutingParams& params, int64_t num_tokens, int64_t num_experts,
                      const float* logits) {
  check(params.method != RoutingMethod::Precomputed,
        "route: routing_method precomputed has nothing to compute (pass topk_ids and topk_weights "
        "to moe_forward instead)");
  check(num_tokens >= 0, "route: num_tokens must be >= 0, got ", num_tokens);
  check(num_experts >= 1 && num_experts <= INT32_MAX, "route: num_experts must be in [1, 2^31), got ",
        num_experts);
  const int k = params.top_k;
  check(k >= 1 && k <= num_experts, "route: top_k must be in [1, num_experts = ", num_experts,
        "], got ", k);
  check(num_tokens == 0 || logits != nullptr, "route: logits is null for num_tokens = ", num_tokens);
  if (params.method == RoutingMethod::Llama4)
    check(k == 1, "route: llama4 routing needs top_k == 1, got ", k);
  if (params.method == RoutingMethod::DeepSeekV3) {
    const int ng = params.n_group;
    check(ng >= 1 && num_experts % ng == 0, "route: deepseek_v3 n_group must be >= 1 and divide num_experts = ",
          num_experts, ", got ", ng);
    check(params.topk_group >= 1 && params.topk_group <= ng,
          "route: deepseek_v3 topk_group must be in [1, n_group = ", ng, "], got ", params.topk_group);
    const int64_t group_size = num_experts / ng;
    check(ng == 1 || group_size >= 2,
          "route: deepseek_v3 with n_group > 1 scores a group by its two largest scores, so each "
          "group needs >= 2 experts; got num_experts / n_group = ",
          num_experts, " / ", ng, " = ", group_size);
    check(k <= params.topk_group * group_size,
          "route: deepseek_v3 top_k must be <= topk_group * (num_experts / n_group) = ",
          params.topk_group * group_size, ", got ", k);
    check(std::isfinite(params.routed_scaling_factor),
          "route: deepseek_v3 routed_scaling_factor must be finite, got ", params.routed_scaling_factor);
  }
}

// Per-thread scratch of route_token.
struct Scratch {
  std::vector<int32_t> candidates;
  std::vector<float> score;        // deepseek_v3 choice scores c
  std::vector<float> sig;          // deepseek_v3 sigmoid, fp32
  std::vector<float> group_score;  // deepseek_v3
  std::vector<int32_t> groups;
};

void route_token(const RoutingParams& p, int32_t E, const float* s, const float* bias, int32_t* ids,
                 float* w, Scratch& sc) {
  const int k = p.top_k;
  std::vector<int32_t>& cand = sc.candidates;

  if (p.method == RoutingMethod::DeepSeekV3) {
    sc.sig.resize(E);
    sc.score.resize(E);
    for (int32_t e = 0; e < E; ++e) {
      sc.sig[e] = static_cast<float>(sigmoid(static_cast<double>(s[e])));
      const float b = bias != nullptr ? bias[e] : 0.0f;
      sc.score[e] = sc.sig[e] + b;  // fp32 add
    }
    cand.clear();
    if (p.n_group > 1) {
      const int32_t G = p.n_group, gsize = E / G;
      sc.group_score.resize(G);
      int32_t top2[2];
      for (int32_t g = 0; g < G; ++g) {
        sc.groups.resize(gsize);
        for (int32_t i = 0; i < gsize; ++i) sc.groups[i] = g * gsize + i;
        select_top_k(sc.score.data(), sc.groups, 2, top2);
        sc.group_score[g] = sc.score[top2[0]] + sc.score[top2[1]];  // larger + smaller, fp32
      }
      sc.groups.resize(G);
      for (int32_t g = 0; g < G; ++g) sc.groups[g] = g;
      std::vector<int32_t> kept(p.topk_group);
      select_top_k(sc.group_score.data(), sc.groups, p.topk_group, kept.data());
      std::sort(kept.begin(), kept.end());  // candidate order does not matter; keep it tidy
      for (int32_t g : kept)
        for (int32_t i = 0; i < gsize; ++i) cand.push_back(g * gsize + i);
    } else {
      for (int32_t e = 0; e < E; ++e) cand.push_back(e);
    }
    select_top_k(sc.score.data(), cand, k, ids);
    double sum = 0.0;
    for (int j = 0; j < k; ++j) sum += static_cast<double>(sc.sig[ids[j]]);
    const double denom = sum + 1e-20;
    const double scale = static_cast<double>(p.routed_scaling_factor);
    for (int j = 0; j < k; ++j)
      w[j] = static_cast<float>(static_cast<double>(sc.sig[ids[j]]) / denom * scale);
    return;
  }

  cand.resize(E);
  for (int32_t e = 0; e < E; ++e) cand[e] = e;
  select_top_k(s, cand, k, ids);
  // The largest logit (NaN only when every logit is NaN): the max of the max-subtracted softmax.
  const double m = static_cast<double>(s[ids[0]]);

  switch (p.method) {
    case RoutingMethod::Default:
    case RoutingMethod::RenormalizeNaive: {
      double sum = 0.0;
      for (int32_t e = 0; e < E; ++e) sum += std::exp(static_cast<double>(s[e]) - m);
      if (p.method == RoutingMethod::Default) {
        for (int j = 0; j < k; ++j)
          w[j] = static_cast<float>(std::exp(static_cast<double>(s[ids[j]]) - m) / sum);
      } else {
        double psum = 0.0;
        for (int j = 0; j < k; ++j) psum += std::exp(static_cast<double>(s[ids[j]]) - m) / sum;
        for (int j = 0; j < k; ++j)
          w[j] = static_cast<float>(std::exp(static_cast<double>(s[ids[j]]) - m) / sum / psum);
      }
      break;
    }
    case RoutingMethod::Renormalize: {
      double sum = 0.0;
      for (int j = 0; j < k; ++j) sum += std::exp(static_cast<double>(s[ids[j]]) - m);
      for (int j = 0; j < k; ++j)
        w[j] = static_cast<float>(std::exp(static_cast<double>(s[ids[j]]) - m) / sum);
      break;
    }
    case RoutingMethod::TopK:
      for (int j = 0; j < k; ++j) w[j] = s[ids[j]];
      break;
    case RoutingMethod::Sigmoid:
    case RoutingMethod::TopKSigmoid:
    case RoutingMethod::Llama4:
      for (int j = 0; j < k; ++j) w[j] = static_cast<float>(sigmoid(static_cast<double>(s[ids[j]])));
      break;
    case RoutingMethod::SigmoidRenorm: {
      double sum = 0.0;
      for (int j = 0; j < k; ++j) sum += sigmoid(static_cast<double>(s[ids[j]]));
      const double denom = std::isnan(sum) ? sum : std::max(sum, 1e-20);
      for (int j = 0; j < k; ++j)
        w[j] = static_cast<float>(sigmoid(static_cast<double>(s[ids[j]])) / denom);
      break;
    }
    case RoutingMethod::DeepSeekV3:
    case RoutingMethod::Precomputed:
      break;  // handled above / refused by check_route_args
  }
}

}  // namespace

Routing route(const RoutingParams& params, int64_t num_tokens, int64_t num_experts,
              const float* logits, const float* bias) {
  check_route_args(params, num_tokens, num_experts, logits);
  const int k = params.top_k;
  const int32_t E = static_cast<int32_t>(num_experts);
  const float* b = routing_uses_bias(params.method) ? bias : nullptr;
  Routing r;
  r.ids.resize(static_cast<size_t>(num_tokens) * k);
  r.weights.resize(static_cast<size_t>(num_tokens) * k);
  // Tokens are independent; chunks of 256 keep the thread overhead small for small T.
  constexpr int64_t kChunk = 256;
  const int64_t chunks = (num_tokens + kChunk - 1) / kChunk;
  std::vector<Scratch> scratch(static_cast<size_t>(detail::workers_for(chunks)));
  detail::parallel_for(chunks, [&](int64_t c, int worker) {
    const int64_t t1 = std::min(num_tokens, (c + 1) * kChunk);
    for (int64_t t = c * kChunk; t < t1; ++t)
      route_token(params, E, logits + t * num_experts, b, r.ids.data() + t * k,
                  r.weights.data() + t * k, scratch[worker]);
  });
  return r;
}

}  // namespace fp4moe::reference
