// format/problem.cpp — names, parsing, validation and description of MoeProblem (docs/numerics.md, docs/architecture.md "Interfaces").
//
// Steps: one table per enum maps the value to its snake_case name (docs/case-file.md); parsing looks the
// name up in that table and, on failure, throws an error that lists every accepted name. validate()
// checks sizes, top-k, and the method/activation-specific parameters, naming the field, the expected
// and the actual value.
#include <cmath>
#include <sstream>
#include <string>
#include <string_view>

#include "fp4moe/error.hpp"
#include "fp4moe/problem.hpp"

namespace fp4moe {
namespace {

template <typename E>
struct NameEntry {
  E value;
  std::string_view name;
};

constexpr NameEntry<RoutingMethod> kRoutingNames[] = {
    {RoutingMethod::Default, "default"},
    {RoutingMethod::Renormalize, "renormalize"},
    {RoutingMethod::RenormalizeNaive, "renormalize_naive"},
    {RoutingMethod::TopK, "topk"},
    {RoutingMethod::Sigmoid, "sigmoid"},
    {RoutingMethod::SigmoidRenorm, "sigmoid_renorm"},
    {RoutingMethod::TopKSigmoid, "topk_sigmoid"},
    {RoutingMethod::Llama4, "llama4"},
    {RoutingMethod::DeepSeekV3, "deepseek_v3"},
    {RoutingMethod::Precomputed, "precomputed"},
};

constexpr NameEntry<Activation> kActivationNames[] = {
    {Activation::SwiGLU, "swiglu"},
    {Activation::GeGLU, "geglu"},
    {Activation::SwiGLUOai, "swiglu_oai"},
    {Activation::Relu2, "relu2"},
};

constexpr NameEntry<ActQuant> kActQuantNames[] = {
    {ActQuant::W4A16, "w4a16"},
    {ActQuant::W4A4Scalar, "w4a4_scalar"},
    {ActQuant::W4A4PerExpert, "w4a4_per_expert"},
};
constexpr NameEntry<WeightFormat> kWeightFormatNames[] = {
    {WeightFormat::NVFP4, "nvfp4"},
    {WeightFormat::MXFP4, "mxfp4"},
};

template <typename E, size_t N>
std::string_view name_of(const NameEntry<E> (&table)[N], E value) {
  for (const auto& e : table)
    if (e.value == value) return e.name;
  return "unknown";
}

template <typename E, size_t N>
E parse_name(const NameEntry<E> (&table)[N], std::string_view name, std::string_view what) {
  for (const auto& e : table)
    if (e.name == name) return e.value;
  std::ostringstream accepted;
  for (size_t i = 0; i < N; ++i) accepted << (i ? ", " : "") << table[i].name;
  throw Error(detail::concat(what, ": unknown name '", name, "', expected one of: ", accepted.str()));
}

}  // namespace

std::string_view to_string(RoutingMethod m) { return name_of(kRoutingNames, m); }
std::string_view to_string(Activation a) { return name_of(kActivationNames, a); }
std::string_view to_string(ActQuant q) { return name_of(kActQuantNames, q); }

bool routing_uses_bias(RoutingMethod m) { return m == RoutingMethod::DeepSeekV3; }

RoutingMethod parse_routing_method(std::string_view name, std::string_view what) {
  return parse_name(kRoutingNames, name, what);
}
Activation parse_activation(std::string_view name, std::string_view what) {
  return parse_name(kActivationNames, name, what);
}
ActQuant parse_act_quant(std::string_view name, std::string_view what) {
  return parse_name(kActQuantNames, name, what);
}
std::string_view to_string(WeightFormat f) { return name_of(kWeightFormatNames, f); }
WeightFormat parse_weight_format(std::string_view name, std::string_view what) {
  return parse_name(kWeightFormatNames, name, what);
}

void MoeProblem::validate() const {
  check(num_experts >= 1, "MoeProblem.num_experts (E) must be >= 1, got ", num_experts);
  check(hidden >= 16 && hidden % 16 == 0,
        "MoeProblem.hidden (H) must be a multiple of 16 and >= 16 (the NVFP4 block size), got ", hidden);
  check(inter >= 16 && inter % 16 == 0,
        "MoeProblem.inter (I) must be a multiple of 16 and >= 16 (the NVFP4 block size), got ", inter);
  if (weight_format == WeightFormat::MXFP4) {
    check(hidden % 32 == 0, "MoeProblem.hidden (H) must be a multiple of 32 with mxfp4 weights (the MXFP4 block "
          "size), got ", hidden);
    check(inter % 32 == 0, "MoeProblem.inter (I) must be a multiple of 32 with mxfp4 weights (the MXFP4 block "
          "size), got ", inter);
    check(act_quant == ActQuant::W4A16, "MoeProblem.act_quant must be w4a16 with mxfp4 weights (no other "
          "activation format is defined for MXFP4), got ", to_string(act_quant));
  }
  const int k = routing.top_k;
  check(k >= 1 && k <= 32, "MoeProblem.routing.top_k (k) must be in [1, 32], got ", k);
  check(k <= num_experts || routing.skip_foreign_ids, "MoeProblem.routing.top_k (k) must be <= num_experts (E = ",
        num_experts, "), got ", k);
  check(!routing.skip_foreign_ids || routing.method == RoutingMethod::Precomputed,
        "MoeProblem.routing.skip_foreign_ids needs routing method precomputed (the caller maps the whole "
        "layer's expert ids to this rank's), got ", to_string(routing.method));
  check(routing.total_experts == 0 || (routing.skip_foreign_ids && routing.total_experts >= num_experts),
        "MoeProblem.routing.total_experts (the whole layer's experts) needs skip_foreign_ids and must be >= "
        "num_experts (E = ", num_experts, "), got ", routing.total_experts);

  if (routing.method == RoutingMethod::DeepSeekV3) {
    const int ng = routing.n_group;
    check(ng >= 1, "MoeProblem.routing.n_group must be >= 1 for deepseek_v3, got ", ng);
    // NOTE: every backend takes the GPU route kernel's limit (one shared-memory key per group), so that a
    // problem the CPU accepts is one the GPU runs.
    check(ng <= kMaxRoutingGroups, "MoeProblem.routing.n_group must be <= ", kMaxRoutingGroups,
          " for deepseek_v3, got ", ng);
    check(num_experts % ng == 0, "MoeProblem.routing.n_group must divide num_experts (E = ",
          num_experts, ") for deepseek_v3, got ", ng);
    check(ng == 1 || num_experts / ng >= 2,
          "MoeProblem.routing.n_group must leave >= 2 experts per group (a group's score is the sum of "
          "its top two) for deepseek_v3: E = ", num_experts, ", n_group = ", ng);
    check(routing.topk_group >= 1 && routing.topk_group <= ng,
          "MoeProblem.routing.topk_group must be in [1, n_group = ", ng, "] for deepseek_v3, got ",
          routing.topk_group);
    const int64_t kept = static_cast<int64_t>(routing.topk_group) * (num_experts / ng);
    check(k <= kept, "MoeProblem.routing.top_k (k) must be <= topk_group * (E / n_group) = ", kept,
          " (the experts of the kept groups) for deepseek_v3, got ", k);
    check(std::isfinite(routing.routed_scaling_factor) && routing.routed_scaling_factor > 0.0f,
          "MoeProblem.routing.routed_scaling_factor must be finite and > 0, got ",
          routing.routed_scaling_factor);
  }
  if (routing.method == RoutingMethod::Llama4)
    check(k == 1, "MoeProblem.routing.top_k (k) must be 1 for llama4 routing, got ", k);
  if (routing.apply_router_weight_on_input)
    check(k == 1,
          "MoeProblem.routing.apply_router_weight_on_input needs top_k (k) == 1, got k = ", k);

  if (activation.kind == Activation::SwiGLUOai) {
    check(std::isfinite(activation.swiglu_alpha),
          "MoeProblem.activation.swiglu_alpha must be finite, got ", activation.swiglu_alpha);
    check(std::isfinite(activation.swiglu_beta),
          "MoeProblem.activation.swiglu_beta must be finite, got ", activation.swiglu_beta);
    check(std::isfinite(activation.swiglu_limit),
          "MoeProblem.activation.swiglu_limit must be finite, got ", activation.swiglu_limit);
  }
}

MoeProblem MoeProblem::expert_parallel_rank(int64_t num_local_experts) const {
  MoeProblem q = *this;
  q.num_experts = num_local_experts;
  q.routing.method = RoutingMethod::Precomputed;
  q.routing.skip_foreign_ids = true;
  q.routing.total_experts = routing.total_experts > 0 ? routing.total_experts : num_experts;
  q.validate();
  return q;
}

std::string MoeProblem::describe() const {
  std::ostringstream os;
  os << "E=" << num_experts << " H=" << hidden << " I=" << inter << " k=" << routing.top_k
     << " routing=" << to_string(routing.method);
  std::ostringstream extra;
  if (routing.method == RoutingMethod::DeepSeekV3)
    extra << "n_group=" << routing.n_group << ",topk_group=" << routing.topk_group
          << ",scale=" << routing.routed_scaling_factor;
  if (routing.apply_router_weight_on_input)
    extra << (extra.tellp() > 0 ? "," : "") << "weight_on_input";
  if (routing.skip_foreign_ids) extra << (extra.tellp() > 0 ? "," : "") << "skip_foreign_ids";
  if (routing.total_experts > 0) extra << ",of " << routing.total_experts;
  if (extra.tellp() > 0) os << '(' << extra.str() << ')';
  os << " act=" << to_string(activation.kind);
  if (activation.kind == Activation::SwiGLUOai)
    os << "(alpha=" << activation.swiglu_alpha << ",beta=" << activation.swiglu_beta
       << ",limit=" << activation.swiglu_limit << ')';
  os << " quant=" << to_string(act_quant);
  if (weight_format != WeightFormat::NVFP4) os << " weights=" << to_string(weight_format);
  return os.str();
}

}  // namespace fp4moe
