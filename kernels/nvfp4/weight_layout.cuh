// kernels/nvfp4/weight_layout.cuh — the prepacked NVFP4 weight layout of the expert GEMMs and its
// register decoder, shared by the host prepack (weight_prepack.cu), the kernels and the tests.
//
// Why a prepacked layout: each consumer thread of the GEMM needs, per 16x16 (rows x K) MMA fragment,
// its 8 weights in the mma/wgmma A-fragment order (PTX ISA, m16n8k16 / m64nNk16 register A, .bf16):
//   lane = 4*g + t (g = lane/4 "groupID", t = lane%4):
//     a0 = row g,   cols 2t, 2t+1      a1 = row g+8, cols 2t, 2t+1
//     a2 = row g,   cols 2t+8, 2t+9    a3 = row g+8, cols 2t+8, 2t+9
//   (lower column in the low 16 bits of each .b32 register).
// The prepack stores, for every group of 8 weight rows ("row group") and every 128-wide K chunk,
// 512 bytes = 32 lanes x 16 bytes, lane 4g+t holding row g's 32 nibbles that lane needs for the 8 k16
// steps of the chunk. A kernel pairs any two row groups into the rows g and g+8 of an m16 tile
// (rows n..n+7 with n+8..n+15, or gate rows with the matching up rows), so the layout is the same
// for GEMM1 and GEMM2.
//
//   weights  [E][N/8][Kp/128][32 lanes][16 B]      Kp = K rounded up to 128, pad columns are zero
//   scales   [E][N/8][Kp/128][8 rows][8 k-blocks]   one byte per 16 K elements, own 8-bit code (below)
//
// Word q (0..3) of a lane's 16 bytes holds the 8 elements of k16 steps 2q and 2q+1 (cols relative to
// the chunk: 32q + {2t, 2t+1, 2t+8, 2t+9, 16+2t, 16+2t+1, 24+2t, 24+2t+1}). Their bits are placed so
// that four bf16x2 registers come out with 6 integer-pipe instructions and 3 left shifts (decode_word):
//   out0 = w & M                      -> a0 of step 2q   (M = 0x81C081C0: sign bit 15, EM bits 8..6
//   out1 = (w << 4) & M               -> a2 of step 2q    of each bf16 half)
//   out2 = r & M, r = rotl(w, 10)     -> a0 of step 2q+1
//   out3 = (r << 4) & 0x01000100 | (w << 6) & 0x80C080C0 -> a2 of step 2q+1
// NOTE (pipes): LOP3, SHF, PRMT and LEA share the SM's integer pipe (16 lanes per sub-partition), which
// the decode loaded most. ptxas issues a left shift as IMAD.SHL on the FMA pipe, so the layout takes
// three of the four outputs' sources by left shifts (of w, or of r where w would wrap): 5 LOP3 + 1 SHF
// on the integer pipe per word instead of 5 LOP3 + 4 SHF (rotations only; decode rows 0.984, prefill
// 0.98). At least one rotation is needed: the four outputs' low-half targets (bits 6..8) need 12
// sources at or below bit 8. The FMA pipe now carries about as much (IMAD + HMUL2): moving the scale
// multiply there as well was slower.
// Each half then holds the e2m1 code as a bf16 bit pattern: sign at bit 15, the 2 exponent bits and
// the mantissa bit at bits 8..6, i.e. exactly q * 2^-126 (q = +-{0,.5,1,1.5,2,3,4,6}; 0.5 is a bf16
// subnormal). kSlot below lists, per output register and half, which word bits hold sign/E1/E0/M.
//
// Scales: the 8-bit code `sc` is chosen so that the bf16 bit pattern of sf * 2^118 is
// sc * 16 + 0x7580 (one IMAD/LEA for two scales, see decode_scale_pair). sc = (X << 3) | m3 with
// sf = 2^(X-10) * (1 + m3/8), X in 1..18; e4m3 subnormals are normalised, sf = 0 gives sc = 0 (the
// block's weights are then zeroed by the prepack, so the non-zero decoded scale never matters).
// Negative e4m3 scales (sign bit set) are folded into the weights' signs; NaN scales are rejected.
// The product (q * 2^-126) * (sf * 2^118) = q * sf * 2^-8 is exact in bf16 (6 significant bits,
// |value| >= 2^-18), so the MMA sums exact products and the epilogue multiplies by 2^8 (exact).
#pragma once

#include <cstdint>

#include "kernels/host_device.cuh"

