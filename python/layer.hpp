// python/layer.hpp — the extension's layer and router: MoeLayer's weights checked and prepared once
// (HostWeights, Layer), and the forward and the routing into caller tensors, on a Hopper GPU
// (MoeRunner, GpuRouter) or on the CPU reference. Part of the extension fp4moe._fp4moe
// (python/module.cpp).
//
//   PreparedLayer(problem, weights, device, ...)   checks and prepares the weights (host arrays)
//   PreparedLayer.run(ForwardArgs, stream)        the forward on checked raw pointers (host pointers
//       on the cpu), outputs and workspace included: it allocates nothing on cuda, never
//       synchronises, takes no Python lock and captures into a CUDA graph like MoeRunner::forward
//   Layer                                          the Python class: a PreparedLayer, the DLPack
//       checks of Layer.forward, and an id in LayerRegistry by which the JAX custom calls
//       (python/jax_ffi.cpp) find the layer
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "fp4moe/error.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/reference.hpp"
#include "fp4moe/runner.hpp"
#include "fp4moe/tactic.hpp"
#include "fp4moe/weight_layout.hpp"
#include "python/dlpack_tensors.hpp"

namespace fp4moe::python {

// ---- the layer -------------------------------------------------------------------------------------
// Router logits for the CPU reference: the fp32 values as given, or n bf16 values widened (exactly)
// into `widened`.
inline const float* logits_as_f32(const void* logits, bool bf16, size_t n, std::vector<float>& widened) {
  if (!bf16) return static_cast<const float*>(logits);
  widened.resize(n);
  for (size_t i = 0; i < n; ++i) widened[i] = format::bf16_to_float(static_cast<const uint16_t*>(logits)[i]);
  return widened.data();
}

// The weights of docs/architecture.md, "Interfaces", as host arrays, checked against the problem; views, valid while the
// dict's arrays live.
struct HostWeights {
  reference::MoeWeights view;

