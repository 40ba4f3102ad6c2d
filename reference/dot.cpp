// reference/dot.cpp — dot_rows of reference/dot.hpp: four dots at a time with AVX2 where the CPU has it.
#include "reference/dot.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define FP4MOE_REFERENCE_AVX2 1
#include <immintrin.h>
#endif

namespace fp4moe::reference::detail {
namespace {

#ifdef FP4MOE_REFERENCE_AVX2
// dot() of a with rows b, b + ldb, b + 2 ldb, b + 3 ldb: lanes 0-3 and 4-7 of each dot's eight
// accumulators are two 4-wide registers, the tail and the reduction are dot()'s.
// NOTE: target avx2 without fma: a separate multiply and add per lane, each rounded as in dot(), so the
// sums are bit-identical to the portable loop (-ffp-contract=off keeps the compiler from fusing).
__attribute__((target("avx2"))) void dot4_avx2(const double* a, const double* b, int64_t ldb, int64_t n,
                                                 double* out) {
  __m256d lo[4], hi[4];
  for (int r = 0; r < 4; ++r) lo[r] = hi[r] = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256d a_lo = _mm256_loadu_pd(a + i), a_hi = _mm256_loadu_pd(a + i + 4);
    for (int r = 0; r < 4; ++r) {
      lo[r] = _mm256_add_pd(lo[r], _mm256_mul_pd(a_lo, _mm256_loadu_pd(b + r * ldb + i)));
      hi[r] = _mm256_add_pd(hi[r], _mm256_mul_pd(a_hi, _mm256_loadu_pd(b + r * ldb + i + 4)));
    }
  }
  for (int r = 0; r < 4; ++r) {
    double acc[8];
    _mm256_storeu_pd(acc, lo[r]);
    _mm256_storeu_pd(acc + 4, hi[r]);
    const double* br = b + r * ldb;
    for (int64_t t = i; t < n; ++t) acc[t % 8] += a[t] * br[t];
    out[r] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  }
}

// NOTE: __builtin_cpu_init first: the CPU features may be asked during static initialisation of another
// translation unit, before libgcc's own constructor has filled them in.
bool have_avx2() {
  static const bool have = (__builtin_cpu_init(), __builtin_cpu_supports("avx2"));
  return have;
}
#endif

}  // namespace

void dot_rows(const double* a, const double* b, int64_t ldb, int64_t rows, int64_t n, double* out, bool simd) {
  int64_t r = 0;
#ifdef FP4MOE_REFERENCE_AVX2
  if (simd && have_avx2())
    for (; r + 4 <= rows; r += 4) dot4_avx2(a, b + r * ldb, ldb, n, out + r);
#else
  (void)simd;
#endif
  for (; r < rows; ++r) out[r] = dot(a, b + r * ldb, n);
}

}  // namespace fp4moe::reference::detail
