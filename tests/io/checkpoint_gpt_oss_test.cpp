// tests/io/checkpoint_gpt_oss_test.cpp — gpt-oss checkpoints (MXFP4, the published Hugging Face
// layout): the fixture loads as exactly its canonical layer (de-interleaved gate/up rows and bias,
// ue8m0 scales, biases, router and its bias); the loaded weights decode like the published
// dequantization of the file's blocks; the layer computed independently in fp32 from the file's
// values (gpt-oss's own formulas) agrees with the reference on the loaded layer; expert- and
// tensor-parallel slices; config parsing; and every broken input fails naming file and tensor.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>

#include "fp4moe/checkpoint.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/reference.hpp"
#include "fp4moe/safetensors.hpp"
#include "fp4moe/weight_layout.hpp"
#include "test_dir.hpp"

namespace fp4moe::io {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

std::string fresh_dir(const std::string& name) { return test::fresh_dir("ckpt_gpt_oss", name); }

FixtureOptions gpt_oss_options(int shards = 3) {
  FixtureOptions o;
  o.format = CheckpointFormat::Mxfp4;
  o.family = ModelFamily::GptOss;
  o.num_layers = 2;
  o.num_experts = 8;
  o.hidden = 96;  // H != I: a transposed or swapped tensor cannot pass
  o.inter = 64;
  o.top_k = 3;
  o.num_shards = shards;
  o.seed = 21;
  return o;
}

void expect_same_layer(const MoeLayerWeights& got, const MoeLayerWeights& want) {
  EXPECT_EQ(got.problem.describe(), want.problem.describe());
  EXPECT_EQ(got.total_experts, want.total_experts);
  EXPECT_EQ(got.expert_begin, want.expert_begin);
  EXPECT_EQ(got.expert_end, want.expert_end);
  EXPECT_EQ(got.w13, want.w13);
  EXPECT_EQ(got.w13_scale, want.w13_scale);
  EXPECT_EQ(got.w2, want.w2);
  EXPECT_EQ(got.w2_scale, want.w2_scale);
  EXPECT_EQ(got.w13_bias, want.w13_bias);
  EXPECT_EQ(got.w2_bias, want.w2_bias);
  EXPECT_EQ(got.router_weight, want.router_weight);
  EXPECT_EQ(got.router_bias, want.router_bias);
  EXPECT_TRUE(got.routing_bias.empty());
  EXPECT_TRUE(got.w13_scale_2.empty() && got.w2_scale_2.empty() && got.w13_input_scale.empty() &&
              got.w2_input_scale.empty());
}

// The file's tensor as bytes / as floats (bf16 widened).
std::vector<uint8_t> file_bytes(const Checkpoint& ck, const std::string& name) {
  const std::string file = ck.dir() + "/" + ck.weight_map().at(name);
  const SafetensorsFile f = SafetensorsFile::open(file);
  const auto* p = reinterpret_cast<const uint8_t*>(f.tensor(name).data.data());
  return std::vector<uint8_t>(p, p + f.tensor(name).data.size());
}
std::vector<float> file_floats(const Checkpoint& ck, const std::string& name) {
  const std::vector<uint8_t> b = file_bytes(ck, name);
  std::vector<float> v(b.size() / 2);
  for (size_t i = 0; i < v.size(); ++i) v[i] = format::bf16_to_float(uint16_t(b[2 * i] | (b[2 * i + 1] << 8)));
  return v;
}

// The published dequantization (transformers' convert_moe_packed_tensors, gpt-oss's weights.py):
// blocks [.., G, 16] and scales [.., G]; out[.., 32 g + 2 j] = lut[lo nibble of byte j], out[.., 32 g +
// 2 j + 1] = lut[hi nibble], times 2^(scale - 127). Row `row` of a tensor of `cols` input features.
std::vector<float> published_row(const std::vector<uint8_t>& blocks, const std::vector<uint8_t>& scales, int64_t row,
                                 int64_t cols) {
  static const float lut[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  std::vector<float> out(cols);
  const int64_t G = cols / 32;
  for (int64_t g = 0; g < G; ++g) {
    const int exp = int(scales[row * G + g]) - 127;
    for (int64_t j = 0; j < 16; ++j) {
      const uint8_t b = blocks[(row * G + g) * 16 + j];
      out[32 * g + 2 * j] = std::ldexp(lut[b & 0x0F], exp);
      out[32 * g + 2 * j + 1] = std::ldexp(lut[b >> 4], exp);
    }
  }
  return out;
}

TEST(GptOssCheckpoint, LoadsAsTheCanonicalLayer) {
  for (int shards : {1, 3}) {
    SCOPED_TRACE(shards);
    const FixtureOptions o = gpt_oss_options(shards);
    const std::string dir = fresh_dir("loads_" + std::to_string(shards));
    const Fixture fx = write_fixture(dir, o);
    ASSERT_EQ(fx.layers.size(), 2u);  // every layer is a MoE layer
    const Checkpoint ck = Checkpoint::open(dir);
    const CheckpointConfig& c = ck.config();
    EXPECT_EQ(c.format, CheckpointFormat::Mxfp4);
    EXPECT_EQ(c.family, ModelFamily::GptOss);
    EXPECT_EQ(c.model_type, "gpt_oss");
    const MoeProblem& p = c.problem;
    EXPECT_EQ(p.weight_format, WeightFormat::MXFP4);
    EXPECT_EQ(p.act_quant, ActQuant::W4A16);
    EXPECT_EQ(p.routing.method, RoutingMethod::Renormalize);
    EXPECT_EQ(p.top_k(), 3);
    EXPECT_EQ(p.activation.kind, Activation::SwiGLUOai);
    EXPECT_EQ(p.activation.swiglu_alpha, 1.702f);
    EXPECT_EQ(p.activation.swiglu_beta, 1.0f);
    EXPECT_EQ(p.activation.swiglu_limit, 7.0f);
    EXPECT_EQ(p.num_experts, 8);
    EXPECT_EQ(p.hidden, 96);
    EXPECT_EQ(p.inter, 64);
    EXPECT_EQ(ck.layer_prefix(1), "model.layers.1.mlp");
    for (const auto& [L, want] : fx.layers) {
      SCOPED_TRACE(L);
      const MoeLayerWeights got = ck.load_layer(L);
      expect_same_layer(got, want);
      EXPECT_EQ(got.w13_scale.size(), size_t(8 * 128 * 3));  // [E, 2I, H/32]
      EXPECT_EQ(got.w2_scale.size(), size_t(8 * 96 * 2));    // [E, H, I/32]
    }
  }
}

// Independently of the fixture writer: the loaded layer's row i of gate is the file's row 2i, row I + i
// (up) the file's row 2i + 1, and each decodes (format::dequantize_mxfp4) to the published
// dequantization of that file row; the same for down; the biases and the router bias as stored.
TEST(GptOssCheckpoint, LoadedRowsDecodeLikeThePublishedDequantization) {
  const FixtureOptions o = gpt_oss_options();
  const std::string dir = fresh_dir("decode");
  write_fixture(dir, o);
  const Checkpoint ck = Checkpoint::open(dir);
  const MoeLayerWeights w = ck.load_layer(1);
  const int64_t E = 8, H = 96, I = 64;
  const std::string ex = "model.layers.1.mlp.experts.";
  const std::vector<uint8_t> b13 = file_bytes(ck, ex + "gate_up_proj_blocks"), s13 = file_bytes(ck, ex + "gate_up_proj_scales");
  const std::vector<uint8_t> b2 = file_bytes(ck, ex + "down_proj_blocks"), s2 = file_bytes(ck, ex + "down_proj_scales");
  const std::vector<float> bias13 = file_floats(ck, ex + "gate_up_proj_bias"), bias2 = file_floats(ck, ex + "down_proj_bias");
  std::vector<float> w13(size_t(E * 2 * I * H)), w2(size_t(E * H * I));
  format::dequantize_mxfp4(w.w13.data(), w.w13_scale.data(), E * 2 * I, H, w13.data());
  format::dequantize_mxfp4(w.w2.data(), w.w2_scale.data(), E * H, I, w2.data());
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t i = 0; i < I; ++i) {
      const std::vector<float> gate = published_row(b13, s13, e * 2 * I + 2 * i, H);
      const std::vector<float> up = published_row(b13, s13, e * 2 * I + 2 * i + 1, H);
      ASSERT_TRUE(std::equal(gate.begin(), gate.end(), w13.begin() + (e * 2 * I + i) * H)) << e << " " << i;
      ASSERT_TRUE(std::equal(up.begin(), up.end(), w13.begin() + (e * 2 * I + I + i) * H)) << e << " " << i;
      EXPECT_EQ(w.w13_bias[e * 2 * I + i], bias13[e * 2 * I + 2 * i]);
      EXPECT_EQ(w.w13_bias[e * 2 * I + I + i], bias13[e * 2 * I + 2 * i + 1]);
    }
    for (int64_t h = 0; h < H; ++h) {
      const std::vector<float> down = published_row(b2, s2, e * H + h, I);
      ASSERT_TRUE(std::equal(down.begin(), down.end(), w2.begin() + (e * H + h) * I)) << e << " " << h;
    }
  }
  EXPECT_EQ(w.w2_bias, bias2);
  EXPECT_EQ(w.router_bias, file_floats(ck, "model.layers.1.mlp.router.bias"));
  // The router logits are x . W^T + b.
  const std::vector<uint16_t> x = random_hidden_states(2, H, 4);
  const std::vector<float> logits = w.router_logits(x.data(), 2);
  MoeLayerWeights no_bias = w;
  no_bias.router_bias.clear();
  const std::vector<float> plain = no_bias.router_logits(x.data(), 2);
  for (int64_t t = 0; t < 2; ++t)
    for (int64_t e = 0; e < E; ++e) EXPECT_EQ(logits[t * E + e], plain[t * E + e] + w.router_bias[e]);
}

