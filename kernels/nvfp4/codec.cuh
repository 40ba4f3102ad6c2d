// kernels/nvfp4/codec.cuh — device-side NVFP4 codecs and block quantization, bit-exact with
// include/fp4moe/format.hpp (format/codecs.cpp, format/nvfp4.cpp) and (docs/numerics.md, "Formats and
// block quantization").
//
// Quantizing one block of 16 values x with the global inverse scale gs = 1 / input_scale:
//   1. amax = max |x_i|, NaN-propagating (a NaN element makes amax NaN)
//   2. sf   = e4m3_rne_satfinite(gs * (amax * (1.0f/6.0f)))
//   3. osc  = (sf == 0) ? 0 : 1 / (float(sf) * (1 / gs))
//   4. q_i  = e2m1_rne_satfinite(x_i * osc); element 2j in the low nibble of byte j
// Every step is one IEEE fp32 operation with round-to-nearest-even, written with the __fmul_rn /
// __fdiv_rn intrinsics.
// NOTE: nvcc contracts a*b+c into an FMA by default; the _rn intrinsics are never contracted, so the
// results do not depend on the compiler's choices.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace fp4moe::kernels::nvfp4 {

inline constexpr int kBlock = 16;  // elements per e4m3 block scale

// ---- e2m1 -----------------------------------------------------------------------------------------
// Round-to-nearest-even on the grid {0, 0.5, 1, 1.5, 2, 3, 4, 6}, saturating to +-6. A negative value
// that rounds to zero keeps its sign (0x8, as does -0); NaN encodes as +6 (0x7).
// NOTE: sm_90 has no cvt to e2m1 (that instruction is sm_100+), so the interval bounds are explicit.
__device__ __forceinline__ uint32_t e2m1_from_float(float x) {
  if (isnan(x)) return 0x7u;
  const uint32_t sign = (__float_as_uint(x) >> 31) << 3;
  const float a = fabsf(x);
  uint32_t mag;
  if (a <= 0.25f) mag = 0;        // 0.25 tie -> 0
  else if (a < 0.75f) mag = 1;    // 0.5
  else if (a <= 1.25f) mag = 2;   // 1.0 (0.75 and 1.25 ties)
  else if (a < 1.75f) mag = 3;    // 1.5
  else if (a <= 2.5f) mag = 4;    // 2.0 (1.75 and 2.5 ties)
  else if (a < 3.5f) mag = 5;     // 3.0
  else if (a <= 5.0f) mag = 6;    // 4.0 (3.5 and 5 ties)
  else mag = 7;                   // 6.0, saturating (also +-inf)
  return sign | mag;
}

// Decodes the low nibble.
__device__ __forceinline__ float e2m1_to_float(uint32_t code) {
  // magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 = m * 2^(e-1) style; a small switch-free form:
  const uint32_t mag = code & 0x7u;
  const uint32_t e = mag >> 1, m = mag & 1u;
  // e == 0: subnormal m * 0.5; e >= 1: (1 + m/2) * 2^(e-1)
  const float v = (e == 0) ? (m ? 0.5f : 0.0f)
                           : __uint_as_float(((e - 1u + 127u) << 23) | (m << 22));
  return (code & 0x8u) ? -v : v;
}

// ---- e4m3fn ---------------------------------------------------------------------------------------
// Round-to-nearest-even, finite values and +-inf saturate to +-448 (satfinite), NaN -> 0x7F.
// NOTE: cvt.rn.satfinite.e4m3x2.f32 (sm_89+) does the rounding and saturation; NaN is mapped to 0x7F
// explicitly so that the sign bit of a NaN input never leaks into the code.
__device__ __forceinline__ uint32_t e4m3_from_float(float x) {
  if (isnan(x)) return 0x7Fu;
  uint16_t pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(x));
  return static_cast<uint32_t>(pair) & 0xFFu;  // the second source lands in the low byte
}

