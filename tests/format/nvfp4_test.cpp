// tests/format/nvfp4_test.cpp — NVFP4 block quantization (docs/numerics.md, "Formats and block quantization") on hand-computed vectors:
// identity scale, a tie-exercising block, an all-zero block, a block whose scale saturates at 448,
// NaN/inf blocks, dequantization, argument errors, and a randomized cross-check against the formula
// evaluated step by step with brute-force codecs.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "error_message.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/format.hpp"

namespace fp4moe::format {
namespace {

using ::testing::HasSubstr;

struct Quantized {
  std::vector<uint8_t> packed, scales;
};

Quantized quantize(const std::vector<float>& x, int64_t rows, float s) {
  const int64_t cols = static_cast<int64_t>(x.size()) / rows;
  Quantized q{std::vector<uint8_t>(rows * cols / 2, 0xEE), std::vector<uint8_t>(rows * cols / 16, 0xEE)};
  quantize_nvfp4(x.data(), rows, cols, s, q.packed.data(), q.scales.data());
  return q;
}

std::vector<uint8_t> pack(const std::vector<uint8_t>& codes) {
  std::vector<uint8_t> out(codes.size() / 2);
  for (size_t j = 0; j < out.size(); ++j) out[j] = static_cast<uint8_t>(codes[2 * j] | (codes[2 * j + 1] << 4));
  return out;
}

TEST(FormatNvfp4, IdentityScaleBlock) {
  // amax 6, s 1: sf = e4m3(6 * fp32(1/6)) = e4m3(1.0) = 0x38, osc = 1, q = e2m1(x).
  const std::vector<float> x = {6, -3, 1.5f, 0.25f, 0.75f, -0.75f, 2.5f, 5, 0, -0.0f, 1, -6, 4, 3.5f, -1.25f, 1.75f};
  const Quantized q = quantize(x, 1, 1.0f);
  EXPECT_EQ(q.scales, (std::vector<uint8_t>{0x38}));
  EXPECT_EQ(q.packed, (std::vector<uint8_t>{0xD7, 0x03, 0xA2, 0x64, 0x80, 0xF2, 0x66, 0x4A}));
  std::vector<float> deq(16);
  dequantize_nvfp4(q.packed.data(), q.scales.data(), 1, 16, deq.data());
  const std::vector<float> expected = {6, -3, 1.5f, 0, 1, -1, 2, 4, 0, -0.0f, 1, -6, 4, 4, -1, 2};
  EXPECT_EQ(deq, expected);
  EXPECT_TRUE(std::signbit(deq[9]));
}

TEST(FormatNvfp4, TiesWithHalfScale) {
  // amax 3, s 1: 3 * fp32(1/6) rounds to 0.5 in fp32 -> sf = 0x30 (0.5); osc = 1 / 0.5 = 2.
  // x * 2 lands exactly on the e2m1 ties 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 (both signs).
  const std::vector<float> x = {3,     -3,     0.125f,  0.375f,  0.625f,  0.875f,  1.25f,  1.75f,
                                2.5f,  -0.125f, -0.375f, -0.625f, -0.875f, -1.25f, -1.75f, -2.5f};
  const Quantized q = quantize(x, 1, 1.0f);
  EXPECT_EQ(q.scales, (std::vector<uint8_t>{0x30}));
  const std::vector<uint8_t> codes = {0x7, 0xF, 0x0, 0x2, 0x2, 0x4, 0x4, 0x6,
                                      0x6, 0x8, 0xA, 0xA, 0xC, 0xC, 0xE, 0xE};
  EXPECT_EQ(q.packed, pack(codes));
  std::vector<float> deq(16);
  dequantize_nvfp4(q.packed.data(), q.scales.data(), 1, 16, deq.data());
  for (int i = 0; i < 16; ++i) EXPECT_EQ(deq[i], e2m1_to_float(codes[i]) * 0.5f) << i;
}

TEST(FormatNvfp4, AllZeroBlockAndSecondBlock) {
  // Block 0 all +0: sf = 0, osc = 0, every q = 0. Block 1 uses a non-unit input scale:
  // s = 2 -> gs = 0.5; amax 24 -> 24 * fp32(1/6) = 4 (fp32), 0.5 * 4 = 2 -> sf 0x40 (2.0);
  // osc = 1 / (2 * (1 / 0.5)) = 0.25; q = e2m1(x / 4).
  std::vector<float> x(32, 0.0f);
  const float b1[16] = {24, -24, 1, -1, 2, 4, 6, 8, 10, 12, 14, -14, 20, 22, -7, 0.5f};
  for (int i = 0; i < 16; ++i) x[16 + i] = b1[i];
  const Quantized q = quantize(x, 1, 2.0f);
  EXPECT_EQ(q.scales, (std::vector<uint8_t>{0x00, 0x40}));
  // x/4: 6,-6,0.25,-0.25,0.5,1,1.5,2,2.5,3,3.5,-3.5,5,5.5,-1.75,0.125
  const std::vector<uint8_t> codes1 = {0x7, 0xF, 0x0, 0x8, 0x1, 0x2, 0x3, 0x4,
                                       0x4, 0x5, 0x6, 0xE, 0x6, 0x7, 0xC, 0x0};
  std::vector<uint8_t> codes(16, 0x0);
  codes.insert(codes.end(), codes1.begin(), codes1.end());
  EXPECT_EQ(q.packed, pack(codes));
  std::vector<float> deq(32);
  dequantize_nvfp4(q.packed.data(), q.scales.data(), 1, 32, deq.data());
  for (int i = 0; i < 16; ++i) EXPECT_EQ(deq[i], 0.0f) << i;
  for (int i = 0; i < 16; ++i) EXPECT_EQ(deq[16 + i], e2m1_to_float(codes1[i]) * 2.0f) << i;
}

TEST(FormatNvfp4, ZeroScaleKeepsNegativeZero) {
  // A block of tiny values whose scale underflows to 0: osc = 0, x * 0 keeps the sign -> 0x8.
  std::vector<float> x(16, 1e-30f);
  x[1] = -1e-30f;
  x[2] = -0.0f;
  const Quantized q = quantize(x, 1, 1.0f);
  EXPECT_EQ(q.scales[0], 0x00);
  std::vector<uint8_t> codes(16, 0x0);
  codes[1] = 0x8;
  codes[2] = 0x8;
  EXPECT_EQ(q.packed, pack(codes));
}

TEST(FormatNvfp4, ScaleSaturatesAt448) {
  // s = 2^-10 -> gs = 1024; amax 6000 -> 6000 * fp32(1/6) = 1000 (fp32), 1024 * 1000 >> 448 ->
  // sf = 0x7E (448). osc = 1 / (448 * 2^-10) = fp32(1 / 0.4375) = 2.2857144.
  const float s = std::ldexp(1.0f, -10);
  const std::vector<float> x = {6000, -6000, 1, -1, 0.5f, 2, -2.2f, 0.1f,
                                -0.1f, 1.5f, 2.7f, 0, 100, -0.3f, 0.8f, 3000};
  const Quantized q = quantize(x, 1, s);
  EXPECT_EQ(q.scales, (std::vector<uint8_t>{0x7E}));
  // x * 2.2857: 13714 -13714 2.29 -2.29 1.14 4.57 -5.03 0.23 -0.23 3.43 6.17 0 228.6 -0.69 1.83 6857
  const std::vector<uint8_t> codes = {0x7, 0xF, 0x4, 0xC, 0x2, 0x6, 0xF, 0x0,
                                      0x8, 0x5, 0x7, 0x0, 0x7, 0x9, 0x4, 0x7};
  EXPECT_EQ(q.packed, pack(codes));
  std::vector<float> deq(16);
  dequantize_nvfp4(q.packed.data(), q.scales.data(), 1, 16, deq.data());
  for (int i = 0; i < 16; ++i) EXPECT_EQ(deq[i], e2m1_to_float(codes[i]) * 448.0f) << i;
  EXPECT_EQ(deq[0], 2688.0f);
}

TEST(FormatNvfp4, NonFiniteElementsStayInTheirBlock) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  // Row 0: block 0 has a NaN (amax NaN -> sf 0x7F, all q 0x7); block 1 is ordinary.
  // Row 1: block 0 has +inf (amax inf -> sf 0x7E); block 1 has a NaN in its last element.
  std::vector<float> x(64, 1.0f);
  x[5] = nan;
  x[32] = inf;
  x[33] = -1.0f;
  x[63] = nan;
  const Quantized q = quantize(x, 2, 1.0f);
  EXPECT_EQ(q.scales, (std::vector<uint8_t>{0x7F, e4m3_from_float(1.0f * (1.0f / 6.0f)), 0x7E, 0x7F}));
  for (int j = 0; j < 8; ++j) EXPECT_EQ(q.packed[j], 0x77) << j;
  // Block 1 of row 0: amax 1 -> sf = e4m3(0.16666667) = 0x23 (0.171875), osc = 5.818 -> 1 * osc -> 6.
  EXPECT_EQ(q.scales[1], 0x23);
  for (int j = 8; j < 16; ++j) EXPECT_EQ(q.packed[j], 0x77) << j;
  // Row 1 block 0: osc = 1/448; inf -> 0x7 (saturated), -1/448 -> 0x8, 1/448 -> 0x0.
  EXPECT_EQ(q.packed[16], 0x87);
  for (int j = 17; j < 24; ++j) EXPECT_EQ(q.packed[j], 0x00) << j;
  for (int j = 24; j < 32; ++j) EXPECT_EQ(q.packed[j], 0x77) << j;
  std::vector<float> deq(64);
  dequantize_nvfp4(q.packed.data(), q.scales.data(), 2, 32, deq.data());
  for (int i = 0; i < 16; ++i) EXPECT_TRUE(std::isnan(deq[i])) << i;
  EXPECT_EQ(deq[16], 6.0f * 0.171875f);
  EXPECT_EQ(deq[32], 6.0f * 448.0f);
}

// Independent step-by-step evaluation of docs/numerics.md, "Formats and block quantization" with brute-force nearest codecs.
uint8_t nearest_code(float v, int ncodes, float (*decode)(uint8_t), uint8_t sign_bit) {
  const double a = std::fabs(static_cast<double>(v));
  int best = 0;
  for (int c = 1; c < ncodes; ++c) {
    const double d = std::fabs(a - decode(static_cast<uint8_t>(c)));
    const double bd = std::fabs(a - decode(static_cast<uint8_t>(best)));
    if (d < bd || (d == bd && c % 2 == 0)) best = c;
  }
  return static_cast<uint8_t>((std::signbit(v) ? sign_bit : 0) | best);
}

TEST(FormatNvfp4, RandomRowsMatchStepByStepFormula) {
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> log_mag(-6.0f, 6.0f);
  const int64_t rows = 7, cols = 96;
  for (float s : {1.0f, 0.37f, 3.0e-3f, 17.5f}) {
    std::vector<float> x(rows * cols);
    for (auto& v : x) v = normal(rng) * std::exp2(log_mag(rng));
    const Quantized q = quantize(x, rows, s);
    const float gs = 1.0f / s;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < cols / 16; ++b) {
        float amax = 0.0f;
        for (int i = 0; i < 16; ++i) amax = std::max(amax, std::fabs(x[r * cols + b * 16 + i]));
        const float t1 = amax * (1.0f / 6.0f);
        const float t2 = gs * t1;
        const uint8_t sf = t2 > 448.0f ? 0x7E : nearest_code(t2, 0x7F, e4m3_to_float, 0x80);
        ASSERT_EQ(q.scales[r * (cols / 16) + b], sf) << "row " << r << " block " << b << " s " << s;
        const float inv_gs = 1.0f / gs;
        const float denom = e4m3_to_float(sf) * inv_gs;
        const float osc = sf == 0 ? 0.0f : 1.0f / denom;
        for (int i = 0; i < 16; ++i) {
          const int64_t c = b * 16 + i;
          const float v = x[r * cols + c] * osc;
          const uint8_t code = std::fabs(v) > 6.0f ? ((std::signbit(v) ? 0x8 : 0) | 0x7)
                                                   : nearest_code(v, 8, e2m1_to_float, 0x8);
          const uint8_t byte = q.packed[r * (cols / 2) + c / 2];
          ASSERT_EQ(c % 2 ? byte >> 4 : byte & 0xF, code) << "row " << r << " col " << c;
        }
      }
  }
}

