// io/checkpoint.cpp — opening a checkpoint directory and loading one MoE layer.
//
// Open: (1) read config.json and hf_quant_config.json (when present) and parse them
// (parse_checkpoint_config); (2) read model.safetensors.index.json ("weight_map") and check that
// every shard it names is a plain relative path that exists, or, without an index, open the single
// model.safetensors and list its tensors; (3) llama4: find whether names carry "language_model.".
// Load layer L: (1) refuse dense / out-of-range layers and a bad expert- or tensor-parallel split; (2) check the
// expert ids present under the layer's prefix against the config's expert count; (3) per local expert
// and projection read the packed weight, the e4m3 block scales (no NaN, no sign bit), scale_2 and the
// input scale (finite and > 0; compressed-tensors values inverted in fp32), with dtype and shape
// checked against the config (so shapes are consistent across experts); (4) fuse gate and up into
// w13 under one scale_2 (policy of LoadOptions), keeping only this tensor-parallel rank's columns of I
// (rows of gate / up, columns of down: io::tensor_parallel_range), so that a rank never holds more
// than its share; (5) read the router weight (bf16 [E, H]) and the DeepSeek score-correction bias.
// gpt_oss (MXFP4, load_gpt_oss_experts): the six fused expert tensors of the layer, dtype and shape
// checked, the local experts' ue8m0 codes checked (no 255), the interleaved gate/up rows (and bias)
// de-interleaved into [gate; up] while copying this rank's rows / columns; the biases widened to
// fp32; then the router weight and its bias.
// Shards are opened lazily and only once; every error names the file and the tensor.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include <fnmatch.h>
#include <nlohmann/json.hpp>
#include <regex>

#include "fp4moe/checkpoint.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/safetensors.hpp"
#include "fp4moe/weight_layout.hpp"

namespace fp4moe::io {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr size_t kMaxConfigBytes = 64u << 20;

std::string read_text(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  check(f.good(), p.string(), ": cannot open for reading");
  f.seekg(0, std::ios::end);
  const std::streamoff size = f.tellg();
  check(size >= 0 && static_cast<size_t>(size) <= kMaxConfigBytes, p.string(), ": size ", size,
        " bytes is not a plausible JSON config (limit ", kMaxConfigBytes, ")");
  f.seekg(0);
  std::string s(static_cast<size_t>(size), '\0');
  f.read(s.data(), size);
  check(f.good() || f.eof(), p.string(), ": read failed");
  return s;
}

bool starts_with(const std::string& s, const std::string& p) { return s.compare(0, p.size(), p) == 0; }

}  // namespace

struct Checkpoint::Impl {
  std::string dir;
  CheckpointConfig config;
  std::map<std::string, std::string> weight_map;  // tensor -> shard file (relative)
  std::string index_name;                         // "model.safetensors.index.json" or empty
  bool language_model_prefix = false;             // llama4
  mutable std::map<std::string, std::unique_ptr<SafetensorsFile>> shards;

  const SafetensorsFile& shard(const std::string& file) const {
    auto it = shards.find(file);
    if (it == shards.end()) {
      auto f = std::make_unique<SafetensorsFile>(SafetensorsFile::open((fs::path(dir) / file).string()));
      it = shards.emplace(file, std::move(f)).first;
    }
    return *it->second;
  }

  bool has(const std::string& name) const { return weight_map.count(name) != 0; }

  // The tensor `name` (dtype and shape checked when given). Errors name the file and the tensor.
  const TensorView& tensor(const std::string& name) const {
    auto it = weight_map.find(name);
    if (it == weight_map.end())
      throw Error(detail::concat(dir, ": missing tensor '", name, "' (not in ",
                                 index_name.empty() ? "model.safetensors" : index_name, ")"));
    const SafetensorsFile& f = shard(it->second);
    if (!f.contains(name))
      throw Error(detail::concat(f.path(), ": tensor '", name, "' is listed in ", index_name,
                                 " for this file but the file does not hold it"));
    return f.tensor(name);
  }
  std::string file_of(const std::string& name) const {
    auto it = weight_map.find(name);
    return it == weight_map.end() ? dir : (fs::path(dir) / it->second).string();
  }
  const TensorView& tensor(const std::string& name, DType dtype, const std::vector<int64_t>& shape,
                           const char* why) const {
    const TensorView& t = tensor(name);
    check(t.dtype == dtype, file_of(name), ": tensor '", name, "': expected dtype ", to_string(dtype), ", got ",
          to_string(t.dtype));
    check(t.shape == shape, file_of(name), ": tensor '", name, "': expected shape ", shape_string(shape), " (", why,
          "), got ", shape_string(t.shape));
    return t;
  }
  // An F32 scalar scale (shape [] or [1]), finite and > 0; `invert`: the file holds the quantize
  // direction, return 1.0f / value.
  float scale(const std::string& name, bool invert) const {
    const TensorView& t = tensor(name);
    check(t.dtype == DType::F32, file_of(name), ": tensor '", name, "': expected dtype F32, got ", to_string(t.dtype));
    check(t.shape.empty() || t.shape == std::vector<int64_t>{1}, file_of(name), ": tensor '", name,
          "': expected a scalar (shape [] or [1]), got shape ", shape_string(t.shape));
    float v;
    std::memcpy(&v, t.data.data(), sizeof v);
    check(std::isfinite(v) && v > 0.0f, file_of(name), ": tensor '", name,
          "': a scale must be finite and > 0, got ", v);
    if (invert) {
      const float r = 1.0f / v;
      check(std::isfinite(r) && r > 0.0f, file_of(name), ": tensor '", name, "': 1 / ", v,
            " (dequant direction) is not a finite positive scale");
      return r;
    }
    return v;
  }

