// kernels/expert_gemm_sm90.cuh — the NVFP4 expert GEMM for sm_90a: FP4 weights decoded in registers
// to bf16 and fed as the register A operand of wgmma; tokens are the MMA N dimension ("swap AB").
//
// One CTA computes a tile of 256 weight rows (GEMM1 gated: 128 gate rows + the 128 matching up rows)
// x 128 token rows (one entry of the tile table) over the whole K (the other tile shapes, TileConfig:
// 128 x 256 and, two CTAs per SM, 128 x 64):
//   warpgroup 2     producer (setmaxnreg 56; 32 at two CTAs per SM): one thread issues the bulk tensor copies (TMA) of each
//                   128-wide K chunk into a 4-stage ring, all completing on the stage's `full` mbarrier
//                   (expect_tx of the bytes the stage loads; out-of-bounds parts of a box are
//                   zero-filled and counted):
//                     activations [2 slabs of 64 K][128 tokens][128 B], 128-byte swizzled (2-D map),
//                       only the rows the tile's wgmma width reads (boxes of kActBoxRows rows)
//                     weights [32 slots][512 B] + scales [32 slots][64 B] (prepacked; 4-D/5-D maps)
//                   Slot j < 16 holds row group j of the CTA's first half (gate groups when gated),
//                   slot 16 + j the matching group of its second half (the matching up groups).
//                   GEMM1 with the gather fused (a_row_to_entry, `a` un-permuted [T, K]): the whole
//                   warpgroup copies the activation rows with cp.async instead (producer_gather), into
//                   the same swizzled slabs; the weights and scales stay bulk tensor copies.
//   warpgroups 0-1  consumers (setmaxnreg 224; 104); warpgroup c, block b (0..kBlocks-1), warp w own the
//                   m16 tile mt = 4 kBlocks c + 4b + w: rows g from slot mt, rows g+8 from slot kSlots/2 + mt
//                   (CTA-local weight rows 8mt + g and kBlockN/2 + 8mt + g; gated: gate and up of
//                   intermediate column 8mt + g).
//                   Per stage: wait `full`, load 4 x 16 B of weights + 4 x 8 B of scales, then per
//                   word q (two k16 steps): decode_word + bf16x2 scale multiply -> A fragments,
//                   one wgmma group (m64nNk16, both blocks). The next stage's loads and word-0
//                   decode overlap the stage's last groups; stages go in pairs, the wgmma stream
//                   drains once per pair; a stage is released (`empty`) once its last group is done.
//                   N (8, 16, 32, 48, 64, 96 or 128; powers of two with 64- and 256-token tiles) is
//                   the smallest instantiated wgmma width that covers the tile's valid token rows
//                   (wgmma_width).
//   epilogue        h = alpha[e] * (2^8 * acc) (fp32, see expert_gemm_layout.cuh for the 2^8), then
//                     GEMM1: staged through shared memory as [row][token] fp32, then per (token, 16
//                            columns; the activation kind a template parameter): activation, bf16
//                            (w4a16) or NVFP4 fake-quantization with act_scale[e] (w4a4, branch-free
//                            per element), written as 2 x 16 B.
//                     GEMM2: fp32 y[row_to_entry[row] * N + n], staged [token][row] in the ring and
//                            copied out a warp per token row (16-byte stores); with top-1 routing the
//                            finalized bf16 output instead (finalize fused), staged [token][row] as
//                            bf16 and copied out the same way.
// Tails: K is padded to 128 in the prepacked weights (zero weights) and the activation columns past K
// are zero-filled by the copy; weight row groups past N are zero-filled; token rows past the tile's
// valid rows (the next expert's rows, or zeros past the last row) only reach accumulator columns that
// are never written.
//
// Fragment shapes (PTX ISA wgmma .m64nNk16, A from registers, .bf16, f32 accumulators):
//   A  64x16 per warpgroup: warp w holds rows 16w..16w+15 in the m16n8k16 A layout (see layout header)
//   B  16xN in shared memory, K-major: token n's 16 K values at row n of a 128-byte swizzled slab
//   D  64xN: thread (warp w, lane 4g+t) holds, for n8 chunk j, d[4j+0..1] = row 16w+g, cols 8j+2t+{0,1}
//      and d[4j+2..3] = row 16w+g+8, same cols.
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "fp4moe/problem.hpp"
#include "kernels/dependent_launch.cuh"
#include "kernels/div_rn.cuh"
#include "kernels/expert_gemm_layout.cuh"
#include "kernels/expert_gemm_staging.cuh"
#include "kernels/nvfp4_device.cuh"

