// fp4moe/reference.hpp — the CPU oracle of the numerics contract (docs/numerics.md).
//
// Exact to the numerics contract up to fp32 summation order: every GPU kernel is tested against it,
// and `fp4moe run --device cpu` runs it. All tensors are host memory, row-major, dense.
#pragma once

#include <cstdint>
#include <vector>

#include "fp4moe/problem.hpp"

namespace fp4moe::reference {

// ---- routing (docs/numerics.md, "Routing methods") ------------------------------------------------
struct Routing {
  std::vector<int32_t> ids;    // [T, k] expert ids, slots in descending score order (ties: lower id)
  std::vector<float> weights;  // [T, k] routing weights (before apply_router_weight_on_input)
};

// logits [T, E] fp32 (bf16 logits are widened by the caller); bias [E] or nullptr (DeepSeekV3 only).
// Throws fp4moe::Error for Precomputed (there is nothing to compute) and on inconsistent params.
// Selection ranks NaN below every number (-inf included) and equal scores by lower id, so a NaN logit
// never displaces a number and poisons only its own token's weights. Methods other than DeepSeekV3
// ignore the bias; DeepSeekV3 with n_group > 1 needs >= 2 experts per group. Numerics: routing.cpp.
Routing route(const RoutingParams& params, int64_t num_tokens, int64_t num_experts,
              const float* logits, const float* bias);

// ---- activation (docs/numerics.md, "The layer, step by step", step 4), fp32 ------------------------
// For gated activations `gate` and `up` are the two halves; for Relu2 `up` is ignored.
float apply_activation(const ActivationParams& act, float gate, float up);

// ---- the layer ------------------------------------------------------------------------------------
// Quantized weights in the canonical layout (docs/case-file.md; linear scales), by the problem's
// weight_format:
//   NVFP4: block scales e4m3, one per 16 K elements; scale_2 the per-expert fp32 global scales;
//          input scales for w4a4.
//   MXFP4: w13 / w2 packed e2m1 exactly as for NVFP4; w13_scale u8 [E, w13_rows, H/32] and w2_scale
//          u8 [E, H, I/32] hold ue8m0 codes c (value 2^(c - 127); 255 is NaN and refused), one per 32
//          K elements, linear layout; w13_scale_2, w2_scale_2 and the input scales are unused (may be
//          null): there is no global scale, and the mode is w4a16 (docs/numerics.md, "MXFP4 weights").
//   Biases as for NVFP4 in both formats.
struct MoeWeights {
  const uint8_t* w13 = nullptr;            // [E, w13_rows, H/2]  e2m1 pairs
  const uint8_t* w13_scale = nullptr;      // [E, w13_rows, H/16] e4m3 (MXFP4: [E, w13_rows, H/32] ue8m0)
  const float* w13_scale_2 = nullptr;      // [E]  (NVFP4 only)
  const float* w13_input_scale = nullptr;  // [E]  (NVFP4 w4a4 only)
  const uint8_t* w2 = nullptr;             // [E, H, I/2]
  const uint8_t* w2_scale = nullptr;       // [E, H, I/16] e4m3 (MXFP4: [E, H, I/32] ue8m0)
  const float* w2_scale_2 = nullptr;       // [E]  (NVFP4 only)
  const float* w2_input_scale = nullptr;   // [E]  (NVFP4 w4a4 only)
  // w4a4_scalar: when > 0, the one activation scale (the max of w13_input_scale over the whole layer's
  // experts: an expert-parallel rank holds only its own); 0: the max of w13_input_scale[0, E).
  float w13_input_scale_max = 0.0f;
  // Optional expert biases (gpt-oss), fp32, added after the global scale: h = alpha1 * acc + w13_bias[e]
  // before the activation, y = alpha2 * acc + w2_bias[e] before the finalize (docs/numerics.md).
  const float* w13_bias = nullptr;         // [E, w13_rows] or null
  const float* w2_bias = nullptr;          // [E, H] or null
};

// The router input: either logits (+ optional bias) or precomputed ids and weights.
struct RouterInput {
  const float* logits = nullptr;        // [T, E] fp32, or nullptr with Precomputed
  const float* bias = nullptr;          // [E] or nullptr
  const int32_t* topk_ids = nullptr;    // [T, k] with Precomputed
  const float* topk_weights = nullptr;  // [T, k] with Precomputed
};

struct MoeResult {
  std::vector<uint16_t> output;       // [T, H] bf16 bits
  std::vector<int32_t> topk_ids;      // [T, k]
  std::vector<float> topk_weights;    // [T, k]
  std::vector<float> output_f32;      // [T, H] the fp32 sums that output rounds (moe_forward fills it)
};

// Intermediates, for stage-by-stage GPU tests. Indexed by the (token, slot) pair t*k + j.
struct MoeTrace {
  std::vector<float> gemm1_input;  // [T*k, H] the GEMM1 A operand as values: bf16 x (w4a16) or q*sf (w4a4)
  std::vector<float> gemm1_out;    // [T*k, w13_rows] h = alpha1 * (gemm1_input . w13^T) (+ w13_bias), fp32
  std::vector<float> act_out;      // [T*k, I] GEMM2 A operand as values: bf16(act) (w4a16) or q*sf (w4a4)
  std::vector<float> gemm2_out;    // [T*k, H] y = alpha2 * (act_out . w2^T), fp32
};

// Throws fp4moe::Error unless weights.w13_input_scale_max is 0 (unset) or a finite scale with a finite
// fp32 reciprocal that is >= the max of w13_input_scale[0, E) (w4a4; any positive scale in w4a16).
void check_input_scale_max(const MoeWeights& weights, int64_t num_experts, ActQuant act_quant);

// Throws fp4moe::Error unless the optional biases (w13_bias [E, w13_rows], w2_bias [E, H]) are finite.
void check_biases(const MoeWeights& weights, const MoeProblem& problem);

// hidden [T, H] bf16 bits. Checks every argument (throws fp4moe::Error; MXFP4: a ue8m0 code 255, naming
// the tensor, expert, row and block). Multi-threaded over tokens.
// The router input is exactly one of: logits (+ bias) for a computed method, or topk_ids +
// topk_weights for Precomputed (ids checked in [0, E)). Input scales are needed (and checked) for w4a4.
MoeResult moe_forward(const MoeProblem& problem, int64_t num_tokens, const uint16_t* hidden,
                      const RouterInput& router, const MoeWeights& weights,
                      MoeTrace* trace = nullptr);

// ---- rounding slack of the whole layer (docs/numerics.md, "The whole layer") -----------------------
// The bound the kernel tolerance table puts on a GEMM's fp32 error, relative to |alpha| * sum_k |a_k w_k|.
inline constexpr double kGemmOrderError = 1e-5;

// For each output [T, H] of moe_forward(..., &trace) -> result: how far a layer whose GEMM1 sums in another
// fp32 order (within gemm1_error of the exact sum) may move it by rounding a GEMM2 input value the other
// way (bf16 in w4a16; an NVFP4 code or block scale in w4a4). 0 where no rounding is in doubt; slots of
// ids outside [0, E) add none. The GEMMs' own fp32 error in y and the output's bf16 rounding are not in it.
std::vector<float> output_rounding_slack(const MoeProblem& problem, const MoeWeights& weights,
                                         const MoeResult& result, const MoeTrace& trace,
                                         double gemm1_error = kGemmOrderError);

// The same layer in fp32 with unquantized weights (w13 [E, w13_rows, H], w2 [E, H, I] fp32) and no
// activation quantization: the accuracy yardstick of `fp4moe demo`. Routing as given.
std::vector<float> moe_forward_fp32(const MoeProblem& problem, int64_t num_tokens,
                                    const uint16_t* hidden, const Routing& routing,
                                    const float* w13, const float* w2);

}  // namespace fp4moe::reference