  HostWeights(const MoeProblem& p, const nb::dict& weights, const WeightPrepOptions& options,
              const std::string& where = "Layer: weights") {
    const int64_t E = p.num_experts, H = p.hidden, I = p.inter, N13 = p.w13_rows();
    const bool w4a4 = p.act_quant != ActQuant::W4A16;
    const bool mxfp4 = p.weight_format == WeightFormat::MXFP4;  // w4a16 only (MoeProblem::validate)
    const TensorCheck host{where, false, 0};
    static const std::set<std::string> known = {"w13", "w13_scale", "w13_scale_2", "w13_input_scale",
                                                "w2",  "w2_scale",  "w2_scale_2",  "w2_input_scale",
                                                "w13_input_scale_max", "w13_bias", "w2_bias"};
    // MXFP4 has no global or input scales (docs/numerics.md, "MXFP4 weights"): one given is a mistake
    // about the format, never silently dropped.
    static const std::set<std::string> nvfp4_only = {"w13_scale_2", "w13_input_scale", "w2_scale_2",
                                                     "w2_input_scale", "w13_input_scale_max"};
    for (auto [key, value] : weights) {
      const std::string k = nb::cast<std::string>(key);
      check(known.count(k) == 1, where, ": unknown key '", k, "' (expected w13, w13_scale, w13_scale_2, ",
            "w13_input_scale, w2, w2_scale, w2_scale_2, w2_input_scale, w13_input_scale_max, w13_bias, w2_bias)");
      check(!mxfp4 || nvfp4_only.count(k) == 0, where, ": '", k, "' must be absent with weight_format mxfp4 (MXFP4 ",
            "has no global or input scales: w13, w13_scale, w2, w2_scale and the optional biases only)");
    }
    auto get = [&](const char* name, bool required) -> std::optional<InArray> {
      if (!weights.contains(name)) {
        check(!required, where, ": '", name, "' is missing",
              std::strstr(name, "input") ? " (act_quant " + std::string(to_string(p.act_quant)) + " needs it)" : "");
        return std::nullopt;
      }
      const nb::object value = weights[name];
      InArray a;
      if (!nb::try_cast(value, a, false))
        throw Error(detail::concat(where, ": '", name, "' is not an array (DLPack or the buffer protocol), got ",
                                   nb::cast<std::string>(nb::str(value.type()))));
      return a;
    };
    // Block scales: linear [rows..., cols/16], or the 128x4-swizzled bytes of fp4moe/format.hpp; MXFP4:
    // ue8m0 codes, linear [rows..., cols/32] only.
    auto scales = [&](const char* name, int64_t rows, int64_t cols, const char* symbolic) -> const uint8_t* {
      const InArray a = *get(name, true);
      if (mxfp4) {
        check(!options.scales_swizzled, where, ": scales_swizzled is for NVFP4 e4m3 scales; mxfp4 ue8m0 scales ",
              "come in the linear layout ", symbolic);
        return static_cast<const uint8_t*>(host(a, name, Elem::UE8M0, {E, rows, cols / 32}, symbolic));
      }
      if (!options.scales_swizzled)
        return static_cast<const uint8_t*>(host(a, name, Elem::E4M3, {E, rows, cols / 16}, symbolic));
      const int64_t bytes = format::swizzled_scales_size(E, rows, cols / 16);
      check(matches(a.dtype(), Elem::E4M3) && int64_t(a.size()) == bytes, where, ": ", name,
            ": scales_swizzled expects ", bytes, " float8_e4m3fn / uint8 elements (the 128x4-swizzled layout of [E, ",
            rows, ", ", cols / 16, "]), got ", a.size(), " of ", dtype_name(a.dtype()));
      host.check_layout(a, name);
      check(a.device_type() == kDLCPU || a.device_type() == kDLCUDAHost, where, ": ", name,
            ": expected a host tensor, got ", device_name(a.device_type(), a.device_id()));
      return static_cast<const uint8_t*>(a.data());
    };
    auto per_expert = [&](const char* name, bool required) -> const float* {
      const std::optional<InArray> a = get(name, required);
      return a ? static_cast<const float*>(host(*a, name, Elem::F32, {E}, "[E]")) : nullptr;
    };
    view.w13 = static_cast<const uint8_t*>(host(*get("w13", true), "w13", Elem::Packed, {E, N13, H / 2}, "[E, w13_rows, H/2]"));
    view.w13_scale = scales("w13_scale", N13, H, mxfp4 ? "[E, w13_rows, H/32]" : "[E, w13_rows, H/16]");
    view.w13_scale_2 = mxfp4 ? nullptr : per_expert("w13_scale_2", true);
    view.w13_input_scale = mxfp4 ? nullptr : per_expert("w13_input_scale", w4a4);
    view.w2 = static_cast<const uint8_t*>(host(*get("w2", true), "w2", Elem::Packed, {E, H, I / 2}, "[E, H, I/2]"));
    view.w2_scale = scales("w2_scale", H, I, mxfp4 ? "[E, H, I/32]" : "[E, H, I/16]");
    view.w2_scale_2 = mxfp4 ? nullptr : per_expert("w2_scale_2", true);
    view.w2_input_scale = mxfp4 ? nullptr : per_expert("w2_input_scale", w4a4);
    // Optional expert biases (gpt-oss), float32.
    if (const std::optional<InArray> b = get("w13_bias", false))
      view.w13_bias = static_cast<const float*>(host(*b, "w13_bias", Elem::F32, {E, N13}, "[E, w13_rows]"));
    if (const std::optional<InArray> b = get("w2_bias", false))
      view.w2_bias = static_cast<const float*>(host(*b, "w2_bias", Elem::F32, {E, H}, "[E, H]"));
    if (weights.contains("w13_input_scale_max")) {  // a number: the whole layer's (expert parallelism)
      const nb::object v = weights["w13_input_scale_max"];
      if (!nb::try_cast(v, view.w13_input_scale_max, true))
        throw Error(detail::concat(where, ": 'w13_input_scale_max' must be a number, got ",
                                   nb::cast<std::string>(nb::str(v.type()))));
    }
  }
};

// The problem and its prepared weights: on a Hopper GPU (MoeRunner) or canonical host copies for the
// CPU reference.
class PreparedLayer {
 public:
  PreparedLayer(const MoeProblem& problem, const nb::dict& weights, const std::string& device, int64_t max_tokens,
                int device_index, bool scales_swizzled, bool w13_up_gate)
      : problem_(problem), max_tokens_(max_tokens) {
    problem_.validate();
    check(device == "cpu" || device == "cuda", "Layer: device must be 'cpu' or 'cuda', got '", device, "'");
    check(max_tokens >= 0, "Layer: max_tokens must be >= 0, got ", max_tokens);
    const WeightPrepOptions options{scales_swizzled, w13_up_gate};
    const HostWeights host(problem_, weights, options);
    try {
      reference::check_biases(host.view, problem_);
    } catch (const Error& e) {
      throw Error(std::string("Layer: ") + e.what());
    }
    if (device == "cuda") {
      check(device_index >= 0, "Layer: device_index must name a CUDA device (>= 0), got ", device_index);
      device_ = device_index;
      runner_ = MoeRunner::create(problem_, max_tokens, device_index);
      Status s;
      {
        nb::gil_scoped_release release;
        s = runner_->prepare_weights(host.view, options);
      }
      if (!s.ok()) throw Error("Layer: " + s.message);
      return;
    }
    // CPU reference: keep a canonical copy (the caller's arrays may go away).
    io::CanonicalExpertWeights c;
    try {
      c = io::canonical_expert_weights(problem_, host.view, options);
    } catch (const Error& e) {
      throw Error(std::string("Layer: ") + e.what());
    }
    const int64_t E = problem_.num_experts;
    if (problem_.weight_format == WeightFormat::MXFP4) {  // NaN codes refused when the layer is built, as on cuda
      const int64_t H = problem_.hidden, I = problem_.inter, N13 = problem_.w13_rows();
      check_ue8m0(c.w13_scale, N13, H / format::kMxfp4BlockSize, "w13_scale (rows [gate; up])");
      check_ue8m0(c.w2_scale, H, I / format::kMxfp4BlockSize, "w2_scale");
    }
    w13_ = std::move(c.w13);
    w13_scale_ = std::move(c.w13_scale);
    w2_scale_ = std::move(c.w2_scale);
    w2_.assign(host.view.w2, host.view.w2 + E * problem_.hidden * problem_.inter / 2);
    w13_bias_ = std::move(c.w13_bias);
    if (host.view.w2_bias != nullptr) w2_bias_.assign(host.view.w2_bias, host.view.w2_bias + E * problem_.hidden);
    auto copy = [E](const float* v) { return v ? std::vector<float>(v, v + E) : std::vector<float>(E, 1.0f); };
    w13_scale_2_ = copy(host.view.w13_scale_2);
    w2_scale_2_ = copy(host.view.w2_scale_2);
    w13_input_scale_ = copy(host.view.w13_input_scale);
    w2_input_scale_ = copy(host.view.w2_input_scale);
    w13_input_scale_max_ = host.view.w13_input_scale_max;
  }