namespace fp4moe::kernels::sm90gemm {

inline constexpr int kConsumerThreads = 256;  // two warpgroups
inline constexpr int kProducerThreads = 128;  // one warpgroup (register reallocation is per warpgroup)
inline constexpr int kThreads = kConsumerThreads + kProducerThreads;
inline constexpr int kSmRegisters = 65536;    // registers per SM (sm_90)
inline constexpr int kRasterGroup = 8;        // token tiles per raster group (L2 reuse of weights)
inline constexpr int kMaxSmemBytes = 232448;  // sm_90 opt-in limit per CTA (227 KiB)
inline constexpr int kSmSmemBytes = 233472;   // shared memory per SM (228 KiB)

// The three tile shapes (MoeTactic::tile_tokens):
//   256 tokens: 128 weight rows per CTA, 1 m64 block per consumer warpgroup (m64n256 wgmma), 3 stages of 73 KiB;
//               each decoded A fragment feeds twice the tokens (half the decode per flop).
//   128 tokens: 256 weight rows per CTA, 2 m64 blocks per consumer warpgroup, 4 stages of 50 KiB.
//    64 tokens: 128 weight rows per CTA, 1 m64 block per warpgroup, 4 stages of 25 KiB, 2 CTAs per SM.
//               For experts with few rows (m <= 64), where the consumers' decode chains and the
//               per-tile pipeline fill and epilogue bound the kernel, not the tensor pipe: the second
//               CTA's 8 consumer warps hide the first's latencies and run their main loop while the
//               first fills its ring or runs its epilogue.
// The 128- and 256-token tiles keep 128 accumulator registers per consumer thread (64 x kTileRows
// per m64 block); the 64-token tile 32.
template <int TileTokens>
struct TileConfig {
  static_assert(TileTokens == 64 || TileTokens == 128 || TileTokens == 256, "tile_tokens is 64, 128 or 256");
  static constexpr int kTileRows = TileTokens;                   // token rows per tile
  static constexpr int kBlocks = TileTokens == 128 ? 2 : 1;      // m64 blocks per consumer warpgroup
  static constexpr int kBlockN = 128 * kBlocks;                  // weight rows per CTA
  static constexpr int kSlots = kBlockN / 8;                     // row groups per CTA
  static constexpr int kStages = TileTokens == 256 ? 3 : 4;
  static constexpr int kCtasPerSm = TileTokens == 64 ? 2 : 1;
  static constexpr int kAcc = TileTokens / 2;                    // accumulators per thread per block
  static constexpr int kSlabBytes = kTileRows * 128;             // 64 K of kTileRows tokens
  // Activation rows per bulk tensor copy box: a stage loads only the boxes that cover the wgmma width
  // of the tile (wgmma_width), so a tile with few valid rows does not pull a whole slab from L2.
  static constexpr int kActBoxRows = TileTokens / 4;  // 16 / 32 / 64
  static constexpr int kMinWidth = TileTokens == 256 ? 64 : 8;   // the narrowest wgmma instantiated
  // Widths 48 and 96 (3/4 of 64 and 128) as well, for 128-token tiles: a tile of 65..96 valid rows
  // runs m64n96 instead of m64n128 (25% fewer tensor cycles per k16 step). Not for 256-token tiles,
  // whose partial tiles are a few percent of their tiles, nor for 64-token tiles: there width 48
  // made GEMM2 3-12% slower (llama4-scout T = 512; three 16-row activation boxes per slab instead of
  // one 64-row copy, or the narrower wgmma at two CTAs per SM: not separated; docs/perf.md, 2026-12-05).
  static constexpr bool kThreeQuarterWidths = TileTokens == 128;
  static constexpr int kActBytes = 2 * kSlabBytes;
  static constexpr int kWeightBytes = kSlots * fp4layout::kChunkBytes;
  static constexpr int kScaleBytes = kSlots * fp4layout::kChunkScaleBytes;
  static constexpr int kStageBytes = kActBytes + kWeightBytes + kScaleBytes;  // 25 / 50 / 73 KiB, one expect_tx
  // GEMM1 staging [row][token] fp32 (kernels/expert_gemm_staging.cuh: row r starts at
  // r * kStagingStride + staging::row_shift(r)).
  static constexpr int kStagingStride = staging::stride(kTileRows);  // 104 / 168 / 296 floats
  static constexpr int kYStride = kBlockN + 4;          // GEMM2 y staging [token][kBlockN] (floats per row)
  static constexpr int kOutStride = kBlockN + 8;        // GEMM2 top-1 out staging [token][kBlockN] (bf16 per row)
  static constexpr int kBarrierOffset = kStages * kStageBytes;
  static constexpr int kTokenEntryOffset = kBarrierOffset + 2 * kStages * 8;
  static constexpr size_t kSmemBytes = 1024 + kTokenEntryOffset + kTileRows * 8;  // entries or row addresses
  // Registers: the launch bound gives each thread kLaunchRegs (a multiple of 8); setmaxnreg moves
  // them from the producer warpgroup to the consumers.
  // NOTE: setmaxnreg.inc draws from the registers the CTA was launched with (kThreads * kLaunchRegs);
  // asking for more than the producer gave back blocks forever.
  static constexpr int kLaunchRegs = kSmRegisters / (kThreads * kCtasPerSm) / 8 * 8;  // 168 / 80
  static constexpr int kProducerRegs = kCtasPerSm == 1 ? 56 : 32;
  static constexpr int kConsumerRegs = kCtasPerSm == 1 ? 224 : 104;
  static_assert(kStageBytes % 1024 == 0, "swizzled activation slabs need 1024-byte alignment");
  static_assert(kBlockN * kStagingStride * 4 <= kStages * kStageBytes, "GEMM1 staging must fit the ring");
  static_assert(kStagingStride % 32 == 8, "float2 staging stores: 16 lanes per phase on distinct banks");
  static_assert(kTileRows * kYStride * 4 <= kStages * kStageBytes, "GEMM2 staging must fit the ring");
  static_assert(kYStride % 16 == 4, "y staging stores: tokens 2t land 8 banks apart");
  static_assert(kYStride * 4 % 16 == 0, "y is copied out of 16-byte aligned staging rows");
  static_assert(kTileRows * kOutStride * 2 <= kStages * kStageBytes, "GEMM2 top-1 staging must fit the ring");
  static_assert(kOutStride * 2 % 16 == 0 && kOutStride / 2 % 32 == 4, "out staging: 16-byte rows, tokens 2t 8 banks apart");
  static_assert(kSmemBytes <= kMaxSmemBytes, "shared memory budget");
  static_assert(kCtasPerSm * (kSmemBytes + 1024) <= kSmSmemBytes, "kCtasPerSm CTAs (1 KiB reserved each) per SM");
  static_assert(kBlocks * kAcc == (kCtasPerSm == 1 ? 128 : 32), "accumulator registers per consumer thread");
  static_assert(kProducerThreads * kProducerRegs + kConsumerThreads * kConsumerRegs <= kThreads * kLaunchRegs,
                "the register reallocation must fit the CTA's launch allocation");
  static_assert(kProducerRegs % 8 == 0 && kConsumerRegs % 8 == 0 && kProducerRegs >= 24 && kConsumerRegs <= 256,
                "setmaxnreg takes multiples of 8 in [24, 256]");
  static_assert(kTileRows <= 256 && kSlots / 2 <= 256, "bulk tensor copy boxes hold at most 256 rows");
  static_assert(kTileRows % kActBoxRows == 0 && kActBoxRows * 128 % 1024 == 0,
                "activation boxes tile the slab in whole 8-row swizzle atoms (1024-byte aligned)");
};

// The wgmma width N of a tile with valid_rows token rows (1..kTileRows): the smallest of the few
// instantiated widths that covers them: powers of two from kMinWidth, and with kThreeQuarterWidths
// 48 and 96. The consumers' dispatch and the producer's activation boxes both follow it: rows [0, N)
// of every slab are loaded (whole boxes: a 48-wide tile of 32-row boxes loads 64 rows).
// NOTE (tokens per expert at T = 512..2048): the presets' experts get 32..128 rows there, about half of
// them just above a power of two (65..96 of a 64-row mean), which wasted up to half the tensor cycles.
template <class C>
__host__ __device__ constexpr int wgmma_width(int valid_rows) {
  int n = C::kMinWidth;
  while (n < valid_rows && n < C::kTileRows) n *= 2;
  if (C::kThreeQuarterWidths && (n == 64 || n == 128) && valid_rows <= 3 * n / 4) return 3 * n / 4;
  return n;
}

enum class Epilogue : int { Gemm1Gated = 0, Gemm1Plain = 1, Gemm2 = 2 };

struct Params {
  const __nv_bfloat16* a;          // [rows, K]
  int rows;                        // rows of a (the bound of the activation copies)
  int num_experts;                 // E
  const uint8_t* w;                // prepacked
  const uint8_t* w_scale;          // prepacked
  const float* alpha;              // [E]
  const int32_t* expert_offsets;   // [E+1]
  const int32_t* tile_expert;      // [max_tiles]
  const int32_t* tile_row_start;   // [max_tiles]
  const int32_t* num_tiles;        // [1]
  int max_tiles;
  int n_ctas;                      // CTAs along N
  int K;                           // activation columns (unpadded)
  int groups;                      // N / 8
  int chunks;                      // padded K / 128
  int N;                           // weight rows
  Epilogue epilogue;
  // GEMM1
  ActivationParams act;
  int quantize;                    // 0: bf16(act), 1: NVFP4 q*sf with act_scale[e]
  const float* act_scale;          // [E]
  __nv_bfloat16* act_out;          // [T*k rows, out_cols]
  int out_cols;                    // I (GEMM1)
  const int32_t* a_row_to_entry;   // GEMM1 only: GEMM row r reads a[a_row_to_entry[r] / a_top_k]
  int a_top_k;                     //   (a un-permuted, [T, K]); nullptr: row r reads a[r]
  const float* bias;               // GEMM1: [E, N] w13_bias (rows [gate; up]) added to h before the
                                   //   activation, or nullptr
  // GEMM2
  const int32_t* row_to_entry;     // [rows]
  float* y;                        // [entries, N]
  __nv_bfloat16* out;              // top-1 only: [entries, N] finalized bf16 output instead of y
  const float* out_weights;        // [entries] finalize weights, or nullptr for unit weights
  int32_t* fin_counters;           // streaming GEMM2 only, top_k >= 2: [T][n_ctas] arrival counters of the
  int fin_top_k;                   //   fused finalize (y and out both written); nullptr: no fused finalize
};

// ---- PTX wrappers -----------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// After the initialising thread's mbar_init calls: the barriers are visible to the async proxy (TMA).
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// NOTE: the retry loop lives inside the asm block (labels are local to its braces): the C++ loop around
// a try_wait made ptxas wrap every wait in BSSY/BSYNC with a YIELD, ~4 of the ~21 loop-control
// instructions per chunk of the streaming GEMM (SASS).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\nWAIT_%=:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// ---- bulk tensor copies (TMA) -----------------------------------------------------------------------
// The maps of one launch (encoded on the host, expert_gemm.cu), passed as a __grid_constant__ parameter.
struct TmaMaps {
  CUtensorMap act;    // a [rows][K] bf16, box [kActBoxRows][64], 128-byte swizzle
  CUtensorMap act_tile;  // the same with box [kTileRows][64]: one copy per slab for a full-width tile
  CUtensorMap w;      // prepacked weights: gated (5-D) [E][2 halves][N/16 groups][chunks][512 B],
                      //   else (4-D) [E][N/8 groups][chunks][512 B]; box = the CTA's slots of one chunk
  CUtensorMap scale;  // the same over the prepacked scales (64 B per group and chunk)
};
__device__ __forceinline__ void tma_prefetch(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1, int c2,
                                            int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
__device__ __forceinline__ void tma_load_5d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1, int c2,
                                            int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6, %7}], "
      "[%2];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
      : "memory");
}
// 16-byte global -> shared copy; src_bytes 0 writes zeros (nothing is read).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// Arrives on the mbarrier once every cp.async the thread issued before has landed (.noinc: the arrival
// counts against the barrier's expected count).
__device__ __forceinline__ void cp_async_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
// NOTE: wgmma and bulk copies read shared memory through the async proxy; cp.async and st.shared
// writes are generic-proxy writes, so a fence sits between them: the writer's before it publishes
// (the GEMM2 epilogue: before the barrier that precedes its bulk stores), or the reader's after its
// barrier wait (the gathered GEMM1's cp.async rows: see producer_gather). TMA writes need no fence; the
// streaming kernel's cp.async activation rows are read by ldmatrix, a generic-proxy read, so need none
// either.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void consumer_sync() {  // named barrier 1: the 256 consumer threads
  asm volatile("bar.sync 1, %0;" ::"n"(kConsumerThreads) : "memory");
}
__device__ __forceinline__ void producer_sync() {  // named barrier 2: the producer warpgroup
  asm volatile("bar.sync 2, %0;" ::"n"(kProducerThreads) : "memory");
}
// Shared-memory loads by 32-bit shared address (volatile: they stay after the mbarrier wait).
__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint64_t lds_u64(uint32_t addr) {
  uint64_t v;
  asm volatile("ld.shared.u64 %0, [%1];" : "=l"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ float lds_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint2 lds64(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}
__device__ __forceinline__ void sts128_zero(uint32_t addr) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(addr), "r"(0u) : "memory");
}
__device__ __forceinline__ void fence_operand(float& x) { asm volatile("" : "+f"(x)::"memory"); }
// NOTE: registers are allocated per warpgroup; the producer gives most of its registers to the two
// consumer warpgroups (kProducerRegs / kConsumerRegs).
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}

// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups 1024 bytes apart (SBO),
// LBO unused for swizzled K-major layouts (1). The k16 step within a 64-wide slab advances the start
// address by 32 bytes; the slab must be 1024-byte aligned (base offset 0).
__device__ __forceinline__ uint64_t make_desc_sw128(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

// ---- wgmma m64nNk16, A from registers (bf16), f32 accumulators ---------------------------------
// D[64 x 8] += A[64 x 16] (registers) * B[16 x 8] (shared memory, K-major, 128B swizzle)
template <int ACC>
__device__ __forceinline__ void wgmma_m64n8k16(float (&d)[ACC], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 "
      "{"
      "%0, %1, %2, %3"
      "}, {%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

// D[64 x 16] += A[64 x 16] (registers) * B[16 x 16] (shared memory, K-major, 128B swizzle)
template <int ACC>
__device__ __forceinline__ void wgmma_m64n16k16(float (&d)[ACC], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7"
      "}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

// D[64 x 32] += A[64 x 16] (registers) * B[16 x 32] (shared memory, K-major, 128B swizzle)
template <int ACC>
__device__ __forceinline__ void wgmma_m64n32k16(float (&d)[ACC], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
      "}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

// D[64 x 48] += A[64 x 16] (registers) * B[16 x 48] (shared memory, K-major, 128B swizzle)
template <int ACC>
__device__ __forceinline__ void wgmma_m64n48k16(float (&d)[ACC], const uint32_t (&a)[4], uint64_t desc_b) {
  static_assert(ACC >= 24, "m64n48 needs 24 accumulators per thread");
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %29, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n48k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23}, {%24, %25, %26, %27}, %28, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

// D[64 x 64] += A[64 x 16] (registers) * B[16 x 64] (shared memory, K-major, 128B swizzle)
template <int ACC>
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[ACC], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

// D[64 x 96] += A[64 x 16] (registers) * B[16 x 96] (shared memory, K-major, 128B swizzle)
template <int ACC>
__device__ __forceinline__ void wgmma_m64n96k16(float (&d)[ACC], const uint32_t (&a)[4], uint64_t desc_b) {
  static_assert(ACC >= 48, "m64n96 needs 48 accumulators per thread");
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %53, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, {%48, %49, %50, %51}, %52, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

// D[64 x 128] += A[64 x 16] (registers) * B[16 x 128] (shared memory, K-major, 128B swizzle)
template <int ACC>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[ACC], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

// D[64 x 256] += A[64 x 16] (registers) * B[16 x 256] (shared memory, K-major, 128B swizzle)
template <int ACC>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[ACC], const uint32_t (&a)[4], uint64_t desc_b) {
  static_assert(ACC >= 128, "m64n256 needs 128 accumulators per thread");
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

template <int NT, int ACC>
__device__ __forceinline__ void wgmma_tile(float (&d)[ACC], const uint32_t (&a)[4], uint64_t desc_b) {
  static_assert(NT / 2 <= ACC, "accumulator array too small for the wgmma width");
  if constexpr (NT == 8) wgmma_m64n8k16(d, a, desc_b);
  else if constexpr (NT == 16) wgmma_m64n16k16(d, a, desc_b);
  else if constexpr (NT == 32) wgmma_m64n32k16(d, a, desc_b);
  else if constexpr (NT == 48) wgmma_m64n48k16(d, a, desc_b);
  else if constexpr (NT == 64) wgmma_m64n64k16(d, a, desc_b);
  else if constexpr (NT == 96) wgmma_m64n96k16(d, a, desc_b);
  else if constexpr (NT == 128) wgmma_m64n128k16(d, a, desc_b);
  else {
    static_assert(NT == 256, "instantiated wgmma widths: 8, 16, 32, 48, 64, 96, 128, 256");
    wgmma_m64n256k16(d, a, desc_b);
  }
}

// ---- decode -------------------------------------------------------------------------------------------
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
// The A fragments of word q of an m16 tile's chunk (both kernels): rows g from this lane's weight
// words wa and scale codes sa, rows g+8 from wb and sb; f0 = k16 step 2q, f1 = step 2q+1, each
// {a0 = row g cols 2t.., a1 = row g+8, a2 = row g cols 2t+8.., a3 = row g+8 cols 2t+8..}.
__device__ __forceinline__ void decode_fragments(const uint4& wa, const uint4& wb, const uint2& sa, const uint2& sb,
                                                 int q, uint32_t (&f0)[4], uint32_t (&f1)[4]) {
  const uint32_t sca = fp4layout::decode_scale_pair(q < 2 ? sa.x : sa.y, q & 1);
  const uint32_t scb = fp4layout::decode_scale_pair(q < 2 ? sb.x : sb.y, q & 1);
  uint32_t da[4], db[4];
  fp4layout::decode_word(word_of(wa, q), da);
  fp4layout::decode_word(word_of(wb, q), db);
  f0[0] = bf16x2_mul_lo(da[0], sca);
  f0[1] = bf16x2_mul_lo(db[0], scb);
  f0[2] = bf16x2_mul_lo(da[1], sca);
  f0[3] = bf16x2_mul_lo(db[1], scb);
  f1[0] = bf16x2_mul_hi(da[2], sca);
  f1[1] = bf16x2_mul_hi(db[2], scb);
  f1[2] = bf16x2_mul_hi(da[3], sca);
  f1[3] = bf16x2_mul_hi(db[3], scb);
}

// Consumer main loop over the K chunks with wgmma width NT; acc[b] is block b's 64xNT accumulator.
// One wgmma group per word q (2 k16 steps x 2 blocks); the group of word q+1 is decoded while the
// group of word q runs. Across a stage boundary, the next stage's barrier wait, shared-memory loads
// and word-0 decode are done while the stage's last two groups run.
// NOTE: keeping a register-A wgmma in flight across the loop's back edge makes ptxas serialise every
// wgmma (C7513), so the loop body holds two stages and drains (wait_group 0) once per pair.
template <class C, int NT>
__device__ __forceinline__ void consumer_mainloop(const Params& p, uint8_t* smem, uint32_t bar_base,
                                                  float (&acc)[C::kBlocks][C::kAcc]) {
  constexpr int kStages = C::kStages, kB = C::kBlocks;
  const int ctid = threadIdx.x;
  const int wg = ctid / 128, warp = (ctid / 32) % 4, lane = ctid % 32, g = lane / 4;
  const bool gather = p.a_row_to_entry != nullptr;  // GEMM1 with the gather fused (producer_gather)
  uint4 wa[kB], wb[kB];
  uint2 sa[kB], sb[kB];
  // Waits for stage kt's data and loads this thread's weight words and scale codes of it.
  auto load_stage = [&](int kt) {
    const int s = kt % kStages;
    mbar_wait(bar_base + 8 * s, (kt / kStages) & 1);
    if (gather) fence_proxy_async();  // the gather's cp.async rows (generic proxy), before wgmma reads them
    const uint32_t wsm = smem_addr(smem) + s * C::kStageBytes + C::kActBytes;
    const uint32_t ssm = wsm + C::kWeightBytes;
#pragma unroll
    for (int b = 0; b < kB; ++b) {
      const int mt = wg * 4 * kB + b * 4 + warp;  // rows g from slot mt, rows g+8 from slot kSlots/2 + mt
      constexpr int kHalf = C::kSlots / 2;
      wa[b] = lds128(wsm + mt * fp4layout::kChunkBytes + lane * 16);
      wb[b] = lds128(wsm + (kHalf + mt) * fp4layout::kChunkBytes + lane * 16);
      sa[b] = lds64(ssm + mt * fp4layout::kChunkScaleBytes + g * 8);
      sb[b] = lds64(ssm + (kHalf + mt) * fp4layout::kChunkScaleBytes + g * 8);
    }
  };
  // Fragments of word q: f[k16 step of the pair][block][register].
  auto decode = [&](int q, uint32_t (&f)[2][kB][4]) {
#pragma unroll
    for (int b = 0; b < kB; ++b) decode_fragments(wa[b], wb[b], sa[b], sb[b], q, f[0][b], f[1][b]);
  };
  uint32_t frag0[2][kB][4];     // word 0 (decoded ahead, at the end of the previous stage)
  uint32_t frag[2][2][kB][4];   // words 1..3: buffer q & 1
  // One wgmma group: the two k16 steps of word q of stage kt, both blocks.
  auto issue = [&](int kt, int q, const uint32_t (&f)[2][kB][4]) {
    // The descriptor's start address field is (address >> 4) and the ring lies below 2^18 bytes, so a
    // k16 step's descriptor is the stage's plus (offset >> 4): one add instead of a rebuild.
    const uint64_t desc0 = make_desc_sw128(smem_addr(smem) + (kt % kStages) * C::kStageBytes);
    wgmma_fence();
#pragma unroll
    for (int st = 0; st < 2; ++st) {
      const int step = 2 * q + st;  // k16 step of the chunk: slab step/4, 32 bytes per step inside it
      const uint64_t desc = desc0 + static_cast<uint64_t>(((step / 4) * C::kSlabBytes + (step % 4) * 32) >> 4);
#pragma unroll
      for (int b = 0; b < kB; ++b) wgmma_tile<NT>(acc[b], f[st][b], desc);
    }
    wgmma_commit();
  };
  // Words 1..3 of stage kt (word 0's group already issued), then the next stage's loads and word-0
  // decode while the groups of words 2 and 3 run.
  auto finish_stage = [&](int kt) {
#pragma unroll
    for (int q = 1; q < 4; ++q) {
      if (q == 3) wgmma_wait<1>();  // the group of word 1 (same buffer) is done
      decode(q, frag[q & 1]);
      issue(kt, q, frag[q & 1]);
    }
    if (kt + 1 < p.chunks) {
      wgmma_wait<2>();  // word 0's group is done: frag0 is free
      load_stage(kt + 1);
      decode(0, frag0);
    }
  };
  load_stage(0);
  decode(0, frag0);
  // Stages go in pairs: between the two stages of a pair the wgmma stream does not drain (the first
  // stage is released once its last group is done, after the second stage's first group is issued);
  // at the end of a pair it drains (see the NOTE above).
  for (int kt = 0; kt < p.chunks; kt += 2) {
    issue(kt, 0, frag0);
    finish_stage(kt);
    if (kt + 1 < p.chunks) {
      issue(kt + 1, 0, frag0);
      wgmma_wait<1>();  // stage kt's last group is done (word 1's buffer is free as well)
      mbar_arrive(bar_base + 8 * (kStages + kt % kStages));
      finish_stage(kt + 1);
      wgmma_wait<0>();
      mbar_arrive(bar_base + 8 * (kStages + (kt + 1) % kStages));
    } else {
      wgmma_wait<0>();
      mbar_arrive(bar_base + 8 * (kStages + kt % kStages));
    }
  }
#pragma unroll
  for (int b = 0; b < kB; ++b)
#pragma unroll
    for (int i = 0; i < C::kAcc; ++i) fence_operand(acc[b][i]);
}

// The producers' place in the ring: the stage of chunk kt and the parity of that stage's `empty`
// barrier's next completion (its first completion is the consumers' release of chunk kt - kStages).
template <int kStages>
struct RingSlot {
  int stage = 0, phase = 0;
  // Waits until the consumers released the stage; the first kStages chunks find their stages free.
  __device__ __forceinline__ void wait_free(uint32_t bar_base, int kt) const {
    if (kt >= kStages) mbar_wait(bar_base + 8 * (kStages + stage), phase);
  }
  // On to chunk kt + 1.
  __device__ __forceinline__ void advance(int kt) {
    if (++stage == kStages) {
      stage = 0;
      if (kt >= kStages) phase ^= 1;
    }
  }
};

// The bulk tensor copies of chunk kt's weight and scale slots of N tile ntile into a stage (w_base:
// (kSlots, 512 B), s_base: (kSlots, 64 B)), completing on `full`. Gated GEMM1's maps are
// (expert, half, group pair, chunk): slots [gate groups][up groups]; the others (expert, group, chunk):
// kSlots consecutive groups.
template <class C>
__device__ __forceinline__ void load_weight_slots(const TmaMaps& maps, uint32_t w_base, uint32_t s_base, uint32_t full,
                                                  int kt, int ntile, int expert, bool gated) {
  constexpr int kSlots = C::kSlots;
  if (gated) {
    tma_load_5d(w_base, &maps.w, full, 0, kt, ntile * (kSlots / 2), 0, expert);
    tma_load_5d(s_base, &maps.scale, full, 0, kt, ntile * (kSlots / 2), 0, expert);
  } else {
    tma_load_4d(w_base, &maps.w, full, 0, kt, ntile * kSlots, expert);
    tma_load_4d(s_base, &maps.scale, full, 0, kt, ntile * kSlots, expert);
  }
}

// Producer (one thread of the producer warpgroup): the bulk tensor copies of every K chunk into the
// ring. Stage s of chunk kt: wait until the consumers released it (chunk kt - kStages), announce the
// stage's bytes on full[s], then rows [0, width) of the 2 activation slabs (width / kActBoxRows boxes
// each, at least one) + the weight and scale slots of the chunk.
// NOTE: one thread issues 4-10 copies per stage; the cp.async producer it replaces issued ~700
// instructions per warp and chunk (address arithmetic per 16 bytes) and paced the consumers.
// NOTE: the activation slab is most of a stage's bytes (64 of 73 KiB with 256-token tiles), all of it
// from L2; a tile's tail (a few rows past a multiple of the tile) loads only its boxes.
template <class C>
__device__ __forceinline__ void producer(const Params& p, const TmaMaps& maps, uint8_t* smem, uint32_t bar_base,
                                         int expert, int ntile, int row_start, int width) {
  constexpr int kStages = C::kStages, kBox = C::kActBoxRows;
  const bool gated = p.epilogue == Epilogue::Gemm1Gated;
  const int boxes = (width + kBox - 1) / kBox;  // per slab
  const uint32_t stage_bytes = static_cast<uint32_t>(2 * boxes * kBox * 128 + C::kWeightBytes + C::kScaleBytes);
  tma_prefetch(&maps.act);
  tma_prefetch(&maps.act_tile);
  tma_prefetch(&maps.w);
  tma_prefetch(&maps.scale);
  RingSlot<kStages> ring;
  for (int kt = 0; kt < p.chunks; ++kt) {
    ring.wait_free(bar_base, kt);
    const int s = ring.stage;
    const uint32_t full = bar_base + 8 * s;
    const uint32_t act_base = smem_addr(smem) + s * C::kStageBytes;  // (2 slabs, tile rows, 128 B)
    const uint32_t w_base = act_base + C::kActBytes;                 // (kSlots, 512 B)
    const uint32_t s_base = w_base + C::kWeightBytes;                // (kSlots, 64 B)
    mbar_arrive_expect_tx(full, stage_bytes);  // out-of-bounds parts of a box count as well
    const int kcol = kt * fp4layout::kChunkK;
    if (width == C::kTileRows) {  // NOTE: a full-width tile in one copy per slab (fewer, larger TMA requests)
      tma_load_2d(act_base, &maps.act_tile, full, kcol, row_start);
      tma_load_2d(act_base + C::kSlabBytes, &maps.act_tile, full, kcol + 64, row_start);
    } else {
      for (int bx = 0; bx < boxes; ++bx) {  // (box rows, 128 B) at row bx * kBox of each slab
        tma_load_2d(act_base + bx * kBox * 128, &maps.act, full, kcol, row_start + bx * kBox);
        tma_load_2d(act_base + C::kSlabBytes + bx * kBox * 128, &maps.act, full, kcol + 64, row_start + bx * kBox);
      }
    }
    load_weight_slots<C>(maps, w_base, s_base, full, kt, ntile, expert, gated);
    ring.advance(kt);
  }
}

// Producer with the gather fused (GEMM1 with Params::a_row_to_entry: `a` is the un-permuted [T, K] and
// tile row r reads token a_row_to_entry[row_start + r] / a_top_k). Every thread of the producer
// warpgroup runs it:
//   1. the address of each valid tile row's activation row goes to shared memory (row_ptr); rows
//      [valid_rows, wgmma width) of every stage are zeroed once (no copy ever writes them).
//   2. thread (sub = ptid / 8, c = ptid % 8) owns rows r = sub + 16 i of the tile and 16-byte column c
//      of each 64-wide slab. Per chunk kt (stage s): wait `empty`; thread 0 announces the weight and
//      scale bytes on full[s] and issues their bulk tensor copies; every thread copies its pieces of
//      the valid rows with cp.async, written where the 128-byte swizzle of the bulk tensor copy puts
//      them (chunk c of row r at r * 128 + (c ^ (r % 8)) * 16; columns past K zero-filled), then
//      arrives on full[s] when they land (cp.async.mbarrier.arrive.noinc: kProducerThreads arrivals
//      besides the expect_tx one), without waiting for them.
// NOTE: cp.async (and st.shared) write through the generic proxy and wgmma reads through the async
// proxy: the consumers fence (fence.proxy.async) after their wait on full[s] when the gather is on. A
// fence on the producer side would need the producer to wait for its copies: its MEMBAR waits for
// every copy in flight, which held the ring to about one chunk in flight (GEMM1 up to 1.18x slower;
// 1.52x with a warp per chunk). The consumers' fence costs little: without it (a bound, not correct)
// GEMM1 is still up to 1.07x slower than with bulk tensor copies of permuted rows (up to 1.10x with a
// relay thread fencing for the consumers); the layer still gains (no gather_quantize launch;
// docs/perf.md, twenty-third session).
// NOTE: a warp's copy covers 4 rows x 128 contiguous bytes (8 lanes per row): whole 32-byte sectors.
// NOTE: the row addresses live in shared memory, read once per copy: held in registers (16 per thread
// with 256-token tiles) they spilled at the producer's 56 registers.
template <class C>
__device__ __forceinline__ void producer_gather(const Params& p, const TmaMaps& maps, uint8_t* smem, uint32_t bar_base,
                                                uint64_t* row_ptr, int expert, int ntile, int row_start,
                                                int valid_rows, int width) {
  constexpr int kStages = C::kStages, kRowsPerThread = C::kTileRows / 16;
  static_assert(kProducerThreads == 128, "8 threads per 128-byte row piece, 16 rows per pass");
  const int ptid = static_cast<int>(threadIdx.x) - kConsumerThreads;
  const int sub = ptid / 8, c = ptid % 8;
  const bool leader = ptid == 0;
  const bool gated = p.epilogue == Epilogue::Gemm1Gated;
  for (int r = ptid; r < valid_rows; r += kProducerThreads)
    row_ptr[r] = reinterpret_cast<uint64_t>(p.a + static_cast<int64_t>(p.a_row_to_entry[row_start + r] / p.a_top_k) * p.K);
  // Rows [valid_rows, width) of every stage and slab: 16 bytes per thread and step.
  const int zero_pieces = (width - valid_rows) * 8;
  for (int z = ptid; z < kStages * 2 * zero_pieces; z += kProducerThreads) {
    const int st = z / (2 * zero_pieces), rem = z % (2 * zero_pieces), slab = rem / zero_pieces, q = rem % zero_pieces;
    sts128_zero(smem_addr(smem) + st * C::kStageBytes + slab * C::kSlabBytes + (valid_rows + q / 8) * 128 + (q % 8) * 16);
  }
  producer_sync();  // row_ptr is written
  const uint32_t ptr_addr = smem_addr(row_ptr) + static_cast<uint32_t>(sub * 8);
  const uint32_t dst_thread = static_cast<uint32_t>(sub * 128 + ((c ^ (sub & 7)) * 16));  // (r & 7) == (sub & 7)
  if (leader) {
    tma_prefetch(&maps.w);
    tma_prefetch(&maps.scale);
  }
  RingSlot<kStages> ring;
  for (int kt = 0; kt < p.chunks; ++kt) {
    ring.wait_free(bar_base, kt);
    const int s = ring.stage;
    const uint32_t full = bar_base + 8 * s;
    const uint32_t act_base = smem_addr(smem) + s * C::kStageBytes;  // (2 slabs, tile rows, 128 B)
    if (leader) {
      const uint32_t w_base = act_base + C::kActBytes;   // (kSlots, 512 B)
      const uint32_t s_base = w_base + C::kWeightBytes;  // (kSlots, 64 B)
      mbar_arrive_expect_tx(full, C::kWeightBytes + C::kScaleBytes);
      load_weight_slots<C>(maps, w_base, s_base, full, kt, ntile, expert, gated);
    }
    const int col = kt * fp4layout::kChunkK + c * 8;  // first of the 8 columns of slab 0 (slab 1: +64)
    const uint32_t bytes0 = col < p.K ? 16u : 0u, bytes1 = col + 64 < p.K ? 16u : 0u;  // K % 16 == 0
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      if (16 * i + sub >= valid_rows) break;
      const __nv_bfloat16* src = reinterpret_cast<const __nv_bfloat16*>(lds_u64(ptr_addr + i * 16 * 8)) + col;
      const uint32_t dst = act_base + dst_thread + static_cast<uint32_t>(i * 16 * 128);
      cp_async16(dst, src, bytes0);
      cp_async16(dst + C::kSlabBytes, src + 64, bytes1);
    }
    cp_async_arrive_noinc(full);  // when this thread's copies (so far) have landed
    ring.advance(kt);
  }
}

// ---- epilogue helpers -----------------------------------------------------------------------------
// NOTE: the kind is a template parameter so that the 16 elements of an epilogue item are straight-line
// code the compiler can interleave (a run-time switch per element serialised them on their loads).
// The activation is split in two: the denominator of the sigmoid (exp, no branches) for all 16
// elements first, then the IEEE division (whose slow-path branch ends a basic block) and the rest.
template <Activation K>
__device__ __forceinline__ float activation_denominator(const ActivationParams& a, float g) {
  if constexpr (K == Activation::SwiGLU) {
    return __fadd_rn(1.0f, expf(-g));
  } else if constexpr (K == Activation::SwiGLUOai) {
    const float gc = g > a.swiglu_limit ? a.swiglu_limit : g;  // min(g, L), NaN stays NaN
    return __fadd_rn(1.0f, expf(-__fmul_rn(a.swiglu_alpha, gc)));
  } else {
    return 1.0f;  // unused
  }
}
// The kinds that divide by the denominator: numerator / den is their one IEEE division.
template <Activation K>
inline constexpr bool kActivationDivides = K == Activation::SwiGLU || K == Activation::SwiGLUOai;
template <Activation K>
__device__ __forceinline__ float activation_numerator(float g) {
  return K == Activation::SwiGLU ? g : 1.0f;  // silu(g) = g / den; sigmoid = 1 / den
}
// The activation given quot = activation_numerator(g) / den (IEEE) for the dividing kinds.
template <Activation K>
__device__ __forceinline__ float activation_from_quotient(const ActivationParams& a, float g, float u, float quot) {
  if constexpr (K == Activation::SwiGLU) {
    return __fmul_rn(quot, u);
  } else if constexpr (K == Activation::GeGLU) {
    const float gelu = __fmul_rn(__fmul_rn(0.5f, g), __fadd_rn(1.0f, erff(__fmul_rn(g, 0.70710678118654752f))));
    return __fmul_rn(gelu, u);
  } else if constexpr (K == Activation::SwiGLUOai) {
    const float L = a.swiglu_limit;
    const float gc = g > L ? L : g;                     // min(g, L), NaN stays NaN
    const float uc = u > L ? L : (u < -L ? -L : u);     // clamp(u, -L, L), NaN stays NaN
    return __fmul_rn(__fmul_rn(gc, quot), __fadd_rn(uc, a.swiglu_beta));
  } else {  // Relu2
    const float r = g < 0.0f ? 0.0f : g;  // max(h, 0), NaN stays NaN
    return __fmul_rn(r, r);
  }
}
template <Activation K>
__device__ __forceinline__ float activation(const ActivationParams& a, float g, float u, float den) {
  const float quot = kActivationDivides<K> ? __fdiv_rn(activation_numerator<K>(g), den) : 0.0f;
  return activation_from_quotient<K>(a, g, u, quot);
}
__device__ __forceinline__ float epilogue_scale(float alpha, float acc) {
  return __fmul_rn(alpha, __fmul_rn(acc, fp4layout::kAccumulatorScale));  // the 2^8 is exact
}
using nvfp4::pack_bf16x2;  // RNE each

// GEMM1 epilogue items: item = (token, 16 consecutive output columns) of the staged tile; all 16 (32
// when gated) staged values are loaded first, then the activation and (w4a4) the re-quantization.
// Gated kinds read gate column i at staging row i and up at row kUpRow + i; relu2 reads row i.
// kStride (floats per staging row), kUpRow (kBlockN / 2) and kNumThreads (threads 0..kNumThreads-1
// share the items) describe the wgmma kernel's staging tile; the streaming kernel spreads the same
// arithmetic over (token, 2 columns) pairs instead (sm90stream::gemm1_pairs).
// Items in the order of staging::item: a warp covers 8 tokens x 4 blocks of 16 columns, so each of its
// 16-byte stores writes 8 token rows (4 x 16 B in each) instead of 32.
// NOTE: with lanes along 32 tokens, every store instruction touched 32 lines (one per token row).
template <Activation K, int kStride, int kUpRow, int kNumThreads>
__device__ __forceinline__ void gemm1_items(const Params& p, const float* stg, const float* bias, int64_t out_base,
                                            int blocks, int valid_rows, float gs, float inv_gs) {
  constexpr bool kGated = K != Activation::Relu2;
  static_assert(kUpRow % 64 == 0, "up rows keep the staging shift of their gate rows");
  const int items = staging::item_count(valid_rows, blocks);
  for (int item = threadIdx.x; item < items; item += kNumThreads) {
    const staging::Item it = staging::item(item, blocks);
    const int tok = it.token, blk = it.block;
    if (tok >= valid_rows) continue;
    const uint32_t src = smem_addr(stg + (blk * 16) * kStride + tok + staging::row_shift(blk * 16));
    float h[16], u[16], x[16];
    // NOTE: volatile loads, all issued before any math: plain loads were sunk next to each element's
    // use, between the division slow-path branches, and paid the load latency 16 times.
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      h[i] = lds_f32(src + i * kStride * 4);
      u[i] = kGated ? lds_f32(src + (kUpRow + i) * kStride * 4) : 0.0f;
    }
    if (bias != nullptr) {  // kernel-uniform: h = alpha * acc + b, one fp32 add (expert biases)
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        h[i] = __fadd_rn(h[i], bias[blk * 16 + i]);
        if (kGated) u[i] = __fadd_rn(u[i], bias[p.out_cols + blk * 16 + i]);
      }
    }
    float den[16], quot[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) den[i] = activation_denominator<K>(p.act, h[i]);
    if constexpr (kActivationDivides<K>) {
      // NOTE: the 16 divisions by the branch-free fast path, then one branch for the item: as
      // __fdiv_rn each was a region of its own with a slow-path call, and the 16 ran one after another.
      bool fast = true;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const float num = activation_numerator<K>(h[i]);
        quot[i] = divrn::fast(num, den[i]);
        fast &= divrn::fast_ok(num, den[i]);
      }
      if (!fast) {
#pragma unroll
        for (int i = 0; i < 16; ++i) quot[i] = __fdiv_rn(activation_numerator<K>(h[i]), den[i]);
      }
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) x[i] = activation_from_quotient<K>(p.act, h[i], u[i], quot[i]);
    if (p.quantize) nvfp4::fake_quantize_block16(x, gs, inv_gs);  // q*sf, exact in bf16
    uint4 lo, hi;
    lo.x = pack_bf16x2(x[0], x[1]);
    lo.y = pack_bf16x2(x[2], x[3]);
    lo.z = pack_bf16x2(x[4], x[5]);
    lo.w = pack_bf16x2(x[6], x[7]);
    hi.x = pack_bf16x2(x[8], x[9]);
    hi.y = pack_bf16x2(x[10], x[11]);
    hi.z = pack_bf16x2(x[12], x[13]);
    hi.w = pack_bf16x2(x[14], x[15]);
    uint4* dst = reinterpret_cast<uint4*>(p.act_out + out_base + tok * static_cast<int64_t>(p.out_cols) + blk * 16);
    dst[0] = lo;
    dst[1] = hi;
  }
}

// The GEMM1 epilogue of a CTA whose staged tile holds output columns [i0, i0 + cols_cta) of the tile's
// valid_rows token rows (from row_start): the valid columns, (w4a4) the re-quantization scale from
// act_scale (p.act_scale[expert], read by the caller), the expert's bias row (column i0 of gate; up
// out_cols later), then Loop::run<K> with the activation kind as a template parameter. Loop spreads
// the arithmetic over the CTA's threads: Gemm1Items (below, the wgmma kernel) or sm90stream::Gemm1Pairs.
template <class Loop>
__device__ __forceinline__ void gemm1_epilogue(const Params& p, const float* stg, int i0, int cols_cta,
                                               int64_t row_start, int valid_rows, float act_scale, int expert) {
  const int cols = min(cols_cta, p.out_cols - i0);
  float gs = 0.0f, inv_gs = 0.0f;
  if (p.quantize) {
    gs = nvfp4::global_inv_scale(act_scale);
    inv_gs = __fdiv_rn(1.0f, gs);
  }
  const int64_t out_base = row_start * static_cast<int64_t>(p.out_cols) + i0;
  const float* bias = p.bias != nullptr ? p.bias + static_cast<int64_t>(expert) * p.N + i0 : nullptr;
  switch (p.act.kind) {
    case Activation::SwiGLU:
      Loop::template run<Activation::SwiGLU>(p, stg, bias, out_base, cols, valid_rows, gs, inv_gs);
      break;
    case Activation::GeGLU:
      Loop::template run<Activation::GeGLU>(p, stg, bias, out_base, cols, valid_rows, gs, inv_gs);
      break;
    case Activation::SwiGLUOai:
      Loop::template run<Activation::SwiGLUOai>(p, stg, bias, out_base, cols, valid_rows, gs, inv_gs);
      break;
    default: Loop::template run<Activation::Relu2>(p, stg, bias, out_base, cols, valid_rows, gs, inv_gs); break;
  }
}

// gemm1_items as a gemm1_epilogue loop: items of 16 columns over the valid columns.
template <int kStride, int kUpRow, int kNumThreads>
struct Gemm1Items {
  template <Activation K>
  __device__ __forceinline__ static void run(const Params& p, const float* stg, const float* bias, int64_t out_base,
                                             int cols, int valid_rows, float gs, float inv_gs) {
    gemm1_items<K, kStride, kUpRow, kNumThreads>(p, stg, bias, out_base, cols / 16, valid_rows, gs, inv_gs);
  }
};

// GEMM2's epilogue rows: value(tok, acc) of every accumulator staged as [token][kBlockN] T in the (free)
// ring (kStride elements per row), then copied out a warp per token row, 16 bytes per lane (512 B per
// warp instruction), to dst[tok_entry[tok] * N + ntile * kBlockN ...] (the valid columns of the N tile).
// Serves the fp32 y of the top-k presets and the bf16 output of the top-1 fused finalize.
// NOTE (not one bulk copy per token row): cp.async.bulk takes its addresses in uniform registers, so a
// copy per thread became a loop over the warp's lanes (3 R2UR + UBLKCP + BRA.U.ANY per token); its
// branch held 15% of GEMM2's warp samples (ncu, qwen3-30b-a3b T = 16384 w4a16, t256).
template <class C, class T, int kStride, class Value>
__device__ __forceinline__ void gemm2_stage_and_copy_rows(const float (&acc)[C::kBlocks][C::kAcc], uint8_t* smem,
                                                          const int32_t* tok_entry, T* dst, int N, int ntile,
                                                          int valid_rows, Value value) {
  constexpr int kB = C::kBlocks, kBlockN = C::kBlockN, kTileRows = C::kTileRows;
  constexpr int kPerLane = 16 / static_cast<int>(sizeof(T)), kPerWarp = 32 * kPerLane;
  static_assert(kStride * sizeof(T) % 16 == 0 && kTileRows * kStride * sizeof(T) <= C::kStages * C::kStageBytes,
                "16-byte staging rows inside the ring");
  const int ctid = threadIdx.x, wg = ctid / 128, warp = (ctid / 32) % 4, lane = ctid % 32, g = lane / 4, t = lane % 4;
  const int jmax = (valid_rows + 7) / 8;  // n8 chunks with valid tokens
  T* stg = reinterpret_cast<T*>(smem);    // (kTileRows, kStride)
#pragma unroll
  for (int b = 0; b < kB; ++b) {
    const int mt = wg * 4 * kB + b * 4 + warp;
#pragma unroll
    for (int j = 0; j < kTileRows / 8; ++j) {
      if (j >= jmax) break;
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int col = 8 * mt + g + (r >= 2 ? kBlockN / 2 : 0);  // CTA-local weight row
        const int tok = 8 * j + 2 * t + (r & 1);
        stg[tok * kStride + col] = value(tok, acc[b][4 * j + r]);
      }
    }
  }
  consumer_sync();
  const int n0 = ntile * kBlockN;
  const int cols = min(kBlockN, N - n0);  // a multiple of 16 (N % 16 == 0)
  constexpr int kConsumerWarps = kConsumerThreads / 32;
  constexpr int kRowsInFlight = 4;  // token rows per warp between a warp's loads and its stores
  // NOTE: the rows' entries and staged values are loaded for kRowsInFlight rows before their stores,
  // each into registers of its own. As one guarded copy per row (a BSSY region each, SASS), every row's
  // staging load reused the registers of the previous row's 16-byte store and waited until that store
  // had read them: one store in flight per warp (maybe the long-scoreboard stalls that ncu showed in
  // the copy-out, docs/perf.md twenty-seventh session, read there as the stores' acceptance rate).
#pragma unroll
  for (int i = 0; i < (kBlockN + kPerWarp - 1) / kPerWarp; ++i) {
    const int c = kPerWarp * i + kPerLane * lane;
    if (c >= cols) continue;  // the lane's column: the same for all its rows
    const uint32_t src = smem_addr(stg + c);
    for (int tok0 = ctid / 32; tok0 < valid_rows; tok0 += kRowsInFlight * kConsumerWarps) {
      int32_t entry[kRowsInFlight];
      uint4 v[kRowsInFlight];
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u) {
        const int tok = min(tok0 + u * kConsumerWarps, valid_rows - 1);  // rows past the tile: a copy of the last
        entry[u] = tok_entry[tok];
        v[u] = lds128(src + static_cast<uint32_t>(tok * kStride * sizeof(T)));
      }
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u)
        if (tok0 + u * kConsumerWarps < valid_rows)
          *reinterpret_cast<uint4*>(dst + static_cast<int64_t>(entry[u]) * N + n0 + c) = v[u];
    }
  }
}

