// format/nvfp4.cpp — NVFP4 block quantization and dequantization (docs/numerics.md, "Formats and block quantization").
//
// Per row, per block of 16 consecutive elements:
//   1. gs   = 1.0f / input_scale                          (fp32 division, once per call)
//   2. amax = max |x_i|  — NaN-propagating: a NaN element makes amax NaN, so the block's scale is the
//             e4m3 NaN code 0x7F and every element of the block encodes as e2m1 0x7 (the NaN policy of
//             e2m1_from_float). Unlike std::max, the NaN cannot be dropped by argument order.
//   3. sf   = e4m3_rne_satfinite(gs * (amax * (1.0f/6.0f)))   (this multiplication order)
//   4. osc  = (sf == 0) ? 0 : 1.0f / (float(sf) * (1.0f / gs))
//   5. q_i  = e2m1_rne_satfinite(x_i * osc), element 2j in the low nibble of byte j.
// Every step is a single IEEE fp32 operation; the build uses ISO C++ (no FP contraction, no fast-math).
#include <cmath>
#include <cstdint>

#include "fp4moe/error.hpp"
#include "fp4moe/format.hpp"

namespace fp4moe::format {
namespace {

void check_shape(int64_t rows, int64_t cols, const char* fn) {
  check(rows >= 0, fn, ": rows must be >= 0, got ", rows);
  check(cols >= 0 && cols % kBlockSize == 0, fn, ": cols must be a non-negative multiple of ",
        kBlockSize, ", got ", cols);
}

// The dequantized value of every byte code: both e2m1 nibbles of a packed byte and every e4m3 scale
// (the CPU reference decodes whole expert matrices with it, so it is a table, built once).
struct DecodeTable {
  float pair_lo[256], pair_hi[256];  // element 2j (low nibble) and 2j + 1 (high nibble) of byte j
  float e4m3[256];
  DecodeTable() {
    for (int c = 0; c < 256; ++c) {
      pair_lo[c] = e2m1_to_float(static_cast<uint8_t>(c & 0xF));
      pair_hi[c] = e2m1_to_float(static_cast<uint8_t>(c >> 4));
      e4m3[c] = e4m3_to_float(static_cast<uint8_t>(c));
    }
  }
};

const DecodeTable& decode_table() {
  static const DecodeTable t;
  return t;
}

}  // namespace

uint8_t nvfp4_block_scale(float amax, float global_inv_scale) {
  const float sixth = 1.0f / 6.0f;  // the fp32 constant, not an exact 1/6
  const float scaled_amax = amax * sixth;
  return e4m3_from_float(global_inv_scale * scaled_amax);
}

void quantize_nvfp4(const float* x, int64_t rows, int64_t cols, float input_scale, uint8_t* packed,
                    uint8_t* scales) {
  check_shape(rows, cols, "quantize_nvfp4");
  check(std::isfinite(input_scale) && input_scale > 0.0f,
        "quantize_nvfp4: input_scale must be finite and > 0, got ", input_scale);
  const float gs = 1.0f / input_scale;
  check(std::isfinite(gs), "quantize_nvfp4: input_scale must have a finite reciprocal, got ",
        input_scale, " (1/input_scale = ", gs, ")");
  if (rows == 0 || cols == 0) return;
  check(x != nullptr && packed != nullptr && scales != nullptr,
        "quantize_nvfp4: x, packed and scales must be non-null for a non-empty input");
  const float inv_gs = 1.0f / gs;
  const int64_t nblocks = cols / kBlockSize;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    uint8_t* pr = packed + r * (cols / 2);
    uint8_t* sr = scales + r * nblocks;
    for (int64_t b = 0; b < nblocks; ++b) {
      const float* xb = xr + b * kBlockSize;
      float amax = 0.0f;
      for (int i = 0; i < kBlockSize; ++i) {
        const float a = std::fabs(xb[i]);
        if (std::isnan(a) || a > amax) amax = a;  // once NaN, `a > amax` is false: NaN stays
        if (std::isnan(amax)) break;
      }
      const uint8_t sf = nvfp4_block_scale(amax, gs);
      sr[b] = sf;
      const float osc = (sf == 0) ? 0.0f : 1.0f / (e4m3_to_float(sf) * inv_gs);
      uint8_t* pb = pr + b * (kBlockSize / 2);
      for (int j = 0; j < kBlockSize / 2; ++j) {
        const uint8_t lo = e2m1_from_float(xb[2 * j] * osc);
        const uint8_t hi = e2m1_from_float(xb[2 * j + 1] * osc);
        pb[j] = static_cast<uint8_t>(lo | (hi << 4));
      }
    }
  }
}

void dequantize_nvfp4(const uint8_t* packed, const uint8_t* scales, int64_t rows, int64_t cols,
                      float* out) {
  check_shape(rows, cols, "dequantize_nvfp4");
  if (rows == 0 || cols == 0) return;
  check(packed != nullptr && scales != nullptr && out != nullptr,
        "dequantize_nvfp4: packed, scales and out must be non-null for a non-empty input");
  const DecodeTable& t = decode_table();
  const int64_t nblocks = cols / kBlockSize;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* pr = packed + r * (cols / 2);
    const uint8_t* sr = scales + r * nblocks;
    float* orow = out + r * cols;
    for (int64_t b = 0; b < nblocks; ++b) {
      const float sf = t.e4m3[sr[b]];
      for (int j = 0; j < kBlockSize / 2; ++j) {
        const uint8_t byte = pr[b * (kBlockSize / 2) + j];
        orow[b * kBlockSize + 2 * j] = t.pair_lo[byte] * sf;
        orow[b * kBlockSize + 2 * j + 1] = t.pair_hi[byte] * sf;
      }
    }
  }
}

}  // namespace fp4moe::format
