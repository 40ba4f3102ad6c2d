// runner/forward_plan.cpp — the decisions of one forward (runner/forward_plan.hpp).
#include "runner/forward_plan.hpp"

#include "fp4moe/error.hpp"
#include "fp4moe/format.hpp"

namespace fp4moe::runner {

bool route_permute_fits(const RoutingParams& params, int64_t num_tokens) {
  if (num_tokens < 1 || num_tokens * params.top_k > kRoutePermuteMaxEntries) return false;
  if (num_tokens > kRoutePermuteMaxTokens) return false;
  return params.method != RoutingMethod::DeepSeekV3 || num_tokens == 1;
}

int64_t finalize_in_gemm2_limit(const MoeProblem& p) {
  // NOTE: the fused finalize's hand-off (a CTA barrier, a gpu-scope fence and atomic, then the slot
  // loads) holds each GEMM2 CTA's slot for its round trips, while the finalize launch reads y once; with
  // the slot loads issued first the fusion wins up to 64 entries (w4a16 T = 8: qwen3-30b-a3b 0.965,
  // qwen3-235b-a22b 0.982, deepseek-r1 1.001), and with GEMM2 waiting per tile (tile_handoff) up to 128
  // where H <= 4096 (T = 9 / 12 / 16: qwen3-30b-a3b 0.95 / 0.97 / 0.97, qwen3-235b-a22b 0.99-1.00;
  // deepseek-r1, H = 7168: 1.00 / 1.01 / 1.01, so 64 there).
  return p.hidden <= 4096 ? 128 : 64;
}

const char* to_string(EarlyStart e) {
  switch (e) {
    case EarlyStart::AfterWait: return "after_wait";
    case EarlyStart::TileTable: return "tile_table";
    case EarlyStart::TileReady: return "tile_ready";
  }
  return "unknown";
}

ForwardPlan plan_forward(const MoeProblem& p, int64_t T, const MoeTactic& tactic, bool routed,
                         OutputDType output_dtype, bool has_w2_bias) {
  check(T >= 0, "plan_forward: T must be >= 0, got ", T);
  const int64_t k = p.top_k();
  ForwardPlan plan;
  plan.tokens = T;
  plan.entries = T * k;
  plan.tile_rows = tactic.tile_tokens;
  plan.stream_kernel = tactic.kernel == GemmKernel::Sm90Stream;

  plan.route = !routed;
  // NOTE: with few entries the route launch permutes its ids in its one block: one boundary fewer in the
  // chain of dependent launches.
  plan.permute_in_route = !routed && route_permute_fits(p.routing, T);
  // NOTE: GEMM1 (either kernel) gathers its activation rows itself (row -> entry -> token): w4a16 reads
  // the hidden rows, scalar w4a4 the rows that the route kernel quantized once per token (a1 as [T, H]).
  // One launch and T * k row copies fewer. Per-expert w4a4 (a scale per copy), the router weight on the
  // input and caller-given ids with w4a4 keep the gather_quantize launch.
  const bool gather_ok = !p.routing.apply_router_weight_on_input;
  plan.quantize_in_route = gather_ok && !routed && p.act_quant == ActQuant::W4A4Scalar;
  plan.gather_in_gemm1 = gather_ok && (p.act_quant == ActQuant::W4A16 || plan.quantize_in_route);

  // NOTE: the split-K arrival counters must be zero when the GEMMs start, and the workspace may be shared
  // with other work between forwards: the permutation clears them (a memset node before the route kernel
  // would cost the chain of dependent launches its start).
  plan.clear_split1 = tactic.split_k1 > 1;
  plan.clear_split2 = tactic.split_k2 > 1;

  // NOTE (early start): what a streaming GEMM may read before its dependency wait follows from the launch
  // order. After a gather_quantize launch the tile table is two launches old, so GEMM1 issues its first
  // weight copies while the gather runs. GEMM2 always has GEMM1 between it and the permutation; it waits
  // per tile (tile_handoff), so the GEMM2 CTAs that take the slots of GEMM1's last wave work while it
  // drains (20 decode rows T = 8..128, w4a16: geomean 0.993 against starting early only up to 32 entries).
  plan.tile_handoff = plan.stream_kernel;
  if (plan.stream_kernel && !plan.gather_in_gemm1) plan.gemm1_early_start = EarlyStart::TileTable;
  if (plan.tile_handoff) plan.gemm2_early_start = EarlyStart::TileReady;

  // NOTE: fp32 outputs (partials of tensor / expert parallelism) take the separate finalize, whose store
  // has both forms (the fused finalizes store bf16 only); so do expert biases (the separate finalize adds
  // w2_bias: w * (y + b)), and caller-given ids, which the separate finalize checks (an out-of-range id,
  // a token with fewer than k GEMM rows, makes its row NaN).
  plan.f32_output = output_dtype == OutputDType::F32;
  const bool fusable = !routed && !plan.f32_output && !has_w2_bias;
  plan.finalize_in_gemm2_limit = finalize_in_gemm2_limit(p);
  // NOTE: top-1: the finalize is one multiply per element, so GEMM2 (either kernel) writes the output.
  plan.fuse_finalize = fusable && k == 1;
  // NOTE: top-k on the streaming kernel: per token and N tile the CTA of the last arriving row sums the
  // slots in order (bit for bit the finalize launch); with more entries the finalize launch is faster.
  plan.finalize_in_gemm2 =
      fusable && k > 1 && plan.stream_kernel && plan.entries <= plan.finalize_in_gemm2_limit;
  plan.finalize_launch = !plan.fuse_finalize && !plan.finalize_in_gemm2;
  plan.unit_weights = p.routing.apply_router_weight_on_input;
  plan.finalize_checks_ids = plan.finalize_launch && routed;
  plan.finalize_bias = plan.finalize_launch && has_w2_bias;
  return plan;
}

StageRowsShape stage_rows_of(const MoeProblem& p, int64_t S, int rows_top_k, ScaleLayout layout) {
  check(S >= 0 && rows_top_k >= 1, "stage_rows_of: S must be >= 0 and rows_top_k >= 1, got ", S, ", ", rows_top_k);
  const int64_t H = p.hidden;
  StageRowsShape s;
  s.rows.num_rows = S;
  s.rows.rows_top_k = rows_top_k;
  s.rows.format = p.act_quant == ActQuant::W4A16 ? RowFormat::BF16 : RowFormat::NVFP4;
  s.rows.scale_layout = layout;
  if (s.rows.format == RowFormat::BF16) {
    s.values_bytes = size_t(S * H * 2);
  } else {
    s.values_bytes = size_t(S * H / 2);
    s.scales_bytes = size_t(layout == ScaleLayout::Linear ? S * H / 16 : format::swizzled_scales_size(1, S, H / 16));
  }
  return s;
}

StageRowsShape stage_rows_shape(const MoeProblem& p, int64_t T, ScaleLayout layout) {
  check(T >= 0, "stage_rows_shape: T must be >= 0, got ", T);
  const int64_t k = p.top_k();
  const bool per_entry = p.routing.apply_router_weight_on_input || p.act_quant == ActQuant::W4A4PerExpert;
  return stage_rows_of(p, per_entry ? T * k : T, per_entry ? 1 : static_cast<int>(k), layout);
}

int64_t experts_tactic_tokens(const MoeProblem& p, int64_t rows, int rows_top_k) {
  const int64_t k = p.top_k();
  return (rows * rows_top_k + k - 1) / k;
}

ExpertsPlan plan_experts(const MoeProblem& p, int64_t rows, int rows_top_k, RowFormat format, const MoeTactic& tactic) {
  check(rows >= 0 && rows_top_k >= 1, "plan_experts: rows must be >= 0 and rows_top_k >= 1, got ", rows, ", ",
        rows_top_k);
  ExpertsPlan plan;
  plan.rows = rows;
  plan.rows_top_k = rows_top_k;
  plan.entries = rows * rows_top_k;
  plan.tactic_tokens = experts_tactic_tokens(p, rows, rows_top_k);
  plan.tile_rows = tactic.tile_tokens;
  plan.stream_kernel = tactic.kernel == GemmKernel::Sm90Stream;
  plan.dequantize = format == RowFormat::NVFP4;
  plan.clear_split1 = tactic.split_k1 > 1;
  plan.clear_split2 = tactic.split_k2 > 1;
  // NOTE (early start, as plan_forward): after the dequantize launch the tile table is two launches old.
  plan.tile_handoff = plan.stream_kernel;
  if (plan.stream_kernel && plan.dequantize) plan.gemm1_early_start = EarlyStart::TileTable;
  if (plan.tile_handoff) plan.gemm2_early_start = EarlyStart::TileReady;
  return plan;
}

std::string describe(const ExpertsPlan& plan) {
  std::string s = detail::concat("rows=", plan.rows, "x", plan.rows_top_k, " entries=", plan.entries,
                                 " tactic_tokens=", plan.tactic_tokens, " tile_rows=", plan.tile_rows,
                                 plan.stream_kernel ? " stream" : " wgmma", " permute");
  if (plan.dequantize) s += " dequantize";
  s += " gemm1(gather)";
  if (plan.clear_split1) s += " split1";
  if (plan.clear_split2) s += " split2";
  s += detail::concat(" gemm1_early=", to_string(plan.gemm1_early_start),
                      " gemm2_early=", to_string(plan.gemm2_early_start));
  if (plan.tile_handoff) s += " tile_handoff";
  return s;
}

std::string describe(const ForwardPlan& plan) {
  std::string s = detail::concat("T=", plan.tokens, " entries=", plan.entries, " tile_rows=", plan.tile_rows,
                                 plan.stream_kernel ? " stream" : " wgmma");
  s += plan.route ? (plan.permute_in_route ? " route+permute" : " route permute") : " permute";
  if (plan.quantize_in_route) s += " quantize_in_route";
  s += plan.gather_in_gemm1 ? " gather_in_gemm1" : " gather_quantize";
  if (plan.clear_split1) s += " split1";
  if (plan.clear_split2) s += " split2";
  s += detail::concat(" gemm1_early=", to_string(plan.gemm1_early_start),
                      " gemm2_early=", to_string(plan.gemm2_early_start));
  if (plan.tile_handoff) s += " tile_handoff";
  if (plan.fuse_finalize) s += " finalize=top1_in_gemm2";
  if (plan.finalize_in_gemm2) s += detail::concat(" finalize=in_gemm2(<=", plan.finalize_in_gemm2_limit, ")");
  if (plan.finalize_launch) {
    s += " finalize=launch";
    if (plan.finalize_checks_ids) s += "+ids";
    if (plan.finalize_bias) s += "+bias";
    if (plan.f32_output) s += "+f32";
  }
  if (plan.unit_weights) s += " unit_weights";
  return s;
}

}  // namespace fp4moe::runner
