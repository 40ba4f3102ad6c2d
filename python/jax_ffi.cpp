// python/jax_ffi.cpp — the layer as XLA FFI custom calls, so that JAX programs (jax.jit included) run
// fp4moe layers: python/fp4moe/jax_ops.py registers these handlers with jax.ffi and calls them.
//
//   fp4moe_moe_forward         args   hidden_states bf16 [T, H], router_logits f32|bf16 [T, E],
//                                     routing_bias f32 [E] or [0] (none)
//                              rets   output bf16 (or f32: the sums before the rounding) [T, H], topk_ids
//                                     s32 [T, k], topk_weights f32 [T, k],
//                                     workspace u8 [workspace_size()]
//   fp4moe_moe_forward_routed  args   hidden_states, topk_ids, topk_weights (precomputed routing)
//                              rets   output, workspace
//   attribute  layer (s64)     the Layer's id in LayerRegistry (python/layer.hpp)
//
// Each has a "CUDA" handler (the layer's MoeRunner on XLA's stream: no allocation, no synchronisation,
// so XLA may capture it into its command buffers) and a "cpu" handler (the CPU reference). XLA owns
// every buffer, the workspace included: it is a result that the caller drops. The handlers run on
// XLA's threads without the Python lock; errors come back to JAX as ffi::Error with the layer's message.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "fp4moe/error.hpp"
#include "python/layer.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace nanobind::literals;

