// tests/io/case_file_test.cpp — case files (docs/case-file.md): save/load round trips for every kind of
// case, random cases, the OUT file, and every error of a bad case with its message checked.
#include "fp4moe/case_file.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "fp4moe/error.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/safetensors.hpp"
#include "test_dir.hpp"

namespace fp4moe::io {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

std::string tmp_path(const std::string& suffix = "") { return test::test_file_path("io", suffix + ".safetensors"); }

MoeProblem small_problem(Activation act = Activation::SwiGLU, RoutingMethod method = RoutingMethod::Renormalize,
                         ActQuant quant = ActQuant::W4A4PerExpert) {
  MoeProblem p;
  p.num_experts = 4;
  p.hidden = 32;
  p.inter = 48;
  p.routing.method = method;
  p.routing.top_k = 2;
  p.activation.kind = act;
  p.act_quant = quant;
  return p;
}

// Bitwise equality of float vectors (so that -0 / NaN payloads would count too).
void expect_same_bits(const std::vector<float>& a, const std::vector<float>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  if (!a.empty()) EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << what;
}

void expect_equal_cases(const MoeCase& a, const MoeCase& b) {
  EXPECT_EQ(a.problem.num_experts, b.problem.num_experts);
  EXPECT_EQ(a.problem.hidden, b.problem.hidden);
  EXPECT_EQ(a.problem.inter, b.problem.inter);
  EXPECT_EQ(a.problem.routing.method, b.problem.routing.method);
  EXPECT_EQ(a.problem.routing.top_k, b.problem.routing.top_k);
  EXPECT_EQ(a.problem.routing.n_group, b.problem.routing.n_group);
  EXPECT_EQ(a.problem.routing.topk_group, b.problem.routing.topk_group);
  EXPECT_EQ(a.problem.routing.routed_scaling_factor, b.problem.routing.routed_scaling_factor);
  EXPECT_EQ(a.problem.routing.apply_router_weight_on_input, b.problem.routing.apply_router_weight_on_input);
  EXPECT_EQ(a.problem.activation.kind, b.problem.activation.kind);
  EXPECT_EQ(a.problem.activation.swiglu_alpha, b.problem.activation.swiglu_alpha);
  EXPECT_EQ(a.problem.activation.swiglu_beta, b.problem.activation.swiglu_beta);
  EXPECT_EQ(a.problem.activation.swiglu_limit, b.problem.activation.swiglu_limit);
  EXPECT_EQ(a.problem.act_quant, b.problem.act_quant);
  EXPECT_EQ(a.num_tokens, b.num_tokens);
  EXPECT_EQ(a.hidden_states, b.hidden_states);
  expect_same_bits(a.router_logits, b.router_logits, "router_logits");
  EXPECT_EQ(a.router_logits_bf16, b.router_logits_bf16);
  expect_same_bits(a.routing_bias, b.routing_bias, "routing_bias");
  EXPECT_EQ(a.topk_ids, b.topk_ids);
  expect_same_bits(a.topk_weights, b.topk_weights, "topk_weights");
  EXPECT_EQ(a.w13, b.w13);
  EXPECT_EQ(a.w13_scale, b.w13_scale);
  expect_same_bits(a.w13_scale_2, b.w13_scale_2, "w13_scale_2");
  expect_same_bits(a.w13_input_scale, b.w13_input_scale, "w13_input_scale");
  EXPECT_EQ(a.w2, b.w2);
  EXPECT_EQ(a.w2_scale, b.w2_scale);
  expect_same_bits(a.w2_scale_2, b.w2_scale_2, "w2_scale_2");
  expect_same_bits(a.w2_input_scale, b.w2_input_scale, "w2_input_scale");
}

// ---- round trips --------------------------------------------------------------------------------

TEST(CaseFileRoundTrip, GatedWithF32Logits) {
  const MoeCase c = make_random_case(small_problem(), 5, {.seed = 11});
  const std::string path = tmp_path();
  save_case(path, c);
  const MoeCase back = load_case(path);
  expect_equal_cases(c, back);
  EXPECT_FALSE(back.router_logits_bf16);
  EXPECT_EQ(back.router_logits.size(), 5u * 4u);
}

TEST(CaseFileRoundTrip, Relu2Precomputed) {
  MoeProblem p = small_problem(Activation::Relu2, RoutingMethod::Precomputed, ActQuant::W4A4Scalar);
  p.routing.top_k = 3;
  const MoeCase c = make_random_case(p, 7, {.seed = 12});
  EXPECT_EQ(c.w13.size(), 4u * 48u * 16u);  // relu2: w13 has I rows
  EXPECT_TRUE(c.router_logits.empty());
  const std::string path = tmp_path();
  save_case(path, c);
  const MoeCase back = load_case(path);
  expect_equal_cases(c, back);
  // The file itself has the canonical shapes.
  const SafetensorsFile f = SafetensorsFile::open(path);
  EXPECT_EQ(f.tensor("w13").shape, (std::vector<int64_t>{4, 48, 16}));
  EXPECT_EQ(f.tensor("w13_scale").shape, (std::vector<int64_t>{4, 48, 2}));
  EXPECT_EQ(f.tensor("w2").shape, (std::vector<int64_t>{4, 32, 24}));
  EXPECT_EQ(f.tensor("w2_scale").shape, (std::vector<int64_t>{4, 32, 3}));
  EXPECT_EQ(f.tensor("topk_ids").shape, (std::vector<int64_t>{7, 3}));
  EXPECT_EQ(f.tensor("topk_ids").dtype, DType::I32);
  EXPECT_FALSE(f.contains("router_logits"));
  EXPECT_EQ(f.metadata().at("routing_method"), "precomputed");
  EXPECT_EQ(f.metadata().at("activation"), "relu2");
  EXPECT_EQ(f.metadata().at("act_quant"), "w4a4_scalar");
  EXPECT_EQ(f.metadata().at("top_k"), "3");
}

TEST(CaseFileRoundTrip, DeepSeekV3WithBf16LogitsAndSwigluOai) {
  MoeProblem p = small_problem(Activation::SwiGLUOai, RoutingMethod::DeepSeekV3, ActQuant::W4A16);
  p.num_experts = 8;
  p.routing.top_k = 3;
  p.routing.n_group = 4;
  p.routing.topk_group = 2;
  p.routing.routed_scaling_factor = 2.5f;
  p.activation.swiglu_alpha = 1.702f;
  p.activation.swiglu_beta = 0.1f;  // not exactly representable: must still read back bit-identical
  p.activation.swiglu_limit = 7.25f;
  MoeCase c = make_random_case(p, 9, {.seed = 13});
  ASSERT_EQ(c.routing_bias.size(), 8u);
  c.router_logits_bf16 = true;  // bf16 logits hold bf16 values
  for (float& l : c.router_logits) l = format::bf16_to_float(format::bf16_from_float(l));
  const std::string path = tmp_path();
  save_case(path, c);
  const MoeCase back = load_case(path);
  expect_equal_cases(c, back);
  EXPECT_TRUE(back.router_logits_bf16);
  const SafetensorsFile f = SafetensorsFile::open(path);
  EXPECT_EQ(f.tensor("router_logits").dtype, DType::BF16);
  EXPECT_EQ(f.metadata().at("routed_scaling_factor"), "2.5");
  EXPECT_EQ(f.metadata().at("n_group"), "4");
  EXPECT_EQ(f.metadata().at("topk_group"), "2");
}

TEST(CaseFileRoundTrip, Llama4GegluW4a16WithoutInputScales) {
  MoeProblem p = small_problem(Activation::GeGLU, RoutingMethod::Llama4, ActQuant::W4A16);
  p.routing.top_k = 1;
  p.routing.apply_router_weight_on_input = true;
  MoeCase c = make_random_case(p, 3, {.seed = 14});
  c.w13_input_scale.clear();  // optional with w4a16
  c.w2_input_scale.clear();
  const std::string path = tmp_path();
  save_case(path, c);
  const MoeCase back = load_case(path);
  expect_equal_cases(c, back);
  EXPECT_TRUE(back.w13_input_scale.empty());
  EXPECT_EQ(back.weights().w13_input_scale, nullptr);
  EXPECT_EQ(back.weights().w2_input_scale, nullptr);
  const SafetensorsFile f = SafetensorsFile::open(path);
  EXPECT_EQ(f.metadata().at("apply_router_weight_on_input"), "1");
}

TEST(CaseFileRoundTrip, ZeroTokens) {
  const MoeCase c = make_random_case(small_problem(), 0, {.seed = 15});
  const std::string path = tmp_path();
  save_case(path, c);
  const MoeCase back = load_case(path);
  expect_equal_cases(c, back);
  EXPECT_EQ(back.num_tokens, 0);
}

TEST(CaseFileRoundTrip, OptionalMetadataTakesDefaults) {
  // Only the four required keys: the rest takes the defaults of RoutingParams / ActivationParams.
  const MoeCase c = make_random_case(small_problem(), 2, {.seed = 16});
  const std::string path = tmp_path();
  save_case(path, c);
  const SafetensorsFile f = SafetensorsFile::open(path);
  std::vector<TensorData> ts;
  for (const auto& [name, v] : f.tensors())
    ts.push_back(TensorData{name, v.dtype, v.shape, std::vector<std::byte>(v.data.begin(), v.data.end())});
  const std::string path2 = tmp_path("-minimal");
  write_safetensors(path2, ts,
                    {{"top_k", "2"}, {"routing_method", "renormalize"}, {"activation", "swiglu"},
                     {"act_quant", "w4a4_per_expert"}, {"some_other_tool_key", "ignored"}});
  const MoeCase back = load_case(path2);
  const RoutingParams rdef;
  const ActivationParams adef;
  EXPECT_EQ(back.problem.routing.n_group, rdef.n_group);
  EXPECT_EQ(back.problem.routing.topk_group, rdef.topk_group);
  EXPECT_EQ(back.problem.routing.routed_scaling_factor, rdef.routed_scaling_factor);
  EXPECT_EQ(back.problem.routing.apply_router_weight_on_input, rdef.apply_router_weight_on_input);
  EXPECT_EQ(back.problem.activation.swiglu_alpha, adef.swiglu_alpha);
  EXPECT_EQ(back.problem.activation.swiglu_beta, adef.swiglu_beta);
  EXPECT_EQ(back.problem.activation.swiglu_limit, adef.swiglu_limit);
  EXPECT_EQ(back.hidden_states, c.hidden_states);
}

TEST(CaseFileViews, WeightsAndRouterPointIntoTheCase) {
  const MoeCase c = make_random_case(small_problem(Activation::SwiGLU, RoutingMethod::DeepSeekV3), 4, {.seed = 3});
  const reference::MoeWeights w = c.weights();
  EXPECT_EQ(w.w13, c.w13.data());
  EXPECT_EQ(w.w13_scale, c.w13_scale.data());
  EXPECT_EQ(w.w13_scale_2, c.w13_scale_2.data());
  EXPECT_EQ(w.w13_input_scale, c.w13_input_scale.data());
  EXPECT_EQ(w.w2, c.w2.data());
  EXPECT_EQ(w.w2_scale, c.w2_scale.data());
  EXPECT_EQ(w.w2_scale_2, c.w2_scale_2.data());
  EXPECT_EQ(w.w2_input_scale, c.w2_input_scale.data());
  const reference::RouterInput r = c.router();
  EXPECT_EQ(r.logits, c.router_logits.data());
  EXPECT_EQ(r.bias, c.routing_bias.data());
  EXPECT_EQ(r.topk_ids, nullptr);

  const MoeCase pc = make_random_case(small_problem(Activation::SwiGLU, RoutingMethod::Precomputed), 4, {.seed = 3});
  const reference::RouterInput pr = pc.router();
  EXPECT_EQ(pr.logits, nullptr);
  EXPECT_EQ(pr.bias, nullptr);
  EXPECT_EQ(pr.topk_ids, pc.topk_ids.data());
  EXPECT_EQ(pr.topk_weights, pc.topk_weights.data());
}

// ---- random cases -------------------------------------------------------------------------------

TEST(CaseFileRandom, SeededAndFollowsTheNvfp4Recipe) {
  const MoeProblem p = small_problem();
  const RandomCaseOptions opts{.seed = 21, .weight_std = 0.05f, .hidden_std = 2.0f};
  std::vector<float> w13f, w2f;
  const MoeCase c = make_random_case(p, 6, opts, &w13f, &w2f);
  const MoeCase again = make_random_case(p, 6, opts);
  expect_equal_cases(c, again);
  const MoeCase other = make_random_case(p, 6, {.seed = 22, .weight_std = 0.05f, .hidden_std = 2.0f});
  EXPECT_NE(c.w13, other.w13);
  EXPECT_NE(c.hidden_states, other.hidden_states);

  const int64_t E = 4, H = 32, I = 48, rows = 2 * I;
  ASSERT_EQ(w13f.size(), static_cast<size_t>(E * rows * H));
  ASSERT_EQ(w2f.size(), static_cast<size_t>(E * H * I));
  // bf16 weights with roughly the requested spread.
  double sq = 0.0;
  for (float x : w13f) {
    EXPECT_EQ(format::bf16_to_float(format::bf16_from_float(x)), x);
    sq += double(x) * x;
  }
  EXPECT_NEAR(std::sqrt(sq / w13f.size()), 0.05, 0.005);

  float hidden_amax = 0.0f;
  for (uint16_t h : c.hidden_states) hidden_amax = std::max(hidden_amax, std::fabs(format::bf16_to_float(h)));

  auto check_expert = [&](const std::vector<float>& wf, const std::vector<uint8_t>& packed,
                          const std::vector<uint8_t>& scales, float scale_2, int64_t e, int64_t r, int64_t cols) {
    const float* x = wf.data() + e * r * cols;
    float amax = 0.0f;
    for (int64_t i = 0; i < r * cols; ++i) amax = std::max(amax, std::fabs(x[i]));
    EXPECT_EQ(scale_2, amax / 2688.0f) << "expert " << e;
    // Exactly what format::quantize_nvfp4 gives with that global scale.
    std::vector<uint8_t> q(r * cols / 2), s(r * cols / 16);
    format::quantize_nvfp4(x, r, cols, scale_2, q.data(), s.data());
    EXPECT_TRUE(std::equal(q.begin(), q.end(), packed.begin() + e * r * cols / 2)) << "expert " << e;
    EXPECT_TRUE(std::equal(s.begin(), s.end(), scales.begin() + e * r * cols / 16)) << "expert " << e;
    // The block holding the amax gets the largest e4m3 scale, 448 (code 0x7E).
    EXPECT_EQ(*std::max_element(s.begin(), s.end()), 0x7E) << "expert " << e;
    // Dequantized weights approximate the bf16 weights.
    std::vector<float> dq(r * cols);
    format::dequantize_nvfp4(q.data(), s.data(), r, cols, dq.data());
    double err = 0.0, ref = 0.0;
    for (int64_t i = 0; i < r * cols; ++i) {
      const double d = double(dq[i]) * scale_2 - x[i];
      err += d * d;
      ref += double(x[i]) * x[i];
    }
    EXPECT_LT(std::sqrt(err / ref), 0.15) << "expert " << e;
  };
  for (int64_t e = 0; e < E; ++e) {
    check_expert(w13f, c.w13, c.w13_scale, c.w13_scale_2[e], e, rows, H);
    check_expert(w2f, c.w2, c.w2_scale, c.w2_scale_2[e], e, H, I);
    const float a1 = hidden_amax / 2688.0f;
    EXPECT_GE(c.w13_input_scale[e], a1 * 0.8f * 0.999f);
    EXPECT_LE(c.w13_input_scale[e], a1 * 1.2f * 1.001f);
    EXPECT_TRUE(std::isfinite(c.w2_input_scale[e]) && c.w2_input_scale[e] > 0.0f);
  }
  // w2_input_scale: silu(4σ)·4σ / 2688 with σ = hidden_std * weight_std * sqrt(H), times U[0.8, 1.2].
  const float sigma = 2.0f * 0.05f * std::sqrt(32.0f);
  const float act = (4 * sigma) / (1 + std::exp(-4 * sigma)) * (4 * sigma);
  for (int64_t e = 0; e < E; ++e) {
    EXPECT_GE(c.w2_input_scale[e], act / 2688.0f * 0.79f);
    EXPECT_LE(c.w2_input_scale[e], act / 2688.0f * 1.21f);
  }
}

TEST(CaseFileRandom, RoutingInputsPerMethod) {
  MoeProblem p = small_problem(Activation::SwiGLU, RoutingMethod::Precomputed);
  p.num_experts = 6;
  p.routing.top_k = 4;
  const MoeCase c = make_random_case(p, 50, {.seed = 5});
  ASSERT_EQ(c.topk_ids.size(), 200u);
  for (int t = 0; t < 50; ++t) {
    std::set<int32_t> ids;
    float sum = 0.0f;
    for (int j = 0; j < 4; ++j) {
      const int32_t id = c.topk_ids[t * 4 + j];
      EXPECT_TRUE(id >= 0 && id < 6);
      ids.insert(id);
      EXPECT_GT(c.topk_weights[t * 4 + j], 0.0f);
      sum += c.topk_weights[t * 4 + j];
    }
    EXPECT_EQ(ids.size(), 4u) << "token " << t << ": ids must be distinct";
    EXPECT_NEAR(sum, 1.0f, 1e-5f);
  }
  EXPECT_TRUE(c.router_logits.empty());
  const MoeCase r = make_random_case(small_problem(), 5, {.seed = 5});
  EXPECT_EQ(r.router_logits.size(), 20u);
  EXPECT_TRUE(r.routing_bias.empty());  // bias only with DeepSeekV3
}

TEST(CaseFileRandom, RejectsInvalidProblems) {
  MoeProblem p = small_problem();
  p.hidden = 40;
  EXPECT_THROW(make_random_case(p, 1), Error);
  EXPECT_THROW(make_random_case(small_problem(), -1), Error);
}

// ---- OUT file -----------------------------------------------------------------------------------

TEST(CaseFileResult, RoundTrip) {
  const MoeProblem p = small_problem();
  reference::MoeResult r;
  r.output = {0x3F80, 0xBF80, 0x7FC0, 0x0001};
  r.output.resize(3 * 32, 0x4000);
  r.topk_ids = {0, 3, 2, 1, 3, 0};
  r.topk_weights = {0.75f, 0.25f, 0.5f, 0.5f, 1e-8f, 0.99999994f};
  const std::string path = tmp_path();
  save_result(path, p, 3, r);
  const reference::MoeResult back = load_result(path);
  EXPECT_EQ(back.output, r.output);
  EXPECT_EQ(back.topk_ids, r.topk_ids);
  expect_same_bits(back.topk_weights, r.topk_weights, "topk_weights");
  const SafetensorsFile f = SafetensorsFile::open(path);
  EXPECT_EQ(f.tensor("output").dtype, DType::BF16);
  EXPECT_EQ(f.tensor("output").shape, (std::vector<int64_t>{3, 32}));
  EXPECT_EQ(f.tensor("topk_ids").dtype, DType::I32);
  EXPECT_EQ(f.tensor("topk_ids").shape, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(f.tensor("topk_weights").dtype, DType::F32);
  EXPECT_EQ(f.tensor("topk_weights").shape, (std::vector<int64_t>{3, 2}));
}

TEST(CaseFileResult, Errors) {
  const MoeProblem p = small_problem();
  reference::MoeResult r;
  r.output.resize(3 * 32);
  r.topk_ids.resize(5);
  r.topk_weights.resize(6);
  const std::string path = tmp_path();
  try {
    save_result(path, p, 3, r);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("topk_ids"), HasSubstr("expected T*k = 6")));
  }
  write_safetensors(path,
                    {make_tensor("output", DType::BF16, {3, 32}, std::vector<uint16_t>(96)),
                     make_tensor("topk_ids", DType::I32, {2, 2}, std::vector<int32_t>(4)),
                     make_tensor("topk_weights", DType::F32, {2, 2}, std::vector<float>(4))},
                    {});
  try {
    load_result(path);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr(path), HasSubstr("tensor 'topk_ids'"), HasSubstr("expected 3 rows")));
  }
  write_safetensors(path, {make_tensor("output", DType::F32, {3, 32}, std::vector<float>(96))}, {});
  try {
    load_result(path);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("tensor 'output'"), HasSubstr("expected dtype BF16, got F32")));
  }
}

