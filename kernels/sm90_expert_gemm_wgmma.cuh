// kernels/sm90_expert_gemm_wgmma.cuh — the NVFP4 expert GEMM for sm_90a with wgmma: FP4 weights
// decoded in registers to bf16 and fed as the register A operand of wgmma; tokens are the MMA N
// dimension ("swap AB"). Launched by expert_gemm.cu (GemmKernel::Sm90Wgmma).
//
// One CTA computes a tile of 256 weight rows (GEMM1 gated: 128 gate rows + the 128 matching up rows)
// x 128 token rows (one entry of the tile table) over the whole K (the other tile shapes, TileConfig:
// 128 x 256 and, two CTAs per SM, 128 x 64). 384 threads in three warpgroups:
//   warpgroup 2     producer (setmaxnreg 56; 32 at two CTAs per SM)
//   warpgroups 0-1  consumers (setmaxnreg 224; 104); warpgroup c, block b (0..kBlocks-1), warp w own the
//                   m16 tile mt = 4 kBlocks c + 4b + w: rows g from slot mt, rows g+8 from slot kSlots/2 + mt
//                   (CTA-local weight rows 8mt + g and kBlockN/2 + 8mt + g; gated: gate and up of
//                   intermediate column 8mt + g).
//
// Steps, per CTA:
//   1. Raster the CTA onto (tile, N tile) (groups of kRasterGroup tiles share weight columns); a CTA
//      past *num_tiles or with no valid rows leaves. Thread 0 initialises the ring's full/empty mbarriers.
//   2. Producer: one thread issues the bulk tensor copies (TMA) of each 128-wide K chunk into a
//      kStages ring (sm90/ring.cuh), all completing on the stage's `full` mbarrier (expect_tx of the
//      bytes the stage loads; out-of-bounds parts of a box are zero-filled and counted):
//        activations [2 slabs of 64 K][tile rows][128 B], 128-byte swizzled (2-D map), only the rows
//          the tile's wgmma width reads (boxes of kActBoxRows rows)
//        weights [kSlots slots][512 B] + scales [kSlots slots][64 B] (prepacked; 4-D/5-D maps)
//      Slot j < kSlots/2 holds row group j of the CTA's first half (gate groups when gated), slot
//      kSlots/2 + j the matching group of its second half (the matching up groups).
//      GEMM1 with the gather fused (a_row_to_entry, `a` un-permuted [T, K]): the whole producer
//      warpgroup copies the activation rows with cp.async instead (producer_gather), into the same
//      swizzled slabs; the weights and scales stay bulk tensor copies.
//   3. Consumers (consumer_mainloop), per stage: wait `full`, load 4 x 16 B of weights + 4 x 8 B of
//      scales, then per word q (two k16 steps): decode_word + bf16x2 scale multiply -> A fragments
//      (nvfp4/decode.cuh), one wgmma group (m64nNk16, both blocks). The next stage's loads and word-0
//      decode overlap the stage's last groups; stages go in pairs, the wgmma stream drains once per
//      pair; a stage is released (`empty`) once its last group is done. N (8, 16, 32, 48, 64, 96 or
//      128; powers of two with 64- and 256-token tiles) is the smallest instantiated wgmma width that
//      covers the tile's valid token rows (wgmma_width).
//   4. Epilogue, h = alpha[e] * (2^8 * acc) (fp32, expert_gemm_epilogue.cuh), in the freed ring:
//        GEMM1: staged through shared memory as [row][token] fp32 (sm90/staging.cuh), then per (token,
//               16 columns; the activation kind a template parameter): activation, bf16 (w4a16) or
//               NVFP4 fake-quantization with act_scale[e] (w4a4, branch-free per element), written as
//               2 x 16 B.
//        GEMM2: fp32 y[row_to_entry[row] * N + n], staged [token][row] in the ring and copied out a
//               warp per token row (16-byte stores); with top-1 routing the finalized bf16 output
//               instead (finalize fused), staged [token][row] as bf16 and copied out the same way.
// Tails: K is padded to 128 in the prepacked weights (zero weights) and the activation columns past K
// are zero-filled by the copy; weight row groups past N are zero-filled; token rows past the tile's
// valid rows (the next expert's rows, or zeros past the last row) only reach accumulator columns that
// are never written.
//
// Fragment shapes: sm90/wgmma.cuh (A from registers in the m16n8k16 A layout of
// nvfp4/weight_layout.cuh; B the K-major swizzled activation slab; D 64xN per warpgroup).
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "fp4moe/problem.hpp"
#include "kernels/dependent_launch.cuh"
#include "kernels/div_rn.cuh"
#include "kernels/expert_gemm_epilogue.cuh"
#include "kernels/expert_gemm_params.cuh"
#include "kernels/nvfp4/codec.cuh"
#include "kernels/nvfp4/decode.cuh"
#include "kernels/nvfp4/weight_layout.cuh"
#include "kernels/sm90/copy.cuh"
#include "kernels/sm90/mbarrier.cuh"
#include "kernels/sm90/ptx.cuh"
#include "kernels/sm90/ring.cuh"
#include "kernels/sm90/staging.cuh"
#include "kernels/sm90/wgmma.cuh"