  // An MXFP4 scale tensor [E, rows, blocks] without the ue8m0 NaN code 255.
  static void check_ue8m0(const std::vector<uint8_t>& codes, int64_t rows, int64_t blocks, const char* name) {
    const int64_t i = format::find_ue8m0_nan(codes.data(), int64_t(codes.size()));
    check(i < 0, "Layer: ", name, ": ue8m0 block scale code 255 (NaN) at expert ", i / (rows * blocks), ", row ",
          (i / blocks) % rows, ", block ", i % blocks, "; MXFP4 scales must be codes 0..254");
  }

  const MoeProblem& problem() const { return problem_; }
  int64_t max_tokens() const { return max_tokens_; }
  bool on_cuda() const { return runner_ != nullptr; }
  // The runner of a cuda layer, for the separate stages; `where` names the entry point in the error.
  MoeRunner& runner(const std::string& where) const {
    check(runner_ != nullptr, where, ": the stages run on a cuda layer; the cpu layer runs the whole reference ",
          "forward only");
    return *runner_;
  }
  int device_index() const { return device_; }
  std::string device() const { return runner_ ? "cuda:" + std::to_string(device_) : "cpu"; }
  size_t workspace_size() const { return runner_ ? runner_->workspace_size(max_tokens_) : 0; }

  std::string tactic(int64_t num_tokens) const {
    check(runner_ != nullptr, "Layer.tactic: the cpu layer runs the reference and has no tactic");
    return describe(runner_->tactic_for(num_tokens));
  }
  void use_tune_cache(const std::string& path) {
    check(runner_ != nullptr, "Layer.use_tune_cache: the cpu layer runs the reference and has no tactic");
    runner_->use_tune_cache(path);
  }

  // The forward of a call checked against the problem (Layer::forward checks DLPack tensors,
  // python/jax_ffi.cpp XLA buffers) on `stream` (cuda; ignored on the cpu). Throws Error; the caller
  // releases the Python lock if it holds it.
  void run(const ForwardArgs& a, uintptr_t stream) const {
    const MoeProblem& p = problem_;
    const bool routed = p.routing.method == RoutingMethod::Precomputed;
    if (runner_) {
      auto* cu_stream = reinterpret_cast<CUstream_st*>(stream);
      const Status st = routed ? runner_->forward_routed(cu_stream, a) : runner_->forward(cu_stream, a);
      if (!st.ok()) throw Error(st.message);
      return;
    }

    // The CPU reference (docs/numerics.md, "The layer, step by step"), with the caller's routing when precomputed.
    const int64_t T = a.num_tokens;
    const bool logits_bf16 = a.logits_dtype == LogitsDType::BF16;
    std::vector<float> widened;
    reference::RouterInput router;
    router.logits =
        a.router_logits ? logits_as_f32(a.router_logits, logits_bf16, size_t(T * p.num_experts), widened) : nullptr;
    router.bias = a.routing_bias;
    if (routed) {
      router.topk_ids = a.topk_ids;
      router.topk_weights = a.topk_weights;
    }
    // MXFP4: no global or input scales (null pointers, reference::MoeWeights).
    const bool mxfp4 = p.weight_format == WeightFormat::MXFP4;
    auto vec = [mxfp4](const std::vector<float>& v) { return mxfp4 ? nullptr : v.data(); };
    reference::MoeWeights w{w13_.data(), w13_scale_.data(), vec(w13_scale_2_), vec(w13_input_scale_),
                            w2_.data(),  w2_scale_.data(),  vec(w2_scale_2_),  vec(w2_input_scale_),
                            w13_input_scale_max_};
    w.w13_bias = w13_bias_.empty() ? nullptr : w13_bias_.data();
    w.w2_bias = w2_bias_.empty() ? nullptr : w2_bias_.data();
    const reference::MoeResult r = reference::moe_forward(p, T, static_cast<const uint16_t*>(a.hidden), router, w);
    if (a.output_dtype == OutputDType::F32) std::memcpy(a.output, r.output_f32.data(), r.output_f32.size() * sizeof(float));
    else std::memcpy(a.output, r.output.data(), r.output.size() * sizeof(uint16_t));
    if (!routed) {
      std::memcpy(a.topk_ids, r.topk_ids.data(), r.topk_ids.size() * sizeof(int32_t));
      std::memcpy(a.topk_weights, r.topk_weights.data(), r.topk_weights.size() * sizeof(float));
    }
  }