// ---- errors in case files -----------------------------------------------------------------------

// A saved case as editable tensors + metadata, for crafting bad files.
struct EditableCase {
  std::vector<TensorData> tensors;
  std::map<std::string, std::string> meta;

  TensorData& at(const std::string& name) {
    for (auto& t : tensors)
      if (t.name == name) return t;
    throw std::runtime_error("no tensor " + name);
  }
  void erase(const std::string& name) {
    std::erase_if(tensors, [&](const TensorData& t) { return t.name == name; });
  }
  template <typename T>
  void set(const std::string& name, DType dtype, std::vector<int64_t> shape, const std::vector<T>& v) {
    erase(name);
    tensors.push_back(make_tensor(name, dtype, std::move(shape), v));
  }
  template <typename T>
  std::vector<T> values(const std::string& name) {
    const TensorData& t = at(name);
    std::vector<T> v(t.bytes.size() / sizeof(T));
    if (!v.empty()) std::memcpy(v.data(), t.bytes.data(), t.bytes.size());
    return v;
  }
};

EditableCase editable(const MoeCase& c, const std::string& path) {
  save_case(path, c);
  const SafetensorsFile f = SafetensorsFile::open(path);
  EditableCase ec;
  for (const auto& [name, v] : f.tensors())
    ec.tensors.push_back(TensorData{name, v.dtype, v.shape, std::vector<std::byte>(v.data.begin(), v.data.end())});
  ec.meta = f.metadata();
  return ec;
}

