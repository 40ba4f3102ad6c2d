// tests/tools/soak_test.cpp — the problems of `fp4moe soak` (tools/soak_problem.hpp) and their check,
// on the CPU: 2,000 problems are valid, cover every routing method, activation and quant mode and the
// token-count classes, and are the same for the same (seed, index); the check finds what it must; the
// command without a GPU says so, and checks the reference against itself with --device cpu.
#include "tools/soak_problem.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <string>

#include "fp4moe/case_file.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/safetensors.hpp"
#include "fp4moe/tune.hpp"
#include "fp4moe/weight_layout.hpp"
#include "test_dir.hpp"
#include "tools/cli_run.hpp"

namespace fp4moe::soak {
namespace {

constexpr uint64_t kSeed = 20250101;
constexpr int64_t kProblems = 2000;

bool same_problem(const SoakProblem& a, const SoakProblem& b) {
  return a.describe() == b.describe() && a.problem.routing.skip_foreign_ids == b.problem.routing.skip_foreign_ids &&
         a.problem.routing.total_experts == b.problem.routing.total_experts && a.tactic == b.tactic;
}

TEST(SoakProblems, ValidAndCoveringEveryKind) {
  std::set<RoutingMethod> methods;
  std::set<Activation> acts;
  std::set<ActQuant> modes;
  std::map<std::string, int64_t> t_class;
  int64_t large = 0, forced = 0, heuristic = 0, biases = 0, bias_routing = 0, ties = 0, all_equal = 0, bf16 = 0;
  int64_t nan_hidden = 0, inf_hidden = 0, nan_logit = 0, inf_logit = 0, invalid_ids = 0, skip = 0, weight_on_input = 0;
  int64_t grouped = 0, small_ragged = 0, mxfp4 = 0, mxfp4_forced = 0, mxfp4_biases = 0;
  std::set<Activation> mxfp4_acts;
  std::set<RoutingMethod> mxfp4_methods;
  std::set<int64_t> token_counts;
  for (int64_t i = 0; i < kProblems; ++i) {
    const SoakProblem sp = make_problem(kSeed, i);
    const MoeProblem& p = sp.problem;
    ASSERT_NO_THROW(p.validate()) << sp.describe();
    ASSERT_EQ(sp.index, i);
    ASSERT_GE(p.num_experts, 1);
    ASSERT_LE(p.num_experts, 512) << sp.describe();
    ASSERT_GE(p.top_k(), 1);
    ASSERT_LE(p.top_k(), std::min<int64_t>(p.num_experts, 32)) << sp.describe();
    for (int64_t d : {p.hidden, p.inter}) {
      ASSERT_EQ(d % 16, 0) << sp.describe();
      ASSERT_GE(d, 16);
      ASSERT_LE(d, 8192) << sp.describe();
    }
    ASSERT_LE(weight_bytes(p), sp.large ? kLargeWeightBytes : kSmallWeightBytes) << sp.describe();
    ASSERT_GE(sp.num_tokens, 0);
    ASSERT_LE(sp.num_tokens, kMaxTokens);
    ASSERT_LE(sp.nan_hidden_tokens + sp.inf_hidden_tokens + sp.nan_logit_tokens + sp.inf_logit_tokens +
                  sp.invalid_id_tokens,
              sp.num_tokens);
    if (sp.tactic) {
      ASSERT_TRUE(tactic_valid(p, *sp.tactic)) << sp.describe();
      ++forced;
    } else {
      ++heuristic;
    }
    if (sp.routing_bias) ASSERT_EQ(p.routing.method, RoutingMethod::DeepSeekV3);
    if (sp.invalid_id_tokens > 0 || p.routing.skip_foreign_ids) ASSERT_EQ(p.routing.method, RoutingMethod::Precomputed);
    methods.insert(p.routing.method);
    acts.insert(p.activation.kind);
    modes.insert(p.act_quant);
    const int64_t T = sp.num_tokens;
    t_class[T == 0 ? "0" : T <= 16 ? "1-16" : T <= 256 ? "17-256" : T <= 2048 ? "257-2048" : T <= 8192 ? "2049-8192" : "8193-16384"]++;
    token_counts.insert(T);
    if (T > 0 && T <= 256 && (T & (T - 1)) != 0) ++small_ragged;
    large += sp.large;
    biases += sp.expert_biases;
    bias_routing += sp.routing_bias;
    ties += p.routing.method != RoutingMethod::Precomputed && sp.logits == LogitKind::Ties;
    all_equal += p.routing.method != RoutingMethod::Precomputed && sp.logits == LogitKind::AllEqual;
    bf16 += sp.bf16_logits;
    nan_hidden += sp.nan_hidden_tokens > 0;
    inf_hidden += sp.inf_hidden_tokens > 0;
    nan_logit += sp.nan_logit_tokens > 0;
    inf_logit += sp.inf_logit_tokens > 0;
    invalid_ids += sp.invalid_id_tokens > 0;
    skip += p.routing.skip_foreign_ids;
    weight_on_input += p.routing.apply_router_weight_on_input;
    grouped += p.routing.method == RoutingMethod::DeepSeekV3 && p.routing.n_group > 1;
    if (p.weight_format == WeightFormat::MXFP4) {
      ASSERT_EQ(p.act_quant, ActQuant::W4A16) << sp.describe();
      ASSERT_EQ(p.hidden % 32, 0) << sp.describe();
      ASSERT_EQ(p.inter % 32, 0) << sp.describe();
      ++mxfp4;
      mxfp4_forced += sp.tactic.has_value();
      mxfp4_biases += sp.expert_biases;
      mxfp4_acts.insert(p.activation.kind);
      mxfp4_methods.insert(p.routing.method);
    }
  }
  // MXFP4: about kMxfp4Share of the problems, with every activation and routing method, forced tactics
  // and biases among them.
  EXPECT_GT(mxfp4, kProblems * kMxfp4Share / 2);
  EXPECT_LT(mxfp4, kProblems * kMxfp4Share * 2);
  EXPECT_EQ(mxfp4_acts.size(), 4u);
  EXPECT_EQ(mxfp4_methods.size(), 10u);
  EXPECT_GT(mxfp4_forced, 10);
  EXPECT_GT(mxfp4_biases, 5);
  EXPECT_EQ(methods.size(), 10u);
  EXPECT_EQ(acts.size(), 4u);
  EXPECT_EQ(modes.size(), 3u);
  // T: skewed towards small counts, every class present, ragged counts common.
  for (const char* c : {"0", "1-16", "17-256", "257-2048", "2049-8192", "8193-16384"})
    EXPECT_GT(t_class[c], 0) << "no problem with T in " << c;
  EXPECT_GT(t_class["1-16"] + t_class["17-256"], kProblems / 2);
  EXPECT_GT(t_class["1-16"], 4 * t_class["8193-16384"]);
  EXPECT_GT(small_ragged, kProblems / 4);
  EXPECT_GT(token_counts.size(), 500u);
  EXPECT_GT(large, 10);
  EXPECT_LT(large, kProblems / 20);
  EXPECT_GT(forced, kProblems / 2);
  EXPECT_GT(heuristic, kProblems / 10);
  for (int64_t n : {biases, bias_routing, ties, all_equal, bf16, nan_hidden, inf_hidden, nan_logit, inf_logit,
                    invalid_ids, skip, weight_on_input, grouped})
    EXPECT_GT(n, 10);
}

TEST(SoakProblems, DerivedFromSeedAndIndexAlone) {
  // In any order, alone or after others: the same problem; other seeds give other problems.
  int64_t differ = 0;
  for (int64_t i : {1999, 0, 17, 1000, 3}) {
    const SoakProblem a = make_problem(kSeed, i), b = make_problem(kSeed, i);
    EXPECT_TRUE(same_problem(a, b)) << a.describe();
    differ += !same_problem(a, make_problem(kSeed + 1, i));
  }
  EXPECT_GE(differ, 4);
  for (int64_t i = 0; i < 40; ++i) {
    const SoakProblem sp = make_problem(kSeed, i);
    if (weight_bytes(sp.problem) > (8 << 20) || sp.num_tokens > 512) continue;
    const io::MoeCase a = make_case(sp), b = make_case(make_problem(kSeed, i));
    EXPECT_EQ(a.hidden_states, b.hidden_states) << sp.describe();
    EXPECT_EQ(a.w13, b.w13);
    EXPECT_EQ(a.topk_ids, b.topk_ids);
    // NOTE: memcmp of a null pointer is undefined even for zero bytes (precomputed-routing cases have no logits).
    ASSERT_EQ(a.router_logits.size(), b.router_logits.size());
    if (!a.router_logits.empty())
      EXPECT_EQ(std::memcmp(a.router_logits.data(), b.router_logits.data(), a.router_logits.size() * 4), 0);
  }
}

// A small problem of the soak with the wanted property (the first index that has it).
SoakProblem find_problem(const std::function<bool(const SoakProblem&)>& want) {
  for (int64_t i = 0; i < 20000; ++i) {
    const SoakProblem sp = make_problem(kSeed, i);
    if (weight_bytes(sp.problem) <= (4 << 20) && sp.num_tokens <= 300 && want(sp)) return sp;
  }
  throw Error("no such soak problem");
}

// An MXFP4 problem's case: ue8m0 scales of blocks of 32 whose codes the GPU kernels take (a span of at
// most 18 powers of two per expert and tensor), no global scales; the reference computes it.
TEST(SoakProblems, Mxfp4CasesFitTheKernels) {
  const SoakProblem sp = find_problem([](const SoakProblem& s) {
    return s.problem.weight_format == WeightFormat::MXFP4 && s.num_tokens > 0 && !s.problem.routing.skip_foreign_ids &&
           s.invalid_id_tokens == 0;
  });
  const io::MoeCase c = make_case(sp);
  const MoeProblem& p = sp.problem;
  ASSERT_EQ(c.w13_scale.size(), size_t(p.num_experts * p.w13_rows() * p.hidden / 32)) << sp.describe();
  EXPECT_TRUE(c.w13_scale_2.empty());
  EXPECT_NO_THROW(io::nvfp4_equivalent(p, c.weights())) << sp.describe();
  const Outcome ref = reference_outcome(c, reference_tokens(sp, c));
  EXPECT_FALSE(ref.refused) << ref.message;
  EXPECT_EQ(check_outcome(c, reference_tokens(sp, c), ref, ref, false), "") << sp.describe();
  EXPECT_NE(sp.describe().find("weights=mxfp4"), std::string::npos);
}

TEST(SoakProblems, CasesHoldTheirPoisonedTokensAndInvalidIds) {
  const SoakProblem sp = find_problem([](const SoakProblem& s) {
    return s.nan_hidden_tokens > 0 && s.inf_logit_tokens > 0 && s.num_tokens > 3;
  });
  const io::MoeCase c = make_case(sp);
  int64_t nan_rows = 0, inf_logit_rows = 0;
  for (int64_t t = 0; t < c.num_tokens; ++t) {
    bool nan = false, inf = false;
    for (int64_t h = 0; h < sp.problem.hidden; ++h) nan |= std::isnan(format::bf16_to_float(c.hidden_states[t * sp.problem.hidden + h]));
    for (int64_t e = 0; e < sp.problem.num_experts; ++e) inf |= std::isinf(c.router_logits[t * sp.problem.num_experts + e]);
    nan_rows += nan;
    inf_logit_rows += inf;
  }
  EXPECT_EQ(nan_rows, sp.nan_hidden_tokens) << sp.describe();
  EXPECT_EQ(inf_logit_rows, sp.inf_logit_tokens) << sp.describe();

  const SoakProblem bad = find_problem([](const SoakProblem& s) { return s.invalid_id_tokens > 0; });
  EXPECT_EQ(static_cast<int64_t>(tokens_with_invalid_ids(make_case(bad)).size()), bad.invalid_id_tokens);
}

TEST(SoakCheck, TheReferenceMatchesItselfOnSampledTokens) {
  // Problems of every method through the check, with the reference as the backend: all match, and a
  // token sample (forced here by asking for rows 0, 2, 4, ...) is the same as the whole layer's rows.
  int64_t checked = 0;
  std::set<RoutingMethod> methods;
  for (int64_t i = 0; i < 400 && methods.size() < 10; ++i) {
    const SoakProblem sp = make_problem(kSeed, i);
    if (weight_bytes(sp.problem) > (2 << 20) || sp.num_tokens > 200 || methods.count(sp.problem.routing.method)) continue;
    methods.insert(sp.problem.routing.method);
    const io::MoeCase c = make_case(sp);
    Outcome whole;
    try {
      whole.result = reference::moe_forward(c.problem, c.num_tokens, c.hidden_states.data(), c.router(), c.weights());
    } catch (const Error& e) {
      whole.refused = true;
      whole.message = e.what();
    }
    std::vector<int64_t> tokens;
    for (int64_t t = 0; t < c.num_tokens; t += 2) tokens.push_back(t);
    const Outcome ref = reference_outcome(c, tokens);
    EXPECT_EQ(check_outcome(c, tokens, ref, whole, /*bad_id_rows_nan=*/false), "") << sp.describe();
    ++checked;
  }
  EXPECT_EQ(methods.size(), 10u);
  EXPECT_GE(checked, 10);
}

TEST(SoakCheck, InfiniteWeightsMatchThemselves) {
  // topk routing weights are the raw logits: an infinite logit is an infinite weight on both sides.
  const SoakProblem sp = find_problem([](const SoakProblem& s) {
    return s.problem.routing.method == RoutingMethod::TopK && s.invalid_id_tokens == 0 && s.num_tokens > 0;
  });
  io::MoeCase c = make_case(sp);
  c.router_logits[0] = std::numeric_limits<float>::infinity();  // token 0 picks expert 0 with weight +inf
  std::vector<int64_t> tokens;
  for (int64_t t = 0; t < c.num_tokens; ++t) tokens.push_back(t);
  const Outcome ref = reference_outcome(c, tokens);
  ASSERT_FALSE(ref.refused) << ref.message;
  int64_t infinite = 0;
  for (float w : ref.result.topk_weights) infinite += std::isinf(w);
  ASSERT_GT(infinite, 0) << sp.describe();
  EXPECT_EQ(check_outcome(c, tokens, ref, ref, /*bad_id_rows_nan=*/false), "") << sp.describe();
  Outcome flipped = ref;
  for (float& w : flipped.result.topk_weights)
    if (std::isinf(w)) w = -w;
  EXPECT_NE(check_outcome(c, tokens, ref, flipped, /*bad_id_rows_nan=*/false), "");
}

TEST(SoakCheck, FindsWhatDiffers) {
  const SoakProblem sp = find_problem([](const SoakProblem& s) {
    return s.problem.routing.method == RoutingMethod::Renormalize && s.num_tokens >= 8 && s.nan_hidden_tokens == 0 &&
           s.inf_hidden_tokens == 0 && s.nan_logit_tokens == 0 && s.inf_logit_tokens == 0 && s.problem.top_k() >= 2;
  });
  const io::MoeCase c = make_case(sp);
  const std::vector<int64_t> tokens = reference_tokens(sp, c);
  const Outcome ref = reference_outcome(c, tokens);
  ASSERT_FALSE(ref.refused) << ref.message;
  const int64_t H = sp.problem.hidden, k = sp.problem.top_k();
  Outcome good;
  good.result = ref.result;
  EXPECT_EQ(check_outcome(c, tokens, ref, good, true), "");

  Outcome o = good;  // swapped ids
  std::swap(o.result.topk_ids[0], o.result.topk_ids[1]);
  EXPECT_NE(check_outcome(c, tokens, ref, o, true).find("topk_ids[0, 0]"), std::string::npos);
  o = good;  // weight off by 1e-5 relative
  o.result.topk_weights[k] *= 1.00001f;
  EXPECT_NE(check_outcome(c, tokens, ref, o, true).find("topk_weights[1, 0]"), std::string::npos);
  o = good;  // one NaN where the reference has a number
  o.result.output[3 * H + 1] = 0x7FC0;
  EXPECT_NE(check_outcome(c, tokens, ref, o, true).find("NaN where the reference has"), std::string::npos);
  o = good;  // every element two ulps off: the count of elements beyond the bound
  for (auto& b : o.result.output) b = static_cast<uint16_t>(b + 2);
  EXPECT_NE(check_outcome(c, tokens, ref, o, true), "");
  o = good;  // within one ulp everywhere: still a match
  for (size_t i = 0; i < o.result.output.size(); i += 7) o.result.output[i] = static_cast<uint16_t>(o.result.output[i] + 1);
  EXPECT_EQ(check_outcome(c, tokens, ref, o, true), "");
  o = good;  // refusals
  o.refused = true;
  o.message = "forward: something";
  EXPECT_NE(check_outcome(c, tokens, ref, o, true).find("refused a call that the reference accepts"), std::string::npos);
  Outcome ref_refused;
  ref_refused.refused = true;
  ref_refused.message = "moe_forward: x";
  EXPECT_NE(check_outcome(c, tokens, ref_refused, good, true).find("accepted a call"), std::string::npos);
  EXPECT_NE(check_outcome(c, tokens, ref_refused, o, true).find("another message"), std::string::npos);
  o.message = ref_refused.message;
  EXPECT_EQ(check_outcome(c, tokens, ref_refused, o, true), "");
}

TEST(SoakCheck, NonFiniteOutputsMustMatchTheReferencePattern) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  auto bits = [](std::vector<float> v) {
    std::vector<uint16_t> b;
    for (float x : v) b.push_back(format::bf16_from_float(x));
    return b;
  };
  const auto ref = bits({1.0f, nan, inf, -2.0f});
  EXPECT_EQ(compare_outputs(bits({1.0f, nan, inf, -2.0f}), ref, 1, 4), "");
  EXPECT_NE(compare_outputs(bits({1.0f, 3.0f, inf, -2.0f}), ref, 1, 4), "");
  EXPECT_NE(compare_outputs(bits({1.0f, nan, -inf, -2.0f}), ref, 1, 4), "");
  EXPECT_NE(compare_outputs(bits({1.0f, nan, inf, inf}), ref, 1, 4), "");
}

// One token whose every output moved (a rounding of its GEMM2 input flipped): beyond 0.5% of the
// elements, so it mismatches unless the reference's rounding slack covers each move.
TEST(SoakCheck, RoundingSlackCoversMovesWithinIt) {
  const int64_t H = 256, rows = 16;  // row 0 moved: 6% of the elements, 0.4% relative L2
  std::vector<uint16_t> ref(static_cast<size_t>(rows * H)), moved(ref.size());
  std::vector<float> slack(ref.size(), 0.0f);
  for (int64_t i = 0; i < rows * H; ++i) {
    const float r = 1.0f + 0.0078125f * static_cast<float>(i % 17);  // bf16 values, ulp 2^-7
    ref[i] = format::bf16_from_float(r);
    moved[i] = i < H ? format::bf16_from_float(r + 0.015625f) : ref[i];  // two ulps
    if (i < H) slack[i] = 0.02f;
  }
  EXPECT_NE(compare_outputs(moved, ref, rows, H), "");
  EXPECT_EQ(compare_outputs(moved, ref, rows, H, slack), "");
  std::vector<float> short_slack = slack;
  for (int64_t i = 0; i < H; i += 2) short_slack[i] = 0.001f;  // half the row beyond its slack
  EXPECT_NE(compare_outputs(moved, ref, rows, H, short_slack), "");
  EXPECT_NE(compare_outputs(moved, ref, rows, H, std::vector<float>(3, 1.0f)), "");  // not [rows, H]
}

// check_outcome computes the reference's rounding slack when the check without it fails: a tested
// output that moves one token by half its slack passes, by three times its slack and two ulps it does not.
TEST(SoakCheck, CheckOutcomeTakesTheRoundingSlackWhenNeeded) {
  const SoakProblem sp = find_problem([](const SoakProblem& s) {
    return s.problem.act_quant != ActQuant::W4A16 && s.num_tokens >= 1 && s.num_tokens <= 3 && s.problem.hidden >= 512 && s.problem.inter >= 512 &&
           !s.large && s.nan_hidden_tokens + s.inf_hidden_tokens + s.nan_logit_tokens + s.inf_logit_tokens == 0 &&
           s.invalid_id_tokens == 0 && !s.problem.routing.skip_foreign_ids && weight_bytes(s.problem) < (32 << 20);
  });
  const io::MoeCase c = make_case(sp);
  const std::vector<int64_t> tokens = reference_tokens(sp, c);
  ASSERT_EQ(static_cast<int64_t>(tokens.size()), c.num_tokens);
  const Outcome ref = reference_outcome(c, tokens), with = reference_outcome(c, tokens, true);
  ASSERT_FALSE(ref.refused) << ref.message;
  EXPECT_TRUE(ref.slack.empty());
  ASSERT_EQ(with.result.output, ref.result.output);
  const int64_t H = sp.problem.hidden;
  auto moved_by = [&](double times, double ulps) {
    Outcome o = ref;
    for (int64_t h = 0; h < H; ++h) {
      const float r = ref.result.output_f32[h];
      int exp = 0;
      std::frexp(r, &exp);
      const double ulp = std::ldexp(1.0, exp - 8);  // of a bf16 value with r's exponent
      o.result.output[h] = format::bf16_from_float(static_cast<float>(r + times * with.slack[h] + ulps * ulp));
    }
    return o;
  };
  const Outcome near = moved_by(0.5, 0.0);  // NOTE: the relative L2 bound does not take the slack
  ASSERT_NE(compare_outputs(near.result.output, ref.result.output, c.num_tokens, H), "")
      << sp.describe() << ": token 0's slack does not reach past the check without it";
  EXPECT_EQ(check_outcome(c, tokens, ref, near, false), "") << sp.describe();
  EXPECT_NE(check_outcome(c, tokens, ref, moved_by(3.0, 2.0), false), "") << sp.describe();
}

TEST(SoakCheck, InvalidIdsAreRefusedByTheReferenceAndNanRowsOnTheGpu) {
  const SoakProblem sp = find_problem([](const SoakProblem& s) {
    return s.invalid_id_tokens > 0 && !s.problem.routing.skip_foreign_ids && s.num_tokens > s.invalid_id_tokens;
  });
  const io::MoeCase c = make_case(sp);
  const std::vector<int64_t> tokens = reference_tokens(sp, c);
  const Outcome ref = reference_outcome(c, tokens);  // the other tokens, with skip_foreign_ids
  ASSERT_FALSE(ref.refused) << ref.message;
  Outcome cpu;
  try {
    reference::moe_forward(c.problem, c.num_tokens, c.hidden_states.data(), c.router(), c.weights());
  } catch (const Error& e) {
    cpu.refused = true;
    cpu.message = e.what();
  }
  ASSERT_TRUE(cpu.refused);
  EXPECT_EQ(check_outcome(c, tokens, ref, cpu, /*bad_id_rows_nan=*/false), "");
  EXPECT_NE(check_outcome(c, tokens, ref, cpu, /*bad_id_rows_nan=*/true), "");  // the GPU must accept them

  // The GPU's answer: the reference's rows, NaN on the tokens with an invalid id.
  Outcome gpu;
  gpu.result.topk_ids = c.topk_ids;
  gpu.result.topk_weights = c.topk_weights;
  const int64_t H = sp.problem.hidden;
  gpu.result.output.assign(static_cast<size_t>(c.num_tokens * H), 0x7FC0);
  for (size_t i = 0; i < tokens.size(); ++i)
    std::copy_n(ref.result.output.begin() + i * H, H, gpu.result.output.begin() + tokens[i] * H);
  const std::vector<int64_t> bad = tokens_with_invalid_ids(c);
  // The reference (skip_foreign_ids) computed the bad rows too; the GPU row must be NaN instead.
  for (int64_t t : bad) std::fill_n(gpu.result.output.begin() + t * H, H, uint16_t(0x7FC0));
  EXPECT_EQ(check_outcome(c, tokens, ref, gpu, true), "") << sp.describe();
  gpu.result.output[bad[0] * H] = 0;
  EXPECT_NE(check_outcome(c, tokens, ref, gpu, true).find("expected NaN"), std::string::npos);
  EXPECT_NE(check_outcome(c, tokens, ref, gpu, false), "");  // the CPU contract: refuse
}

TEST(SoakCheck, LargeProblemsSampleTokensIncludingEveryPoisonedOne) {
  const SoakProblem sp = [] {
    for (int64_t i = 0; i < 20000; ++i) {
      const SoakProblem s = make_problem(kSeed, i);
      if (s.large && s.num_tokens > 64) return s;
    }
    throw Error("no large problem");
  }();
  // Only the cost decides the sample, so the data is needed only for the poisoned rows: a case with
  // the problem's T and a poisoned token stands in (the real weights would be GBs).
  io::MoeCase c;
  c.problem = sp.problem;
  c.num_tokens = sp.num_tokens;
  c.hidden_states.assign(static_cast<size_t>(sp.num_tokens * sp.problem.hidden), 0);
  if (sp.problem.routing.method != RoutingMethod::Precomputed)
    c.router_logits.assign(static_cast<size_t>(sp.num_tokens * sp.problem.num_experts), 0.0f);
  else {
    c.topk_ids.assign(static_cast<size_t>(sp.num_tokens * sp.problem.top_k()), 0);
    c.topk_weights.assign(c.topk_ids.size(), 1.0f);
  }
  const int64_t poisoned = sp.num_tokens / 2 + 1;
  c.hidden_states[poisoned * sp.problem.hidden + 3] = 0x7FC0;
  const std::vector<int64_t> tokens = reference_tokens(sp, c);
  const double per_token = double(sp.problem.top_k()) *
                           double(sp.problem.w13_rows() * sp.problem.hidden + sp.problem.hidden * sp.problem.inter);
  if (per_token * sp.num_tokens <= 4e9) GTEST_SKIP() << "this large problem is cheap enough to compute whole";
  EXPECT_LT(tokens.size(), static_cast<size_t>(sp.num_tokens)) << sp.describe();
  EXPECT_GE(tokens.size(), 16u);
  EXPECT_TRUE(std::is_sorted(tokens.begin(), tokens.end()));
  EXPECT_EQ(tokens.front(), 0);
  EXPECT_EQ(tokens.back(), sp.num_tokens - 1);
  EXPECT_TRUE(std::binary_search(tokens.begin(), tokens.end(), poisoned));
  EXPECT_EQ(tokens, reference_tokens(sp, c));
}

TEST(SoakCaseFile, KeepsWhatTheCaseFileCannotSayInItsMetadata) {
  const SoakProblem sp = find_problem([](const SoakProblem& s) { return s.tactic && s.num_tokens > 0; });
  const io::MoeCase c = make_case(sp);
  const std::string path = test::test_file_path("soak", ".safetensors");
  save_problem_case(path, sp, c);
  const io::MoeCase back = io::load_case(path);
  EXPECT_EQ(back.hidden_states, c.hidden_states);
  EXPECT_EQ(back.w13, c.w13);
  EXPECT_EQ(back.problem.describe(), c.problem.describe());
  const io::SafetensorsFile f = io::SafetensorsFile::open(path);
  EXPECT_EQ(f.metadata().at("soak_seed"), std::to_string(kSeed));
  EXPECT_EQ(f.metadata().at("soak_index"), std::to_string(sp.index));
  EXPECT_EQ(f.metadata().at("soak_tactic"), describe(*sp.tactic));
  EXPECT_EQ(f.metadata().at("soak_problem"), sp.describe());
}

TEST(SoakCommand, WithoutAGpuSaysSo) {
  const std::string dir = test::fresh_dir("soak", "no-gpu");
  const CliRun r = cli("soak --problems 0 --out " + dir);
  if (r.status == 0) GTEST_SKIP() << "a usable GPU is present";
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("no usable GPU"), std::string::npos) << r.output;
}

