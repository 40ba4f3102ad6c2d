// tests/runner/output_match.hpp — the layer's output against another computation of it (the CPU
// reference, or the single-GPU layer) by the tolerance of docs/numerics.md, "The whole layer": no NaN
// where the other has none, at least 99.5% of elements within one bf16 ulp plus 1e-3 of their token
// row's RMS, relative L2 error below 5e-3.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "fp4moe/format.hpp"

namespace fp4moe::test {

inline float bf16_ulp(float x) {
  const float a = std::fabs(x);
  if (a < 1e-30f) return 1e-30f;
  int exp = 0;
  std::frexp(a, &exp);  // a = m * 2^exp, m in [0.5, 1)
  return std::ldexp(1.0f, exp - 8);
}

// The output rows of T tokens against the reference's (bf16 bits), by the tolerance above.
inline void expect_output_matches(const std::vector<uint16_t>& gpu, const std::vector<uint16_t>& ref, int64_t T, int64_t H,
                           const std::string& label) {
  ASSERT_EQ(gpu.size(), ref.size());
  double num = 0, den = 0;
  int64_t off = 0;
  for (int64_t t = 0; t < T; ++t) {
    double row_sq = 0;
    for (int64_t h = 0; h < H; ++h) row_sq += std::pow(format::bf16_to_float(ref[t * H + h]), 2.0);
    // Absolute floor: results that nearly cancel move by more than their own ulp when a rounding of
    // the activation flips; 1e-3 of the row's RMS covers that (docs/numerics.md).
    const float floor = 1e-3f * static_cast<float>(std::sqrt(row_sq / H));
    for (int64_t h = 0; h < H; ++h) {
      const size_t i = t * H + h;
      const float r = format::bf16_to_float(ref[i]), g = format::bf16_to_float(gpu[i]);
      ASSERT_FALSE(std::isnan(g) && !std::isnan(r)) << label << " NaN at " << i;
      num += double(g - r) * (g - r);
      den += double(r) * r;
      if (std::fabs(g - r) > bf16_ulp(r) * 1.01f + floor) ++off;
    }
  }
  const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  EXPECT_LT(rel, 5e-3) << label;
  EXPECT_LE(off, static_cast<int64_t>(0.005 * ref.size()) + 1) << label << ": " << off << " of " << ref.size()
                                                               << " beyond 1 ulp + 1e-3 row RMS";
}

}  // namespace fp4moe::test