namespace fp4moe::python {
namespace {

// A buffer as the checks see it: an XLA buffer in a handler, or at trace time a jax array's dtype and
// shape (_jax_check_args), so that both run the same checks with the same messages.
struct BufferSpec {
  ffi::DataType dtype;
  ffi::Span<const int64_t> dims;
};
BufferSpec spec(const ffi::AnyBuffer& b) { return {b.element_type(), b.dimensions()}; }

// The dtypes the calls use, by the names NumPy and JAX print.
constexpr std::pair<ffi::DataType, const char*> kDtypeNames[] = {
    {ffi::DataType::BF16, "bfloat16"}, {ffi::DataType::F32, "float32"}, {ffi::DataType::S32, "int32"},
    {ffi::DataType::U8, "uint8"},      {ffi::DataType::S8, "int8"},     {ffi::DataType::F16, "float16"},
    {ffi::DataType::S64, "int64"},     {ffi::DataType::F64, "float64"}, {ffi::DataType::U16, "uint16"},
    {ffi::DataType::S16, "int16"},     {ffi::DataType::U32, "uint32"},  {ffi::DataType::U64, "uint64"},
    {ffi::DataType::PRED, "bool"},     {ffi::DataType::F8E4M3FN, "float8_e4m3fn"}};

const char* dtype_name(ffi::DataType d) {
  for (const auto& [dtype, name] : kDtypeNames)
    if (dtype == d) return name;
  return "another dtype";
}
ffi::DataType dtype_of(const std::string& name) {
  for (const auto& [dtype, known] : kDtypeNames)
    if (name == known) return dtype;
  return ffi::DataType::INVALID;
}

std::string dims_text(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// Throws unless `b` has one of `dtypes` and exactly `shape`. NOTE: the messages are built only on a
// failure: a handler call allocates nothing on the host when its arguments are right.
void expect(const BufferSpec& b, const char* name, std::initializer_list<ffi::DataType> dtypes,
            std::initializer_list<int64_t> shape, const char* symbolic) {
  if (std::find(dtypes.begin(), dtypes.end(), b.dtype) == dtypes.end()) {
    std::string want;
    for (ffi::DataType d : dtypes) want += (want.empty() ? "" : " or ") + std::string(dtype_name(d));
    throw Error(detail::concat(name, ": expected ", want, ", got ", dtype_name(b.dtype)));
  }
  if (!std::equal(b.dims.begin(), b.dims.end(), shape.begin(), shape.end()))
    throw Error(detail::concat(name, ": expected shape ", symbolic, " = ",
                               dims_text(ffi::Span<const int64_t>(shape.begin(), shape.size())), ", got ",
                               dims_text(b.dims)));
}

// The registered layer `id`, checked to live where the call runs.
std::shared_ptr<PreparedLayer> find_layer(int64_t id, bool on_cuda, int32_t device_ordinal) {
  std::shared_ptr<PreparedLayer> layer = LayerRegistry::instance().find(id);
  check(layer != nullptr, "layer ", id, " no longer exists (a compiled JAX function keeps the id of the MoeLayer "
        "it was traced with, not the layer: keep the MoeLayer alive while the function is used)");
  check(layer->on_cuda() == on_cuda, "the layer is on ", layer->device(), " but the call runs on ",
        on_cuda ? "a CUDA device" : "the cpu", " (a JAX array on the layer's device runs it)");
  check(!on_cuda || layer->device_index() == device_ordinal, "the layer is on ", layer->device(),
        " but the call runs on CUDA device ", device_ordinal, " (one layer per device)");
  return layer;
}

// The arguments of moe_forward (a = router_logits, b = routing_bias, empty for none) or, with
// `routed`, of moe_forward_routed (a = topk_ids, b = topk_weights), checked against the layer;
// returns T. Run at trace time and again by the handlers.
int64_t check_args(const PreparedLayer& layer, bool routed, const BufferSpec& hidden, const BufferSpec& a,
                   const BufferSpec& b) {
  const MoeProblem& p = layer.problem();
  const bool precomputed = p.routing.method == RoutingMethod::Precomputed;
  check(!precomputed || routed, "routing method precomputed: call moe_forward_routed with topk_ids and topk_weights");
  check(precomputed || !routed, "routing method ", to_string(p.routing.method),
        " routes the layer's own logits: call moe_forward with router_logits");
  if (hidden.dims.size() != 2) throw Error("hidden_states: expected shape [T, H], got " + dims_text(hidden.dims));
  const int64_t T = hidden.dims[0], E = p.num_experts, k = p.top_k();
  check(T <= layer.max_tokens(), "hidden_states: T = ", T, " exceeds the layer's max_tokens = ", layer.max_tokens());
  expect(hidden, "hidden_states", {ffi::DataType::BF16}, {T, p.hidden}, "[T, H]");
  if (routed) {
    expect(a, "topk_ids", {ffi::DataType::S32}, {T, k}, "[T, k]");
    expect(b, "topk_weights", {ffi::DataType::F32}, {T, k}, "[T, k]");
    return T;
  }
  expect(a, "router_logits", {ffi::DataType::F32, ffi::DataType::BF16}, {T, E}, "[T, E]");
  const bool has_bias = !(b.dims.size() == 1 && b.dims[0] == 0);
  // Checked wherever given; read by deepseek_v3 only (routing_uses_bias), ignored by the other methods.
  if (has_bias) expect(b, "routing_bias", {ffi::DataType::F32}, {E}, "[E]");
  return T;
}

// bf16, or float32 for the fp32 sums before the rounding (ForwardArgs::output_dtype).
void set_output(ForwardArgs& c, const ffi::AnyBuffer& output) {
  c.output = output.untyped_data();
  c.output_dtype = output.element_type() == ffi::DataType::F32 ? OutputDType::F32 : OutputDType::BF16;
}

// NOTE: MoeRunner takes a 256-byte aligned workspace and XLA aligns its buffers less strictly, so a
// call asks XLA for kWorkspaceAlign - 1 bytes more than the layer needs and aligns inside them.
constexpr size_t kWorkspaceAlign = 256;
size_t workspace_request(const PreparedLayer& layer) {
  return layer.on_cuda() ? layer.workspace_size() + kWorkspaceAlign - 1 : 0;
}

void set_workspace(ForwardArgs& c, const PreparedLayer& layer, const ffi::AnyBuffer& workspace) {
  expect(spec(workspace), "workspace", {ffi::DataType::U8}, {int64_t(workspace_request(layer))},
         "[workspace_size() + 255]");
  const auto base = reinterpret_cast<uintptr_t>(workspace.untyped_data());
  const size_t skip = (kWorkspaceAlign - base % kWorkspaceAlign) % kWorkspaceAlign;
  c.workspace = reinterpret_cast<void*>(base + skip);
  c.workspace_bytes = workspace.size_bytes() - skip;  // >= workspace_size(): skip < kWorkspaceAlign
}

ffi::Error failure(const char* op, int64_t id, const std::exception& e) {
  return ffi::Error::InvalidArgument(std::string("fp4moe ") + op + " (layer " + std::to_string(id) + "): " + e.what());
}

ffi::Error forward(CUstream_st* stream, bool on_cuda, int32_t device_ordinal, int64_t id, ffi::AnyBuffer hidden,
                   ffi::AnyBuffer logits, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> output,
                   ffi::Result<ffi::AnyBuffer> topk_ids, ffi::Result<ffi::AnyBuffer> topk_weights,
                   ffi::Result<ffi::AnyBuffer> workspace) {
  try {
    const std::shared_ptr<PreparedLayer> layer = find_layer(id, on_cuda, device_ordinal);
    const MoeProblem& p = layer->problem();
    const int64_t T = check_args(*layer, false, spec(hidden), spec(logits), spec(bias)), k = p.top_k();
    expect(spec(*output), "output", {ffi::DataType::BF16, ffi::DataType::F32}, {T, p.hidden}, "[T, H]");
    expect(spec(*topk_ids), "topk_ids", {ffi::DataType::S32}, {T, k}, "[T, k]");
    expect(spec(*topk_weights), "topk_weights", {ffi::DataType::F32}, {T, k}, "[T, k]");
    ForwardArgs c;
    c.num_tokens = T;
    c.hidden = hidden.untyped_data();
    c.router_logits = logits.untyped_data();
    c.logits_dtype = logits.element_type() == ffi::DataType::BF16 ? LogitsDType::BF16 : LogitsDType::F32;
    c.routing_bias = bias.element_count() > 0 && routing_uses_bias(p.routing.method)
                         ? static_cast<const float*>(bias.untyped_data())
                         : nullptr;
    c.topk_ids = static_cast<int32_t*>(topk_ids->untyped_data());
    c.topk_weights = static_cast<float*>(topk_weights->untyped_data());
    set_output(c, *output);
    set_workspace(c, *layer, *workspace);
    layer->run(c, reinterpret_cast<uintptr_t>(stream));
    return ffi::Error::Success();
  } catch (const std::exception& e) {
    return failure("moe_forward", id, e);
  }
}

ffi::Error forward_routed(CUstream_st* stream, bool on_cuda, int32_t device_ordinal, int64_t id,
                          ffi::AnyBuffer hidden, ffi::AnyBuffer topk_ids, ffi::AnyBuffer topk_weights,
                          ffi::Result<ffi::AnyBuffer> output, ffi::Result<ffi::AnyBuffer> workspace) {
  try {
    const std::shared_ptr<PreparedLayer> layer = find_layer(id, on_cuda, device_ordinal);
    const int64_t T = check_args(*layer, true, spec(hidden), spec(topk_ids), spec(topk_weights));
    expect(spec(*output), "output", {ffi::DataType::BF16, ffi::DataType::F32}, {T, layer->problem().hidden}, "[T, H]");
    ForwardArgs c;
    c.num_tokens = T;
    c.hidden = hidden.untyped_data();
    // NOTE: precomputed ids and weights are only read; ForwardArgs' pointers are non-const because
    // the routing methods write them.
    c.topk_ids = static_cast<int32_t*>(topk_ids.untyped_data());
    c.topk_weights = static_cast<float*>(topk_weights.untyped_data());
    set_output(c, *output);
    set_workspace(c, *layer, *workspace);
    layer->run(c, reinterpret_cast<uintptr_t>(stream));
    return ffi::Error::Success();
  } catch (const std::exception& e) {
    return failure("moe_forward_routed", id, e);
  }
}

ffi::Error forward_cuda(CUstream_st* stream, int32_t device_ordinal, int64_t id, ffi::AnyBuffer hidden,
                        ffi::AnyBuffer logits, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> output,
                        ffi::Result<ffi::AnyBuffer> topk_ids, ffi::Result<ffi::AnyBuffer> topk_weights,
                        ffi::Result<ffi::AnyBuffer> workspace) {
  return forward(stream, true, device_ordinal, id, hidden, logits, bias, output, topk_ids, topk_weights, workspace);
}
ffi::Error forward_cpu(int64_t id, ffi::AnyBuffer hidden, ffi::AnyBuffer logits, ffi::AnyBuffer bias,
                       ffi::Result<ffi::AnyBuffer> output, ffi::Result<ffi::AnyBuffer> topk_ids,
                       ffi::Result<ffi::AnyBuffer> topk_weights, ffi::Result<ffi::AnyBuffer> workspace) {
  return forward(nullptr, false, 0, id, hidden, logits, bias, output, topk_ids, topk_weights, workspace);
}
ffi::Error forward_routed_cuda(CUstream_st* stream, int32_t device_ordinal, int64_t id, ffi::AnyBuffer hidden,
                               ffi::AnyBuffer topk_ids, ffi::AnyBuffer topk_weights,
                               ffi::Result<ffi::AnyBuffer> output, ffi::Result<ffi::AnyBuffer> workspace) {
  return forward_routed(stream, true, device_ordinal, id, hidden, topk_ids, topk_weights, output, workspace);
}
ffi::Error forward_routed_cpu(int64_t id, ffi::AnyBuffer hidden, ffi::AnyBuffer topk_ids, ffi::AnyBuffer topk_weights,
                              ffi::Result<ffi::AnyBuffer> output, ffi::Result<ffi::AnyBuffer> workspace) {
  return forward_routed(nullptr, false, 0, id, hidden, topk_ids, topk_weights, output, workspace);
}

// The bindings: [the CUDA stream and device ordinal,] the layer attribute, the three argument buffers,
// and the results (output, [topk_ids, topk_weights,] workspace).
auto cuda_context() { return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<CUstream_st*>>().Ctx<ffi::DeviceOrdinal>(); }
template <typename Binding>
auto layer_and_args(Binding&& b) {
  return std::forward<Binding>(b)
      .template Attr<int64_t>("layer")
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>();
}
template <typename Binding>
auto two_results(Binding&& b) {
  return std::forward<Binding>(b).template Ret<ffi::AnyBuffer>().template Ret<ffi::AnyBuffer>();
}

// NOTE: the cuda handlers neither allocate nor synchronise, so XLA may record them into its command
// buffers (CUDA graphs); the cpu reference allocates host vectors and is left out of them.
XLA_FFI_DEFINE_HANDLER(kForwardCuda, forward_cuda, two_results(two_results(layer_and_args(cuda_context()))),
                       {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(kForwardCpu, forward_cpu, two_results(two_results(layer_and_args(ffi::Ffi::Bind()))));
XLA_FFI_DEFINE_HANDLER(kForwardRoutedCuda, forward_routed_cuda, two_results(layer_and_args(cuda_context())),
                       {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(kForwardRoutedCpu, forward_routed_cpu, two_results(layer_and_args(ffi::Ffi::Bind())));

nb::capsule handler(XLA_FFI_Handler* fn) { return nb::capsule(reinterpret_cast<void*>(fn)); }

}  // namespace

void bind_jax_ffi(nb::module_& m) {
  m.def(
      "_jax_workspace_bytes", [](const Layer& layer) { return workspace_request(layer.prepared()); }, "layer"_a,
      "Bytes of the workspace result a call declares (the layer's workspace and room to align it).");
  // Trace time: the same checks as the handlers, on (dtype name, shape) pairs of jax arrays.
  m.def(
      "_jax_check_args",
      [](const Layer& layer, bool routed, const std::pair<std::string, std::vector<int64_t>>& hidden,
         const std::pair<std::string, std::vector<int64_t>>& a, const std::pair<std::string, std::vector<int64_t>>& b) {
        auto as_spec = [](const std::pair<std::string, std::vector<int64_t>>& x) {
          return BufferSpec{dtype_of(x.first), ffi::Span<const int64_t>(x.second.data(), x.second.size())};
        };
        try {
          return check_args(layer.prepared(), routed, as_spec(hidden), as_spec(a), as_spec(b));
        } catch (const Error& e) {
          throw Error(std::string("fp4moe.jax_ops.") + (routed ? "moe_forward_routed: " : "moe_forward: ") + e.what());
        }
      },
      "layer"_a, "routed"_a, "hidden_states"_a, "a"_a, "b"_a,
      "Checks a call's arguments as (dtype name, shape) against the layer; returns T (fp4moe.jax_ops).");
  m.def(
      "_jax_ffi_handlers",
      [] {
        nb::dict cuda, cpu, d;
        cuda["fp4moe_moe_forward"] = handler(kForwardCuda);
        cuda["fp4moe_moe_forward_routed"] = handler(kForwardRoutedCuda);
        cpu["fp4moe_moe_forward"] = handler(kForwardCpu);
        cpu["fp4moe_moe_forward_routed"] = handler(kForwardRoutedCpu);
        d["CUDA"] = cuda;
        d["cpu"] = cpu;
        return d;
      },
      "The XLA FFI handlers of the layer: {platform: {target name: PyCapsule}} (python/fp4moe/jax_ops.py).");
}

}  // namespace fp4moe::python