TEST(FormatNvfp4, ScaleUsesFp32SixthAndMultiplicationOrder) {
  // amax = 0x1.c7fffep+1 (3.5624998), s = 1: amax * fp32(1/6) rounds to exactly 0.59375, the e4m3 tie
  // between 0.5625 (0x31) and 0.625 (0x32) -> 0x32. An exact amax / 6 = 0.59374994 would give 0x31.
  std::vector<float> x(16, 0.0f);
  x[3] = 0x1.c7fffep+1f;
  EXPECT_EQ(quantize(x, 1, 1.0f).scales[0], 0x32);
  EXPECT_EQ(nvfp4_block_scale(0x1.c7fffep+1f, 1.0f), 0x32);
  // s = 0.1f -> gs = 1 / 0.1f = 10 (fp32); amax = 0x1.299998p+0 (1.1624999):
  //   gs * (amax * fp32(1/6)) = 1.9375 exactly, the tie 1.875 (0x3F) | 2 (0x40) -> 0x40, whereas
  //   (gs * amax) * fp32(1/6) = 1.9374999 -> 0x3F and gs * (amax / 6) -> 0x3F.
  ASSERT_EQ(1.0f / 0.1f, 10.0f);
  x[3] = -0x1.299998p+0f;
  EXPECT_EQ(quantize(x, 1, 0.1f).scales[0], 0x40);
  EXPECT_EQ(nvfp4_block_scale(0x1.299998p+0f, 10.0f), 0x40);
}