// Writes the edited case and returns load_case's error message (empty when it loaded).
std::string load_error(const EditableCase& ec, const std::string& path) {
  write_safetensors(path, ec.tensors, ec.meta);
  try {
    load_case(path);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

class CaseFileErrors : public ::testing::Test {
 protected:
  // E=4 H=32 I=48 k=2, swiglu, renormalize, w4a4_per_expert, T=3.
  void SetUp() override {
    path_ = tmp_path();
    base_ = editable(make_random_case(small_problem(), 3, {.seed = 7}), path_);
  }
  std::string error_with(const std::function<void(EditableCase&)>& edit) {
    EditableCase ec = base_;
    edit(ec);
    return load_error(ec, path_);
  }
  std::string path_;
  EditableCase base_;
};

TEST_F(CaseFileErrors, BaseCaseLoads) { EXPECT_EQ(error_with([](EditableCase&) {}), ""); }

TEST_F(CaseFileErrors, NotACaseFile) {
  std::filesystem::remove(path_);
  try {
    load_case(path_);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr(path_), HasSubstr("cannot open")));
  }
}

TEST_F(CaseFileErrors, MissingTensor) {
  for (const char* name : {"hidden_states", "router_logits", "w13", "w13_scale", "w13_scale_2", "w13_input_scale",
                           "w2", "w2_scale", "w2_scale_2", "w2_input_scale"}) {
    EXPECT_THAT(error_with([&](EditableCase& ec) { ec.erase(name); }),
                AllOf(HasSubstr(path_), HasSubstr("missing tensor '" + std::string(name) + "'")))
        << name;
  }
  EXPECT_THAT(error_with([](EditableCase& ec) { ec.erase("w2_input_scale"); }),
              HasSubstr("required with act_quant w4a4"));
}

