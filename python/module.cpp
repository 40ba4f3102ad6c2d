// python/module.cpp — the nanobind extension fp4moe._fp4moe: the problem, the layer and the router
// (python/layer.hpp) on a Hopper GPU or the CPU reference, checkpoint, random-case and
// tensor-parallel loading. Tensors come in through DLPack (torch, CuPy, NumPy, ...; python/
// dlpack_tensors.hpp), so python/ is the only C++ that sees framework tensors.
//
// The Python package (python/fp4moe/__init__.py) allocates the outputs in the caller's framework and
// picks the caller's stream; python/fp4moe/torch_ops.py registers the PyTorch ops on top.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "fp4moe/case_file.hpp"
#include "fp4moe/checkpoint.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/presets.hpp"
#include "fp4moe/runner.hpp"
#include "fp4moe/tune.hpp"
#include "fp4moe/weight_layout.hpp"
#include "python/dlpack_tensors.hpp"
#include "python/expert_parallel.hpp"
#include "python/layer.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace fp4moe::python {

// The JAX custom calls' handlers: python/jax_ffi.cpp, or python/jax_ffi_unavailable.cpp in a build
// without jaxlib's XLA FFI headers.
void bind_jax_ffi(nb::module_& m);

namespace {

// ---- host data out --------------------------------------------------------------------------------
// The expert tensors of `w` (io::MoeCase, io::MoeLayerWeights or io::TensorParallelShard: the same field
// names), moved out of it into host arrays shaped by `p`.
template <typename Weights>
nb::dict weights_dict(const MoeProblem& p, Weights& w) {
  const size_t E = size_t(p.num_experts), H = size_t(p.hidden), I = size_t(p.inter), N13 = size_t(p.w13_rows());
  // NVFP4: e4m3 bits per 16 K elements and the [E] global and input scales; MXFP4: ue8m0 codes per 32 and
  // no [E] scales (reference::MoeWeights).
  const size_t block = size_t(p.weight_block());
  const bool mxfp4 = p.weight_format == WeightFormat::MXFP4;
  nb::dict d;
  d["w13"] = to_array(std::move(w.w13), {E, N13, H / 2});
  d["w13_scale"] = to_array(std::move(w.w13_scale), {E, N13, H / block});
  if (!mxfp4) {
    d["w13_scale_2"] = to_array(std::move(w.w13_scale_2), {E});
    d["w13_input_scale"] = to_array(std::move(w.w13_input_scale), {E});
  }
  d["w2"] = to_array(std::move(w.w2), {E, H, I / 2});
  d["w2_scale"] = to_array(std::move(w.w2_scale), {E, H, I / block});
  if (!mxfp4) {
    d["w2_scale_2"] = to_array(std::move(w.w2_scale_2), {E});
    d["w2_input_scale"] = to_array(std::move(w.w2_input_scale), {E});
  }
  if constexpr (requires { w.w13_input_scale_max; })
    if (w.w13_input_scale_max > 0.0f) d["w13_input_scale_max"] = w.w13_input_scale_max;
  if constexpr (requires { w.w13_bias; }) {  // optional expert biases
    if (!w.w13_bias.empty()) d["w13_bias"] = to_array(std::move(w.w13_bias), {E, N13});
    if (!w.w2_bias.empty()) d["w2_bias"] = to_array(std::move(w.w2_bias), {E, H});
  }
  return d;
}

// A random case (io::make_random_packed_case): weights, bf16 hidden states (as uint16 bits) and logits.
nb::dict random_case(const MoeProblem& p, int64_t num_tokens, uint64_t seed, bool expert_biases) {
  io::MoeCase c = io::make_random_packed_case(p, num_tokens, seed);
  if (expert_biases) io::add_random_expert_biases(c, seed);
  const size_t T = size_t(num_tokens), E = size_t(p.num_experts), H = size_t(p.hidden), k = size_t(p.top_k());
  nb::dict d;
  d["weights"] = weights_dict(p, c);
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
    p.routing.total_experts = w.total_experts;
  }
  const size_t total = size_t(w.total_experts), H = size_t(p.hidden);
  nb::dict d;
  d["problem"] = p;
  d["weight_format"] = std::string(to_string(p.weight_format));  // the checkpoint's: nvfp4 or mxfp4 (gpt-oss)
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
  // gpt-oss: the router's own bias, added to the logits (x . router_weight^T + router_bias).
  if (!w.router_bias.empty()) d["router_bias"] = to_array(std::move(w.router_bias), {total});
  d["experts_rescaled"] = w.fusion.experts_rescaled;
  d["block_scales_changed"] = w.fusion.block_scales_changed;
  d["worst_relative_change"] = w.fusion.worst_relative_change;
  d["weights"] = weights_dict(p, w);
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
  d["weights"] = weights_dict(s.problem, s);
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
    d[nb::int_(layer)] = weights_dict(w.problem, w);
  return d;
}