 private:
  MoeProblem problem_;
  int64_t max_tokens_ = 0;
  int device_ = 0;
  std::unique_ptr<MoeRunner> runner_;  // cuda
  std::vector<uint8_t> w13_, w13_scale_, w2_, w2_scale_;  // cpu: canonical layout
  std::vector<float> w13_scale_2_, w13_input_scale_, w2_scale_2_, w2_input_scale_;
  float w13_input_scale_max_ = 0.0f;
  std::vector<float> w13_bias_, w2_bias_;  // cpu: canonical layout, or empty
};

// The live layers by id, for callers that hold no Python reference: a JAX custom call names its layer
// by an integer attribute. A lookup shares ownership, so a layer that Python drops mid-call lives
// until the call returns; a lookup after it is gone finds nothing.
class LayerRegistry {
 public:
  static LayerRegistry& instance() {
    static LayerRegistry registry;
    return registry;
  }
  int64_t add(const std::shared_ptr<PreparedLayer>& layer) {
    const std::lock_guard<std::mutex> lock(mutex_);
    const int64_t id = next_id_++;
    layers_.emplace(id, layer);
    return id;
  }
  void remove(int64_t id) {
    const std::lock_guard<std::mutex> lock(mutex_);
    layers_.erase(id);
  }
  std::shared_ptr<PreparedLayer> find(int64_t id) const {
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto it = layers_.find(id);
    return it == layers_.end() ? nullptr : it->second.lock();
  }

 private:
  mutable std::mutex mutex_;
  int64_t next_id_ = 1;
  std::unordered_map<int64_t, std::weak_ptr<PreparedLayer>> layers_;
};

// The tensors of a whole-layer forward, checked (device, dtype, shape, layout, alignment, T <= max_tokens)
// into `c` (ForwardArgs or ExpertParallelArgs: the same fields) and `memory`: hidden_states, router_logits
// (every routing method but precomputed), routing_bias (checked wherever given, read by deepseek_v3),
// topk_ids / topk_weights (read with precomputed routing, written otherwise) and output (bf16, or the
// float32 sums before the rounding).
template <typename Args>
void check_forward_tensors(const std::string& where, const MoeProblem& p, int64_t max_tokens, const TensorCheck& t,
                           Overlaps& memory, const nb::handle& hidden_obj, const nb::handle& logits_obj,
                           const nb::handle& bias_obj, const nb::handle& ids_obj, const nb::handle& weights_obj,
                           const nb::handle& output_obj, Args& c) {
  const bool routed = p.routing.method == RoutingMethod::Precomputed;
  const InArray hidden = as_array<InArray>(where, "hidden_states", hidden_obj);
  const std::optional<InArray> logits = as_optional_array<InArray>(where, "router_logits", logits_obj);
  const std::optional<InArray> bias = as_optional_array<InArray>(where, "routing_bias", bias_obj);
  const int64_t E = p.num_experts, H = p.hidden, k = p.top_k();
  c.hidden = t(hidden, "hidden_states", Elem::BF16, {-1, H}, "[T, H]", 16);
  const int64_t T = int64_t(hidden.shape(0));
  check(T <= max_tokens, where, ": hidden_states: T = ", T, " exceeds the layer's max_tokens = ", max_tokens);
  c.num_tokens = T;
  check(routed != logits.has_value(), where, ": ",
        routed ? "routing method precomputed takes topk_ids and topk_weights, not router_logits"
               : "router_logits is required (routing method " + std::string(to_string(p.routing.method)) + ")");
  memory.add(hidden, "hidden_states", false);
  if (logits) {
    c.router_logits = t(*logits, "router_logits", Elem::F32OrBF16, {T, E}, "[T, E]");
    c.logits_dtype = matches(logits->dtype(), Elem::F32) ? LogitsDType::F32 : LogitsDType::BF16;
    memory.add(*logits, "router_logits", false);
  }
  // Checked wherever given; read by deepseek_v3 only (routing_uses_bias), ignored by the other methods.
  if (bias) {
    const void* b = t(*bias, "routing_bias", Elem::F32, {E}, "[E]");
    if (routing_uses_bias(p.routing.method)) c.routing_bias = static_cast<const float*>(b);
    memory.add(*bias, "routing_bias", false);
  }
  // Precomputed routing reads topk_ids / topk_weights; the other methods write them.
  auto routing_tensor = [&](const nb::handle& obj, const char* name, Elem elem) {
    std::optional<InArray> in;
    std::optional<Array> out;
    if (routed) in = as_array<InArray>(where, name, obj);
    else out = as_array<Array>(where, name, obj);
    void* ptr = in ? t(*in, name, elem, {T, k}, "[T, k]") : t(*out, name, elem, {T, k}, "[T, k]");
    if (in) memory.add(*in, name, false);
    else memory.add(*out, name, true);
    return ptr;
  };
  c.topk_ids = static_cast<int32_t*>(routing_tensor(ids_obj, "topk_ids", Elem::I32));
  c.topk_weights = static_cast<float*>(routing_tensor(weights_obj, "topk_weights", Elem::F32));
  // float32: the fp32 sums before the rounding (partial outputs that the caller adds first)
  const Array output = as_array<Array>(where, "output", output_obj);
  c.output = t(output, "output", Elem::F32OrBF16, {T, H}, "[T, H]", 16);
  c.output_dtype = matches(output.dtype(), Elem::F32) ? OutputDType::F32 : OutputDType::BF16;
  memory.add(output, "output", true);
}

// The Python class fp4moe._fp4moe.Layer: a PreparedLayer with DLPack tensors in and out.
class Layer {
 public:
  Layer(const MoeProblem& problem, const nb::dict& weights, const std::string& device, int64_t max_tokens,
        int device_index, bool scales_swizzled, bool w13_up_gate)
      : impl_(std::make_shared<PreparedLayer>(problem, weights, device, max_tokens, device_index, scales_swizzled,
                                              w13_up_gate)),
        id_(LayerRegistry::instance().add(impl_)) {}
  ~Layer() { LayerRegistry::instance().remove(id_); }
  Layer(const Layer&) = delete;
  Layer& operator=(const Layer&) = delete;