// gpt-oss's MLP block written out here in fp32 from the file's values (transformers' GptOssMLP /
// GptOssExperts: router linear with bias, top-k, softmax over the k; gate_up = x W^T + b with gate the
// even and up the odd columns; gate clamped above, up on both sides at swiglu_limit; (up + 1) * gate *
// sigmoid(1.702 gate); down with its bias; weighted sum), against the reference on the loaded layer.
// The reference rounds the activation and the output to bf16 (w4a16): agreement to 2 % of the
// output's largest magnitude.
TEST(GptOssCheckpoint, LayerAgreesWithTheModelsOwnFormulas) {
  const FixtureOptions o = gpt_oss_options();
  const std::string dir = fresh_dir("formulas");
  write_fixture(dir, o);
  const Checkpoint ck = Checkpoint::open(dir);
  const MoeLayerWeights w = ck.load_layer(0);
  const int64_t E = 8, H = 96, I = 64, T = 5, k = 3;
  const float limit = 7.0f;
  const std::string ex = "model.layers.0.mlp.experts.";
  const std::vector<uint8_t> b13 = file_bytes(ck, ex + "gate_up_proj_blocks"), s13 = file_bytes(ck, ex + "gate_up_proj_scales");
  const std::vector<uint8_t> b2 = file_bytes(ck, ex + "down_proj_blocks"), s2 = file_bytes(ck, ex + "down_proj_scales");
  const std::vector<float> bias13 = file_floats(ck, ex + "gate_up_proj_bias"), bias2 = file_floats(ck, ex + "down_proj_bias");
  const std::vector<float> router = file_floats(ck, "model.layers.0.mlp.router.weight");
  const std::vector<float> rbias = file_floats(ck, "model.layers.0.mlp.router.bias");
  // Larger inputs than N(0, 1) so that the clamps at the limit are exercised.
  std::vector<uint16_t> x = random_hidden_states(T, H, 8);
  for (auto& v : x) v = format::bf16_from_float(format::bf16_to_float(v) * 4.0f);

  std::vector<float> want(size_t(T * H), 0.0f);
  int clamped = 0;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<float> xt(H);
    for (int64_t h = 0; h < H; ++h) xt[h] = format::bf16_to_float(x[t * H + h]);
    std::vector<std::pair<float, int64_t>> logit(E);
    for (int64_t e = 0; e < E; ++e) {
      double acc = rbias[e];
      for (int64_t h = 0; h < H; ++h) acc += double(xt[h]) * router[e * H + h];
      logit[e] = {float(acc), e};
    }
    std::sort(logit.begin(), logit.end(), [](auto a, auto b) { return a.first > b.first || (a.first == b.first && a.second < b.second); });
    double denom = 0;
    for (int64_t j = 0; j < k; ++j) denom += std::exp(double(logit[j].first - logit[0].first));
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = logit[j].second;
      const double weight = std::exp(double(logit[j].first - logit[0].first)) / denom;
      std::vector<float> act(I);
      for (int64_t i = 0; i < I; ++i) {
        double gu[2];
        for (int half = 0; half < 2; ++half) {
          const int64_t row = e * 2 * I + 2 * i + half;  // interleaved: even gate, odd up
          const std::vector<float> wr = published_row(b13, s13, row, H);
          double acc = bias13[row];
          for (int64_t h = 0; h < H; ++h) acc += double(xt[h]) * wr[h];
          gu[half] = acc;
        }
        clamped += gu[0] > limit || std::fabs(gu[1]) > limit;
        const double g = std::min(gu[0], double(limit)), u = std::clamp(gu[1], -double(limit), double(limit));
        act[i] = float((u + 1.0) * g / (1.0 + std::exp(-1.702 * g)));
      }
      for (int64_t h = 0; h < H; ++h) {
        const std::vector<float> wr = published_row(b2, s2, e * H + h, I);
        double acc = bias2[e * H + h];
        for (int64_t i = 0; i < I; ++i) acc += double(act[i]) * wr[i];
        want[t * H + h] += float(weight * acc);
      }
    }
  }
  EXPECT_GT(clamped, 0) << "the inputs should reach the swiglu limit";
  const MoeCase c = w.to_case(x, T);
  const reference::MoeResult r = reference::moe_forward(c.problem, T, c.hidden_states.data(), c.router(), c.weights());
  float peak = 0;
  for (float v : want) peak = std::max(peak, std::fabs(v));
  ASSERT_GT(peak, 0.0f);
  for (int64_t i = 0; i < T * H; ++i)
    ASSERT_NEAR(format::bf16_to_float(r.output[i]), want[i], 0.02f * peak) << "element " << i;
}

