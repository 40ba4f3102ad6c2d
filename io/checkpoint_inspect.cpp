// io/checkpoint_inspect.cpp — `fp4moe inspect`: structure, scale statistics and problems of a checkpoint.
//
// Steps: (1) open the checkpoint (config + index); a failure is the one problem reported; (2) list the
// MoE layers of the config and load each one (all checks of load_layer), recording each failure and
// the fusion report; (3) find shared experts by name; (4) scale statistics per tensor kind
// (weight_scale e4m3 blocks, weight_scale_2 / input_scale, or the compressed-tensors global scales as
// stored; gpt-oss: the ue8m0 gate_up_proj_scales / down_proj_scales as 2^(c - 127), code 255 counted
// non-finite) over every tensor of that kind, each shard opened once; an unreadable shard is a problem.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>
#include <sstream>

#include "fp4moe/checkpoint.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/safetensors.hpp"

namespace fp4moe::io {

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

const char* kScaleKinds[] = {"weight_scale_2", "weight_global_scale", "input_global_scale", "input_scale",
                             "weight_scale", "gate_up_proj_scales", "down_proj_scales"};

bool is_ue8m0_kind(const std::string& kind) { return kind == "gate_up_proj_scales" || kind == "down_proj_scales"; }

void add_value(ScaleStats& s, double v, bool negative) {
  ++s.count;
  if (!std::isfinite(v)) {
    ++s.non_finite;
    return;
  }
  if (v == 0.0) ++s.zeros;
  if (negative) ++s.negative;
  if (s.count - s.non_finite == 1) s.min = s.max = v;
  s.min = std::min(s.min, v);
  s.max = std::max(s.max, v);
}

}  // namespace

InspectReport inspect_checkpoint(const std::string& dir, int64_t max_layers) {
  InspectReport r;
  r.dir = dir;
  std::set<std::string> seen;
  auto problem = [&](const std::string& m) {
    if (seen.insert(m).second) r.problems.push_back(m);
  };
  std::unique_ptr<Checkpoint> ck;
  try {
    ck = std::make_unique<Checkpoint>(Checkpoint::open(dir));
  } catch (const Error& e) {
    problem(e.what());
    return r;
  }
  r.config = ck->config();
  r.config_ok = true;

  // (2) layers
  ScaleFusionReport fusion;
  for (int64_t L = 0; L < r.config.num_layers; ++L) {
    if (!r.config.is_moe_layer(L)) continue;
    r.moe_layers.push_back(L);
    if (max_layers >= 0 && static_cast<int64_t>(r.loaded_layers.size()) >= max_layers) continue;
    try {
      const MoeLayerWeights w = ck->load_layer(L);
      r.loaded_layers.push_back(L);
      fusion.experts_rescaled += w.fusion.experts_rescaled;
      fusion.block_scales_changed += w.fusion.block_scales_changed;
      fusion.worst_relative_change = std::max(fusion.worst_relative_change, w.fusion.worst_relative_change);
    } catch (const Error& e) {
      problem(e.what());
    }
  }
  if (r.moe_layers.empty()) problem(dir + ": the config describes no MoE layer");
  r.fusion = fusion;

  // (3) shared experts
  for (const auto& [name, file] : ck->weight_map()) {
    for (const char* tag : {".shared_experts.", ".shared_expert."}) {
      const size_t pos = name.find(tag);
      if (pos != std::string::npos) r.shared_experts.insert(name.substr(0, pos + std::strlen(tag) - 1));
    }
  }

  // (4) scale statistics, shard by shard
  std::map<std::string, std::vector<std::string>> by_file;
  for (const auto& [name, file] : ck->weight_map()) {
    for (const char* kind : kScaleKinds)
      if (ends_with(name, std::string(".") + kind)) {
        by_file[file].push_back(name);
        break;
      }
  }
  for (const auto& [file, names] : by_file) {
    try {
      const SafetensorsFile f = SafetensorsFile::open(dir + "/" + file);
      for (const std::string& name : names) {
        if (!f.contains(name)) continue;  // load_layer reports it where it matters
        const TensorView& t = f.tensor(name);
        std::string kind;
        for (const char* k : kScaleKinds)
          if (ends_with(name, std::string(".") + k)) {
            kind = k;
            break;
          }
        ScaleStats& s = r.scale_stats[kind];
        ++s.tensors;
        const auto* p = reinterpret_cast<const uint8_t*>(t.data.data());
        if (is_ue8m0_kind(kind) && t.dtype == DType::U8) {
          for (size_t i = 0; i < t.data.size(); ++i) add_value(s, format::ue8m0_to_float(p[i]), false);
        } else if (t.dtype == DType::F8_E4M3) {
          for (size_t i = 0; i < t.data.size(); ++i)
            add_value(s, format::e4m3_to_float(p[i]), (p[i] & 0x80) != 0 && p[i] != 0x80);
        } else if (t.dtype == DType::F32) {
          for (int64_t i = 0; i < t.numel(); ++i) {
            float v;
            std::memcpy(&v, p + 4 * i, 4);
            add_value(s, v, v < 0.0f);
          }
        } else {
          problem(detail::concat(f.path(), ": tensor '", name, "': a scale of dtype ", to_string(t.dtype),
                                 is_ue8m0_kind(kind) ? " (expected U8 ue8m0 codes)" : " (expected F8_E4M3 or F32)"));
        }
      }
    } catch (const Error& e) {
      problem(e.what());
    }
  }
  return r;
}

