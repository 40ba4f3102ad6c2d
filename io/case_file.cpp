// io/case_file.cpp — the case-file interface (docs/case-file.md): load_case / save_case, the OUT file
// (save_result / load_result) and random cases for tests and `fp4moe demo`.
//
// load_case, in order (every failure throws fp4moe::Error starting with "case file 'PATH'"):
//   1. open the safetensors file (strict header validation, see io/safetensors.cpp);
//   2. metadata: top_k, routing_method, activation, act_quant are required; weight_format (nvfp4 |
//      mxfp4, default nvfp4), n_group, topk_group,
//      routed_scaling_factor, apply_router_weight_on_input (0|1), swiglu_alpha, swiglu_beta,
//      swiglu_limit are optional (defaults of RoutingParams / ActivationParams). Numbers must parse as
//      a whole (no spaces, no trailing text); unknown metadata keys are ignored;
//   3. sizes from shapes: T, H from hidden_states [T, H]; E from w13 [E, w13_rows, H/2]; I from
//      w2 [E, H, I/2]; H and I must be multiples of 16; then MoeProblem::validate();
//   4. every tensor against the sizes: w13, w13_scale, w2, w2_scale, the [E] scales (MXFP4: U8 ue8m0
//      block scales [.., K/32], and no [E] scale tensor may be present), the optional
//      expert biases (w13_bias F32|BF16 [E, w13_rows], w2_bias F32|BF16 [E, H]), and the router
//      input (router_logits F32|BF16 [T, E] and optional routing_bias F32|BF16 [E], or topk_ids I32 and
//      topk_weights F32 [T, k] with `precomputed`). Tensors with other names are ignored;
//   5. values: global and input scales finite and > 0, e4m3 block scales not NaN (0x7F / 0xFF), ue8m0
//      codes not 255,
//      expert biases finite, precomputed ids in [0, E).
// save_case writes the same layout back (all metadata keys; floats in their shortest exact decimal
// form so they read back bit-identical).
#include "fp4moe/case_file.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <random>
#include <sstream>
#include <system_error>

#include "fp4moe/error.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/safetensors.hpp"

namespace fp4moe::io {
namespace {

constexpr float kE2m1Max = 6.0f;
constexpr float kE4m3Max = 448.0f;

std::string float_string(float v) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);  // shortest form that reads back exactly
  return std::string(buf, r.ptr);
}

template <typename T>
std::vector<T> copy_values(const TensorView& v) {
  std::vector<T> out(v.data.size() / sizeof(T));
  if (!out.empty()) std::memcpy(out.data(), v.data.data(), v.data.size());
  return out;
}

std::vector<float> widen_bf16(const TensorView& v) {
  const std::vector<uint16_t> bits = copy_values<uint16_t>(v);
  std::vector<float> out(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) out[i] = format::bf16_to_float(bits[i]);
  return out;
}

// Reads a case file's tensors and metadata with errors that name the file, tensor or key.
class CaseReader {
 public:
  explicit CaseReader(const std::string& path)
      : file_(SafetensorsFile::open(path)), where_("case file '" + path + "'") {}

  const std::string& where() const { return where_; }

  template <typename... Args>
  [[noreturn]] void fail(Args&&... parts) const {
    throw Error(detail::concat(where_, ": ", std::forward<Args>(parts)...));
  }

  // ---- metadata ----
  const std::string* meta(const std::string& key) const {
    auto it = file_.metadata().find(key);
    return it == file_.metadata().end() ? nullptr : &it->second;
  }
  const std::string& meta_required(const std::string& key) const {
    const std::string* v = meta(key);
    if (!v) fail("missing metadata key '", key, "' (required)");
    return *v;
  }
  template <typename T>
  T parse_number(const std::string& key, const std::string& text, const char* kind) const {
    T value{};
    const char* b = text.data();
    const char* e = b + text.size();
    const auto r = std::from_chars(b, e, value);
    if (text.empty() || r.ec != std::errc() || r.ptr != e)
      fail("metadata '", key, "' = '", text, "' is not ", kind,
           r.ec == std::errc::result_out_of_range ? " (out of range)" : "");
    return value;
  }
  int meta_int(const std::string& key, int def, bool required = false) const {
    const std::string* v = required ? &meta_required(key) : meta(key);
    return v ? parse_number<int>(key, *v, "an integer") : def;
  }
  float meta_float(const std::string& key, float def) const {
    const std::string* v = meta(key);
    return v ? parse_number<float>(key, *v, "a number") : def;
  }
  bool meta_bool01(const std::string& key, bool def) const {
    const std::string* v = meta(key);
    if (!v) return def;
    if (*v == "0") return false;
    if (*v == "1") return true;
    fail("metadata '", key, "' = '", *v, "' must be '0' or '1'");
  }