// 0x7F / 0xFF decode to NaN.
__device__ __forceinline__ float e4m3_to_float(uint32_t code) {
  const uint32_t e = (code >> 3) & 0xFu, m = code & 0x7u;
  float v;
  if (e == 0xFu && m == 0x7u) v = __uint_as_float(0x7FC00000u);
  else if (e == 0) v = __fmul_rn(static_cast<float>(m), 0.001953125f);  // m * 2^-9, exact
  else v = __uint_as_float(((e - 7u + 127u) << 23) | (m << 20));
  return (code & 0x80u) ? -v : v;
}

// ---- scale layouts ----------------------------------------------------------------------------------
// Byte offset of scale (m, k) in the 128x4-swizzled layout of a [row_tiles*128, kt*4] scale matrix (one
// batch; format::scales_linear_to_swizzled): 512-byte tiles of 128 rows x 4 columns, row m % 32 major.
__device__ __forceinline__ int64_t swizzled_scale_offset(int64_t m, int64_t k, int64_t kt) {
  return (m / 128) * kt * 512 + (k / 4) * 512 + (m % 32) * 16 + ((m % 128) / 32) * 4 + k % 4;
}

// ---- block scale ----------------------------------------------------------------------------------
// gs = 1 / input_scale (input_scale in the dequant direction).
__device__ __forceinline__ float global_inv_scale(float input_scale) {
  return __fdiv_rn(1.0f, input_scale);
}

// NaN-propagating running max of |x|: once amax is NaN it stays NaN.
__device__ __forceinline__ float amax_update(float amax, float x) {
  const float a = fabsf(x);
  return (isnan(a) || a > amax) ? a : amax;
}
// Combines two partial maxima (e.g. across lanes), NaN-propagating.
__device__ __forceinline__ float amax_combine(float a, float b) {
  return (isnan(b) || b > a) ? b : a;
}

// e4m3(gs * (amax * (1/6))) — the fp32 constant 1.0f/6.0f, this multiplication order.
__device__ __forceinline__ uint32_t nvfp4_block_scale(float amax, float gs) {
  return e4m3_from_float(__fmul_rn(gs, __fmul_rn(amax, 1.0f / 6.0f)));
}

// osc = (sf == 0) ? 0 : 1 / (float(sf) * (1 / gs)). `inv_gs` is 1 / gs (computed once per scale).
__device__ __forceinline__ float nvfp4_output_scale(uint32_t sf, float inv_gs) {
  return sf == 0 ? 0.0f : __fdiv_rn(1.0f, __fmul_rn(e4m3_to_float(sf), inv_gs));
}

// q = e2m1(x * osc)
__device__ __forceinline__ uint32_t nvfp4_quantize_value(float x, float osc) {
  return e2m1_from_float(__fmul_rn(x, osc));
}

// e2m1_to_float(e2m1_from_float(y)) without branches: |y| rounded to the e2m1 grid's step in its
// range (0.5 below 2, 1 below 4, 2 from 4), half to even, as rint(|y| / step) * step (exact: the
// steps are powers of two), saturated at 6; the sign is y's (-0 for small negatives), and NaN gives
// code 7, i.e. +6. The grid's ties (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4,
// 5 -> 4) are rint's ties to even; equal to the threshold count it replaces for every float bit
// pattern (an exhaustive host check).
// NOTE: the compiler turns e2m1_from_float's if-chain into divergent branches per element, which
// dominated the GEMM1 epilogue and the activation quantization; the threshold count that replaced it
// (seven compare, select and add steps) was ~25 instructions per element, this form ~13.
__device__ __forceinline__ float e2m1_round_value(float y) {
  const float a = fabsf(y);
  const float inv_step = a < 2.0f ? 2.0f : (a < 4.0f ? 1.0f : 0.5f);
  const float step = a < 2.0f ? 0.5f : (a < 4.0f ? 1.0f : 2.0f);
  const float v = fminf(__fmul_rn(rintf(__fmul_rn(a, inv_step)), step), 6.0f);
  const float r = __uint_as_float(__float_as_uint(v) | (__float_as_uint(y) & 0x80000000u));
  return isnan(y) ? 6.0f : r;
}
// ---- one block of 16 ------------------------------------------------------------------------------
struct Block16 {
  uint32_t packed[2];  // 8 bytes, little-endian: element 2j in the low nibble of byte j
  uint32_t sf;         // e4m3 code of the block scale
};

