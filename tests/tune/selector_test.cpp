// tests/tune/selector_test.cpp — the per-forward selector (cache first, heuristic otherwise, foreign
// entries ignored with one warning), the debug line, and FP4MOE_LOG parsing.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "error_message.hpp"
#include "fp4moe/presets.hpp"
#include "fp4moe/tune.hpp"

namespace fp4moe {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using Source = TacticSelector::Choice::Source;

DeviceKey h200() { return {std::string(fp4moe_version()), "NVIDIA H200", 132, 12080}; }
const MoeTactic kWgmma256{GemmKernel::Sm90Wgmma, 256, 1, 1};

TEST(TacticSelector, WithoutACacheEveryBucketIsTheHeuristic) {
  const MoeProblem p = preset("qwen3-235b-a22b", ActQuant::W4A4Scalar);
  const TacticSelector s(p, h200(), nullptr);
  EXPECT_TRUE(s.warnings().empty());
  EXPECT_EQ(s.cached_buckets(), 0);
  for (int64_t T : {0, 1, 7, 33, 1000, 8191, 8193, 1 << 22}) {
    const TacticSelector::Choice& c = s.select(T);
    EXPECT_EQ(c.bucket, bucket_of(T));
    EXPECT_EQ(c.tactic, heuristic_tactic(p, T));
    EXPECT_EQ(c.source, Source::Heuristic);
  }
  expect_error([&] { s.select(-1); }, "token count T must be >= 0");
}

TEST(TacticSelector, AnExpertParallelRankChoosesForItsShareOfTheTokens) {
  MoeProblem rank = preset("deepseek-r1", ActQuant::W4A4Scalar);  // 256 experts over 8 ranks: 32 each
  rank.num_experts = 32;
  rank.routing.method = RoutingMethod::Precomputed;
  rank.routing.skip_foreign_ids = true;
  EXPECT_EQ(tactic_tokens(rank, 64), 64);  // the whole layer's expert count not given: T itself
  rank.routing.total_experts = 256;
  EXPECT_EQ(rank.describe().find("skip_foreign_ids,of 256") != std::string::npos, true) << rank.describe();
  EXPECT_EQ(tactic_tokens(rank, 64), 8);
  EXPECT_EQ(tactic_tokens(rank, 65), 9);  // rounded up
  EXPECT_EQ(tactic_tokens(rank, 1), 1);
  EXPECT_EQ(tactic_tokens(rank, 0), 0);
  EXPECT_EQ(tactic_tokens(rank, -1), -1);
  EXPECT_EQ(tactic_tokens(preset("deepseek-r1"), 64), 64);  // not expert-parallel
  const TacticSelector s(rank, h200(), nullptr);
  for (int64_t T : {1, 64, 1000, 16384}) {
    const TacticSelector::Choice& c = s.select(T);
    EXPECT_EQ(c.bucket, bucket_of(tactic_tokens(rank, T))) << T;
    EXPECT_EQ(c.tactic, heuristic_tactic(rank, tactic_tokens(rank, T))) << T;
  }
  expect_error([&] { s.select(-1); }, "token count T must be >= 0");
  rank.routing.total_experts = 16;
  expect_error([&] { rank.validate(); }, "total_experts (the whole layer's experts) needs skip_foreign_ids and must be "
                                         ">= num_experts (E = 32), got 16");
}

TEST(TacticSelector, TakesThisDevicesEntriesAndWarnsOnceAboutForeignOnes) {
  const MoeProblem p = preset("deepseek-r1", ActQuant::W4A4Scalar);
  TuneCache cache;
  cache.set(h200(), p, bucket_of(1000), kWgmma256, 800, 900);
  DeviceKey older = h200();
  older.fp4moe_version = "0.0.1";
  cache.set(older, p, bucket_of(8), kWgmma256, 10, 20);
  DeviceKey h100 = h200();
  h100.gpu_name = "NVIDIA H100";
  cache.set(h100, p, bucket_of(9), kWgmma256, 10, 20);
  cache.set(h100, preset("tiny"), 3, kWgmma256, 10, 20);  // another problem: no warning about it

  const TacticSelector s(p, h200(), &cache);
  EXPECT_EQ(s.cached_buckets(), 1);
  EXPECT_EQ(s.select(1000).source, Source::Cache);
  EXPECT_EQ(s.select(1000).tactic, kWgmma256);
  EXPECT_EQ(s.select(897).source, Source::Cache) << "the whole bucket [897, 1024]";
  EXPECT_EQ(s.select(8).source, Source::Heuristic);
  EXPECT_EQ(s.select(9).source, Source::Heuristic);
  ASSERT_EQ(s.warnings().size(), 1u);
  EXPECT_THAT(s.warnings()[0], HasSubstr("2 entries for E=256 H=7168"));
  EXPECT_THAT(s.warnings()[0], HasSubstr("another device or fp4moe version"));
  EXPECT_THAT(s.warnings()[0], HasSubstr("NVIDIA H200 (132 SMs, CUDA runtime 12080, fp4moe "));
}

TEST(TacticSelector, FromFileKeepsTheLoadWarningAndFallsBack) {
  const fs::path dir = fs::path(FP4MOE_TEST_TMPDIR) / "tune";
  fs::create_directories(dir);
  const std::string corrupt = (dir / "selector_corrupt.json").string();
  std::ofstream(corrupt) << "{\"format\": \"fp4moe-tune-cache\", ";
  const MoeProblem p = preset("tiny");
  const TacticSelector s = TacticSelector::from_file(p, h200(), corrupt);
  ASSERT_EQ(s.warnings().size(), 1u);
  EXPECT_THAT(s.warnings()[0], HasSubstr("not valid JSON"));
  EXPECT_EQ(s.cached_buckets(), 0);

  const std::string good = (dir / "selector_good.json").string();
  TuneCache cache;
  cache.set(h200(), p, 5, kWgmma256, 3, 4);
  cache.save(good);
  const TacticSelector t = TacticSelector::from_file(p, h200(), good);
  EXPECT_TRUE(t.warnings().empty());
  EXPECT_EQ(t.select(5).source, Source::Cache);
  EXPECT_EQ(t.select(5).tactic, kWgmma256);
}

TEST(TacticSelector, DescribesTheChoiceForTheDebugLog) {
  const MoeProblem p = preset("qwen3-30b-a3b");
  TuneCache cache;
  cache.set(h200(), p, bucket_of(300), kWgmma256, 3, 4);
  const TacticSelector s(p, h200(), &cache);
  EXPECT_EQ(describe_choice(p, 300, s.select(300)),
            "forward " + p.describe() + " T=300 bucket 50 [289, 320] tactic sm90_wgmma/t256/s1 (cache)");
  EXPECT_THAT(describe_choice(p, 3, s.select(3)), HasSubstr("T=3 bucket 3 [3, 3] tactic sm90_stream/t16/s1 (heuristic)"));
  // One token: 8 experts, but GEMM2 has 6 K chunks (I = 768): no split.
  EXPECT_THAT(describe_choice(p, 1, s.select(1)), HasSubstr("T=1 bucket 1 [1, 1] tactic sm90_stream/t16/s1 (heuristic)"));
}

TEST(LogLevel, ParsesTheThreeValuesAndWarnsOnOthers) {
  std::string w;
  EXPECT_EQ(parse_log_level(nullptr, &w), LogLevel::Info);
  EXPECT_EQ(parse_log_level("", &w), LogLevel::Info);
  EXPECT_EQ(parse_log_level("off", &w), LogLevel::Off);
  EXPECT_EQ(parse_log_level("info", &w), LogLevel::Info);
  EXPECT_EQ(parse_log_level("debug", &w), LogLevel::Debug);
  EXPECT_TRUE(w.empty());
  EXPECT_EQ(parse_log_level("verbose", &w), LogLevel::Info);
  EXPECT_EQ(w, "FP4MOE_LOG: unknown value 'verbose', expected off, info or debug; using info");
}

}  // namespace
}  // namespace fp4moe
