// tests/format/scale_layout_test.cpp — 128x4-swizzled scale layout: offsets against the formula
// (computed here independently, atom by atom), size, linear -> swizzled -> linear round trip, zero
// padding, bijectivity, and argument errors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "fp4moe/error.hpp"
#include "fp4moe/format.hpp"

namespace fp4moe::format {
namespace {

using ::testing::HasSubstr;

// Independent formulation: an atom is 128 rows x 4 columns = 512 bytes; inside it, the 32-row
// sub-tile index (m % 128) / 32 picks a 4-byte group inside a 16-byte row of the 32 x 16 atom.
int64_t expected_offset(int64_t b, int64_t m, int64_t k, int64_t rows, int64_t cols) {
  const int64_t padded_rows = (rows + 127) / 128 * 128;
  const int64_t padded_cols = (cols + 3) / 4 * 4;
  const int64_t batch_bytes = padded_rows * padded_cols;
  const int64_t atoms_per_row_tile = padded_cols / 4;
  const int64_t row_tile = m / 128, col_tile = k / 4;
  const int64_t atom = row_tile * atoms_per_row_tile + col_tile;
  const int64_t r = m % 128, c = k % 4;
  const int64_t inner = (r % 32) * 16 + (r / 32) * 4 + c;
  return b * batch_bytes + atom * 512 + inner;
}

struct Shape {
  int64_t rows, cols;
};

std::vector<Shape> shapes() {
  std::vector<Shape> out;
  for (int64_t m : {1, 127, 128, 129, 300})
    for (int64_t k : {1, 3, 4, 5, 9}) out.push_back({m, k});
  return out;
}

TEST(FormatScaleLayout, SizeIsPaddedTiles) {
  EXPECT_EQ(swizzled_scales_size(1, 1, 1), 512);
  EXPECT_EQ(swizzled_scales_size(1, 128, 4), 512);
  EXPECT_EQ(swizzled_scales_size(1, 129, 4), 1024);
  EXPECT_EQ(swizzled_scales_size(1, 300, 9), 384 * 12);
  EXPECT_EQ(swizzled_scales_size(2, 300, 9), 2 * 384 * 12);
  EXPECT_EQ(swizzled_scales_size(0, 300, 9), 0);
  EXPECT_EQ(swizzled_scales_size(3, 0, 9), 0);
  EXPECT_EQ(swizzled_scales_size(3, 5, 0), 0);
}

TEST(FormatScaleLayout, OffsetsMatchFormula) {
  for (const Shape& s : shapes())
    for (int64_t batches : {1, 2}) {
      const int64_t size = swizzled_scales_size(batches, s.rows, s.cols);
      EXPECT_EQ(size, batches * ((s.rows + 127) / 128) * 128 * ((s.cols + 3) / 4) * 4);
      std::set<int64_t> seen;
      for (int64_t b = 0; b < batches; ++b)
        for (int64_t m = 0; m < s.rows; ++m)
          for (int64_t k = 0; k < s.cols; ++k) {
            const int64_t off = swizzled_scale_offset(b, m, k, s.rows, s.cols);
            ASSERT_EQ(off, expected_offset(b, m, k, s.rows, s.cols))
                << "b " << b << " m " << m << " k " << k << " rows " << s.rows << " cols " << s.cols;
            ASSERT_GE(off, 0);
            ASSERT_LT(off, size);
            ASSERT_TRUE(seen.insert(off).second) << "offset used twice: " << off;
          }
    }
}

TEST(FormatScaleLayout, KnownOffsets) {
  // rows 300, cols 9: Kt = 3, atoms of 512 bytes; batch stride 3 * 3 * 512.
  EXPECT_EQ(swizzled_scale_offset(0, 0, 0, 300, 9), 0);
  EXPECT_EQ(swizzled_scale_offset(0, 1, 0, 300, 9), 16);
  EXPECT_EQ(swizzled_scale_offset(0, 32, 0, 300, 9), 4);
  EXPECT_EQ(swizzled_scale_offset(0, 33, 3, 300, 9), 16 + 4 + 3);
  EXPECT_EQ(swizzled_scale_offset(0, 127, 3, 300, 9), 31 * 16 + 3 * 4 + 3);
  EXPECT_EQ(swizzled_scale_offset(0, 0, 4, 300, 9), 512);
  EXPECT_EQ(swizzled_scale_offset(0, 0, 8, 300, 9), 1024);
  EXPECT_EQ(swizzled_scale_offset(0, 128, 0, 300, 9), 3 * 512);
  EXPECT_EQ(swizzled_scale_offset(1, 0, 0, 300, 9), 9 * 512);
  EXPECT_EQ(swizzled_scale_offset(1, 299, 8, 300, 9),
            9 * 512 + 2 * 3 * 512 + 2 * 512 + (299 % 32) * 16 + ((299 % 128) / 32) * 4 + 0);
}

TEST(FormatScaleLayout, RoundTripAndZeroPadding) {
  for (const Shape& s : shapes())
    for (int64_t batches : {1, 2}) {
      const int64_t n = batches * s.rows * s.cols;
      std::vector<uint8_t> linear(n);
      for (int64_t i = 0; i < n; ++i) linear[i] = static_cast<uint8_t>(1 + (i * 37) % 255);  // never 0
      const int64_t size = swizzled_scales_size(batches, s.rows, s.cols);
      std::vector<uint8_t> sw(size, 0xCD);  // poisoned: padding must be overwritten with zeros
      scales_linear_to_swizzled(linear.data(), batches, s.rows, s.cols, sw.data());
      std::vector<bool> is_data(size, false);
      for (int64_t b = 0; b < batches; ++b)
        for (int64_t m = 0; m < s.rows; ++m)
          for (int64_t k = 0; k < s.cols; ++k) {
            const int64_t off = expected_offset(b, m, k, s.rows, s.cols);
            is_data[off] = true;
            ASSERT_EQ(sw[off], linear[(b * s.rows + m) * s.cols + k]);
          }
      int64_t padding = 0;
      for (int64_t i = 0; i < size; ++i)
        if (!is_data[i]) {
          ++padding;
          ASSERT_EQ(sw[i], 0) << "padding byte " << i << " rows " << s.rows << " cols " << s.cols;
        }
      EXPECT_EQ(padding, size - n);
      std::vector<uint8_t> back(n, 0);
      scales_swizzled_to_linear(sw.data(), batches, s.rows, s.cols, back.data());
      EXPECT_EQ(back, linear) << "rows " << s.rows << " cols " << s.cols << " batches " << batches;
    }
}

TEST(FormatScaleLayout, ArgumentErrors) {
  auto err = [](auto fn) -> std::string {
    try {
      fn();
    } catch (const Error& e) {
      return e.what();
    }
    return "<no error>";
  };
  EXPECT_THAT(err([] { swizzled_scale_offset(0, 5, 0, 5, 4); }), HasSubstr("row m must be in [0, 5), got 5"));
  EXPECT_THAT(err([] { swizzled_scale_offset(0, 0, 4, 5, 4); }),
              HasSubstr("scale column k must be in [0, 4), got 4"));
  EXPECT_THAT(err([] { swizzled_scale_offset(-1, 0, 0, 5, 4); }), HasSubstr("batch index b"));
  EXPECT_THAT(err([] { swizzled_scales_size(-1, 5, 4); }), HasSubstr("batches must be >= 0, got -1"));
  EXPECT_THAT(err([] { swizzled_scales_size(1, -5, 4); }), HasSubstr("rows must be >= 0, got -5"));
  EXPECT_THAT(err([] { swizzled_scales_size(1, 5, -4); }), HasSubstr("scale_cols must be >= 0, got -4"));
  EXPECT_NO_THROW(scales_linear_to_swizzled(nullptr, 0, 5, 4, nullptr));
  EXPECT_NO_THROW(scales_swizzled_to_linear(nullptr, 1, 0, 4, nullptr));
}

}  // namespace
}  // namespace fp4moe::format