TEST_F(CaseFileErrors, InputScalesOptionalForW4a16ButCheckedWhenPresent) {
  EXPECT_EQ(error_with([](EditableCase& ec) {
              ec.meta["act_quant"] = "w4a16";
              ec.erase("w13_input_scale");
              ec.erase("w2_input_scale");
            }),
            "");
  EXPECT_THAT(error_with([](EditableCase& ec) {
                ec.meta["act_quant"] = "w4a16";
                ec.set("w2_input_scale", DType::F32, {4}, std::vector<float>{1.0f, 0.0f, 1.0f, 1.0f});
              }),
              AllOf(HasSubstr("tensor 'w2_input_scale'"), HasSubstr("finite and > 0"), HasSubstr("index [1]")));
}

TEST_F(CaseFileErrors, MissingMetadataKey) {
  for (const char* key : {"top_k", "routing_method", "activation", "act_quant"}) {
    EXPECT_THAT(error_with([&](EditableCase& ec) { ec.meta.erase(key); }),
                AllOf(HasSubstr(path_), HasSubstr("missing metadata key '" + std::string(key) + "'")))
        << key;
  }
}

TEST_F(CaseFileErrors, WrongDtype) {
  EXPECT_THAT(error_with([](EditableCase& ec) {
                ec.set("w13_scale_2", DType::BF16, {4}, std::vector<uint16_t>(4, 0x3F80));
              }),
              AllOf(HasSubstr("tensor 'w13_scale_2'"), HasSubstr("expected dtype F32, got BF16")));
  EXPECT_THAT(error_with([](EditableCase& ec) {
                ec.set("hidden_states", DType::F32, {3, 32}, std::vector<float>(96, 1.0f));
              }),
              AllOf(HasSubstr("tensor 'hidden_states'"), HasSubstr("expected dtype BF16, got F32")));
  EXPECT_THAT(error_with([](EditableCase& ec) {
                ec.set("w13", DType::I32, {4, 96, 4}, std::vector<int32_t>(4 * 96 * 4));
              }),
              AllOf(HasSubstr("tensor 'w13'"), HasSubstr("expected dtype U8, got I32")));
  EXPECT_THAT(error_with([](EditableCase& ec) {
                ec.at("w2_scale").dtype = DType::U8;
              }),
              AllOf(HasSubstr("tensor 'w2_scale'"), HasSubstr("expected dtype F8_E4M3, got U8")));
  EXPECT_THAT(error_with([](EditableCase& ec) {
                ec.set("router_logits", DType::I32, {3, 4}, std::vector<int32_t>(12));
              }),
              AllOf(HasSubstr("tensor 'router_logits'"), HasSubstr("expected dtype F32 or BF16, got I32")));
}