TEST(GptOssCheckpoint, ExpertAndTensorParallelSlices) {
  const FixtureOptions o = gpt_oss_options();
  const std::string dir = fresh_dir("slices");
  write_fixture(dir, o);
  const Checkpoint ck = Checkpoint::open(dir);
  const MoeLayerWeights full = ck.load_layer(1);
  MoeProblem local = full.problem;
  for (int er = 0; er < 2; ++er)
    for (int tr = 0; tr < 2; ++tr) {
      SCOPED_TRACE(testing::Message() << "ep " << er << " tp " << tr);
      LoadOptions lo;
      lo.ep_rank = er;
      lo.ep_size = 2;
      lo.tp_rank = tr;
      lo.tp_size = 2;  // I = 64: two blocks of 32
      const MoeLayerWeights s = ck.load_layer(1, lo);
      EXPECT_EQ(s.expert_begin, 4 * er);
      EXPECT_EQ(s.inter_begin, 32 * tr);
      EXPECT_EQ(s.problem.inter, 32);
      EXPECT_EQ(s.problem.num_experts, 4);
      const TensorParallelShard want = tensor_parallel_shard(local, full.weights(), tr, 2);
      const int64_t H = 96, Ir = 32;
      auto experts = [&](const auto& v, int64_t per_expert) {
        return std::vector<typename std::decay_t<decltype(v)>::value_type>(v.begin() + 4 * er * per_expert,
                                                                           v.begin() + (4 * er + 4) * per_expert);
      };
      EXPECT_EQ(s.w13, experts(want.w13, 2 * Ir * H / 2));
      EXPECT_EQ(s.w13_scale, experts(want.w13_scale, 2 * Ir * H / 32));
      EXPECT_EQ(s.w2, experts(want.w2, H * Ir / 2));
      EXPECT_EQ(s.w2_scale, experts(want.w2_scale, H * Ir / 32));
      EXPECT_EQ(s.w13_bias, experts(want.w13_bias, 2 * Ir));
      if (tr == 0)
        EXPECT_EQ(s.w2_bias, experts(want.w2_bias, H));
      else
        EXPECT_TRUE(s.w2_bias.empty());
      EXPECT_EQ(s.router_weight, full.router_weight);
      EXPECT_EQ(s.router_bias, full.router_bias);
    }
  LoadOptions bad;
  bad.tp_size = 3;
  EXPECT_THAT([&] { ck.load_layer(1, bad); }, ::testing::ThrowsMessage<Error>(HasSubstr("blocks of 32")));
}

