// runner/forward_plan.hpp — every launch and fusion decision of one MoeRunner forward, as a pure function
// of the problem, the token count, the tactic and the call's form (CPU code, no CUDA): GpuMoeRunner::run
// fills the kernels' arguments from the plan and launches; tests/runner/forward_plan_cpu_test.cpp checks
// the decisions on the CPU.
//
// The stages of a forward, and which launches a plan may drop:
//   route             (forward only)            -> with permute_in_route, also the permutation
//   permute           (skipped with permute_in_route)
//   gather_quantize   (skipped with gather_in_gemm1: GEMM1 gathers its rows itself)
//   gemm1_act
//   gemm2             (with fuse_finalize or finalize_in_gemm2, also writes the output)
//   finalize          (only with finalize_launch)
#pragma once

#include <cstdint>
#include <string>

#include "fp4moe/problem.hpp"
#include "fp4moe/runner.hpp"  // OutputDType
#include "fp4moe/tactic.hpp"

namespace fp4moe::runner {

// The limits of the route launch that also permutes (kernels::launch_route_permute): its one block
// holds at most kRoutePermuteMaxEntries entries (the permutation's one-block path) and routes at most
// kRoutePermuteMaxTokens tokens, one per warp. moe_runner.cu checks at compile time that these are the
// kernels' own constants (permute_block::kSmallEntries, permute_block::kWarps).
inline constexpr int64_t kRoutePermuteMaxEntries = 256;
inline constexpr int64_t kRoutePermuteMaxTokens = 16;
// kernels::route_permute_fits for the plan: T in [1, kRoutePermuteMaxTokens], T * k <=
// kRoutePermuteMaxEntries, and T = 1 for DeepSeekV3 (whose routing takes a block per token).
bool route_permute_fits(const RoutingParams& params, int64_t num_tokens);

// The most entries (T * k) for which the streaming GEMM2 finalizes top-k > 1 itself: 128 where
// H <= 4096, else 64.
int64_t finalize_in_gemm2_limit(const MoeProblem& problem);

// What a streaming GEMM may do before its dependency wait (kernels::GemmEarlyStart, same values).
enum class EarlyStart : int { AfterWait = 0, TileTable = 1, TileReady = 2 };
const char* to_string(EarlyStart e);

struct ForwardPlan {
  int64_t tokens = 0;   // T
  int64_t entries = 0;  // T * k
  int tile_rows = 0;    // the permutation's tile table is built for the tactic's tile height
  bool stream_kernel = false;  // tactic.kernel == Sm90Stream

  // Stages 1-3.
  bool route = false;              // a route launch (forward; forward_routed takes caller-given ids)
  bool permute_in_route = false;   // the route launch also permutes (no permute launch)
  bool quantize_in_route = false;  // the route launch writes each token's NVFP4-quantized row to a1 [T, H]
  bool gather_in_gemm1 = false;    // no gather_quantize launch: GEMM1 reads hidden (w4a16) or a1 [T, H]

  // The counters the permutation clears for the GEMMs (PermuteArgs::zero_words).
  bool clear_split1 = false;  // GEMM1's split-K arrival counters (split_k1 > 1)
  bool clear_split2 = false;  // GEMM2's (split_k2 > 1)

  // Stages 4-5.
  EarlyStart gemm1_early_start = EarlyStart::AfterWait;
  EarlyStart gemm2_early_start = EarlyStart::AfterWait;
  bool tile_handoff = false;  // GEMM1 counts each tile's finished CTAs in tile_ready; GEMM2 waits per tile

  // Stage 6: exactly one of fuse_finalize, finalize_in_gemm2, finalize_launch.
  int64_t finalize_in_gemm2_limit = 0;  // entries
  bool fuse_finalize = false;      // top-1: GEMM2 writes the output, y is not written
  bool finalize_in_gemm2 = false;  // top-k: GEMM2 writes y, each (token, N tile)'s last CTA the output
  bool finalize_launch = false;    // a separate finalize launch reads y
  bool unit_weights = false;       // the output sums y unweighted (the router weight went on the input)
  bool finalize_checks_ids = false;  // finalize_launch: ids outside [0, E) give NaN rows or, with
                                     // skip_foreign_ids, add nothing (forward_routed)
  bool finalize_bias = false;        // finalize_launch adds w2_bias by each slot's expert
  bool f32_output = false;           // the output is the fp32 sums (finalize_launch only)
};

// The plan of a forward of T >= 0 tokens with `tactic` (valid for the problem). routed: forward_routed.
ForwardPlan plan_forward(const MoeProblem& problem, int64_t T, const MoeTactic& tactic, bool routed,
                         OutputDType output_dtype, bool has_w2_bias);

// ---- the layer as stages (MoeRunner::prepare / experts / finalize) ----------------------------------
// The rows prepare makes for T tokens: one per entry (t*k + j) where the GEMM1 operand differs between a
// token's slots (the router weight on the input, per-expert input scales), else one per token.
StageRowsShape stage_rows_shape(const MoeProblem& problem, int64_t T, ScaleLayout layout);
// The shape and bytes of S rows with rows_top_k ids each in the problem's row format (any S: rows that
// arrive from other ranks).
StageRowsShape stage_rows_of(const MoeProblem& problem, int64_t S, int rows_top_k, ScaleLayout layout);

// The launches of MoeRunner::experts on S rows with rows_top_k ids each: permute (the ids as [S,
// rows_top_k]) -> dequantize (NVFP4 rows only) -> GEMM1 gathering its rows (row -> entry -> source row)
// -> GEMM2 writing y by entry. The GEMM decisions are plan_forward's for the same tactic.
struct ExpertsPlan {
  int64_t rows = 0;            // S
  int rows_top_k = 0;
  int64_t entries = 0;         // S * rows_top_k
  int64_t tactic_tokens = 0;   // ceil(entries / k): the token count whose bucket gives the tactic
  int tile_rows = 0;
  bool stream_kernel = false;
  bool dequantize = false;     // NVFP4 rows: a launch writes their bf16 values (q * sf) for GEMM1
  bool clear_split1 = false, clear_split2 = false;
  EarlyStart gemm1_early_start = EarlyStart::AfterWait;
  EarlyStart gemm2_early_start = EarlyStart::AfterWait;
  bool tile_handoff = false;
};
// The token count whose tactic the experts stage uses (before the tactic is known).
int64_t experts_tactic_tokens(const MoeProblem& problem, int64_t rows, int rows_top_k);
ExpertsPlan plan_experts(const MoeProblem& problem, int64_t rows, int rows_top_k, RowFormat format,
                         const MoeTactic& tactic);
std::string describe(const ExpertsPlan& plan);

// One line, e.g. "T=8 entries=64 tile_rows=16 stream route+permute gather_in_gemm1 ... finalize=in_gemm2(<=128)".
std::string describe(const ForwardPlan& plan);

}  // namespace fp4moe::runner