TEST_F(CaseFileErrors, WrongShape) {
  EXPECT_THAT(error_with([](EditableCase& ec) {
                ec.set("w13_scale", DType::F8_E4M3, {4, 96, 3}, std::vector<uint8_t>(4 * 96 * 3));
              }),
              AllOf(HasSubstr("tensor 'w13_scale'"), HasSubstr("expected shape [4, 96, 2]"),
                    HasSubstr("got [4, 96, 3]")));
  EXPECT_THAT(error_with([](EditableCase& ec) {
                ec.set("router_logits", DType::F32, {3, 5}, std::vector<float>(15));
              }),
              AllOf(HasSubstr("tensor 'router_logits'"), HasSubstr("expected shape [3, 4]"), HasSubstr("got [3, 5]")));
  EXPECT_THAT(error_with([](EditableCase& ec) {
                ec.set("hidden_states", DType::BF16, {96}, std::vector<uint16_t>(96));
              }),
              AllOf(HasSubstr("tensor 'hidden_states'"), HasSubstr("[T, H] (rank 2)"), HasSubstr("got [96]")));
  // Gated activation: w13 needs 2I rows; a relu2-shaped w13 is refused.
  EXPECT_THAT(error_with([](EditableCase& ec) {
                ec.set("w13", DType::U8, {4, 48, 16}, std::vector<uint8_t>(4 * 48 * 16));
              }),
              AllOf(HasSubstr("tensor 'w13'"), HasSubstr("expected shape [4, 96, 16]"), HasSubstr("[E, 2I, H/2]"),
                    HasSubstr("got [4, 48, 16]")));
  // relu2 declared on a gated file: w13 has 2I rows where I rows are expected.
  EXPECT_THAT(error_with([](EditableCase& ec) { ec.meta["activation"] = "relu2"; }),
              AllOf(HasSubstr("tensor 'w13'"), HasSubstr("expected shape [4, 48, 16]"), HasSubstr("[E, I, H/2]")));
  EXPECT_THAT(error_with([](EditableCase& ec) {
                ec.set("routing_bias", DType::F32, {3}, std::vector<float>(3));
              }),
              AllOf(HasSubstr("tensor 'routing_bias'"), HasSubstr("expected shape [4]"), HasSubstr("got [3]")));
  EXPECT_THAT(error_with([](EditableCase& ec) {
                ec.set("w2", DType::U8, {4, 16, 24}, std::vector<uint8_t>(4 * 16 * 24));
              }),
              AllOf(HasSubstr("tensor 'w2'"), HasSubstr("expected shape [4, 32, 24]"), HasSubstr("got [4, 16, 24]")));
}

TEST_F(CaseFileErrors, InconsistentExpertCount) {
  EXPECT_THAT(error_with([](EditableCase& ec) {
                ec.set("w2", DType::U8, {5, 32, 24}, std::vector<uint8_t>(5 * 32 * 24));
              }),
              AllOf(HasSubstr("tensor 'w2'"), HasSubstr("expected shape [4, 32, 24]"), HasSubstr("got [5, 32, 24]"),
                    HasSubstr("E=4")));
  EXPECT_THAT(error_with([](EditableCase& ec) {
                ec.set("w2_scale_2", DType::F32, {5}, std::vector<float>(5, 1.0f));
              }),
              AllOf(HasSubstr("tensor 'w2_scale_2'"), HasSubstr("expected shape [4]"), HasSubstr("got [5]")));
  EXPECT_THAT(error_with([](EditableCase& ec) {
                ec.set("w13_input_scale", DType::F32, {3}, std::vector<float>(3, 1.0f));
              }),
              AllOf(HasSubstr("tensor 'w13_input_scale'"), HasSubstr("expected shape [4]"), HasSubstr("got [3]")));
  EXPECT_THAT(error_with([](EditableCase& ec) {
                ec.set("w2_scale", DType::F8_E4M3, {2, 32, 3}, std::vector<uint8_t>(2 * 32 * 3));
              }),
              AllOf(HasSubstr("tensor 'w2_scale'"), HasSubstr("expected shape [4, 32, 3]")));
}