  // The router weight `name`, bf16 [E, H], each element finite, into w.router_weight.
  void read_router(const std::string& name, int64_t E, int64_t H, MoeLayerWeights& w) const {
    const TensorView& r = tensor(name, DType::BF16, {E, H}, "[E, H] from config.json");
    w.router_weight.resize(E * H);
    std::memcpy(w.router_weight.data(), r.data.data(), r.data.size());
    for (int64_t i = 0; i < E * H; ++i)
      check((w.router_weight[i] & 0x7F80) != 0x7F80, file_of(name), ": tensor '", name, "': element ", i,
            " is not finite");
  }

  std::string layer_prefix(int64_t layer) const {
    const std::string l = std::to_string(layer);
    switch (config.family) {
      case ModelFamily::DeepSeekV3:
      case ModelFamily::Qwen3Moe:
      case ModelFamily::GptOss: return "model.layers." + l + ".mlp";
      case ModelFamily::Llama4:
        return (language_model_prefix ? "language_model.model.layers." : "model.layers.") + l + ".feed_forward";
      case ModelFamily::Mixtral: return "model.layers." + l + ".block_sparse_moe";
    }
    return {};
  }
  std::string router_name(int64_t layer) const {
    const bool router = config.family == ModelFamily::Llama4 || config.family == ModelFamily::GptOss;
    return layer_prefix(layer) + (router ? ".router.weight" : ".gate.weight");
  }
};

namespace {

// Names of the three projections: gate, up, down.
// The modules the quantization config leaves unquantized (ModelOpt exclude_modules: names with
// fnmatch wildcards; compressed-tensors ignore: names, or "re:" regular expressions matched whole).
class ExcludedModules {
 public:
  ExcludedModules(const std::vector<std::string>& patterns, const std::string& where) {
    for (const std::string& p : patterns) {
      if (p.rfind("re:", 0) == 0) {
        try {
          regexes_.emplace_back(p, std::regex(p.substr(3), std::regex::ECMAScript));
        } catch (const std::regex_error& e) {
          throw Error(detail::concat(where, ": excluded module pattern '", p, "' is not a valid regular expression (",
                                     e.what(), ")"));
        }
      } else {
        globs_.push_back(p);
      }
    }
  }
  // The pattern that excludes module `name`, or "".
  std::string pattern_of(const std::string& name) const {
    for (const std::string& g : globs_)
      if (fnmatch(g.c_str(), name.c_str(), 0) == 0) return g;
    for (const auto& [text, re] : regexes_)
      if (std::regex_match(name, re)) return text;
    return {};
  }

