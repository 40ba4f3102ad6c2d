// fp4moe/problem.hpp — the MoE problem as plain, printable structs (docs/numerics.md, docs/architecture.md "Interfaces").
//
// The problem says WHAT is computed (shapes, routing, activation, quantization mode). How it is
// computed (tiles, stages, kernel family) is a tactic and lives elsewhere.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace fp4moe {

// The most expert groups DeepSeekV3 routing takes (n_group), on every backend.
inline constexpr int kMaxRoutingGroups = 16;


// Routing methods (docs/numerics.md, "Routing methods"), by their snake_case names.
enum class RoutingMethod {
  Default,           // softmax over E, top-k, no renormalisation
  Renormalize,       // top-k on logits, softmax over the k
  RenormalizeNaive,  // softmax, top-k, divide by the sum of the k
  TopK,              // top-k on logits, weights = raw logits
  Sigmoid,           // sigmoid, top-k
  SigmoidRenorm,     // sigmoid, top-k, w / max(sum w, 1e-20)
  TopKSigmoid,       // top-k on logits, then sigmoid
  Llama4,            // top-1 on logits, weight sigmoid
  DeepSeekV3,        // grouped sigmoid routing with bias and routed scaling factor
  Precomputed,       // the caller gives ids and weights
};

enum class Activation {
  SwiGLU,     // silu(g) * u
  GeGLU,      // gelu_erf(g) * u
  SwiGLUOai,  // gpt-oss: g' = min(g, L), u' = clamp(u, -L, L), g' * sigmoid(alpha g') * (u' + beta)
  Relu2,      // max(h, 0)^2, not gated: w13 has I rows
};

enum class ActQuant {
  W4A16,          // activations stay bf16
  W4A4Scalar,     // tokens quantized once with max_e w13_input_scale[e]
  W4A4PerExpert,  // each expert quantizes its tokens with its own w13_input_scale[e]
};

// The weights' 4-bit format (docs/numerics.md, "Formats and block quantization").
enum class WeightFormat {
  NVFP4,  // e2m1, one e4m3 scale per 16 K elements, fp32 global scale per expert (scale_2)
  MXFP4,  // e2m1, one ue8m0 scale (2^(c-127)) per 32 K elements, no global scale; w4a16 only
};

std::string_view to_string(RoutingMethod m);
std::string_view to_string(Activation a);
std::string_view to_string(ActQuant q);
std::string_view to_string(WeightFormat f);
// Parse a snake_case name; throws fp4moe::Error naming `what` and the accepted names.
RoutingMethod parse_routing_method(std::string_view name, std::string_view what = "routing_method");
Activation parse_activation(std::string_view name, std::string_view what = "activation");
ActQuant parse_act_quant(std::string_view name, std::string_view what = "act_quant");
WeightFormat parse_weight_format(std::string_view name, std::string_view what = "weight_format");

// Whether routing by `m` reads a routing bias: deepseek_v3 only. Every other method accepts a bias and
// ignores it (its dtype and shape are still checked where it is given), as FlashInfer's kernels do with
// Llama-4's. The CPU reference, the GPU runner and router, and the Python and JAX entry points follow
// this one rule.
bool routing_uses_bias(RoutingMethod m);

struct RoutingParams {
  RoutingMethod method = RoutingMethod::Renormalize;
  int top_k = 1;
  int n_group = 1;                     // DeepSeekV3: number of expert groups (1 = no group selection)
  int topk_group = 1;                  // DeepSeekV3: groups kept
  float routed_scaling_factor = 1.0f;  // DeepSeekV3
  bool apply_router_weight_on_input = false;  // k = 1 only (Llama-4)
  // Precomputed only (expert parallelism): an id outside [0, E) names another rank's expert, and its
  // slot adds nothing to this rank's partial output. Without it such an id is bad input that makes its
  // token's output row NaN. k may then exceed the local E.
  bool skip_foreign_ids = false;
  // With skip_foreign_ids: the whole layer's expert count (0: not given). Tactics are then chosen for
  // the load an even routing gives this rank (fp4moe/tune.hpp, tactic_tokens), not for T * k local slots.
  int64_t total_experts = 0;
};

struct ActivationParams {
  Activation kind = Activation::SwiGLU;
  float swiglu_alpha = 1.702f;  // SwiGLUOai only
  float swiglu_beta = 1.0f;     // SwiGLUOai only
  float swiglu_limit = 7.0f;    // SwiGLUOai only
};

struct MoeProblem {
  int64_t num_experts = 0;  // E
  int64_t hidden = 0;       // H (K of GEMM1, N of GEMM2)
  int64_t inter = 0;        // I (per-expert intermediate size)
  RoutingParams routing;
  ActivationParams activation;
  ActQuant act_quant = ActQuant::W4A16;
  WeightFormat weight_format = WeightFormat::NVFP4;

  int top_k() const { return routing.top_k; }
  bool gated() const { return activation.kind != Activation::Relu2; }
  int64_t w13_rows() const { return gated() ? 2 * inter : inter; }  // rows of w13 per expert
  // K elements per weight block scale: 16 (NVFP4) or 32 (MXFP4).
  int64_t weight_block() const { return weight_format == WeightFormat::MXFP4 ? 32 : 16; }
  // Throws fp4moe::Error naming the first inconsistent field (sizes, k > E, groups, scales, ...).
  void validate() const;
  // An expert-parallel rank's problem, validated: num_local_experts of this layer's experts, precomputed
  // routing with skip_foreign_ids (ids outside [0, num_local_experts) are other ranks' experts) and
  // total_experts the whole layer's (this problem's total_experts when set, else its E).
  MoeProblem expert_parallel_rank(int64_t num_local_experts) const;
  // One line, e.g. "E=256 H=7168 I=2048 k=8 routing=deepseek_v3(n_group=8,topk_group=4,scale=2.5) act=swiglu quant=w4a4_scalar"
  std::string describe() const;
};

}  // namespace fp4moe