TEST_F(CaseFileErrors, HiddenNotAMultipleOf16) {
  EXPECT_THAT(error_with([](EditableCase& ec) {
                ec.set("hidden_states", DType::BF16, {3, 40}, std::vector<uint16_t>(120));
              }),
              AllOf(HasSubstr(path_), HasSubstr("hidden size H = 40"), HasSubstr("multiple of 16")));
  EXPECT_THAT(error_with([](EditableCase& ec) {
                ec.set("hidden_states", DType::BF16, {3, 0}, std::vector<uint16_t>());
              }),
              AllOf(HasSubstr("hidden size H = 0"), HasSubstr("multiple of 16")));
}

TEST_F(CaseFileErrors, InterNotAMultipleOf16) {
  EXPECT_THAT(error_with([](EditableCase& ec) {
                ec.set("w2", DType::U8, {4, 32, 20}, std::vector<uint8_t>(4 * 32 * 20));
              }),
              AllOf(HasSubstr("intermediate size I = 40"), HasSubstr("multiple of 16")));
}

TEST_F(CaseFileErrors, TopKGreaterThanExperts) {
  EXPECT_THAT(error_with([](EditableCase& ec) { ec.meta["top_k"] = "5"; }),
              AllOf(HasSubstr(path_), HasSubstr("top_k"), HasSubstr("num_experts (E = 4), got 5")));
  EXPECT_THAT(error_with([](EditableCase& ec) { ec.meta["top_k"] = "0"; }),
              AllOf(HasSubstr("top_k"), HasSubstr("got 0")));
}

TEST_F(CaseFileErrors, InvalidGroupParameters) {
  EXPECT_THAT(error_with([](EditableCase& ec) {
                ec.meta["routing_method"] = "deepseek_v3";
                ec.meta["n_group"] = "3";
              }),
              AllOf(HasSubstr("n_group"), HasSubstr("divide")));
  EXPECT_THAT(error_with([](EditableCase& ec) {
                ec.meta["routing_method"] = "llama4";
              }),
              AllOf(HasSubstr("top_k"), HasSubstr("llama4")));
}

TEST_F(CaseFileErrors, UnknownNames) {
  EXPECT_THAT(error_with([](EditableCase& ec) { ec.meta["routing_method"] = "softmax_magic"; }),
              AllOf(HasSubstr(path_), HasSubstr("routing_method"), HasSubstr("'softmax_magic'"),
                    HasSubstr("deepseek_v3")));
  EXPECT_THAT(error_with([](EditableCase& ec) { ec.meta["activation"] = "silu"; }),
              AllOf(HasSubstr("activation"), HasSubstr("'silu'"), HasSubstr("swiglu_oai")));
  EXPECT_THAT(error_with([](EditableCase& ec) { ec.meta["act_quant"] = "w4a8"; }),
              AllOf(HasSubstr("act_quant"), HasSubstr("'w4a8'"), HasSubstr("w4a4_per_expert")));
}

TEST_F(CaseFileErrors, BadGlobalAndInputScales) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const char* name : {"w13_scale_2", "w2_scale_2", "w13_input_scale", "w2_input_scale"}) {
    for (float bad : {0.0f, -0.0f, -1.5f, nan, inf, -inf}) {
      const std::string msg = error_with([&](EditableCase& ec) {
        std::vector<float> v = ec.values<float>(name);
        v[2] = bad;
        ec.set(name, DType::F32, {4}, v);
      });
      EXPECT_THAT(msg, AllOf(HasSubstr("tensor '" + std::string(name) + "'"), HasSubstr("finite and > 0"),
                             HasSubstr("index [2]")))
          << name << " = " << bad;
    }
  }
}

TEST_F(CaseFileErrors, NanBlockScale) {
  EXPECT_THAT(error_with([](EditableCase& ec) {
                std::vector<uint8_t> v = ec.values<uint8_t>("w2_scale");
                v[1 * 32 * 3 + 5 * 3 + 2] = 0xFF;  // expert 1, row 5, column 2
                ec.set("w2_scale", DType::F8_E4M3, {4, 32, 3}, v);
              }),
              AllOf(HasSubstr("tensor 'w2_scale'"), HasSubstr("[1, 5, 2] is NaN"), HasSubstr("0xff")));
}

TEST_F(CaseFileErrors, MalformedNumbersInMetadata) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"top_k", "2x"},         {"top_k", " 2"},       {"top_k", ""},         {"top_k", "2.0"},
      {"top_k", "99999999999"}, {"n_group", "+1"},    {"topk_group", "one"}, {"routed_scaling_factor", "2.5f"},
      {"swiglu_alpha", "abc"}, {"swiglu_limit", "7 "}, {"swiglu_beta", "1e99"},
  };
  for (const auto& [key, value] : bad) {
    EXPECT_THAT(error_with([&](EditableCase& ec) { ec.meta[key] = value; }),
                AllOf(HasSubstr(path_), HasSubstr("metadata '" + key + "' = '" + value + "'"), HasSubstr("is not")))
        << key << " = '" << value << "'";
  }
  EXPECT_THAT(error_with([](EditableCase& ec) { ec.meta["apply_router_weight_on_input"] = "true"; }),
              AllOf(HasSubstr("metadata 'apply_router_weight_on_input' = 'true'"), HasSubstr("'0' or '1'")));
}