// The kernel itself is defined only where it is launched (expert_gemm.cu); other kernels include this
// header for its helpers with FP4MOE_SM90GEMM_HELPERS_ONLY defined (one definition of the kernel).
#if !defined(FP4MOE_SM90GEMM_HELPERS_ONLY)
template <int TileTokens>
__global__ void __launch_bounds__(kThreads, TileConfig<TileTokens>::kCtasPerSm)
    expert_gemm_kernel(const __grid_constant__ Params p, const __grid_constant__ TmaMaps maps) {
  using C = TileConfig<TileTokens>;
  constexpr int kTileRows = C::kTileRows, kBlockN = C::kBlockN, kStages = C::kStages, kB = C::kBlocks;
  constexpr int kStagingStride = C::kStagingStride;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);  // 1024-aligned, still shared
  dependent_launch_prologue();

  // Raster: groups of kRasterGroup tiles; inside a group the tile varies fastest, so the CTAs that run
  // together share weight columns (same expert, same N tile) and activation rows.
  const int64_t per_group = static_cast<int64_t>(kRasterGroup) * p.n_ctas;
  const int64_t group = blockIdx.x / per_group;
  const int64_t first = group * kRasterGroup;
  const int64_t gsize = min(static_cast<int64_t>(kRasterGroup), p.max_tiles - first);
  const int64_t local = blockIdx.x - group * per_group;
  const int tile = static_cast<int>(first + local % gsize);
  const int ntile = static_cast<int>(local / gsize);
  if (tile >= *p.num_tiles) return;  // the whole CTA leaves before any barrier
  const int expert = p.tile_expert[tile];
  const int64_t row_start = p.tile_row_start[tile];
  const int valid_rows = static_cast<int>(min(static_cast<int64_t>(kTileRows), p.expert_offsets[expert + 1] - row_start));
  if (valid_rows <= 0) return;

  const uint32_t bar_base = smem_addr(smem + C::kBarrierOffset);  // full[s] at 8s, empty[s] at 8(kStages+s)
  int32_t* tok_entry = reinterpret_cast<int32_t*>(smem + C::kTokenEntryOffset);  // GEMM2: entry of each tile row
  uint64_t* row_ptr = reinterpret_cast<uint64_t*>(smem + C::kTokenEntryOffset);  // gathered GEMM1: row addresses
  const bool gather = p.a_row_to_entry != nullptr;  // GEMM1 only (the launcher checks)
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(bar_base + 8 * s, gather ? 1 + kProducerThreads : 1);  // expect_tx (+ the gather's) arrivals
      mbar_init(bar_base + 8 * (kStages + s), kConsumerThreads);      // every consumer thread
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (threadIdx.x >= kConsumerThreads) {
    setmaxnreg_dec<C::kProducerRegs>();
    if (gather)
      producer_gather<C>(p, maps, smem, bar_base, row_ptr, expert, ntile, static_cast<int>(row_start), valid_rows,
                         wgmma_width<C>(valid_rows));
    else if (threadIdx.x == kConsumerThreads)
      producer<C>(p, maps, smem, bar_base, expert, ntile, static_cast<int>(row_start), wgmma_width<C>(valid_rows));
    return;
  }
  setmaxnreg_inc<C::kConsumerRegs>();

  const int ctid = threadIdx.x;
  // GEMM2 top-1 (finalize fused): the router weight of each tile row, after the entries.
  float* tok_weight = reinterpret_cast<float*>(smem + C::kTokenEntryOffset + kTileRows * sizeof(int32_t));
  if (p.epilogue == Epilogue::Gemm2)
    for (int i = ctid; i < valid_rows; i += kConsumerThreads) {
      const int32_t entry = p.row_to_entry[row_start + i];
      tok_entry[i] = entry;
      if (p.out != nullptr) tok_weight[i] = p.out_weights != nullptr ? p.out_weights[entry] : 1.0f;
    }

  float acc[kB][C::kAcc];
