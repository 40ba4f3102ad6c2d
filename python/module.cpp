// python/module.cpp — the nanobind extension fp4moe._fp4moe: the problem, the layer on a Hopper GPU
// (MoeRunner) or on the CPU reference, checkpoint and random-case loading. Tensors come in through
// DLPack (torch, CuPy, NumPy, ...), so this file is the only C++ that sees framework tensors.
//
//   Layer(problem, weights, device, max_tokens, ...)   checks and prepares the weights (host arrays)
//   Layer.forward(hidden, logits, bias, ids, weights, output, workspace, stream)
//       every tensor comes from the caller, outputs and workspace included: the forward allocates
//       nothing and never synchronises, and captures into a CUDA graph like MoeRunner::forward.
//
// The Python package (python/fp4moe/__init__.py) allocates the outputs in the caller's framework and
// picks the caller's stream; python/fp4moe/torch_ops.py registers the PyTorch ops on top.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "fp4moe/case_file.hpp"
#include "fp4moe/checkpoint.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/presets.hpp"
#include "fp4moe/reference.hpp"
#include "fp4moe/runner.hpp"
#include "fp4moe/tactic.hpp"
#include "fp4moe/tune.hpp"
#include "fp4moe/weight_layout.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace fp4moe::python {
namespace {

using Code = nb::dlpack::dtype_code;
using Array = nb::ndarray<>;          // any dtype, device and layout: checked by TensorCheck
using InArray = nb::ndarray<nb::ro>;  // the same, read-only accepted (inputs)

// NOTE: DLPack device types (dlpack.h): kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3 (pinned host memory).
constexpr int kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3;

// ---- tensor checks ---------------------------------------------------------------------------------
enum class Elem { BF16, F32, I32, Packed, E4M3, Bytes, Logits };

bool is(nb::dlpack::dtype d, Code code, int bits) { return d.code == uint8_t(code) && d.bits == bits && d.lanes == 1; }

bool matches(nb::dlpack::dtype d, Elem e) {
  switch (e) {
    case Elem::BF16: return is(d, Code::Bfloat, 16) || is(d, Code::Int, 16) || is(d, Code::UInt, 16);
    case Elem::F32: return is(d, Code::Float, 32);
    case Elem::I32: return is(d, Code::Int, 32);
    case Elem::Packed: return is(d, Code::UInt, 8) || is(d, Code::Int, 8);
    case Elem::E4M3: return is(d, Code::Float8_E4M3FN, 8) || is(d, Code::UInt, 8);
    case Elem::Bytes: return is(d, Code::UInt, 8) || is(d, Code::Int, 8);
    case Elem::Logits: return matches(d, Elem::F32) || matches(d, Elem::BF16);
  }
  return false;
}

const char* expected_dtype(Elem e) {
  switch (e) {
    case Elem::BF16: return "bfloat16 (or its bits as int16 / uint16)";
    case Elem::F32: return "float32";
    case Elem::I32: return "int32";
    case Elem::Packed: return "uint8 (two e2m1 codes per byte)";
    case Elem::E4M3: return "float8_e4m3fn (or its bits as uint8)";
    case Elem::Bytes: return "uint8 or int8";
    case Elem::Logits: return "float32 or bfloat16 (or its bits as int16 / uint16)";
  }
  return "?";
}

std::string dtype_name(nb::dlpack::dtype d) {
  std::string s;
  switch (Code(d.code)) {
    case Code::Int: s = "int"; break;
    case Code::UInt: s = "uint"; break;
    case Code::Float: s = "float"; break;
    case Code::Bfloat: s = "bfloat"; break;
    case Code::Bool: return "bool";
    case Code::Float8_E4M3FN: return "float8_e4m3fn";
    case Code::Float8_E5M2: return "float8_e5m2";
    default: return detail::concat("dtype(code=", int(d.code), ", bits=", int(d.bits), ")");
  }
  s += std::to_string(d.bits);
  if (d.lanes != 1) s += "x" + std::to_string(d.lanes);
  return s;
}

template <typename A>
std::string shape_of(const A& a) {
  std::string s = "[";
  for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + "]";
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string device_name(int type, int id) {
  switch (type) {
    case kDLCPU: return "cpu";
    case kDLCUDA: return "cuda:" + std::to_string(id);
    case kDLCUDAHost: return "cuda pinned host memory";
    default: return "DLPack device type " + std::to_string(type);
  }
}

// Checks a caller tensor against what an entry point expects; the messages name the entry point,
// the tensor, the expected and the actual value (DESIGN.md §1, the API boundary).
struct TensorCheck {
  std::string where;   // e.g. "Layer.forward"
  bool on_cuda = false;
  int device = 0;      // the CUDA device when on_cuda

  template <typename A>
  void* operator()(const A& a, const char* name, Elem elem, const std::vector<int64_t>& shape,
                   const char* symbolic) const {
    auto fail = [&](auto&&... parts) { throw Error(detail::concat(where, ": ", name, ": ", parts...)); };
    if (!matches(a.dtype(), elem)) fail("expected dtype ", expected_dtype(elem), ", got ", dtype_name(a.dtype()));
    bool same = a.ndim() == shape.size();
    for (size_t i = 0; same && i < shape.size(); ++i) same = int64_t(a.shape(i)) == shape[i];
    if (!same) fail("expected shape ", symbolic, " = ", shape_text(shape), ", got ", shape_of(a));
    check_layout(a, name);
    const int type = a.device_type(), id = a.device_id();
    const bool ok = on_cuda ? (type == kDLCUDA && id == device) : (type == kDLCPU || type == kDLCUDAHost);
    if (!ok)
      fail("expected a tensor on ", on_cuda ? device_name(kDLCUDA, device) : "the cpu", " (the layer's device), got ",
           device_name(type, id));
    return const_cast<void*>(static_cast<const void*>(a.data()));
  }

  // Row-major and dense (dimensions of extent 1, and empty tensors, may have any strides).
  template <typename A>
  void check_layout(const A& a, const char* name) const {
    if (a.size() == 0) return;
    int64_t expected = 1;
    for (size_t i = a.ndim(); i-- > 0;) {
      if (a.shape(i) != 1 && a.stride(i) != expected)
        throw Error(detail::concat(where, ": ", name, ": expected a contiguous row-major tensor, got strides ",
                                   strides_of(a), " (in elements) for shape ", shape_of(a),
                                   "; make it contiguous first"));
      expected *= int64_t(a.shape(i));
    }
  }

  template <typename A>
  static std::string strides_of(const A& a) {
    std::string s = "[";
    for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.stride(i));
    return s + "]";
  }
};

// ---- host arrays out: owned by a capsule, exported through DLPack and the buffer protocol ---------
using HostArray = nb::ndarray<nb::array_api>;  // Python: an object with __dlpack__ and the buffer protocol

template <typename T>
HostArray to_array(std::vector<T>&& v, std::initializer_list<size_t> shape) {
  auto* owned = new std::vector<T>(std::move(v));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return HostArray(owned->data(), shape, owner, {}, nb::dtype<T>(), kDLCPU);
}

// ---- the layer -------------------------------------------------------------------------------------
// The weights of DESIGN.md §3 as host arrays, checked against the problem; views, valid while the
// dict's arrays live.
struct HostWeights {
  reference::MoeWeights view;

