// tests/runner/tune_profile_test.cpp — tune_problem (what `fp4moe tune` profiles) on the tiny preset:
// one entry per bucket up to max_tokens (or per bucket of the given token counts), in order, each
// naming a candidate tactic, the bucket's heuristic and positive times, and a tuned tactic that is
// either the heuristic (with its time) or at least 1.5% faster than it in the confirmation replays.
// NOTE: the test's name avoids "Tiny", which the sanitizer filters of scripts/gpu-check select.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "fp4moe/bench.hpp"
#include "fp4moe/presets.hpp"
#include "fp4moe/runner.hpp"
#include "fp4moe/tune.hpp"

namespace fp4moe {
namespace {

TEST(TuneProfile, OneConsistentEntryPerBucket) {
  std::string why;
  if (!cuda_device_available(&why)) GTEST_SKIP() << why;
  for (ActQuant mode : {ActQuant::W4A16, ActQuant::W4A4Scalar}) {
    const MoeProblem p = preset("tiny", mode);
    TuneProfileOptions o;
    o.max_tokens = 40;  // buckets 1..33: single token counts, then [33, 40]
    o.reps = 5;
    o.progress = false;
    const std::vector<TuneEntry> entries = tune_problem("tiny", p, o);
    std::vector<int> expected;
    for (int b = 1; b < num_buckets() && bucket_range(b).representative <= o.max_tokens; ++b) expected.push_back(b);
    ASSERT_EQ(entries.size(), expected.size());
    const std::vector<MoeTactic> candidates = candidate_tactics(p);
    for (size_t i = 0; i < entries.size(); ++i) {
      const TuneEntry& e = entries[i];
      SCOPED_TRACE(describe_bucket(e.bucket));
      EXPECT_EQ(e.bucket, expected[i]);
      EXPECT_EQ(problem_key(e.problem), problem_key(p));
      EXPECT_TRUE(e.heuristic == heuristic_tactic(p, bucket_range(e.bucket).representative));
      EXPECT_NE(std::find(candidates.begin(), candidates.end(), e.tactic), candidates.end());
      EXPECT_GT(e.heuristic_us, 0.0);
      EXPECT_GT(e.tactic_us, 0.0);
      if (e.tactic == e.heuristic) EXPECT_EQ(e.tactic_us, e.heuristic_us);
      else EXPECT_LT(e.tactic_us, 0.985 * e.heuristic_us);
    }
  }
}

TEST(TuneProfile, GivenTokenCountsTuneOnlyTheirBuckets) {
  std::string why;
  if (!cuda_device_available(&why)) GTEST_SKIP() << why;
  const MoeProblem p = preset("tiny", ActQuant::W4A16);
  TuneProfileOptions o;
  o.max_tokens = 1;  // ignored when tokens are given
  o.tokens = {40, 2, 36};
  o.reps = 5;
  o.progress = false;
  const std::vector<TuneEntry> entries = tune_problem("tiny", p, o);
  ASSERT_EQ(entries.size(), 2u);
  EXPECT_EQ(entries[0].bucket, bucket_of(2));
  EXPECT_EQ(entries[1].bucket, bucket_of(40));
  for (const TuneEntry& e : entries) EXPECT_GT(e.tactic_us, 0.0);
}

}  // namespace
}  // namespace fp4moe