#pragma unroll
  for (int b = 0; b < kB; ++b)
#pragma unroll
    for (int i = 0; i < C::kAcc; ++i) acc[b][i] = 0.0f;
  // N of the wgmma: the smallest width (of a few, to keep instantiations few) covering the valid rows.
  const int width = wgmma_width<C>(valid_rows);
  if constexpr (TileTokens == 64) {
    if (width == 8) consumer_mainloop<C, 8>(p, smem, bar_base, acc);
    else if (width == 16) consumer_mainloop<C, 16>(p, smem, bar_base, acc);
    else if (width == 32) consumer_mainloop<C, 32>(p, smem, bar_base, acc);
    else consumer_mainloop<C, 64>(p, smem, bar_base, acc);
  } else if constexpr (TileTokens == 128) {
    if (width == 8) consumer_mainloop<C, 8>(p, smem, bar_base, acc);
    else if (width == 16) consumer_mainloop<C, 16>(p, smem, bar_base, acc);
    else if (width == 32) consumer_mainloop<C, 32>(p, smem, bar_base, acc);
    else if (width == 48) consumer_mainloop<C, 48>(p, smem, bar_base, acc);
    else if (width == 64) consumer_mainloop<C, 64>(p, smem, bar_base, acc);
    else if (width == 96) consumer_mainloop<C, 96>(p, smem, bar_base, acc);
    else consumer_mainloop<C, 128>(p, smem, bar_base, acc);
  } else {
    if (width == 64) consumer_mainloop<C, 64>(p, smem, bar_base, acc);
    else if (width == 128) consumer_mainloop<C, 128>(p, smem, bar_base, acc);
    else consumer_mainloop<C, 256>(p, smem, bar_base, acc);
  }

  const int wg = ctid / 128, warp = (ctid / 32) % 4, lane = ctid % 32, g = lane / 4, t = lane % 4;
  const float alpha = p.alpha[expert];
  const int jmax = (valid_rows + 7) / 8;  // n8 chunks with valid tokens
  consumer_sync();  // every consumer is past its last wgmma: the ring is free; tok_entry is visible

  if (p.epilogue == Epilogue::Gemm2 && p.out == nullptr) {  // y = alpha * acc, fp32
    gemm2_stage_and_copy_rows<C, float, C::kYStride>(acc, smem, tok_entry, p.y, p.N, ntile, valid_rows,
                                                     [&](int, float a) { return epilogue_scale(alpha, a); });
    return;
  }
  if (p.epilogue == Epilogue::Gemm2) {
    // top-1 with the finalize fused: out = bf16(0 + w * y) (the finalize kernel's arithmetic).
    // NOTE: stored straight from the registers (2-byte stores, 8 tokens x 16 B per warp instruction),
    // this epilogue took 10.8 of a 101 us CTA (llama4-scout T = 4096, t128; timeline) against 3.2 us
    // for the staged fp32 y of the other presets; staged, the GEMM2 stage is 3-6% shorter at T >= 2048.
    gemm2_stage_and_copy_rows<C, __nv_bfloat16, C::kOutStride>(
        acc, smem, tok_entry, p.out, p.N, ntile, valid_rows, [&](int tok, float a) {
          return __float2bfloat16_rn(__fadd_rn(0.0f, __fmul_rn(tok_weight[tok], epilogue_scale(alpha, a))));
        });
    return;
  }

  // GEMM1: h = alpha * acc into the staging tile stg[row][token] (fp32; staging row = CTA-local weight
  // row: gated, gate i at row i and up i at row kBlockN/2 + i; relu2, weight row n at row n), then per
  // (token, 16 columns) the activation.
  float* stg = reinterpret_cast<float*>(smem);
  const bool gated = p.epilogue == Epilogue::Gemm1Gated;
