// io/checkpoint_fixture.cpp — small NVFP4 MoE checkpoints written from random weights (tests, demos).
//
// Steps: (1) config.json for the family (+ hf_quant_config.json for ModelOpt, or a compressed-tensors
// "quantization_config"); (2) per layer: dense layers get bf16 MLP weights; MoE layers get, per
// expert, bf16-rounded normal gate/up/down weights quantized with format::quantize_nvfp4 under
// scale_2 = amax / (448 * 6) (gate and up share the amax of both, unless up_scale_2_factor != 1),
// input scales drawn per projection, the router (bf16) and, for deepseek_v3, the score-correction
// bias; shared experts where the family has them; (3) the tensors go round-robin into num_shards
// shards with model.safetensors.index.json (or one model.safetensors). compressed-tensors stores
// g = 1 / s; the expected layer holds 1.0f / g, which the weights are quantized with, so the loader's
// inversion reproduces it exactly. The expected canonical layer is assembled from the same values.
// gpt_oss (write_gpt_oss): config.json with an mxfp4 quantization_config; per layer random e2m1 codes
// and ue8m0 scales (118..122) written in the published fused layout with gate and up rows interleaved,
// bf16 biases and router; the expected layer holds the same bytes de-interleaved into [gate; up].
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "fp4moe/checkpoint.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/safetensors.hpp"

namespace fp4moe::io {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr float kGlobalDenom = 448.0f * 6.0f;

struct Rng {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return (static_cast<double>(next() >> 11) + 0.5) * 0x1.0p-53; }
  double normal() { return std::sqrt(-2.0 * std::log(uniform())) * std::cos(6.283185307179586 * uniform()); }
};

float bf16_round(float x) { return format::bf16_to_float(format::bf16_from_float(x)); }

std::vector<float> normals(Rng& rng, int64_t n, float std) {
  std::vector<float> v(n);
  for (auto& x : v) x = bf16_round(static_cast<float>(rng.normal()) * std);
  return v;
}

float amax_of(const std::vector<float>& v) {
  float a = 0.0f;
  for (float x : v) a = std::max(a, std::fabs(x));
  return a;
}

std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = format::bf16_from_float(v[i]);
  return b;
}

// The value the loader will see for a stored scale s (compressed-tensors stores 1/s).
float representable(float s, bool ct) { return ct ? 1.0f / (1.0f / s) : s; }

struct Writer {
  const FixtureOptions& o;
  bool ct;
  std::vector<TensorData> tensors;

  void scalar(const std::string& name, float dequant) {
    const float stored = ct ? 1.0f / dequant : dequant;
    tensors.push_back(make_tensor(name, DType::F32, {}, std::vector<float>{stored}));
  }
  // Quantizes x [rows, cols] with scale_2 s (already representable) and writes one projection.
  void projection(const std::string& base, const std::vector<float>& x, int64_t rows, int64_t cols, float s,
                  float input_scale, std::vector<uint8_t>& packed, std::vector<uint8_t>& scales) {
    packed.assign(rows * cols / 2, 0);
    scales.assign(rows * cols / format::kBlockSize, 0);
    format::quantize_nvfp4(x.data(), rows, cols, s, packed.data(), scales.data());
    tensors.push_back(make_tensor(base + (ct ? ".weight_packed" : ".weight"), DType::U8, {rows, cols / 2}, packed));
    tensors.push_back(make_tensor(base + ".weight_scale", DType::F8_E4M3, {rows, cols / format::kBlockSize}, scales));
    scalar(base + (ct ? ".weight_global_scale" : ".weight_scale_2"), s);
    scalar(base + (ct ? ".input_global_scale" : ".input_scale"), input_scale);
  }
};

