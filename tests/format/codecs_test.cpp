// tests/format/codecs_test.cpp — e2m1, e4m3fn, ue8m0, bf16 codecs: exhaustive decode, every rounding
// tie, saturation, signed zero and NaN policy; encoders cross-checked against a brute-force nearest
// search over the decoded code tables (ties to the even code).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "fp4moe/format.hpp"

namespace fp4moe::format {
namespace {

const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// Brute force: nearest non-negative finite code magnitude in [0, max_code], ties to the even code,
// values beyond the largest saturate; the sign bit is `sign_bit`.
uint8_t brute_nearest(double x, const std::vector<double>& mags, uint8_t sign_bit) {
  const uint8_t sign = std::signbit(x) ? sign_bit : 0;
  const double a = std::fabs(x);
  int best = 0;
  double best_d = std::fabs(a - mags[0]);
  for (int c = 1; c < static_cast<int>(mags.size()); ++c) {
    const double d = std::fabs(a - mags[c]);
    if (d < best_d || (d == best_d && (c % 2 == 0) && (best % 2 != 0))) {
      best = c;
      best_d = d;
    }
  }
  return static_cast<uint8_t>(sign | best);
}

// ---- e4m3 ------------------------------------------------------------------------------------------

TEST(FormatCodecs, E4m3DecodeKnownCodes) {
  EXPECT_EQ(e4m3_to_float(0x00), 0.0f);
  EXPECT_TRUE(std::signbit(e4m3_to_float(0x80)));
  EXPECT_EQ(e4m3_to_float(0x80), 0.0f);
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));  // min subnormal
  EXPECT_EQ(e4m3_to_float(0x07), 7.0f * std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_float(0x08), std::ldexp(1.0f, -6));  // min normal
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(e4m3_to_float(0x39), 1.125f);
  EXPECT_EQ(e4m3_to_float(0x30), 0.5f);
  EXPECT_EQ(e4m3_to_float(0x40), 2.0f);
  EXPECT_EQ(e4m3_to_float(0x7D), 416.0f);
  EXPECT_EQ(e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(e4m3_to_float(0xFE), -448.0f);
  EXPECT_EQ(e4m3_to_float(0xB8), -1.0f);
  EXPECT_TRUE(std::isnan(e4m3_to_float(0x7F)));
  EXPECT_TRUE(std::isnan(e4m3_to_float(0xFF)));
}

TEST(FormatCodecs, E4m3DecodeAllCodesFromFields) {
  for (int c = 0; c < 256; ++c) {
    const int s = c >> 7, e = (c >> 3) & 0xF, m = c & 7;
    const float v = e4m3_to_float(static_cast<uint8_t>(c));
    if (e == 15 && m == 7) {
      EXPECT_TRUE(std::isnan(v)) << "code " << c;
      continue;
    }
    const double mag = e == 0 ? m * std::ldexp(1.0, -9) : (1.0 + m / 8.0) * std::ldexp(1.0, e - 7);
    EXPECT_EQ(static_cast<double>(v), s ? -mag : mag) << "code " << c;
    EXPECT_EQ(std::signbit(v), s == 1) << "code " << c;
  }
}

TEST(FormatCodecs, E4m3AllCodesRoundTrip) {
  for (int c = 0; c < 256; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    const uint8_t back = e4m3_from_float(e4m3_to_float(code));
    if (code == 0x7F || code == 0xFF) {
      EXPECT_EQ(back, 0x7F) << "NaN code " << c;
    } else {
      EXPECT_EQ(back, code) << "code " << c;
    }
  }
  EXPECT_EQ(e4m3_from_float(-0.0f), 0x80);
  EXPECT_EQ(e4m3_from_float(0.0f), 0x00);
}

TEST(FormatCodecs, E4m3RoundingTiesToEven) {
  // Normal range: 1.0625 lies between 1 (0x38, even) and 1.125 (0x39).
  EXPECT_EQ(e4m3_from_float(1.0625f), 0x38);
  EXPECT_EQ(e4m3_from_float(-1.0625f), 0xB8);
  EXPECT_EQ(e4m3_from_float(std::nextafter(1.0625f, 2.0f)), 0x39);
  // 1.1875 between 1.125 (0x39) and 1.25 (0x3A, even).
  EXPECT_EQ(e4m3_from_float(1.1875f), 0x3A);
  EXPECT_EQ(e4m3_from_float(std::nextafter(1.1875f, 0.0f)), 0x39);
  // 1.9375 between 1.875 (0x3F) and 2 (0x40, even): the carry into the next binade.
  EXPECT_EQ(e4m3_from_float(1.9375f), 0x40);
  EXPECT_EQ(e4m3_from_float(-1.9375f), 0xC0);
  // 432 between 416 (0x7D) and 448 (0x7E, even).
  EXPECT_EQ(e4m3_from_float(432.0f), 0x7E);
  EXPECT_EQ(e4m3_from_float(std::nextafter(432.0f, 0.0f)), 0x7D);
  // 0.5 * 1.0625 = 0.53125 between 0.5 (0x30) and 0.5625 (0x31).
  EXPECT_EQ(e4m3_from_float(0.53125f), 0x30);
}

TEST(FormatCodecs, E4m3Subnormals) {
  const float q = std::ldexp(1.0f, -9);  // subnormal quantum
  for (int m = 0; m < 8; ++m) EXPECT_EQ(e4m3_from_float(m * q), m) << m;
  EXPECT_EQ(e4m3_from_float(0.5f * q), 0x00);               // tie -> 0 (even)
  EXPECT_EQ(e4m3_from_float(std::nextafter(0.5f * q, 1.0f)), 0x01);
  EXPECT_EQ(e4m3_from_float(-0.5f * q), 0x80);              // negative underflow keeps the sign
  EXPECT_EQ(e4m3_from_float(1.5f * q), 0x02);               // tie 1|2 -> 2
  EXPECT_EQ(e4m3_from_float(2.5f * q), 0x02);               // tie 2|3 -> 2
  EXPECT_EQ(e4m3_from_float(3.5f * q), 0x04);               // tie 3|4 -> 4
  EXPECT_EQ(e4m3_from_float(7.5f * q), 0x08);               // tie 7|min normal -> 0x08
  EXPECT_EQ(e4m3_from_float(-6.5f * q), 0x86);              // tie 6|7 -> 6
  EXPECT_EQ(e4m3_from_float(0.25f * q), 0x00);
  EXPECT_EQ(e4m3_from_float(1e-30f), 0x00);
  EXPECT_EQ(e4m3_from_float(float_of(1u)), 0x00);           // smallest fp32 subnormal
  // Between the last subnormal and the first normal both quanta are 2^-9: 8.5 q is a tie 8|9 -> 8.
  EXPECT_EQ(e4m3_from_float(8.5f * q), 0x08);
  EXPECT_EQ(e4m3_from_float(9.5f * q), 0x0A);
}

TEST(FormatCodecs, E4m3SaturationAndNaN) {
  EXPECT_EQ(e4m3_from_float(448.0f), 0x7E);
  EXPECT_EQ(e4m3_from_float(449.0f), 0x7E);
  EXPECT_EQ(e4m3_from_float(464.0f), 0x7E);  // would round to 480 (the NaN code's value)
  EXPECT_EQ(e4m3_from_float(480.0f), 0x7E);
  EXPECT_EQ(e4m3_from_float(1e6f), 0x7E);
  EXPECT_EQ(e4m3_from_float(std::numeric_limits<float>::max()), 0x7E);
  EXPECT_EQ(e4m3_from_float(kInf), 0x7E);
  EXPECT_EQ(e4m3_from_float(-448.0f), 0xFE);
  EXPECT_EQ(e4m3_from_float(-500.0f), 0xFE);
  EXPECT_EQ(e4m3_from_float(-kInf), 0xFE);
  EXPECT_EQ(e4m3_from_float(kNaN), 0x7F);
  EXPECT_EQ(e4m3_from_float(-kNaN), 0x7F);
}

TEST(FormatCodecs, E4m3MatchesBruteForceNearest) {
  std::vector<double> mags;
  for (int c = 0; c <= 0x7E; ++c) mags.push_back(e4m3_to_float(static_cast<uint8_t>(c)));
  std::vector<float> xs;
  // Every code value, every midpoint between neighbours, and the fp32 neighbours of both.
  for (size_t c = 0; c + 1 < mags.size(); ++c) {
    const float v = static_cast<float>(mags[c]);
    const float mid = static_cast<float>((mags[c] + mags[c + 1]) / 2);
    for (float y : {v, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) {
      xs.push_back(y);
      xs.push_back(-y);
    }
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> expo(-14.0f, 10.0f);
  for (int i = 0; i < 20000; ++i) {
    const float y = std::exp2(expo(rng));
    xs.push_back(i % 2 ? y : -y);
  }
  for (float x : xs) EXPECT_EQ(e4m3_from_float(x), brute_nearest(x, mags, 0x80)) << "x = " << x;
}

// ---- e2m1 ------------------------------------------------------------------------------------------

TEST(FormatCodecs, E2m1DecodeAllCodes) {
  const float expected[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                              -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  for (int c = 0; c < 16; ++c) {
    EXPECT_EQ(e2m1_to_float(static_cast<uint8_t>(c)), expected[c]) << c;
    EXPECT_EQ(std::signbit(e2m1_to_float(static_cast<uint8_t>(c))), c >= 8) << c;
    EXPECT_EQ(e2m1_to_float(static_cast<uint8_t>(c | 0xA0)), expected[c]) << "high nibble ignored";
    EXPECT_EQ(e2m1_from_float(expected[c]), c) << "round trip " << c;
  }
}

TEST(FormatCodecs, E2m1RoundingTies) {
  struct Tie {
    float x;
    uint8_t code;
  };
  // tie -> code with the even mantissa bit
  const Tie ties[] = {{0.25f, 0x0}, {0.75f, 0x2}, {1.25f, 0x2}, {1.75f, 0x4},
                      {2.5f, 0x4},  {3.5f, 0x6},  {5.0f, 0x6}};
  for (const Tie& t : ties) {
    EXPECT_EQ(e2m1_from_float(t.x), t.code) << t.x;
    EXPECT_EQ(e2m1_from_float(-t.x), t.code | 0x8) << -t.x;
    // Just above a tie goes up, just below goes down.
    const uint8_t up = e2m1_from_float(std::nextafter(t.x, 100.0f));
    const uint8_t down = e2m1_from_float(std::nextafter(t.x, 0.0f));
    EXPECT_EQ(e2m1_to_float(up) > t.x, true) << "above " << t.x;
    EXPECT_EQ(e2m1_to_float(down) < t.x, true) << "below " << t.x;
  }
  EXPECT_EQ(e2m1_from_float(0.26f), 0x1);
  EXPECT_EQ(e2m1_from_float(0.74f), 0x1);
  EXPECT_EQ(e2m1_from_float(4.9f), 0x6);
  EXPECT_EQ(e2m1_from_float(5.1f), 0x7);
}

TEST(FormatCodecs, E2m1SaturationZeroAndNaN) {
  EXPECT_EQ(e2m1_from_float(6.0f), 0x7);
  EXPECT_EQ(e2m1_from_float(6.5f), 0x7);
  EXPECT_EQ(e2m1_from_float(1e30f), 0x7);
  EXPECT_EQ(e2m1_from_float(kInf), 0x7);
  EXPECT_EQ(e2m1_from_float(-7.0f), 0xF);
  EXPECT_EQ(e2m1_from_float(-kInf), 0xF);
  EXPECT_EQ(e2m1_from_float(0.0f), 0x0);
  EXPECT_EQ(e2m1_from_float(-0.0f), 0x8);
  EXPECT_EQ(e2m1_from_float(-0.1f), 0x8);
  EXPECT_EQ(e2m1_from_float(-0.25f), 0x8);
  EXPECT_EQ(e2m1_from_float(-1e-40f), 0x8);
  EXPECT_EQ(e2m1_from_float(0.1f), 0x0);
  EXPECT_EQ(e2m1_from_float(kNaN), 0x7);   // NaN -> +6
  EXPECT_EQ(e2m1_from_float(-kNaN), 0x7);
}

TEST(FormatCodecs, E2m1MatchesBruteForceNearest) {
  std::vector<double> mags;
  for (int c = 0; c < 8; ++c) mags.push_back(e2m1_to_float(static_cast<uint8_t>(c)));
  for (int i = -8000; i <= 8000; ++i) {
    const float x = static_cast<float>(i) / 1024.0f;  // step 2^-10 hits every tie exactly
    EXPECT_EQ(e2m1_from_float(x), brute_nearest(x, mags, 0x8)) << "x = " << x;
  }
}

// ---- ue8m0 -----------------------------------------------------------------------------------------

TEST(FormatCodecs, Ue8m0DecodeAndRoundTrip) {
  EXPECT_EQ(ue8m0_to_float(127), 1.0f);
  EXPECT_EQ(ue8m0_to_float(128), 2.0f);
  EXPECT_EQ(ue8m0_to_float(126), 0.5f);
  EXPECT_EQ(ue8m0_to_float(0), std::ldexp(1.0f, -127));
  EXPECT_EQ(ue8m0_to_float(254), std::ldexp(1.0f, 127));
  EXPECT_TRUE(std::isnan(ue8m0_to_float(255)));
  for (int c = 1; c < 255; ++c) {
    EXPECT_EQ(ue8m0_to_float(static_cast<uint8_t>(c)), std::ldexp(1.0f, c - 127)) << c;
    EXPECT_EQ(ue8m0_from_float(ue8m0_to_float(static_cast<uint8_t>(c))), c) << c;
  }
}

TEST(FormatCodecs, Ue8m0EncodeRoundsUp) {
  EXPECT_EQ(ue8m0_from_float(1.0f), 127);
  EXPECT_EQ(ue8m0_from_float(std::nextafter(1.0f, 2.0f)), 128);
  EXPECT_EQ(ue8m0_from_float(1.5f), 128);
  EXPECT_EQ(ue8m0_from_float(0.75f), 127);
  EXPECT_EQ(ue8m0_from_float(3.0f), 129);
  EXPECT_EQ(ue8m0_from_float(std::ldexp(1.0f, 127)), 254);
  EXPECT_EQ(ue8m0_from_float(std::numeric_limits<float>::max()), 254);  // saturates
  EXPECT_EQ(ue8m0_from_float(kInf), 254);
  EXPECT_EQ(ue8m0_from_float(kNaN), 255);
  EXPECT_EQ(ue8m0_from_float(0.0f), 0);
  EXPECT_EQ(ue8m0_from_float(-0.0f), 0);
  EXPECT_EQ(ue8m0_from_float(-4.0f), 0);
  EXPECT_EQ(ue8m0_from_float(std::numeric_limits<float>::min()), 1);  // 2^-126
  EXPECT_EQ(ue8m0_from_float(std::numeric_limits<float>::denorm_min()), 0);
}

// ---- bf16 ------------------------------------------------------------------------------------------

TEST(FormatCodecs, Bf16RoundToNearestEven) {
  EXPECT_EQ(bf16_from_float(1.0f), 0x3F80);
  EXPECT_EQ(bf16_from_float(-1.0f), 0xBF80);
  EXPECT_EQ(bf16_from_float(0.0f), 0x0000);
  EXPECT_EQ(bf16_from_float(-0.0f), 0x8000);
  // 1 + 2^-8 is halfway between 0x3F80 (even) and 0x3F81.
  EXPECT_EQ(bf16_from_float(float_of(0x3F808000u)), 0x3F80);
  EXPECT_EQ(bf16_from_float(float_of(0x3F808001u)), 0x3F81);
  EXPECT_EQ(bf16_from_float(float_of(0x3F807FFFu)), 0x3F80);
  // 0x3F818000 is halfway between 0x3F81 and 0x3F82 (even).
  EXPECT_EQ(bf16_from_float(float_of(0x3F818000u)), 0x3F82);
  EXPECT_EQ(bf16_from_float(float_of(0xBF818000u)), 0xBF82);
  // Overflow by rounding gives inf; inf stays inf.
  EXPECT_EQ(bf16_from_float(std::numeric_limits<float>::max()), 0x7F80);
  EXPECT_EQ(bf16_from_float(kInf), 0x7F80);
  EXPECT_EQ(bf16_from_float(-kInf), 0xFF80);
  // NaN stays NaN, also a NaN whose payload sits only in the low 16 bits.
  EXPECT_TRUE(std::isnan(bf16_to_float(bf16_from_float(kNaN))));
  EXPECT_TRUE(std::isnan(bf16_to_float(bf16_from_float(float_of(0x7F800001u)))));
  EXPECT_TRUE(std::isnan(bf16_to_float(bf16_from_float(float_of(0xFF800001u)))));
}

TEST(FormatCodecs, Bf16AllBitPatternsRoundTrip) {
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    const float f = bf16_to_float(static_cast<uint16_t>(b));
    EXPECT_EQ(bits_of(f), b << 16);
    if (!std::isnan(f)) {
      EXPECT_EQ(bf16_from_float(f), b) << b;
    }
  }
}

}  // namespace
}  // namespace fp4moe::format
