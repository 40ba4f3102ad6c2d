// format/mxfp4.cpp — MXFP4 block dequantization and quantization (docs/numerics.md, "MXFP4 weights").
//
// The e2m1 codes and their nibble order are NVFP4's (format/codecs.cpp); one ue8m0 code c per 32
// consecutive elements scales them by 2^(c - 127) with no global scale. Decoding is one fp32 product
// per element, q * 2^(c - 127); encoding scales by the inverse power of two (exact) and rounds each
// element with e2m1_from_float.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "fp4moe/error.hpp"
#include "fp4moe/format.hpp"

namespace fp4moe::format {
namespace {

void check_shape(int64_t rows, int64_t cols, const char* fn) {
  check(rows >= 0, fn, ": rows must be >= 0, got ", rows);
  check(cols >= 0 && cols % kMxfp4BlockSize == 0, fn, ": cols must be a non-negative multiple of ",
        kMxfp4BlockSize, " (the MXFP4 block size), got ", cols);
}

struct DecodeTable {
  float pair_lo[256], pair_hi[256];  // element 2j (low nibble) and 2j + 1 (high nibble) of byte j
  float ue8m0[256];
  DecodeTable() {
    for (int c = 0; c < 256; ++c) {
      pair_lo[c] = e2m1_to_float(static_cast<uint8_t>(c & 0xF));
      pair_hi[c] = e2m1_to_float(static_cast<uint8_t>(c >> 4));
      ue8m0[c] = ue8m0_to_float(static_cast<uint8_t>(c));
    }
  }
};

const DecodeTable& decode_table() {
  static const DecodeTable t;
  return t;
}

}  // namespace

void dequantize_mxfp4(const uint8_t* packed, const uint8_t* scales, int64_t rows, int64_t cols, float* out) {
  check_shape(rows, cols, "dequantize_mxfp4");
  if (rows == 0 || cols == 0) return;
  check(packed != nullptr && scales != nullptr && out != nullptr,
        "dequantize_mxfp4: packed, scales and out must be non-null for a non-empty input");
  const DecodeTable& t = decode_table();
  constexpr int kHalf = kMxfp4BlockSize / 2;  // bytes of one block
  const int64_t nblocks = cols / kMxfp4BlockSize;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* pr = packed + r * (cols / 2);
    const uint8_t* sr = scales + r * nblocks;
    float* orow = out + r * cols;
    for (int64_t b = 0; b < nblocks; ++b) {
      const float sf = t.ue8m0[sr[b]];
      for (int j = 0; j < kHalf; ++j) {
        const uint8_t byte = pr[b * kHalf + j];
        orow[b * kMxfp4BlockSize + 2 * j] = t.pair_lo[byte] * sf;
        orow[b * kMxfp4BlockSize + 2 * j + 1] = t.pair_hi[byte] * sf;
      }
    }
  }
}

void quantize_mxfp4(const float* x, int64_t rows, int64_t cols, uint8_t* packed, uint8_t* scales) {
  check_shape(rows, cols, "quantize_mxfp4");
  if (rows == 0 || cols == 0) return;
  check(x != nullptr && packed != nullptr && scales != nullptr,
        "quantize_mxfp4: x, packed and scales must be non-null for a non-empty input");
  const int64_t nblocks = cols / kMxfp4BlockSize;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nblocks; ++b) {
      const float* xb = x + r * cols + b * kMxfp4BlockSize;
      float amax = 0.0f;
      for (int i = 0; i < kMxfp4BlockSize; ++i) {
        const float a = std::fabs(xb[i]);
        if (std::isnan(a) || a > amax) amax = a;
        if (std::isnan(amax)) break;
      }
      // NOTE: amax / 6 rounded up to a power of two keeps every |x_i| * 2^(127-c) <= 6 (no clipping);
      // std::ldexp of the inverse is exact down to the fp32 subnormals.
      const uint8_t c = ue8m0_from_float(amax / 6.0f);
      scales[r * nblocks + b] = c;
      uint8_t* pb = packed + r * (cols / 2) + b * (kMxfp4BlockSize / 2);
      for (int j = 0; j < kMxfp4BlockSize / 2; ++j) {
        const double lo = std::ldexp(static_cast<double>(xb[2 * j]), 127 - c);
        const double hi = std::ldexp(static_cast<double>(xb[2 * j + 1]), 127 - c);
        pb[j] = static_cast<uint8_t>(e2m1_from_float(static_cast<float>(lo)) |
                                     (e2m1_from_float(static_cast<float>(hi)) << 4));
      }
    }
  }
}

int64_t find_ue8m0_nan(const uint8_t* codes, int64_t n) {
  // NOTE: memchr, not a loop: the reference scans every scale of a layer (gpt-oss-120b: 100 MB) per call.
  if (n <= 0) return -1;
  const void* hit = std::memchr(codes, kUe8m0Nan, static_cast<size_t>(n));
  return hit == nullptr ? -1 : static_cast<const uint8_t*>(hit) - codes;
}

}  // namespace fp4moe::format
