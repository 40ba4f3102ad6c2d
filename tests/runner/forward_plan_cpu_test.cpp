// The forward's launch and fusion decisions (runner/forward_plan.hpp) on the CPU: concrete decisions of
// the presets at the limits of each fusion, and the whole bucket ladder with the heuristic's tactics.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "fp4moe/presets.hpp"
#include "fp4moe/tune.hpp"
#include "runner/forward_plan.hpp"

namespace fp4moe::runner {
namespace {

constexpr MoeTactic kStream{GemmKernel::Sm90Stream, 16, 1, 1};
constexpr MoeTactic kStream32{GemmKernel::Sm90Stream, 32, 1, 1};
constexpr MoeTactic kWgmma{GemmKernel::Sm90Wgmma, 128, 1, 1};

ForwardPlan plan_of(const MoeProblem& p, int64_t T, const MoeTactic& t, bool routed = false,
                    OutputDType out = OutputDType::BF16, bool w2_bias = false) {
  EXPECT_TRUE(tactic_valid(p, t)) << describe(t) << " for " << p.describe();
  return plan_forward(p, T, t, routed, out, w2_bias);
}

int finalize_paths(const ForwardPlan& f) { return int(f.fuse_finalize) + int(f.finalize_in_gemm2) + int(f.finalize_launch); }

TEST(ForwardPlan, RoutePermuteFitsItsLimits) {
  RoutingParams r;
  r.method = RoutingMethod::Renormalize;
  r.top_k = 8;
  EXPECT_TRUE(route_permute_fits(r, 1));
  EXPECT_TRUE(route_permute_fits(r, 16));
  EXPECT_FALSE(route_permute_fits(r, 17));  // one token per warp of the block
  EXPECT_FALSE(route_permute_fits(r, 0));
  r.top_k = 16;
  EXPECT_TRUE(route_permute_fits(r, 16));  // 256 entries
  r.top_k = 32;
  EXPECT_TRUE(route_permute_fits(r, 8));   // 256 entries
  EXPECT_FALSE(route_permute_fits(r, 9));  // 288 entries
  r.method = RoutingMethod::Llama4;
  r.top_k = 1;
  EXPECT_TRUE(route_permute_fits(r, 16));
  EXPECT_FALSE(route_permute_fits(r, 17));
  r.method = RoutingMethod::DeepSeekV3;
  r.top_k = 8;
  EXPECT_TRUE(route_permute_fits(r, 1));
  EXPECT_FALSE(route_permute_fits(r, 2));  // a block per token
}

TEST(ForwardPlan, FinalizeInGemm2LimitFollowsHidden) {
  EXPECT_EQ(finalize_in_gemm2_limit(preset("qwen3-30b-a3b")), 128);    // H = 2048
  EXPECT_EQ(finalize_in_gemm2_limit(preset("qwen3-235b-a22b")), 128);  // H = 4096
  EXPECT_EQ(finalize_in_gemm2_limit(preset("gpt-oss-120b")), 128);     // H = 2880
  EXPECT_EQ(finalize_in_gemm2_limit(preset("llama4-scout")), 64);      // H = 5120
  EXPECT_EQ(finalize_in_gemm2_limit(preset("deepseek-r1")), 64);       // H = 7168
}

TEST(ForwardPlan, DecodeTopKOnTheStreamingKernelFusesEverything) {
  const MoeProblem p = preset("qwen3-30b-a3b");  // k = 8, H = 2048
  const ForwardPlan f = plan_of(p, 8, kStream);
  EXPECT_EQ(f.tokens, 8);
  EXPECT_EQ(f.entries, 64);
  EXPECT_EQ(f.tile_rows, 16);
  EXPECT_TRUE(f.stream_kernel);
  EXPECT_TRUE(f.route);
  EXPECT_TRUE(f.permute_in_route);
  EXPECT_FALSE(f.quantize_in_route);  // w4a16: GEMM1 reads the hidden rows
  EXPECT_TRUE(f.gather_in_gemm1);
  EXPECT_FALSE(f.clear_split1);
  EXPECT_FALSE(f.clear_split2);
  EXPECT_EQ(f.gemm1_early_start, EarlyStart::AfterWait);  // the tile table is one launch old
  EXPECT_EQ(f.gemm2_early_start, EarlyStart::TileReady);
  EXPECT_TRUE(f.tile_handoff);
  EXPECT_EQ(f.finalize_in_gemm2_limit, 128);
  EXPECT_TRUE(f.finalize_in_gemm2);
  EXPECT_FALSE(f.fuse_finalize);
  EXPECT_FALSE(f.finalize_launch);
  EXPECT_FALSE(f.unit_weights);
  EXPECT_EQ(describe(f),
            "T=8 entries=64 tile_rows=16 stream route+permute gather_in_gemm1 gemm1_early=after_wait "
            "gemm2_early=tile_ready tile_handoff finalize=in_gemm2(<=128)");
}

TEST(ForwardPlan, TimesKOverTheLimitsKeepsTheLaunches) {
  const MoeProblem p = preset("qwen3-30b-a3b");  // limit 128 entries
  EXPECT_TRUE(plan_of(p, 16, kStream).finalize_in_gemm2);  // 128 entries
  EXPECT_TRUE(plan_of(p, 16, kStream).permute_in_route);
  const ForwardPlan f = plan_of(p, 17, kStream32);  // 136 entries
  EXPECT_FALSE(f.finalize_in_gemm2);
  EXPECT_TRUE(f.finalize_launch);
  EXPECT_FALSE(f.permute_in_route);
  EXPECT_TRUE(f.tile_handoff);  // the hand-off does not depend on T
  EXPECT_EQ(describe(f),
            "T=17 entries=136 tile_rows=32 stream route permute gather_in_gemm1 gemm1_early=after_wait "
            "gemm2_early=tile_ready tile_handoff finalize=launch");

  const MoeProblem d = preset("deepseek-r1");  // H = 7168: limit 64 entries
  EXPECT_TRUE(plan_of(d, 8, kStream).finalize_in_gemm2);   // 64 entries
  EXPECT_FALSE(plan_of(d, 9, kStream).finalize_in_gemm2);  // 72
  EXPECT_TRUE(plan_of(p, 9, kStream).finalize_in_gemm2);   // 72 where H <= 4096
  EXPECT_TRUE(plan_of(d, 1, kStream).permute_in_route);    // DeepSeekV3: one token only
  EXPECT_FALSE(plan_of(d, 2, kStream).permute_in_route);

  const MoeProblem g = preset("gpt-oss-120b");  // k = 4
  EXPECT_TRUE(plan_of(g, 32, kStream32).finalize_in_gemm2);  // 128 entries
  EXPECT_FALSE(plan_of(g, 33, kStream32).finalize_in_gemm2);
}

TEST(ForwardPlan, WgmmaKernelKeepsTheFinalizeForTopK) {
  const ForwardPlan f = plan_of(preset("qwen3-30b-a3b"), 8, kWgmma);
  EXPECT_FALSE(f.stream_kernel);
  EXPECT_FALSE(f.tile_handoff);
  EXPECT_EQ(f.gemm1_early_start, EarlyStart::AfterWait);
  EXPECT_EQ(f.gemm2_early_start, EarlyStart::AfterWait);
  EXPECT_TRUE(f.finalize_launch);
  EXPECT_FALSE(f.finalize_in_gemm2);
  EXPECT_TRUE(f.permute_in_route);  // the route launch's fusion does not depend on the kernel
  EXPECT_TRUE(f.gather_in_gemm1);
}

TEST(ForwardPlan, TopOneFusesTheFinalize) {
  const MoeProblem p = preset("llama4-scout");  // k = 1, router weight on the input
  for (const MoeTactic& t : {kStream, kWgmma})
    for (int64_t T : {1, 16, 17, 4096}) {
      const ForwardPlan f = plan_of(p, T, t);
      EXPECT_TRUE(f.fuse_finalize) << describe(f);
      EXPECT_FALSE(f.finalize_in_gemm2);
      EXPECT_FALSE(f.finalize_launch);
      EXPECT_TRUE(f.unit_weights);  // the weight went on the input
      // The router weight on the input keeps gather_quantize (x' = bf16(x * bf16(w))).
      EXPECT_FALSE(f.gather_in_gemm1);
      EXPECT_FALSE(f.quantize_in_route);
      EXPECT_EQ(f.permute_in_route, T <= 16);
      EXPECT_EQ(f.gemm1_early_start, t.kernel == GemmKernel::Sm90Stream ? EarlyStart::TileTable : EarlyStart::AfterWait);
    }
  MoeProblem q = preset("qwen3-30b-a3b");
  q.routing.top_k = 1;
  const ForwardPlan f = plan_of(q, 8, kStream);
  EXPECT_TRUE(f.fuse_finalize);
  EXPECT_FALSE(f.unit_weights);
  EXPECT_TRUE(f.gather_in_gemm1);
}

TEST(ForwardPlan, RoutedKeepsTheSeparateFinalize) {
  for (const char* name : {"qwen3-30b-a3b", "llama4-scout"}) {
    const MoeProblem p = preset(name);
    const ForwardPlan f = plan_of(p, 8, kStream, /*routed=*/true);
    EXPECT_FALSE(f.route);
    EXPECT_FALSE(f.permute_in_route);
    EXPECT_FALSE(f.quantize_in_route);
    EXPECT_FALSE(f.fuse_finalize) << name;
    EXPECT_FALSE(f.finalize_in_gemm2) << name;
    EXPECT_TRUE(f.finalize_launch) << name;
    EXPECT_TRUE(f.finalize_checks_ids) << name;  // out-of-range ids give NaN rows
  }
  // w4a16: GEMM1 still gathers caller-given ids' rows.
  EXPECT_TRUE(plan_of(preset("qwen3-30b-a3b"), 8, kStream, true).gather_in_gemm1);
}

TEST(ForwardPlan, F32OutputAndW2BiasKeepTheFinalize) {
  for (const char* name : {"qwen3-30b-a3b", "gpt-oss-120b", "llama4-scout"}) {
    const MoeProblem p = preset(name);
    const ForwardPlan f32 = plan_of(p, 4, kStream, false, OutputDType::F32);
    EXPECT_TRUE(f32.finalize_launch) << name;
    EXPECT_TRUE(f32.f32_output);
    EXPECT_FALSE(f32.finalize_bias);
    const ForwardPlan bias = plan_of(p, 4, kStream, false, OutputDType::BF16, /*w2_bias=*/true);
    EXPECT_TRUE(bias.finalize_launch) << name;
    EXPECT_TRUE(bias.finalize_bias);
    EXPECT_FALSE(bias.f32_output);
    EXPECT_FALSE(bias.finalize_checks_ids);
    // The rest of the plan is that of the bf16 forward.
    const ForwardPlan plain = plan_of(p, 4, kStream);
    EXPECT_EQ(bias.permute_in_route, plain.permute_in_route);
    EXPECT_EQ(bias.gather_in_gemm1, plain.gather_in_gemm1);
    EXPECT_EQ(bias.tile_handoff, plain.tile_handoff);
  }
  const ForwardPlan both = plan_of(preset("gpt-oss-120b"), 4, kStream, true, OutputDType::F32, true);
  EXPECT_EQ(describe(both).substr(describe(both).find("finalize=")), "finalize=launch+ids+bias+f32");
}

TEST(ForwardPlan, ActivationQuantizationDecidesTheGather) {
  const MoeProblem scalar = preset("qwen3-30b-a3b", ActQuant::W4A4Scalar);
  const ForwardPlan s = plan_of(scalar, 8, kStream);
  EXPECT_TRUE(s.quantize_in_route);  // once per token, in the route launch
  EXPECT_TRUE(s.gather_in_gemm1);
  EXPECT_EQ(s.gemm1_early_start, EarlyStart::AfterWait);
  EXPECT_NE(describe(s).find("route+permute quantize_in_route gather_in_gemm1"), std::string::npos);
  // Caller-given ids: no route launch to quantize in, so gather_quantize.
  const ForwardPlan sr = plan_of(scalar, 8, kStream, true);
  EXPECT_FALSE(sr.quantize_in_route);
  EXPECT_FALSE(sr.gather_in_gemm1);
  EXPECT_EQ(sr.gemm1_early_start, EarlyStart::TileTable);  // the tile table is two launches old

  // Per-expert scales: a scale per copy of a row, so gather_quantize in every form.
  const MoeProblem per_expert = preset("qwen3-30b-a3b", ActQuant::W4A4PerExpert);
  for (bool routed : {false, true}) {
    const ForwardPlan f = plan_of(per_expert, 8, kStream, routed);
    EXPECT_FALSE(f.quantize_in_route);
    EXPECT_FALSE(f.gather_in_gemm1);
    EXPECT_EQ(f.gemm1_early_start, EarlyStart::TileTable);
    EXPECT_NE(describe(f).find(" gather_quantize"), std::string::npos);
  }
  const ForwardPlan w = plan_of(per_expert, 8, kWgmma);
  EXPECT_FALSE(w.gather_in_gemm1);
  EXPECT_EQ(w.gemm1_early_start, EarlyStart::AfterWait);  // the wgmma kernel does not start early
}

TEST(ForwardPlan, SplitCountersPerGemm) {
  const MoeProblem p = preset("deepseek-r1");  // H = 7168, I = 2048: every split allowed
  const ForwardPlan both = plan_of(p, 1, MoeTactic{GemmKernel::Sm90Stream, 16, 4, 2});
  EXPECT_TRUE(both.clear_split1);
  EXPECT_TRUE(both.clear_split2);
  const ForwardPlan second = plan_of(p, 1, MoeTactic{GemmKernel::Sm90Stream, 16, 1, 6});
  EXPECT_FALSE(second.clear_split1);
  EXPECT_TRUE(second.clear_split2);
  EXPECT_NE(describe(second).find(" split2 "), std::string::npos);
  EXPECT_EQ(describe(second).find("split1"), std::string::npos);
}

// Every bucket the tuner profiles (up to 16384 tokens), at both ends, with the heuristic's tactic: one
// finalize path, and the fusions exactly where their rules allow them.
TEST(ForwardPlan, BucketLadderWithTheHeuristic) {
  struct Count { int in_gemm2 = 0, permute_in_route = 0, top1 = 0, launches = 0, plans = 0; };
  for (const std::string& name : preset_names()) {
    for (ActQuant mode : {ActQuant::W4A16, ActQuant::W4A4Scalar, ActQuant::W4A4PerExpert}) {
      if (preset_weight_format(name) == WeightFormat::MXFP4 && mode != ActQuant::W4A16) continue;  // w4a16 only
      const MoeProblem p = preset(name, mode);
      Count c;
      for (int b : buckets_to_tune(16384, {})) {
        const BucketRange r = bucket_range(b);
        for (int64_t T : {r.lo, r.representative}) {
          const MoeTactic t = heuristic_tactic(p, T);
          for (bool routed : {false, true}) {
            const ForwardPlan f = plan_of(p, T, t, routed);
            SCOPED_TRACE(name + " " + describe(f));
            ASSERT_EQ(finalize_paths(f), 1);
            EXPECT_EQ(f.entries, T * p.top_k());
            EXPECT_EQ(f.tile_rows, t.tile_tokens);
            EXPECT_EQ(f.route, !routed);
            EXPECT_EQ(f.permute_in_route, !routed && route_permute_fits(p.routing, T));
            if (f.permute_in_route) EXPECT_TRUE(T <= kRoutePermuteMaxTokens && f.entries <= kRoutePermuteMaxEntries);
            EXPECT_EQ(f.tile_handoff, t.kernel == GemmKernel::Sm90Stream);
            EXPECT_EQ(f.finalize_in_gemm2, !routed && p.top_k() > 1 && f.stream_kernel &&
                                               f.entries <= finalize_in_gemm2_limit(p));
            EXPECT_EQ(f.fuse_finalize, !routed && p.top_k() == 1);
            EXPECT_EQ(f.finalize_checks_ids, routed);
            if (routed) continue;
            c.plans += 1;
            c.in_gemm2 += f.finalize_in_gemm2;
            c.permute_in_route += f.permute_in_route;
            c.top1 += f.fuse_finalize;
            c.launches += f.finalize_launch;
          }
        }
      }
      // The ladder's T in 1..16 are single-T buckets, so each T counts twice (lo and representative).
      if (name == "qwen3-30b-a3b" || name == "qwen3-235b-a22b") {  // k = 8, limit 128: T <= 16
        EXPECT_EQ(c.in_gemm2, 2 * 16) << name;
        EXPECT_EQ(c.permute_in_route, 2 * 16) << name;
      } else if (name == "deepseek-r1") {  // limit 64: T <= 8; route+permute for T = 1 only
        EXPECT_EQ(c.in_gemm2, 2 * 8) << name;
        EXPECT_EQ(c.permute_in_route, 2) << name;
      } else if (name == "gpt-oss-120b" || name == "gpt-oss-20b" || name == "gpt-oss-120b-nvfp4") {  // k = 4, limit 128: T <= 32
        EXPECT_EQ(c.in_gemm2, 2 * 32) << name;
        EXPECT_EQ(c.permute_in_route, 2 * 16) << name;
      } else if (name == "llama4-scout") {  // k = 1: GEMM2 writes the output at every T
        EXPECT_EQ(c.top1, c.plans) << name;
        EXPECT_EQ(c.permute_in_route, 2 * 16) << name;
      }
      if (p.top_k() > 1) EXPECT_EQ(c.launches, c.plans - c.in_gemm2) << name;
    }
  }
}

TEST(ForwardPlan, ZeroTokens) {
  const ForwardPlan f = plan_of(preset("qwen3-30b-a3b"), 0, kStream);
  EXPECT_EQ(f.entries, 0);
  EXPECT_FALSE(f.permute_in_route);  // the route launch that permutes needs a token
  EXPECT_THROW(plan_forward(preset("tiny"), -1, kStream, false, OutputDType::BF16, false), Error);
}

// ---- the layer as stages ----

TEST(StagePlan, RowsArePerTokenUnlessTheSlotsDiffer) {
  MoeProblem p = preset("qwen3-30b-a3b", ActQuant::W4A4Scalar);  // k = 8, H = 2048
  StageRowsShape s = stage_rows_shape(p, 5, ScaleLayout::Linear);
  EXPECT_EQ(s.rows.num_rows, 5);
  EXPECT_EQ(s.rows.rows_top_k, 8);
  EXPECT_EQ(s.rows.format, RowFormat::NVFP4);
  EXPECT_EQ(s.values_bytes, 5u * 1024);
  EXPECT_EQ(s.scales_bytes, 5u * 128);
  s = stage_rows_shape(p, 5, ScaleLayout::Swizzled128x4);  // rows padded to 128, scale columns to 4
  EXPECT_EQ(s.scales_bytes, 128u * 128);
  p.act_quant = ActQuant::W4A4PerExpert;  // a scale per copy: one row per entry
  s = stage_rows_shape(p, 5, ScaleLayout::Linear);
  EXPECT_EQ(s.rows.num_rows, 40);
  EXPECT_EQ(s.rows.rows_top_k, 1);
  p.act_quant = ActQuant::W4A16;
  s = stage_rows_shape(p, 5, ScaleLayout::Swizzled128x4);
  EXPECT_EQ(s.rows.format, RowFormat::BF16);
  EXPECT_EQ(s.values_bytes, 5u * 2048 * 2);
  EXPECT_EQ(s.scales_bytes, 0u);
  const MoeProblem llama = preset("llama4-scout");  // the router weight on the input, k = 1
  s = stage_rows_shape(llama, 3, ScaleLayout::Linear);
  EXPECT_EQ(s.rows.num_rows, 3);
  EXPECT_EQ(s.rows.rows_top_k, 1);
  EXPECT_EQ(stage_rows_shape(p, 0, ScaleLayout::Linear).values_bytes, 0u);
}

TEST(StagePlan, ExpertsUseTheFusedForwardsTacticAndLaunchOrder) {
  const MoeProblem p = preset("qwen3-30b-a3b");  // k = 8
  EXPECT_EQ(experts_tactic_tokens(p, 5, 8), 5);   // per-token rows: T
  EXPECT_EQ(experts_tactic_tokens(p, 40, 1), 5);  // per-entry rows: T * k / k
  EXPECT_EQ(experts_tactic_tokens(p, 41, 1), 6);  // rows from other ranks round up
  ExpertsPlan e = plan_experts(p, 5, 8, RowFormat::BF16, kStream);
  EXPECT_EQ(e.entries, 40);
  EXPECT_FALSE(e.dequantize);
  EXPECT_EQ(e.gemm1_early_start, EarlyStart::AfterWait);  // GEMM1 follows the permutation
  EXPECT_TRUE(e.tile_handoff);
  EXPECT_EQ(e.gemm2_early_start, EarlyStart::TileReady);
  e = plan_experts(p, 5, 8, RowFormat::NVFP4, MoeTactic{GemmKernel::Sm90Stream, 16, 2, 4});
  EXPECT_TRUE(e.dequantize);
  EXPECT_EQ(e.gemm1_early_start, EarlyStart::TileTable);  // the dequantize launch lies between
  EXPECT_TRUE(e.clear_split1);
  EXPECT_TRUE(e.clear_split2);
  e = plan_experts(p, 500, 8, RowFormat::NVFP4, kWgmma);
  EXPECT_FALSE(e.tile_handoff);
  EXPECT_EQ(e.gemm1_early_start, EarlyStart::AfterWait);
  EXPECT_EQ(e.gemm2_early_start, EarlyStart::AfterWait);
  EXPECT_EQ(describe(e), "rows=500x8 entries=4000 tactic_tokens=500 tile_rows=128 wgmma permute dequantize "
                         "gemm1(gather) gemm1_early=after_wait gemm2_early=after_wait");
}

}  // namespace
}  // namespace fp4moe::runner