// ---- config ----------------------------------------------------------------------------------------
const char* kConfig = R"({"model_type":"gpt_oss","num_hidden_layers":24,"hidden_size":2880,"intermediate_size":2880,
  "num_local_experts":32,"num_experts_per_tok":4,"experts_per_token":4,"hidden_act":"silu","swiglu_limit":7.0,
  "quantization_config":{"quant_method":"mxfp4","modules_to_not_convert":["model.layers.*.self_attn",
  "model.layers.*.mlp.router","model.embed_tokens","lm_head"]}})";

TEST(GptOssConfig, PublishedConfigGivesTheGptOss20bProblem) {
  const CheckpointConfig c = parse_checkpoint_config(kConfig, "", "D");
  EXPECT_EQ(c.problem.describe(), "E=32 H=2880 I=2880 k=4 routing=renormalize act=swiglu_oai(alpha=1.702,beta=1,limit=7) "
                                  "quant=w4a16 weights=mxfp4");
  EXPECT_EQ(c.num_layers, 24);
  for (int64_t L = 0; L < 24; ++L) EXPECT_TRUE(c.is_moe_layer(L));
  EXPECT_EQ(c.excluded_modules.size(), 4u);
  std::string other = kConfig;
  other.replace(other.find("\"swiglu_limit\":7.0"), 18, "\"swiglu_limit\":5.5");
  EXPECT_EQ(parse_checkpoint_config(other, "", "D").problem.activation.swiglu_limit, 5.5f);
}

