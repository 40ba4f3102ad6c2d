// format/scale_layout.cpp — linear <-> 128x4-swizzled e4m3 scale-factor layouts.
//
// The swizzled layout (CUTLASS / FlashInfer / vLLM) tiles each batch into 128-row x 4-column atoms of
// 512 bytes. Within an atom, row m and column k sit at (m%32)*16 + ((m%128)/32)*4 + k%4; atoms are
// ordered row-tile major: (m/128)*Kt*512 + (k/4)*512, Kt = ceil(scale_cols/4). Rows are padded to a
// multiple of 128 and columns to a multiple of 4; padding bytes are written as zero.
#include <cstdint>
#include <cstring>

#include "fp4moe/error.hpp"
#include "fp4moe/format.hpp"

namespace fp4moe::format {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

void check_dims(int64_t batches, int64_t rows, int64_t scale_cols, const char* fn) {
  check(batches >= 0, fn, ": batches must be >= 0, got ", batches);
  check(rows >= 0, fn, ": rows must be >= 0, got ", rows);
  check(scale_cols >= 0, fn, ": scale_cols must be >= 0, got ", scale_cols);
}

// Offset without argument checks, for the copy loops.
inline int64_t offset_unchecked(int64_t b, int64_t m, int64_t k, int64_t row_tiles, int64_t kt) {
  return b * row_tiles * kt * 512 + (m / 128) * kt * 512 + (k / 4) * 512 + (m % 32) * 16 +
         ((m % 128) / 32) * 4 + k % 4;
}

}  // namespace

int64_t swizzled_scales_size(int64_t batches, int64_t rows, int64_t scale_cols) {
  check_dims(batches, rows, scale_cols, "swizzled_scales_size");
  return batches * ceil_div(rows, 128) * 128 * ceil_div(scale_cols, 4) * 4;
}

int64_t swizzled_scale_offset(int64_t b, int64_t m, int64_t k, int64_t rows, int64_t scale_cols) {
  check(b >= 0, "swizzled_scale_offset: batch index b must be >= 0, got ", b);
  check(m >= 0 && m < rows, "swizzled_scale_offset: row m must be in [0, ", rows, "), got ", m);
  check(k >= 0 && k < scale_cols, "swizzled_scale_offset: scale column k must be in [0, ",
        scale_cols, "), got ", k);
  return offset_unchecked(b, m, k, ceil_div(rows, 128), ceil_div(scale_cols, 4));
}

void scales_linear_to_swizzled(const uint8_t* linear, int64_t batches, int64_t rows,
                               int64_t scale_cols, uint8_t* swizzled) {
  const int64_t size = swizzled_scales_size(batches, rows, scale_cols);
  if (size == 0) return;
  check(linear != nullptr && swizzled != nullptr,
        "scales_linear_to_swizzled: linear and swizzled must be non-null for a non-empty layout");
  std::memset(swizzled, 0, static_cast<size_t>(size));
  const int64_t row_tiles = ceil_div(rows, 128);
  const int64_t kt = ceil_div(scale_cols, 4);
  for (int64_t b = 0; b < batches; ++b)
    for (int64_t m = 0; m < rows; ++m) {
      const uint8_t* src = linear + (b * rows + m) * scale_cols;
      for (int64_t k = 0; k < scale_cols; ++k)
        swizzled[offset_unchecked(b, m, k, row_tiles, kt)] = src[k];
    }
}

void scales_swizzled_to_linear(const uint8_t* swizzled, int64_t batches, int64_t rows,
                               int64_t scale_cols, uint8_t* linear) {
  const int64_t size = swizzled_scales_size(batches, rows, scale_cols);
  if (size == 0) return;
  check(linear != nullptr && swizzled != nullptr,
        "scales_swizzled_to_linear: swizzled and linear must be non-null for a non-empty layout");
  const int64_t row_tiles = ceil_div(rows, 128);
  const int64_t kt = ceil_div(scale_cols, 4);
  for (int64_t b = 0; b < batches; ++b)
    for (int64_t m = 0; m < rows; ++m) {
      uint8_t* dst = linear + (b * rows + m) * scale_cols;
      for (int64_t k = 0; k < scale_cols; ++k)
        dst[k] = swizzled[offset_unchecked(b, m, k, row_tiles, kt)];
    }
}

}  // namespace fp4moe::format