// Quantizes 16 consecutive values with gs = 1 / input_scale (and inv_gs = 1 / gs).
__device__ __forceinline__ Block16 quantize_block16(const float (&x)[kBlock], float gs, float inv_gs) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kBlock; ++i) amax = amax_update(amax, x[i]);
  Block16 out;
  out.sf = nvfp4_block_scale(amax, gs);
  const float osc = nvfp4_output_scale(out.sf, inv_gs);
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    uint32_t word = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) word |= nvfp4_quantize_value(x[8 * w + i], osc) << (4 * i);
    out.packed[w] = word;
  }
  return out;
}

// Quantizes 16 values and returns the dequantized values q * float(sf) in place (no global scale).
// These are exact in bf16 (an e2m1 value times an e4m3 value has at most 6 significant bits).
// Returns the block scale code.
__device__ __forceinline__ uint32_t fake_quantize_block16(float (&x)[kBlock], float gs, float inv_gs) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kBlock; ++i) amax = amax_update(amax, x[i]);
  const uint32_t sf = nvfp4_block_scale(amax, gs);
  const float osc = nvfp4_output_scale(sf, inv_gs);
  const float sf_value = e4m3_to_float(sf);
#pragma unroll
  for (int i = 0; i < kBlock; ++i)
    x[i] = __fmul_rn(e2m1_round_value(__fmul_rn(x[i], osc)), sf_value);
  return sf;
}

// 16 bf16 (two uint4) -> 16 floats; element 2i is the low half of word i.
__device__ __forceinline__ void load_bf16x16(const __nv_bfloat16* src, float (&v)[16]) {
  const uint4* p = reinterpret_cast<const uint4*>(src);
  const uint4 lo = p[0], hi = p[1];
  const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    v[2 * i] = __uint_as_float(w[i] << 16);
    v[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
  }
}

// Two floats -> bf16x2 (RNE each), lo in the low 16 bits, in one conversion instruction
// (cvt.rn.bf16x2.f32) instead of two.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// 16 floats (exactly representable in bf16, or rounded RNE) -> two uint4 stores.
__device__ __forceinline__ void store_bf16x16(__nv_bfloat16* dst, const float (&v)[16]) {
  uint32_t w[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) w[i] = pack_bf16x2(v[2 * i], v[2 * i + 1]);
  uint4* p = reinterpret_cast<uint4*>(dst);
  p[0] = make_uint4(w[0], w[1], w[2], w[3]);
  p[1] = make_uint4(w[4], w[5], w[6], w[7]);
}

// ---- the top-k finalize's arithmetic, for 8 consecutive columns ------------------------------------
// (docs/numerics.md, "The layer, step by step": the finalize step)
// Shared by the finalize kernel and GEMM2's fused finalize, so both give the same bits.
// acc[q] = acc[q] + w * y[q]: separately rounded (never contracted into an FMA). y is read through L2
// (__ldcg): in the fused finalize other CTAs of the same launch wrote it, so no stale L1 line is used.
struct Slot8 {
  float4 lo, hi;  // columns 0-3, 4-7
};
__device__ __forceinline__ Slot8 finalize_load_slot8(const float* y) {
  const float4* src = reinterpret_cast<const float4*>(y);
  return Slot8{__ldcg(src), __ldcg(src + 1)};
}
__device__ __forceinline__ void finalize_add_slot8(float (&acc)[8], float w, const Slot8& y) {
  const float v[8] = {y.lo.x, y.lo.y, y.lo.z, y.lo.w, y.hi.x, y.hi.y, y.hi.z, y.hi.w};
#pragma unroll
  for (int q = 0; q < 8; ++q) acc[q] = __fadd_rn(acc[q], __fmul_rn(w, v[q]));
}

