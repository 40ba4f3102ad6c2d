// tests/io/checkpoint_test.cpp — checkpoint loading: fixtures of both formats and all four namings load
// bit-exactly, w1/w3 scale fusion, expert-parallel slicing, config parsing, and every bad input with its
// message (file and tensor named).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
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

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::HasSubstr;

std::string fresh_dir(const std::string& name) { return test::fresh_dir("ckpt", name); }

void expect_same_layer(const MoeLayerWeights& got, const MoeLayerWeights& want) {
  EXPECT_EQ(got.problem.describe(), want.problem.describe());
  EXPECT_EQ(got.total_experts, want.total_experts);
  EXPECT_EQ(got.expert_begin, want.expert_begin);
  EXPECT_EQ(got.expert_end, want.expert_end);
  EXPECT_EQ(got.w13, want.w13);
  EXPECT_EQ(got.w13_scale, want.w13_scale);
  EXPECT_EQ(got.w13_scale_2, want.w13_scale_2);
  EXPECT_EQ(got.w13_input_scale, want.w13_input_scale);
  EXPECT_EQ(got.w2, want.w2);
  EXPECT_EQ(got.w2_scale, want.w2_scale);
  EXPECT_EQ(got.w2_scale_2, want.w2_scale_2);
  EXPECT_EQ(got.w13_input_scale_max, want.w13_input_scale_max);
  EXPECT_EQ(got.w2_input_scale, want.w2_input_scale);
  EXPECT_EQ(got.router_weight, want.router_weight);
  EXPECT_EQ(got.routing_bias, want.routing_bias);
}

struct Param {
  CheckpointFormat format;
  ModelFamily family;
  int shards;
};

class FixtureLoads : public ::testing::TestWithParam<Param> {};

TEST_P(FixtureLoads, EqualsTheLayerBuiltFromTheSameWeights) {
  const Param p = GetParam();
  FixtureOptions o;
  o.format = p.format;
  o.family = p.family;
  o.num_shards = p.shards;
  o.num_layers = 3;
  o.seed = 11 + static_cast<int>(p.family);
  const std::string dir = fresh_dir(std::string(to_string(p.family)) + "_" + std::string(to_string(p.format)));
  const Fixture fx = write_fixture(dir, o);
  ASSERT_FALSE(fx.layers.empty());
  const Checkpoint ck = Checkpoint::open(dir);
  EXPECT_EQ(ck.config().format, p.format);
  EXPECT_EQ(ck.config().family, p.family);
  for (const auto& [L, want] : fx.layers) {
    SCOPED_TRACE(L);
    const MoeLayerWeights got = ck.load_layer(L);
    expect_same_layer(got, want);
    EXPECT_EQ(got.fusion.experts_rescaled, 0);
    // The case built from the loaded layer runs like the one built from the fixture's weights.
    const std::vector<uint16_t> x = random_hidden_states(7, o.hidden, 3);
    const MoeCase a = got.to_case(x, 7), b = want.to_case(x, 7);
    const auto ra = reference::moe_forward(a.problem, 7, a.hidden_states.data(), a.router(), a.weights());
    const auto rb = reference::moe_forward(b.problem, 7, b.hidden_states.data(), b.router(), b.weights());
    EXPECT_EQ(ra.output, rb.output);
    EXPECT_EQ(ra.topk_ids, rb.topk_ids);
  }
  if (p.family == ModelFamily::DeepSeekV3) {
    EXPECT_FALSE(ck.config().is_moe_layer(0));
    EXPECT_THAT([&] { ck.load_layer(0); },
                ::testing::ThrowsMessage<Error>(AllOf(HasSubstr("layer 0 is dense"), HasSubstr("first_k_dense_replace"))));
  }
  EXPECT_THAT([&] { ck.load_layer(3); }, ::testing::ThrowsMessage<Error>(HasSubstr("out of range")));
}