json family_config(const FixtureOptions& o) {
  json c;
  c["hidden_size"] = o.hidden;
  c["num_hidden_layers"] = o.num_layers;
  c["hidden_act"] = "silu";
  c["num_experts_per_tok"] = o.family == ModelFamily::Llama4 ? 1 : o.top_k;
  switch (o.family) {
    case ModelFamily::DeepSeekV3: {
      c["model_type"] = "deepseek_v3";
      c["architectures"] = {"DeepseekV3ForCausalLM"};
      c["n_routed_experts"] = o.num_experts;
      c["moe_intermediate_size"] = o.inter;
      c["intermediate_size"] = 2 * o.inter;
      const int n_group = (o.num_experts % 4 == 0 && o.num_experts >= 8) ? 4 : 1;
      c["n_group"] = n_group;
      c["topk_group"] = n_group == 1 ? 1 : 2;
      c["routed_scaling_factor"] = 2.5;
      c["scoring_func"] = "sigmoid";
      c["topk_method"] = "noaux_tc";
      c["norm_topk_prob"] = true;
      c["first_k_dense_replace"] = o.num_layers > 1 ? 1 : 0;
      c["moe_layer_freq"] = 1;
      c["n_shared_experts"] = 1;
      break;
    }
    case ModelFamily::Qwen3Moe:
      c["model_type"] = "qwen3_moe";
      c["architectures"] = {"Qwen3MoeForCausalLM"};
      c["num_experts"] = o.num_experts;
      c["moe_intermediate_size"] = o.inter;
      c["norm_topk_prob"] = true;
      c["decoder_sparse_step"] = 1;
      c["mlp_only_layers"] = json::array();
      break;
    case ModelFamily::Llama4: {
      json t = c;
      t["model_type"] = "llama4_text";
      t["num_local_experts"] = o.num_experts;
      t["intermediate_size"] = o.inter;
      t["intermediate_size_mlp"] = 2 * o.inter;
      t["interleave_moe_layer_step"] = 1;
      c = json::object();
      c["model_type"] = "llama4";
      c["architectures"] = {"Llama4ForConditionalGeneration"};
      c["text_config"] = t;
      break;
    }
    case ModelFamily::Mixtral:
      c["model_type"] = "mixtral";
      c["architectures"] = {"MixtralForCausalLM"};
      c["num_local_experts"] = o.num_experts;
      c["intermediate_size"] = o.inter;
      break;
    case ModelFamily::GptOss:  // write_gpt_oss writes its own config
      break;
  }
  return c;
}

void write_text(const fs::path& p, const std::string& s) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  check(f.good(), p.string(), ": cannot open for writing");
  f << s;
  check(f.good(), p.string(), ": write failed");
}

// The tensors round-robin into num_shards shards with model.safetensors.index.json (or, with one
// shard, one model.safetensors without index).
void write_shards(const std::string& dir, std::vector<TensorData>& tensors, int num_shards) {
  const std::map<std::string, std::string> meta{{"format", "pt"}};
  if (num_shards == 1) {
    write_safetensors((fs::path(dir) / "model.safetensors").string(), tensors, meta);
    return;
  }
  std::vector<std::vector<TensorData>> shards(num_shards);
  json weight_map = json::object();
  char name[64];
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int s = static_cast<int>(i % num_shards);
    std::snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", s + 1, num_shards);
    weight_map[tensors[i].name] = name;
    shards[s].push_back(std::move(tensors[i]));
  }
  for (int s = 0; s < num_shards; ++s) {
    std::snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", s + 1, num_shards);
    write_safetensors((fs::path(dir) / name).string(), shards[s], meta);
  }
  json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", weight_map}};
  write_text(fs::path(dir) / "model.safetensors.index.json", index.dump(2));
}