// Errors specific to precomputed routing.
class CaseFilePrecomputedErrors : public CaseFileErrors {
 protected:
  void SetUp() override {
    path_ = tmp_path();
    base_ = editable(make_random_case(small_problem(Activation::SwiGLU, RoutingMethod::Precomputed), 3, {.seed = 8}),
                     path_);
  }
};

TEST_F(CaseFilePrecomputedErrors, BaseCaseLoads) { EXPECT_EQ(error_with([](EditableCase&) {}), ""); }

TEST_F(CaseFilePrecomputedErrors, OutOfRangeIds) {
  for (int32_t bad : {4, 100, -1}) {
    EXPECT_THAT(error_with([&](EditableCase& ec) {
                  std::vector<int32_t> ids = ec.values<int32_t>("topk_ids");
                  ids[2 * 2 + 1] = bad;  // token 2, slot 1
                  ec.set("topk_ids", DType::I32, {3, 2}, ids);
                }),
                AllOf(HasSubstr("tensor 'topk_ids'"), HasSubstr("expert id " + std::to_string(bad) + " at [2, 1]"),
                      HasSubstr("out of range [0, E = 4)")));
  }
}

TEST_F(CaseFilePrecomputedErrors, MissingOrMisshapenIdsAndWeights) {
  EXPECT_THAT(error_with([](EditableCase& ec) { ec.erase("topk_ids"); }),
              AllOf(HasSubstr("missing tensor 'topk_ids'"), HasSubstr("precomputed")));
  EXPECT_THAT(error_with([](EditableCase& ec) { ec.erase("topk_weights"); }),
              HasSubstr("missing tensor 'topk_weights'"));
  EXPECT_THAT(error_with([](EditableCase& ec) {
                ec.set("topk_ids", DType::I32, {3, 3}, std::vector<int32_t>(9));
              }),
              AllOf(HasSubstr("tensor 'topk_ids'"), HasSubstr("expected shape [3, 2]"), HasSubstr("got [3, 3]")));
  EXPECT_THAT(error_with([](EditableCase& ec) {
                ec.set("topk_weights", DType::BF16, {3, 2}, std::vector<uint16_t>(6));
              }),
              AllOf(HasSubstr("tensor 'topk_weights'"), HasSubstr("expected dtype F32, got BF16")));
  // A logits file declared precomputed lacks the ids.
  EXPECT_THAT(error_with([](EditableCase& ec) {
                ec.erase("topk_ids");
                ec.set("router_logits", DType::F32, {3, 4}, std::vector<float>(12));
              }),
              HasSubstr("missing tensor 'topk_ids'"));
}

TEST(CaseFileSave, RejectsInconsistentCases) {
  MoeCase c = make_random_case(small_problem(), 3, {.seed = 9});
  c.w2_scale.pop_back();
  const std::string path = tmp_path();
  try {
    save_case(path, c);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("MoeCase.w2_scale"), HasSubstr("expected E*H*(I/16)")));
  }
  MoeCase d = make_random_case(small_problem(), 3, {.seed = 9});
  d.w13_input_scale.clear();  // required for w4a4
  EXPECT_THROW(save_case(path, d), Error);
}


// ---- MXFP4 -------------------------------------------------------------------------------------

MoeProblem mx_problem(Activation act = Activation::SwiGLUOai) {
  MoeProblem p = small_problem(act, RoutingMethod::Renormalize, ActQuant::W4A16);
  p.hidden = 64;
  p.inter = 96;
  p.weight_format = WeightFormat::MXFP4;
  return p;
}

TEST(CaseFileMxfp4, RoundTripWithU8ScalesAndNoGlobalScales) {
  for (Activation act : {Activation::SwiGLUOai, Activation::Relu2}) {
    MoeCase c = make_random_case(mx_problem(act), 6, {.seed = 31});
    add_random_expert_biases(c, 32);
    const int64_t rows = c.problem.w13_rows();
    ASSERT_EQ(c.w13_scale.size(), size_t(4 * rows * 64 / 32));
    ASSERT_EQ(c.w2_scale.size(), size_t(4 * 64 * 96 / 32));
    EXPECT_TRUE(c.w13_scale_2.empty() && c.w2_scale_2.empty() && c.w13_input_scale.empty() && c.w2_input_scale.empty());
    const std::string path = tmp_path();
    save_case(path, c);
    const SafetensorsFile f = SafetensorsFile::open(path);
    EXPECT_EQ(f.metadata().at("weight_format"), "mxfp4");
    EXPECT_EQ(f.tensor("w13_scale").dtype, DType::U8);
    EXPECT_EQ(f.tensor("w2_scale").shape, (std::vector<int64_t>{4, 64, 3}));
    EXPECT_FALSE(f.contains("w13_scale_2") || f.contains("w2_scale_2") || f.contains("w13_input_scale"));
    const MoeCase back = load_case(path);
    EXPECT_EQ(back.problem.weight_format, WeightFormat::MXFP4);
    expect_equal_cases(c, back);
    expect_same_bits(c.w13_bias, back.w13_bias, "w13_bias");
    expect_same_bits(c.w2_bias, back.w2_bias, "w2_bias");
  }
}

TEST(CaseFileMxfp4, Nvfp4FilesHaveNoFormatKeyAndLoadAsNvfp4) {
  const std::string path = tmp_path();
  save_case(path, make_random_case(small_problem(), 2, {.seed = 3}));
  EXPECT_EQ(SafetensorsFile::open(path).metadata().count("weight_format"), 0u);
  EXPECT_EQ(load_case(path).problem.weight_format, WeightFormat::NVFP4);
}