INSTANTIATE_TEST_SUITE_P(
    AllFormatsAndNamings, FixtureLoads,
    ::testing::Values(Param{CheckpointFormat::ModelOpt, ModelFamily::DeepSeekV3, 3},
                      Param{CheckpointFormat::ModelOpt, ModelFamily::Qwen3Moe, 1},
                      Param{CheckpointFormat::ModelOpt, ModelFamily::Llama4, 2},
                      Param{CheckpointFormat::ModelOpt, ModelFamily::Mixtral, 2},
                      Param{CheckpointFormat::CompressedTensors, ModelFamily::DeepSeekV3, 2},
                      Param{CheckpointFormat::CompressedTensors, ModelFamily::Qwen3Moe, 2},
                      Param{CheckpointFormat::CompressedTensors, ModelFamily::Llama4, 1},
                      Param{CheckpointFormat::CompressedTensors, ModelFamily::Mixtral, 3}));

TEST(Checkpoint, ConfigToProblem) {
  const std::string dir = fresh_dir("config_problem");
  FixtureOptions o;
  o.family = ModelFamily::Llama4;
  o.llama4_language_model_prefix = false;
  write_fixture(dir, o);
  const Checkpoint ck = Checkpoint::open(dir);
  const MoeProblem& p = ck.config().problem;
  EXPECT_EQ(p.routing.method, RoutingMethod::Llama4);
  EXPECT_TRUE(p.routing.apply_router_weight_on_input);
  EXPECT_EQ(p.top_k(), 1);
  EXPECT_EQ(ck.layer_prefix(1), "model.layers.1.feed_forward");
  const MoeLayerWeights w = ck.load_layer(1);
  EXPECT_EQ(w.problem.num_experts, 8);

  const CheckpointConfig q = parse_checkpoint_config(
      R"({"model_type":"qwen3_moe","num_hidden_layers":4,"hidden_size":64,"num_experts":16,
          "moe_intermediate_size":32,"num_experts_per_tok":4,"norm_topk_prob":false,"decoder_sparse_step":2,
          "mlp_only_layers":[3]})",
      R"({"quantization":{"quant_algo":"NVFP4","group_size":16}})", "q");
  EXPECT_EQ(q.problem.routing.method, RoutingMethod::Default);
  EXPECT_EQ(q.problem.act_quant, ActQuant::W4A4Scalar);
  EXPECT_FALSE(q.is_moe_layer(0));
  EXPECT_TRUE(q.is_moe_layer(1));
  EXPECT_FALSE(q.is_moe_layer(3));  // mlp_only_layers
  const CheckpointConfig wo = parse_checkpoint_config(
      R"({"model_type":"mixtral","num_hidden_layers":1,"hidden_size":64,"num_local_experts":4,
          "intermediate_size":32,"num_experts_per_tok":2,
          "quantization_config":{"quant_method":"compressed-tensors","format":"nvfp4-pack-quantized",
            "config_groups":{"g":{"weights":{"num_bits":4,"type":"float","group_size":16}}}}})",
      "", "m");
  EXPECT_EQ(wo.format, CheckpointFormat::CompressedTensors);
  EXPECT_EQ(wo.problem.act_quant, ActQuant::W4A16);
  EXPECT_EQ(wo.problem.routing.method, RoutingMethod::Renormalize);
}