#pragma unroll
  for (int b = 0; b < kB; ++b) {
    const int mt = wg * 4 * kB + b * 4 + warp;
    const int row_g = 8 * mt + g;                 // rows g of the m16 tile (slot mt)
    const int row_g8 = kBlockN / 2 + 8 * mt + g;  // rows g+8 (slot kSlots/2 + mt)
#pragma unroll
    for (int j = 0; j < kTileRows / 8; ++j) {
      if (j >= jmax) break;
      const int tok = 8 * j + 2 * t;
      *reinterpret_cast<float2*>(stg + row_g * kStagingStride + staging::row_shift(row_g) + tok) =
          make_float2(epilogue_scale(alpha, acc[b][4 * j + 0]), epilogue_scale(alpha, acc[b][4 * j + 1]));
      *reinterpret_cast<float2*>(stg + row_g8 * kStagingStride + staging::row_shift(row_g8) + tok) =
          make_float2(epilogue_scale(alpha, acc[b][4 * j + 2]), epilogue_scale(alpha, acc[b][4 * j + 3]));
    }
  }
  consumer_sync();

  const int cols_cta = gated ? kBlockN / 2 : kBlockN;
  using Items = Gemm1Items<kStagingStride, kBlockN / 2, kConsumerThreads>;
  gemm1_epilogue<Items>(p, stg, ntile * cols_cta, cols_cta, row_start, valid_rows,
                        p.quantize ? p.act_scale[expert] : 0.0f, expert);
}
#endif  // !FP4MOE_SM90GEMM_HELPERS_ONLY

}  // namespace fp4moe::kernels::sm90gemm