  int64_t id() const { return id_; }
  const PreparedLayer& prepared() const { return *impl_; }
  const MoeProblem& problem() const { return impl_->problem(); }
  int64_t max_tokens() const { return impl_->max_tokens(); }
  std::string device() const { return impl_->device(); }
  size_t workspace_size() const { return impl_->workspace_size(); }
  std::string tactic(int64_t num_tokens) const { return impl_->tactic(num_tokens); }
  void use_tune_cache(const std::string& path) { impl_->use_tune_cache(path); }

  // Every argument is checked (python/dlpack_tensors.hpp: device, dtype, shape, layout, alignment,
  // overlaps, the workspace's size) before a pointer reaches the runner or the CPU reference.
  void forward(const nb::handle& hidden_obj, const nb::handle& logits_obj, const nb::handle& bias_obj,
               const nb::handle& ids_obj, const nb::handle& weights_obj, const nb::handle& output_obj,
               const nb::handle& workspace_obj, uintptr_t stream) {
    static const std::string where = "Layer.forward";
    const TensorCheck t{where, impl_->on_cuda(), impl_->device_index()};
    ForwardArgs c;
    Overlaps memory;
    check_forward_tensors(where, impl_->problem(), impl_->max_tokens(), t, memory, hidden_obj, logits_obj, bias_obj,
                          ids_obj, weights_obj, output_obj, c);
    const std::optional<Array> workspace = as_optional_array<Array>(where, "workspace", workspace_obj);
    if (impl_->on_cuda()) {
      check(workspace.has_value(), where, ": workspace is required on cuda (workspace_size() = ",
            impl_->workspace_size(), " bytes)");
      c.workspace = t(*workspace, "workspace", Elem::Bytes, {-1}, "[bytes]", 256);
      c.workspace_bytes = size_t(workspace->nbytes());
      check(c.workspace_bytes >= impl_->workspace_size(), where, ": workspace: expected at least workspace_size() = ",
            impl_->workspace_size(), " bytes, got ", c.workspace_bytes);
      memory.add(*workspace, "workspace", true);
    } else if (workspace) {  // the cpu layer needs none; one given is still checked
      t(*workspace, "workspace", Elem::Bytes, {-1}, "[bytes]");
    }
    memory.check(where);
    try {
      nb::gil_scoped_release release;
      impl_->run(c, stream);
    } catch (const Error& e) {
      throw Error(where + ": " + e.what());
    }
  }

  // ---- the layer as stages (MoeRunner::prepare / experts / finalize), cuda only ----
  // The rows prepare writes for T tokens: {num_rows, rows_top_k, format ("bf16" | "nvfp4"),
  // values_shape, scales_shape (linear [S, H/16]; swizzled: [bytes]; none for bf16)}.
  nb::dict prepared_rows(int64_t num_tokens, bool swizzled) const {
    static const std::string where = "Layer.prepared_rows";
    check(num_tokens >= 0 && num_tokens <= impl_->max_tokens(), where, ": num_tokens must be in [0, max_tokens=",
          impl_->max_tokens(), "], got ", num_tokens);
    const StageRowsShape s =
        impl_->runner(where).prepared_rows(num_tokens, swizzled ? ScaleLayout::Swizzled128x4 : ScaleLayout::Linear);
    return rows_dict(s, impl_->problem().hidden);
  }

