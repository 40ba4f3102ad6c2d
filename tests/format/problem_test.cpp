// tests/format/problem_test.cpp — enum names (to_string / parse round trips and errors listing the
// accepted names), MoeProblem::validate with every error message, describe(), and the presets.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>

#include "error_message.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/presets.hpp"
#include "fp4moe/problem.hpp"

namespace fp4moe {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(Problem, RoutingNamesRoundTrip) {
  const std::pair<RoutingMethod, const char*> all[] = {
      {RoutingMethod::Default, "default"},           {RoutingMethod::Renormalize, "renormalize"},
      {RoutingMethod::RenormalizeNaive, "renormalize_naive"}, {RoutingMethod::TopK, "topk"},
      {RoutingMethod::Sigmoid, "sigmoid"},           {RoutingMethod::SigmoidRenorm, "sigmoid_renorm"},
      {RoutingMethod::TopKSigmoid, "topk_sigmoid"},  {RoutingMethod::Llama4, "llama4"},
      {RoutingMethod::DeepSeekV3, "deepseek_v3"},    {RoutingMethod::Precomputed, "precomputed"}};
  for (const auto& [m, name] : all) {
    EXPECT_EQ(to_string(m), name);
    EXPECT_EQ(parse_routing_method(name), m);
  }
}

TEST(Problem, ActivationAndQuantNamesRoundTrip) {
  const std::pair<Activation, const char*> acts[] = {{Activation::SwiGLU, "swiglu"},
                                                     {Activation::GeGLU, "geglu"},
                                                     {Activation::SwiGLUOai, "swiglu_oai"},
                                                     {Activation::Relu2, "relu2"}};
  for (const auto& [a, name] : acts) {
    EXPECT_EQ(to_string(a), name);
    EXPECT_EQ(parse_activation(name), a);
  }
  const std::pair<ActQuant, const char*> quants[] = {{ActQuant::W4A16, "w4a16"},
                                                     {ActQuant::W4A4Scalar, "w4a4_scalar"},
                                                     {ActQuant::W4A4PerExpert, "w4a4_per_expert"}};
  for (const auto& [q, name] : quants) {
    EXPECT_EQ(to_string(q), name);
    EXPECT_EQ(parse_act_quant(name), q);
  }
}

TEST(Problem, ParseErrorsListAcceptedNames) {
  EXPECT_THAT(error_of([] { parse_routing_method("softmax"); }),
              AllOf(HasSubstr("routing_method"), HasSubstr("'softmax'"), HasSubstr("default"),
                    HasSubstr("deepseek_v3"), HasSubstr("precomputed")));
  EXPECT_THAT(error_of([] { parse_routing_method("Renormalize", "--routing"); }),
              AllOf(HasSubstr("--routing"), HasSubstr("'Renormalize'"), HasSubstr("renormalize")));
  EXPECT_THAT(error_of([] { parse_activation("silu"); }),
              AllOf(HasSubstr("activation"), HasSubstr("'silu'"), HasSubstr("swiglu, geglu, swiglu_oai, relu2")));
  EXPECT_THAT(error_of([] { parse_act_quant("w4a8", "metadata act_quant"); }),
              AllOf(HasSubstr("metadata act_quant"), HasSubstr("'w4a8'"),
                    HasSubstr("w4a16, w4a4_scalar, w4a4_per_expert")));
  EXPECT_THAT(error_of([] { parse_activation(""); }), HasSubstr("''"));
}

MoeProblem base() {
  MoeProblem p;
  p.num_experts = 8;
  p.hidden = 256;
  p.inter = 128;
  p.routing.top_k = 2;
  return p;
}

MoeProblem deepseek() {
  MoeProblem p = base();
  p.num_experts = 16;
  p.routing.method = RoutingMethod::DeepSeekV3;
  p.routing.top_k = 4;
  p.routing.n_group = 4;
  p.routing.topk_group = 2;
  p.routing.routed_scaling_factor = 2.5f;
  return p;
}

std::string validate_error(const MoeProblem& p) { return error_of([&] { p.validate(); }); }

TEST(Problem, ValidProblemsPass) {
  EXPECT_NO_THROW(base().validate());
  EXPECT_NO_THROW(deepseek().validate());
  MoeProblem p = base();
  p.num_experts = 1;
  p.routing.top_k = 1;
  p.hidden = 16;
  p.inter = 16;
  EXPECT_NO_THROW(p.validate());
  p = base();
  p.num_experts = 64;
  p.routing.top_k = 32;
  EXPECT_NO_THROW(p.validate());
  p = deepseek();
  p.routing.top_k = 8;  // == topk_group * E / n_group
  EXPECT_NO_THROW(p.validate());
}

TEST(Problem, ValidateSizes) {
  MoeProblem p = base();
  p.num_experts = 0;
  EXPECT_THAT(validate_error(p), AllOf(HasSubstr("num_experts"), HasSubstr(">= 1"), HasSubstr("got 0")));
  p = base();
  p.hidden = 100;
  EXPECT_THAT(validate_error(p), AllOf(HasSubstr("hidden"), HasSubstr("multiple of 16"), HasSubstr("got 100")));
  p.hidden = 0;
  EXPECT_THAT(validate_error(p), AllOf(HasSubstr("hidden"), HasSubstr("got 0")));
  p = base();
  p.inter = 24;
  EXPECT_THAT(validate_error(p), AllOf(HasSubstr("inter"), HasSubstr("multiple of 16"), HasSubstr("got 24")));
  p.inter = -16;
  EXPECT_THAT(validate_error(p), AllOf(HasSubstr("inter"), HasSubstr("got -16")));
}

TEST(Problem, ValidateTopK) {
  MoeProblem p = base();
  p.routing.top_k = 0;
  EXPECT_THAT(validate_error(p), AllOf(HasSubstr("top_k"), HasSubstr("[1, 32]"), HasSubstr("got 0")));
  p.routing.top_k = 33;
  p.num_experts = 64;
  EXPECT_THAT(validate_error(p), AllOf(HasSubstr("top_k"), HasSubstr("[1, 32]"), HasSubstr("got 33")));
  p = base();
  p.routing.top_k = 9;
  EXPECT_THAT(validate_error(p), AllOf(HasSubstr("top_k"), HasSubstr("num_experts (E = 8)"), HasSubstr("got 9")));
}

TEST(Problem, ValidateDeepSeekV3) {
  MoeProblem p = deepseek();
  p.routing.n_group = 0;
  EXPECT_THAT(validate_error(p), AllOf(HasSubstr("n_group"), HasSubstr(">= 1"), HasSubstr("got 0")));
  p.routing.n_group = 3;
  EXPECT_THAT(validate_error(p), AllOf(HasSubstr("n_group"), HasSubstr("divide num_experts (E = 16)"), HasSubstr("got 3")));
  p.routing.n_group = 16;  // one expert per group: no top-two group score
  p.routing.topk_group = 4;
  EXPECT_THAT(validate_error(p), AllOf(HasSubstr("n_group"), HasSubstr(">= 2 experts per group"), HasSubstr("n_group = 16")));
  p = deepseek();
  p.routing.topk_group = 0;
  EXPECT_THAT(validate_error(p), AllOf(HasSubstr("topk_group"), HasSubstr("[1, n_group = 4]"), HasSubstr("got 0")));
  p.routing.topk_group = 5;
  EXPECT_THAT(validate_error(p), AllOf(HasSubstr("topk_group"), HasSubstr("got 5")));
  p = deepseek();
  p.routing.top_k = 9;  // kept groups hold 2 * 4 = 8 experts
  EXPECT_THAT(validate_error(p), AllOf(HasSubstr("top_k"), HasSubstr("topk_group * (E / n_group) = 8"), HasSubstr("got 9")));
  p = deepseek();
  p.routing.routed_scaling_factor = 0.0f;
  EXPECT_THAT(validate_error(p), AllOf(HasSubstr("routed_scaling_factor"), HasSubstr("finite and > 0"), HasSubstr("got 0")));
  p.routing.routed_scaling_factor = -1.0f;
  EXPECT_THAT(validate_error(p), AllOf(HasSubstr("routed_scaling_factor"), HasSubstr("got -1")));
  p.routing.routed_scaling_factor = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THAT(validate_error(p), HasSubstr("routed_scaling_factor"));
  p.routing.routed_scaling_factor = std::numeric_limits<float>::infinity();
  EXPECT_THAT(validate_error(p), HasSubstr("routed_scaling_factor"));
  // Group parameters are not checked for methods that do not use them.
  p = base();
  p.routing.n_group = 0;
  p.routing.routed_scaling_factor = -3.0f;
  EXPECT_NO_THROW(p.validate());
}

TEST(Problem, ValidateTopOneRequirements) {
  MoeProblem p = base();
  p.routing.method = RoutingMethod::Llama4;
  EXPECT_THAT(validate_error(p), AllOf(HasSubstr("top_k"), HasSubstr("must be 1 for llama4"), HasSubstr("got 2")));
  p.routing.top_k = 1;
  EXPECT_NO_THROW(p.validate());
  p = base();
  p.routing.apply_router_weight_on_input = true;
  EXPECT_THAT(validate_error(p),
              AllOf(HasSubstr("apply_router_weight_on_input"), HasSubstr("top_k (k) == 1"), HasSubstr("got k = 2")));
  p.routing.top_k = 1;
  EXPECT_NO_THROW(p.validate());
}

TEST(Problem, ValidateSwigluOaiParameters) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  MoeProblem p = base();
  p.activation.kind = Activation::SwiGLUOai;
  EXPECT_NO_THROW(p.validate());
  p.activation.swiglu_alpha = nan;
  EXPECT_THAT(validate_error(p), AllOf(HasSubstr("swiglu_alpha"), HasSubstr("finite"), HasSubstr("got nan")));
  p.activation.swiglu_alpha = 1.702f;
  p.activation.swiglu_beta = -inf;
  EXPECT_THAT(validate_error(p), AllOf(HasSubstr("swiglu_beta"), HasSubstr("got -inf")));
  p.activation.swiglu_beta = 1.0f;
  p.activation.swiglu_limit = inf;
  EXPECT_THAT(validate_error(p), AllOf(HasSubstr("swiglu_limit"), HasSubstr("got inf")));
  p.activation.kind = Activation::SwiGLU;  // parameters unused
  EXPECT_NO_THROW(p.validate());
}

