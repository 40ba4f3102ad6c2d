// io/checkpoint_config.cpp — config.json + quantization config -> CheckpointConfig.
//
// Steps: (1) bound the nesting depth of both texts, then parse them as JSON (invalid UTF-8, syntax
// errors -> fp4moe::Error naming `where` and the file); (2) find the NVFP4 description: a non-empty
// hf_quant_config.json (ModelOpt), else config.json "quantization_config" (ModelOpt or
// compressed-tensors nvfp4-pack-quantized); every field that matters is checked (algo, bits, type,
// group size); (3) the model family from model_type (llama4: the fields of text_config); (4) the sizes
// and routing parameters, each integer type- and range-checked, into MoeProblem, then validate().
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include <nlohmann/json.hpp>

#include "fp4moe/checkpoint.hpp"
#include "fp4moe/error.hpp"

namespace fp4moe::io {

using json = nlohmann::json;

std::string_view to_string(CheckpointFormat f) {
  switch (f) {
    case CheckpointFormat::ModelOpt: return "modelopt";
    case CheckpointFormat::CompressedTensors: return "compressed-tensors";
    case CheckpointFormat::Mxfp4: return "mxfp4";
  }
  return "?";
}

std::string_view to_string(ModelFamily f) {
  switch (f) {
    case ModelFamily::DeepSeekV3: return "deepseek_v3";
    case ModelFamily::Qwen3Moe: return "qwen3_moe";
    case ModelFamily::Llama4: return "llama4";
    case ModelFamily::Mixtral: return "mixtral";
    case ModelFamily::GptOss: return "gpt_oss";
  }
  return "?";
}

std::string_view to_string(ScaleFusionPolicy p) {
  return p == ScaleFusionPolicy::RescaleToMax ? "rescale_to_max" : "error";
}

CheckpointFormat parse_checkpoint_format(std::string_view name) {
  if (name == "modelopt") return CheckpointFormat::ModelOpt;
  if (name == "compressed-tensors" || name == "compressed_tensors") return CheckpointFormat::CompressedTensors;
  if (name == "mxfp4") return CheckpointFormat::Mxfp4;
  throw Error("checkpoint format must be one of modelopt, compressed-tensors, mxfp4; got '" + std::string(name) + "'");
}

ModelFamily parse_model_family(std::string_view name) {
  if (name == "deepseek_v3" || name == "deepseek") return ModelFamily::DeepSeekV3;
  if (name == "qwen3_moe" || name == "qwen3") return ModelFamily::Qwen3Moe;
  if (name == "llama4" || name == "llama4_text") return ModelFamily::Llama4;
  if (name == "mixtral") return ModelFamily::Mixtral;
  if (name == "gpt_oss" || name == "gpt-oss") return ModelFamily::GptOss;
  throw Error("model family must be one of deepseek_v3 (deepseek), qwen3_moe (qwen3), llama4, mixtral, gpt_oss; got '" +
              std::string(name) + "'");
}

namespace {
// config.json model types whose MoE layers follow a family's tensor names, routing and config keys.
struct ModelTypeRow {
  std::string_view model_type;
  ModelFamily family;
};
constexpr ModelTypeRow kModelTypes[] = {
    {"deepseek_v3", ModelFamily::DeepSeekV3},  {"deepseek_v32", ModelFamily::DeepSeekV3},
    {"kimi_k2", ModelFamily::DeepSeekV3},      {"glm4_moe", ModelFamily::DeepSeekV3},
    {"qwen3_moe", ModelFamily::Qwen3Moe},      {"qwen3_next", ModelFamily::Qwen3Moe},
    {"llama4", ModelFamily::Llama4},           {"llama4_text", ModelFamily::Llama4},
    {"mixtral", ModelFamily::Mixtral},         {"gpt_oss", ModelFamily::GptOss},
};
}  // namespace

ModelFamily family_of_model_type(std::string_view model_type) {
  std::string known;
  for (const ModelTypeRow& r : kModelTypes) {
    if (r.model_type == model_type) return r.family;
    known += (known.empty() ? "" : ", ") + std::string(r.model_type);
  }
  throw Error(detail::concat("model type '", model_type, "' is not a supported MoE model (supported: ", known, ")"));
}

ScaleFusionPolicy parse_scale_fusion_policy(std::string_view name) {
  if (name == "rescale_to_max") return ScaleFusionPolicy::RescaleToMax;
  if (name == "error") return ScaleFusionPolicy::Error;
  throw Error("scale fusion policy must be one of rescale_to_max, error; got '" + std::string(name) + "'");
}

bool CheckpointConfig::is_moe_layer(int64_t layer) const { return dense_reason(layer).empty(); }

std::string CheckpointConfig::dense_reason(int64_t layer) const {
  if (layer < 0 || layer >= num_layers)
    return detail::concat("out of range (num_hidden_layers=", num_layers, ")");
  switch (family) {
    case ModelFamily::DeepSeekV3:
      if (layer < first_k_dense_replace)
        return detail::concat("dense (first_k_dense_replace=", first_k_dense_replace, ")");
      if (layer % moe_layer_freq != 0) return detail::concat("dense (moe_layer_freq=", moe_layer_freq, ")");
      return {};
    case ModelFamily::Qwen3Moe:
      if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end())
        return "dense (listed in mlp_only_layers)";
      if ((layer + 1) % moe_layer_freq != 0)
        return detail::concat("dense (decoder_sparse_step=", moe_layer_freq, ")");
      return {};
    case ModelFamily::Llama4:
      if (!moe_layers.empty()) {
        if (std::find(moe_layers.begin(), moe_layers.end(), layer) == moe_layers.end())
          return "dense (not listed in moe_layers)";
        return {};
      }
      if ((layer + 1) % moe_layer_freq != 0)
        return detail::concat("dense (interleave_moe_layer_step=", moe_layer_freq, ")");
      return {};
    case ModelFamily::Mixtral:
    case ModelFamily::GptOss:
      return {};
  }
  return {};
}

