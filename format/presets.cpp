// format/presets.cpp — the model presets (docs/architecture.md, "Interfaces").
//
// Each preset is a table row (name, E, H, I, k, routing, activation, weight format); preset() copies the
// row into a MoeProblem, sets the caller's quantization mode and validates it. Unknown names list the
// known ones; a mode an MXFP4 preset cannot run (anything but w4a16) names the preset and its NVFP4
// stand-in where there is one.
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "fp4moe/error.hpp"
#include "fp4moe/presets.hpp"

namespace fp4moe {
namespace {

struct PresetRow {
  std::string_view name;
  int64_t experts, hidden, inter;
  RoutingParams routing;
  ActivationParams activation;
  WeightFormat weights = WeightFormat::NVFP4;
};

RoutingParams routing_of(RoutingMethod m, int k, int n_group = 1, int topk_group = 1,
                         float scale = 1.0f, bool weight_on_input = false) {
  RoutingParams r;
  r.method = m;
  r.top_k = k;
  r.n_group = n_group;
  r.topk_group = topk_group;
  r.routed_scaling_factor = scale;
  r.apply_router_weight_on_input = weight_on_input;
  return r;
}

ActivationParams act_of(Activation a, float alpha = 1.702f, float beta = 1.0f, float limit = 7.0f) {
  ActivationParams p;
  p.kind = a;
  p.swiglu_alpha = alpha;
  p.swiglu_beta = beta;
  p.swiglu_limit = limit;
  return p;
}

const std::vector<PresetRow>& rows() {
  static const std::vector<PresetRow> table = {
      {"deepseek-r1", 256, 7168, 2048, routing_of(RoutingMethod::DeepSeekV3, 8, 8, 4, 2.5f),
       act_of(Activation::SwiGLU)},
      {"qwen3-30b-a3b", 128, 2048, 768, routing_of(RoutingMethod::Renormalize, 8),
       act_of(Activation::SwiGLU)},
      {"qwen3-235b-a22b", 128, 4096, 1536, routing_of(RoutingMethod::Renormalize, 8),
       act_of(Activation::SwiGLU)},
      {"llama4-scout", 16, 5120, 8192, routing_of(RoutingMethod::Llama4, 1, 1, 1, 1.0f, true),
       act_of(Activation::SwiGLU)},
      // gpt-oss checkpoints are MXFP4 (w4a16); the -nvfp4 row is the same layer with NVFP4 weights.
      {"gpt-oss-120b", 128, 2880, 2880, routing_of(RoutingMethod::Renormalize, 4),
       act_of(Activation::SwiGLUOai, 1.702f, 1.0f, 7.0f), WeightFormat::MXFP4},
      {"gpt-oss-20b", 32, 2880, 2880, routing_of(RoutingMethod::Renormalize, 4),
       act_of(Activation::SwiGLUOai, 1.702f, 1.0f, 7.0f), WeightFormat::MXFP4},
      {"gpt-oss-120b-nvfp4", 128, 2880, 2880, routing_of(RoutingMethod::Renormalize, 4),
       act_of(Activation::SwiGLUOai, 1.702f, 1.0f, 7.0f)},
      // Models built like a preset above (checkpoint families in fp4moe/checkpoint.hpp): Kimi-K2 and
      // GLM-4.6 route like DeepSeek-V3 with one group, Qwen3-Next like Qwen3 with 512 narrow experts.
      {"kimi-k2", 384, 7168, 2048, routing_of(RoutingMethod::DeepSeekV3, 8, 1, 1, 2.827f),
       act_of(Activation::SwiGLU)},
      {"glm-4.6", 160, 5120, 1536, routing_of(RoutingMethod::DeepSeekV3, 8, 1, 1, 2.5f),
       act_of(Activation::SwiGLU)},
      {"qwen3-next-80b-a3b", 512, 2048, 512, routing_of(RoutingMethod::Renormalize, 10),
       act_of(Activation::SwiGLU)},
      // Small enough for the CPU reference to run in well under a second.
      {"tiny", 8, 256, 128, routing_of(RoutingMethod::Renormalize, 2), act_of(Activation::SwiGLU)},
  };
  return table;
}

}  // namespace

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const auto& r : rows()) names.emplace_back(r.name);
  return names;
}

WeightFormat preset_weight_format(std::string_view name) {
  for (const auto& r : rows())
    if (r.name == name) return r.weights;
  return preset(name).weight_format;  // unknown: preset's error lists the names
}

MoeProblem preset(std::string_view name, ActQuant mode) {
  for (const auto& r : rows()) {
    if (r.name != name) continue;
    MoeProblem p;
    p.num_experts = r.experts;
    p.hidden = r.hidden;
    p.inter = r.inter;
    p.routing = r.routing;
    p.activation = r.activation;
    p.act_quant = mode;
    p.weight_format = r.weights;
    if (r.weights == WeightFormat::MXFP4 && mode != ActQuant::W4A16) {
      const std::string stand_in = detail::concat(name, "-nvfp4");
      bool has_stand_in = false;
      for (const auto& o : rows()) has_stand_in = has_stand_in || o.name == stand_in;
      throw Error(detail::concat("preset '", name, "' has mxfp4 weights, which run in mode w4a16 only, got ",
                                 to_string(mode), has_stand_in ? detail::concat(" (its NVFP4 stand-in '", stand_in,
                                                                               "' takes every mode)") : std::string()));
    }
    p.validate();
    return p;
  }
  std::ostringstream known;
  const auto names = preset_names();
  for (size_t i = 0; i < names.size(); ++i) known << (i ? ", " : "") << names[i];
  throw Error(detail::concat("preset: unknown model name '", name, "', expected one of: ", known.str()));
}

}  // namespace fp4moe
