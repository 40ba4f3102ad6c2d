// kernels/sm90/wgmma.cuh — warpgroup MMA (wgmma.mma_async m64nNk16, A from registers, .bf16, f32
// accumulators, B from shared memory K-major with the 128-byte swizzle), its fences and the shared-memory
// matrix descriptor.
//
// Fragment shapes (PTX ISA wgmma .m64nNk16):
//   A  64x16 per warpgroup: warp w holds rows 16w..16w+15 in the m16n8k16 A layout (four .b32 registers)
//   B  16xN in shared memory, K-major: token n's 16 K values at row n of a 128-byte swizzled slab
//   D  64xN: thread (warp w, lane 4g+t) holds, for n8 chunk j, d[4j+0..1] = row 16w+g, cols 8j+2t+{0,1}
//      and d[4j+2..3] = row 16w+g+8, same cols (N/2 registers).
#pragma once

#include <cstdint>

namespace fp4moe::kernels::sm90 {

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups 1024 bytes apart (SBO),
// LBO unused for swizzled K-major layouts (1). The k16 step within a 64-wide slab advances the start
// address by 32 bytes; the slab must be 1024-byte aligned (base offset 0).
__device__ __forceinline__ uint64_t make_desc_sw128(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

// ---- wgmma m64nNk16 ---------------------------------------------------------------------------------
// One asm body serves every width. NOTE: an asm statement takes neither a pack expansion in its operand
// list nor a computed string, so the preprocessor writes both lists: the N/2 accumulators are operands
// 0..N/2-1 ("+f"), then A (4 registers), the descriptor and the scale-d flag. FP4MOE_WGMMA_R<k> holds
// the operand numbers 4k..4k+5: for k < N/8 the four accumulators of quad k, for k = N/8 the six
// operands after them. FP4MOE_WGMMA_EACH_<n>(F0, F) applies F0 to quad 0 and F to quads 1..n-1.
#define FP4MOE_WGMMA_R0 0, 1, 2, 3, 4, 5
#define FP4MOE_WGMMA_R1 4, 5, 6, 7, 8, 9
#define FP4MOE_WGMMA_R2 8, 9, 10, 11, 12, 13
#define FP4MOE_WGMMA_R3 12, 13, 14, 15, 16, 17
#define FP4MOE_WGMMA_R4 16, 17, 18, 19, 20, 21
#define FP4MOE_WGMMA_R5 20, 21, 22, 23, 24, 25
#define FP4MOE_WGMMA_R6 24, 25, 26, 27, 28, 29
#define FP4MOE_WGMMA_R7 28, 29, 30, 31, 32, 33
#define FP4MOE_WGMMA_R8 32, 33, 34, 35, 36, 37
#define FP4MOE_WGMMA_R9 36, 37, 38, 39, 40, 41
#define FP4MOE_WGMMA_R10 40, 41, 42, 43, 44, 45
#define FP4MOE_WGMMA_R11 44, 45, 46, 47, 48, 49
#define FP4MOE_WGMMA_R12 48, 49, 50, 51, 52, 53
#define FP4MOE_WGMMA_R13 52, 53, 54, 55, 56, 57
#define FP4MOE_WGMMA_R14 56, 57, 58, 59, 60, 61
#define FP4MOE_WGMMA_R15 60, 61, 62, 63, 64, 65
#define FP4MOE_WGMMA_R16 64, 65, 66, 67, 68, 69
#define FP4MOE_WGMMA_R17 68, 69, 70, 71, 72, 73
#define FP4MOE_WGMMA_R18 72, 73, 74, 75, 76, 77
#define FP4MOE_WGMMA_R19 76, 77, 78, 79, 80, 81
#define FP4MOE_WGMMA_R20 80, 81, 82, 83, 84, 85
#define FP4MOE_WGMMA_R21 84, 85, 86, 87, 88, 89
#define FP4MOE_WGMMA_R22 88, 89, 90, 91, 92, 93
#define FP4MOE_WGMMA_R23 92, 93, 94, 95, 96, 97
#define FP4MOE_WGMMA_R24 96, 97, 98, 99, 100, 101
#define FP4MOE_WGMMA_R25 100, 101, 102, 103, 104, 105
#define FP4MOE_WGMMA_R26 104, 105, 106, 107, 108, 109
#define FP4MOE_WGMMA_R27 108, 109, 110, 111, 112, 113
#define FP4MOE_WGMMA_R28 112, 113, 114, 115, 116, 117
#define FP4MOE_WGMMA_R29 116, 117, 118, 119, 120, 121
#define FP4MOE_WGMMA_R30 120, 121, 122, 123, 124, 125
#define FP4MOE_WGMMA_R31 124, 125, 126, 127, 128, 129
#define FP4MOE_WGMMA_R32 128, 129, 130, 131, 132, 133

#define FP4MOE_WGMMA_CALL(F, ...) F(__VA_ARGS__)
#define FP4MOE_WGMMA_EACH_1(F0, F) FP4MOE_WGMMA_CALL(F0, FP4MOE_WGMMA_R0)
#define FP4MOE_WGMMA_EACH_2(F0, F) FP4MOE_WGMMA_EACH_1(F0, F) FP4MOE_WGMMA_CALL(F, FP4MOE_WGMMA_R1)
#define FP4MOE_WGMMA_EACH_4(F0, F) FP4MOE_WGMMA_EACH_2(F0, F) FP4MOE_WGMMA_CALL(F, FP4MOE_WGMMA_R2) \
    FP4MOE_WGMMA_CALL(F, FP4MOE_WGMMA_R3)
#define FP4MOE_WGMMA_EACH_6(F0, F) FP4MOE_WGMMA_EACH_4(F0, F) FP4MOE_WGMMA_CALL(F, FP4MOE_WGMMA_R4) \
    FP4MOE_WGMMA_CALL(F, FP4MOE_WGMMA_R5)
#define FP4MOE_WGMMA_EACH_8(F0, F) FP4MOE_WGMMA_EACH_6(F0, F) FP4MOE_WGMMA_CALL(F, FP4MOE_WGMMA_R6) \
    FP4MOE_WGMMA_CALL(F, FP4MOE_WGMMA_R7)
#define FP4MOE_WGMMA_EACH_12(F0, F) FP4MOE_WGMMA_EACH_8(F0, F) FP4MOE_WGMMA_CALL(F, FP4MOE_WGMMA_R8) \
    FP4MOE_WGMMA_CALL(F, FP4MOE_WGMMA_R9) FP4MOE_WGMMA_CALL(F, FP4MOE_WGMMA_R10) \
    FP4MOE_WGMMA_CALL(F, FP4MOE_WGMMA_R11)
#define FP4MOE_WGMMA_EACH_16(F0, F) FP4MOE_WGMMA_EACH_12(F0, F) FP4MOE_WGMMA_CALL(F, FP4MOE_WGMMA_R12) \
    FP4MOE_WGMMA_CALL(F, FP4MOE_WGMMA_R13) FP4MOE_WGMMA_CALL(F, FP4MOE_WGMMA_R14) \
    FP4MOE_WGMMA_CALL(F, FP4MOE_WGMMA_R15)
#define FP4MOE_WGMMA_EACH_32(F0, F) FP4MOE_WGMMA_EACH_16(F0, F) FP4MOE_WGMMA_CALL(F, FP4MOE_WGMMA_R16) \
    FP4MOE_WGMMA_CALL(F, FP4MOE_WGMMA_R17) FP4MOE_WGMMA_CALL(F, FP4MOE_WGMMA_R18) \
    FP4MOE_WGMMA_CALL(F, FP4MOE_WGMMA_R19) FP4MOE_WGMMA_CALL(F, FP4MOE_WGMMA_R20) \
    FP4MOE_WGMMA_CALL(F, FP4MOE_WGMMA_R21) FP4MOE_WGMMA_CALL(F, FP4MOE_WGMMA_R22) \
    FP4MOE_WGMMA_CALL(F, FP4MOE_WGMMA_R23) FP4MOE_WGMMA_CALL(F, FP4MOE_WGMMA_R24) \
    FP4MOE_WGMMA_CALL(F, FP4MOE_WGMMA_R25) FP4MOE_WGMMA_CALL(F, FP4MOE_WGMMA_R26) \
    FP4MOE_WGMMA_CALL(F, FP4MOE_WGMMA_R27) FP4MOE_WGMMA_CALL(F, FP4MOE_WGMMA_R28) \
    FP4MOE_WGMMA_CALL(F, FP4MOE_WGMMA_R29) FP4MOE_WGMMA_CALL(F, FP4MOE_WGMMA_R30) \
    FP4MOE_WGMMA_CALL(F, FP4MOE_WGMMA_R31)

// Quad pieces: of the asm string ("%i, ..."), of the output operands ("+f"(d[i]), ...).
#define FP4MOE_WGMMA_STR0(r0, r1, r2, r3, r4, r5) "%" #r0 ", %" #r1 ", %" #r2 ", %" #r3
#define FP4MOE_WGMMA_STR(r0, r1, r2, r3, r4, r5) ", %" #r0 ", %" #r1 ", %" #r2 ", %" #r3
#define FP4MOE_WGMMA_OUT0(r0, r1, r2, r3, r4, r5) "+f"(d[r0]), "+f"(d[r1]), "+f"(d[r2]), "+f"(d[r3])
#define FP4MOE_WGMMA_OUT(r0, r1, r2, r3, r4, r5) , "+f"(d[r0]), "+f"(d[r1]), "+f"(d[r2]), "+f"(d[r3])
// The six operands after the accumulators: A, the descriptor, the scale-d flag (the predicate p).
#define FP4MOE_WGMMA_SETP(r0, r1, r2, r3, r4, r5) "{\n.reg .pred p;\nsetp.ne.b32 p, %" #r5 ", 0;\n"
#define FP4MOE_WGMMA_TAIL(r0, r1, r2, r3, r4, r5) "}, {%" #r0 ", %" #r1 ", %" #r2 ", %" #r3 "}, %" #r4 ", p, 1, 1, 0;\n}\n"
// D[64 x N] += A[64 x 16] * B[16 x N] (scale-d 1: accumulate), with k = N/8 accumulator quads.
#define FP4MOE_WGMMA_ASM(N, k)                                                                                \
  asm volatile(FP4MOE_WGMMA_CALL(FP4MOE_WGMMA_SETP, FP4MOE_WGMMA_R##k)                                        \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 {"                                 \
               FP4MOE_WGMMA_EACH_##k(FP4MOE_WGMMA_STR0, FP4MOE_WGMMA_STR)                                    \
               FP4MOE_WGMMA_CALL(FP4MOE_WGMMA_TAIL, FP4MOE_WGMMA_R##k)                                       \
               : FP4MOE_WGMMA_EACH_##k(FP4MOE_WGMMA_OUT0, FP4MOE_WGMMA_OUT)                                  \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1))

// D[64 x N] += A[64 x 16] (registers) * B[16 x N] (shared memory, K-major, 128-byte swizzle): d[0..N/2)
// of an accumulator array of ACC >= N/2 floats.
template <int N, int ACC>
__device__ __forceinline__ void wgmma_m64nNk16(float (&d)[ACC], const uint32_t (&a)[4], uint64_t desc_b) {
  static_assert(N / 2 <= ACC, "accumulator array too small for the wgmma width");
  if constexpr (N == 8) FP4MOE_WGMMA_ASM(8, 1);
  else if constexpr (N == 16) FP4MOE_WGMMA_ASM(16, 2);
  else if constexpr (N == 32) FP4MOE_WGMMA_ASM(32, 4);
  else if constexpr (N == 48) FP4MOE_WGMMA_ASM(48, 6);
  else if constexpr (N == 64) FP4MOE_WGMMA_ASM(64, 8);
  else if constexpr (N == 96) FP4MOE_WGMMA_ASM(96, 12);
  else if constexpr (N == 128) FP4MOE_WGMMA_ASM(128, 16);
  else {
    static_assert(N == 256, "instantiated wgmma widths: 8, 16, 32, 48, 64, 96, 128, 256");
    FP4MOE_WGMMA_ASM(256, 32);
  }
}

#undef FP4MOE_WGMMA_ASM
#undef FP4MOE_WGMMA_TAIL
#undef FP4MOE_WGMMA_SETP
#undef FP4MOE_WGMMA_OUT
#undef FP4MOE_WGMMA_OUT0
#undef FP4MOE_WGMMA_STR
#undef FP4MOE_WGMMA_STR0
#undef FP4MOE_WGMMA_EACH_1
#undef FP4MOE_WGMMA_EACH_2
#undef FP4MOE_WGMMA_EACH_4
#undef FP4MOE_WGMMA_EACH_6
#undef FP4MOE_WGMMA_EACH_8
#undef FP4MOE_WGMMA_EACH_12
#undef FP4MOE_WGMMA_EACH_16
#undef FP4MOE_WGMMA_EACH_32
#undef FP4MOE_WGMMA_CALL
#undef FP4MOE_WGMMA_R0
#undef FP4MOE_WGMMA_R1
#undef FP4MOE_WGMMA_R2
#undef FP4MOE_WGMMA_R3
#undef FP4MOE_WGMMA_R4
#undef FP4MOE_WGMMA_R5
#undef FP4MOE_WGMMA_R6
#undef FP4MOE_WGMMA_R7
#undef FP4MOE_WGMMA_R8
#undef FP4MOE_WGMMA_R9
#undef FP4MOE_WGMMA_R10
#undef FP4MOE_WGMMA_R11
#undef FP4MOE_WGMMA_R12
#undef FP4MOE_WGMMA_R13
#undef FP4MOE_WGMMA_R14
#undef FP4MOE_WGMMA_R15
#undef FP4MOE_WGMMA_R16
#undef FP4MOE_WGMMA_R17
#undef FP4MOE_WGMMA_R18
#undef FP4MOE_WGMMA_R19
#undef FP4MOE_WGMMA_R20
#undef FP4MOE_WGMMA_R21
#undef FP4MOE_WGMMA_R22
#undef FP4MOE_WGMMA_R23
#undef FP4MOE_WGMMA_R24
#undef FP4MOE_WGMMA_R25
#undef FP4MOE_WGMMA_R26
#undef FP4MOE_WGMMA_R27
#undef FP4MOE_WGMMA_R28
#undef FP4MOE_WGMMA_R29
#undef FP4MOE_WGMMA_R30
#undef FP4MOE_WGMMA_R31
#undef FP4MOE_WGMMA_R32

}  // namespace fp4moe::kernels::sm90