namespace {

constexpr int kMaxJsonDepth = 64;

// Rejects nesting deeper than kMaxJsonDepth before parsing (bounded work and stack on any input).
void check_depth(std::string_view text, const std::string& file) {
  int depth = 0;
  bool in_string = false, escape = false;
  for (char ch : text) {
    if (in_string) {
      if (escape) escape = false;
      else if (ch == '\\') escape = true;
      else if (ch == '"') in_string = false;
      continue;
    }
    if (ch == '"') in_string = true;
    else if (ch == '[' || ch == '{') {
      if (++depth > kMaxJsonDepth) throw Error(file + ": JSON nested deeper than " + std::to_string(kMaxJsonDepth));
    } else if (ch == ']' || ch == '}') {
      --depth;
    }
  }
}

json parse_json(std::string_view text, const std::string& file) {
  check_depth(text, file);
  try {
    json j = json::parse(text.begin(), text.end());
    if (!j.is_object()) throw Error(file + ": expected a JSON object at the top level, got " + j.type_name());
    return j;
  } catch (const json::exception& e) {
    throw Error(file + ": invalid JSON: " + e.what());
  }
}

struct Reader {
  const json& obj;
  std::string file;  // e.g. "DIR/config.json"
  std::string path;  // key path prefix, e.g. "text_config."

  bool has(const char* key) const { return obj.contains(key) && !obj.at(key).is_null(); }