TEST(Problem, GatedAndRows) {
  MoeProblem p = base();
  EXPECT_TRUE(p.gated());
  EXPECT_EQ(p.w13_rows(), 256);
  p.activation.kind = Activation::Relu2;
  EXPECT_FALSE(p.gated());
  EXPECT_EQ(p.w13_rows(), 128);
}

TEST(Problem, Describe) {
  MoeProblem p = preset("deepseek-r1", ActQuant::W4A4Scalar);
  EXPECT_EQ(p.describe(),
            "E=256 H=7168 I=2048 k=8 routing=deepseek_v3(n_group=8,topk_group=4,scale=2.5) act=swiglu "
            "quant=w4a4_scalar");
  EXPECT_EQ(preset("qwen3-30b-a3b").describe(), "E=128 H=2048 I=768 k=8 routing=renormalize act=swiglu quant=w4a16");
  EXPECT_EQ(preset("llama4-scout", ActQuant::W4A4PerExpert).describe(),
            "E=16 H=5120 I=8192 k=1 routing=llama4(weight_on_input) act=swiglu quant=w4a4_per_expert");
  EXPECT_EQ(preset("gpt-oss-120b").describe(),
            "E=128 H=2880 I=2880 k=4 routing=renormalize act=swiglu_oai(alpha=1.702,beta=1,limit=7) quant=w4a16 "
            "weights=mxfp4");
  EXPECT_EQ(preset("gpt-oss-20b").describe(),
            "E=32 H=2880 I=2880 k=4 routing=renormalize act=swiglu_oai(alpha=1.702,beta=1,limit=7) quant=w4a16 "
            "weights=mxfp4");
  EXPECT_EQ(preset("gpt-oss-120b-nvfp4", ActQuant::W4A4Scalar).describe(),
            "E=128 H=2880 I=2880 k=4 routing=renormalize act=swiglu_oai(alpha=1.702,beta=1,limit=7) quant=w4a4_scalar");
}

