// tests/kernels/div_rn_cpu_test.cpp — the branch-free division of kernels/div_rn.cuh on the host: its
// correction steps, fed the correctly rounded reciprocal RN(1/b), must give the IEEE quotient (the
// host's correctly rounded float division) for every operand pair that divrn::fast_ok accepts,
// including quotients next to a rounding midpoint. The steps are not exact for every reciprocal
// within an ulp (DivRn.NeedsTheHardwareReciprocal): what the device's rcp.approx returns is checked
// against __fdiv_rn by the GPU test Nvfp4Device.DivRnFastPathMatchesIeee.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "kernels/div_rn.cuh"

namespace fp4moe {
namespace {

namespace dr = kernels::divrn;

bool same(float a, float b) { return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b); }

// A float with the given sign, unbiased exponent and 23-bit mantissa.
float make(bool neg, int exp, uint32_t mant) {
  return std::bit_cast<float>((neg ? 0x80000000u : 0u) | static_cast<uint32_t>(exp + 127) << 23 | (mant & 0x7FFFFFu));
}

// Checks refine(a, b, RN(1/b)) == a / b; returns 1 on a failure.
int check_pair(float a, float b) {
  const float want = a / b, r = 1.0f / b;
  const float got = dr::refine(a, b, r);
  if (same(got, want)) return 0;
  ADD_FAILURE() << std::hexfloat << "a " << a << " b " << b << " r " << r << ": got " << got << " want " << want;
  return 1;
}

// With r one ulp below RN(1/b) the steps round 1 / (1 - 2^-24) to 1: the fast path is exact only with
// the reciprocal the hardware gives, which the GPU test checks (b = 1 - 2^-24 is one of its divisors).
TEST(DivRn, NeedsTheHardwareReciprocal) {
  const float b = 0x1.fffffep-1f;
  EXPECT_TRUE(same(dr::refine(1.0f, b, 1.0f / b), 1.0f / b));
  EXPECT_FALSE(same(dr::refine(1.0f, b, std::nextafter(1.0f / b, 0.0f)), 1.0f / b));
}

TEST(DivRn, RangeCheck) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(dr::fast_ok(1.0f, 1.0f));
  EXPECT_TRUE(dr::fast_ok(-0x1p62f, 0x1p-62f));
  EXPECT_TRUE(dr::fast_ok(0x1p-62f, -0x1p62f));
  for (float bad : {0.0f, -0.0f, 0x1p-63f, 0x1.fffffep-63f, 0x1.000002p62f, 0x1p63f, inf, -inf, nan,
                    std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::max()}) {
    EXPECT_FALSE(dr::fast_ok(bad, 1.0f)) << std::hexfloat << bad;
    EXPECT_FALSE(dr::fast_ok(1.0f, bad)) << std::hexfloat << bad;
  }
}

TEST(DivRn, RandomOperandsOverTheRange) {
  std::mt19937_64 rng(2026);
  int fails = 0;
  for (int i = 0; i < 1000000 && fails < 20; ++i) {
    const uint64_t u = rng();
    const float a = make(u & 1, static_cast<int>((u >> 1) % 124) - 62, static_cast<uint32_t>(u >> 8));
    const float b = make((u >> 40) & 1, static_cast<int>((u >> 41) % 124) - 62, static_cast<uint32_t>(rng()));
    ASSERT_TRUE(dr::fast_ok(a, b));
    fails += check_pair(a, b);
  }
  EXPECT_EQ(fails, 0);
}

// The activations' shape of division: b = 1 + exp(-g) in [1, 2^62], a = g or 1.
TEST(DivRn, SigmoidDenominators) {
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> g(-40.0f, 40.0f);
  int fails = 0;
  for (int i = 0; i < 1000000 && fails < 20; ++i) {
    const float x = g(rng);
    const float den = 1.0f + std::exp(-x);
    if (!dr::fast_ok(x, den)) continue;
    fails += check_pair(x, den);
    fails += check_pair(1.0f, den);
  }
  EXPECT_EQ(fails, 0);
}

// Quotients next to a rounding midpoint: a = RN(b * m) for m one ulp-quarter off the midpoint of two
// neighbouring floats q, q+ulp (the cases where a wrong last correction shows).
TEST(DivRn, QuotientsNearMidpoints) {
  std::mt19937_64 rng(11);
  int fails = 0;
  for (int i = 0; i < 1000000 && fails < 20; ++i) {
    const uint64_t u = rng();
    const float q = make(false, static_cast<int>(u % 40) - 20, static_cast<uint32_t>(u >> 8));
    const float b = make(false, static_cast<int>((u >> 40) % 40) - 20, static_cast<uint32_t>(rng()));
    const double mid = 0.5 * (static_cast<double>(q) + static_cast<double>(std::nextafter(q, 2.0f * q)));
    const double ulp = static_cast<double>(std::nextafter(q, 2.0f * q)) - static_cast<double>(q);
    for (double off : {-0.25, -1.0 / 64, 0.0, 1.0 / 64, 0.25}) {
      const float a = static_cast<float>(static_cast<double>(b) * (mid + off * ulp));
      if (dr::fast_ok(a, b)) fails += check_pair(a, b);
    }
  }
  EXPECT_EQ(fails, 0);
}

// Exact quotients and the ends of the range.
TEST(DivRn, ExactQuotientsAndRangeEnds) {
  int fails = 0;
  const std::vector<float> ends = {0x1p-62f, 0x1.000002p-62f, 0x1.fffffep-62f, 0x1p62f, 0x1.fffffep61f, 1.0f,
                                   0x1.fffffep-1f, 0x1.000002p0f, 3.0f, 7.0f, 0x1.555556p-2f};
  for (float a : ends)
    for (float b : ends)
      for (float sa : {1.0f, -1.0f})
        for (float sb : {1.0f, -1.0f}) fails += check_pair(sa * a, sb * b);
  for (int n = 1; n < 4096; ++n)
    for (float b : {1.0f, 3.0f, 5.0f, 7.0f, 9.0f, 0x1p-30f * 3.0f}) fails += check_pair(static_cast<float>(n) * b, b);
  EXPECT_EQ(fails, 0);
}

}  // namespace
}  // namespace fp4moe
