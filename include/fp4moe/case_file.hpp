// fp4moe/case_file.hpp — the case-file interface (docs/case-file.md; `fp4moe run --case`).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fp4moe/problem.hpp"
#include "fp4moe/reference.hpp"

namespace fp4moe::io {

// A whole MoE layer invocation, owned in host memory.
struct MoeCase {
  MoeProblem problem;
  int64_t num_tokens = 0;
  std::vector<uint16_t> hidden_states;  // [T, H] bf16 bits
  std::vector<float> router_logits;     // [T, E] (bf16 logits are widened on load); empty with precomputed
  bool router_logits_bf16 = false;      // dtype the file had
  std::vector<float> routing_bias;      // [E] or empty
  std::vector<int32_t> topk_ids;        // [T, k] precomputed only
  std::vector<float> topk_weights;      // [T, k] precomputed only
  // Weights as reference::MoeWeights describes them for problem.weight_format: NVFP4 e4m3 scales
  // [.., K/16] with the [E] global (and input) scales; MXFP4 ue8m0 codes [.., K/32] and the four [E]
  // scale vectors empty.
  std::vector<uint8_t> w13, w13_scale;  // [E, w13_rows, H/2], [E, w13_rows, H/16] (MXFP4: H/32)
  std::vector<float> w13_scale_2, w13_input_scale;  // [E] (MXFP4: empty)
  std::vector<uint8_t> w2, w2_scale;    // [E, H, I/2], [E, H, I/16] (MXFP4: I/32)
  std::vector<float> w2_scale_2, w2_input_scale;    // [E] (MXFP4: empty)
  std::vector<float> w13_bias, w2_bias;  // optional expert biases: [E, w13_rows], [E, H] (or empty)

  reference::MoeWeights weights() const;      // views into this case
  reference::RouterInput router() const;      // views into this case
};

// Reads and checks a case file: every tensor's presence, dtype and shape against the metadata, and
// the metadata values themselves. Throws fp4moe::Error naming the tensor or key.
MoeCase load_case(const std::string& path);
void save_case(const std::string& path, const MoeCase& c);

// OUT file: `output` bf16 [T,H], `topk_ids` i32 [T,k], `topk_weights` f32 [T,k].
void save_result(const std::string& path, const MoeProblem& problem, int64_t num_tokens,
                 const reference::MoeResult& result);
reference::MoeResult load_result(const std::string& path);

// A random case (weights drawn as bf16-like normals and quantized with format/: NVFP4, or MXFP4 by
// format::quantize_mxfp4 without global and input scales), for tests and demo.
struct RandomCaseOptions {
  uint64_t seed = 1;
  float weight_std = 0.02f;
  float hidden_std = 1.0f;
};
MoeCase make_random_case(const MoeProblem& problem, int64_t num_tokens,
                         const RandomCaseOptions& opts = {},
                         std::vector<float>* w13_fp32 = nullptr, std::vector<float>* w2_fp32 = nullptr);

// A random case with FP4 codes and e4m3 block scales drawn directly instead of quantized from
// fp32 weights: cheap for presets with GBs of weights (tests, benchmarks). Weight values
// q * sf * scale_2 have an RMS of about 0.02; input scales follow the data (amax / (6 * 448)). The codes
// and scales are drawn on every core, in fixed blocks with generators of their own: the same bytes for
// a seed whatever the thread count. MXFP4 problems get ue8m0 codes instead (a per-expert base of 117..120
// plus a per-block offset of 0..3; weight RMS about 0.02 as well) and no global or input scales.
MoeCase make_random_packed_case(const MoeProblem& problem, int64_t num_tokens, uint64_t seed);

// Random expert biases (gpt-oss style) for `c`: w13_bias ~ N(0, 0.1), w2_bias ~ N(0, 0.02), about the
// size of a random case's GEMM outputs (tests).
void add_random_expert_biases(MoeCase& c, uint64_t seed);

}  // namespace fp4moe::io
