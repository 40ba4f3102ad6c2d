// tests/reference/dot_test.cpp — the reference GEMMs' dot product (reference/dot.hpp): the SIMD path
// gives the portable loop's bits, and the loop is the documented eight-lane order.
#include "reference/dot.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

namespace fp4moe::reference {
namespace {

uint64_t bits(double x) {
  uint64_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

// fp32 values over a wide range of magnitudes and both signs, as double: the additions round often,
// so a different order would show in the low bits.
std::vector<double> wide_values(std::mt19937& rng, int64_t n) {
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exp(-30, 30);
  std::vector<double> v(static_cast<size_t>(n));
  for (auto& x : v) x = static_cast<double>(std::ldexp(mant(rng), exp(rng)));
  return v;
}

TEST(ReferenceDot, SimdRowsEqualThePortableLoopBitForBit) {
  std::mt19937 rng(7);
  for (int64_t n : {0, 1, 7, 8, 9, 15, 16, 31, 64, 100, 1000, 4096}) {
    for (int64_t rows : {1, 3, 4, 5, 8, 13}) {
      const int64_t ldb = n + 3;  // rows not packed: the stride is honoured
      const std::vector<double> a = wide_values(rng, n), b = wide_values(rng, rows * ldb);
      std::vector<double> simd(static_cast<size_t>(rows), -1.0), portable(static_cast<size_t>(rows), -2.0);
      detail::dot_rows(a.data(), b.data(), ldb, rows, n, simd.data(), /*simd=*/true);
      detail::dot_rows(a.data(), b.data(), ldb, rows, n, portable.data(), /*simd=*/false);
      for (int64_t r = 0; r < rows; ++r)
        ASSERT_EQ(bits(simd[r]), bits(portable[r])) << "n=" << n << " rows=" << rows << " r=" << r;
    }
  }
}

TEST(ReferenceDot, IsTheEightLaneSumInItsDocumentedOrder) {
  std::mt19937 rng(11);
  for (int64_t n : {0, 5, 8, 24, 37, 1024}) {
    const std::vector<double> a = wide_values(rng, n), b = wide_values(rng, n);
    double lane[8] = {};
    for (int64_t i = 0; i < n; ++i) lane[i % 8] = lane[i % 8] + a[i] * b[i];
    const double want = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    EXPECT_EQ(bits(detail::dot(a.data(), b.data(), n)), bits(want)) << "n=" << n;
  }
}

}  // namespace
}  // namespace fp4moe::reference
