// tests/tune/registry_test.cpp — the tactic codec (JSON round trip, errors naming the field) and the
// registry (validity rules per family, independent of T; the heuristic valid for every bucket).
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

#include "error_message.hpp"
#include "fp4moe/presets.hpp"
#include "fp4moe/tune.hpp"

namespace fp4moe {
namespace {

MoeProblem problem(int64_t E, int64_t H, int64_t I, int k) {
  MoeProblem p;
  p.num_experts = E;
  p.hidden = H;
  p.inter = I;
  p.routing.top_k = k;
  return p;
}

const MoeTactic kWgmma128{GemmKernel::Sm90Wgmma, 128, 1, 1};
const MoeTactic kWgmma256{GemmKernel::Sm90Wgmma, 256, 1, 1};
const MoeTactic kWgmma64{GemmKernel::Sm90Wgmma, 64, 1, 1};
const MoeTactic kStream1{GemmKernel::Sm90Stream, 16, 1, 1};
const MoeTactic kStream2{GemmKernel::Sm90Stream, 16, 2, 2};
const MoeTactic kStream4{GemmKernel::Sm90Stream, 16, 4, 4};
const MoeTactic kStream32x1{GemmKernel::Sm90Stream, 32, 1, 1};
const MoeTactic kStream32x2{GemmKernel::Sm90Stream, 32, 2, 2};
const MoeTactic kStream32x4{GemmKernel::Sm90Stream, 32, 4, 4};

const MoeTactic kStream1x4{GemmKernel::Sm90Stream, 16, 1, 4};
const MoeTactic kStream4x2{GemmKernel::Sm90Stream, 16, 4, 2};

TEST(TacticJson, RoundTripsEveryCandidate) {
  EXPECT_EQ(tactic_to_json(kWgmma128), R"({"kernel":"sm90_wgmma","tile_tokens":128,"split_k1":1,"split_k2":1})");
  EXPECT_EQ(tactic_to_json(kStream1x4), R"({"kernel":"sm90_stream","tile_tokens":16,"split_k1":1,"split_k2":4})");
  for (const MoeTactic& t : candidate_tactics(problem(8, 4096, 4096, 2))) {
    EXPECT_EQ(tactic_from_json(tactic_to_json(t)), t) << describe(t);
  }
  // Key order and whitespace do not matter.
  EXPECT_EQ(tactic_from_json(R"( { "split_k2": 2, "split_k1": 4, "kernel": "sm90_stream", "tile_tokens": 16 } )"),
            kStream4x2);
}

TEST(TacticJson, ParseErrorsNameTheField) {
  expect_error([] { tactic_from_json(R"({"kernel":"sm90_wgmma","tile_tokens":128)"); }, "tactic: invalid JSON");
  expect_error([] { tactic_from_json("[1,2]"); }, "tactic: expected an object");
  expect_error([] { tactic_from_json(R"({"tile_tokens":128,"split_k1":1,"split_k2":1})"); }, "tactic.kernel: missing");
  expect_error([] { tactic_from_json(R"({"kernel":7,"tile_tokens":128,"split_k1":1,"split_k2":1})"); },
               "tactic.kernel: expected a string, got 7");
  expect_error([] { tactic_from_json(R"({"kernel":"sm80_mma","tile_tokens":128,"split_k1":1,"split_k2":1})"); },
               "tactic.kernel: unknown kernel 'sm80_mma', expected one of: sm90_wgmma, sm90_stream");
  expect_error([] { tactic_from_json(R"({"kernel":"sm90_wgmma","tile_tokens":"128","split_k1":1,"split_k2":1})"); },
               "tactic.tile_tokens: expected an integer, got \"128\"");
  expect_error([] { tactic_from_json(R"({"kernel":"sm90_wgmma","tile_tokens":128.5,"split_k1":1,"split_k2":1})"); },
               "tactic.tile_tokens: expected an integer");
  expect_error([] { tactic_from_json(R"({"kernel":"sm90_wgmma","tile_tokens":128,"split_k1":1})"); },
               "tactic.split_k2: missing");
  expect_error([] { tactic_from_json(R"({"kernel":"sm90_wgmma","tile_tokens":128,"split_k2":1})"); },
               "tactic.split_k1: missing");
  expect_error([] { tactic_from_json(R"({"kernel":"sm90_wgmma","tile_tokens":128,"split_k1":4294967297,"split_k2":1})"); },
               "tactic.split_k1: out of the int range");
  // Version 1's single split for both GEMMs is an unknown key, not silently one of the two.
  expect_error([] { tactic_from_json(R"({"kernel":"sm90_wgmma","tile_tokens":128,"split_k":1})"); },
               "tactic.split_k: unknown key");
  expect_error(
      [] { tactic_from_json(R"({"kernel":"sm90_wgmma","tile_tokens":128,"split_k1":1,"split_k2":1,"stages":4})"); },
      "tactic.stages: unknown key");
  expect_error([] { parse_gemm_kernel("x", "--kernel"); }, "--kernel: unknown kernel 'x'");
}

TEST(TacticName, DescribeAndParseRoundTrip) {
  EXPECT_EQ(describe(kWgmma256), "sm90_wgmma/t256/s1");
  EXPECT_EQ(describe(kStream4), "sm90_stream/t16/s4");  // both GEMMs split 4 ways
  EXPECT_EQ(describe(kStream1x4), "sm90_stream/t16/s1x4");
  EXPECT_EQ(describe(kStream4x2), "sm90_stream/t16/s4x2");
  for (const MoeTactic& t : candidate_tactics(problem(16, 7168, 2048, 8))) {
    EXPECT_EQ(parse_tactic(describe(t)), std::optional<MoeTactic>(t)) << describe(t);
  }
  EXPECT_EQ(parse_tactic("sm90_stream/t16/s2x2"), std::optional<MoeTactic>(kStream2));
  EXPECT_EQ(parse_tactic("sm90_stream/t32/s4"), std::optional<MoeTactic>(kStream32x4));
  for (const char* bad : {"sm90_stream/t16/s1x", "sm90_stream/t16/sx2", "sm90_stream/t16/s0x1", "sm90_stream/t16/s1x0",
                          "sm90_stream/t16/s1x2x4", "sm90_stream/t16/s", "sm90_stream/t16", "sm80/t16/s1",
                          "sm90_stream/t0/s1"}) {
    EXPECT_EQ(parse_tactic(bad), std::nullopt) << bad;
  }
}

// The stream tactics of one tile for the given split lists (GEMM1 outer, GEMM2 inner: the registry's order).
std::vector<MoeTactic> stream_tactics(int tile, std::vector<int> splits1, std::vector<int> splits2) {
  std::vector<MoeTactic> out;
  for (int s1 : splits1)
    for (int s2 : splits2) out.push_back(MoeTactic{GemmKernel::Sm90Stream, tile, s1, s2});
  return out;
}

std::vector<MoeTactic> wgmma_then(std::vector<MoeTactic> a, const std::vector<MoeTactic>& b) {
  a.insert(a.begin(), {kWgmma64, kWgmma128, kWgmma256});
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// The split table of fp4moe/tactic.hpp is the one source: a split the streaming launcher would accept
// (up to its bound of 64) but the table does not list is invalid, for GEMM1 and GEMM2 alike.
TEST(Registry, SplitsComeFromTheTableAlone) {
  const MoeProblem p = problem(256, 16384, 16384, 8);  // 128 chunks along both K: no chunk rule applies
  for (int s = 0; s <= 65; ++s) {
    bool listed = false;
    for (int v : kStreamSplitK) listed |= v == s;
    EXPECT_EQ(tactic_valid(p, MoeTactic{GemmKernel::Sm90Stream, 16, s, 1}), listed) << s;
    EXPECT_EQ(tactic_valid(p, MoeTactic{GemmKernel::Sm90Stream, 32, 1, s}), listed) << s;
    EXPECT_EQ(tactic_valid(p, MoeTactic{GemmKernel::Sm90Wgmma, 128, s, 1}), s == 1) << s;
  }
  EXPECT_NE(why_invalid(p, MoeTactic{GemmKernel::Sm90Stream, 16, 8, 1}).find("split_k1 must be in {1, 2, 4, 6}, got 8"),
            std::string::npos);
}

TEST(Registry, CandidatesFollowTheFamilyRules) {
  // Large K: every split allowed in both GEMMs (H=7168: 56 chunks, I=2048: 16 chunks).
  EXPECT_EQ(candidate_tactics(problem(256, 7168, 2048, 8)),
            wgmma_then(stream_tactics(16, {1, 2, 4, 6}, {1, 2, 4, 6}), stream_tactics(32, {1, 2, 4, 6}, {1, 2, 4, 6})));
  // Each GEMM splits by its own K: H = 1024 is 8 chunks (splits 1, 2, 4; 6 needs 12), I = 384 is 3 (no split).
  EXPECT_EQ(candidate_tactics(problem(16, 1024, 384, 2)),
            wgmma_then(stream_tactics(16, {1, 2, 4}, {1}), stream_tactics(32, {1, 2, 4}, {1})));
  // qwen3-30b-a3b: H = 2048 (16 chunks), I = 768 (6 chunks: split 4 needs 8).
  EXPECT_EQ(candidate_tactics(problem(128, 2048, 768, 8)),
            wgmma_then(stream_tactics(16, {1, 2, 4, 6}, {1, 2}), stream_tactics(32, {1, 2, 4, 6}, {1, 2})));
  // H = I = 384: no split at all.
  EXPECT_EQ(candidate_tactics(problem(16, 384, 384, 2)),
            (std::vector<MoeTactic>{kWgmma64, kWgmma128, kWgmma256, kStream1, kStream32x1}));
  // Ceil of chunks: K = 1040 is 9 chunks, 896 is 7: split 4 needs 8.
  EXPECT_TRUE(tactic_valid(problem(16, 1040, 1040, 2), kStream4));
  EXPECT_FALSE(tactic_valid(problem(16, 1040, 896, 2), kStream4));
  EXPECT_TRUE(tactic_valid(problem(16, 1040, 896, 2), kStream4x2));
  EXPECT_FALSE(tactic_valid(problem(16, 896, 1040, 2), kStream4));
  EXPECT_TRUE(tactic_valid(problem(16, 896, 1040, 2), (MoeTactic{GemmKernel::Sm90Stream, 16, 2, 4})));
  // Split 6 needs 12 chunks: K = 1536 has them, 1408 (11) does not.
  EXPECT_TRUE(tactic_valid(problem(16, 1536, 1536, 2), (MoeTactic{GemmKernel::Sm90Stream, 16, 6, 6})));
  EXPECT_FALSE(tactic_valid(problem(16, 1536, 1408, 2), (MoeTactic{GemmKernel::Sm90Stream, 16, 6, 6})));
  EXPECT_TRUE(tactic_valid(problem(16, 1536, 1408, 2), (MoeTactic{GemmKernel::Sm90Stream, 16, 6, 4})));
}

TEST(Registry, WhyInvalidNamesTheRule) {
  const MoeProblem p = problem(16, 1024, 384, 2);
  EXPECT_EQ(why_invalid(p, kWgmma128), "");
  EXPECT_EQ(why_invalid(p, kWgmma64), "");
  EXPECT_EQ(why_invalid(p, MoeTactic{GemmKernel::Sm90Wgmma, 32, 1, 1}),
            "sm90_wgmma: tile_tokens must be in {64, 128, 256}, got 32");
  EXPECT_EQ(why_invalid(p, MoeTactic{GemmKernel::Sm90Wgmma, 128, 2, 1}), "sm90_wgmma: split_k1 must be in {1}, got 2");
  EXPECT_EQ(why_invalid(p, MoeTactic{GemmKernel::Sm90Wgmma, 128, 1, 2}), "sm90_wgmma: split_k2 must be in {1}, got 2");
  EXPECT_EQ(why_invalid(p, MoeTactic{GemmKernel::Sm90Stream, 16, 3, 1}),
            "sm90_stream: split_k1 must be in {1, 2, 4, 6}, got 3");
  EXPECT_EQ(why_invalid(p, MoeTactic{GemmKernel::Sm90Stream, 64, 1, 1}),
            "sm90_stream: tile_tokens must be in {16, 32}, got 64");
  EXPECT_EQ(why_invalid(p, MoeTactic{GemmKernel::Sm90Stream, 16, 2, 1}), "");  // GEMM1: 8 chunks
  EXPECT_EQ(why_invalid(p, kStream2), "sm90_stream: split_k2 2 needs >= 4 chunks of 128 along GEMM2's K, got 3 (K=384)");
  EXPECT_EQ(why_invalid(problem(16, 384, 1024, 2), kStream2),
            "sm90_stream: split_k1 2 needs >= 4 chunks of 128 along GEMM1's K, got 3 (K=384)");
  EXPECT_NE(why_invalid(problem(16, 1000, 384, 2), kWgmma128).find("multiples of 16"), std::string::npos);
  EXPECT_NE(why_invalid(p, MoeTactic{static_cast<GemmKernel>(9), 128, 1, 1}).find("unknown kernel id 9"),
            std::string::npos);
}

TEST(Registry, HeuristicIsValidForEveryBucketOfEveryPreset) {
  std::vector<MoeProblem> problems;
  for (const std::string& name : preset_names())
    problems.push_back(preset(name, preset_weight_format(name) == WeightFormat::MXFP4 ? ActQuant::W4A16
                                                                                     : ActQuant::W4A4Scalar));
  problems.push_back(problem(4, 16, 16, 1));  // the smallest shape the runner accepts
  problems.push_back(problem(16, 1024, 384, 2));
  for (const MoeProblem& p : problems) {
    for (int b = 0; b < num_buckets(); ++b) {
      const BucketRange r = bucket_range(b);
      const MoeTactic t = heuristic_tactic(p, r.representative);
      EXPECT_TRUE(tactic_valid(p, t)) << p.describe() << " bucket " << b << ": " << why_invalid(p, t);
      // Depends on T only through the bucket: its ends give the same tactic as its representative.
      EXPECT_EQ(heuristic_tactic(p, r.lo), t) << p.describe() << " bucket " << b;
      if (!r.open()) EXPECT_EQ(heuristic_tactic(p, r.hi), t) << p.describe() << " bucket " << b;
    }
  }
}

TEST(Registry, HeuristicFollowsTokensPerExpert) {
  const MoeProblem ds = problem(256, 7168, 2048, 8);  // m = T * 8 / 256 = T / 32
  // T = 8: 64 routed slots -> 64 experts hit * ceil(7168 / 128) = 3584 CTAs: no split needed.
  EXPECT_EQ(heuristic_tactic(ds, 8), kStream1);
  EXPECT_EQ(heuristic_tactic(ds, 4), kStream1);  // 32 experts * 56 = 1792 CTAs
  EXPECT_EQ(heuristic_tactic(ds, 384), kStream1);            // m = 12
  EXPECT_EQ(heuristic_tactic(ds, 480), kStream32x1);         // bucket [449, 480]: m = 15, 32-token tiles
  EXPECT_EQ(heuristic_tactic(ds, 481), kWgmma128);           // bucket [481, 512]: m = 16 (56 + 16 K chunks)
  EXPECT_EQ(heuristic_tactic(ds, 768), kWgmma128);           // m = 24 (E = 256: no 64-token tiles)
  EXPECT_EQ(heuristic_tactic(ds, 7168), kWgmma128);          // bucket [6145, 7168]: m = 224
  EXPECT_EQ(heuristic_tactic(ds, 7169), kWgmma128);          // bucket [7169, 8192]: m = 256
  EXPECT_EQ(heuristic_tactic(ds, 10240), kWgmma128);         // bucket [8193, 10240]: m = 320
  EXPECT_EQ(heuristic_tactic(ds, 10241), kWgmma256);         // bucket [10241, 12288]: m = 384
  EXPECT_EQ(heuristic_tactic(ds, int64_t(1) << 40), kWgmma256);
  // Few experts hit and long K: split K while the smaller GEMM keeps <= 5 CTAs per SM and >= 10 chunks
  // per split. llama4-scout shape: GEMM2 has ceil(5120 / 128) = 40 CTAs per expert, K chunks 40 and 64.
  const MoeProblem scout = problem(16, 5120, 8192, 1);
  EXPECT_EQ(heuristic_tactic(scout, 1), kStream4);   // 40 CTAs * 4 = 160
  EXPECT_EQ(heuristic_tactic(scout, 4), kStream4);   // 160 * 4 = 640 <= 660
  EXPECT_EQ(heuristic_tactic(scout, 5), kStream2);   // 200 * 2 = 400
  EXPECT_EQ(heuristic_tactic(scout, 8), kStream2);   // 320 * 2 = 640
  EXPECT_EQ(heuristic_tactic(scout, 9), kStream1);   // 360 * 2 > 660
  // Short K: GEMM2 of qwen3-30b-a3b has ceil(768 / 128) = 6 chunks, never split.
  const MoeProblem small = problem(128, 2048, 768, 8);
  EXPECT_EQ(heuristic_tactic(small, 1), kStream1);
  EXPECT_EQ(heuristic_tactic(small, 3), kStream1);
  // 32-token tiles once the mean rows per expert exceed 12 (T * 8 / 128 > 12: T > 192).
  const MoeProblem mid = problem(128, 4096, 1536, 8);
  EXPECT_EQ(heuristic_tactic(mid, 192), kStream1);
  EXPECT_EQ(heuristic_tactic(mid, 193), kStream32x1);  // bucket [193, 224]
  EXPECT_EQ(heuristic_tactic(mid, 224), kStream32x1);  // m = 14, still streaming
  // The wgmma switch point by the K chunks of both GEMMs: 32 + 12 = 44 here, streaming up to m = 16.
  EXPECT_EQ(heuristic_tactic(mid, 256), kStream32x1);  // bucket [225, 256]: m = 16
  EXPECT_EQ(heuristic_tactic(mid, 257), kWgmma64);     // bucket [257, 288]: m = 18, 64-token tiles (E <= 128)
  EXPECT_EQ(heuristic_tactic(mid, 640), kWgmma64);     // bucket [513, 640]: m = 40
  EXPECT_EQ(heuristic_tactic(mid, 641), kWgmma128);    // bucket [641, 768]: m = 48
  // qwen3-30b-a3b: 16 + 6 = 22 chunks, streaming up to m = 27.
  EXPECT_EQ(heuristic_tactic(small, 416), kStream32x1);  // bucket [385, 416]: m = 26
  EXPECT_EQ(heuristic_tactic(small, 417), kWgmma64);     // bucket [417, 448]: m = 28
  // Split K not allowed by the shape (GEMM2: 3 chunks): stays split 1 in both GEMMs.
  EXPECT_EQ(heuristic_tactic(problem(16, 1024, 384, 2), 1), kStream1);
  expect_error([&] { heuristic_tactic(ds, -1); }, "token count T must be >= 0");
}

}  // namespace
}  // namespace fp4moe
