// tests/runner/moe_runner_test.cpp — the whole GPU layer (MoeRunner) against the CPU reference.
//
// Inputs are fresh random cases: FP4 codes and e4m3 block scales drawn directly (so presets as large
// as DeepSeek-R1 are cheap to build), outputs poisoned before each run (run_case_on_gpu does that).
//
// Tolerance (derivation in docs/numerics.md): routing ids identical, weights within 1e-6 relative;
// the output differs from the reference only by fp32 summation order in the two GEMMs (the reference
// sums in double), which moves a bf16 rounding of the activation, or, in w4a4, an NVFP4 rounding of
// the re-quantized activation, on rare elements. So: no NaN where the reference has none, at least
// 99.5% of output elements within one bf16 ulp of the reference plus 1e-3 of their token row's RMS
// (outputs that nearly cancel), relative L2 error below 5e-3.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <string>

#include "fp4moe/bench.hpp"
#include "fp4moe/case_file.hpp"
#include "fp4moe/checkpoint.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/presets.hpp"
#include "fp4moe/reference.hpp"
#include "fp4moe/runner.hpp"
#include "layout_fixtures.hpp"
#include "small_problem.hpp"
#include "runner/device_buffer.hpp"
#include "runner/layer_buffers.hpp"
#include "runner/output_match.hpp"

