// tune/buckets.cpp — the fixed ladder of token-count buckets (fp4moe/tune.hpp documents it).
//
// The ladder is one compile-time table of the buckets' last T; bucket_of is a binary search in it,
// so the mapping and bucket_range cannot disagree. The table is built from the rules (dense, steps of
// 8, steps of 32, quarters of powers of two) and checked against kNumBuckets at compile time.
#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "fp4moe/error.hpp"
#include "fp4moe/tune.hpp"

namespace fp4moe {
namespace {

constexpr int kClosedBuckets = kNumBuckets - 1;  // every bucket but the open one has a last T

constexpr std::array<int64_t, kClosedBuckets> make_bucket_ends() {
  std::array<int64_t, kClosedBuckets> ends{};
  int n = 0;
  for (int64_t t = 0; t <= 32; ++t) ends[n++] = t;            // dense: the small-T kernels differ per T
  for (int64_t t = 40; t <= 128; t += 8) ends[n++] = t;       // steps of 8
  for (int64_t t = 160; t <= 512; t += 32) ends[n++] = t;     // steps of 32
  for (int p = 9; p < 20; ++p)                                // quarters of each power of two
    for (int q = 1; q <= 4; ++q) ends[n++] = (int64_t(1) << p) + q * (int64_t(1) << (p - 2));
  return ends;
}

constexpr std::array<int64_t, kClosedBuckets> kBucketEnds = make_bucket_ends();
static_assert(kBucketEnds[32] == 32 && kBucketEnds[44] == 128 && kBucketEnds[56] == 512);
static_assert(kBucketEnds[kClosedBuckets - 1] == kLastClosedBucketEnd, "the ladder must end at 2^20");
constexpr int64_t kOpenBucketRepresentative = kLastClosedBucketEnd + kLastClosedBucketEnd / 4;

}  // namespace

int bucket_of(int64_t T) {
  check(T >= 0, "token count T must be >= 0, got ", T);
  // The first bucket whose last T is >= T; past the table: the open bucket.
  const auto it = std::lower_bound(kBucketEnds.begin(), kBucketEnds.end(), T);
  return static_cast<int>(it - kBucketEnds.begin());
}

BucketRange bucket_range(int b) {
  check(b >= 0 && b < kNumBuckets, "bucket index must be in [0, ", kNumBuckets, "), got ", b);
  if (b == kNumBuckets - 1) return {kLastClosedBucketEnd + 1, INT64_MAX, kOpenBucketRepresentative};
  const int64_t lo = b == 0 ? 0 : kBucketEnds[b - 1] + 1;
  return {lo, kBucketEnds[b], kBucketEnds[b]};
}

std::vector<int> buckets_to_tune(int64_t max_tokens, const std::vector<int64_t>& tokens) {
  std::vector<int> out;
  if (tokens.empty()) {
    for (int b = 1; b < kNumBuckets && bucket_range(b).representative <= max_tokens; ++b) out.push_back(b);
    return out;
  }
  for (int64_t T : tokens)
    if (const int b = bucket_of(T); b > 0) out.push_back(b);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::string describe_bucket(int b) {
  const BucketRange r = bucket_range(b);
  // detail::concat rather than string operator+: GCC 12 warns falsely (-Wrestrict) on the latter.
  if (r.open()) return detail::concat("[", r.lo, ", inf)");
  return detail::concat("[", r.lo, ", ", r.hi, "]");
}

}  // namespace fp4moe