 private:
  std::vector<std::string> globs_;
  std::vector<std::pair<std::string, std::regex>> regexes_;
};

struct ProjNames {
  const char* gate;
  const char* up;
  const char* down;
};
ProjNames proj_names(ModelFamily f) {
  if (f == ModelFamily::Mixtral) return {"w1", "w3", "w2"};
  return {"gate_proj", "up_proj", "down_proj"};
}

struct Projection {
  const TensorView* weight = nullptr;
  const TensorView* block_scale = nullptr;
  float scale_2 = 0, input_scale = 0;
};

// Checks the e4m3 block scales of one tensor: no NaN code, no sign bit.
void check_block_scales(const Checkpoint::Impl& ck, const std::string& name, const TensorView& t) {
  const auto* p = reinterpret_cast<const uint8_t*>(t.data.data());
  for (size_t i = 0; i < t.data.size(); ++i) {
    const uint8_t c = p[i];
    if ((c & 0x7F) == 0x7F)
      throw Error(detail::concat(ck.file_of(name), ": tensor '", name, "': block scale ", i,
                                 " is NaN (e4m3 code 0x", std::hex, int(c), ")"));
    if ((c & 0x80) != 0)
      throw Error(detail::concat(ck.file_of(name), ": tensor '", name, "': block scale ", i, " is negative (",
                                 format::e4m3_to_float(c), ")"));
  }
}

Projection read_projection(const Checkpoint::Impl& ck, const std::string& base, int64_t out, int64_t in,
                           const char* why) {
  const bool ct = ck.config.format == CheckpointFormat::CompressedTensors;
  const bool w4a4 = ck.config.problem.act_quant != ActQuant::W4A16;
  Projection p;
  p.weight = &ck.tensor(base + (ct ? ".weight_packed" : ".weight"), DType::U8, {out, in / 2}, why);
  const std::string sname = base + ".weight_scale";
  p.block_scale = &ck.tensor(sname, DType::F8_E4M3, {out, in / format::kBlockSize}, why);
  check_block_scales(ck, sname, *p.block_scale);
  p.scale_2 = ck.scale(base + (ct ? ".weight_global_scale" : ".weight_scale_2"), ct);
  p.input_scale = w4a4 ? ck.scale(base + (ct ? ".input_global_scale" : ".input_scale"), ct) : 1.0f;
  return p;
}

// Copies rows [row_begin, row_end) x bytes [col_begin, col_end) of a row-major tensor whose rows are
// row_bytes long, packed, into dst.
void copy_block(const TensorView& t, int64_t row_bytes, int64_t row_begin, int64_t row_end, int64_t col_begin,
                int64_t col_end, uint8_t* dst) {
  const auto* src = reinterpret_cast<const uint8_t*>(t.data.data());
  const int64_t n = col_end - col_begin;
  if (n == row_bytes) {  // whole rows: one contiguous range
    std::memcpy(dst, src + row_begin * row_bytes, size_t((row_end - row_begin) * row_bytes));
    return;
  }
  for (int64_t r = row_begin; r < row_end; ++r, dst += n) std::memcpy(dst, src + r * row_bytes + col_begin, size_t(n));
}

// Re-expresses block scales (n bytes) from scale_2 `from` to scale_2 `to` (to > from).
void rescale_blocks(uint8_t* scales, int64_t n, float from, float to, ScaleFusionReport& rep) {
  const float ratio = from / to;
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t b = scales[i];
    const float f = format::e4m3_to_float(b);
    const uint8_t nb = format::e4m3_from_float(f * ratio);
    if (nb != b) ++rep.block_scales_changed;
    if (f > 0.0f) {
      const double before = static_cast<double>(f) * from;
      const double after = static_cast<double>(format::e4m3_to_float(nb)) * to;
      rep.worst_relative_change = std::max(rep.worst_relative_change, std::fabs(after - before) / before);
    }
    scales[i] = nb;
  }
}

// A bias or router bias: BF16 (as published) or F32 values of `shape`, widened to fp32, each finite.
std::vector<float> read_floats(const Checkpoint::Impl& ck, const std::string& name, const std::vector<int64_t>& shape,
                               const char* why) {
  const TensorView& t = ck.tensor(name);
  check(t.dtype == DType::BF16 || t.dtype == DType::F32, ck.file_of(name), ": tensor '", name,
        "': expected dtype BF16 or F32, got ", to_string(t.dtype));
  check(t.shape == shape, ck.file_of(name), ": tensor '", name, "': expected shape ", shape_string(shape), " (", why,
        "), got ", shape_string(t.shape));
  const int64_t n = t.numel();
  std::vector<float> v(static_cast<size_t>(n));
  if (t.dtype == DType::F32) {
    std::memcpy(v.data(), t.data.data(), size_t(n) * 4);
  } else {
    for (int64_t i = 0; i < n; ++i) {
      uint16_t b;
      std::memcpy(&b, t.data.data() + 2 * i, 2);
      v[size_t(i)] = format::bf16_to_float(b);
    }
  }
  for (int64_t i = 0; i < n; ++i)
    check(std::isfinite(v[size_t(i)]), ck.file_of(name), ": tensor '", name, "': element ", i, " is not finite (",
          v[size_t(i)], ")");
  return v;
}

// Refuses a ue8m0 NaN code (255) among the scales [E, rows, blocks] of experts [begin, end).
void check_ue8m0_codes(const Checkpoint::Impl& ck, const std::string& name, const TensorView& t, int64_t rows,
                       int64_t blocks, int64_t begin, int64_t end) {
  const auto* p = reinterpret_cast<const uint8_t*>(t.data.data());
  const int64_t per_expert = rows * blocks;
  const int64_t i = format::find_ue8m0_nan(p + begin * per_expert, (end - begin) * per_expert);
  if (i < 0) return;
  const int64_t e = begin + i / per_expert, r = (i % per_expert) / blocks, b = i % blocks;
  throw Error(detail::concat(ck.file_of(name), ": tensor '", name, "': expert ", e, " row ", r, " block ", b,
                             " has ue8m0 code 255 (NaN), which is not a scale"));
}