  // ---- tensors ----
  const TensorView* find(const std::string& name) const {
    return file_.contains(name) ? &file_.tensor(name) : nullptr;
  }
  const TensorView& require(const std::string& name, const char* why = "") const {
    const TensorView* t = find(name);
    if (!t) fail("missing tensor '", name, "'", why);
    return *t;
  }
  void check_dtype(const std::string& name, const TensorView& t, DType want) const {
    if (t.dtype != want)
      fail("tensor '", name, "': expected dtype ", to_string(want), ", got ", to_string(t.dtype));
  }
  void check_dtype2(const std::string& name, const TensorView& t, DType a, DType b) const {
    if (t.dtype != a && t.dtype != b)
      fail("tensor '", name, "': expected dtype ", to_string(a), " or ", to_string(b), ", got ",
           to_string(t.dtype));
  }
  void check_rank(const std::string& name, const TensorView& t, size_t rank, const char* symbolic) const {
    if (t.shape.size() != rank)
      fail("tensor '", name, "': expected shape ", symbolic, " (rank ", rank, "), got ",
           shape_string(t.shape));
  }
  void check_shape(const std::string& name, const TensorView& t, const std::vector<int64_t>& want,
                   const std::string& symbolic) const {
    if (t.shape != want)
      fail("tensor '", name, "': expected shape ", shape_string(want), " (", symbolic, "), got ",
           shape_string(t.shape));
  }
  // Global / input scales: F32 [E], every value finite and > 0.
  std::vector<float> scales(const std::string& name, const TensorView& t, int64_t E,
                            const std::string& sizes) const {
    check_dtype(name, t, DType::F32);
    check_shape(name, t, {E}, "[E] with " + sizes);
    std::vector<float> v = copy_values<float>(t);
    for (size_t i = 0; i < v.size(); ++i)
      if (!(std::isfinite(v[i]) && v[i] > 0.0f))
        fail("tensor '", name, "': every scale must be finite and > 0, got ", v[i], " at index [", i, "]");
    return v;
  }
  // e4m3 block scales: no NaN codes (the sign bit is ignored: scales are magnitudes).
  std::vector<uint8_t> block_scales(const std::string& name, const TensorView& t,
                                    const std::vector<int64_t>& shape, const std::string& symbolic) const {
    check_dtype(name, t, DType::F8_E4M3);
    check_shape(name, t, shape, symbolic);
    std::vector<uint8_t> v = copy_values<uint8_t>(t);
    for (size_t i = 0; i < v.size(); ++i) {
      if ((v[i] & 0x7F) == 0x7F) {
        const int64_t per_e = shape[1] * shape[2];
        const int64_t e = static_cast<int64_t>(i) / per_e, r = (static_cast<int64_t>(i) % per_e) / shape[2],
                      c = static_cast<int64_t>(i) % shape[2];
        char hex[8];
        std::snprintf(hex, sizeof hex, "0x%02x", v[i]);
        fail("tensor '", name, "': e4m3 block scale at [", e, ", ", r, ", ", c, "] is NaN (code ", hex, ")");
      }
    }
    return v;
  }
  // MXFP4 ue8m0 block scales: U8, no NaN code (255).
  std::vector<uint8_t> ue8m0_scales(const std::string& name, const TensorView& t, const std::vector<int64_t>& shape,
                                    const std::string& symbolic) const {
    check_dtype(name, t, DType::U8);
    check_shape(name, t, shape, symbolic);
    std::vector<uint8_t> v = copy_values<uint8_t>(t);
    const int64_t i = format::find_ue8m0_nan(v.data(), static_cast<int64_t>(v.size()));
    if (i >= 0) {
      const int64_t per_e = shape[1] * shape[2];
      fail("tensor '", name, "': ue8m0 block scale at [", i / per_e, ", ", (i % per_e) / shape[2], ", ", i % shape[2],
           "] (expert, row, block) is NaN (code 255)");
    }
    return v;
  }

 private:
  SafetensorsFile file_;
  std::string where_;
};

void check_size(const char* fn, const char* field, size_t actual, int64_t expected, const char* symbolic) {
  check(static_cast<int64_t>(actual) == expected, fn, ": MoeCase.", field, " has ", actual,
        " elements, expected ", symbolic, " = ", expected);
}