  void prepare(const nb::handle& hidden_obj, const nb::handle& ids_obj, const nb::handle& weights_obj,
               const nb::handle& values_obj, const nb::handle& scales_obj, bool swizzled, uintptr_t stream) {
    static const std::string where = "Layer.prepare";
    MoeRunner& runner = impl_->runner(where);
    const MoeProblem& p = impl_->problem();
    const TensorCheck t{where, true, impl_->device_index()};
    const int64_t H = p.hidden, k = p.top_k();
    Overlaps memory;
    const InArray hidden = as_array<InArray>(where, "hidden_states", hidden_obj);
    PrepareArgs a;
    a.hidden = t(hidden, "hidden_states", Elem::BF16, {-1, H}, "[T, H]", 16);
    a.num_tokens = int64_t(hidden.shape(0));
    check(a.num_tokens <= impl_->max_tokens(), where, ": hidden_states: T = ", a.num_tokens,
          " exceeds the layer's max_tokens = ", impl_->max_tokens());
    memory.add(hidden, "hidden_states", false);
    const int64_t T = a.num_tokens;
    // Read only where a token's slots differ (per-expert input scales, the router weight on the input).
    // NOTE: presence, not the pointer: an empty tensor's data may be null.
    const auto ids = as_optional_array<InArray>(where, "topk_ids", ids_obj);
    if (ids) {
      a.topk_ids = static_cast<const int32_t*>(t(*ids, "topk_ids", Elem::I32, {T, k}, "[T, k]"));
      memory.add(*ids, "topk_ids", false);
    }
    check(ids.has_value() || p.act_quant != ActQuant::W4A4PerExpert, where,
          ": topk_ids is required with act_quant w4a4_per_expert (each copy takes its expert's input scale)");
    const auto w = as_optional_array<InArray>(where, "topk_weights", weights_obj);
    if (w) {
      a.topk_weights = static_cast<const float*>(t(*w, "topk_weights", Elem::F32, {T, k}, "[T, k]"));
      memory.add(*w, "topk_weights", false);
    }
    check(w.has_value() || !p.routing.apply_router_weight_on_input, where,
          ": topk_weights is required: the router weight goes on the input (apply_router_weight_on_input)");
    const StageRowsShape shape = runner.prepared_rows(T, swizzled ? ScaleLayout::Swizzled128x4 : ScaleLayout::Linear);
    a.rows = shape.rows;
    rows_tensors(where, t, memory, values_obj, scales_obj, shape, true, a.rows);
    memory.check(where);
    run_stage(where, [&] { return runner.prepare(reinterpret_cast<CUstream_st*>(stream), a); });
  }

  void experts(const nb::handle& values_obj, const nb::handle& scales_obj, bool swizzled, const nb::handle& ids_obj,
               const nb::handle& y_obj, const nb::handle& workspace_obj, uintptr_t stream) {
    static const std::string where = "Layer.experts";
    MoeRunner& runner = impl_->runner(where);
    const MoeProblem& p = impl_->problem();
    const TensorCheck t{where, true, impl_->device_index()};
    const int64_t H = p.hidden;
    Overlaps memory;
    const InArray ids = as_array<InArray>(where, "topk_ids", ids_obj);
    ExpertsArgs a;
    a.topk_ids = static_cast<const int32_t*>(t(ids, "topk_ids", Elem::I32, {-1, -1}, "[S, rows_top_k]"));
    memory.add(ids, "topk_ids", false);
    const int64_t S = int64_t(ids.shape(0)), rk = int64_t(ids.shape(1));
    check(rk >= 1 && rk <= p.top_k(), where, ": topk_ids: rows_top_k (its second extent) must be in [1, top_k=",
          p.top_k(), "], got ", rk);
    check(S * rk <= impl_->max_tokens() * p.top_k(), where, ": topk_ids: S * rows_top_k = ", S * rk,
          " exceeds max_tokens * top_k = ", impl_->max_tokens() * p.top_k());
    // The bytes of S rows in the problem's format (any S: rows may come from other ranks).
    const StageRowsShape shape =
        runner.rows_shape(S, int(rk), swizzled ? ScaleLayout::Swizzled128x4 : ScaleLayout::Linear);
    a.rows = shape.rows;
    rows_tensors(where, t, memory, values_obj, scales_obj, shape, false, a.rows);
    const Array y = as_array<Array>(where, "y", y_obj);
    a.y = static_cast<float*>(t(y, "y", Elem::F32, {S * rk, H}, "[S * rows_top_k, H]", 16));
    memory.add(y, "y", true);
    workspace_tensor(where, t, memory, workspace_obj, a.workspace, a.workspace_bytes);
    memory.check(where);
    run_stage(where, [&] { return runner.experts(reinterpret_cast<CUstream_st*>(stream), a); });
  }