TEST(Checkpoint, ConfigErrorsNameTheFileAndKey) {
  const std::string cfg =
      R"({"model_type":"mixtral","num_hidden_layers":1,"hidden_size":64,"num_local_experts":4,"intermediate_size":32,"num_experts_per_tok":2})";
  auto throws = [](const std::string& c, const std::string& q, const std::vector<std::string>& parts) {
    try {
      parse_checkpoint_config(c, q, "D");
      ADD_FAILURE() << "no error for " << c << " / " << q;
    } catch (const Error& e) {
      for (const auto& part : parts) EXPECT_THAT(e.what(), HasSubstr(part));
    }
  };
  throws(cfg, R"({"quantization":{"quant_algo":"FP8"}})", {"D/hf_quant_config.json", "quant_algo", "FP8"});
  throws(cfg, R"({"quantization":{"quant_algo":"NVFP4","group_size":32}})", {"group_size", "32"});
  throws(cfg, R"({"quantization":)", {"D/hf_quant_config.json", "invalid JSON"});
  throws(cfg, "", {"no quantization description"});
  throws(R"({"model_type":"gpt2"})", R"({"quantization":{"quant_algo":"NVFP4"}})", {"'model_type'", "model type 'gpt2' is not a supported MoE model", "kimi_k2", "qwen3_next"});
  throws(R"({"model_type":"mixtral","num_hidden_layers":1,"hidden_size":"64"})",
         R"({"quantization":{"quant_algo":"NVFP4"}})", {"D/config.json", "hidden_size", "must be an integer"});
  throws(R"({"model_type":"mixtral","num_hidden_layers":1,"hidden_size":60,"num_local_experts":4,"intermediate_size":32,"num_experts_per_tok":2})",
         R"({"quantization":{"quant_algo":"NVFP4"}})", {"D/config.json", "hidden"});
  throws(std::string(100, '[') + std::string(100, ']'), "", {"nested deeper"});
  throws("{\"model_type\":\"mix\xff\"}", R"({"quantization":{"quant_algo":"NVFP4"}})", {"D/config.json", "invalid JSON"});
  throws(R"({"model_type":"mixtral","num_hidden_layers":1,"hidden_size":64,"num_local_experts":4,"intermediate_size":32,
            "num_experts_per_tok":2,"quantization_config":{"quant_method":"compressed-tensors","config_groups":
            {"g":{"format":"nvfp4-pack-quantized","weights":{"num_bits":8,"type":"float","group_size":16}}}}})",
         "", {"num_bits", "must be 4"});
}

// Reads every tensor of a safetensors file, lets `edit` change the list, writes it back.
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

void set_f32(TensorData& t, float v) { std::memcpy(t.bytes.data(), &v, 4); }

std::string single_shard_fixture(const std::string& name, CheckpointFormat format = CheckpointFormat::ModelOpt) {
  const std::string dir = fresh_dir(name);
  FixtureOptions o;
  o.format = format;
  o.family = ModelFamily::Qwen3Moe;
  o.num_shards = 1;
  write_fixture(dir, o);
  return dir;
}

void expect_load_error(const std::string& dir, const std::vector<std::string>& parts) {
  try {
    const Checkpoint ck = Checkpoint::open(dir);
    ck.load_layer(1);
    ADD_FAILURE() << "no error for " << dir;
  } catch (const Error& e) {
    for (const auto& part : parts) EXPECT_THAT(e.what(), HasSubstr(part));
  }
}

const std::string kExpert = "model.layers.1.mlp.experts.3.";

TEST(CheckpointBadInput, MissingInputScaleIsAnErrorNeverZero) {
  const std::string dir = single_shard_fixture("missing_input_scale");
  rewrite(dir + "/model.safetensors", [](auto& ts) {
    std::erase_if(ts, [](const TensorData& t) { return t.name == kExpert + "up_proj.input_scale"; });
  });
  expect_load_error(dir, {dir, "missing tensor", kExpert + "up_proj.input_scale"});
  const std::string ct = single_shard_fixture("missing_input_global_scale", CheckpointFormat::CompressedTensors);
  rewrite(ct + "/model.safetensors", [](auto& ts) {
    std::erase_if(ts, [](const TensorData& t) { return t.name == kExpert + "down_proj.input_global_scale"; });
  });
  expect_load_error(ct, {"missing tensor", kExpert + "down_proj.input_global_scale"});
}