  int64_t integer(const char* key, int64_t lo, int64_t hi) const {
    check(has(key), file, ": missing required key '", path, key, "'");
    return integer_value(obj.at(key), key, lo, hi);
  }
  int64_t integer_or(const char* key, int64_t def, int64_t lo, int64_t hi) const {
    return has(key) ? integer_value(obj.at(key), key, lo, hi) : def;
  }
  int64_t integer_value(const json& v, const char* key, int64_t lo, int64_t hi) const {
    int64_t x = 0;
    if (v.is_number_integer()) {
      if (v.is_number_unsigned()) {
        const uint64_t u = v.get<uint64_t>();
        check(u <= static_cast<uint64_t>(hi), file, ": '", path, key, "' must be in [", lo, ", ", hi, "], got ", u);
        x = static_cast<int64_t>(u);
      } else {
        x = v.get<int64_t>();
      }
    } else {
      throw Error(detail::concat(file, ": '", path, key, "' must be an integer, got ", v.dump()));
    }
    check(x >= lo && x <= hi, file, ": '", path, key, "' must be in [", lo, ", ", hi, "], got ", x);
    return x;
  }
  double number_or(const char* key, double def) const {
    if (!has(key)) return def;
    const json& v = obj.at(key);
    check(v.is_number(), file, ": '", path, key, "' must be a number, got ", v.dump());
    const double x = v.get<double>();
    check(std::isfinite(x), file, ": '", path, key, "' must be finite, got ", v.dump());
    return x;
  }
  bool boolean_or(const char* key, bool def) const {
    if (!has(key)) return def;
    const json& v = obj.at(key);
    check(v.is_boolean(), file, ": '", path, key, "' must be true or false, got ", v.dump());
    return v.get<bool>();
  }
  std::string string(const char* key) const {
    check(has(key), file, ": missing required key '", path, key, "'");
    return string_or(key, "");
  }
  std::string string_or(const char* key, const std::string& def) const {
    if (!has(key)) return def;
    const json& v = obj.at(key);
    check(v.is_string(), file, ": '", path, key, "' must be a string, got ", v.dump());
    return v.get<std::string>();
  }
  std::vector<std::string> strings_or_empty(const char* key) const {
    std::vector<std::string> out;
    if (!has(key)) return out;
    const json& v = obj.at(key);
    check(v.is_array(), file, ": '", path, key, "' must be an array of strings, got ", v.dump());
    for (const json& s : v) {
      check(s.is_string(), file, ": '", path, key, "' must be an array of strings, got element ", s.dump());
      out.push_back(s.get<std::string>());
    }
    return out;
  }
  std::vector<int64_t> integers_or_empty(const char* key, int64_t lo, int64_t hi) const {
    std::vector<int64_t> out;
    if (!has(key)) return out;
    const json& v = obj.at(key);
    check(v.is_array(), file, ": '", path, key, "' must be an array of integers, got ", v.dump());
    for (const json& x : v) out.push_back(integer_value(x, key, lo, hi));
    return out;
  }
  Reader child(const char* key) const {
    check(has(key), file, ": missing required key '", path, key, "'");
    const json& v = obj.at(key);
    check(v.is_object(), file, ": '", path, key, "' must be an object, got ", v.type_name());
    return Reader{v, file, path + key + "."};
  }
};

// ModelOpt: {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": [...]}.
void read_modelopt(const Reader& q, CheckpointConfig& cfg) {
  const std::string algo = q.string("quant_algo");
  check(algo == "NVFP4", q.file, ": '", q.path, "quant_algo' must be \"NVFP4\" (fp4moe loads NVFP4 only), got \"",
        algo, "\"");
  const int64_t group = q.integer_or("group_size", 16, 0, std::numeric_limits<int32_t>::max());
  check(group == 16, q.file, ": '", q.path, "group_size' must be 16 for NVFP4, got ", group);
  cfg.format = CheckpointFormat::ModelOpt;
  cfg.excluded_modules = q.strings_or_empty("exclude_modules");
  cfg.problem.act_quant = ActQuant::W4A4Scalar;
}

// compressed-tensors: config_groups with weights {num_bits 4, type float, group_size 16}.
void read_compressed_tensors(const Reader& q, CheckpointConfig& cfg) {
  const std::string top_format = q.string_or("format", "");
  const Reader groups = q.child("config_groups");
  check(!groups.obj.empty(), q.file, ": '", q.path, "config_groups' is empty");
  int weight_only = -1;
  for (auto it = groups.obj.begin(); it != groups.obj.end(); ++it) {
    check(it.value().is_object(), q.file, ": '", groups.path, it.key(), "' must be an object");
    const Reader g{it.value(), q.file, groups.path + it.key() + "."};
    const std::string fmt = g.string_or("format", top_format);
    check(fmt == "nvfp4-pack-quantized", q.file, ": '", g.path,
          "format' must be \"nvfp4-pack-quantized\" (NVFP4), got \"", fmt, "\"");
    auto check_fp4 = [&](const Reader& w) {
      const int64_t bits = w.integer("num_bits", 0, 64);
      check(bits == 4, q.file, ": '", w.path, "num_bits' must be 4, got ", bits);
      const std::string type = w.string("type");
      check(type == "float", q.file, ": '", w.path, "type' must be \"float\", got \"", type, "\"");
      const int64_t group = w.integer("group_size", 0, std::numeric_limits<int32_t>::max());
      check(group == 16, q.file, ": '", w.path, "group_size' must be 16, got ", group);
    };
    check_fp4(g.child("weights"));
    const bool wo = !g.has("input_activations");
    if (!wo) check_fp4(g.child("input_activations"));
    check(weight_only < 0 || weight_only == static_cast<int>(wo), q.file,
          ": config groups disagree on activation quantization ('", g.path, "input_activations')");
    weight_only = wo;
  }
  cfg.format = CheckpointFormat::CompressedTensors;
  cfg.excluded_modules = q.strings_or_empty("ignore");
  cfg.problem.act_quant = weight_only == 1 ? ActQuant::W4A16 : ActQuant::W4A4Scalar;
}

// gpt-oss (transformers' Mxfp4Config): {"quant_method": "mxfp4", "modules_to_not_convert": [...]}. The
// experts' weights are MXFP4 blocks and ue8m0 scales; the activations stay bf16.
void read_mxfp4(const Reader& q, CheckpointConfig& cfg) {
  cfg.format = CheckpointFormat::Mxfp4;
  cfg.excluded_modules = q.strings_or_empty("modules_to_not_convert");
  cfg.problem.act_quant = ActQuant::W4A16;
  cfg.problem.weight_format = WeightFormat::MXFP4;
}

}  // namespace