TEST(GptOssConfig, ErrorsNameTheFileAndKey) {
  auto throws = [](std::string c, const std::vector<std::string>& parts) {
    try {
      parse_checkpoint_config(c, "", "D");
      ADD_FAILURE() << "no error for " << c;
    } catch (const Error& e) {
      for (const auto& part : parts) EXPECT_THAT(e.what(), HasSubstr(part));
    }
  };
  auto edit = [](const std::string& from, const std::string& to) {
    std::string s = kConfig;
    s.replace(s.find(from), from.size(), to);
    return s;
  };
  throws(edit("\"model_type\":\"gpt_oss\"", "\"model_type\":\"mixtral\""),
         {"D/config.json", "quant_method \"mxfp4\" is loaded for model_type \"gpt_oss\" only", "mixtral"});
  throws(edit("\"quant_method\":\"mxfp4\"", "\"quant_method\":\"bnb\""), {"D/config.json", "quant_method", "bnb"});
  throws(edit("\"swiglu_limit\":7.0", "\"swiglu_limit\":-1"), {"D/config.json", "swiglu_limit"});
  throws(edit("\"intermediate_size\":2880", "\"intermediate_size\":2896"), {"D/config.json", "32", "2896"});
  try {  // gpt_oss described as NVFP4 ModelOpt: not its layout
    const std::string s = kConfig;
    const size_t q = s.find(",\"swiglu_limit\"");
    ASSERT_NE(q, std::string::npos);
    parse_checkpoint_config(s.substr(0, q) + "}", R"({"quantization":{"quant_algo":"NVFP4"}})", "D");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("model_type \"gpt_oss\" is loaded from its MXFP4 layout only"),
                                HasSubstr("modelopt")));
  }
}

// ---- broken files ----------------------------------------------------------------------------------
void rewrite(const std::string& path, const std::function<void(std::vector<TensorData>&)>& edit) {
  std::vector<TensorData> ts;
  {
    const SafetensorsFile f = SafetensorsFile::open(path);
    for (const auto& [name, t] : f.tensors()) {
      TensorData d{name, t.dtype, t.shape, {}};
      d.bytes.assign(t.data.begin(), t.data.end());
      ts.push_back(std::move(d));
    }
  }
  edit(ts);
  write_safetensors(path, ts, {{"format", "pt"}});
}

TensorData& find(std::vector<TensorData>& ts, const std::string& name) {
  for (auto& t : ts)
    if (t.name == name) return t;
  throw Error("test: no tensor " + name);
}

const std::string kExperts = "model.layers.1.mlp.experts.";

std::string single_file(const std::string& name, const std::function<void(std::vector<TensorData>&)>& edit) {
  const std::string dir = fresh_dir(name);
  write_fixture(dir, gpt_oss_options(1));
  rewrite(dir + "/model.safetensors", edit);
  return dir;
}

void expect_load_error(const std::string& dir, const std::vector<std::string>& parts) {
  try {
    Checkpoint::open(dir).load_layer(1);
    ADD_FAILURE() << "no error for " << dir;
  } catch (const Error& e) {
    for (const auto& part : parts) EXPECT_THAT(e.what(), HasSubstr(part));
  }
}

