// fp4moe/format.hpp — NVFP4 number formats, block quantization and scale-factor layouts (docs/numerics.md, "Formats and block quantization").
//
// Everything here is plain IEEE fp32 host code, bit-exact to the numerics contract; the GPU kernels
// are tested against it.
#pragma once

#include <cstdint>

namespace fp4moe::format {

inline constexpr int kBlockSize = 16;  // elements per e4m3 block scale along K

// ---- codecs ---------------------------------------------------------------------------------------
// e2m1 (FP4): a 4-bit code in the low nibble. Encoding is round-to-nearest-even with saturation to
// +-6; a negative value that rounds to zero encodes as 0x8 (negative zero); NaN encodes as +6 (0x7),
// the saturating conversion of the hardware.
uint8_t e2m1_from_float(float x);
float e2m1_to_float(uint8_t code);  // uses the low nibble only

// e4m3fn (float8_e4m3fn): round-to-nearest-even, saturating finite values to +-448; NaN -> 0x7F.
uint8_t e4m3_from_float(float x);
float e4m3_to_float(uint8_t code);  // 0x7F / 0xFF decode to NaN

// ue8m0: a power of two 2^(code-127); code 0xFF is NaN. Encoding rounds up to the next power of two
// (the MX scale convention), saturating to 2^127; zero, negative and subnormal-small values give 0.
uint8_t ue8m0_from_float(float x);
float ue8m0_to_float(uint8_t code);

// bf16 stored as uint16_t bits; round-to-nearest-even, NaN stays NaN.
uint16_t bf16_from_float(float x);
float bf16_to_float(uint16_t bits);

// ---- NVFP4 block quantization --------------------------------------------------------------------
// Quantizes `rows` rows of `cols` fp32 values (cols % 16 == 0) with the input scale `input_scale`
// (dequant direction, > 0 and finite), exactly as docs/numerics.md, "Formats and block quantization":
//   packed  [rows, cols/2]  two e2m1 codes per byte, element 2j in the low nibble of byte j
//   scales  [rows, cols/16] e4m3 block scales, linear (row-major) layout
// Throws fp4moe::Error on bad arguments.
void quantize_nvfp4(const float* x, int64_t rows, int64_t cols, float input_scale, uint8_t* packed,
                    uint8_t* scales);

// The block scale of one block: e4m3(gs * (amax * (1/6))) with gs = 1 / input_scale.
uint8_t nvfp4_block_scale(float amax, float global_inv_scale);

// Dequantized values q * float(sf) (no global scale), [rows, cols], from linear-layout scales.
void dequantize_nvfp4(const uint8_t* packed, const uint8_t* scales, int64_t rows, int64_t cols,
                      float* out);

// ---- scale-factor layouts ------------------------------------------------------------------------
// 128x4-swizzled layout (CUTLASS / FlashInfer / vLLM): rows padded to a multiple of 128, scale columns
// to a multiple of 4, padding bytes zero. For batch b, row m, scale column k, Kt = ceil(scale_cols/4):
//   b*ceil(rows/128)*Kt*512 + (m/128)*Kt*512 + (k/4)*512 + (m%32)*16 + ((m%128)/32)*4 + k%4
int64_t swizzled_scales_size(int64_t batches, int64_t rows, int64_t scale_cols);  // bytes
int64_t swizzled_scale_offset(int64_t b, int64_t m, int64_t k, int64_t rows, int64_t scale_cols);
// linear [batches, rows, scale_cols] -> swizzled (swizzled_scales_size bytes, padding zeroed)
void scales_linear_to_swizzled(const uint8_t* linear, int64_t batches, int64_t rows,
                               int64_t scale_cols, uint8_t* swizzled);
// swizzled -> linear [batches, rows, scale_cols] (padding ignored)
void scales_swizzled_to_linear(const uint8_t* swizzled, int64_t batches, int64_t rows,
                               int64_t scale_cols, uint8_t* linear);

}  // namespace fp4moe::format