// Experts the quantization config leaves unquantized are refused by name and pattern; excluding
// other modules (the router, lm_head, another layer's experts) changes nothing.
TEST(CheckpointExcluded, ExcludedExpertsAreRefusedNamingThePattern) {
  struct Case {
    CheckpointFormat format;
    std::vector<std::string> excluded;
    std::string pattern;  // "" = loads
  };
  const std::vector<Case> cases = {
      {CheckpointFormat::ModelOpt, {"lm_head", "*.mlp.gate", "model.layers.0.*"}, ""},
      {CheckpointFormat::ModelOpt, {"lm_head", "model.layers.1.mlp.experts.*"}, "model.layers.1.mlp.experts.*"},
      {CheckpointFormat::ModelOpt, {"*experts.3.down_proj"}, "*experts.3.down_proj"},
      {CheckpointFormat::CompressedTensors, {"lm_head", "re:.*mlp\\.gate$"}, ""},
      {CheckpointFormat::CompressedTensors, {"re:.*layers\\.1\\.mlp\\.experts\\..*"},
       "re:.*layers\\.1\\.mlp\\.experts\\..*"},
  };
  int i = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(i);
    const std::string dir = fresh_dir("excluded_" + std::to_string(i++));
    FixtureOptions o;
    o.format = c.format;
    o.family = ModelFamily::Qwen3Moe;
    o.num_shards = 1;
    o.excluded_modules = c.excluded;
    const Fixture fx = write_fixture(dir, o);
    if (c.pattern.empty()) {
      expect_same_layer(Checkpoint::open(dir).load_layer(1), fx.layers.at(1));
    } else {
      expect_load_error(dir, {dir, "layer 1", "is excluded from quantization by '" + c.pattern + "'",
                              c.format == CheckpointFormat::ModelOpt ? "exclude_modules" : "ignore",
                              "NVFP4 experts only"});
    }
  }
  // A pattern that is not a regular expression is a configuration error naming it.
  const std::string dir = fresh_dir("excluded_bad_regex");
  FixtureOptions o;
  o.format = CheckpointFormat::CompressedTensors;
  o.family = ModelFamily::Qwen3Moe;
  o.num_shards = 1;
  o.excluded_modules = {"re:(unclosed"};
  write_fixture(dir, o);
  expect_load_error(dir, {"re:(unclosed", "not a valid regular expression"});
}

TEST(CheckpointBadInput, MissingRouterAndBias) {
  const std::string dir = single_shard_fixture("missing_router");
  rewrite(dir + "/model.safetensors", [](auto& ts) {
    std::erase_if(ts, [](const TensorData& t) { return t.name == "model.layers.1.mlp.gate.weight"; });
  });
  expect_load_error(dir, {"missing tensor", "model.layers.1.mlp.gate.weight"});
}

TEST(CheckpointBadInput, InconsistentShapeAcrossExperts) {
  const std::string dir = single_shard_fixture("bad_shape");
  rewrite(dir + "/model.safetensors", [](auto& ts) {
    TensorData& t = find(ts, kExpert + "down_proj.weight");
    t.shape = {t.shape[0] / 2, t.shape[1] * 2};
  });
  expect_load_error(dir, {dir + "/model.safetensors", kExpert + "down_proj.weight", "expected shape [64, 16]",
                          "got [32, 32]"});
}

TEST(CheckpointBadInput, ZeroNegativeAndNonFiniteScales) {
  const std::vector<std::pair<std::string, float>> cases = {
      {"gate_proj.weight_scale_2", 0.0f}, {"up_proj.weight_scale_2", -1.0f},
      {"down_proj.input_scale", std::nanf("")}, {"gate_proj.input_scale", INFINITY}};
  int i = 0;
  for (const auto& [tensor, value] : cases) {
    const std::string dir = single_shard_fixture("bad_scale_" + std::to_string(i++));
    rewrite(dir + "/model.safetensors", [&](auto& ts) { set_f32(find(ts, kExpert + tensor), value); });
    expect_load_error(dir, {dir + "/model.safetensors", kExpert + tensor, "finite and > 0"});
  }
  const std::string ct = single_shard_fixture("bad_global_scale", CheckpointFormat::CompressedTensors);
  rewrite(ct + "/model.safetensors", [&](auto& ts) { set_f32(find(ts, kExpert + "up_proj.weight_global_scale"), 0.0f); });
  expect_load_error(ct, {kExpert + "up_proj.weight_global_scale", "finite and > 0"});
  // A block scale that is NaN or negative.
  const std::string nan_dir = single_shard_fixture("nan_block_scale");
  rewrite(nan_dir + "/model.safetensors", [](auto& ts) { find(ts, kExpert + "up_proj.weight_scale").bytes[5] = std::byte{0x7F}; });
  expect_load_error(nan_dir, {kExpert + "up_proj.weight_scale", "block scale 5 is NaN"});
  const std::string neg_dir = single_shard_fixture("neg_block_scale");
  rewrite(neg_dir + "/model.safetensors", [](auto& ts) { find(ts, kExpert + "down_proj.weight_scale").bytes[2] = std::byte{0xB8}; });
  expect_load_error(neg_dir, {kExpert + "down_proj.weight_scale", "block scale 2 is negative"});
}

