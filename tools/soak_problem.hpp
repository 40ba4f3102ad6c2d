// tools/soak_problem.hpp — the random problems of `fp4moe soak` and their check against the CPU
// reference (no GPU code: the CPU tests build it too).
//
// Problem i of a soak is derived from (seed, i) alone: make_problem draws its parameters,
// make_case its data, so `fp4moe soak --seed S --start I --problems 1` replays problem I exactly.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "fp4moe/case_file.hpp"
#include "fp4moe/problem.hpp"
#include "fp4moe/reference.hpp"
#include "fp4moe/tactic.hpp"

namespace fp4moe::soak {

// How the router logits of a problem are drawn.
enum class LogitKind {
  Normal,    // N(0, 1)
  Ties,      // N(0, 1) rounded to multiples of 0.5: many exact ties between experts
  AllEqual,  // one value for every expert of a token: only the lower-id rule decides
};

struct SoakProblem {
  uint64_t seed = 0;
  int64_t index = 0;
  MoeProblem problem;
  int64_t num_tokens = 0;
  std::optional<MoeTactic> tactic;  // forced (a valid tactic of the tune registry); nullopt: the runner's choice
  bool expert_biases = false;       // w13_bias / w2_bias (gpt-oss)
  bool routing_bias = false;        // deepseek_v3 only
  bool bf16_logits = false;         // logits rounded to bf16 values (a case file stores them as BF16)
  LogitKind logits = LogitKind::Normal;
  // Tokens whose inputs are poisoned (each a count of distinct tokens, drawn by make_case).
  int64_t nan_hidden_tokens = 0, inf_hidden_tokens = 0;  // one element of the hidden row NaN / +-inf
  int64_t nan_logit_tokens = 0, inf_logit_tokens = 0;    // one logit NaN / +-inf (computed routing)
  // Precomputed routing: tokens with an id outside [0, E) in one slot. With routing.skip_foreign_ids
  // such an id is another rank's expert (its slot adds nothing); without it the id is bad input, which
  // the CPU reference refuses and the GPU runner turns into a NaN output row (fp4moe/runner.hpp).
  int64_t invalid_id_tokens = 0;
  bool large = false;  // drawn from the large size class (weights 64 MB .. 2 GB)

  std::string describe() const;
};

// Bytes of the weights of a problem in its format (codes and block scales of w13 and w2: one scale byte
// per 16 elements for NVFP4, per 32 for MXFP4).
int64_t weight_bytes(const MoeProblem& p);

// Size classes of make_problem: weights under kSmallWeightBytes, except about 2% of the problems
// (the large class) with up to kLargeWeightBytes.
inline constexpr int64_t kSmallWeightBytes = int64_t(64) << 20;
inline constexpr int64_t kLargeWeightBytes = int64_t(2) << 30;
inline constexpr int64_t kMaxTokens = 16384;
// The share of problems with MXFP4 weights (w4a16, H and I multiples of 32).
inline constexpr double kMxfp4Share = 0.15;

// Problem `index` of the soak with this seed.
SoakProblem make_problem(uint64_t seed, int64_t index);

// The problem's data: random packed weights (io::make_random_packed_case) with its routing inputs,
// biases and poisoned tokens.
io::MoeCase make_case(const SoakProblem& sp);

// The tokens (ascending) the reference computes: all of them, or for problems whose reference would
// cost more than about 4e9 multiply-adds a sample of at least 16 that holds every poisoned token and
// every token with an invalid id, the first and the last.
std::vector<int64_t> reference_tokens(const SoakProblem& sp, const io::MoeCase& c);

// Rows `tokens` of a case (hidden states, logits or precomputed ids / weights); weights shared by copy.
io::MoeCase token_subset(const io::MoeCase& c, const std::vector<int64_t>& tokens);

// Tokens of a precomputed case with an id outside [0, E) (ascending).
std::vector<int64_t> tokens_with_invalid_ids(const io::MoeCase& c);

// What a backend did with a case: its result, or the message it refused the call with.
struct Outcome {
  bool refused = false;
  std::string message;
  reference::MoeResult result;
  std::vector<float> slack;  // with_slack: reference::output_rounding_slack of the reference's rows, [rows, H]
};

// The reference's answer on rows `tokens` of the case. A precomputed case whose ids are invalid
// without skip_foreign_ids is computed with skip_foreign_ids: its other tokens are then exactly the
// layer's, and check_outcome expects NaN rows for the invalid ones (bad_id_rows_nan).
// with_slack: also its rounding slack (check_outcome computes it when the check needs it).
Outcome reference_outcome(const io::MoeCase& c, const std::vector<int64_t>& tokens, bool with_slack = false);

// The check of a backend's outcome (its rows `tokens` of `tested`, all T rows) against the reference's
// (rows `tokens` only), by the tolerance table of docs/numerics.md ("The whole layer"):
//   topk_ids identical; topk_weights within 1e-6 relative (NaN where the reference has NaN);
//   output: NaN exactly where the reference has NaN, the same infinity where it has one, and over the
//   elements it has finite: relative L2 error < 5e-3, at least 99.5% within 1 bf16 ulp plus 1e-3 of
//   their token row's RMS plus the element's rounding slack (the reference's `slack`: what rounding a
//   GEMM2 input the other way, allowed by GEMM1's fp32 order, can move it; a few tokens with large H
//   would otherwise put one flip's effect on more than 0.5% of the elements).
// Tokens with an invalid id (no skip_foreign_ids): with bad_id_rows_nan their whole row must be NaN
// (the GPU runner's contract); otherwise the backend must have refused the call as the reference does.
// Returns "" when it matches, else what differs.
std::string check_outcome(const io::MoeCase& c, const std::vector<int64_t>& tokens, const Outcome& ref,
                          const Outcome& tested, bool bad_id_rows_nan);

// The output comparison alone (bf16 bits, rows of H values; slack: [rows, H] or empty for none), as
// above; "" when it matches.
std::string compare_outputs(const std::vector<uint16_t>& tested, const std::vector<uint16_t>& ref, int64_t rows,
                            int64_t H, const std::vector<float>& slack = {});

// Saves the problem's case file at `path` with metadata keys for what a case file cannot say
// (soak_seed, soak_index, soak_tactic, soak_skip_foreign_ids, soak_total_experts, soak_problem), which
// load_case ignores.
void save_problem_case(const std::string& path, const SoakProblem& sp, const io::MoeCase& c);

}  // namespace fp4moe::soak