TEST(SoakCommand, CpuAgainstItselfReportsProgressAndTheSummary) {
  // Three consecutive small problems, then one whose precomputed ids are invalid (which the reference
  // refuses on both sides).
  auto small = [](const SoakProblem& s) { return weight_bytes(s.problem) <= (4 << 20) && s.num_tokens <= 256; };
  int64_t start = -1;
  for (int64_t i = 0; i < 5000 && start < 0; ++i)
    if (small(make_problem(kSeed, i)) && small(make_problem(kSeed, i + 1)) && small(make_problem(kSeed, i + 2))) start = i;
  ASSERT_GE(start, 0);
  const std::string dir = test::fresh_dir("soak", "cpu");
  const std::string seed = " --seed " + std::to_string(kSeed);
  CliRun r = cli("soak --device cpu" + seed + " --start " + std::to_string(start) +
                 " --problems 3 --progress-seconds 0.1 --out " + dir);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("soak: 3 problems, 0 mismatches, 0 crashes"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("problems/s"), std::string::npos) << r.output;
  std::ifstream next(dir + "/next");
  int64_t n = -1;
  next >> n;
  EXPECT_EQ(n, start + 3);
  EXPECT_FALSE(std::filesystem::exists(dir + "/mismatches.log"));

  const SoakProblem bad = find_problem([](const SoakProblem& s) {
    return s.invalid_id_tokens > 0 && !s.problem.routing.skip_foreign_ids;
  });
  r = cli("soak --device cpu" + seed + " --start " + std::to_string(bad.index) + " --problems 1 --out " + dir);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("soak: 1 problems, 0 mismatches, 0 crashes"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace fp4moe::soak