// A seeded source of uniform and normal draws that does not depend on the standard library's
// distribution implementations (those differ between libstdc++ and libc++).
class Rng {
 public:
  explicit Rng(uint64_t seed) : gen_(seed) {}
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(gen_() >> 11) * 0x1.0p-53; }
  // Standard normal by Box-Muller (both values of a pair are used).
  double normal() {
    if (have_spare_) {
      have_spare_ = false;
      return spare_;
    }
    double u1 = 0.0;
    do u1 = uniform();
    while (u1 <= 0.0);
    const double u2 = uniform();
    const double r = std::sqrt(-2.0 * std::log(u1));
    const double a = 6.283185307179586476925 * u2;
    spare_ = r * std::sin(a);
    have_spare_ = true;
    return r * std::cos(a);
  }
  uint64_t below(uint64_t n) { return gen_() % n; }  // slight modulo bias is irrelevant here

 private:
  std::mt19937_64 gen_;
  double spare_ = 0.0;
  bool have_spare_ = false;
};

float bf16_round(float x) { return format::bf16_to_float(format::bf16_from_float(x)); }

}  // namespace

// ---- views --------------------------------------------------------------------------------------

reference::MoeWeights MoeCase::weights() const {
  auto ptr = [](const auto& v) { return v.empty() ? nullptr : v.data(); };
  reference::MoeWeights w;
  w.w13 = ptr(w13);
  w.w13_scale = ptr(w13_scale);
  w.w13_scale_2 = ptr(w13_scale_2);
  w.w13_input_scale = ptr(w13_input_scale);
  w.w2 = ptr(w2);
  w.w2_scale = ptr(w2_scale);
  w.w2_scale_2 = ptr(w2_scale_2);
  w.w2_input_scale = ptr(w2_input_scale);
  w.w13_bias = ptr(w13_bias);
  w.w2_bias = ptr(w2_bias);
  return w;
}

reference::RouterInput MoeCase::router() const {
  reference::RouterInput r;
  if (problem.routing.method == RoutingMethod::Precomputed) {
    r.topk_ids = topk_ids.data();
    r.topk_weights = topk_weights.data();
  } else {
    r.logits = router_logits.data();
    r.bias = routing_bias.empty() ? nullptr : routing_bias.data();
  }
  return r;
}

// ---- load ---------------------------------------------------------------------------------------