namespace fp4moe::kernels::sm90gemm {

using expert_gemm::Epilogue;
using expert_gemm::Params;
using expert_gemm::activation_denominator;
using expert_gemm::activation_from_quotient;
using expert_gemm::activation_numerator;
using expert_gemm::epilogue_scale;
using expert_gemm::gemm1_epilogue;
using expert_gemm::kActivationDivides;
using nvfp4::pack_bf16x2;  // RNE each
using sm90::fence_operand;
using sm90::fence_proxy_async;
using sm90::lds128;
using sm90::lds64;
using sm90::lds_f32;
using sm90::lds_u64;
using sm90::mbar_arrive;
using sm90::mbar_arrive_expect_tx;
using sm90::mbar_init;
using sm90::mbar_init_fence;
using sm90::mbar_wait;
using sm90::smem_addr;
namespace staging = sm90::staging;


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
  // one 64-row copy, or the narrower wgmma at two CTAs per SM: not separated).
  static constexpr bool kThreeQuarterWidths = TileTokens == 128;
  static constexpr int kActBytes = 2 * kSlabBytes;
  static constexpr int kWeightBytes = kSlots * nvfp4::kChunkBytes;
  static constexpr int kScaleBytes = kSlots * nvfp4::kChunkScaleBytes;
  static constexpr int kStageBytes = kActBytes + kWeightBytes + kScaleBytes;  // 25 / 50 / 73 KiB, one expect_tx
  // GEMM1 staging [row][token] fp32 (kernels/sm90/staging.cuh: row r starts at
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

// The maps of one launch (encoded on the host, expert_gemm.cu), passed as a __grid_constant__ parameter.
struct TmaMaps {
  CUtensorMap act;    // a [rows][K] bf16, box [kActBoxRows][64], 128-byte swizzle
  CUtensorMap act_tile;  // the same with box [kTileRows][64]: one copy per slab for a full-width tile
  CUtensorMap w;      // prepacked weights: gated (5-D) [E][2 halves][N/16 groups][chunks][512 B],
                      //   else (4-D) [E][N/8 groups][chunks][512 B]; box = the CTA's slots of one chunk
  CUtensorMap scale;  // the same over the prepacked scales (64 B per group and chunk)
};

// Named barrier 1: the 256 consumer threads; 2: the producer warpgroup.
__device__ __forceinline__ void consumer_sync() { sm90::named_barrier_sync<1, kConsumerThreads>(); }
__device__ __forceinline__ void producer_sync() { sm90::named_barrier_sync<2, kProducerThreads>(); }

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
      wa[b] = lds128(wsm + mt * nvfp4::kChunkBytes + lane * 16);
      wb[b] = lds128(wsm + (kHalf + mt) * nvfp4::kChunkBytes + lane * 16);
      sa[b] = lds64(ssm + mt * nvfp4::kChunkScaleBytes + g * 8);
      sb[b] = lds64(ssm + (kHalf + mt) * nvfp4::kChunkScaleBytes + g * 8);
    }
  };
  // Fragments of word q: f[k16 step of the pair][block][register].
  auto decode = [&](int q, uint32_t (&f)[2][kB][4]) {
#pragma unroll
    for (int b = 0; b < kB; ++b) nvfp4::decode_fragments(wa[b], wb[b], sa[b], sb[b], q, f[0][b], f[1][b]);
  };
  uint32_t frag0[2][kB][4];     // word 0 (decoded ahead, at the end of the previous stage)
  uint32_t frag[2][2][kB][4];   // words 1..3: buffer q & 1
  // One wgmma group: the two k16 steps of word q of stage kt, both blocks.
  auto issue = [&](int kt, int q, const uint32_t (&f)[2][kB][4]) {
    // The descriptor's start address field is (address >> 4) and the ring lies below 2^18 bytes, so a
    // k16 step's descriptor is the stage's plus (offset >> 4): one add instead of a rebuild.
    const uint64_t desc0 = sm90::make_desc_sw128(smem_addr(smem) + (kt % kStages) * C::kStageBytes);
    sm90::wgmma_fence();
#pragma unroll
    for (int st = 0; st < 2; ++st) {
      const int step = 2 * q + st;  // k16 step of the chunk: slab step/4, 32 bytes per step inside it
      const uint64_t desc = desc0 + static_cast<uint64_t>(((step / 4) * C::kSlabBytes + (step % 4) * 32) >> 4);
#pragma unroll
      for (int b = 0; b < kB; ++b) sm90::wgmma_m64nNk16<NT>(acc[b], f[st][b], desc);
    }
    sm90::wgmma_commit();
  };
  // Words 1..3 of stage kt (word 0's group already issued), then the next stage's loads and word-0
  // decode while the groups of words 2 and 3 run.
  auto finish_stage = [&](int kt) {
#pragma unroll
    for (int q = 1; q < 4; ++q) {
      if (q == 3) sm90::wgmma_wait<1>();  // the group of word 1 (same buffer) is done
      decode(q, frag[q & 1]);
      issue(kt, q, frag[q & 1]);
    }
    if (kt + 1 < p.chunks) {
      sm90::wgmma_wait<2>();  // word 0's group is done: frag0 is free
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
      sm90::wgmma_wait<1>();  // stage kt's last group is done (word 1's buffer is free as well)
      mbar_arrive(bar_base + 8 * (kStages + kt % kStages));
      finish_stage(kt + 1);
      sm90::wgmma_wait<0>();
      mbar_arrive(bar_base + 8 * (kStages + (kt + 1) % kStages));
    } else {
      sm90::wgmma_wait<0>();
      mbar_arrive(bar_base + 8 * (kStages + kt % kStages));
    }
  }
