// tests/tune/registry_test.cpp — the tactic codec (JSON round trip, errors naming the field) and the
// registry (validity rules per family, independent of T; the heuristic valid for every bucket).
#include <gtest/gtest.h>

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

const MoeTactic kWgmma128{GemmKernel::Sm90Wgmma, 128, 1};
const MoeTactic kWgmma256{GemmKernel::Sm90Wgmma, 256, 1};
const MoeTactic kStream1{GemmKernel::Sm90Stream, 16, 1};
const MoeTactic kStream2{GemmKernel::Sm90Stream, 16, 2};
const MoeTactic kStream4{GemmKernel::Sm90Stream, 16, 4};
const MoeTactic kStream32x1{GemmKernel::Sm90Stream, 32, 1};
const MoeTactic kStream32x2{GemmKernel::Sm90Stream, 32, 2};
const MoeTactic kStream32x4{GemmKernel::Sm90Stream, 32, 4};

TEST(TacticJson, RoundTripsEveryCandidate) {
  EXPECT_EQ(tactic_to_json(kWgmma128), R"({"kernel":"sm90_wgmma","tile_tokens":128,"split_k":1})");
  for (const MoeTactic& t : candidate_tactics(problem(8, 4096, 4096, 2))) {
    EXPECT_EQ(tactic_from_json(tactic_to_json(t)), t) << describe(t);
  }
  // Key order and whitespace do not matter.
  EXPECT_EQ(tactic_from_json(R"( { "split_k": 2, "kernel": "sm90_stream", "tile_tokens": 16 } )"), kStream2);
}

TEST(TacticJson, ParseErrorsNameTheField) {
  expect_error([] { tactic_from_json(R"({"kernel":"sm90_wgmma","tile_tokens":128)"); }, "tactic: invalid JSON");
  expect_error([] { tactic_from_json("[1,2]"); }, "tactic: expected an object");
  expect_error([] { tactic_from_json(R"({"tile_tokens":128,"split_k":1})"); }, "tactic.kernel: missing");
  expect_error([] { tactic_from_json(R"({"kernel":7,"tile_tokens":128,"split_k":1})"); },
               "tactic.kernel: expected a string, got 7");
  expect_error([] { tactic_from_json(R"({"kernel":"sm80_mma","tile_tokens":128,"split_k":1})"); },
               "tactic.kernel: unknown kernel 'sm80_mma', expected one of: sm90_wgmma, sm90_stream");
  expect_error([] { tactic_from_json(R"({"kernel":"sm90_wgmma","tile_tokens":"128","split_k":1})"); },
               "tactic.tile_tokens: expected an integer, got \"128\"");
  expect_error([] { tactic_from_json(R"({"kernel":"sm90_wgmma","tile_tokens":128.5,"split_k":1})"); },
               "tactic.tile_tokens: expected an integer");
  expect_error([] { tactic_from_json(R"({"kernel":"sm90_wgmma","tile_tokens":128})"); }, "tactic.split_k: missing");
  expect_error([] { tactic_from_json(R"({"kernel":"sm90_wgmma","tile_tokens":128,"split_k":4294967297})"); },
               "tactic.split_k: out of the int range");
  expect_error([] { tactic_from_json(R"({"kernel":"sm90_wgmma","tile_tokens":128,"split_k":1,"stages":4})"); },
               "tactic.stages: unknown key");
  expect_error([] { parse_gemm_kernel("x", "--kernel"); }, "--kernel: unknown kernel 'x'");
}

TEST(Registry, CandidatesFollowTheFamilyRules) {
  // Large K: every split allowed (H=7168: 56 chunks, I=2048: 16 chunks).
  EXPECT_EQ(candidate_tactics(problem(256, 7168, 2048, 8)),
            (std::vector<MoeTactic>{kWgmma128, kWgmma256, kStream1, kStream2, kStream4, kStream32x1, kStream32x2,
                                    kStream32x4}));
  // The GEMM with the longer K decides: H = 1024 is 8 chunks, so splits 2 and 4 are valid although
  // I = 384 (3 chunks) gives GEMM2 no split (gemm_split_k).
  EXPECT_EQ(candidate_tactics(problem(16, 1024, 384, 2)),
            (std::vector<MoeTactic>{kWgmma128, kWgmma256, kStream1, kStream2, kStream4, kStream32x1, kStream32x2,
                                    kStream32x4}));
  // H = 512 and I = 384 (4 and 3 chunks): split 2 yes, split 4 (needs 8) no.
  EXPECT_EQ(candidate_tactics(problem(16, 512, 384, 2)),
            (std::vector<MoeTactic>{kWgmma128, kWgmma256, kStream1, kStream2, kStream32x1, kStream32x2}));
  // H = I = 384: no split at all.
  EXPECT_EQ(candidate_tactics(problem(16, 384, 384, 2)),
            (std::vector<MoeTactic>{kWgmma128, kWgmma256, kStream1, kStream32x1}));
  // Ceil of chunks: K = 1040 is 9 chunks, 896 is 7: split 4 needs 8 in one of the GEMMs.
  EXPECT_TRUE(tactic_valid(problem(16, 1040, 896, 2), kStream4));
  EXPECT_TRUE(tactic_valid(problem(16, 896, 1040, 2), kStream4));
  EXPECT_FALSE(tactic_valid(problem(16, 896, 896, 2), kStream4));
}