MoeCase load_case(const std::string& path) {
  const CaseReader rd(path);
  MoeCase c;
  MoeProblem& p = c.problem;

  // 2. Metadata.
  p.routing.top_k = rd.meta_int("top_k", 0, /*required=*/true);
  const std::string what_prefix = rd.where() + ": metadata ";
  p.routing.method = parse_routing_method(rd.meta_required("routing_method"), what_prefix + "'routing_method'");
  p.activation.kind = parse_activation(rd.meta_required("activation"), what_prefix + "'activation'");
  p.act_quant = parse_act_quant(rd.meta_required("act_quant"), what_prefix + "'act_quant'");
  if (const std::string* wf = rd.meta("weight_format"))
    p.weight_format = parse_weight_format(*wf, what_prefix + "'weight_format'");
  const bool mxfp4 = p.weight_format == WeightFormat::MXFP4;
  const RoutingParams rdef;
  const ActivationParams adef;
  p.routing.n_group = rd.meta_int("n_group", rdef.n_group);
  p.routing.topk_group = rd.meta_int("topk_group", rdef.topk_group);
  p.routing.routed_scaling_factor = rd.meta_float("routed_scaling_factor", rdef.routed_scaling_factor);
  p.routing.apply_router_weight_on_input =
      rd.meta_bool01("apply_router_weight_on_input", rdef.apply_router_weight_on_input);
  p.activation.swiglu_alpha = rd.meta_float("swiglu_alpha", adef.swiglu_alpha);
  p.activation.swiglu_beta = rd.meta_float("swiglu_beta", adef.swiglu_beta);
  p.activation.swiglu_limit = rd.meta_float("swiglu_limit", adef.swiglu_limit);

  // 3. Sizes from shapes.
  const TensorView& hs = rd.require("hidden_states");
  rd.check_dtype("hidden_states", hs, DType::BF16);
  rd.check_rank("hidden_states", hs, 2, "[T, H]");
  const int64_t T = hs.shape[0], H = hs.shape[1];
  if (H < 16 || H % 16 != 0)
    rd.fail("hidden size H = ", H, " (from hidden_states ", shape_string(hs.shape),
            ") must be a positive multiple of 16 (the NVFP4 block size)");

  const TensorView& w13 = rd.require("w13");
  rd.check_dtype("w13", w13, DType::U8);
  rd.check_rank("w13", w13, 3, "[E, w13_rows, H/2]");
  const int64_t E = w13.shape[0];
  if (E < 1) rd.fail("number of experts E = ", E, " (from w13 ", shape_string(w13.shape), ") must be >= 1");

  const TensorView& w2 = rd.require("w2");
  rd.check_dtype("w2", w2, DType::U8);
  rd.check_rank("w2", w2, 3, "[E, H, I/2]");
  const int64_t I = 2 * w2.shape[2];
  if (w2.shape[0] == E && w2.shape[1] == H && (I < 16 || I % 16 != 0))
    rd.fail("intermediate size I = ", I, " (from w2 ", shape_string(w2.shape),
            " = [E, H, I/2]) must be a positive multiple of 16 (the NVFP4 block size)");
  std::ostringstream sizes_os;
  sizes_os << "E=" << E << ", H=" << H << ", I=" << I;
  const std::string sizes = sizes_os.str();
  rd.check_shape("w2", w2, {E, H, I / 2}, "[E, H, I/2] with " + sizes + "; E from w13, H from hidden_states");

  p.num_experts = E;
  p.hidden = H;
  p.inter = I;
  const int64_t rows = p.w13_rows();
  rd.check_shape("w13", w13, {E, rows, H / 2},
                 std::string(p.gated() ? "[E, 2I, H/2]" : "[E, I, H/2]") + " with " + sizes +
                     ", activation " + std::string(to_string(p.activation.kind)));
  try {
    p.validate();
  } catch (const Error& e) {
    rd.fail(e.what());
  }
  const int64_t k = p.top_k();
  c.num_tokens = T;

  // 4./5. Tensors.
  c.hidden_states = copy_values<uint16_t>(hs);
  c.w13 = copy_values<uint8_t>(w13);
  c.w2 = copy_values<uint8_t>(w2);
  if (mxfp4) {
    // NOTE: a global or input scale in an MXFP4 file is refused rather than ignored: it would mean the
    // file was written for a format whose values it changes.
    for (const char* name : {"w13_scale_2", "w2_scale_2", "w13_input_scale", "w2_input_scale"})
      if (rd.find(name))
        rd.fail("tensor '", name, "' is not part of an mxfp4 case (MXFP4 weights have no global or input scales; "
                "weight_format is mxfp4)");
    c.w13_scale = rd.ue8m0_scales("w13_scale", rd.require("w13_scale"), {E, rows, H / 32},
                                  std::string(p.gated() ? "[E, 2I, H/32]" : "[E, I, H/32]") + " with " + sizes +
                                      ", weight_format mxfp4");
    c.w2_scale = rd.ue8m0_scales("w2_scale", rd.require("w2_scale"), {E, H, I / 32},
                                 "[E, H, I/32] with " + sizes + ", weight_format mxfp4");
  } else {
    c.w13_scale = rd.block_scales("w13_scale", rd.require("w13_scale"), {E, rows, H / 16},
                                  std::string(p.gated() ? "[E, 2I, H/16]" : "[E, I, H/16]") + " with " + sizes);
    c.w2_scale = rd.block_scales("w2_scale", rd.require("w2_scale"), {E, H, I / 16}, "[E, H, I/16] with " + sizes);
    c.w13_scale_2 = rd.scales("w13_scale_2", rd.require("w13_scale_2"), E, sizes);
    c.w2_scale_2 = rd.scales("w2_scale_2", rd.require("w2_scale_2"), E, sizes);
  }
  const bool w4a4 = p.act_quant != ActQuant::W4A16;
  auto input_scale = [&](const std::string& name, std::vector<float>& dst) {
    // Required for w4a4; optional (unused) for w4a16, but checked when present.
    const TensorView* t = w4a4 ? &rd.require(name, " (required with act_quant w4a4_scalar / w4a4_per_expert)")
                               : rd.find(name);
    if (t) dst = rd.scales(name, *t, E, sizes);
  };
  input_scale("w13_input_scale", c.w13_input_scale);
  input_scale("w2_input_scale", c.w2_input_scale);
  auto bias = [&](const char* name, std::vector<float>& dst, int64_t cols, const std::string& symbolic) {
    if (const TensorView* b = rd.find(name)) {  // optional expert biases (gpt-oss)
      rd.check_dtype2(name, *b, DType::F32, DType::BF16);
      rd.check_shape(name, *b, {E, cols}, symbolic + " with " + sizes);
      dst = b->dtype == DType::BF16 ? widen_bf16(*b) : copy_values<float>(*b);
    }
  };
  bias("w13_bias", c.w13_bias, rows, p.gated() ? "[E, 2I]" : "[E, I]");
  bias("w2_bias", c.w2_bias, H, "[E, H]");
  try {
    reference::check_biases(c.weights(), p);
  } catch (const Error& e) {
    rd.fail(e.what());
  }

  std::ostringstream tk_os;
  tk_os << "[T, k] with T=" << T << ", k=" << k;
  const std::string tk = tk_os.str();
  if (p.routing.method == RoutingMethod::Precomputed) {
    const char* why = " (required with routing_method precomputed)";
    const TensorView& ids = rd.require("topk_ids", why);
    rd.check_dtype("topk_ids", ids, DType::I32);
    rd.check_shape("topk_ids", ids, {T, k}, tk);
    c.topk_ids = copy_values<int32_t>(ids);
    for (size_t i = 0; i < c.topk_ids.size(); ++i) {
      const int32_t id = c.topk_ids[i];
      if (id < 0 || id >= E)
        rd.fail("tensor 'topk_ids': expert id ", id, " at [", static_cast<int64_t>(i) / k, ", ",
                static_cast<int64_t>(i) % k, "] is out of range [0, E = ", E, ")");
    }
    const TensorView& wts = rd.require("topk_weights", why);
    rd.check_dtype("topk_weights", wts, DType::F32);
    rd.check_shape("topk_weights", wts, {T, k}, tk);
    c.topk_weights = copy_values<float>(wts);
  } else {
    const TensorView& lg = rd.require("router_logits");
    rd.check_dtype2("router_logits", lg, DType::F32, DType::BF16);
    rd.check_shape("router_logits", lg, {T, E}, "[T, E] with T=" + std::to_string(T) + ", E=" + std::to_string(E));
    c.router_logits_bf16 = lg.dtype == DType::BF16;
    c.router_logits = c.router_logits_bf16 ? widen_bf16(lg) : copy_values<float>(lg);
    if (const TensorView* b = rd.find("routing_bias")) {
      rd.check_dtype2("routing_bias", *b, DType::F32, DType::BF16);
      rd.check_shape("routing_bias", *b, {E}, "[E] with E=" + std::to_string(E));
      c.routing_bias = b->dtype == DType::BF16 ? widen_bf16(*b) : copy_values<float>(*b);
    }
  }
  return c;
}