CheckpointConfig parse_checkpoint_config(std::string_view config_json, std::string_view quant_config_json,
                                         const std::string& where) {
  const std::string config_file = where + "/config.json";
  const std::string quant_file = where + "/hf_quant_config.json";
  const json root = parse_json(config_json, config_file);
  const Reader top{root, config_file, ""};
  CheckpointConfig cfg;

  // (2) quantization
  if (!quant_config_json.empty()) {
    const json qroot = parse_json(quant_config_json, quant_file);
    const Reader qr{qroot, quant_file, ""};
    read_modelopt(qr.child("quantization"), cfg);
  } else {
    check(top.has("quantization_config"), where,
          ": no quantization description: expected hf_quant_config.json (ModelOpt) or a "
          "\"quantization_config\" in config.json");
    const Reader q = top.child("quantization_config");
    const std::string method = q.string("quant_method");
    if (method == "compressed-tensors") {
      read_compressed_tensors(q, cfg);
    } else if (method == "modelopt") {
      read_modelopt(q.has("quantization") ? q.child("quantization") : q, cfg);
    } else if (method == "mxfp4") {
      read_mxfp4(q, cfg);
    } else {
      throw Error(detail::concat(config_file, ": 'quantization_config.quant_method' must be \"modelopt\", "
                                              "\"compressed-tensors\" or \"mxfp4\", got \"", method, "\""));
    }
  }

  // (3) family
  cfg.model_type = top.string("model_type");
  try {
    cfg.family = family_of_model_type(cfg.model_type);
  } catch (const Error& e) {
    throw Error(detail::concat(config_file, ": 'model_type': ", e.what()));
  }
  // The MXFP4 layout (fused expert blocks and scales) is gpt-oss's, and gpt-oss's experts are read in
  // that layout only.
  const bool mxfp4 = cfg.format == CheckpointFormat::Mxfp4;
  check(mxfp4 == (cfg.family == ModelFamily::GptOss), config_file,
        mxfp4 ? detail::concat(": quant_method \"mxfp4\" is loaded for model_type \"gpt_oss\" only (the gpt-oss "
                               "expert layout), got model_type \"", cfg.model_type, "\"")
              : detail::concat(": model_type \"gpt_oss\" is loaded from its MXFP4 layout only "
                               "(quantization_config.quant_method \"mxfp4\"), got a ", to_string(cfg.format),
                               " description"));
  const json* text = &root;
  std::string text_path;
  if (cfg.model_type == "llama4" && top.has("text_config")) {
    text = &root.at("text_config");
    check(text->is_object(), config_file, ": 'text_config' must be an object");
    text_path = "text_config.";
    const Reader tc{*text, config_file, text_path};
    cfg.model_type = tc.string_or("model_type", cfg.model_type);
  }
  const Reader c{*text, config_file, text_path};

  // (4) sizes and routing
  constexpr int64_t kMaxSize = int64_t(1) << 20, kMaxExperts = int64_t(1) << 16;
  cfg.num_layers = c.integer("num_hidden_layers", 1, kMaxExperts);
  MoeProblem& p = cfg.problem;
  p.hidden = c.integer("hidden_size", 1, kMaxSize);
  const char* experts_key = c.has("n_routed_experts")    ? "n_routed_experts"
                            : c.has("num_local_experts") ? "num_local_experts"
                                                         : "num_experts";
  p.num_experts = c.integer(experts_key, 1, kMaxExperts);
  const char* inter_key = c.has("moe_intermediate_size") ? "moe_intermediate_size" : "intermediate_size";
  if (cfg.family == ModelFamily::Llama4 && c.has("intermediate_size")) inter_key = "intermediate_size";
  p.inter = c.integer(inter_key, 1, kMaxSize);
  const char* top_k_key =
      cfg.family == ModelFamily::GptOss && !c.has("num_experts_per_tok") ? "experts_per_token" : "num_experts_per_tok";
  p.routing.top_k = static_cast<int>(
      c.integer_or(top_k_key, cfg.family == ModelFamily::Llama4 ? 1 : -1, 1, kMaxExperts));
  check(p.routing.top_k >= 1, config_file, ": missing required key '", text_path, "num_experts_per_tok'");
  const std::string act = c.string_or("hidden_act", "silu");
  check(act == "silu", config_file, ": '", text_path, "hidden_act' must be \"silu\" (swiglu experts), got \"", act,
        "\"");
  p.activation.kind = Activation::SwiGLU;

  switch (cfg.family) {
    case ModelFamily::DeepSeekV3: {
      const std::string scoring = c.string_or("scoring_func", "sigmoid");
      check(scoring == "sigmoid", config_file, ": '", text_path,
            "scoring_func' must be \"sigmoid\" for deepseek_v3 routing, got \"", scoring, "\"");
      const std::string topk_method = c.string_or("topk_method", "noaux_tc");
      check(topk_method == "noaux_tc", config_file, ": '", text_path,
            "topk_method' must be \"noaux_tc\" for deepseek_v3 routing, got \"", topk_method, "\"");
      check(c.boolean_or("norm_topk_prob", true), config_file, ": '", text_path,
            "norm_topk_prob' false is not supported (deepseek_v3 routing normalizes the top-k weights)");
      p.routing.method = RoutingMethod::DeepSeekV3;
      p.routing.n_group = static_cast<int>(c.integer_or("n_group", 1, 1, kMaxExperts));
      p.routing.topk_group = static_cast<int>(c.integer_or("topk_group", 1, 1, kMaxExperts));
      const double scale = c.number_or("routed_scaling_factor", 1.0);
      check(scale > 0 && scale < 1e6, config_file, ": '", text_path,
            "routed_scaling_factor' must be in (0, 1e6), got ", scale);
      p.routing.routed_scaling_factor = static_cast<float>(scale);
      cfg.first_k_dense_replace = c.integer_or("first_k_dense_replace", 0, 0, cfg.num_layers);
      cfg.moe_layer_freq = c.integer_or("moe_layer_freq", 1, 1, kMaxExperts);
      cfg.n_shared_experts = c.integer_or("n_shared_experts", 0, 0, kMaxExperts);
      break;
    }
    case ModelFamily::Qwen3Moe:
      p.routing.method = c.boolean_or("norm_topk_prob", false) ? RoutingMethod::Renormalize : RoutingMethod::Default;
      cfg.moe_layer_freq = c.integer_or("decoder_sparse_step", 1, 1, kMaxExperts);
      cfg.mlp_only_layers = c.integers_or_empty("mlp_only_layers", 0, cfg.num_layers - 1);
      break;
    case ModelFamily::Llama4:
      p.routing.method = RoutingMethod::Llama4;
      p.routing.apply_router_weight_on_input = true;
      check(p.routing.top_k == 1, config_file, ": '", text_path,
            "num_experts_per_tok' must be 1 for llama4 routing, got ", p.routing.top_k);
      cfg.moe_layer_freq = c.integer_or("interleave_moe_layer_step", 1, 1, kMaxExperts);
      cfg.moe_layers = c.integers_or_empty("moe_layers", 0, cfg.num_layers - 1);
      cfg.n_shared_experts = 1;
      break;
    case ModelFamily::Mixtral:
      p.routing.method = RoutingMethod::Renormalize;
      break;
    case ModelFamily::GptOss: {
      // transformers' GptOssTopKRouter: top-k of the logits (x . W^T + b), softmax over the k. The
      // experts: gate' = min(gate, limit), up' = clamp(up, -limit, limit),
      // gate' * sigmoid(1.702 gate') * (up' + 1); alpha 1.702 is fixed by the model, limit is
      // config.json's swiglu_limit.
      p.routing.method = RoutingMethod::Renormalize;
      p.activation.kind = Activation::SwiGLUOai;
      p.activation.swiglu_alpha = 1.702f;
      p.activation.swiglu_beta = 1.0f;
      const double limit = c.number_or("swiglu_limit", 7.0);
      check(limit > 0 && limit < 1e30, config_file, ": '", text_path, "swiglu_limit' must be in (0, 1e30), got ",
            limit);
      p.activation.swiglu_limit = static_cast<float>(limit);
      break;
    }
  }
  try {
    p.validate();
  } catch (const Error& e) {
    throw Error(config_file + ": the MoE layer it describes is not valid: " + e.what());
  }
  return cfg;
}

}  // namespace fp4moe::io