  void finalize(const nb::handle& y_obj, const nb::handle& ids_obj, const nb::handle& weights_obj,
                const nb::handle& output_obj, uintptr_t stream) {
    static const std::string where = "Layer.finalize";
    MoeRunner& runner = impl_->runner(where);
    const MoeProblem& p = impl_->problem();
    const TensorCheck t{where, true, impl_->device_index()};
    const int64_t H = p.hidden, k = p.top_k();
    Overlaps memory;
    const InArray ids = as_array<InArray>(where, "topk_ids", ids_obj);
    FinalizeArgs a;
    a.topk_ids = static_cast<const int32_t*>(t(ids, "topk_ids", Elem::I32, {-1, k}, "[T, k]"));
    a.num_tokens = int64_t(ids.shape(0));
    const int64_t T = a.num_tokens;
    check(T <= impl_->max_tokens(), where, ": topk_ids: T = ", T, " exceeds the layer's max_tokens = ",
          impl_->max_tokens());
    memory.add(ids, "topk_ids", false);
    const InArray w = as_array<InArray>(where, "topk_weights", weights_obj);
    a.topk_weights = static_cast<const float*>(t(w, "topk_weights", Elem::F32, {T, k}, "[T, k]"));
    memory.add(w, "topk_weights", false);
    const InArray y = as_array<InArray>(where, "y", y_obj);
    a.y = static_cast<const float*>(t(y, "y", Elem::F32, {T * k, H}, "[T * k, H]", 16));
    memory.add(y, "y", false);
    const Array out = as_array<Array>(where, "output", output_obj);
    a.output = t(out, "output", Elem::F32OrBF16, {T, H}, "[T, H]", 16);
    a.output_dtype = matches(out.dtype(), Elem::F32) ? OutputDType::F32 : OutputDType::BF16;
    memory.add(out, "output", true);
    memory.check(where);
    run_stage(where, [&] { return runner.finalize(reinterpret_cast<CUstream_st*>(stream), a); });
  }

 private:
  // A stage call without the Python lock; its failure as an Error naming the entry point.
  template <typename Call>
  static void run_stage(const std::string& where, Call&& call) {
    Status st;
    {
      nb::gil_scoped_release release;
      st = call();
    }
    if (!st.ok()) throw Error(where + ": " + st.message);
  }

  static nb::dict rows_dict(const StageRowsShape& s, int64_t H) {
    nb::dict d;
    const bool bf16 = s.rows.format == RowFormat::BF16;
    const int64_t S = s.rows.num_rows;
    d["num_rows"] = S;
    d["rows_top_k"] = s.rows.rows_top_k;
    d["format"] = bf16 ? "bf16" : "nvfp4";
    d["scale_layout"] = s.rows.scale_layout == ScaleLayout::Linear ? "linear" : "swizzled";
    d["values_shape"] = nb::make_tuple(S, bf16 ? H : H / 2);
    if (bf16) d["scales_shape"] = nb::none();
    else if (s.rows.scale_layout == ScaleLayout::Linear) d["scales_shape"] = nb::make_tuple(S, H / 16);
    else d["scales_shape"] = nb::make_tuple(int64_t(s.scales_bytes));
    return d;
  }

  // The values / scales tensors of rows with `shape` (written by prepare, read by experts).
  static void rows_tensors(const std::string& where, const TensorCheck& t, Overlaps& memory, const nb::handle& values_obj,
                           const nb::handle& scales_obj, const StageRowsShape& shape, bool written, StageRows& rows) {
    const int64_t S = shape.rows.num_rows;
    const bool bf16 = shape.rows.format == RowFormat::BF16;
    const Array values = as_array<Array>(where, "values", values_obj);
    const int64_t H = bf16 ? int64_t(shape.values_bytes / 2) : int64_t(shape.values_bytes * 2);  // all rows
    const int64_t cols = S > 0 ? H / S : 0;
    rows.values = bf16 ? t(values, "values", Elem::BF16, {S, S > 0 ? cols : -1}, "[S, H] bf16", 16)
                       : t(values, "values", Elem::Packed, {S, S > 0 ? cols / 2 : -1}, "[S, H/2] packed e2m1", 8);
    memory.add(values, "values", written);
    const std::optional<Array> scales = as_optional_array<Array>(where, "scales", scales_obj);
    if (bf16) {
      check(!scales.has_value(), where, ": scales must be None: bf16 rows (act_quant w4a16) have no scales");
      rows.scales = nullptr;
      return;
    }
    check(scales.has_value(), where, ": scales is required: NVFP4 rows (act_quant w4a4) carry e4m3 block scales");
    if (shape.rows.scale_layout == ScaleLayout::Linear) {
      rows.scales = t(*scales, "scales", Elem::E4M3, {S, S > 0 ? int64_t(shape.scales_bytes) / S : -1}, "[S, H/16] e4m3");
    } else {
      t.check_device(*scales, "scales");
      check(matches(scales->dtype(), Elem::E4M3) && size_t(scales->size()) == shape.scales_bytes, where,
            ": scales: the 128x4-swizzled layout of [", S, ", H/16] holds ", shape.scales_bytes,
            " float8_e4m3fn / uint8 elements, got ", scales->size(), " of ", dtype_name(scales->dtype()));
      t.check_layout(*scales, "scales");
      rows.scales = scales->data();
    }
    memory.add(*scales, "scales", written);
  }