MoeProblem make_problem(int64_t num_experts, int64_t hidden, int64_t inter, int top_k,
                        const std::string& routing_method, int n_group, int topk_group, float routed_scaling_factor,
                        bool apply_router_weight_on_input, bool skip_foreign_ids, const std::string& activation,
                        float swiglu_alpha, float swiglu_beta, float swiglu_limit, const std::string& act_quant,
                        const std::string& weight_format) {
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
  p.weight_format = parse_weight_format(weight_format);
  p.validate();
  return p;
}

}  // namespace
}  // namespace fp4moe::python

NB_MODULE(_fp4moe, m) {
  using namespace fp4moe;
  using namespace fp4moe::python;
  m.doc() = "fp4moe: NVFP4 and MXFP4 Mixture-of-Experts layers on Hopper GPUs (and the CPU reference)";
  m.attr("__version__") = std::string(fp4moe_version());
  nb::exception<Error>(m, "Error", PyExc_ValueError);

  nb::class_<MoeProblem>(m, "Problem", "What a MoE layer computes (docs/numerics.md; docs/architecture.md, \"Interfaces\"): shapes, routing, "
                                       "activation, quantization mode.")
      .def("__init__",
           [](MoeProblem* self, int64_t num_experts, int64_t hidden, int64_t inter, int top_k,
              const std::string& routing_method, int n_group, int topk_group, float routed_scaling_factor,
              bool apply_router_weight_on_input, bool skip_foreign_ids, const std::string& activation,
              float swiglu_alpha, float swiglu_beta, float swiglu_limit, const std::string& act_quant,
              const std::string& weight_format) {
             new (self) MoeProblem(make_problem(num_experts, hidden, inter, top_k, routing_method, n_group,
                                                topk_group, routed_scaling_factor, apply_router_weight_on_input,
                                                skip_foreign_ids, activation, swiglu_alpha, swiglu_beta, swiglu_limit,
                                                act_quant, weight_format));
           },
           nb::kw_only(), "num_experts"_a, "hidden"_a, "inter"_a, "top_k"_a, "routing_method"_a = "renormalize",
           "n_group"_a = 1, "topk_group"_a = 1, "routed_scaling_factor"_a = 1.0f,
           "apply_router_weight_on_input"_a = false, "skip_foreign_ids"_a = false, "activation"_a = "swiglu", "swiglu_alpha"_a = 1.702f,
           "swiglu_beta"_a = 1.0f, "swiglu_limit"_a = 7.0f, "act_quant"_a = "w4a16", "weight_format"_a = "nvfp4")
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
      .def_prop_ro("total_experts", [](const MoeProblem& p) { return p.routing.total_experts; })
      .def_prop_ro("activation", [](const MoeProblem& p) { return std::string(to_string(p.activation.kind)); })
      .def_prop_ro("act_quant", [](const MoeProblem& p) { return std::string(to_string(p.act_quant)); })
      .def_prop_ro("weight_format", [](const MoeProblem& p) { return std::string(to_string(p.weight_format)); },
                   "The weights' 4-bit format: nvfp4 (e4m3 scales per 16, per-expert global scales) or mxfp4 "
                   "(ue8m0 scales per 32, no global scale; w4a16 only).")
      .def_prop_ro("weight_block", &MoeProblem::weight_block, "K elements per weight block scale: 16 or 32.")
      .def_prop_ro("w13_rows", &MoeProblem::w13_rows)
      .def("with_act_quant",
           [](const MoeProblem& p, const std::string& mode) {
             MoeProblem q = p;
             q.act_quant = parse_act_quant(mode);
             q.validate();
             return q;
           },
           "act_quant"_a, "The same problem with another quantization mode (w4a16, w4a4_scalar, w4a4_per_expert).")
      .def("with_weight_format",
           [](const MoeProblem& p, const std::string& format) {
             MoeProblem q = p;
             q.weight_format = parse_weight_format(format);
             q.validate();
             return q;
           },
           "weight_format"_a, "The same problem with another weight format (nvfp4, mxfp4; mxfp4 is w4a16 only).")
      .def("with_routing_method",
           [](const MoeProblem& p, const std::string& method) {
             MoeProblem q = p;
             q.routing.method = parse_routing_method(method);
             q.validate();
             return q;
           },
           "routing_method"_a, "The same problem with another routing method (e.g. precomputed).")
      .def("expert_parallel_rank", &MoeProblem::expert_parallel_rank, "num_local_experts"_a,
           "An expert-parallel rank's problem: its experts only, precomputed routing with skip_foreign_ids (ids "
           "outside [0, num_local_experts) are other ranks' experts), total_experts the whole layer's (its "
           "tactics are chosen for the load an even routing gives the rank).")
      .def("describe", &MoeProblem::describe)
      .def("__repr__", [](const MoeProblem& p) { return "fp4moe.Problem(" + p.describe() + ")"; });

  m.def("preset", [](const std::string& name, const std::string& act_quant) { return preset(name, parse_act_quant(act_quant)); },
        "name"_a, "act_quant"_a = "w4a16", "A model preset (docs/architecture.md, \"Interfaces\": deepseek-r1, qwen3-30b-a3b, ...).");
  m.def("preset_names", &preset_names);
  m.def("preset_weight_format", [](const std::string& name) { return std::string(to_string(preset_weight_format(name))); },
        "name"_a, "A preset's weight format: nvfp4, or mxfp4 (gpt-oss-120b, gpt-oss-20b; w4a16 only).");
  m.def("cuda_device_available", [] {
    std::string why;
    const bool ok = cuda_device_available(&why);
    return std::make_pair(ok, why);
  }, "(available, why not): an sm_90 device is visible and this build has the CUDA kernels.");
  m.def("random_case", &random_case, "problem"_a, "num_tokens"_a, "seed"_a = 1, "expert_biases"_a = false,
        "Random weights of the problem's weight_format (NVFP4, or MXFP4: ue8m0 scales, no [E] scales) and inputs "
        "for a problem (host arrays; bf16 as uint16 bits), with random expert biases (w13_bias, w2_bias) when "
        "asked.");
  m.def("load_layer", &load_layer, "checkpoint"_a, "layer"_a, nb::kw_only(), "ep_rank"_a = 0, "ep_size"_a = 1,
        "tp_rank"_a = 0, "tp_size"_a = 1, "fusion"_a = "rescale_to_max",
        "One MoE layer of a checkpoint directory (NVFP4, or gpt-oss MXFP4) in the canonical layout (host arrays).");

  m.def("tensor_parallel_shard", &tensor_parallel_shard, "problem"_a, "weights"_a, "rank"_a, "size"_a,
        "Rank `rank` of `size` of canonical weights: its share of the intermediate columns of every expert, in "
        "whole blocks of weight_block (16 NVFP4, 32 MXFP4) columns (host arrays).");
  m.def("_write_checkpoint_fixture", &write_checkpoint_fixture, "dir"_a, "family"_a, "format"_a, "num_shards"_a = 2,
        "Tests only: a small random checkpoint in dir; returns {layer: the canonical weights it must load as}.");

  nb::class_<Router>(m, "Router", "Routing alone, over the experts of a problem ('cuda' or the 'cpu' reference).")
      .def(nb::init<const MoeProblem&, const std::string&, int>(), "problem"_a, "device"_a, "device_index"_a = 0)
      .def_prop_ro("device", &Router::device)
      .def("route", &Router::route, "router_logits"_a.none(), "routing_bias"_a.none(), "topk_ids"_a.none(),
           "topk_weights"_a.none(),
           "stream"_a, "Top-k ids and weights into caller tensors (no allocation, no synchronisation on cuda).");

  nb::class_<Layer>(m, "Layer", "One prepared MoE layer on a device ('cuda' or the 'cpu' reference).")
      .def(nb::init<const MoeProblem&, const nb::dict&, const std::string&, int64_t, int, bool, bool>(), "problem"_a,
           "weights"_a, "device"_a, "max_tokens"_a, "device_index"_a = 0, "scales_swizzled"_a = false,
           "w13_up_gate"_a = false)
      .def_prop_ro("id", &Layer::id, "The layer's id, by which the JAX custom calls name it.")
      .def_prop_ro("problem", &Layer::problem)
      .def_prop_ro("max_tokens", &Layer::max_tokens)
      .def_prop_ro("device", &Layer::device)
      .def("workspace_size", &Layer::workspace_size, "Bytes of device workspace a forward needs (0 on the cpu).")
      .def("tactic", &Layer::tactic, "num_tokens"_a, "The tactic a forward of num_tokens tokens uses (cuda).")
      .def("use_tune_cache", &Layer::use_tune_cache, "path"_a)
      .def("forward", &Layer::forward, "hidden_states"_a.none(), "router_logits"_a.none(), "routing_bias"_a.none(),
           "topk_ids"_a.none(), "topk_weights"_a.none(), "output"_a.none(), "workspace"_a.none(), "stream"_a,
           "Runs the layer into caller tensors (no allocation, no synchronisation on cuda).")
      .def("prepared_rows", &Layer::prepared_rows, "num_tokens"_a, "swizzled"_a,
           "The rows prepare writes for num_tokens tokens (cuda).")
      .def("prepare", &Layer::prepare, "hidden_states"_a.none(), "topk_ids"_a.none(), "topk_weights"_a.none(),
           "values"_a.none(), "scales"_a.none(), "swizzled"_a, "stream"_a,
           "Stage 2: hidden_states -> the GEMM1 operand rows (cuda).")
      .def("experts", &Layer::experts, "values"_a.none(), "scales"_a.none(), "swizzled"_a, "topk_ids"_a.none(),
           "y"_a.none(), "workspace"_a.none(), "stream"_a, "Stage 3: rows -> y per entry (cuda).")
      .def("finalize", &Layer::finalize, "y"_a.none(), "topk_ids"_a.none(), "topk_weights"_a.none(),
           "output"_a.none(), "stream"_a, "Stage 4: y -> the output, slots summed in order (cuda).");

  nb::class_<PyCommunicator>(m, "Communicator", "A rank of an expert-parallel group (virtual_ranks, nccl_communicator).")
      .def_prop_ro("rank", &PyCommunicator::rank)
      .def_prop_ro("size", &PyCommunicator::size);
  m.def("virtual_ranks", &virtual_ranks, "size"_a, "device_index"_a = -1, "timeout_seconds"_a = 120.0,
        "size in-process ranks on one GPU (device copies for the exchanges); each rank's calls from its own thread.");
  m.def("nccl_unique_id", &nccl_unique_id_bytes, "A new NCCL unique id (bytes) for nccl_communicator (NCCL loaded at run time).");
  m.def("nccl_communicator", &nccl_communicator, "unique_id"_a, "rank"_a, "size"_a, "device_index"_a,
        "Rank `rank` of an NCCL group of `size` (ncclCommInitRank; returns once every rank has joined).");
  nb::class_<PyExpertParallelLayer>(m, "ExpertParallelLayer",
                                    "One rank of the expert-parallel layer (cuda): FP4 rows all-to-all or all-gathered, fp32 back.")
      .def(nb::init<const MoeProblem&, const nb::dict&, const std::shared_ptr<PyCommunicator>&, int64_t, int, int64_t,
                    bool, const std::string&>(),
           "problem"_a, "weights"_a, "communicator"_a, "max_tokens"_a, "device_index"_a,
           "receive_capacity_rows"_a = 0, "w13_up_gate"_a = false, "scheme"_a = "all_to_all")
      .def_prop_ro("scheme", &PyExpertParallelLayer::scheme)
      .def_prop_ro("problem", &PyExpertParallelLayer::problem)
      .def_prop_ro("local_problem", &PyExpertParallelLayer::local_problem)
      .def_prop_ro("max_tokens", &PyExpertParallelLayer::max_tokens)
      .def_prop_ro("rank", &PyExpertParallelLayer::rank)
      .def_prop_ro("size", &PyExpertParallelLayer::size)
      .def("last_traffic", &PyExpertParallelLayer::last_traffic, "Rows and wire bytes of this rank's last forward.")
      .def("forward", &PyExpertParallelLayer::forward, "hidden_states"_a.none(), "router_logits"_a.none(),
           "routing_bias"_a.none(), "topk_ids"_a.none(), "topk_weights"_a.none(), "output"_a.none(), "stream"_a,
           "This rank's tokens through the layer (waits for the other ranks; not capturable).");

  bind_jax_ffi(m);
}