// ---- save ---------------------------------------------------------------------------------------

void save_case(const std::string& path, const MoeCase& c) {
  const MoeProblem& p = c.problem;
  p.validate();
  const char* fn = "save_case";
  const int64_t T = c.num_tokens, E = p.num_experts, H = p.hidden, I = p.inter, k = p.top_k();
  const int64_t rows = p.w13_rows();
  check(T >= 0, fn, ": MoeCase.num_tokens must be >= 0, got ", T);
  check_size(fn, "hidden_states", c.hidden_states.size(), T * H, "T*H");
  check_size(fn, "w13", c.w13.size(), E * rows * (H / 2), "E*w13_rows*(H/2)");
  const bool mxfp4 = p.weight_format == WeightFormat::MXFP4;
  const int64_t blk = p.weight_block();
  check_size(fn, "w13_scale", c.w13_scale.size(), E * rows * (H / blk), mxfp4 ? "E*w13_rows*(H/32)" : "E*w13_rows*(H/16)");
  check_size(fn, "w2", c.w2.size(), E * H * (I / 2), "E*H*(I/2)");
  check_size(fn, "w2_scale", c.w2_scale.size(), E * H * (I / blk), mxfp4 ? "E*H*(I/32)" : "E*H*(I/16)");
  if (mxfp4) {
    for (auto [v, name] : {std::pair<const std::vector<float>*, const char*>{&c.w13_scale_2, "w13_scale_2"},
                           {&c.w2_scale_2, "w2_scale_2"}, {&c.w13_input_scale, "w13_input_scale"},
                           {&c.w2_input_scale, "w2_input_scale"}})
      check(v->empty(), fn, ": MoeCase.", name, " must be empty with weight_format mxfp4 (no global or input "
            "scales), got ", v->size(), " elements");
  } else {
    check_size(fn, "w13_scale_2", c.w13_scale_2.size(), E, "E");
    check_size(fn, "w2_scale_2", c.w2_scale_2.size(), E, "E");
  }
  const bool w4a4 = p.act_quant != ActQuant::W4A16;
  if (w4a4 || !c.w13_input_scale.empty()) check_size(fn, "w13_input_scale", c.w13_input_scale.size(), E, "E");
  if (w4a4 || !c.w2_input_scale.empty()) check_size(fn, "w2_input_scale", c.w2_input_scale.size(), E, "E");
  if (!c.w13_bias.empty()) check_size(fn, "w13_bias", c.w13_bias.size(), E * rows, "E*w13_rows");
  if (!c.w2_bias.empty()) check_size(fn, "w2_bias", c.w2_bias.size(), E * H, "E*H");
  const bool precomputed = p.routing.method == RoutingMethod::Precomputed;
  if (precomputed) {
    check_size(fn, "topk_ids", c.topk_ids.size(), T * k, "T*k");
    check_size(fn, "topk_weights", c.topk_weights.size(), T * k, "T*k");
  } else {
    check_size(fn, "router_logits", c.router_logits.size(), T * E, "T*E");
    if (!c.routing_bias.empty()) check_size(fn, "routing_bias", c.routing_bias.size(), E, "E");
  }

  std::map<std::string, std::string> meta;
  meta["top_k"] = std::to_string(p.routing.top_k);
  meta["routing_method"] = std::string(to_string(p.routing.method));
  meta["n_group"] = std::to_string(p.routing.n_group);
  meta["topk_group"] = std::to_string(p.routing.topk_group);
  meta["routed_scaling_factor"] = float_string(p.routing.routed_scaling_factor);
  meta["apply_router_weight_on_input"] = p.routing.apply_router_weight_on_input ? "1" : "0";
  meta["activation"] = std::string(to_string(p.activation.kind));
  meta["swiglu_alpha"] = float_string(p.activation.swiglu_alpha);
  meta["swiglu_beta"] = float_string(p.activation.swiglu_beta);
  meta["swiglu_limit"] = float_string(p.activation.swiglu_limit);
  meta["act_quant"] = std::string(to_string(p.act_quant));
  // NOTE: NVFP4 files keep the layout they had before the key existed (no key means nvfp4).
  if (mxfp4) meta["weight_format"] = std::string(to_string(p.weight_format));

  std::vector<TensorData> ts;
  ts.push_back(make_tensor("hidden_states", DType::BF16, {T, H}, c.hidden_states));
  if (precomputed) {
    ts.push_back(make_tensor("topk_ids", DType::I32, {T, k}, c.topk_ids));
    ts.push_back(make_tensor("topk_weights", DType::F32, {T, k}, c.topk_weights));
  } else {
    if (c.router_logits_bf16) {
      std::vector<uint16_t> bits(c.router_logits.size());
      for (size_t i = 0; i < bits.size(); ++i) bits[i] = format::bf16_from_float(c.router_logits[i]);
      ts.push_back(make_tensor("router_logits", DType::BF16, {T, E}, bits));
    } else {
      ts.push_back(make_tensor("router_logits", DType::F32, {T, E}, c.router_logits));
    }
    if (!c.routing_bias.empty()) ts.push_back(make_tensor("routing_bias", DType::F32, {E}, c.routing_bias));
  }
  ts.push_back(make_tensor("w13", DType::U8, {E, rows, H / 2}, c.w13));
  const DType scale_dtype = mxfp4 ? DType::U8 : DType::F8_E4M3;
  ts.push_back(make_tensor("w13_scale", scale_dtype, {E, rows, H / blk}, c.w13_scale));
  if (!mxfp4) ts.push_back(make_tensor("w13_scale_2", DType::F32, {E}, c.w13_scale_2));
  if (!c.w13_input_scale.empty()) ts.push_back(make_tensor("w13_input_scale", DType::F32, {E}, c.w13_input_scale));
  ts.push_back(make_tensor("w2", DType::U8, {E, H, I / 2}, c.w2));
  ts.push_back(make_tensor("w2_scale", scale_dtype, {E, H, I / blk}, c.w2_scale));
  if (!mxfp4) ts.push_back(make_tensor("w2_scale_2", DType::F32, {E}, c.w2_scale_2));
  if (!c.w2_input_scale.empty()) ts.push_back(make_tensor("w2_input_scale", DType::F32, {E}, c.w2_input_scale));
  if (!c.w13_bias.empty()) ts.push_back(make_tensor("w13_bias", DType::F32, {E, rows}, c.w13_bias));
  if (!c.w2_bias.empty()) ts.push_back(make_tensor("w2_bias", DType::F32, {E, H}, c.w2_bias));
  write_safetensors(path, ts, meta);
}