namespace fp4moe::kernels::nvfp4 {

inline constexpr int kRowsPerGroup = 8;      // weight rows of one row group
inline constexpr int kChunkK = 128;          // K elements of one chunk
inline constexpr int kChunkBytes = 512;      // weight bytes of one (row group, chunk)
inline constexpr int kChunkScaleBytes = 64;  // scale bytes of one (row group, chunk)
inline constexpr uint32_t kEmMask = 0x81C081C0u;
inline constexpr uint32_t kScaleBias = 0x75807580u;  // 235 << 7 in each half
inline constexpr float kAccumulatorScale = 256.0f;   // 2^8: undoes the 2^-8 of the decoded weights

// Source bits of the 8 elements of a word: [output register j][half h] -> {sign, e1, e0, m}
// (e1 e0 = the e2m1 exponent bits, m = the mantissa bit).
struct SlotBits {
  uint8_t sign, e1, e0, m;
};
inline constexpr SlotBits kSlot[4][2] = {
    {{15, 8, 7, 6}, {31, 24, 23, 22}},      // out0 = w & M
    {{11, 4, 3, 2}, {27, 20, 19, 18}},      // out1 = (w << 4) & M
    {{5, 30, 29, 28}, {21, 14, 13, 12}},    // out2 = rotl(w, 10) & M
    {{9, 26, 1, 0}, {25, 10, 17, 16}},      // out3 = rotl(w, 14) & 0x01000100 | (w << 6) & 0x80C080C0
};

// Column (K offset within the 128-wide chunk) of element (word q, output j, half h) for lane t.
FP4MOE_HD int element_col(int q, int j, int h, int t) { return 32 * q + 8 * j + 2 * t + h; }

FP4MOE_HD uint32_t rotl32(uint32_t x, int r) {
#if defined(__CUDA_ARCH__)
  return __funnelshift_l(x, x, r);  // one SHF.L.W
#else
  return (x << r) | (x >> (32 - r));
#endif
}

// The four bf16x2 registers (values q * 2^-126) of one word, before the scale multiply.
FP4MOE_HD void decode_word(uint32_t w, uint32_t (&out)[4]) {
  out[0] = w & kEmMask;
  out[1] = (w << 4) & kEmMask;
  const uint32_t r = rotl32(w, 10);
  out[2] = r & kEmMask;
  out[3] = ((r << 4) & 0x01000100u) | ((w << 6) & 0x80C080C0u);  // r << 4 == rotl(w, 14) on these bits
}

// bf16x2 {sf(kblock 2p) * 2^118 (low half), sf(kblock 2p+1) * 2^118 (high half)} from the 4 scale
// codes of a 32-bit word (bytes 0..3 = k-blocks 4r..4r+3): p_odd selects bytes 2,3 instead of 0,1.
FP4MOE_HD uint32_t decode_scale_pair(uint32_t codes, bool p_odd) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(codes, 0u, p_odd ? 0x5352u : 0x5150u) * 16u + kScaleBias;  // PRMT + LEA
#else
  const uint32_t lo = p_odd ? (codes >> 16) & 0xFFu : codes & 0xFFu;
  const uint32_t hi = p_odd ? (codes >> 24) & 0xFFu : (codes >> 8) & 0xFFu;
  return ((hi << 16) | lo) * 16u + kScaleBias;
#endif
}

// ---- host-side helpers (prepack and tests) ---------------------------------------------------------
// e4m3 magnitude code (0..0x7E, not NaN) -> sc.
inline uint8_t scale_code_from_e4m3(uint8_t mag) {
  const int e = mag >> 3, m = mag & 7;
  if (mag == 0) return 0;
  if (e > 0) return static_cast<uint8_t>(((e + 3) << 3) | m);
  // subnormal m * 2^-9 -> normalised (X, m3): m=1 -> 2^-9, 2..3 -> 2^-8 * {1, 1.5}, 4..7 -> 2^-7 * 1.m
  if (m == 1) return static_cast<uint8_t>(1 << 3);
  if (m <= 3) return static_cast<uint8_t>((2 << 3) | ((m - 2) * 4));
  return static_cast<uint8_t>((3 << 3) | ((m - 4) * 2));
}

// Byte offsets in the prepacked arrays.
inline int64_t weight_offset(int64_t expert, int64_t group, int64_t chunk, int64_t groups, int64_t chunks) {
  return ((expert * groups + group) * chunks + chunk) * kChunkBytes;
}
inline int64_t scale_offset(int64_t expert, int64_t group, int64_t chunk, int64_t groups, int64_t chunks) {
  return ((expert * groups + group) * chunks + chunk) * kChunkScaleBytes;
}

}  // namespace fp4moe::kernels::nvfp4