// gpt-oss: one layer's fused MXFP4 experts (see checkpoint.hpp for the layout).
void load_gpt_oss_experts(const Checkpoint::Impl& ck, int64_t layer, const std::string& prefix, int tp_rank,
                          MoeLayerWeights& w) {
  const CheckpointConfig& cfg = ck.config;
  const int64_t E = cfg.problem.num_experts, H = cfg.problem.hidden, I = cfg.problem.inter;
  const int64_t begin = w.expert_begin, end = w.expert_end, ib = w.inter_begin, ie = w.inter_end, part = ie - ib;
  const std::string experts = prefix + ".experts";
  {  // experts left unconverted are bf16, not MXFP4 (transformers matches these names as prefixes)
    const std::string where = "quantization_config.modules_to_not_convert of config.json";
    const ExcludedModules excluded(cfg.excluded_modules, ck.dir + ": " + where);
    for (std::string module = experts;;) {
      const std::string pattern = excluded.pattern_of(module);
      check(pattern.empty(), ck.dir, ": layer ", layer, ": expert module '", experts,
            "' is excluded from quantization by '", pattern, "' (", where, "); fp4moe runs MXFP4 experts only");
      const size_t dot = module.rfind('.');
      if (dot == std::string::npos) break;
      module.resize(dot);
    }
  }
  const std::string gu = experts + ".gate_up_proj", dn = experts + ".down_proj";
  const std::string why13 = detail::concat("[E, 2I, H/32, 16] = [", E, ", ", 2 * I, ", ", H / 32,
                                           ", 16] from config.json, gate and up rows interleaved");
  const std::string whys13 = detail::concat("[E, 2I, H/32] = [", E, ", ", 2 * I, ", ", H / 32, "] from config.json");
  const std::string why2 = detail::concat("[E, H, I/32, 16] = [", E, ", ", H, ", ", I / 32, ", 16] from config.json");
  const std::string whys2 = detail::concat("[E, H, I/32] = [", E, ", ", H, ", ", I / 32, "] from config.json");
  const TensorView& b13 = ck.tensor(gu + "_blocks", DType::U8, {E, 2 * I, H / 32, 16}, why13.c_str());
  const TensorView& s13 = ck.tensor(gu + "_scales", DType::U8, {E, 2 * I, H / 32}, whys13.c_str());
  const TensorView& b2 = ck.tensor(dn + "_blocks", DType::U8, {E, H, I / 32, 16}, why2.c_str());
  const TensorView& s2 = ck.tensor(dn + "_scales", DType::U8, {E, H, I / 32}, whys2.c_str());
  check_ue8m0_codes(ck, gu + "_scales", s13, 2 * I, H / 32, begin, end);
  check_ue8m0_codes(ck, dn + "_scales", s2, H, I / 32, begin, end);
  const std::vector<float> bias13 = read_floats(ck, gu + "_bias", {E, 2 * I}, "[E, 2I] from config.json");
  const std::vector<float> bias2 = read_floats(ck, dn + "_bias", {E, H}, "[E, H] from config.json");

  const auto* pb13 = reinterpret_cast<const uint8_t*>(b13.data.data());
  const auto* ps13 = reinterpret_cast<const uint8_t*>(s13.data.data());
  const int64_t row_w = H / 2, row_s = H / 32;  // bytes of one w13 row: packed codes, scales
  for (int64_t e = begin; e < end; ++e) {
    const int64_t l = e - begin;
    uint8_t* w13 = w.w13.data() + l * 2 * part * row_w;
    uint8_t* sc13 = w.w13_scale.data() + l * 2 * part * row_s;
    float* bs13 = w.w13_bias.data() + l * 2 * part;
    for (int64_t j = 0; j < part; ++j) {
      for (int64_t half = 0; half < 2; ++half) {  // 0: gate (file row 2i), 1: up (file row 2i + 1)
        const int64_t src = e * 2 * I + 2 * (ib + j) + half, dst = half * part + j;
        std::memcpy(w13 + dst * row_w, pb13 + src * row_w, size_t(row_w));
        std::memcpy(sc13 + dst * row_s, ps13 + src * row_s, size_t(row_s));
        bs13[dst] = bias13[size_t(src)];
      }
    }
    // down [H, I]: the columns [ib, ie) of every row (whole 32-blocks).
    copy_block(b2, I / 2, e * H, (e + 1) * H, ib / 2, ie / 2, w.w2.data() + l * H * (part / 2));
    copy_block(s2, I / 32, e * H, (e + 1) * H, ib / 32, ie / 32, w.w2_scale.data() + l * H * (part / 32));
  }
  if (tp_rank == 0)  // added once per output: with tensor-parallel rank 0
    w.w2_bias.assign(bias2.begin() + begin * H, bias2.begin() + end * H);
  else
    w.w2_bias.clear();
}

}  // namespace