std::string InspectReport::to_text() const {
  std::ostringstream os;
  os << "checkpoint: " << dir << "\n";
  if (config_ok) {
    const MoeProblem& p = config.problem;
    const bool mx = p.weight_format == WeightFormat::MXFP4;
    const int64_t blk = p.weight_block();
    os << "format:     " << to_string(config.format) << (mx ? " MXFP4 (group 32, ue8m0 scales" : " NVFP4 (group 16")
       << ", act_quant " << to_string(p.act_quant) << ")\n";
    os << "model:      " << config.model_type << " (family " << to_string(config.family) << "), "
       << config.num_layers << " layers\n";
    os << "moe layers: " << moe_layers.size();
    if (!moe_layers.empty()) os << " (" << moe_layers.front() << ".." << moe_layers.back() << ")";
    os << ", loaded cleanly: " << loaded_layers.size() << "\n";
    os << "experts:    " << p.num_experts << " routed, top-k " << p.top_k();
    if (!shared_experts.empty()) os << ", shared experts in " << shared_experts.size() << " layers (not part of the routed MoE)";
    os << "\n";
    os << "shapes:     w13 [" << p.num_experts << ", " << 2 * p.inter << ", " << p.hidden / 2 << "] w13_scale ["
       << p.num_experts << ", " << 2 * p.inter << ", " << p.hidden / blk << "] w2 [" << p.num_experts << ", "
       << p.hidden << ", " << p.inter / 2 << "] w2_scale [" << p.num_experts << ", " << p.hidden << ", "
       << p.inter / blk << "] router [" << p.num_experts << ", " << p.hidden << "]";
    if (config.family == ModelFamily::GptOss)
      os << " router_bias [" << p.num_experts << "] w13_bias [" << p.num_experts << ", " << 2 * p.inter
         << "] w2_bias [" << p.num_experts << ", " << p.hidden << "]";
    os << "\n";
    os << "activation: " << to_string(p.activation.kind);
    if (p.activation.kind == Activation::SwiGLUOai)
      os << " (alpha " << p.activation.swiglu_alpha << ", beta " << p.activation.swiglu_beta << ", limit "
         << p.activation.swiglu_limit << ")";
    if (config.family == ModelFamily::GptOss) os << ", gate/up rows interleaved in the files (loaded as [gate; up])";
    os << "\n";
    os << "problem:    " << p.describe() << "\n";
    if (!mx) os << "w1/w3 fusion: " << fusion.experts_rescaled << " experts with different gate/up weight_scale_2, "
       << fusion.block_scales_changed << " block scales changed, worst relative change "
       << fusion.worst_relative_change << "\n";
    os << "scales (as stored):\n";
    for (const auto& [kind, s] : scale_stats) {
      os << "  " << kind << ": " << s.tensors << " tensors, " << s.count << " values, min " << s.min << ", max "
         << s.max << ", zeros " << s.zeros << ", negative " << s.negative << ", non-finite " << s.non_finite << "\n";
    }
  }
  if (problems.empty()) {
    os << "problems:   none\n";
  } else {
    os << "problems:   " << problems.size() << "\n";
    for (const auto& m : problems) os << "  - " << m << "\n";
  }
  os << (servable() ? "servable:   yes\n" : "servable:   NO\n");
  return os.str();
}

}  // namespace fp4moe::io
