// tests/tune/buckets_test.cpp — the token-count ladder: every T in 0..20000 in exactly one bucket that
// contains it, contiguous ordered buckets, the documented boundaries, the open bucket at the int limits.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "error_message.hpp"
#include "fp4moe/tune.hpp"

namespace fp4moe {
namespace {

TEST(Buckets, EveryTokenCountUpTo20000IsInTheBucketThatContainsIt) {
  int previous = 0;
  for (int64_t T = 0; T <= 20000; ++T) {
    const int b = bucket_of(T);
    ASSERT_GE(b, 0) << "T=" << T;
    ASSERT_LT(b, num_buckets()) << "T=" << T;
    const BucketRange r = bucket_range(b);
    ASSERT_LE(r.lo, T) << "T=" << T << " bucket " << b;
    ASSERT_GE(r.hi, T) << "T=" << T << " bucket " << b;
    // Monotone, and a new bucket starts exactly where the previous one ended.
    ASSERT_TRUE(b == previous || (b == previous + 1 && r.lo == T)) << "T=" << T;
    previous = b;
  }
}

TEST(Buckets, AreContiguousOrderedAndRepresentedByAMember) {
  EXPECT_EQ(bucket_range(0).lo, 0);
  for (int b = 0; b < num_buckets(); ++b) {
    const BucketRange r = bucket_range(b);
    EXPECT_LE(r.lo, r.hi) << b;
    EXPECT_GE(r.representative, r.lo) << b;
    EXPECT_LE(r.representative, r.hi) << b;
    EXPECT_EQ(bucket_of(r.lo), b);
    EXPECT_EQ(bucket_of(r.representative), b);
    if (!r.open()) {
      EXPECT_EQ(bucket_of(r.hi), b);
      EXPECT_EQ(r.representative, r.hi) << "closed buckets are tuned at their upper end";
    }
    if (b + 1 < num_buckets()) {
      EXPECT_FALSE(r.open()) << "only the last bucket is open";
      EXPECT_EQ(bucket_range(b + 1).lo, r.hi + 1) << "gap or overlap after bucket " << b;
    }
  }
  EXPECT_TRUE(bucket_range(num_buckets() - 1).open());
}

TEST(Buckets, FollowTheDocumentedLadder) {
  for (int64_t T = 0; T <= 32; ++T) EXPECT_EQ(bucket_of(T), T) << "dense up to 32";
  EXPECT_EQ(bucket_range(33).lo, 33);
  EXPECT_EQ(bucket_range(33).hi, 40);
  EXPECT_EQ(bucket_range(44).hi, 128);
  EXPECT_EQ(bucket_range(45).lo, 129);
  EXPECT_EQ(bucket_range(45).hi, 160);
  EXPECT_EQ(bucket_range(56).hi, 512);
  EXPECT_EQ(bucket_range(57).lo, 513);
  EXPECT_EQ(bucket_range(57).hi, 640);
  EXPECT_EQ(bucket_range(60).hi, 1024);
  EXPECT_EQ(bucket_range(100).hi, int64_t(1) << 20);
  EXPECT_EQ(num_buckets(), 102);
  // Above 512 no bucket spans more than 1.25x its start.
  for (int b = 57; b < num_buckets() - 1; ++b) {
    const BucketRange r = bucket_range(b);
    EXPECT_LE(4 * r.hi, 5 * (r.lo - 1)) << b;
  }
  EXPECT_EQ(describe_bucket(5), "[5, 5]");
  EXPECT_EQ(describe_bucket(33), "[33, 40]");
  EXPECT_EQ(describe_bucket(101), "[1048577, inf)");
}

TEST(Buckets, TheIntegerLimitsFallInTheOpenBucket) {
  const int open = num_buckets() - 1;
  EXPECT_EQ(bucket_of((int64_t(1) << 20) + 1), open);
  EXPECT_EQ(bucket_of(std::numeric_limits<int32_t>::max()), open);
  EXPECT_EQ(bucket_of(int64_t(std::numeric_limits<int32_t>::max()) + 1), open);
  EXPECT_EQ(bucket_of(std::numeric_limits<int64_t>::max() / 2), open);
  EXPECT_EQ(bucket_of(std::numeric_limits<int64_t>::max()), open);
  EXPECT_EQ(bucket_range(open).hi, std::numeric_limits<int64_t>::max());
}

TEST(Buckets, NegativeTokenCountsAndBadIndicesAreErrors) {
  expect_error([] { bucket_of(-1); }, "token count T must be >= 0, got -1");
  expect_error([] { bucket_of(std::numeric_limits<int64_t>::min()); }, "must be >= 0");
  expect_error([] { bucket_range(-1); }, "bucket index must be in [0, 102), got -1");
  expect_error([] { bucket_range(102); }, "got 102");
}

TEST(Buckets, TheTunedBucketsAreTheRangeOrThoseOfTheGivenTokenCounts) {
  std::vector<int> upto40;
  for (int b = 1; b <= 33; ++b) upto40.push_back(b);  // T = 1..32 one each, then [33, 40]
  EXPECT_EQ(buckets_to_tune(40, {}), upto40);
  EXPECT_EQ(buckets_to_tune(39, {}), std::vector<int>(upto40.begin(), upto40.end() - 1));
  // Given token counts: their buckets, sorted, each once; T = 0 (bucket 0) has no work; max_tokens is ignored.
  EXPECT_EQ(buckets_to_tune(1, {16384, 512, 0, 1000, 1024, 512, 3}),
            (std::vector<int>{3, bucket_of(512), bucket_of(1024), bucket_of(16384)}));
  EXPECT_EQ(bucket_of(1000), bucket_of(1024));
  EXPECT_TRUE(buckets_to_tune(16384, {0}).empty());
  expect_error([] { buckets_to_tune(16384, {512, -1}); }, "token count T must be >= 0, got -1");
}

}  // namespace
}  // namespace fp4moe