std::pair<int64_t, int64_t> expert_range(int64_t num_experts, int rank, int size) {
  check(size >= 1 && size <= num_experts, "expert parallelism: ep_size must be in [1, E=", num_experts, "], got ",
        size);
  check(rank >= 0 && rank < size, "expert parallelism: ep_rank must be in [0, ", size, "), got ", rank);
  const int64_t base = num_experts / size, rem = num_experts % size;
  const int64_t begin = rank * base + std::min<int64_t>(rank, rem);
  return {begin, begin + base + (rank < rem ? 1 : 0)};
}

Checkpoint::Checkpoint(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Checkpoint::Checkpoint(Checkpoint&&) noexcept = default;
Checkpoint& Checkpoint::operator=(Checkpoint&&) noexcept = default;
Checkpoint::~Checkpoint() = default;
const std::string& Checkpoint::dir() const { return impl_->dir; }
const CheckpointConfig& Checkpoint::config() const { return impl_->config; }
const std::map<std::string, std::string>& Checkpoint::weight_map() const { return impl_->weight_map; }
std::string Checkpoint::layer_prefix(int64_t layer) const { return impl_->layer_prefix(layer); }

Checkpoint Checkpoint::open(const std::string& dir) {
  auto impl = std::make_unique<Impl>();
  impl->dir = dir;
  const fs::path d(dir);
  std::error_code ec;
  check(fs::is_directory(d, ec), dir, ": not a directory");
  const fs::path config_path = d / "config.json";
  check(fs::exists(config_path, ec), dir, ": no config.json");
  const std::string config = read_text(config_path);
  const fs::path quant_path = d / "hf_quant_config.json";
  std::string quant;
  if (fs::exists(quant_path, ec)) {
    quant = read_text(quant_path);
    check(!quant.empty(), quant_path.string(), ": empty file");
  }
  impl->config = parse_checkpoint_config(config, quant, dir);

  const fs::path index_path = d / "model.safetensors.index.json";
  if (fs::exists(index_path, ec)) {
    impl->index_name = "model.safetensors.index.json";
    const std::string text = read_text(index_path);
    const std::string where = index_path.string();
    json root;
    try {
      root = json::parse(text);
    } catch (const json::exception& e) {
      throw Error(where + ": invalid JSON: " + e.what());
    }
    check(root.is_object() && root.contains("weight_map") && root.at("weight_map").is_object(), where,
          ": expected an object with a \"weight_map\" object (tensor name -> shard file)");
    std::map<std::string, bool> checked;
    for (auto it = root.at("weight_map").begin(); it != root.at("weight_map").end(); ++it) {
      check(it.value().is_string(), where, ": weight_map entry '", it.key(), "' must be a file name string, got ",
            it.value().dump());
      const std::string file = it.value().get<std::string>();
      const fs::path rel(file);
      bool plain = !file.empty() && rel.is_relative();
      for (const auto& part : rel) plain = plain && part != "..";
      check(plain, where, ": tensor '", it.key(), "' maps to '", file,
            "', which is not a relative path inside the checkpoint directory");
      auto [c, inserted] = checked.emplace(file, false);
      if (inserted) c->second = fs::is_regular_file(d / rel, ec);
      check(c->second, where, ": tensor '", it.key(), "' maps to '", file, "', which does not exist in ", dir);
      impl->weight_map.emplace(it.key(), file);
    }
    check(!impl->weight_map.empty(), where, ": weight_map is empty");
  } else {
    const fs::path single = d / "model.safetensors";
    check(fs::exists(single, ec), dir, ": no model.safetensors.index.json and no model.safetensors");
    const SafetensorsFile& f = impl->shard("model.safetensors");
    for (const auto& [name, t] : f.tensors()) impl->weight_map.emplace(name, "model.safetensors");
  }
  if (impl->config.family == ModelFamily::Llama4) {
    auto it = impl->weight_map.lower_bound("language_model.model.layers.");
    impl->language_model_prefix =
        it != impl->weight_map.end() && starts_with(it->first, "language_model.model.layers.");
  }
  return Checkpoint(std::move(impl));
}

MoeLayerWeights Checkpoint::load_layer(int64_t layer, const LoadOptions& options) const {
  const Impl& ck = *impl_;
  const CheckpointConfig& cfg = ck.config;
  const std::string reason = cfg.dense_reason(layer);
  check(reason.empty(), ck.dir, ": layer ", layer, " is ", reason, ": it has no routed experts");
  const int64_t E = cfg.problem.num_experts, H = cfg.problem.hidden, I = cfg.problem.inter;
  const auto [begin, end] = expert_range(E, options.ep_rank, options.ep_size);
  const auto [inter_begin, inter_end] =
      tensor_parallel_range(I, options.tp_rank, options.tp_size, cfg.problem.weight_block());
  const std::string prefix = ck.layer_prefix(layer);
  if (cfg.family == ModelFamily::GptOss) {
    MoeLayerWeights w;
    w.layer = layer;
    w.total_experts = E;
    w.expert_begin = begin;
    w.expert_end = end;
    w.problem = cfg.problem;
    w.problem.num_experts = end - begin;
    w.problem.inter = inter_end - inter_begin;
    w.total_inter = I;
    w.inter_begin = inter_begin;
    w.inter_end = inter_end;
    w.allocate_experts(true);
    load_gpt_oss_experts(ck, layer, prefix, options.tp_rank, w);
    const std::string rname = ck.router_name(layer);
    ck.read_router(rname, E, H, w);
    w.router_bias = read_floats(ck, prefix + ".router.bias", {E}, "[E] from config.json");
    return w;
  }

  // (2) the expert ids present in the checkpoint
  const std::string experts = prefix + ".experts.";
  int64_t found = 0, max_id = -1;
  std::string last_id;
  for (auto it = ck.weight_map.lower_bound(experts); it != ck.weight_map.end() && starts_with(it->first, experts);
       ++it) {
    const std::string rest = it->first.substr(experts.size());
    const std::string id = rest.substr(0, rest.find('.'));
    if (id == last_id) continue;
    last_id = id;
    int64_t v = -1;
    if (!id.empty() && id.size() < 10 && std::all_of(id.begin(), id.end(), [](char ch) { return ch >= '0' && ch <= '9'; }))
      v = std::stoll(id);
    check(v >= 0, ck.file_of(it->first), ": tensor '", it->first, "': expert id '", id, "' is not an integer");
    ++found;
    max_id = std::max(max_id, v);
  }
  check(found > 0, ck.dir, ": layer ", layer, " has no expert tensors '", experts, "*' (config says it is a MoE layer with ",
        E, " experts)");
  check(max_id < E, ck.dir, ": layer ", layer, " has expert id ", max_id, " but the config has only ", E, " experts");

  MoeLayerWeights w;
  w.layer = layer;
  w.total_experts = E;
  w.expert_begin = begin;
  w.expert_end = end;
  w.problem = cfg.problem;
  w.problem.num_experts = end - begin;
  w.problem.inter = inter_end - inter_begin;  // this tensor-parallel rank's share (all of I without)
  w.total_inter = I;
  w.inter_begin = inter_begin;
  w.inter_end = inter_end;
  w.allocate_experts();

  // (3) + (4)
  const ProjNames names = proj_names(cfg.family);
  {  // experts left unquantized by the quantization config cannot run as NVFP4
    const std::string where = cfg.format == CheckpointFormat::ModelOpt ? "exclude_modules of hf_quant_config.json"
                                                                        : "quantization_config.ignore of config.json";
    const ExcludedModules excluded(cfg.excluded_modules, ck.dir + ": " + where);
    for (int64_t e = begin; e < end; ++e)
      for (const char* proj : {names.gate, names.up, names.down}) {
        const std::string module = experts + std::to_string(e) + "." + proj;
        const std::string pattern = excluded.pattern_of(module);
        check(pattern.empty(), ck.dir, ": layer ", layer, ": expert module '", module, "' is excluded from quantization by '",
              pattern, "' (", where, "); fp4moe runs NVFP4 experts only");
      }
  }
  const std::string up_why = detail::concat("[out, in] = [I, H] = [", I, ", ", H, "] from config.json");
  const std::string down_why = detail::concat("[out, in] = [H, I] = [", H, ", ", I, "] from config.json");
  const int64_t part = inter_end - inter_begin, half_w = part * (H / 2), half_s = part * (H / 16);
  for (int64_t e = begin; e < end; ++e) {
    const int64_t l = e - begin;
    const std::string base = experts + std::to_string(e) + ".";
    const Projection g = read_projection(ck, base + names.gate, I, H, up_why.c_str());
    const Projection u = read_projection(ck, base + names.up, I, H, up_why.c_str());
    const Projection dn = read_projection(ck, base + names.down, H, I, down_why.c_str());
    uint8_t* w13 = w.w13.data() + l * 2 * half_w;
    uint8_t* s13 = w.w13_scale.data() + l * 2 * half_s;
    // gate / up [I, H]: rows [inter_begin, inter_end); down [H, I]: those columns of every row.
    copy_block(*g.weight, H / 2, inter_begin, inter_end, 0, H / 2, w13);
    copy_block(*u.weight, H / 2, inter_begin, inter_end, 0, H / 2, w13 + half_w);
    copy_block(*g.block_scale, H / 16, inter_begin, inter_end, 0, H / 16, s13);
    copy_block(*u.block_scale, H / 16, inter_begin, inter_end, 0, H / 16, s13 + half_s);
    float s2 = g.scale_2;
    if (g.scale_2 != u.scale_2) {
      const std::string gn = base + names.gate, un = base + names.up;
      check(options.fusion != ScaleFusionPolicy::Error, ck.file_of(un + ".weight_scale"), ": layer ", layer,
            " expert ", e, ": gate '", gn, "' and up '", un, "' have different weight_scale_2 (", g.scale_2, " vs ",
            u.scale_2, ") and the fusion policy is 'error' (use rescale_to_max to re-express both under the max)");
      s2 = std::max(g.scale_2, u.scale_2);
      if (g.scale_2 < s2) rescale_blocks(s13, half_s, g.scale_2, s2, w.fusion);
      else rescale_blocks(s13 + half_s, half_s, u.scale_2, s2, w.fusion);
      ++w.fusion.experts_rescaled;
    }
    w.w13_scale_2[l] = s2;
    w.w13_input_scale[l] = std::max(g.input_scale, u.input_scale);
    copy_block(*dn.weight, I / 2, 0, H, inter_begin / 2, inter_end / 2, w.w2.data() + l * H * (part / 2));
    copy_block(*dn.block_scale, I / 16, 0, H, inter_begin / 16, inter_end / 16, w.w2_scale.data() + l * H * (part / 16));
    w.w2_scale_2[l] = dn.scale_2;
    w.w2_input_scale[l] = dn.input_scale;
  }

  // The whole layer's largest GEMM1 input scale (w4a4_scalar quantizes every token with it): an
  // expert-parallel rank also reads the other ranks' experts' scales.
  if (cfg.problem.act_quant != ActQuant::W4A16) {
    const bool ct = cfg.format == CheckpointFormat::CompressedTensors;
    const char* input = ct ? ".input_global_scale" : ".input_scale";
    w.w13_input_scale_max = *std::max_element(w.w13_input_scale.begin(), w.w13_input_scale.end());
    for (int64_t e = 0; e < E; ++e)
      if (e < begin || e >= end)
        for (const char* proj : {names.gate, names.up})
          w.w13_input_scale_max =
              std::max(w.w13_input_scale_max, ck.scale(experts + std::to_string(e) + "." + proj + input, ct));
  }

  // (5) router and bias
  const std::string rname = ck.router_name(layer);
  ck.read_router(rname, E, H, w);
  if (cfg.family == ModelFamily::DeepSeekV3) {
    const std::string bname = prefix + ".gate.e_score_correction_bias";
    const TensorView& b = ck.tensor(bname);
    check(b.shape == std::vector<int64_t>{E}, ck.file_of(bname), ": tensor '", bname, "': expected shape [", E,
          "], got ", shape_string(b.shape));
    w.routing_bias.resize(E);
    if (b.dtype == DType::F32) {
      std::memcpy(w.routing_bias.data(), b.data.data(), b.data.size());
    } else {
      check(b.dtype == DType::BF16, ck.file_of(bname), ": tensor '", bname, "': expected dtype F32 or BF16, got ",
            to_string(b.dtype));
      for (int64_t i = 0; i < E; ++i) {
        uint16_t v;
        std::memcpy(&v, b.data.data() + 2 * i, 2);
        w.routing_bias[i] = format::bf16_to_float(v);
      }
    }
    for (int64_t i = 0; i < E; ++i)
      check(std::isfinite(w.routing_bias[i]), ck.file_of(bname), ": tensor '", bname, "': element ", i,
            " is not finite (", w.routing_bias[i], ")");
  }
  return w;
}

// ---- MoeLayerWeights ------------------------------------------------------------------------------

void MoeLayerWeights::allocate_experts(bool biases) {
  const int64_t E = problem.num_experts, H = problem.hidden, I = problem.inter, blk = problem.weight_block();
  const int64_t n13 = problem.w13_rows();
  w13.assign(E * n13 * (H / 2), 0);
  w13_scale.assign(E * n13 * (H / blk), 0);
  w2.assign(E * H * (I / 2), 0);
  w2_scale.assign(E * H * (I / blk), 0);
  const size_t scalars = problem.weight_format == WeightFormat::MXFP4 ? 0 : size_t(E);  // MXFP4: no [E] scales
  w13_scale_2.assign(scalars, 0.0f);
  w13_input_scale.assign(scalars, 0.0f);
  w2_scale_2.assign(scalars, 0.0f);
  w2_input_scale.assign(scalars, 0.0f);
  if (biases) {
    w13_bias.assign(E * n13, 0.0f);
    w2_bias.assign(E * H, 0.0f);
  } else {
    w13_bias.clear();
    w2_bias.clear();
  }
}

reference::MoeWeights MoeLayerWeights::weights() const {
  auto ptr = [](const auto& v) { return v.empty() ? nullptr : v.data(); };
  reference::MoeWeights v;
  v.w13 = w13.data();
  v.w13_scale = w13_scale.data();
  v.w13_scale_2 = ptr(w13_scale_2);
  v.w13_input_scale = ptr(w13_input_scale);
  v.w2 = w2.data();
  v.w2_scale = w2_scale.data();
  v.w2_scale_2 = ptr(w2_scale_2);
  v.w2_input_scale = ptr(w2_input_scale);
  v.w13_input_scale_max = w13_input_scale_max;
  v.w13_bias = ptr(w13_bias);
  v.w2_bias = ptr(w2_bias);
  return v;
}

std::vector<float> MoeLayerWeights::router_logits(const uint16_t* hidden, int64_t num_tokens) const {
  const int64_t E = total_experts, H = problem.hidden;
  check(num_tokens >= 0, "router_logits: num_tokens must be >= 0, got ", num_tokens);
  check(static_cast<int64_t>(router_weight.size()) == E * H, "router_logits: router weight has ",
        router_weight.size(), " elements, expected E*H = ", E * H);
  check(router_bias.empty() || static_cast<int64_t>(router_bias.size()) == E, "router_logits: router bias has ",
        router_bias.size(), " elements, expected E = ", E);
  std::vector<float> w(router_weight.size());
  for (size_t i = 0; i < w.size(); ++i) w[i] = format::bf16_to_float(router_weight[i]);
  std::vector<float> x(H), logits(num_tokens * E);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t h = 0; h < H; ++h) x[h] = format::bf16_to_float(hidden[t * H + h]);
    for (int64_t e = 0; e < E; ++e) {
      const float* row = w.data() + e * H;
      float acc = 0.0f;
      for (int64_t h = 0; h < H; ++h) acc += x[h] * row[h];
      if (!router_bias.empty()) acc += router_bias[e];
      logits[t * E + e] = acc;
    }
  }
  return logits;
}