TEST(FormatNvfp4, BlockScaleHelper) {
  EXPECT_EQ(nvfp4_block_scale(6.0f, 1.0f), 0x38);
  EXPECT_EQ(nvfp4_block_scale(0.0f, 1.0f), 0x00);
  EXPECT_EQ(nvfp4_block_scale(6000.0f, 1024.0f), 0x7E);
  EXPECT_EQ(nvfp4_block_scale(std::numeric_limits<float>::quiet_NaN(), 1.0f), 0x7F);
  EXPECT_EQ(nvfp4_block_scale(24.0f, 0.5f), 0x40);
}

TEST(FormatNvfp4, EmptyInputsAreValid) {
  EXPECT_NO_THROW(quantize_nvfp4(nullptr, 0, 32, 1.0f, nullptr, nullptr));
  EXPECT_NO_THROW(quantize_nvfp4(nullptr, 3, 0, 1.0f, nullptr, nullptr));
  EXPECT_NO_THROW(dequantize_nvfp4(nullptr, nullptr, 0, 16, nullptr));
}

TEST(FormatNvfp4, ArgumentErrorsNameTheArgument) {
  std::vector<float> x(32, 1.0f);
  std::vector<uint8_t> p(16), sc(2);
  auto q = [&](int64_t rows, int64_t cols, float s) {
    return error_of([&] { quantize_nvfp4(x.data(), rows, cols, s, p.data(), sc.data()); });
  };
  EXPECT_THAT(q(1, 24, 1.0f), HasSubstr("cols must be a non-negative multiple of 16, got 24"));
  EXPECT_THAT(q(-1, 32, 1.0f), HasSubstr("rows must be >= 0, got -1"));
  EXPECT_THAT(q(1, 32, 0.0f), HasSubstr("input_scale must be finite and > 0, got 0"));
  EXPECT_THAT(q(1, 32, -2.0f), HasSubstr("input_scale must be finite and > 0, got -2"));
  EXPECT_THAT(q(1, 32, std::numeric_limits<float>::quiet_NaN()), HasSubstr("input_scale"));
  EXPECT_THAT(q(1, 32, std::numeric_limits<float>::infinity()), HasSubstr("input_scale"));
  EXPECT_THAT(q(1, 32, std::numeric_limits<float>::denorm_min()), HasSubstr("finite reciprocal"));
  EXPECT_THAT(error_of([&] { dequantize_nvfp4(p.data(), sc.data(), 1, 17, x.data()); }),
              HasSubstr("dequantize_nvfp4: cols"));
  EXPECT_THAT(error_of([&] { quantize_nvfp4(nullptr, 1, 32, 1.0f, p.data(), sc.data()); }),
              HasSubstr("non-null"));
}

}  // namespace
}  // namespace fp4moe::format