// gpt-oss in its published MXFP4 layout (checkpoint.hpp).
Fixture write_gpt_oss(const std::string& dir, const FixtureOptions& o) {
  check(o.format == CheckpointFormat::Mxfp4 && o.family == ModelFamily::GptOss,
        "write_fixture: the mxfp4 format and the gpt_oss family go together, got ", to_string(o.format), " / ",
        to_string(o.family));
  check(o.hidden % 32 == 0 && o.inter % 32 == 0, "write_fixture: gpt_oss needs H and I multiples of 32, got H ",
        o.hidden, ", I ", o.inter);
  check(o.model_type.empty() || o.model_type == "gpt_oss", "write_fixture: model_type '", o.model_type,
        "' is not of family gpt_oss");
  const int64_t E = o.num_experts, H = o.hidden, I = o.inter;
  fs::create_directories(dir);
  json modules = {"model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"};
  for (const std::string& m : o.excluded_modules)
    if (std::find(modules.begin(), modules.end(), m) == modules.end()) modules.push_back(m);
  json config = {{"architectures", {"GptOssForCausalLM"}},
                 {"model_type", "gpt_oss"},
                 {"hidden_size", H},
                 {"intermediate_size", I},
                 {"num_hidden_layers", o.num_layers},
                 {"num_local_experts", E},
                 {"num_experts_per_tok", o.top_k},
                 {"experts_per_token", o.top_k},
                 {"hidden_act", "silu"},
                 {"swiglu_limit", 7.0},
                 {"head_dim", 64},
                 {"num_attention_heads", 4},
                 {"num_key_value_heads", 1},
                 {"rms_norm_eps", 1e-05},
                 {"quantization_config", {{"quant_method", "mxfp4"}, {"modules_to_not_convert", modules}}}};
  write_text(fs::path(dir) / "config.json", config.dump(2));
  Fixture fx;
  fx.config = parse_checkpoint_config(config.dump(), "", dir);

  Rng rng{o.seed * 0x2545F4914F6CDD1Dull + 13};
  auto codes = [&](int64_t n, bool scales) {
    std::vector<uint8_t> v(static_cast<size_t>(n));
    for (auto& b : v) b = scales ? static_cast<uint8_t>(118 + rng.next() % 5) : static_cast<uint8_t>(rng.next());
    return v;
  };
  std::vector<TensorData> tensors;
  tensors.push_back(make_tensor("model.norm.weight", DType::BF16, {H}, to_bf16(normals(rng, H, 1.0f))));
  for (int64_t L = 0; L < o.num_layers; ++L) {
    const std::string lp = "model.layers." + std::to_string(L);
    tensors.push_back(make_tensor(lp + ".post_attention_layernorm.weight", DType::BF16, {H},
                                  to_bf16(normals(rng, H, 1.0f))));
    MoeLayerWeights& w = fx.layers[L];
    w.layer = L;
    w.total_experts = E;
    w.expert_end = E;
    w.total_inter = I;
    w.inter_end = I;
    w.problem = fx.config.problem;
    w.allocate_experts(true);
    // The file's tensors: gate_up rows interleaved (2i gate i, 2i + 1 up i).
    const std::vector<uint8_t> b13 = codes(E * 2 * I * (H / 2), false), s13 = codes(E * 2 * I * (H / 32), true);
    const std::vector<uint8_t> b2 = codes(E * H * (I / 2), false), s2 = codes(E * H * (I / 32), true);
    const std::vector<float> bias13 = normals(rng, E * 2 * I, 0.1f), bias2 = normals(rng, E * H, 0.02f);
    for (int64_t e = 0; e < E; ++e)
      for (int64_t r = 0; r < 2 * I; ++r) {
        const int64_t src = e * 2 * I + r, dst = e * 2 * I + (r % 2) * I + r / 2;  // canonical [gate; up]
        std::copy_n(b13.begin() + src * (H / 2), H / 2, w.w13.begin() + dst * (H / 2));
        std::copy_n(s13.begin() + src * (H / 32), H / 32, w.w13_scale.begin() + dst * (H / 32));
        w.w13_bias[size_t(dst)] = bias13[size_t(src)];
      }
    w.w2 = b2;
    w.w2_scale = s2;
    w.w2_bias = bias2;
    w.router_weight = to_bf16(normals(rng, E * H, 0.1f));
    w.router_bias = normals(rng, E, 0.1f);
    const std::string mlp = lp + ".mlp";
    tensors.push_back(make_tensor(mlp + ".experts.gate_up_proj_blocks", DType::U8, {E, 2 * I, H / 32, 16}, b13));
    tensors.push_back(make_tensor(mlp + ".experts.gate_up_proj_scales", DType::U8, {E, 2 * I, H / 32}, s13));
    tensors.push_back(make_tensor(mlp + ".experts.gate_up_proj_bias", DType::BF16, {E, 2 * I}, to_bf16(bias13)));
    tensors.push_back(make_tensor(mlp + ".experts.down_proj_blocks", DType::U8, {E, H, I / 32, 16}, b2));
    tensors.push_back(make_tensor(mlp + ".experts.down_proj_scales", DType::U8, {E, H, I / 32}, s2));
    tensors.push_back(make_tensor(mlp + ".experts.down_proj_bias", DType::BF16, {E, H}, to_bf16(bias2)));
    tensors.push_back(make_tensor(mlp + ".router.weight", DType::BF16, {E, H}, w.router_weight));
    tensors.push_back(make_tensor(mlp + ".router.bias", DType::BF16, {E}, to_bf16(w.router_bias)));
  }
  write_shards(dir, tensors, o.num_shards);
  return fx;
}

}  // namespace

