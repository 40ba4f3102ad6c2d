// format/codecs.cpp — e2m1, e4m3fn, ue8m0 and bf16 scalar codecs (docs/numerics.md, "Formats and block quantization").
//
// Steps of every encoder: (1) special values (NaN, sign); (2) scale |x| by a power of two so that the
// target's quantum becomes 1 (exact in double); (3) round to nearest, ties to even (std::nearbyint in
// the default rounding mode); (4) saturate; (5) assemble the code. Decoders are exact.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "fp4moe/format.hpp"

namespace fp4moe::format {
namespace {

// Magnitudes of the 8 non-negative e2m1 codes.
constexpr float kE2m1Values[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

uint32_t float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

float bits_float(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

}  // namespace

// ---- e2m1 -----------------------------------------------------------------------------------------
// The grid is tiny, so round-to-nearest-even is written as explicit interval bounds. A tie goes to the
// code with the even mantissa bit: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4.
uint8_t e2m1_from_float(float x) {
  // NOTE: NaN encodes as +6 (0x7), what the hardware's satfinite cvt to e2m1 produces.
  if (std::isnan(x)) return 0x7;
  const uint8_t sign = std::signbit(x) ? 0x8 : 0x0;
  const float a = std::fabs(x);
  uint8_t mag;
  if (a <= 0.25f) mag = 0;        // 0.25 tie -> 0 (code 0 even)
  else if (a < 0.75f) mag = 1;    // 0.5
  else if (a <= 1.25f) mag = 2;   // 1.0; 0.75 tie -> 1, 1.25 tie -> 1
  else if (a < 1.75f) mag = 3;    // 1.5
  else if (a <= 2.5f) mag = 4;    // 2.0; 1.75 tie -> 2, 2.5 tie -> 2
  else if (a < 3.5f) mag = 5;     // 3.0
  else if (a <= 5.0f) mag = 6;    // 4.0; 3.5 tie -> 4, 5 tie -> 4
  else mag = 7;                   // 6.0; saturates (including +-inf)
  return static_cast<uint8_t>(sign | mag);  // a negative value rounding to zero gives 0x8
}

float e2m1_to_float(uint8_t code) {
  const float v = kE2m1Values[code & 0x7];
  return (code & 0x8) ? -v : v;
}

// ---- e4m3fn ---------------------------------------------------------------------------------------
// Layout s.eeee.mmm, bias 7, no infinities, 0x7F/0xFF NaN, max finite 448 (0x7E), min subnormal 2^-9.
uint8_t e4m3_from_float(float x) {
  if (std::isnan(x)) return 0x7F;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  // NOTE: satfinite — finite overflow and +-inf clamp to +-448, as cvt.rn.satfinite.e4m3x2 does.
  if (std::isinf(x)) return static_cast<uint8_t>(sign | 0x7E);
  const double a = std::fabs(static_cast<double>(x));
  if (a == 0.0) return sign;
  int e2;  // a = f * 2^e2, f in [0.5, 1)  =>  floor(log2 a) = e2 - 1
  (void)std::frexp(a, &e2);
  int exp_unbiased = e2 - 1;
  if (exp_unbiased < -6) exp_unbiased = -6;  // subnormal range shares the quantum 2^-9
  const int quantum_exp = exp_unbiased - 3;  // 3 mantissa bits
  const double r = std::nearbyint(std::ldexp(a, -quantum_exp));  // exact scaling, RNE rounding
  const double v = std::ldexp(r, quantum_exp);
  if (v > 448.0) return static_cast<uint8_t>(sign | 0x7E);
  if (v == 0.0) return sign;
  // Re-derive the exponent from the rounded value (rounding may have carried into the next binade).
  int ev;
  (void)std::frexp(v, &ev);
  const int vexp = ev - 1;
  if (vexp < -6) {  // subnormal: value = m * 2^-9, m in 1..7
    return static_cast<uint8_t>(sign | static_cast<uint8_t>(std::ldexp(v, 9)));
  }
  const int mant = static_cast<int>(std::ldexp(v, 3 - vexp)) - 8;  // 0..7
  return static_cast<uint8_t>(sign | ((vexp + 7) << 3) | mant);
}

float e4m3_to_float(uint8_t code) {
  const bool neg = code & 0x80;
  const int e = (code >> 3) & 0xF;
  const int m = code & 0x7;
  float v;
  if (e == 0xF && m == 0x7) {
    v = std::numeric_limits<float>::quiet_NaN();
  } else if (e == 0) {
    v = std::ldexp(static_cast<float>(m), -9);
  } else {
    v = std::ldexp(static_cast<float>(8 + m), e - 7 - 3);
  }
  return neg ? -v : v;
}

// ---- ue8m0 ----------------------------------------------------------------------------------------
// 2^(code-127), code 0xFF NaN. Encoding rounds up to the next power of two and saturates to 2^127
// (code 0xFE). Zero, negative and fp32-subnormal inputs give code 0 (no rounding is attempted below
// the smallest fp32 normal); NaN gives 0xFF; +inf saturates to 0xFE.
uint8_t ue8m0_from_float(float x) {
  if (std::isnan(x)) return 0xFF;
  if (!(x >= std::numeric_limits<float>::min())) return 0x00;  // zero, negative, subnormal
  if (std::isinf(x)) return 0xFE;
  const uint32_t u = float_bits(x);
  int code = static_cast<int>((u >> 23) & 0xFF);  // biased exponent 1..254 = floor(log2 x) + 127
  if ((u & 0x7FFFFF) != 0) ++code;                  // not a power of two: round up
  if (code > 0xFE) code = 0xFE;
  return static_cast<uint8_t>(code);
}

float ue8m0_to_float(uint8_t code) {
  if (code == 0xFF) return std::numeric_limits<float>::quiet_NaN();
  if (code == 0) return bits_float(0x00400000u);  // 2^-127 is an fp32 subnormal
  return bits_float(static_cast<uint32_t>(code) << 23);
}

// ---- bf16 -----------------------------------------------------------------------------------------
uint16_t bf16_from_float(float x) {
  const uint32_t u = float_bits(x);
  if (std::isnan(x)) return static_cast<uint16_t>((u >> 16) | 0x0040);  // keep sign, force quiet
  const uint32_t lsb = (u >> 16) & 1u;
  return static_cast<uint16_t>((u + 0x7FFFu + lsb) >> 16);  // RNE; overflow rounds to inf
}

float bf16_to_float(uint16_t bits) { return bits_float(static_cast<uint32_t>(bits) << 16); }

}  // namespace fp4moe::format