MoeCase MoeLayerWeights::to_case(std::vector<uint16_t> hidden_states, int64_t num_tokens) const {
  check(expert_begin == 0 && expert_end == total_experts, "to_case: needs the whole layer, this holds experts [",
        expert_begin, ", ", expert_end, ") of ", total_experts);
  check(static_cast<int64_t>(hidden_states.size()) == num_tokens * problem.hidden, "to_case: hidden_states has ",
        hidden_states.size(), " elements, expected T*H = ", num_tokens * problem.hidden);
  MoeCase c;
  c.problem = problem;
  c.num_tokens = num_tokens;
  c.router_logits = router_logits(hidden_states.data(), num_tokens);
  c.hidden_states = std::move(hidden_states);
  c.routing_bias = routing_bias;
  c.w13 = w13;
  c.w13_scale = w13_scale;
  c.w13_scale_2 = w13_scale_2;
  c.w13_input_scale = w13_input_scale;
  c.w2 = w2;
  c.w2_scale = w2_scale;
  c.w2_scale_2 = w2_scale_2;
  c.w2_input_scale = w2_input_scale;
  c.w13_bias = w13_bias;
  c.w2_bias = w2_bias;
  return c;
}

std::vector<uint16_t> random_hidden_states(int64_t num_tokens, int64_t hidden, uint64_t seed) {
  check(num_tokens >= 0 && hidden >= 0, "random_hidden_states: sizes must be >= 0, got T=", num_tokens,
        " H=", hidden);
  uint64_t state = seed;
  auto next = [&state]() {  // splitmix64
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  auto uniform = [&]() { return (static_cast<double>(next() >> 11) + 0.5) * 0x1.0p-53; };
  std::vector<uint16_t> x(num_tokens * hidden);
  for (auto& v : x) {  // Box-Muller, one normal per pair of uniforms
    const double n = std::sqrt(-2.0 * std::log(uniform())) * std::cos(6.283185307179586 * uniform());
    v = format::bf16_from_float(static_cast<float>(n));
  }
  return x;
}

}  // namespace fp4moe::io
