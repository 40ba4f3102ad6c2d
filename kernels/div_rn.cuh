// kernels/div_rn.cuh — IEEE fp32 division (round to nearest even) split into a branch-free fast path
// and a range check, for code that divides many independent values at once (the GEMM1 epilogue's 16
// activations per item).
//
// Why: `__fdiv_rn(a, b)` compiles to MUFU.RCP, five FFMAs and an FCHK whose slow path is a called
// subroutine; each division is its own BSSY/BSYNC region, so ptxas cannot interleave the dependent
// chains of 16 divisions (SASS of expert_gemm_kernel: 16 serial regions per item). Here every
// quotient is computed by the same fast path, and the caller takes one branch for the whole item when
// any operand pair is out of range, where it divides again with __fdiv_rn.
//
// The fast path (the compiler's fast path, operation for operation):
//   r  = rcp.approx.ftz(b)       e  = fma(-b, r, 1)      r1 = fma(r, e, r)
//   q  = a * r1                  rm = fma(-b, q, a)      result = fma(r1, rm, q)
// Range (fast_ok): |a| and |b| in [2^-62, 2^62]. There r1, q and the result are normal numbers and
// the remainder rm is exact, far inside the operands that the compiler's FCHK (which sends a
// division to its slow path) is expected to pass; zero, subnormal, infinite and NaN operands are
// outside it (so is -0 / b, whose sign the fast path loses). The result equals __fdiv_rn's only with
// the hardware reciprocal: with r one ulp off, the steps can round wrong (1 / (1 - 2^-24)). So the
// GPU test below is what shows the two agree.
// Tests: the CPU ctest `DivRn.*` (the steps with the correctly rounded reciprocal against the host's
// division, over the range and next to rounding midpoints); the GPU test
// `Nvfp4Device.DivRnFastPathMatchesIeee` (the device's fast path against __fdiv_rn for every fp32
// numerator with a set of divisors, and for every divisor mantissa with a set of numerators).
#pragma once

#include "kernels/host_device.cuh"

#if !defined(__CUDA_ARCH__)
#include <cmath>
#endif

namespace fp4moe::kernels::divrn {

inline constexpr float kMinOperand = 0x1p-62f;  // the fast path's operand range, both ends included
inline constexpr float kMaxOperand = 0x1p62f;

// True when the fast path is exact for a / b (NaN compares false: out of range).
// NOTE: bitwise & (no short circuit) and fabs: four compares with |x| operands, no branches.
FP4MOE_HD bool fast_ok(float a, float b) {
#if defined(__CUDA_ARCH__)
  const float aa = fabsf(a), ab = fabsf(b);
#else
  const float aa = std::fabs(a), ab = std::fabs(b);
#endif
  return (aa >= kMinOperand) & (aa <= kMaxOperand) & (ab >= kMinOperand) & (ab <= kMaxOperand);
}

// The correction steps of the fast path, given the reciprocal r of b.
FP4MOE_HD float refine(float a, float b, float r) {
#if defined(__CUDA_ARCH__)
  const float e = __fmaf_rn(-b, r, 1.0f);
  const float r1 = __fmaf_rn(r, e, r);
  const float q = __fmul_rn(a, r1);
  const float rm = __fmaf_rn(-b, q, a);
  return __fmaf_rn(r1, rm, q);
#else
  const float e = std::fma(-b, r, 1.0f);
  const float r1 = std::fma(r, e, r);
  const float q = a * r1;
  const float rm = std::fma(-b, q, a);
  return std::fma(r1, rm, q);
#endif
}

#if defined(__CUDACC__)
// The approximate reciprocal (MUFU.RCP).
__device__ __forceinline__ float rcp_approx(float b) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(b));
  return r;
}
// a / b by the fast path; exact (== __fdiv_rn(a, b)) when fast_ok(a, b).
__device__ __forceinline__ float fast(float a, float b) { return refine(a, b, rcp_approx(b)); }
#endif

}  // namespace fp4moe::kernels::divrn