// The k slots of one token over 8 columns: acc = acc + w_j * y[entry0 + j] for j = 0..k-1 in order
// (finalize_add_slot8). y points at the first column in row 0; row r starts y_row_stride floats later.
// weights == nullptr: unit weights. ids != nullptr: a slot whose id lies outside [0, num_experts) has
// no GEMM row (its y was never written, and is not read): acc becomes NaN there, or with
// skip_foreign_ids (expert parallelism: another rank's expert) the slot adds nothing. bias != nullptr
// (expert biases; needs ids): the slot's y is y + bias[id] (one fp32 add; bias at the same first column,
// row stride y_row_stride) before the weighted add.
// NOTE (loads first): the weights and y of up to kInFlight slots are loaded before the first add; with
// a load and its use per slot, a thread waited for k L2 round trips in a row (SASS: each slot's loads
// issued after the previous slot's adds), the whole time of a decode finalize. kInFlight x 8 registers
// hold the loaded y: fewer where the caller's register budget is tight (GEMM2's fused finalize).
// NOTE (bias in the second loop): nothing in the load loop may read a loaded y. The bias add once sat
// there, as adds predicated on `bias != nullptr`; a predicated-off FADD still waits for its source
// registers, so every slot's loads waited for the previous slot's (SASS: LDG, LDG, @P FADD x 8 per
// slot) and the separate finalize ran 1.3-1.6x slower without any bias.
template <int kInFlight>
__device__ __forceinline__ void finalize_token8(float (&acc)[8], int k, int64_t entry0, const float* weights,
                                                const int32_t* ids, int num_experts, const float* y,
                                                int64_t y_row_stride, bool skip_foreign_ids = false,
                                                const float* bias = nullptr) {
  for (int j0 = 0; j0 < k; j0 += kInFlight) {
    float w[kInFlight];
    int32_t e[kInFlight];
    bool bad[kInFlight];
    Slot8 v[kInFlight];
#pragma unroll
    for (int s = 0; s < kInFlight; ++s) {
      if (j0 + s >= k) break;
      const int64_t entry = entry0 + j0 + s;
      w[s] = weights != nullptr ? weights[entry] : 1.0f;
      e[s] = ids != nullptr ? ids[entry] : 0;
      bad[s] = ids != nullptr && (e[s] < 0 || e[s] >= num_experts);
      if (!bad[s]) v[s] = finalize_load_slot8(y + entry * y_row_stride);
    }
#pragma unroll
    for (int s = 0; s < kInFlight; ++s) {
      if (j0 + s >= k) break;
      if (bad[s]) {
        if (!skip_foreign_ids) {
#pragma unroll
          for (int q = 0; q < 8; ++q) acc[q] = __int_as_float(0x7fc00000);
        }
        continue;
      }
      if (bias != nullptr) {  // kernel-uniform (expert biases)
        const float4* b = reinterpret_cast<const float4*>(bias + static_cast<int64_t>(e[s]) * y_row_stride);
        const float4 lo = __ldg(b), hi = __ldg(b + 1);
        v[s].lo = make_float4(__fadd_rn(v[s].lo.x, lo.x), __fadd_rn(v[s].lo.y, lo.y), __fadd_rn(v[s].lo.z, lo.z),
                              __fadd_rn(v[s].lo.w, lo.w));
        v[s].hi = make_float4(__fadd_rn(v[s].hi.x, hi.x), __fadd_rn(v[s].hi.y, hi.y), __fadd_rn(v[s].hi.z, hi.z),
                              __fadd_rn(v[s].hi.w, hi.w));
      }
      finalize_add_slot8(acc, w[s], v[s]);
    }
  }
}
// 8 floats -> 8 bf16 (RNE), one 16-byte store.
__device__ __forceinline__ void store_bf16x8(__nv_bfloat16* dst, const float (&v)[8]) {
  *reinterpret_cast<uint4*>(dst) = make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]),
                                              pack_bf16x2(v[4], v[5]), pack_bf16x2(v[6], v[7]));
}

// Dequantizes a Block16: out[i] = e2m1(q_i) * float(sf).
__device__ __forceinline__ void dequantize_block16(const Block16& b, float (&out)[kBlock]) {
  const float sf_value = e4m3_to_float(b.sf);
#pragma unroll
  for (int i = 0; i < kBlock; ++i)
    out[i] = __fmul_rn(e2m1_to_float(b.packed[i / 8] >> (4 * (i % 8))), sf_value);
}

}  // namespace fp4moe::kernels::nvfp4