// ---- OUT file -----------------------------------------------------------------------------------

void save_result(const std::string& path, const MoeProblem& problem, int64_t num_tokens,
                 const reference::MoeResult& result) {
  const char* fn = "save_result";
  const int64_t T = num_tokens, H = problem.hidden, k = problem.top_k();
  check(T >= 0, fn, ": num_tokens must be >= 0, got ", T);
  check(static_cast<int64_t>(result.output.size()) == T * H, fn, ": result.output has ",
        result.output.size(), " elements, expected T*H = ", T * H);
  check(static_cast<int64_t>(result.topk_ids.size()) == T * k, fn, ": result.topk_ids has ",
        result.topk_ids.size(), " elements, expected T*k = ", T * k);
  check(static_cast<int64_t>(result.topk_weights.size()) == T * k, fn, ": result.topk_weights has ",
        result.topk_weights.size(), " elements, expected T*k = ", T * k);
  write_safetensors(path,
                    {make_tensor("output", DType::BF16, {T, H}, result.output),
                     make_tensor("topk_ids", DType::I32, {T, k}, result.topk_ids),
                     make_tensor("topk_weights", DType::F32, {T, k}, result.topk_weights)},
                    {});
}

reference::MoeResult load_result(const std::string& path) {
  const SafetensorsFile f = SafetensorsFile::open(path);
  const std::string where = "result file '" + path + "'";
  auto get = [&](const char* name, DType dtype) -> const TensorView& {
    check(f.contains(name), where, ": missing tensor '", name, "'");
    const TensorView& t = f.tensor(name);
    check(t.dtype == dtype, where, ": tensor '", name, "': expected dtype ", to_string(dtype), ", got ",
          to_string(t.dtype));
    check(t.shape.size() == 2, where, ": tensor '", name, "': expected a rank-2 shape, got ",
          shape_string(t.shape));
    return t;
  };
  const TensorView& out = get("output", DType::BF16);
  const TensorView& ids = get("topk_ids", DType::I32);
  const TensorView& wts = get("topk_weights", DType::F32);
  const int64_t T = out.shape[0];
  check(ids.shape[0] == T, where, ": tensor 'topk_ids': expected ", T, " rows (T from output ",
        shape_string(out.shape), "), got shape ", shape_string(ids.shape));
  check(wts.shape == ids.shape, where, ": tensor 'topk_weights': expected shape ", shape_string(ids.shape),
        " (that of topk_ids), got ", shape_string(wts.shape));
  reference::MoeResult r;
  r.output = copy_values<uint16_t>(out);
  r.topk_ids = copy_values<int32_t>(ids);
  r.topk_weights = copy_values<float>(wts);
  return r;
}