TEST(Registry, EachGemmSplitsWhileItsKChunksAllow) {
  // qwen3-30b-a3b, split_k 4: GEMM1 K = 2048 (16 chunks) splits 4 ways, GEMM2 K = 768 (6 chunks) 2 ways.
  EXPECT_EQ(gemm_split_k(kStream4, 2048), 4);
  EXPECT_EQ(gemm_split_k(kStream4, 768), 2);
  EXPECT_EQ(gemm_split_k(kStream4, 1024), 4);  // 8 chunks: 2 per split
  EXPECT_EQ(gemm_split_k(kStream4, 1023), 4);  // ceil: still 8 chunks
  EXPECT_EQ(gemm_split_k(kStream4, 896), 2);   // 7 chunks
  EXPECT_EQ(gemm_split_k(kStream2, 512), 2);   // 4 chunks
  EXPECT_EQ(gemm_split_k(kStream2, 384), 1);   // 3 chunks
  EXPECT_EQ(gemm_split_k(kStream32x4, 256), 1);
  EXPECT_EQ(gemm_split_k(kStream1, 1 << 20), 1);
  EXPECT_EQ(gemm_split_k(kWgmma128, 1 << 20), 1);
}

TEST(Registry, WhyInvalidNamesTheRule) {
  const MoeProblem p = problem(16, 1024, 384, 2);
  EXPECT_EQ(why_invalid(p, kWgmma128), "");
  EXPECT_EQ(why_invalid(p, MoeTactic{GemmKernel::Sm90Wgmma, 64, 1}),
            "sm90_wgmma: tile_tokens must be in {128, 256}, got 64");
  EXPECT_EQ(why_invalid(p, MoeTactic{GemmKernel::Sm90Wgmma, 128, 2}), "sm90_wgmma: split_k must be in {1}, got 2");
  EXPECT_EQ(why_invalid(p, MoeTactic{GemmKernel::Sm90Stream, 16, 3}), "sm90_stream: split_k must be in {1, 2, 4}, got 3");
  EXPECT_EQ(why_invalid(p, MoeTactic{GemmKernel::Sm90Stream, 64, 1}), "sm90_stream: tile_tokens must be in {16, 32}, got 64");
  EXPECT_EQ(why_invalid(p, kStream2), "");  // GEMM1: 8 chunks
  EXPECT_EQ(why_invalid(problem(16, 384, 256, 2), kStream2),
            "sm90_stream: split_k 2 needs >= 4 chunks of 128 along K in at least one GEMM, got 3 (GEMM1, K=H=384) "
            "and 2 (GEMM2, K=I=256)");
  EXPECT_NE(why_invalid(problem(16, 1000, 384, 2), kWgmma128).find("multiples of 16"), std::string::npos);
  EXPECT_NE(why_invalid(p, MoeTactic{static_cast<GemmKernel>(9), 128, 1}).find("unknown kernel id 9"),
            std::string::npos);
}

TEST(Registry, HeuristicIsValidForEveryBucketOfEveryPreset) {
  std::vector<MoeProblem> problems;
  for (const char* name : {"deepseek-r1", "qwen3-30b-a3b", "qwen3-235b-a22b", "llama4-scout", "gpt-oss-120b", "tiny"})
    problems.push_back(preset(name, ActQuant::W4A4Scalar));
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
  EXPECT_EQ(heuristic_tactic(ds, 481), kWgmma128);           // bucket [481, 512]: m = 16
  EXPECT_EQ(heuristic_tactic(ds, 768), kWgmma128);           // m = 24
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
  EXPECT_EQ(heuristic_tactic(mid, 225), kWgmma128);    // bucket [225, 256]: m = 16
  // Split K not allowed by the shape: stays split 1.
  EXPECT_EQ(heuristic_tactic(problem(16, 1024, 384, 2), 1), kStream1);
  expect_error([&] { heuristic_tactic(ds, -1); }, "token count T must be >= 0");
}

}  // namespace
}  // namespace fp4moe