TEST(CheckpointBadInput, DtypeMismatch) {
  const std::string dir = single_shard_fixture("bad_dtype");
  rewrite(dir + "/model.safetensors", [](auto& ts) { find(ts, kExpert + "gate_proj.weight_scale").dtype = DType::U8; });
  expect_load_error(dir, {dir + "/model.safetensors", kExpert + "gate_proj.weight_scale", "expected dtype F8_E4M3, got U8"});
  const std::string router = single_shard_fixture("bad_router_dtype");
  rewrite(router + "/model.safetensors", [](auto& ts) {
    TensorData& t = find(ts, "model.layers.1.mlp.gate.weight");
    t.dtype = DType::F32;
    t.shape[1] /= 2;
  });
  expect_load_error(router, {"model.layers.1.mlp.gate.weight", "expected dtype BF16, got F32"});
}

std::string sharded_fixture(const std::string& name) {
  const std::string dir = fresh_dir(name);
  FixtureOptions o;
  o.family = ModelFamily::DeepSeekV3;
  o.num_shards = 2;
  write_fixture(dir, o);
  return dir;
}

TEST(CheckpointBadInput, TruncatedAndCorruptShards) {
  const std::string dir = sharded_fixture("truncated");
  const std::string shard = dir + "/model-00002-of-00002.safetensors";
  fs::resize_file(shard, fs::file_size(shard) - 100);
  expect_load_error(dir, {"model-00002-of-00002.safetensors"});
  const std::string dir2 = sharded_fixture("corrupt_header");
  const std::string shard2 = dir2 + "/model-00001-of-00002.safetensors";
  {
    std::fstream f(shard2, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(12);
    f.write("\x01\x02garbage", 9);
  }
  expect_load_error(dir2, {"model-00001-of-00002.safetensors"});
}

TEST(CheckpointBadInput, IndexEntriesPointingAtMissingFiles) {
  const std::string dir = sharded_fixture("missing_shard");
  fs::remove(dir + "/model-00002-of-00002.safetensors");
  try {
    Checkpoint::open(dir);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("model.safetensors.index.json"), HasSubstr("model-00002-of-00002.safetensors"),
                                HasSubstr("does not exist")));
  }
  const std::string dir2 = sharded_fixture("escaping_index");
  {
    std::ofstream f(dir2 + "/model.safetensors.index.json");
    f << R"({"weight_map": {"model.norm.weight": "../other/model.safetensors"}})";
  }
  EXPECT_THAT([&] { Checkpoint::open(dir2); }, ::testing::ThrowsMessage<Error>(HasSubstr("not a relative path")));
  // An index entry whose shard does not hold the tensor.
  const std::string dir3 = sharded_fixture("index_wrong_shard");
  {
    std::ifstream in(dir3 + "/model.safetensors.index.json");
    std::string s((std::istreambuf_iterator<char>(in)), {});
    const std::string key = "\"model.layers.1.mlp.gate.weight\": \"model-0000";
    const size_t pos = s.find(key);
    ASSERT_NE(pos, std::string::npos);
    char& digit = s[pos + key.size()];
    digit = digit == '1' ? '2' : '1';
    std::ofstream(dir3 + "/model.safetensors.index.json") << s;
  }
  expect_load_error(dir3, {"model.layers.1.mlp.gate.weight", "does not hold it"});
}