// ---- random cases -------------------------------------------------------------------------------
//
// Draw order (all from one std::mt19937_64 seeded with opts.seed): hidden states; the router input
// (logits, then the DeepSeekV3 bias; or precomputed ids and weights); per expert w13 then w2; per
// expert the two input-scale factors.
//   hidden       bf16(N(0,1) * hidden_std)
//   logits       N(0,1) fp32;  DeepSeekV3 bias N(0,1) * 0.1 (a correction of the order of σ's spread)
//   precomputed  k distinct ids per token, weights U[0.1,1) normalised to sum 1
//   weights      bf16(N(0,1) * weight_std), quantized per expert with the NVFP4 recipe:
//                scale_2[e] = amax(weights of e) / (448 * 6), so the largest block scale is 448;
//                MXFP4: format::quantize_mxfp4 (ue8m0 of each 32-block's amax / 6, rounded up), no
//                global scales, and no input scales (nor their draws)
//   w13_input_scale[e] = amax(hidden) / (448*6) * U[0.8, 1.2]
//   w2_input_scale[e]  = act(4σ_h, 4σ_h) / (448*6) * U[0.8, 1.2], with σ_h = hidden_std * weight_std *
//                sqrt(H) the standard deviation of a GEMM1 output: the activation of a 4-sigma gate and
//                up value is a typical amax of the GEMM2 input (it exceeds what nearly all elements
//                reach, and a calibrated scale that some rare element overshoots saturates it to ±6).
MoeCase make_random_case(const MoeProblem& problem, int64_t num_tokens, const RandomCaseOptions& opts,
                         std::vector<float>* w13_fp32, std::vector<float>* w2_fp32) {
  problem.validate();
  check(num_tokens >= 0, "make_random_case: num_tokens must be >= 0, got ", num_tokens);
  check(std::isfinite(opts.weight_std) && opts.weight_std >= 0.0f,
        "make_random_case: weight_std must be finite and >= 0, got ", opts.weight_std);
  check(std::isfinite(opts.hidden_std) && opts.hidden_std >= 0.0f,
        "make_random_case: hidden_std must be finite and >= 0, got ", opts.hidden_std);
  const int64_t T = num_tokens, E = problem.num_experts, H = problem.hidden, I = problem.inter;
  const int64_t k = problem.top_k(), rows = problem.w13_rows();
  const float kGlobalDenom = kE4m3Max * kE2m1Max;  // 2688: largest e4m3 scale times largest e2m1 value

  Rng rng(opts.seed);
  MoeCase c;
  c.problem = problem;
  c.num_tokens = T;

  c.hidden_states.resize(T * H);
  float hidden_amax = 0.0f;
  for (auto& h : c.hidden_states) {
    h = format::bf16_from_float(static_cast<float>(rng.normal()) * opts.hidden_std);
    hidden_amax = std::max(hidden_amax, std::fabs(format::bf16_to_float(h)));
  }

  if (problem.routing.method == RoutingMethod::Precomputed) {
    c.topk_ids.resize(T * k);
    c.topk_weights.resize(T * k);
    std::vector<int32_t> perm(E);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t e = 0; e < E; ++e) perm[e] = static_cast<int32_t>(e);
      float sum = 0.0f;
      for (int64_t j = 0; j < k; ++j) {  // partial Fisher-Yates: k distinct ids
        std::swap(perm[j], perm[j + static_cast<int64_t>(rng.below(E - j))]);
        c.topk_ids[t * k + j] = perm[j];
        c.topk_weights[t * k + j] = static_cast<float>(0.1 + 0.9 * rng.uniform());
        sum += c.topk_weights[t * k + j];
      }
      for (int64_t j = 0; j < k; ++j) c.topk_weights[t * k + j] /= sum;
    }
  } else {
    c.router_logits.resize(T * E);
    for (auto& l : c.router_logits) l = static_cast<float>(rng.normal());
    if (problem.routing.method == RoutingMethod::DeepSeekV3) {
      c.routing_bias.resize(E);
      for (auto& b : c.routing_bias) b = static_cast<float>(rng.normal() * 0.1);
    }
  }

  // Weights, one expert at a time (the fp32 copies are only kept when asked for).
  c.w13.resize(E * rows * (H / 2));
  const bool mxfp4 = problem.weight_format == WeightFormat::MXFP4;
  const int64_t blk = problem.weight_block();
  c.w13_scale.resize(E * rows * (H / blk));
  c.w2.resize(E * H * (I / 2));
  c.w2_scale.resize(E * H * (I / blk));
  if (!mxfp4) {
    c.w13_scale_2.resize(E);
    c.w2_scale_2.resize(E);
  }
  if (w13_fp32) w13_fp32->resize(E * rows * H);
  if (w2_fp32) w2_fp32->resize(E * H * I);
  auto make_expert = [&](int64_t e, int64_t r, int64_t cols, std::vector<float>& buf, std::vector<float>* keep,
                         uint8_t* packed, uint8_t* scales, float* scale_2) {
    buf.resize(r * cols);
    float amax = 0.0f;
    for (auto& x : buf) {
      x = bf16_round(static_cast<float>(rng.normal()) * opts.weight_std);
      amax = std::max(amax, std::fabs(x));
    }
    if (mxfp4) {
      format::quantize_mxfp4(buf.data(), r, cols, packed, scales);
    } else {
      *scale_2 = amax > 0.0f ? amax / kGlobalDenom : 1.0f;  // all-zero weights: any positive scale
      format::quantize_nvfp4(buf.data(), r, cols, *scale_2, packed, scales);
    }
    if (keep) std::copy(buf.begin(), buf.end(), keep->begin() + e * r * cols);
  };
  std::vector<float> buf;
  for (int64_t e = 0; e < E; ++e) {
    make_expert(e, rows, H, buf, w13_fp32, c.w13.data() + e * rows * (H / 2),
                c.w13_scale.data() + e * rows * (H / blk), mxfp4 ? nullptr : &c.w13_scale_2[e]);
    make_expert(e, H, I, buf, w2_fp32, c.w2.data() + e * H * (I / 2), c.w2_scale.data() + e * H * (I / blk),
                mxfp4 ? nullptr : &c.w2_scale_2[e]);
  }
  if (mxfp4) return c;

  // Input scales (also written for w4a16, where they are unused).
  const float a1 = (hidden_amax > 0.0f ? hidden_amax : 1.0f) / kGlobalDenom;
  const float sigma_h = opts.hidden_std * opts.weight_std * std::sqrt(static_cast<float>(H));
  float act_amax = std::fabs(reference::apply_activation(problem.activation, 4.0f * sigma_h, 4.0f * sigma_h));
  if (!(std::isfinite(act_amax) && act_amax > 0.0f)) act_amax = 1.0f;
  const float a2 = act_amax / kGlobalDenom;
  c.w13_input_scale.resize(E);
  c.w2_input_scale.resize(E);
  for (int64_t e = 0; e < E; ++e) {
    c.w13_input_scale[e] = a1 * static_cast<float>(0.8 + 0.4 * rng.uniform());
    c.w2_input_scale[e] = a2 * static_cast<float>(0.8 + 0.4 * rng.uniform());
  }
  return c;
}

void add_random_expert_biases(MoeCase& c, uint64_t seed) {
  const MoeProblem& p = c.problem;
  Rng rng(seed * 0x9E3779B97F4A7C15ull + 17);
  c.w13_bias.resize(static_cast<size_t>(p.num_experts * p.w13_rows()));
  c.w2_bias.resize(static_cast<size_t>(p.num_experts * p.hidden));
  for (auto& b : c.w13_bias) b = static_cast<float>(0.1 * rng.normal());
  for (auto& b : c.w2_bias) b = static_cast<float>(0.02 * rng.normal());
}

}  // namespace fp4moe::io