#pragma unroll
  for (int b = 0; b < kB; ++b)
#pragma unroll
    for (int i = 0; i < C::kAcc; ++i) fence_operand(acc[b][i]);
}

// The bulk tensor copies of chunk kt's weight and scale slots of N tile ntile into a stage (w_base:
// (kSlots, 512 B), s_base: (kSlots, 64 B)), completing on `full`. Gated GEMM1's box starts at group pair
// ntile * kSlots / 2 of each half (slots [gate groups][up groups]); the others' at group ntile * kSlots.
template <class C>
__device__ __forceinline__ void load_weight_slots(const TmaMaps& maps, uint32_t w_base, uint32_t s_base, uint32_t full,
                                                  int kt, int ntile, int expert, bool gated) {
  constexpr int kSlots = C::kSlots;
  // NOTE: a call per branch, each with its own group coordinate: one call with the coordinate selected
  // by `gated` made the compiler select the shift (3 or 4) at run time.
  if (gated) sm90::copy_weight_chunk(&maps.w, &maps.scale, w_base, s_base, full, kt, ntile * (kSlots / 2), expert, true);
  else sm90::copy_weight_chunk(&maps.w, &maps.scale, w_base, s_base, full, kt, ntile * kSlots, expert, false);
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
  sm90::tma_prefetch(&maps.act);
  sm90::tma_prefetch(&maps.act_tile);
  sm90::tma_prefetch(&maps.w);
  sm90::tma_prefetch(&maps.scale);
  sm90::RingSlot<kStages> ring;
  for (int kt = 0; kt < p.chunks; ++kt) {
    ring.wait_free(bar_base, kt);
    const int s = ring.stage;
    const uint32_t full = bar_base + 8 * s;
    const uint32_t act_base = smem_addr(smem) + s * C::kStageBytes;  // (2 slabs, tile rows, 128 B)
    const uint32_t w_base = act_base + C::kActBytes;                 // (kSlots, 512 B)
    const uint32_t s_base = w_base + C::kWeightBytes;                // (kSlots, 64 B)
    mbar_arrive_expect_tx(full, stage_bytes);  // out-of-bounds parts of a box count as well
    const int kcol = kt * nvfp4::kChunkK;
    if (width == C::kTileRows) {  // NOTE: a full-width tile in one copy per slab (fewer, larger TMA requests)
      sm90::tma_load_2d(act_base, &maps.act_tile, full, kcol, row_start);
      sm90::tma_load_2d(act_base + C::kSlabBytes, &maps.act_tile, full, kcol + 64, row_start);
    } else {
      for (int bx = 0; bx < boxes; ++bx) {  // (box rows, 128 B) at row bx * kBox of each slab
        sm90::tma_load_2d(act_base + bx * kBox * 128, &maps.act, full, kcol, row_start + bx * kBox);
        sm90::tma_load_2d(act_base + C::kSlabBytes + bx * kBox * 128, &maps.act, full, kcol + 64, row_start + bx * kBox);
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
// relay thread fencing for the consumers); the layer still gains (no gather_quantize launch).
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
    sm90::sts128_zero(smem_addr(smem) + st * C::kStageBytes + slab * C::kSlabBytes + (valid_rows + q / 8) * 128 + (q % 8) * 16);
  }
  producer_sync();  // row_ptr is written
  const uint32_t ptr_addr = smem_addr(row_ptr) + static_cast<uint32_t>(sub * 8);
  const uint32_t dst_thread = static_cast<uint32_t>(sub * 128 + ((c ^ (sub & 7)) * 16));  // (r & 7) == (sub & 7)
  if (leader) {
    sm90::tma_prefetch(&maps.w);
    sm90::tma_prefetch(&maps.scale);
  }
  sm90::RingSlot<kStages> ring;
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
    const int col = kt * nvfp4::kChunkK + c * 8;  // first of the 8 columns of slab 0 (slab 1: +64)
    const uint32_t bytes0 = col < p.K ? 16u : 0u, bytes1 = col + 64 < p.K ? 16u : 0u;  // K % 16 == 0
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      if (16 * i + sub >= valid_rows) break;
      const __nv_bfloat16* src = reinterpret_cast<const __nv_bfloat16*>(lds_u64(ptr_addr + i * 16 * 8)) + col;
      const uint32_t dst = act_base + dst_thread + static_cast<uint32_t>(i * 16 * 128);
      sm90::cp_async16(dst, src, bytes0);
      sm90::cp_async16(dst + C::kSlabBytes, src + 64, bytes1);
    }
    sm90::cp_async_arrive_noinc(full);  // when this thread's copies (so far) have landed
    ring.advance(kt);
  }
}

// ---- epilogue -----------------------------------------------------------------------------------------

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
  // the copy-out, read there as the stores' acceptance rate).
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
// ---- kernel -------------------------------------------------------------------------------------------
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
    sm90::setmaxnreg_dec<C::kProducerRegs>();
    if (gather)
      producer_gather<C>(p, maps, smem, bar_base, row_ptr, expert, ntile, static_cast<int>(row_start), valid_rows,
                         wgmma_width<C>(valid_rows));
    else if (threadIdx.x == kConsumerThreads)
      producer<C>(p, maps, smem, bar_base, expert, ntile, static_cast<int>(row_start), wgmma_width<C>(valid_rows));
    return;
  }
  sm90::setmaxnreg_inc<C::kConsumerRegs>();

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

}  // namespace fp4moe::kernels::sm90gemm