Fixture write_fixture(const std::string& dir, const FixtureOptions& o) {
  if (o.family == ModelFamily::GptOss || o.format == CheckpointFormat::Mxfp4) return write_gpt_oss(dir, o);
  check(o.num_layers >= 1 && o.num_experts >= 1 && o.hidden >= 16 && o.hidden % 16 == 0 && o.inter >= 16 &&
            o.inter % 16 == 0 && o.num_shards >= 1,
        "write_fixture: bad sizes (layers ", o.num_layers, ", experts ", o.num_experts, ", H ", o.hidden, ", I ",
        o.inter, ", shards ", o.num_shards, ")");
  check(std::isfinite(o.up_scale_2_factor) && o.up_scale_2_factor > 0.0f,
        "write_fixture: up_scale_2_factor must be finite and > 0, got ", o.up_scale_2_factor);
  const bool ct = o.format == CheckpointFormat::CompressedTensors;
  const int64_t E = o.num_experts, H = o.hidden, I = o.inter;
  fs::create_directories(dir);

  // (1) configs
  json config = family_config(o);
  if (!o.model_type.empty()) {  // another model type of the same family (Kimi-K2, GLM-4.5, Qwen3-Next, ...)
    check(family_of_model_type(o.model_type) == o.family, "write_fixture: model_type '", o.model_type,
          "' is not of family ", to_string(o.family));
    config["model_type"] = o.model_type;
  }
  json quant;
  if (ct) {
    json fp4 = {{"num_bits", 4}, {"type", "float"}, {"strategy", "tensor_group"}, {"group_size", 16},
                {"symmetric", true}, {"dynamic", false}};
    json act = fp4;
    act["dynamic"] = "local";
    config["quantization_config"] = {
        {"quant_method", "compressed-tensors"},
        {"format", "nvfp4-pack-quantized"},
        {"config_groups",
         {{"group_0", {{"targets", {"Linear"}}, {"weights", fp4}, {"input_activations", act},
                       {"format", "nvfp4-pack-quantized"}}}}},
        {"ignore", o.excluded_modules}};
  } else {
    quant = {{"producer", {{"name", "modelopt"}, {"version", "fixture"}}},
             {"quantization", {{"quant_algo", "NVFP4"}, {"kv_cache_quant_algo", nullptr}, {"group_size", 16},
                               {"exclude_modules", o.excluded_modules}}}};
    write_text(fs::path(dir) / "hf_quant_config.json", quant.dump(2));
  }
  write_text(fs::path(dir) / "config.json", config.dump(2));
  Fixture fx;
  fx.config = parse_checkpoint_config(config.dump(), ct ? std::string() : quant.dump(), dir);

  // (2) tensors
  Rng rng{o.seed * 0x2545F4914F6CDD1Dull + 7};
  Writer wr{o, ct, {}};
  const bool llama4 = o.family == ModelFamily::Llama4;
  const std::string model = (llama4 && o.llama4_language_model_prefix) ? "language_model.model" : "model";
  wr.tensors.push_back(make_tensor(model + ".norm.weight", DType::BF16, {H}, to_bf16(normals(rng, H, 1.0f))));
  std::vector<uint8_t> packed, scales;
  for (int64_t L = 0; L < o.num_layers; ++L) {
    const std::string lp = model + ".layers." + std::to_string(L);
    const std::string mlp = lp + (llama4 ? ".feed_forward" : o.family == ModelFamily::Mixtral ? ".block_sparse_moe" : ".mlp");
    if (!fx.config.is_moe_layer(L)) {  // dense MLP, bf16
      for (const char* p : {"gate_proj", "up_proj"})
        wr.tensors.push_back(make_tensor(mlp + "." + p + ".weight", DType::BF16, {2 * I, H},
                                         to_bf16(normals(rng, 2 * I * H, 0.02f))));
      wr.tensors.push_back(make_tensor(mlp + ".down_proj.weight", DType::BF16, {H, 2 * I},
                                       to_bf16(normals(rng, 2 * I * H, 0.02f))));
      continue;
    }
    MoeLayerWeights& w = fx.layers[L];
    w.layer = L;
    w.total_experts = E;
    w.expert_begin = 0;
    w.expert_end = E;
    w.total_inter = I;
    w.inter_end = I;
    w.problem = fx.config.problem;
    w.allocate_experts();
    const bool mixtral = o.family == ModelFamily::Mixtral;
    const std::string gn = mixtral ? "w1" : "gate_proj", un = mixtral ? "w3" : "up_proj", dn = mixtral ? "w2" : "down_proj";
    const float a1 = representable(4.0f / kGlobalDenom, ct);
    const int64_t half_w = I * (H / 2), half_s = I * (H / 16);
    for (int64_t e = 0; e < E; ++e) {
      const std::string base = mlp + ".experts." + std::to_string(e) + ".";
      const std::vector<float> gate = normals(rng, I * H, 0.02f), up = normals(rng, I * H, 0.02f),
                               down = normals(rng, H * I, 0.02f);
      float s13 = std::max(amax_of(gate), amax_of(up)) / kGlobalDenom;
      if (!(s13 > 0.0f)) s13 = 1.0f;
      const float sg = representable(s13, ct);
      const float su = representable(o.up_scale_2_factor == 1.0f ? s13 : s13 * o.up_scale_2_factor, ct);
      float s2 = amax_of(down) / kGlobalDenom;
      if (!(s2 > 0.0f)) s2 = 1.0f;
      s2 = representable(s2, ct);
      const float ig = representable(a1 * static_cast<float>(0.8 + 0.4 * rng.uniform()), ct);
      const float iu = representable(a1 * static_cast<float>(0.8 + 0.4 * rng.uniform()), ct);
      const float id = representable(0.05f / kGlobalDenom * static_cast<float>(0.8 + 0.4 * rng.uniform()), ct);

      uint8_t* w13 = w.w13.data() + e * 2 * half_w;
      uint8_t* sc13 = w.w13_scale.data() + e * 2 * half_s;
      wr.projection(base + gn, gate, I, H, sg, ig, packed, scales);
      std::copy(packed.begin(), packed.end(), w13);
      std::copy(scales.begin(), scales.end(), sc13);
      wr.projection(base + un, up, I, H, su, iu, packed, scales);
      std::copy(packed.begin(), packed.end(), w13 + half_w);
      std::copy(scales.begin(), scales.end(), sc13 + half_s);
      float s13_fused = sg;
      if (sg != su) {  // expected result of rescale_to_max: the smaller half's block scales re-expressed
        s13_fused = std::max(sg, su);
        uint8_t* blocks = sg < su ? sc13 : sc13 + half_s;
        const float ratio = std::min(sg, su) / s13_fused;
        for (int64_t i = 0; i < half_s; ++i)
          blocks[i] = format::e4m3_from_float(format::e4m3_to_float(blocks[i]) * ratio);
      }
      w.w13_scale_2[e] = s13_fused;
      w.w13_input_scale[e] = std::max(ig, iu);
      wr.projection(base + dn, down, H, I, s2, id, packed, scales);
      std::copy(packed.begin(), packed.end(), w.w2.data() + e * H * (I / 2));
      std::copy(scales.begin(), scales.end(), w.w2_scale.data() + e * H * (I / 16));
      w.w2_scale_2[e] = s2;
      w.w2_input_scale[e] = id;
    }
    if (w.problem.act_quant != ActQuant::W4A16)
      w.w13_input_scale_max = *std::max_element(w.w13_input_scale.begin(), w.w13_input_scale.end());
    w.router_weight = to_bf16(normals(rng, E * H, 0.1f));
    wr.tensors.push_back(make_tensor(mlp + (llama4 ? ".router.weight" : ".gate.weight"), DType::BF16, {E, H},
                                     w.router_weight));
    if (o.family == ModelFamily::DeepSeekV3) {
      w.routing_bias.resize(E);
      for (auto& b : w.routing_bias) b = static_cast<float>(rng.normal() * 0.1);
      wr.tensors.push_back(make_tensor(mlp + ".gate.e_score_correction_bias", DType::F32, {E}, w.routing_bias));
    }
    if (o.family == ModelFamily::DeepSeekV3 || llama4) {  // one quantized shared expert of width I
      const std::string sp = mlp + (llama4 ? ".shared_expert." : ".shared_experts.");
      for (const char* p : {"gate_proj", "up_proj"})
        wr.projection(sp + p, normals(rng, I * H, 0.02f), I, H, representable(0.1f / kGlobalDenom, ct),
                      a1, packed, scales);
      wr.projection(sp + "down_proj", normals(rng, H * I, 0.02f), H, I, representable(0.1f / kGlobalDenom, ct),
                    a1, packed, scales);
    }
  }

  // (3) shards
  write_shards(dir, wr.tensors, o.num_shards);
  return fx;
}

}  // namespace fp4moe::io