namespace fp4moe {
namespace {

using test::bf16_ulp;
using test::expect_output_matches;

io::MoeCase random_case(const MoeProblem& p, int64_t T, uint64_t seed) {
  return io::make_random_packed_case(p, T, seed);
}

void expect_layer_matches(const io::MoeCase& c, const std::string& label,
                          std::optional<MoeTactic> tactic = std::nullopt) {
  const reference::MoeResult ref =
      reference::moe_forward(c.problem, c.num_tokens, c.hidden_states.data(), c.router(), c.weights());
  const reference::MoeResult gpu = run_case_on_gpu(c, nullptr, tactic);
  ASSERT_EQ(gpu.topk_ids, ref.topk_ids) << label;
  ASSERT_EQ(gpu.topk_weights.size(), ref.topk_weights.size());
  for (size_t i = 0; i < ref.topk_weights.size(); ++i)
    ASSERT_NEAR(gpu.topk_weights[i], ref.topk_weights[i], 1e-6 * std::fabs(ref.topk_weights[i]) + 1e-30)
        << label << " weight " << i;
  expect_output_matches(gpu.output, ref.output, c.num_tokens, c.problem.hidden, label);
}

bool have_gpu() {
  std::string why;
  return cuda_device_available(&why);
}

#define SKIP_WITHOUT_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no sm_90 GPU"

struct LayerCase {
  std::string model;
  ActQuant mode;
  int64_t tokens;
};

class LayerPreset : public ::testing::TestWithParam<LayerCase> {};

TEST_P(LayerPreset, MatchesReference) {
  SKIP_WITHOUT_GPU();
  const LayerCase& lc = GetParam();
  MoeProblem p = preset(lc.model, lc.mode);
  expect_layer_matches(random_case(p, lc.tokens, 1000 + lc.tokens), lc.model + " T=" + std::to_string(lc.tokens));
}

std::vector<LayerCase> preset_cases() {
  std::vector<LayerCase> v;
  for (ActQuant m : {ActQuant::W4A16, ActQuant::W4A4Scalar, ActQuant::W4A4PerExpert})
    for (int64_t t : {0, 1, 3, 17, 255, 1000, 8191, 8193}) v.push_back({"tiny", m, t});
  // The large presets hold GBs of weights: two rows each, one per main mode.
  v.push_back({"deepseek-r1", ActQuant::W4A16, 1});
  v.push_back({"deepseek-r1", ActQuant::W4A4Scalar, 16});
  v.push_back({"qwen3-30b-a3b", ActQuant::W4A16, 33});
  v.push_back({"qwen3-30b-a3b", ActQuant::W4A4PerExpert, 3});
  v.push_back({"qwen3-235b-a22b", ActQuant::W4A16, 2});
  v.push_back({"qwen3-235b-a22b", ActQuant::W4A4Scalar, 40});
  v.push_back({"llama4-scout", ActQuant::W4A16, 70});
  v.push_back({"llama4-scout", ActQuant::W4A4Scalar, 1});
  v.push_back({"gpt-oss-120b", ActQuant::W4A16, 24});  // MXFP4
  v.push_back({"gpt-oss-20b", ActQuant::W4A16, 7});    // MXFP4
  v.push_back({"gpt-oss-120b-nvfp4", ActQuant::W4A16, 3});
  v.push_back({"gpt-oss-120b-nvfp4", ActQuant::W4A4Scalar, 5});
  v.push_back({"kimi-k2", ActQuant::W4A4Scalar, 9});  // 384 experts, one group
  v.push_back({"glm-4.6", ActQuant::W4A16, 12});
  v.push_back({"qwen3-next-80b-a3b", ActQuant::W4A16, 30});  // 512 experts, k = 10
  v.push_back({"qwen3-next-80b-a3b", ActQuant::W4A4Scalar, 2});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Presets, LayerPreset, ::testing::ValuesIn(preset_cases()),
                         [](const auto& info) {
                           std::string n = info.param.model + "_" + std::string(to_string(info.param.mode)) + "_T" +
                                           std::to_string(info.param.tokens);
                           for (char& ch : n) if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n;
                         });

// Every routing method, activation and mode on a small problem (the sanitizer subset: "Small").
struct SmallCase {
  RoutingMethod method;
  Activation act;
  ActQuant mode;
};
class LayerSmall : public ::testing::TestWithParam<SmallCase> {};

TEST_P(LayerSmall, MatchesReference) {
  SKIP_WITHOUT_GPU();
  const SmallCase& sc = GetParam();
  const MoeProblem p = test::small_problem(sc.mode, sc.method, sc.act);
  expect_layer_matches(random_case(p, 37, 7), std::string(to_string(sc.method)));
}

std::vector<SmallCase> small_cases() {
  std::vector<SmallCase> v;
  for (RoutingMethod m : {RoutingMethod::Default, RoutingMethod::Renormalize, RoutingMethod::RenormalizeNaive,
                          RoutingMethod::TopK, RoutingMethod::Sigmoid, RoutingMethod::SigmoidRenorm,
                          RoutingMethod::TopKSigmoid, RoutingMethod::Llama4, RoutingMethod::DeepSeekV3,
                          RoutingMethod::Precomputed})
    v.push_back({m, Activation::SwiGLU, ActQuant::W4A4Scalar});
  for (Activation a : {Activation::SwiGLU, Activation::GeGLU, Activation::SwiGLUOai, Activation::Relu2})
    for (ActQuant q : {ActQuant::W4A16, ActQuant::W4A4Scalar, ActQuant::W4A4PerExpert})
      if (a != Activation::SwiGLU || q != ActQuant::W4A4Scalar)  // that one is in the loop above
        v.push_back({RoutingMethod::Renormalize, a, q});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Small, LayerSmall, ::testing::ValuesIn(small_cases()), [](const auto& info) {
  return std::string(to_string(info.param.method)) + "_" + std::string(to_string(info.param.act)) + "_" +
         std::string(to_string(info.param.mode));
});

// Every tactic on shapes that stress its tiles: partial token tiles of every wgmma width, experts
// with several tiles, intermediate sizes below one CTA's columns, K tails, relu2 and precomputed
// routing with one hot expert.
struct TacticCase {
  MoeTactic tactic;
  std::string name;
};
class LayerTactic : public ::testing::TestWithParam<TacticCase> {};

TEST_P(LayerTactic, MatchesReference) {
  SKIP_WITHOUT_GPU();
  const MoeTactic t = GetParam().tactic;
  int ran = 0;
  auto run = [&](const io::MoeCase& c, const std::string& label) {
    if (!tactic_valid(c.problem, t)) return;  // e.g. split-K needs enough K chunks
    ++ran;
    expect_layer_matches(c, label, t);
  };
  {
    MoeProblem p = preset("tiny", ActQuant::W4A4Scalar);  // E=8 k=2: ~250 tokens per expert
    run(random_case(p, 1000, 21), "tiny w4a4 T=1000");
  }
  {
    MoeProblem p = preset("tiny", ActQuant::W4A16);
    p.routing.method = RoutingMethod::Precomputed;
    io::MoeCase c = random_case(p, 700, 22);
    for (int64_t i = 0; i < c.num_tokens; ++i) c.topk_ids[i * 2] = 3;  // expert 3 gets every token
    run(c, "tiny one hot expert");
  }
  {
    MoeProblem p;
    p.num_experts = 6;
    p.hidden = 2880;  // K tail of GEMM1 (2880 = 22.5 chunks of 128)
    p.inter = 96;     // fewer columns than one CTA
    p.routing.method = RoutingMethod::Renormalize;
    p.routing.top_k = 2;
    p.activation.kind = Activation::SwiGLUOai;
    p.act_quant = ActQuant::W4A4PerExpert;
    run(random_case(p, 333, 23), "gpt-oss-like shapes");
  }
  {
    MoeProblem p;
    p.num_experts = 4;
    p.hidden = 320;
    p.inter = 352;
    p.routing.method = RoutingMethod::TopK;
    p.routing.top_k = 1;  // GEMM2 writes the output (fused finalize)
    p.activation.kind = Activation::Relu2;
    p.act_quant = ActQuant::W4A16;
    run(random_case(p, 1500, 24), "relu2 top-1");
  }
  // decode-sized: K deep enough for every split; T * k = 4, 20, 96 (GEMM2's fused finalize, up to 128
  // entries for H <= 4096) and 160 (the finalize launch)
  for (int64_t T : {1, 5, 24, 40}) {
    MoeProblem p;
    p.num_experts = 16;
    p.hidden = 1024;
    p.inter = 1040;  // 8.125 chunks: a K tail in GEMM2
    p.routing.method = RoutingMethod::Renormalize;
    p.routing.top_k = 4;
    p.activation.kind = Activation::SwiGLU;
    p.act_quant = ActQuant::W4A4Scalar;
    run(random_case(p, T, 25 + T), "decode shapes T=" + std::to_string(T));
  }
  {
    MoeProblem p;  // GEMM2's K (640: 5 chunks) allows at most split 2 there, GEMM1's (1024: 8 chunks) 4
    p.num_experts = 16;
    p.hidden = 1024;
    p.inter = 640;
    p.routing.method = RoutingMethod::Renormalize;
    p.routing.top_k = 4;
    p.activation.kind = Activation::SwiGLU;
    p.act_quant = ActQuant::W4A16;
    run(random_case(p, 3, 29), "GEMMs split differently T=3");
  }
  EXPECT_GE(ran, 3) << describe(t) << " ran on too few of the cases";
}

std::vector<TacticCase> tactic_cases() {
  std::vector<TacticCase> v;
  for (int tile : {64, 128, 256}) v.push_back({{GemmKernel::Sm90Wgmma, tile, 1, 1}, "wgmma_t" + std::to_string(tile)});
  // Both GEMMs split alike, and a few pairs that split them differently (GEMM1 x GEMM2).
  const int pairs[][3] = {{16, 1, 1}, {16, 2, 2}, {16, 4, 4}, {16, 4, 2}, {16, 1, 4},
                          {32, 1, 1}, {32, 2, 2}, {32, 4, 4}, {32, 2, 1}};
  for (const auto& [tile, s1, s2] : pairs) {
    const MoeTactic t{GemmKernel::Sm90Stream, tile, s1, s2};
    v.push_back({t, "stream_t" + std::to_string(tile) + "_s" + std::to_string(s1) + "x" + std::to_string(s2)});
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Tactics, LayerTactic, ::testing::ValuesIn(tactic_cases()),
                         [](const auto& info) { return info.param.name; });

TEST(LayerEdge, AllTokensOnOneExpertAndEmptyExperts) {
  SKIP_WITHOUT_GPU();
  MoeProblem p = preset("tiny", ActQuant::W4A4Scalar);
  p.routing.method = RoutingMethod::Precomputed;
  io::MoeCase c = random_case(p, 300, 3);
  for (int64_t t = 0; t < c.num_tokens; ++t)
    for (int j = 0; j < p.top_k(); ++j) c.topk_ids[t * p.top_k() + j] = static_cast<int32_t>(j);  // experts 0..k-1 only
  expect_layer_matches(c, "one expert per slot");
}

TEST(LayerEdge, LogitTiesRouteToLowerExpert) {
  SKIP_WITHOUT_GPU();
  MoeProblem p = preset("tiny", ActQuant::W4A16);
  io::MoeCase c = random_case(p, 64, 4);
  for (auto& v : c.router_logits) v = std::round(v);  // many exact ties
  expect_layer_matches(c, "ties");
}

TEST(LayerEdge, OutOfRangePrecomputedIdPoisonsOnlyItsToken) {
  SKIP_WITHOUT_GPU();
  MoeProblem p = preset("tiny", ActQuant::W4A4PerExpert);
  p.routing.method = RoutingMethod::Precomputed;
  io::MoeCase c = random_case(p, 40, 8);
  const reference::MoeResult ref =
      reference::moe_forward(c.problem, c.num_tokens, c.hidden_states.data(), c.router(), c.weights());
  const int64_t bad_token = 13, H = p.hidden;
  c.topk_ids[bad_token * p.top_k() + 1] = static_cast<int32_t>(p.num_experts + 3);
  const reference::MoeResult gpu = run_case_on_gpu(c);
  for (int64_t t = 0; t < c.num_tokens; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      const float g = format::bf16_to_float(gpu.output[t * H + h]);
      const float r = format::bf16_to_float(ref.output[t * H + h]);
      if (t == bad_token) {
        ASSERT_TRUE(std::isnan(g)) << "column " << h;
      } else {
        ASSERT_LE(std::fabs(g - r), 2 * bf16_ulp(r) + 1e-6f) << "token " << t << " column " << h;
      }
    }
  }
}

// Expert parallelism: each rank's experts on the whole layer's routing mapped to local ids (another
// rank's expert: -1, skip_foreign_ids), outputs poisoned first, against the reference rank.
TEST(LayerExpertParallel, RanksMatchTheReferenceRank) {
  SKIP_WITHOUT_GPU();
  for (const auto& [mode, format] : {std::pair{ActQuant::W4A16, WeightFormat::NVFP4},
                                     std::pair{ActQuant::W4A4Scalar, WeightFormat::NVFP4},
                                     std::pair{ActQuant::W4A4PerExpert, WeightFormat::NVFP4},
                                     std::pair{ActQuant::W4A16, WeightFormat::MXFP4}}) {
    MoeProblem p = preset("tiny", mode);
    p.weight_format = format;
    const int64_t T = 77, k = p.top_k();
    const io::MoeCase c = random_case(p, T, 90);
    const reference::MoeResult full =
        reference::moe_forward(p, T, c.hidden_states.data(), c.router(), c.weights());
    for (int rank = 0; rank < 3; ++rank) {
      const auto [begin, end] = io::expert_range(p.num_experts, rank, 3);
      const test::ExpertRangeWeights local(c, begin, end, full.topk_ids);
      reference::RouterInput router;
      router.topk_ids = local.local_ids.data();
      router.topk_weights = full.topk_weights.data();
      const reference::MoeResult ref =
          reference::moe_forward(local.problem, T, c.hidden_states.data(), router, local.weights());
      auto runner = MoeRunner::create(local.problem, T);
      const Status prepared = runner->prepare_weights(local.weights());
      ASSERT_TRUE(prepared.ok()) << prepared.message;
      const test::LayerBuffers buf(local.problem, T, *runner);
      ASSERT_EQ(cudaMemcpy(buf.hidden.ptr, c.hidden_states.data(), T * p.hidden * 2, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(buf.ids.ptr, local.local_ids.data(), T * k * 4, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(buf.weights.ptr, full.topk_weights.data(), T * k * 4, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(buf.poison_output(), cudaSuccess);
      ForwardArgs a = buf.args;
      a.router_logits = nullptr;
      const Status s = runner->forward_routed(nullptr, a);
      ASSERT_TRUE(s.ok()) << s.message;
      cudaError_t copied;
      const std::vector<uint16_t> out = buf.output(&copied);
      ASSERT_EQ(copied, cudaSuccess);
      expect_output_matches(out, ref.output, T, p.hidden,
                            std::string(to_string(mode)) + " " + std::string(to_string(format)) + " rank " +
                                std::to_string(rank));
    }
  }
}

// Expert biases (gpt-oss): GEMM1's in both kernels' epilogues (and after a K split), GEMM2's in the
// separate finalize, which a forward with biases always takes; top-1 and top-k, gated and relu2.
TEST(LayerExpertBias, MatchesTheReferenceOnEveryKernel) {
  SKIP_WITHOUT_GPU();
  const std::optional<MoeTactic> tactics[] = {std::nullopt, MoeTactic{GemmKernel::Sm90Wgmma, 128, 1, 1},
                                              MoeTactic{GemmKernel::Sm90Stream, 16, 1, 1},
                                              MoeTactic{GemmKernel::Sm90Stream, 16, 2, 1}};
  for (Activation act : {Activation::SwiGLUOai, Activation::Relu2})
    for (ActQuant mode : {ActQuant::W4A16, ActQuant::W4A4Scalar})
      for (int top_k : {4, 1})
        for (const auto& tactic : tactics)
          for (int64_t T : {1, 37}) {
            MoeProblem p;
            p.num_experts = 16;
            p.hidden = 512;  // GEMM1's K = 512: four 128-chunks, enough for split_k1 = 2
            p.inter = 256;
            p.routing.top_k = top_k;
            p.activation.kind = act;
            p.act_quant = mode;
            io::MoeCase c = random_case(p, T, 700 + T + top_k);
            io::add_random_expert_biases(c, 800 + T);
            const std::string label = p.describe() + " T=" + std::to_string(T) + " " +
                                      (tactic ? describe(*tactic) : std::string("heuristic"));
            expect_layer_matches(c, label, tactic);
          }
}

// fp32 outputs (ForwardArgs::output_dtype F32, the partials of tensor / expert parallelism): the sums
// that the bf16 output rounds, bit for bit, whichever finalize the bf16 forward fused (the streaming
// GEMM2's, top-1's in GEMM2, or the separate one, which the fp32 forward always takes); close to the
// reference's fp32 sums; every element written (poisoned first).
TEST(LayerOutputF32, TheSumsThatTheBf16OutputRounds) {
  SKIP_WITHOUT_GPU();
  struct Case {
    MoeProblem p;
    int64_t T;
    bool routed;
  };
  MoeProblem top1 = preset("tiny", ActQuant::W4A4Scalar);
  top1.routing.method = RoutingMethod::Llama4;
  top1.routing.top_k = 1;
  top1.routing.apply_router_weight_on_input = true;
  MoeProblem routed = preset("tiny", ActQuant::W4A16);
  routed.routing.method = RoutingMethod::Precomputed;
  for (const Case& tc : {Case{preset("tiny", ActQuant::W4A16), 9, false},        // streaming tactic: finalize in GEMM2
                         Case{preset("tiny", ActQuant::W4A4PerExpert), 300, false},  // the separate finalize
                         Case{top1, 40, false},                                    // top-1: finalize in GEMM2
                         Case{routed, 33, true}}) {
    const std::string label = tc.p.describe() + " T=" + std::to_string(tc.T);
    const io::MoeCase c = random_case(tc.p, tc.T, 500 + tc.T);
    const reference::MoeResult ref =
        reference::moe_forward(tc.p, tc.T, c.hidden_states.data(), c.router(), c.weights());
    auto runner = MoeRunner::create(tc.p, tc.T);
    ASSERT_TRUE(runner->prepare_weights(c.weights()).ok()) << label;
    const test::LayerBuffers buf(tc.p, tc.T, *runner);
    if (!tc.routed) ASSERT_EQ(buf.upload(c), cudaSuccess);
    if (tc.routed) {  // hidden rows, the caller's ids and weights (a precomputed case has no logits)
      ASSERT_EQ(cudaMemcpy(buf.hidden.ptr, c.hidden_states.data(), c.hidden_states.size() * 2, cudaMemcpyHostToDevice),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpy(buf.ids.ptr, c.topk_ids.data(), c.topk_ids.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(buf.weights.ptr, c.topk_weights.data(), c.topk_weights.size() * 4, cudaMemcpyHostToDevice),
                cudaSuccess);
    }
    auto forward = [&](const ForwardArgs& a) { return tc.routed ? runner->forward_routed(nullptr, a) : runner->forward(nullptr, a); };
    ASSERT_EQ(buf.poison_output(), cudaSuccess);
    ForwardArgs a = buf.args;
    if (tc.routed) a.router_logits = nullptr;
    Status s = forward(a);
    ASSERT_TRUE(s.ok()) << label << ": " << s.message;
    cudaError_t copied;
    const std::vector<uint16_t> bf16_out = buf.output(&copied);
    ASSERT_EQ(copied, cudaSuccess);

    const size_t n = static_cast<size_t>(tc.T * tc.p.hidden);
    DeviceBuffer out_f32(n * sizeof(float), "fp32 output");
    ASSERT_EQ(cudaMemset(out_f32.ptr, 0xFF, n * sizeof(float)), cudaSuccess);  // NaN
    a.output = out_f32.ptr;
    a.output_dtype = OutputDType::F32;
    s = forward(a);
    ASSERT_TRUE(s.ok()) << label << ": " << s.message;
    std::vector<float> f32(n);
    ASSERT_EQ(cudaMemcpy(f32.data(), out_f32.ptr, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    double num = 0, den = 0;
    for (size_t i = 0; i < n; ++i) {
      ASSERT_FALSE(std::isnan(f32[i])) << label << " element " << i << " not written";
      ASSERT_EQ(format::bf16_from_float(f32[i]), bf16_out[i]) << label << " element " << i;
      num += (double(f32[i]) - ref.output_f32[i]) * (double(f32[i]) - ref.output_f32[i]);
      den += double(ref.output_f32[i]) * ref.output_f32[i];
    }
    EXPECT_LT(std::sqrt(num / den), 5e-3) << label;
  }
}

TEST(LayerErrors, ArgumentsAreCheckedBeforeLaunch) {
  SKIP_WITHOUT_GPU();
  MoeProblem p = preset("tiny");
  io::MoeCase c = random_case(p, 4, 5);
  auto runner = MoeRunner::create(p, 4);
  ForwardArgs a;
  a.num_tokens = 4;
  EXPECT_NE(runner->forward(nullptr, a).message.find("not prepared"), std::string::npos);
  ASSERT_TRUE(runner->prepare_weights(c.weights()).ok());
  a.num_tokens = 5;
  EXPECT_NE(runner->forward(nullptr, a).message.find("max_tokens"), std::string::npos);
  a.num_tokens = 4;
  EXPECT_NE(runner->forward(nullptr, a).message.find("workspace_bytes"), std::string::npos);
  a.workspace_bytes = runner->workspace_size(4);
  EXPECT_NE(runner->forward(nullptr, a).message.find("hidden is null"), std::string::npos);
  std::vector<float> bad(p.num_experts, 0.0f);
  reference::MoeWeights w = c.weights();
  w.w2_scale_2 = bad.data();
  EXPECT_NE(runner->prepare_weights(w).message.find("w2_scale_2[0]"), std::string::npos);
}


// ---- MXFP4 weights (docs/numerics.md, "MXFP4 weights") ---------------------------------------------
// The runner prepares MXFP4 weights as their exact NVFP4 equivalent (io::nvfp4_equivalent), so the layer
// meets the same tolerance table against the MXFP4 reference, with every routing method, activation,
// bias and tactic of both GEMM families.

MoeProblem mxfp4_problem(RoutingMethod method, Activation act) {
  MoeProblem p;
  p.num_experts = 16;
  p.hidden = 256;
  p.inter = 96;  // 3 blocks of 32, not a multiple of the GEMM tiles
  p.routing.method = method;
  p.routing.top_k = method == RoutingMethod::Llama4 ? 1 : 4;
  if (method == RoutingMethod::DeepSeekV3) {
    p.routing.n_group = 4;
    p.routing.topk_group = 2;
    p.routing.routed_scaling_factor = 2.5f;
  }
  p.routing.apply_router_weight_on_input = method == RoutingMethod::Llama4;
  p.activation.kind = act;
  p.weight_format = WeightFormat::MXFP4;
  return p;
}

struct Mxfp4SmallCase {
  RoutingMethod method;
  Activation act;
  bool biases;
};
class LayerMxfp4Small : public ::testing::TestWithParam<Mxfp4SmallCase> {};

TEST_P(LayerMxfp4Small, MatchesReference) {
  SKIP_WITHOUT_GPU();
  const Mxfp4SmallCase& mc = GetParam();
  const MoeProblem p = mxfp4_problem(mc.method, mc.act);
  for (int64_t T : {1, 37}) {
    io::MoeCase c = random_case(p, T, 60 + T);
    if (mc.biases) io::add_random_expert_biases(c, 61 + T);
    expect_layer_matches(c, p.describe() + (mc.biases ? " biases" : "") + " T=" + std::to_string(T));
  }
}

std::vector<Mxfp4SmallCase> mxfp4_small_cases() {
  std::vector<Mxfp4SmallCase> v;
  for (RoutingMethod m : {RoutingMethod::Default, RoutingMethod::Renormalize, RoutingMethod::RenormalizeNaive,
                          RoutingMethod::TopK, RoutingMethod::Sigmoid, RoutingMethod::SigmoidRenorm,
                          RoutingMethod::TopKSigmoid, RoutingMethod::Llama4, RoutingMethod::DeepSeekV3,
                          RoutingMethod::Precomputed})
    v.push_back({m, Activation::SwiGLUOai, true});
  for (Activation a : {Activation::SwiGLU, Activation::GeGLU, Activation::SwiGLUOai, Activation::Relu2})
    for (bool b : {false, true})
      if (a != Activation::SwiGLUOai || !b) v.push_back({RoutingMethod::Renormalize, a, b});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Small, LayerMxfp4Small, ::testing::ValuesIn(mxfp4_small_cases()), [](const auto& info) {
  return std::string(to_string(info.param.method)) + "_" + std::string(to_string(info.param.act)) +
         (info.param.biases ? "_bias" : "");
});

// Every tactic of both families (the LayerTactic list) on MXFP4 shapes that stress its tiles.
class LayerMxfp4Tactic : public ::testing::TestWithParam<TacticCase> {};

TEST_P(LayerMxfp4Tactic, MatchesReference) {
  SKIP_WITHOUT_GPU();
  const MoeTactic t = GetParam().tactic;
  int ran = 0;
  auto run = [&](const io::MoeCase& c, const std::string& label) {
    if (!tactic_valid(c.problem, t)) return;
    ++ran;
    expect_layer_matches(c, label, t);
  };
  {
    MoeProblem p = preset("tiny");
    p.weight_format = WeightFormat::MXFP4;  // E=8 k=2: ~250 tokens per expert
    run(random_case(p, 1000, 31), "tiny mxfp4 T=1000");
  }
  {
    MoeProblem p;
    p.num_experts = 6;
    p.hidden = 2880;  // K tail of GEMM1 (22.5 chunks of 128)
    p.inter = 96;
    p.routing.top_k = 2;
    p.activation.kind = Activation::SwiGLUOai;
    p.weight_format = WeightFormat::MXFP4;
    io::MoeCase c = random_case(p, 333, 32);
    io::add_random_expert_biases(c, 33);
    run(c, "gpt-oss-like shapes with biases");
  }
  {
    MoeProblem p;
    p.num_experts = 4;
    p.hidden = 320;
    p.inter = 352;
    p.routing.method = RoutingMethod::TopK;
    p.routing.top_k = 1;  // GEMM2 writes the output (fused finalize)
    p.activation.kind = Activation::Relu2;
    p.weight_format = WeightFormat::MXFP4;
    run(random_case(p, 1500, 34), "relu2 top-1");
  }
  for (int64_t T : {1, 5, 24, 40}) {  // decode-sized, K deep enough for every split; a K tail in GEMM2
    MoeProblem p;
    p.num_experts = 16;
    p.hidden = 1024;
    p.inter = 1056;  // 8.25 chunks
    p.routing.top_k = 4;
    p.activation.kind = Activation::SwiGLU;
    p.weight_format = WeightFormat::MXFP4;
    run(random_case(p, T, 35 + T), "decode shapes T=" + std::to_string(T));
  }
  EXPECT_GE(ran, 3) << describe(t) << " ran on too few of the cases";
}

INSTANTIATE_TEST_SUITE_P(Tactics, LayerMxfp4Tactic, ::testing::ValuesIn(tactic_cases()),
                         [](const auto& info) { return info.param.name; });

// gpt-oss shapes (H = I = 2880, k = 4, E = 32: gpt-oss-20b; renormalize, swiglu_oai, biases) at decode
// token counts and T = 100 (every expert hit, about 12 rows each), with the heuristic's tactics.
class LayerMxfp4GptOss : public ::testing::TestWithParam<int64_t> {};

TEST_P(LayerMxfp4GptOss, MatchesReference) {
  SKIP_WITHOUT_GPU();
  const int64_t T = GetParam();
  const MoeProblem p = preset("gpt-oss-20b");
  ASSERT_EQ(p.weight_format, WeightFormat::MXFP4);
  io::MoeCase c = random_case(p, T, 900 + T);
  io::add_random_expert_biases(c, 901 + T);
  expect_layer_matches(c, "gpt-oss-20b T=" + std::to_string(T));
}

// NOTE: T * k * 25M multiply-adds in the CPU reference: T = 100 is about 1e10.
INSTANTIATE_TEST_SUITE_P(Tokens, LayerMxfp4GptOss, ::testing::Values(1, 4, 33, 100));

// The 18-powers-of-two limit and NaN codes are refused by prepare_weights, naming tensor and expert.
TEST(LayerMxfp4Errors, PrepareRefusesWideSpansAndNanCodes) {
  SKIP_WITHOUT_GPU();
  MoeProblem p = preset("tiny");
  p.weight_format = WeightFormat::MXFP4;
  io::MoeCase c = random_case(p, 4, 5);
  auto runner = MoeRunner::create(p, 4);
  ASSERT_TRUE(runner->prepare_weights(c.weights()).ok());
  const int64_t per_expert = static_cast<int64_t>(c.w2_scale.size()) / p.num_experts;
  const uint8_t lo = *std::min_element(c.w2_scale.begin() + 3 * per_expert, c.w2_scale.begin() + 4 * per_expert);
  c.w2_scale[3 * per_expert + 7] = static_cast<uint8_t>(lo + 18);  // expert 3: 19 powers of two
  const Status wide = runner->prepare_weights(c.weights());
  EXPECT_NE(wide.message.find("w2_scale of expert 3 spans ue8m0 codes"), std::string::npos) << wide.message;
  EXPECT_NE(wide.message.find("at most 18 powers of two"), std::string::npos) << wide.message;
  c.w2_scale[3 * per_expert + 7] = 255;
  const Status nan = runner->prepare_weights(c.weights());
  EXPECT_NE(nan.message.find("code 255 (NaN) at expert 3"), std::string::npos) << nan.message;
  c.w2_scale[3 * per_expert + 7] = static_cast<uint8_t>(lo + 17);  // exactly 18: taken
  EXPECT_TRUE(runner->prepare_weights(c.weights()).ok());
  WeightPrepOptions swizzled;
  swizzled.scales_swizzled = true;
  EXPECT_NE(runner->prepare_weights(c.weights(), swizzled).message.find("not built for mxfp4"), std::string::npos);
}

}  // namespace
}  // namespace fp4moe