  HostWeights(const MoeProblem& p, const nb::dict& weights, const WeightPrepOptions& options,
              const std::string& where = "Layer: weights") {
    const int64_t E = p.num_experts, H = p.hidden, I = p.inter, N13 = p.w13_rows();
    const bool w4a4 = p.act_quant != ActQuant::W4A16;
    const TensorCheck host{where, false, 0};
    static const std::set<std::string> known = {"w13", "w13_scale", "w13_scale_2", "w13_input_scale",
                                                "w2",  "w2_scale",  "w2_scale_2",  "w2_input_scale",
                                                "w13_input_scale_max"};
    for (auto [key, value] : weights) {
      const std::string k = nb::cast<std::string>(key);
      check(known.count(k) == 1, where, ": unknown key '", k, "' (expected w13, w13_scale, w13_scale_2, ",
            "w13_input_scale, w2, w2_scale, w2_scale_2, w2_input_scale, w13_input_scale_max)");
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
    // Block scales: linear [rows..., cols/16], or the 128x4-swizzled bytes of fp4moe/format.hpp.
    auto scales = [&](const char* name, int64_t rows, int64_t cols, const char* symbolic) -> const uint8_t* {
      const InArray a = *get(name, true);
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
    view.w13_scale = scales("w13_scale", N13, H, "[E, w13_rows, H/16]");
    view.w13_scale_2 = per_expert("w13_scale_2", true);
    view.w13_input_scale = per_expert("w13_input_scale", w4a4);
    view.w2 = static_cast<const uint8_t*>(host(*get("w2", true), "w2", Elem::Packed, {E, H, I / 2}, "[E, H, I/2]"));
    view.w2_scale = scales("w2_scale", H, I, "[E, H, I/16]");
    view.w2_scale_2 = per_expert("w2_scale_2", true);
    view.w2_input_scale = per_expert("w2_input_scale", w4a4);
    if (weights.contains("w13_input_scale_max")) {  // a number: the whole layer's (expert parallelism)
      const nb::object v = weights["w13_input_scale_max"];
      if (!nb::try_cast(v, view.w13_input_scale_max, true))
        throw Error(detail::concat(where, ": 'w13_input_scale_max' must be a number, got ",
                                   nb::cast<std::string>(nb::str(v.type()))));
    }
  }
};

class Layer {
 public:
  Layer(const MoeProblem& problem, const nb::dict& weights, const std::string& device, int64_t max_tokens,
        int device_index, bool scales_swizzled, bool w13_up_gate)
      : problem_(problem), max_tokens_(max_tokens) {
    problem_.validate();
    check(device == "cpu" || device == "cuda", "Layer: device must be 'cpu' or 'cuda', got '", device, "'");
    check(max_tokens >= 0, "Layer: max_tokens must be >= 0, got ", max_tokens);
    const WeightPrepOptions options{scales_swizzled, w13_up_gate};
    const HostWeights host(problem_, weights, options);
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
    w13_ = std::move(c.w13);
    w13_scale_ = std::move(c.w13_scale);
    w2_scale_ = std::move(c.w2_scale);
    w2_.assign(host.view.w2, host.view.w2 + E * problem_.hidden * problem_.inter / 2);
    auto copy = [E](const float* v) { return v ? std::vector<float>(v, v + E) : std::vector<float>(E, 1.0f); };
    w13_scale_2_ = copy(host.view.w13_scale_2);
    w2_scale_2_ = copy(host.view.w2_scale_2);
    w13_input_scale_ = copy(host.view.w13_input_scale);
    w2_input_scale_ = copy(host.view.w2_input_scale);
    w13_input_scale_max_ = host.view.w13_input_scale_max;
  }

  const MoeProblem& problem() const { return problem_; }
  int64_t max_tokens() const { return max_tokens_; }
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

  void forward(const InArray& hidden, const std::optional<InArray>& logits, const std::optional<InArray>& bias,
               const Array& topk_ids, const Array& topk_weights, const Array& output,
               const std::optional<Array>& workspace, uintptr_t stream) {
    const MoeProblem& p = problem_;
    const bool routed = p.routing.method == RoutingMethod::Precomputed;
    const TensorCheck t{"Layer.forward", runner_ != nullptr, device_};
    check(hidden.ndim() == 2, "Layer.forward: hidden_states: expected shape [T, H], got ", shape_of(hidden));
    const int64_t T = int64_t(hidden.shape(0)), E = p.num_experts, H = p.hidden, k = p.top_k();
    check(T <= max_tokens_, "Layer.forward: hidden_states: T = ", T, " exceeds the layer's max_tokens = ", max_tokens_);
    const void* x = t(hidden, "hidden_states", Elem::BF16, {T, H}, "[T, H]");
    check(routed != logits.has_value(), "Layer.forward: ",
          routed ? "routing method precomputed takes topk_ids and topk_weights, not router_logits"
                 : "router_logits is required (routing method " + std::string(to_string(p.routing.method)) + ")");
    const void* s = logits ? t(*logits, "router_logits", Elem::Logits, {T, E}, "[T, E]") : nullptr;
    const bool logits_bf16 = logits && !matches(logits->dtype(), Elem::F32);
    check(!bias || p.routing.method == RoutingMethod::DeepSeekV3,
          "Layer.forward: routing_bias is only used by deepseek_v3 routing, got method ", to_string(p.routing.method));
    const float* b = bias ? static_cast<const float*>(t(*bias, "routing_bias", Elem::F32, {E}, "[E]")) : nullptr;
    auto* ids = static_cast<int32_t*>(t(topk_ids, "topk_ids", Elem::I32, {T, k}, "[T, k]"));
    auto* weights = static_cast<float*>(t(topk_weights, "topk_weights", Elem::F32, {T, k}, "[T, k]"));
    void* out = t(output, "output", Elem::BF16, {T, H}, "[T, H]");

    if (runner_) {
      check(workspace.has_value(), "Layer.forward: workspace is required on cuda (workspace_size() = ",
            workspace_size(), " bytes)");
      const int64_t ws_bytes = int64_t(workspace->nbytes());
      void* ws = t(*workspace, "workspace", Elem::Bytes, {ws_bytes}, "[workspace_size()]");
      ForwardArgs a;
      a.num_tokens = T;
      a.hidden = x;
      a.router_logits = s;
      a.logits_dtype = logits_bf16 ? LogitsDType::BF16 : LogitsDType::F32;
      a.routing_bias = b;
      a.topk_ids = ids;
      a.topk_weights = weights;
      a.output = out;
      a.workspace = ws;
      a.workspace_bytes = size_t(ws_bytes);
      Status st;
      {
        nb::gil_scoped_release release;
        auto* cu_stream = reinterpret_cast<CUstream_st*>(stream);
        st = routed ? runner_->forward_routed(cu_stream, a) : runner_->forward(cu_stream, a);
      }
      if (!st.ok()) throw Error("Layer.forward: " + st.message);
      return;
    }

    // The CPU reference (DESIGN.md §1), with the caller's routing when precomputed.
    std::vector<float> logits_f32;
    if (logits_bf16) {
      logits_f32.resize(size_t(T * E));
      const auto* bits = static_cast<const uint16_t*>(s);
      for (size_t i = 0; i < logits_f32.size(); ++i) logits_f32[i] = format::bf16_to_float(bits[i]);
    }
    reference::RouterInput router;
    router.logits = logits_bf16 ? logits_f32.data() : static_cast<const float*>(s);
    router.bias = b;
    if (routed) {
      router.topk_ids = ids;
      router.topk_weights = weights;
    }
    reference::MoeWeights w{w13_.data(), w13_scale_.data(), w13_scale_2_.data(), w13_input_scale_.data(),
                            w2_.data(),  w2_scale_.data(),  w2_scale_2_.data(),  w2_input_scale_.data(),
                            w13_input_scale_max_};
    reference::MoeResult r;
    {
      nb::gil_scoped_release release;
      r = reference::moe_forward(p, T, static_cast<const uint16_t*>(x), router, w);
    }
    std::memcpy(out, r.output.data(), r.output.size() * sizeof(uint16_t));
    if (!routed) {
      std::memcpy(ids, r.topk_ids.data(), r.topk_ids.size() * sizeof(int32_t));
      std::memcpy(weights, r.topk_weights.data(), r.topk_weights.size() * sizeof(float));
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

  void route(const InArray& logits, const std::optional<InArray>& bias, const Array& topk_ids,
             const Array& topk_weights, uintptr_t stream) const {
    const TensorCheck t{"Router.route", gpu_ != nullptr, device_};
    check(logits.ndim() == 2, "Router.route: router_logits: expected shape [T, E], got ", shape_of(logits));
    const int64_t T = int64_t(logits.shape(0)), E = num_experts_, k = params_.top_k;
    const void* s = t(logits, "router_logits", Elem::Logits, {T, E}, "[T, E]");
    const bool logits_bf16 = !matches(logits.dtype(), Elem::F32);
    check(!bias || params_.method == RoutingMethod::DeepSeekV3,
          "Router.route: routing_bias is only used by deepseek_v3 routing, got method ", to_string(params_.method));
    const float* b = bias ? static_cast<const float*>(t(*bias, "routing_bias", Elem::F32, {E}, "[E]")) : nullptr;
    auto* ids = static_cast<int32_t*>(t(topk_ids, "topk_ids", Elem::I32, {T, k}, "[T, k]"));
    auto* weights = static_cast<float*>(t(topk_weights, "topk_weights", Elem::F32, {T, k}, "[T, k]"));
    if (gpu_) {
      Status st;
      {
        nb::gil_scoped_release release;
        st = gpu_->route(reinterpret_cast<CUstream_st*>(stream), T, s, logits_bf16 ? LogitsDType::BF16 : LogitsDType::F32,
                         b, ids, weights);
      }
      if (!st.ok()) throw Error("Router.route: " + st.message);
      return;
    }
    std::vector<float> widened;
    if (logits_bf16) {
      widened.resize(size_t(T * E));
      for (size_t i = 0; i < widened.size(); ++i) widened[i] = format::bf16_to_float(static_cast<const uint16_t*>(s)[i]);
    }
    const reference::Routing r =
        reference::route(params_, T, E, logits_bf16 ? widened.data() : static_cast<const float*>(s), b);
    std::memcpy(ids, r.ids.data(), r.ids.size() * sizeof(int32_t));
    std::memcpy(weights, r.weights.data(), r.weights.size() * sizeof(float));
  }

 private:
  RoutingParams params_;
  int64_t num_experts_;
  int device_ = 0;
  std::unique_ptr<GpuRouter> gpu_;
};

// ---- host data out --------------------------------------------------------------------------------
nb::dict weights_dict(const MoeProblem& p, std::vector<uint8_t>&& w13, std::vector<uint8_t>&& w13_scale,
                      std::vector<float>&& w13_scale_2, std::vector<float>&& w13_input_scale,
                      std::vector<uint8_t>&& w2, std::vector<uint8_t>&& w2_scale, std::vector<float>&& w2_scale_2,
                      std::vector<float>&& w2_input_scale, float w13_input_scale_max = 0.0f) {
  const size_t E = size_t(p.num_experts), H = size_t(p.hidden), I = size_t(p.inter), N13 = size_t(p.w13_rows());
  nb::dict d;
  d["w13"] = to_array(std::move(w13), {E, N13, H / 2});
  d["w13_scale"] = to_array(std::move(w13_scale), {E, N13, H / 16});  // e4m3 bits
  d["w13_scale_2"] = to_array(std::move(w13_scale_2), {E});
  d["w13_input_scale"] = to_array(std::move(w13_input_scale), {E});
  d["w2"] = to_array(std::move(w2), {E, H, I / 2});
  d["w2_scale"] = to_array(std::move(w2_scale), {E, H, I / 16});  // e4m3 bits
  d["w2_scale_2"] = to_array(std::move(w2_scale_2), {E});
  d["w2_input_scale"] = to_array(std::move(w2_input_scale), {E});
  if (w13_input_scale_max > 0.0f) d["w13_input_scale_max"] = w13_input_scale_max;
  return d;
}

// A random case (io::make_random_packed_case): weights, bf16 hidden states (as uint16 bits) and logits.
nb::dict random_case(const MoeProblem& p, int64_t num_tokens, uint64_t seed) {
  io::MoeCase c = io::make_random_packed_case(p, num_tokens, seed);
  const size_t T = size_t(num_tokens), E = size_t(p.num_experts), H = size_t(p.hidden), k = size_t(p.top_k());
  nb::dict d;
  d["weights"] = weights_dict(p, std::move(c.w13), std::move(c.w13_scale), std::move(c.w13_scale_2),
                              std::move(c.w13_input_scale), std::move(c.w2), std::move(c.w2_scale),
                              std::move(c.w2_scale_2), std::move(c.w2_input_scale));
  d["hidden_states"] = to_array(std::move(c.hidden_states), {T, H});
  if (p.routing.method == RoutingMethod::Precomputed) {
    d["topk_ids"] = to_array(std::move(c.topk_ids), {T, k});
    d["topk_weights"] = to_array(std::move(c.topk_weights), {T, k});
  } else {
    d["router_logits"] = to_array(std::move(c.router_logits), {T, E});
  }
  if (!c.routing_bias.empty()) d["routing_bias"] = to_array(std::move(c.routing_bias), {E});
  return d;
}

// One MoE layer of a checkpoint directory (io::Checkpoint::load_layer).
nb::dict load_layer(const std::string& dir, int64_t layer, int ep_rank, int ep_size, int tp_rank, int tp_size,
                    const std::string& fusion) {
  io::LoadOptions options;
  options.ep_rank = ep_rank;
  options.ep_size = ep_size;
  options.tp_rank = tp_rank;
  options.tp_size = tp_size;
  options.fusion = io::parse_scale_fusion_policy(fusion);
  io::MoeLayerWeights w;
  {
    nb::gil_scoped_release release;
    w = io::Checkpoint::open(dir).load_layer(layer, options);
  }
  // An expert-parallel rank's problem takes the whole layer's routing as precomputed ids mapped to its
  // experts (skip_foreign_ids); "layer_problem" keeps the whole layer's (E, routing) for the router.
  MoeProblem layer_problem = w.problem;
  layer_problem.num_experts = w.total_experts;
  layer_problem.inter = w.total_inter;
  MoeProblem p = w.problem;
  if (w.expert_end - w.expert_begin < w.total_experts) {
    p.routing.method = RoutingMethod::Precomputed;
    p.routing.skip_foreign_ids = true;
  }
  const size_t total = size_t(w.total_experts), H = size_t(p.hidden);
  nb::dict d;
  d["problem"] = p;
  d["layer_problem"] = layer_problem;
  d["layer"] = w.layer;
  d["total_experts"] = w.total_experts;
  d["expert_begin"] = w.expert_begin;
  d["expert_end"] = w.expert_end;
  d["total_inter"] = w.total_inter;
  d["inter_begin"] = w.inter_begin;
  d["inter_end"] = w.inter_end;
  d["router_weight"] = to_array(std::move(w.router_weight), {total, H});
  if (!w.routing_bias.empty()) d["routing_bias"] = to_array(std::move(w.routing_bias), {total});
  d["experts_rescaled"] = w.fusion.experts_rescaled;
  d["block_scales_changed"] = w.fusion.block_scales_changed;
  d["worst_relative_change"] = w.fusion.worst_relative_change;
  d["weights"] = weights_dict(p, std::move(w.w13), std::move(w.w13_scale), std::move(w.w13_scale_2),
                              std::move(w.w13_input_scale), std::move(w.w2), std::move(w.w2_scale),
                              std::move(w.w2_scale_2), std::move(w.w2_input_scale), w.w13_input_scale_max);
  return d;
}

// The tensor-parallel shard of rank `rank` of `size` (io::tensor_parallel_shard): {problem, weights,
// inter_begin, inter_end}.
nb::dict tensor_parallel_shard(const MoeProblem& p, const nb::dict& weights, int rank, int size) {
  const HostWeights host(p, weights, {}, "tensor_parallel_shard: weights");
  io::TensorParallelShard s = io::tensor_parallel_shard(p, host.view, rank, size);
  nb::dict d;
  d["problem"] = s.problem;
  d["inter_begin"] = s.inter_begin;
  d["inter_end"] = s.inter_end;
  d["weights"] = weights_dict(s.problem, std::move(s.w13), std::move(s.w13_scale), std::move(s.w13_scale_2),
                              std::move(s.w13_input_scale), std::move(s.w2), std::move(s.w2_scale),
                              std::move(s.w2_scale_2), std::move(s.w2_input_scale), s.w13_input_scale_max);
  return d;
}

// Tests: writes the small checkpoint of io::write_fixture and returns the canonical weights each MoE
// layer must load as, {layer: weights dict}.
nb::dict write_checkpoint_fixture(const std::string& dir, const std::string& family, const std::string& format,
                                  int num_shards) {
  io::FixtureOptions options;
  options.family = io::parse_model_family(family);
  options.format = io::parse_checkpoint_format(format);
  options.num_shards = num_shards;
  if (options.family == io::ModelFamily::Llama4) options.top_k = 1;
  io::Fixture fixture = io::write_fixture(dir, options);
  nb::dict d;
  for (auto& [layer, w] : fixture.layers)
    d[nb::int_(layer)] = weights_dict(w.problem, std::move(w.w13), std::move(w.w13_scale), std::move(w.w13_scale_2),
                                      std::move(w.w13_input_scale), std::move(w.w2), std::move(w.w2_scale),
                                      std::move(w.w2_scale_2), std::move(w.w2_input_scale), w.w13_input_scale_max);
  return d;
}

MoeProblem make_problem(int64_t num_experts, int64_t hidden, int64_t inter, int top_k,
                        const std::string& routing_method, int n_group, int topk_group, float routed_scaling_factor,
                        bool apply_router_weight_on_input, bool skip_foreign_ids, const std::string& activation,
                        float swiglu_alpha, float swiglu_beta, float swiglu_limit, const std::string& act_quant) {
  MoeProblem p;
  p.num_experts = num_experts;
  p.hidden = hidden;
  p.inter = inter;
  p.routing.method = parse_routing_method(routing_method);
  p.routing.top_k = top_k;
  p.routing.n_group = n_group;
  p.routing.topk_group = topk_group;
  p.routing.routed_scaling_factor = routed_scaling_factor;
  p.routing.apply_router_weight_on_input = apply_router_weight_on_input;
  p.routing.skip_foreign_ids = skip_foreign_ids;
  p.activation.kind = parse_activation(activation);
  p.activation.swiglu_alpha = swiglu_alpha;
  p.activation.swiglu_beta = swiglu_beta;
  p.activation.swiglu_limit = swiglu_limit;
  p.act_quant = parse_act_quant(act_quant);
  p.validate();
  return p;
}

}  // namespace
}  // namespace fp4moe::python

NB_MODULE(_fp4moe, m) {
  using namespace fp4moe;
  using namespace fp4moe::python;
  m.doc() = "fp4moe: NVFP4 Mixture-of-Experts layers on Hopper GPUs (and the CPU reference)";
  m.attr("__version__") = std::string(fp4moe_version());
  nb::exception<Error>(m, "Error", PyExc_ValueError);

  nb::class_<MoeProblem>(m, "Problem", "What a MoE layer computes (DESIGN.md §1, §3, §4): shapes, routing, "
                                       "activation, quantization mode.")
      .def("__init__",
           [](MoeProblem* self, int64_t num_experts, int64_t hidden, int64_t inter, int top_k,
              const std::string& routing_method, int n_group, int topk_group, float routed_scaling_factor,
              bool apply_router_weight_on_input, bool skip_foreign_ids, const std::string& activation,
              float swiglu_alpha, float swiglu_beta, float swiglu_limit, const std::string& act_quant) {
             new (self) MoeProblem(make_problem(num_experts, hidden, inter, top_k, routing_method, n_group,
                                                topk_group, routed_scaling_factor, apply_router_weight_on_input,
                                                skip_foreign_ids, activation, swiglu_alpha, swiglu_beta, swiglu_limit,
                                                act_quant));
           },
           nb::kw_only(), "num_experts"_a, "hidden"_a, "inter"_a, "top_k"_a, "routing_method"_a = "renormalize",
           "n_group"_a = 1, "topk_group"_a = 1, "routed_scaling_factor"_a = 1.0f,
           "apply_router_weight_on_input"_a = false, "skip_foreign_ids"_a = false, "activation"_a = "swiglu", "swiglu_alpha"_a = 1.702f,
           "swiglu_beta"_a = 1.0f, "swiglu_limit"_a = 7.0f, "act_quant"_a = "w4a16")
      .def_ro("num_experts", &MoeProblem::num_experts)
      .def_ro("hidden", &MoeProblem::hidden)
      .def_ro("inter", &MoeProblem::inter)
      .def_prop_ro("top_k", &MoeProblem::top_k)
      .def_prop_ro("routing_method", [](const MoeProblem& p) { return std::string(to_string(p.routing.method)); })
      .def_prop_ro("n_group", [](const MoeProblem& p) { return p.routing.n_group; })
      .def_prop_ro("topk_group", [](const MoeProblem& p) { return p.routing.topk_group; })
      .def_prop_ro("routed_scaling_factor", [](const MoeProblem& p) { return p.routing.routed_scaling_factor; })
      .def_prop_ro("apply_router_weight_on_input",
                   [](const MoeProblem& p) { return p.routing.apply_router_weight_on_input; })
      .def_prop_ro("skip_foreign_ids", [](const MoeProblem& p) { return p.routing.skip_foreign_ids; })
      .def_prop_ro("activation", [](const MoeProblem& p) { return std::string(to_string(p.activation.kind)); })
      .def_prop_ro("act_quant", [](const MoeProblem& p) { return std::string(to_string(p.act_quant)); })
      .def_prop_ro("w13_rows", &MoeProblem::w13_rows)
      .def("with_act_quant",
           [](const MoeProblem& p, const std::string& mode) {
             MoeProblem q = p;
             q.act_quant = parse_act_quant(mode);
             q.validate();
             return q;
           },
           "act_quant"_a, "The same problem with another quantization mode (w4a16, w4a4_scalar, w4a4_per_expert).")
      .def("with_routing_method",
           [](const MoeProblem& p, const std::string& method) {
             MoeProblem q = p;
             q.routing.method = parse_routing_method(method);
             q.validate();
             return q;
           },
           "routing_method"_a, "The same problem with another routing method (e.g. precomputed).")
      .def("expert_parallel_rank",
           [](const MoeProblem& p, int64_t num_local_experts) {
             MoeProblem q = p;
             q.num_experts = num_local_experts;
             q.routing.method = RoutingMethod::Precomputed;
             q.routing.skip_foreign_ids = true;
             q.validate();
             return q;
           },
           "num_local_experts"_a,
           "An expert-parallel rank's problem: its experts only, precomputed routing with skip_foreign_ids (ids "
           "outside [0, num_local_experts) are other ranks' experts).")
      .def("describe", &MoeProblem::describe)
      .def("__repr__", [](const MoeProblem& p) { return "fp4moe.Problem(" + p.describe() + ")"; });

  m.def("preset", [](const std::string& name, const std::string& act_quant) { return preset(name, parse_act_quant(act_quant)); },
        "name"_a, "act_quant"_a = "w4a16", "A model preset of DESIGN.md §3 (deepseek-r1, qwen3-30b-a3b, ...).");
  m.def("preset_names", &preset_names);
  m.def("cuda_device_available", [] {
    std::string why;
    const bool ok = cuda_device_available(&why);
    return std::make_pair(ok, why);
  }, "(available, why not): an sm_90 device is visible and this build has the CUDA kernels.");
  m.def("random_case", &random_case, "problem"_a, "num_tokens"_a, "seed"_a = 1,
        "Random NVFP4 weights and inputs for a problem (host arrays; bf16 as uint16 bits).");
  m.def("load_layer", &load_layer, "checkpoint"_a, "layer"_a, nb::kw_only(), "ep_rank"_a = 0, "ep_size"_a = 1,
        "tp_rank"_a = 0, "tp_size"_a = 1, "fusion"_a = "rescale_to_max",
        "One MoE layer of an NVFP4 checkpoint directory in the canonical layout (host arrays).");

  m.def("tensor_parallel_shard", &tensor_parallel_shard, "problem"_a, "weights"_a, "rank"_a, "size"_a,
        "Rank `rank` of `size` of canonical weights: its share of the intermediate columns of every expert, in "
        "whole 16-column blocks (host arrays).");
  m.def("_write_checkpoint_fixture", &write_checkpoint_fixture, "dir"_a, "family"_a, "format"_a, "num_shards"_a = 2,
        "Tests only: a small random checkpoint in dir; returns {layer: the canonical weights it must load as}.");

  nb::class_<Router>(m, "Router", "Routing alone, over the experts of a problem ('cuda' or the 'cpu' reference).")
      .def(nb::init<const MoeProblem&, const std::string&, int>(), "problem"_a, "device"_a, "device_index"_a = 0)
      .def_prop_ro("device", &Router::device)
      .def("route", &Router::route, "router_logits"_a, "routing_bias"_a.none(), "topk_ids"_a, "topk_weights"_a,
           "stream"_a, "Top-k ids and weights into caller tensors (no allocation, no synchronisation on cuda).");

  nb::class_<Layer>(m, "Layer", "One prepared MoE layer on a device ('cuda' or the 'cpu' reference).")
      .def(nb::init<const MoeProblem&, const nb::dict&, const std::string&, int64_t, int, bool, bool>(), "problem"_a,
           "weights"_a, "device"_a, "max_tokens"_a, "device_index"_a = 0, "scales_swizzled"_a = false,
           "w13_up_gate"_a = false)
      .def_prop_ro("problem", &Layer::problem)
      .def_prop_ro("max_tokens", &Layer::max_tokens)
      .def_prop_ro("device", &Layer::device)
      .def("workspace_size", &Layer::workspace_size, "Bytes of device workspace a forward needs (0 on the cpu).")
      .def("tactic", &Layer::tactic, "num_tokens"_a, "The tactic a forward of num_tokens tokens uses (cuda).")
      .def("use_tune_cache", &Layer::use_tune_cache, "path"_a)
      .def("forward", &Layer::forward, "hidden_states"_a, "router_logits"_a.none(), "routing_bias"_a.none(),
           "topk_ids"_a, "topk_weights"_a, "output"_a, "workspace"_a.none(), "stream"_a,
           "Runs the layer into caller tensors (no allocation, no synchronisation on cuda).");
}