  void workspace_tensor(const std::string& where, const TensorCheck& t, Overlaps& memory, const nb::handle& obj,
                        void*& ptr, size_t& bytes) const {
    const std::optional<Array> workspace = as_optional_array<Array>(where, "workspace", obj);
    check(workspace.has_value(), where, ": workspace is required on cuda (workspace_size() = ",
          impl_->workspace_size(), " bytes)");
    ptr = t(*workspace, "workspace", Elem::Bytes, {-1}, "[bytes]", 256);
    bytes = size_t(workspace->nbytes());
    check(bytes >= impl_->workspace_size(), where, ": workspace: expected at least workspace_size() = ",
          impl_->workspace_size(), " bytes, got ", bytes);
    memory.add(*workspace, "workspace", true);
  }

  std::shared_ptr<PreparedLayer> impl_;
  int64_t id_;
};

// Routing alone (expert parallelism: every rank routes over the whole layer's experts): GpuRouter on
// cuda, reference::route on the cpu.
class Router {
 public:
  Router(const MoeProblem& problem, const std::string& device, int device_index)
      : params_(problem.routing), num_experts_(problem.num_experts) {
    check(device == "cpu" || device == "cuda", "Router: device must be 'cpu' or 'cuda', got '", device, "'");
    check(params_.method != RoutingMethod::Precomputed, "Router: routing method precomputed has nothing to route");
    problem.validate();
    if (device == "cuda") {
      check(device_index >= 0, "Router: device_index must name a CUDA device (>= 0), got ", device_index);
      device_ = device_index;
      gpu_ = GpuRouter::create(params_, num_experts_, device_index);
    }
  }

  std::string device() const { return gpu_ ? "cuda:" + std::to_string(device_) : "cpu"; }

  void route(const nb::handle& logits_obj, const nb::handle& bias_obj, const nb::handle& ids_obj,
             const nb::handle& weights_obj, uintptr_t stream) const {
    static const std::string where = "Router.route";
    const TensorCheck t{where, gpu_ != nullptr, device_};
    const InArray logits = as_array<InArray>(where, "router_logits", logits_obj);
    const std::optional<InArray> bias = as_optional_array<InArray>(where, "routing_bias", bias_obj);
    const int64_t E = num_experts_, k = params_.top_k;
    const void* s = t(logits, "router_logits", Elem::F32OrBF16, {-1, E}, "[T, E]");
    const int64_t T = int64_t(logits.shape(0));
    const bool logits_bf16 = !matches(logits.dtype(), Elem::F32);
    Overlaps memory;
    memory.add(logits, "router_logits", false);
    // Checked wherever given; read by deepseek_v3 only (routing_uses_bias), ignored by the other methods.
    const float* b = nullptr;
    if (bias) {
      const void* given = t(*bias, "routing_bias", Elem::F32, {E}, "[E]");
      if (routing_uses_bias(params_.method)) b = static_cast<const float*>(given);
      memory.add(*bias, "routing_bias", false);
    }
    const Array ids_array = as_array<Array>(where, "topk_ids", ids_obj);
    const Array weights_array = as_array<Array>(where, "topk_weights", weights_obj);
    auto* ids = static_cast<int32_t*>(t(ids_array, "topk_ids", Elem::I32, {T, k}, "[T, k]"));
    auto* weights = static_cast<float*>(t(weights_array, "topk_weights", Elem::F32, {T, k}, "[T, k]"));
    memory.add(ids_array, "topk_ids", true);
    memory.add(weights_array, "topk_weights", true);
    memory.check(where);
    if (gpu_) {
      Status st;
      {
        nb::gil_scoped_release release;
        st = gpu_->route(reinterpret_cast<CUstream_st*>(stream), T, s, logits_bf16 ? LogitsDType::BF16 : LogitsDType::F32,
                         b, ids, weights);
      }
      if (!st.ok()) throw Error(where + ": " + st.message);
      return;
    }
    std::vector<float> widened;
    const reference::Routing r = reference::route(params_, T, E, logits_as_f32(s, logits_bf16, size_t(T * E), widened), b);
    std::memcpy(ids, r.ids.data(), r.ids.size() * sizeof(int32_t));
    std::memcpy(weights, r.weights.data(), r.weights.size() * sizeof(float));
  }

 private:
  RoutingParams params_;
  int64_t num_experts_;
  int device_ = 0;
  std::unique_ptr<GpuRouter> gpu_;
};

}  // namespace fp4moe::python
