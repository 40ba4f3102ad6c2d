// tests/small_problem.hpp — the GPU layer tests' small problem: 16 experts, H = 256, I = 96 (not a
// multiple of the GEMM tiles), top-4 (top-1 with the router weight on the input for llama4; 4 groups,
// 2 of them chosen, scaling 2.5 for deepseek_v3).
#pragma once

#include "fp4moe/problem.hpp"

namespace fp4moe::test {

inline MoeProblem small_problem(ActQuant mode, RoutingMethod method, Activation act = Activation::SwiGLU) {
  MoeProblem p;
  p.num_experts = 16;
  p.hidden = 256;
  p.inter = 96;
  p.routing.method = method;
  p.routing.top_k = method == RoutingMethod::Llama4 ? 1 : 4;
  p.routing.apply_router_weight_on_input = method == RoutingMethod::Llama4;
  if (method == RoutingMethod::DeepSeekV3) {
    p.routing.n_group = 4;
    p.routing.topk_group = 2;
    p.routing.routed_scaling_factor = 2.5f;
  }
  p.activation.kind = act;
  p.act_quant = mode;
  return p;
}

}  // namespace fp4moe::test