TEST(CheckpointBadInput, NonUtf8Names) {
  const std::string dir = sharded_fixture("non_utf8_index");
  {
    std::ofstream f(dir + "/model.safetensors.index.json", std::ios::binary);
    f << "{\"weight_map\": {\"model.norm\xff.weight\": \"model-00001-of-00002.safetensors\"}}";
  }
  EXPECT_THAT([&] { Checkpoint::open(dir); },
              ::testing::ThrowsMessage<Error>(AllOf(HasSubstr("model.safetensors.index.json"), HasSubstr("invalid JSON"))));
  const std::string dir2 = single_shard_fixture("non_utf8_shard");
  // The writer refuses such a name: write a placeholder and patch the header bytes.
  rewrite(dir2 + "/model.safetensors", [](auto& ts) { ts.push_back(make_tensor("bad@@name", DType::F32, {1}, std::vector<float>{1})); });
  {
    std::fstream f(dir2 + "/model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(f)), {});
    const size_t pos = bytes.find("bad@@name");
    ASSERT_NE(pos, std::string::npos);
    f.seekp(static_cast<std::streamoff>(pos + 3));
    f.write("\xc3(", 2);
  }
  EXPECT_THAT([&] { Checkpoint::open(dir2); }, ::testing::ThrowsMessage<Error>(HasSubstr("model.safetensors")));
}

TEST(CheckpointModelTypes, SiblingsOfAFamilyLoadAsThatFamily) {
  // Same tensor names, config keys and routing as their family: DeepSeek-V3.2, Kimi-K2 and GLM-4.5/4.6
  // are DeepSeek-V3 models, Qwen3-Next a Qwen3-MoE one.
  const std::pair<const char*, ModelFamily> siblings[] = {{"deepseek_v32", ModelFamily::DeepSeekV3},
                                                          {"kimi_k2", ModelFamily::DeepSeekV3},
                                                          {"glm4_moe", ModelFamily::DeepSeekV3},
                                                          {"qwen3_next", ModelFamily::Qwen3Moe}};
  for (const auto& [model_type, family] : siblings) {
    SCOPED_TRACE(model_type);
    const std::string dir = fresh_dir(std::string("sibling_") + model_type);
    FixtureOptions o;
    o.family = family;
    o.model_type = model_type;
    o.num_shards = 1;
    const Fixture fx = write_fixture(dir, o);
    const Checkpoint ck = Checkpoint::open(dir);
    EXPECT_EQ(ck.config().model_type, model_type);
    EXPECT_EQ(ck.config().family, family);
    ASSERT_FALSE(fx.layers.empty());
    for (const auto& [layer, want] : fx.layers) expect_same_layer(ck.load_layer(layer), want);
  }
  EXPECT_EQ(family_of_model_type("llama4_text"), ModelFamily::Llama4);
  EXPECT_EQ(family_of_model_type("gpt_oss"), ModelFamily::GptOss);
  EXPECT_THAT([] { family_of_model_type("dbrx"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("model type 'dbrx' is not a supported MoE model")));
  FixtureOptions mismatch;
  mismatch.family = ModelFamily::Mixtral;
  mismatch.model_type = "kimi_k2";
  EXPECT_THAT([&] { write_fixture(fresh_dir("sibling_mismatch"), mismatch); },
              ::testing::ThrowsMessage<Error>(HasSubstr("model_type 'kimi_k2' is not of family mixtral")));
}

TEST(CheckpointFusion, DifferentGateUpScale2AreRescaledToTheMax) {
  for (const float factor : {0.37f, 1.9f}) {
    SCOPED_TRACE(factor);
    const std::string dir = fresh_dir("fusion");
    FixtureOptions o;
    o.family = ModelFamily::Mixtral;
    o.num_shards = 1;
    o.num_layers = 1;
    o.up_scale_2_factor = factor;
    const Fixture fx = write_fixture(dir, o);
    const Checkpoint ck = Checkpoint::open(dir);
    const MoeLayerWeights w = ck.load_layer(0);
    expect_same_layer(w, fx.layers.at(0));
    // Independently: from the stored tensors, which block scales change and by how much.
    const SafetensorsFile f = SafetensorsFile::open(dir + "/model.safetensors");
    int64_t changed = 0;
    double worst = 0;
    for (int64_t e = 0; e < o.num_experts; ++e) {
      const std::string base = "model.layers.0.block_sparse_moe.experts." + std::to_string(e) + ".";
      float sg, su;
      std::memcpy(&sg, f.tensor(base + "w1.weight_scale_2").data.data(), 4);
      std::memcpy(&su, f.tensor(base + "w3.weight_scale_2").data.data(), 4);
      ASSERT_NE(sg, su);
      const std::string smaller = sg < su ? "w1" : "w3";
      const float from = std::min(sg, su), to = std::max(sg, su);
      EXPECT_EQ(w.w13_scale_2[e], to);
      const TensorView& s = f.tensor(base + smaller + ".weight_scale");
      for (const std::byte b : s.data) {
        const float v = format::e4m3_to_float(static_cast<uint8_t>(b));
        const uint8_t nb = format::e4m3_from_float(v * (from / to));
        changed += nb != static_cast<uint8_t>(b);
        if (v > 0) worst = std::max(worst, std::fabs(double(format::e4m3_to_float(nb)) * to - double(v) * from) / (double(v) * from));
      }
    }
    EXPECT_EQ(w.fusion.experts_rescaled, o.num_experts);
    EXPECT_GT(w.fusion.block_scales_changed, 0);
    EXPECT_EQ(w.fusion.block_scales_changed, changed);
    EXPECT_EQ(w.fusion.worst_relative_change, worst);
    EXPECT_GT(w.fusion.worst_relative_change, 0.0);
    EXPECT_LT(w.fusion.worst_relative_change, 0.07);  // e4m3 has 3 mantissa bits: <= 2^-4 relative
    // Tensor-parallel ranks rescale only their own columns of I: the same scales as the shard of the
    // whole layer, and the ranks' counts add up to the whole layer's.
    int64_t ranks_changed = 0;
    for (int r = 0; r < 2; ++r) {
      LoadOptions lo;
      lo.tp_rank = r;
      lo.tp_size = 2;
      const MoeLayerWeights s = ck.load_layer(0, lo);
      const TensorParallelShard want = tensor_parallel_shard(w.problem, w.weights(), r, 2);
      EXPECT_EQ(s.w13_scale, want.w13_scale);
      EXPECT_EQ(s.w13, want.w13);
      EXPECT_EQ(s.w13_scale_2, w.w13_scale_2);
      EXPECT_EQ(s.fusion.experts_rescaled, o.num_experts);
      ranks_changed += s.fusion.block_scales_changed;
    }
    EXPECT_EQ(ranks_changed, w.fusion.block_scales_changed);
    LoadOptions strict;
    strict.fusion = ScaleFusionPolicy::Error;
    EXPECT_THAT([&] { ck.load_layer(0, strict); },
                ::testing::ThrowsMessage<Error>(AllOf(HasSubstr("different weight_scale_2"),
                                                      HasSubstr("experts.0.w3"), HasSubstr("model.safetensors"))));
  }
}

TEST(CheckpointEp, SlicesAreContiguousExpertRanges) {
  EXPECT_EQ(expert_range(8, 0, 3), std::make_pair(int64_t(0), int64_t(3)));
  EXPECT_EQ(expert_range(8, 1, 3), std::make_pair(int64_t(3), int64_t(6)));
  EXPECT_EQ(expert_range(8, 2, 3), std::make_pair(int64_t(6), int64_t(8)));
  EXPECT_THROW(expert_range(8, 3, 3), Error);
  EXPECT_THROW(expert_range(8, 0, 9), Error);
  const std::string dir = sharded_fixture("ep");
  const Checkpoint ck = Checkpoint::open(dir);
  const MoeLayerWeights full = ck.load_layer(1);
  const int64_t H = full.problem.hidden, I = full.problem.inter;
  int64_t covered = 0;
  for (int r = 0; r < 3; ++r) {
    LoadOptions lo;
    lo.ep_rank = r;
    lo.ep_size = 3;
    const MoeLayerWeights s = ck.load_layer(1, lo);
    const int64_t b = s.expert_begin, n = s.expert_end - s.expert_begin;
    EXPECT_EQ(b, covered);
    covered += n;
    EXPECT_EQ(s.problem.num_experts, n);
    EXPECT_EQ(s.total_experts, 8);
    const int64_t w13e = 2 * I * H / 2, s13e = 2 * I * H / 16, w2e = H * I / 2, s2e = H * I / 16;
    EXPECT_EQ(s.w13, std::vector<uint8_t>(full.w13.begin() + b * w13e, full.w13.begin() + (b + n) * w13e));
    EXPECT_EQ(s.w13_scale, std::vector<uint8_t>(full.w13_scale.begin() + b * s13e, full.w13_scale.begin() + (b + n) * s13e));
    EXPECT_EQ(s.w2, std::vector<uint8_t>(full.w2.begin() + b * w2e, full.w2.begin() + (b + n) * w2e));
    EXPECT_EQ(s.w2_scale, std::vector<uint8_t>(full.w2_scale.begin() + b * s2e, full.w2_scale.begin() + (b + n) * s2e));
    EXPECT_EQ(s.w13_scale_2, std::vector<float>(full.w13_scale_2.begin() + b, full.w13_scale_2.begin() + b + n));
    EXPECT_EQ(s.w2_input_scale, std::vector<float>(full.w2_input_scale.begin() + b, full.w2_input_scale.begin() + b + n));
    ASSERT_GT(full.w13_input_scale_max, 0.0f);  // a w4a4 checkpoint
    EXPECT_EQ(s.w13_input_scale_max, full.w13_input_scale_max);  // the whole layer's, on every rank
    EXPECT_EQ(s.router_weight, full.router_weight);  // the router scores all experts
    EXPECT_EQ(s.routing_bias, full.routing_bias);
    EXPECT_THROW(s.to_case(random_hidden_states(1, H, 1), 1), Error);
  }
  EXPECT_EQ(covered, 8);
}

TEST(CheckpointTp, RanksHoldTheirColumnsOfTheIntermediateSize) {
  const std::string dir = sharded_fixture("tp");
  const Checkpoint ck = Checkpoint::open(dir);
  const MoeLayerWeights full = ck.load_layer(1);
  for (int r = 0; r < 2; ++r) {
    LoadOptions lo;
    lo.tp_rank = r;
    lo.tp_size = 2;
    lo.ep_rank = 1;  // combined with expert parallelism: experts [4, 8) of 8
    lo.ep_size = 2;
    const MoeLayerWeights s = ck.load_layer(1, lo);
    EXPECT_EQ(s.total_inter, full.problem.inter);
    EXPECT_EQ(s.inter_begin, r * full.problem.inter / 2);
    EXPECT_EQ(s.inter_end, (r + 1) * full.problem.inter / 2);
    EXPECT_EQ(s.problem.inter, full.problem.inter / 2);
    EXPECT_EQ(s.problem.num_experts, 4);
    // The same bytes as the shard of the whole layer's experts [4, 8).
    MoeProblem local = full.problem;
    local.num_experts = 8;
    const TensorParallelShard want = tensor_parallel_shard(local, full.weights(), r, 2);
    const int64_t H = full.problem.hidden, half = full.problem.inter / 2;
    const int64_t w13e = 2 * half * H / 2, s13e = 2 * half * H / 16, w2e = H * half / 2, s2e = H * half / 16;
    EXPECT_EQ(s.w13, std::vector<uint8_t>(want.w13.begin() + 4 * w13e, want.w13.end()));
    EXPECT_EQ(s.w13_scale, std::vector<uint8_t>(want.w13_scale.begin() + 4 * s13e, want.w13_scale.end()));
    EXPECT_EQ(s.w2, std::vector<uint8_t>(want.w2.begin() + 4 * w2e, want.w2.end()));
    EXPECT_EQ(s.w2_scale, std::vector<uint8_t>(want.w2_scale.begin() + 4 * s2e, want.w2_scale.end()));
    EXPECT_EQ(s.w13_scale_2, std::vector<float>(full.w13_scale_2.begin() + 4, full.w13_scale_2.end()));
  }
  LoadOptions bad;
  bad.tp_size = 3;  // the fixture's I = 32 is two blocks of 16
  EXPECT_THAT([&] { ck.load_layer(1, bad); },
              ::testing::ThrowsMessage<Error>(HasSubstr("with at least tp_size = 3 blocks of 16")));
}

TEST(Checkpoint, RouterLogitsAreTheFp32DotProductOfTheBf16Values) {
  MoeLayerWeights w;
  w.total_experts = 2;
  w.problem.hidden = 16;
  w.router_weight.assign(32, format::bf16_from_float(0.5f));
  w.router_weight[16] = format::bf16_from_float(-2.0f);
  const std::vector<uint16_t> x(16, format::bf16_from_float(1.5f));
  const std::vector<float> l = w.router_logits(x.data(), 1);
  ASSERT_EQ(l.size(), 2u);
  EXPECT_EQ(l[0], 12.0f);
  EXPECT_EQ(l[1], 1.5f * -2.0f + 15 * 0.75f);
}

}  // namespace
}  // namespace fp4moe::io