// make_random_case quantizes its normal weights with format::quantize_mxfp4: the dequantized weights are
// the kept fp32 weights to within half an e2m1 step of their block, and the codes are realistic.
TEST(CaseFileMxfp4, RandomCaseFollowsTheMxfp4Recipe) {
  const MoeProblem p = mx_problem();
  std::vector<float> w13, w2;
  const MoeCase c = make_random_case(p, 2, {.seed = 5}, &w13, &w2);
  std::vector<float> deq(w13.size());
  format::dequantize_mxfp4(c.w13.data(), c.w13_scale.data(), p.num_experts * p.w13_rows(), p.hidden, deq.data());
  for (size_t b = 0; b < c.w13_scale.size(); ++b) {
    float amax = 0;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(w13[b * 32 + i]));
    ASSERT_EQ(c.w13_scale[b], format::ue8m0_from_float(amax / 6.0f)) << "block " << b;
    const float step = format::ue8m0_to_float(c.w13_scale[b]);  // the largest e2m1 step (4 -> 6) is 2 * step
    for (int i = 0; i < 32; ++i) ASSERT_LE(std::fabs(deq[b * 32 + i] - w13[b * 32 + i]), step) << "block " << b;
  }
  const auto [lo, hi] = std::minmax_element(c.w2_scale.begin(), c.w2_scale.end());
  EXPECT_GE(*lo, 110);  // weights N(0, 0.02): block amax about 0.01..0.1
  EXPECT_LE(*hi, 125);
  EXPECT_THROW(make_random_case([] { MoeProblem q = mx_problem(); q.inter = 48; return q; }(), 1), Error);
}

class CaseFileMxfp4Errors : public ::testing::Test {
 protected:
  // E=4 H=64 I=96 k=2, swiglu_oai, renormalize, w4a16, mxfp4, T=3.
  void SetUp() override {
    path_ = tmp_path();
    base_ = editable(make_random_case(mx_problem(), 3, {.seed = 8}), path_);
  }
  std::string error_with(const std::function<void(EditableCase&)>& edit) {
    EditableCase ec = base_;
    edit(ec);
    return load_error(ec, path_);
  }
  std::string path_;
  EditableCase base_;
};

TEST_F(CaseFileMxfp4Errors, BaseCaseLoads) { EXPECT_EQ(error_with([](EditableCase&) {}), ""); }

TEST_F(CaseFileMxfp4Errors, UnknownFormatName) {
  EXPECT_THAT(error_with([](EditableCase& ec) { ec.meta["weight_format"] = "mxfp8"; }),
              AllOf(HasSubstr("metadata 'weight_format'"), HasSubstr("unknown name 'mxfp8'"), HasSubstr("nvfp4, mxfp4")));
}

TEST_F(CaseFileMxfp4Errors, ScalesMustBeU8OfBlocksOf32) {
  EXPECT_THAT(error_with([](EditableCase& ec) {
                ec.set("w13_scale", DType::F8_E4M3, {4, 192, 2}, ec.values<uint8_t>("w13_scale"));
              }),
              AllOf(HasSubstr("tensor 'w13_scale'"), HasSubstr("expected dtype U8")));
  EXPECT_THAT(error_with([](EditableCase& ec) {
                ec.set("w2_scale", DType::U8, {4, 64, 6}, std::vector<uint8_t>(4 * 64 * 6, 120));
              }),
              AllOf(HasSubstr("tensor 'w2_scale'"), HasSubstr("[4, 64, 3]"), HasSubstr("[E, H, I/32]")));
  // An NVFP4 file's scales read as MXFP4 (the key alone changed) do not fit.
  EXPECT_THAT(error_with([](EditableCase& ec) { ec.meta.erase("weight_format"); }),
              AllOf(HasSubstr("tensor 'w13_scale'"), HasSubstr("expected dtype F8_E4M3")));
}

TEST_F(CaseFileMxfp4Errors, NanCodeIsRefusedNamingExpertRowBlock) {
  EXPECT_THAT(error_with([](EditableCase& ec) {
                std::vector<uint8_t> v = ec.values<uint8_t>("w2_scale");
                v[2 * 64 * 3 + 17 * 3 + 1] = 255;  // expert 2, row 17, block 1
                ec.set("w2_scale", DType::U8, {4, 64, 3}, v);
              }),
              AllOf(HasSubstr("tensor 'w2_scale'"), HasSubstr("[2, 17, 1] (expert, row, block) is NaN (code 255)")));
}

TEST_F(CaseFileMxfp4Errors, GlobalAndInputScalesAreRefused) {
  for (const char* name : {"w13_scale_2", "w2_scale_2", "w13_input_scale", "w2_input_scale"})
    EXPECT_THAT(error_with([&](EditableCase& ec) { ec.set(name, DType::F32, {4}, std::vector<float>(4, 1.0f)); }),
                AllOf(HasSubstr("tensor '" + std::string(name) + "' is not part of an mxfp4 case"))) << name;
}

TEST_F(CaseFileMxfp4Errors, OnlyW4a16AndMultiplesOf32) {
  EXPECT_THAT(error_with([](EditableCase& ec) { ec.meta["act_quant"] = "w4a4_scalar"; }),
              HasSubstr("act_quant must be w4a16 with mxfp4 weights"));
  EXPECT_THAT(error_with([](EditableCase& ec) {  // H = 48: a multiple of 16, not of 32
                ec.set("hidden_states", DType::BF16, {3, 48}, std::vector<uint16_t>(3 * 48));
                ec.set("w13", DType::U8, {4, 192, 24}, std::vector<uint8_t>(4 * 192 * 24));
                ec.set("w2", DType::U8, {4, 48, 48}, std::vector<uint8_t>(4 * 48 * 48));
              }),
              HasSubstr("MoeProblem.hidden (H) must be a multiple of 32 with mxfp4 weights"));
}

TEST(CaseFileMxfp4Save, RejectsGlobalScalesAndNvfp4SizedScales) {
  const std::string path = tmp_path();
  MoeCase c = make_random_case(mx_problem(), 2, {.seed = 4});
  MoeCase d = c;
  d.w13_scale_2.assign(4, 1.0f);
  EXPECT_THAT([&] { save_case(path, d); }, ::testing::ThrowsMessage<Error>(HasSubstr("w13_scale_2 must be empty")));
  d = c;
  d.w2_scale.resize(4 * 64 * 6);
  EXPECT_THAT([&] { save_case(path, d); }, ::testing::ThrowsMessage<Error>(HasSubstr("E*H*(I/32)")));
}

}  // namespace
}  // namespace fp4moe::io