TEST(GptOssBadInput, WrongDtypeShapeMissingTensorAndNanScale) {
  const std::string file = "/model.safetensors";
  std::string d = single_file("dtype", [](auto& ts) { find(ts, kExperts + "gate_up_proj_scales").dtype = DType::F8_E4M3; });
  expect_load_error(d, {d + file, kExperts + "gate_up_proj_scales", "expected dtype U8, got F8_E4M3"});
  d = single_file("bias_dtype", [](auto& ts) {
    TensorData& t = find(ts, kExperts + "down_proj_bias");
    t.dtype = DType::U8;
    t.shape.back() *= 2;
  });
  expect_load_error(d, {d + file, kExperts + "down_proj_bias", "expected dtype BF16 or F32, got U8"});
  d = single_file("shape", [](auto& ts) {
    TensorData& t = find(ts, kExperts + "down_proj_blocks");
    t.shape = {8, 96, 4, 8};  // the same bytes, blocks of 16 codes
  });
  expect_load_error(d, {d + file, kExperts + "down_proj_blocks", "expected shape [8, 96, 2, 16]", "got [8, 96, 4, 8]"});
  d = single_file("transposed", [](auto& ts) {
    TensorData& t = find(ts, kExperts + "gate_up_proj_bias");
    t.shape = {128, 8};
  });
  expect_load_error(d, {kExperts + "gate_up_proj_bias", "expected shape [8, 128]", "got [128, 8]"});
  for (const char* name : {"router.bias", "router.weight", "experts.down_proj_scales", "experts.gate_up_proj_blocks"}) {
    SCOPED_TRACE(name);
    const std::string tensor = std::string("model.layers.1.mlp.") + name;
    d = single_file(std::string("missing_") + name,
                    [&](auto& ts) { std::erase_if(ts, [&](const TensorData& t) { return t.name == tensor; }); });
    expect_load_error(d, {d, "missing tensor '" + tensor + "'"});
  }
  // ue8m0 code 255 (NaN): expert 5, row 7, block 1 of down_proj_scales [8, 96, 2].
  d = single_file("nan_scale", [](auto& ts) {
    find(ts, kExperts + "down_proj_scales").bytes[(5 * 96 + 7) * 2 + 1] = std::byte{0xFF};
  });
  expect_load_error(d, {d + file, kExperts + "down_proj_scales", "expert 5 row 7 block 1", "code 255"});
  // A non-finite bias (bf16 inf).
  d = single_file("inf_bias", [](auto& ts) {
    TensorData& t = find(ts, kExperts + "gate_up_proj_bias");
    t.bytes[6] = std::byte{0x80};
    t.bytes[7] = std::byte{0x7F};
  });
  expect_load_error(d, {kExperts + "gate_up_proj_bias", "element 3 is not finite"});
  // An expert-parallel rank checks the scales of its own experts.
  d = single_file("nan_scale_rank", [](auto& ts) { find(ts, kExperts + "gate_up_proj_scales").bytes[0] = std::byte{0xFF}; });
  LoadOptions upper;
  upper.ep_rank = 1;
  upper.ep_size = 2;
  EXPECT_EQ(Checkpoint::open(d).load_layer(1, upper).expert_begin, 4);
  expect_load_error(d, {kExperts + "gate_up_proj_scales", "expert 0 row 0 block 0", "code 255"});
}

TEST(GptOssBadInput, ExpertsLeftUnconvertedAreRefused) {
  for (const std::string pattern : {"model.layers.*.mlp", "model.layers.1.mlp.experts"}) {
    SCOPED_TRACE(pattern);
    FixtureOptions o = gpt_oss_options(2);
    o.excluded_modules = {pattern};
    const std::string dir = fresh_dir("unconverted");
    write_fixture(dir, o);
    expect_load_error(dir, {dir, "layer 1", "excluded from quantization by '" + pattern + "'", "modules_to_not_convert",
                            "MXFP4 experts only"});
  }
  FixtureOptions o = gpt_oss_options(2);
  o.excluded_modules = {"model.layers.0.mlp.experts"};  // another layer's experts
  const std::string dir = fresh_dir("unconverted_other");
  const Fixture fx = write_fixture(dir, o);
  expect_same_layer(Checkpoint::open(dir).load_layer(1), fx.layers.at(1));
}

}  // namespace
}  // namespace fp4moe::io
