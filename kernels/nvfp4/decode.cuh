// kernels/nvfp4/decode.cuh — the register decode of the prepacked NVFP4 weights into bf16 MMA A
// fragments (both GEMMs: wgmma register A, mma.sync A): decode_word and decode_scale_pair of
// weight_layout.cuh, then one bf16x2 multiply per register by the pair of block scales.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/nvfp4/weight_layout.cuh"

namespace fp4moe::kernels::nvfp4 {

__device__ __forceinline__ uint32_t bf16x2_mul_lo(uint32_t x, uint32_t s) {  // x * {s.lo, s.lo}
  const __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&x),
                                   __low2bfloat162(*reinterpret_cast<const __nv_bfloat162*>(&s)));
  return *reinterpret_cast<const uint32_t*>(&r);
}
__device__ __forceinline__ uint32_t bf16x2_mul_hi(uint32_t x, uint32_t s) {  // x * {s.hi, s.hi}
  const __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&x),
                                   __high2bfloat162(*reinterpret_cast<const __nv_bfloat162*>(&s)));
  return *reinterpret_cast<const uint32_t*>(&r);
}
__device__ __forceinline__ uint32_t word_of(const uint4& v, int q) {
  return q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w;
}
// The A fragments of word q of an m16 tile's chunk (both GEMMs): rows g from this lane's weight
// words wa and scale codes sa, rows g+8 from wb and sb; f0 = k16 step 2q, f1 = step 2q+1, each
// {a0 = row g cols 2t.., a1 = row g+8, a2 = row g cols 2t+8.., a3 = row g+8 cols 2t+8..}.
__device__ __forceinline__ void decode_fragments(const uint4& wa, const uint4& wb, const uint2& sa, const uint2& sb,
                                                 int q, uint32_t (&f0)[4], uint32_t (&f1)[4]) {
  const uint32_t sca = decode_scale_pair(q < 2 ? sa.x : sa.y, q & 1);
  const uint32_t scb = decode_scale_pair(q < 2 ? sb.x : sb.y, q & 1);
  uint32_t da[4], db[4];
  decode_word(word_of(wa, q), da);
  decode_word(word_of(wb, q), db);
  f0[0] = bf16x2_mul_lo(da[0], sca);
  f0[1] = bf16x2_mul_lo(db[0], scb);
  f0[2] = bf16x2_mul_lo(da[1], sca);
  f0[3] = bf16x2_mul_lo(db[1], scb);
  f1[0] = bf16x2_mul_hi(da[2], sca);
  f1[1] = bf16x2_mul_hi(db[2], scb);
  f1[2] = bf16x2_mul_hi(da[3], sca);
  f1[3] = bf16x2_mul_hi(db[3], scb);
}

}  // namespace fp4moe::kernels::nvfp4