TEST(Preset, Mxfp4PresetsTakeW4a16Only) {
  EXPECT_EQ(preset_weight_format("gpt-oss-120b"), WeightFormat::MXFP4);
  EXPECT_EQ(preset_weight_format("gpt-oss-20b"), WeightFormat::MXFP4);
  EXPECT_EQ(preset_weight_format("gpt-oss-120b-nvfp4"), WeightFormat::NVFP4);
  EXPECT_EQ(preset_weight_format("deepseek-r1"), WeightFormat::NVFP4);
  EXPECT_THAT(error_of([] { preset("gpt-oss-120b", ActQuant::W4A4Scalar); }),
              AllOf(HasSubstr("preset 'gpt-oss-120b' has mxfp4 weights, which run in mode w4a16 only, got w4a4_scalar"),
                    HasSubstr("NVFP4 stand-in 'gpt-oss-120b-nvfp4'")));
  EXPECT_THAT(error_of([] { preset("gpt-oss-20b", ActQuant::W4A4PerExpert); }),
              AllOf(HasSubstr("preset 'gpt-oss-20b' has mxfp4 weights"), ::testing::Not(HasSubstr("stand-in"))));
  EXPECT_THAT(error_of([] { preset_weight_format("gpt-oss"); }), HasSubstr("unknown model name 'gpt-oss'"));
}

