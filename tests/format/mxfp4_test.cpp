// tests/format/mxfp4_test.cpp — MXFP4 dequantization and quantization (docs/numerics.md, "MXFP4 weights"):
// every ue8m0 code with every e2m1 code against q * 2^(c - 127) computed in double, the nibble order,
// quantization of exactly representable values back to their codes, the round-up block scale, NaN
// codes and argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "error_message.hpp"
#include "fp4moe/format.hpp"

namespace fp4moe::format {
namespace {

constexpr double kE2m1[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};

double e2m1_value(int code) { return (code & 8) ? -kE2m1[code & 7] : kE2m1[code & 7]; }

TEST(Mxfp4, DequantizeIsQTimesTwoToTheCodeMinus127ForEveryCode) {
  // One row per ue8m0 code 0..254; the row's 32 elements run through the 16 e2m1 codes twice, in the
  // low nibble for even and the high nibble for odd elements.
  const int64_t rows = 255, cols = 64;
  std::vector<uint8_t> packed(rows * cols / 2), scales(rows * cols / 32);
  for (int64_t r = 0; r < rows; ++r) {
    scales[r * 2] = static_cast<uint8_t>(r);
    scales[r * 2 + 1] = static_cast<uint8_t>(254 - r);
    for (int64_t j = 0; j < cols / 2; ++j)
      packed[r * cols / 2 + j] = static_cast<uint8_t>((j % 16) | (((j + 5) % 16) << 4));
  }
  std::vector<float> out(rows * cols);
  dequantize_mxfp4(packed.data(), scales.data(), rows, cols, out.data());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < cols; ++i) {
      const int64_t j = i / 2;
      const int code = (i % 2 == 0) ? int(j % 16) : int((j + 5) % 16);
      const int c = i < 32 ? int(r) : int(254 - r);
      const double want = e2m1_value(code) * std::ldexp(1.0, c - 127);
      // Above fp32's range (c = 254, |q| >= 2) the fp32 product is +-inf, as the value must round.
      const float want_f = std::fabs(want) > double(std::numeric_limits<float>::max())
                               ? std::copysign(std::numeric_limits<float>::infinity(), float(want))
                               : static_cast<float>(want);
      ASSERT_EQ(static_cast<double>(want_f) == want || std::isinf(want_f), true) << "not exact: code " << c;
      ASSERT_EQ(out[r * cols + i], want_f) << "row " << r << " element " << i << " scale code " << c;
      ASSERT_EQ(std::signbit(out[r * cols + i]), (code & 8) != 0) << "sign of zero, row " << r << " element " << i;
    }
}

TEST(Mxfp4, NanCodeDecodesToNanAndIsFound) {
  std::vector<uint8_t> packed(16, 0x22), scales = {kUe8m0Nan};
  std::vector<float> out(32);
  dequantize_mxfp4(packed.data(), scales.data(), 1, 32, out.data());
  for (float v : out) EXPECT_TRUE(std::isnan(v));
  const std::vector<uint8_t> codes = {0, 127, 254, 255, 255};
  EXPECT_EQ(find_ue8m0_nan(codes.data(), 5), 3);
  EXPECT_EQ(find_ue8m0_nan(codes.data(), 3), -1);
}

TEST(Mxfp4, QuantizeRecoversExactValuesAndRoundsTheScaleUp) {
  std::mt19937 rng(3);
  const int64_t rows = 40, cols = 96;
  std::vector<uint8_t> codes(rows * cols), want_scales(rows * cols / 32);
  std::vector<float> x(rows * cols);
  for (int64_t b = 0; b < rows * cols / 32; ++b) {
    const int c = 1 + int(rng() % 250);
    want_scales[b] = static_cast<uint8_t>(c);
    for (int i = 0; i < 32; ++i) {
      // Element 0 of each block holds +-6 (so the block's amax / 6 is the scale itself).
      const int code = i == 0 ? (7 | (rng() % 2 ? 8 : 0)) : int(rng() % 16);
      codes[b * 32 + i] = static_cast<uint8_t>(code);
      x[b * 32 + i] = static_cast<float>(e2m1_value(code) * std::ldexp(1.0, c - 127));
    }
  }
  std::vector<uint8_t> packed(rows * cols / 2), scales(rows * cols / 32);
  quantize_mxfp4(x.data(), rows, cols, packed.data(), scales.data());
  EXPECT_EQ(scales, want_scales);
  for (int64_t i = 0; i < rows * cols; ++i) {
    const int got = (packed[i / 2] >> (4 * (i % 2))) & 0xF;
    ASSERT_EQ(got, codes[i]) << "element " << i;
  }
  std::vector<float> back(rows * cols);
  dequantize_mxfp4(packed.data(), scales.data(), rows, cols, back.data());
  for (int64_t i = 0; i < rows * cols; ++i) ASSERT_EQ(back[i], x[i]) << "element " << i;

  // amax = 5: 5 / 6 rounds up to the scale 1 (code 127), 5 itself rounds to 4 (tie to even).
  std::vector<float> y(32, 0.0f);
  y[3] = -5.0f;
  y[4] = 0.7f;  // 0.7 -> 0.5
  quantize_mxfp4(y.data(), 1, 32, packed.data(), scales.data());
  EXPECT_EQ(scales[0], 127);
  EXPECT_EQ((packed[1] >> 4) & 0xF, 0x8 | 6);  // -4
  EXPECT_EQ(packed[2] & 0xF, 1);               // 0.5
  // An all-zero block: code 0, zero codes.
  std::vector<float> z(32, 0.0f);
  quantize_mxfp4(z.data(), 1, 32, packed.data(), scales.data());
  EXPECT_EQ(scales[0], 0);
  for (int j = 0; j < 16; ++j) EXPECT_EQ(packed[j], 0);
  // A NaN element: the NaN code.
  z[9] = std::numeric_limits<float>::quiet_NaN();
  quantize_mxfp4(z.data(), 1, 32, packed.data(), scales.data());
  EXPECT_EQ(scales[0], kUe8m0Nan);
}

TEST(Mxfp4, ArgumentErrors) {
  std::vector<uint8_t> packed(16), scales(1);
  std::vector<float> out(48);
  expect_error([&] { dequantize_mxfp4(packed.data(), scales.data(), 1, 48, out.data()); },
               "cols must be a non-negative multiple of 32");
  expect_error([&] { quantize_mxfp4(out.data(), 1, 16, packed.data(), scales.data()); },
               "cols must be a non-negative multiple of 32");
  expect_error([&] { dequantize_mxfp4(nullptr, scales.data(), 1, 32, out.data()); }, "must be non-null");
  dequantize_mxfp4(nullptr, nullptr, 0, 32, nullptr);  // empty: nothing to read
}

}  // namespace
}  // namespace fp4moe::format
