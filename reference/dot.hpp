// reference/dot.hpp — the dot product of the CPU reference's GEMMs (reference/moe.cpp, steps 4 and 6).
//
// The sum of a[i] * b[i] in double: the operands are fp32 values held as double, so every product is
// exact and only the additions round. Eight accumulators, lane j taking i = j mod 8, combined as
// ((0+1)+(2+3))+((4+5)+(6+7)). That order is part of the reference (docs/numerics.md: it matters only
// below double precision, before the caller's single rounding to fp32).
#pragma once

#include <cstdint>

namespace fp4moe::reference::detail {

inline double dot(const double* a, const double* b, int64_t n) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  for (; i < n; ++i) acc[i % 8] += a[i] * b[i];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// out[r] = dot(a, b + r * ldb, n) for r in [0, rows). simd: with AVX2 where the CPU has it (four rows
// of b at a time); false: the portable loop. Both give the same bits.
void dot_rows(const double* a, const double* b, int64_t ldb, int64_t rows, int64_t n, double* out,
              bool simd = true);

}  // namespace fp4moe::reference::detail