TEST(Preset, AllPresetsValidate) {
  const auto names = preset_names();
  EXPECT_EQ(names, (std::vector<std::string>{"deepseek-r1", "qwen3-30b-a3b", "qwen3-235b-a22b", "llama4-scout",
                                             "gpt-oss-120b", "gpt-oss-20b", "gpt-oss-120b-nvfp4", "kimi-k2", "glm-4.6",
                                             "qwen3-next-80b-a3b", "tiny"}));
  for (const auto& n : names)
    for (ActQuant q : {ActQuant::W4A16, ActQuant::W4A4Scalar, ActQuant::W4A4PerExpert}) {
      if (preset_weight_format(n) == WeightFormat::MXFP4 && q != ActQuant::W4A16) continue;  // Mxfp4PresetsTakeW4a16Only
      const MoeProblem p = preset(n, q);
      EXPECT_NO_THROW(p.validate()) << n;
      EXPECT_EQ(p.act_quant, q) << n;
    }
}

TEST(Preset, ModelShapes) {
  const MoeProblem ds = preset("deepseek-r1");
  EXPECT_EQ(ds.num_experts, 256);
  EXPECT_EQ(ds.hidden, 7168);
  EXPECT_EQ(ds.inter, 2048);
  EXPECT_EQ(ds.top_k(), 8);
  EXPECT_EQ(ds.routing.method, RoutingMethod::DeepSeekV3);
  EXPECT_EQ(ds.routing.n_group, 8);
  EXPECT_EQ(ds.routing.topk_group, 4);
  EXPECT_EQ(ds.routing.routed_scaling_factor, 2.5f);
  EXPECT_EQ(ds.activation.kind, Activation::SwiGLU);

  const MoeProblem q30 = preset("qwen3-30b-a3b");
  EXPECT_EQ(q30.num_experts, 128);
  EXPECT_EQ(q30.hidden, 2048);
  EXPECT_EQ(q30.inter, 768);
  EXPECT_EQ(q30.top_k(), 8);
  EXPECT_EQ(q30.routing.method, RoutingMethod::Renormalize);

  const MoeProblem q235 = preset("qwen3-235b-a22b");
  EXPECT_EQ(q235.num_experts, 128);
  EXPECT_EQ(q235.hidden, 4096);
  EXPECT_EQ(q235.inter, 1536);
  EXPECT_EQ(q235.top_k(), 8);
  EXPECT_EQ(q235.routing.method, RoutingMethod::Renormalize);

  const MoeProblem l4 = preset("llama4-scout");
  EXPECT_EQ(l4.num_experts, 16);
  EXPECT_EQ(l4.hidden, 5120);
  EXPECT_EQ(l4.inter, 8192);
  EXPECT_EQ(l4.top_k(), 1);
  EXPECT_EQ(l4.routing.method, RoutingMethod::Llama4);
  EXPECT_TRUE(l4.routing.apply_router_weight_on_input);

  const MoeProblem oss = preset("gpt-oss-120b");
  EXPECT_EQ(oss.num_experts, 128);
  EXPECT_EQ(oss.hidden, 2880);
  EXPECT_EQ(oss.inter, 2880);
  EXPECT_EQ(oss.top_k(), 4);
  EXPECT_EQ(oss.routing.method, RoutingMethod::Renormalize);
  EXPECT_EQ(oss.activation.kind, Activation::SwiGLUOai);
  EXPECT_EQ(oss.activation.swiglu_alpha, 1.702f);
  EXPECT_EQ(oss.activation.swiglu_beta, 1.0f);
  EXPECT_EQ(oss.activation.swiglu_limit, 7.0f);
  EXPECT_EQ(oss.weight_format, WeightFormat::MXFP4);
  const MoeProblem oss20 = preset("gpt-oss-20b");
  EXPECT_EQ(oss20.num_experts, 32);
  EXPECT_EQ(oss20.hidden, 2880);
  EXPECT_EQ(oss20.inter, 2880);
  EXPECT_EQ(oss20.top_k(), 4);
  MoeProblem stand_in = preset("gpt-oss-120b-nvfp4");
  EXPECT_EQ(stand_in.weight_format, WeightFormat::NVFP4);
  stand_in.weight_format = WeightFormat::MXFP4;
  EXPECT_EQ(stand_in.describe(), oss.describe());  // the same layer but for the weights' format

  EXPECT_EQ(preset("kimi-k2").describe(),
            "E=384 H=7168 I=2048 k=8 routing=deepseek_v3(n_group=1,topk_group=1,scale=2.827) act=swiglu quant=w4a16");
  EXPECT_EQ(preset("glm-4.6").describe(),
            "E=160 H=5120 I=1536 k=8 routing=deepseek_v3(n_group=1,topk_group=1,scale=2.5) act=swiglu quant=w4a16");
  EXPECT_EQ(preset("qwen3-next-80b-a3b").describe(),
            "E=512 H=2048 I=512 k=10 routing=renormalize act=swiglu quant=w4a16");

  const MoeProblem tiny = preset("tiny");
  EXPECT_LE(tiny.num_experts * tiny.hidden * tiny.w13_rows(), 1 << 20);  // CPU-sized
  EXPECT_GE(tiny.top_k(), 2);
  EXPECT_EQ(preset("tiny", ActQuant::W4A4Scalar).act_quant, ActQuant::W4A4Scalar);
  EXPECT_EQ(tiny.act_quant, ActQuant::W4A16);
}

TEST(Preset, UnknownNameListsPresets) {
  EXPECT_THAT(error_of([] { preset("deepseek-v3"); }),
              AllOf(HasSubstr("'deepseek-v3'"), HasSubstr("deepseek-r1"), HasSubstr("qwen3-30b-a3b"),
                    HasSubstr("qwen3-235b-a22b"), HasSubstr("llama4-scout"), HasSubstr("gpt-oss-120b"),
                    HasSubstr("tiny")));
}

}  // namespace
}  // namespace fp4moe
