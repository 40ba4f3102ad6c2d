// fp4moe/format.hpp — NVFP4 and MXFP4 number formats, block quantization and scale-factor layouts
// (docs/numerics.md, "Formats and block quantization" and "MXFP4 weights").
//
// Everything here is plain IEEE fp32 host code, bit-exact to the numerics contract; the GPU kernels
// are tested against it.
#pragma once

#include <cstdint>

namespace fp4moe::format {

inline constexpr int kBlockSize = 16;      // elements per e4m3 block scale along K (NVFP4)
inline constexpr int kMxfp4BlockSize = 32; // elements per ue8m0 block scale along K (MXFP4)
inline constexpr uint8_t kUe8m0Nan = 0xFF; // the ue8m0 NaN code, refused wherever weights are taken

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

// ---- MXFP4 (OCP MX e2m1 with ue8m0 block scales) --------------------------------------------------
// Dequantized values q * 2^(c - 127), [rows, cols] (cols % 32 == 0), from
//   packed  [rows, cols/2]  e2m1 pairs as for NVFP4 (element 2j in the low nibble of byte j)
//   scales  [rows, cols/32] ue8m0 codes c, linear layout.
// Each value is one fp32 product of two exact numbers, so it is exact whenever it is an fp32 number
// (every code but 254 with |q| >= 2, which overflows to +-inf as the product must). Code 255 decodes
// to NaN: callers refuse it first (find_ue8m0_nan). Throws fp4moe::Error on bad shapes.
void dequantize_mxfp4(const uint8_t* packed, const uint8_t* scales, int64_t rows, int64_t cols, float* out);

// Quantizes rows of fp32 values to MXFP4: per block of 32, c = ue8m0_from_float(amax / 6) (the power
// of two at or above amax / 6, so no element saturates; an all-zero block gets code 0) and
// q_i = e2m1_rne_satfinite(x_i * 2^(127 - c)) (an exact scaling). A block with a NaN gets code 255.
// Random test weights (io::make_random_case); the checkpoints' own codes are taken as they are.
void quantize_mxfp4(const float* x, int64_t rows, int64_t cols, uint8_t* packed, uint8_t* scales);

// The index of the first ue8m0 NaN code (255) among n codes, or -1 when there is none.
int64_t find_ue8m0_nan(const uint8_t* codes, int64_t n);

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
