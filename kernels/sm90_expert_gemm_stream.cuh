// kernels/sm90_expert_gemm_stream.cuh — the streaming ("decode") NVFP4 expert GEMM for sm_90a, for few
// token rows per expert (1..32 per tile), launched by expert_gemm_stream.cu (GemmKernel::Sm90Stream).
// At decode the layer is bound by reading the FP4 weights from HBM, so this kernel keeps several K
// chunks of weights in flight on every SM: per chunk, one thread issues the weights and scales as two
// bulk tensor copies (TMA) into the CTA's shared-memory ring (one ring for the CTA's 8 warps) and its
// warp (two warps for 32-row tiles; the warps take turns by chunk) adds the activation rows (cp.async);
// every warp decodes its weights with the register decoder of nvfp4/weight_layout.cuh and feeds
// mma.sync m16n8k16; the tokens are the MMA N dimension (swap AB), 8 per mma. Warps meet only
// through the ring's mbarriers, never at a CTA barrier in the main loop.
//
// CTA = 256 threads (8 warps); 4 CTAs per SM with 16-row tiles (53 KiB of shared memory each), 3 with
// 32-row tiles (70 KiB), over
//   one tile (expert e, <= 16 or 32 token rows) x 128 weight rows x the K chunks of its split:
//     plain / GEMM2: warp w owns the m16 tile of row groups 16*ntile + 2w (rows g) and 2w+1 (rows g+8);
//     gated GEMM1:   warp w owns gate row group ig = 8*ntile + w (rows g) and up row group I/8 + ig
//                    (rows g+8), so the CTA covers the 64 intermediate columns [64*ntile, +64).
//   Grid (1-D): blockIdx.x = (tile * split_k + split) * n_ctas + ntile; CTAs past *num_tiles leave.
//   Split s covers K chunks [s*cps, min(chunks, (s+1)*cps)), cps = ceil(chunks / split_k) (may be empty).
//
// Shared memory (dynamic, StreamTile<>): kStages ring stages, one K chunk each,
//   [weights: 16 row-group slots x 512 B][scales: 16 x 64 B][activations: tile rows x 272 B]
//   (weights and scales in the prepacked layout of nvfp4/weight_layout.cuh, lane l's 16 bytes of a slot
//   at l * 16; activation rows of 128 bf16 padded to kActRowStride), then full[kStages] (the copy
//   lanes' cp.async arrivals + one expect_tx arrival: every byte of the stage landed) and
//   empty[kStages] (256 arrivals, one per thread: every warp is done with the stage) mbarriers.
//
// Steps, per CTA:
//   1. Initialise the mbarriers (before the dependency wait); with the early start (GemmEarlyStart::
//      TileTable) read the tile through L2 and issue the weight copies of the first kPrefetch chunks,
//      then wait; the lanes of fill group 0 whose tile row is past the tile's rows zero that row in
//      every stage; issue the (remaining) copies of the first kPrefetch chunks (see mainloop). GEMM1
//      with a_row_to_entry (the gather fused): tile row r is copied from the un-permuted activation row
//      a_row_to_entry[r] / a_top_k.
//   2. Per chunk kc (see mainloop): fill group (kc + kPrefetch) % kFillGroups refills chunk
//      kc + kPrefetch; every warp waits for
//      full[] of chunk kc, then per word q (k16 steps 2q, 2q+1): decode_word + decode_scale_pair +
//      bf16x2 multiplies -> A fragments (rows g / g+8), ldmatrix (x4: both n8 halves; x2 when NT = 8)
//      -> B fragments, mma.sync per n8 half; the warp then arrives on empty[].
//   3. split_k > 1: every CTA stores its accumulators (fragment order, 8 floats per thread) as the
//      split's partial; the last CTA to arrive on the output tile's counter (atomicAdd) resets the
//      counter to 0 and sums the partials in split order 0..split_k-1 (deterministic), then runs 4.
//   4. Epilogue, h = alpha[e] * (2^8 * acc):
//        GEMM1: staged through shared memory [128 rows][kStgStride] fp32 (gated: gate i at row i, up i
//               at row 64 + i; relu2: weight row n at row n), then gemm1_pairs: a thread per (token,
//               2 columns), activation, bf16 or NVFP4 fake-quantization, the wgmma kernel's arithmetic.
//        GEMM2: fp32 y[row_to_entry[row] * N + n] from the registers, or the top-1 fused finalize;
//               with fin_counters (top_k >= 2) y and then the fused finalize of gemm2_finalize_tile.
//   5. GEMM1 with tile_ready: the CTA signals its tile (signal_tile_ready); a GEMM2 with the early start
//      TileReady waits for its tile's count (wait_tile_ready) in place of step 1's dependency wait.
//
// Shapes (PTX ISA mma.m16n8k16 .row.col .bf16, f32 accumulators; lane = 4g + t):
//   A 16x16 (weights, registers): a0 = row g cols 2t..2t+1, a1 = row g+8, a2 = row g cols 2t+8.., a3
//   B 16x8 (tokens, .col): b0 = B[k = 2t, 2t+1][n = g], b1 = B[k = 2t+8, 2t+9][n = g]
//     = activation row g, 2 consecutive K values: ldmatrix (non-transposed) of an 8x8 b16 matrix whose
//     8 rows are 8 tokens' 16-byte K segments gives lane (g, t) exactly that row g, elements 2t, 2t+1.
//   D 16x8: c0, c1 = row g, tokens 2t, 2t+1; c2, c3 = row g+8, same tokens.
//   acc[h][4]: n8 tile h (tokens 8h..8h+7); NT (8, 16 or 32 <= tile rows) covers the valid rows.
//
// NOTE (why bulk copies for the weights): the kernel is bound by instructions, not by memory (the
// copy-only load pattern of bench/micro/weight_stream_pattern.cu reads 4.18 TB/s on an H200, while ncu
// showed issue slots 74% busy with math-pipe throttle the largest stall after "not selected"). With
// per-lane cp.async into per-warp rings, every warp spent ~60 of its ~225 instructions per chunk on
// copies, their guards, commit/wait groups and the __syncwarp for the scales; the two bulk copies per
// chunk cost one thread ~30 instructions and the other warps nothing but the full[] wait (SASS).
// NOTE (activations in shared memory): the <= 32 token rows are shared by the 8 warps; fragments
// loaded from global by every warp would cost 16 x 4-byte loads per lane per chunk and n8 half.
// The stage rows are 272 B apart (256 B + 16 B of padding), so the 8 row addresses of one ldmatrix
// matrix fall into 8 different 16-byte bank groups (272 = 16 mod 128), and the address of every k16
// step is the lane's base plus an immediate. NOTE: the XOR swizzle it replaces (segment c of a
// 256-byte row at c ^ (r & 7)) cost a LOP3 + IADD per ldmatrix, 16 of the ~225 instructions per warp
// and chunk of the 8-token main loop (SASS).
// NOTE (cost): per chunk a lane decodes 64 weights (8 words) with 8 x (6 LOP3/SHF + 3 IMAD.SHL) + 8 x
// (PRMT + LEA) for the scales + 32 HMUL2 ~ 1.9 instructions per weight, of which 1.0 on the integer
// pipe (nvfp4/weight_layout.cuh); then 4 LDS, 8 ldmatrix and 8 or 16 mma.sync.
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "fp4moe/problem.hpp"
#include "kernels/dependent_launch.cuh"
#include "kernels/expert_gemm_epilogue.cuh"
#include "kernels/expert_gemm_params.cuh"
#include "kernels/launch.hpp"
#include "kernels/nvfp4/codec.cuh"
#include "kernels/nvfp4/decode.cuh"
#include "kernels/nvfp4/weight_layout.cuh"
#include "kernels/sm90/copy.cuh"
#include "kernels/sm90/mbarrier.cuh"
#include "kernels/sm90/mma.cuh"
#include "kernels/sm90/ptx.cuh"
#include "kernels/sm90/ring.cuh"

namespace fp4moe::kernels::sm90stream {

using expert_gemm::Epilogue;
using expert_gemm::Params;


inline constexpr int kThreads = 256;                      // 8 warps
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kRowsPerCta = 16 * kWarps;           // 128 weight rows (gated: 64 gate + 64 up)
inline constexpr int kGroupsPerCta = kRowsPerCta / 8;     // 16 row groups
inline constexpr int kActRowBytes = nvfp4::kChunkK * 2;          // 256: 128 bf16
inline constexpr int kActRowStride = kActRowBytes + 16;              // 272: padded, see the NOTE above
// One ring stage per K chunk, shared by the 8 warps (StreamTile<>):
//   [weights: 16 slots x 512 B][scales: 16 slots x 64 B][activations: tile rows x kActRowStride]
// Slots are the CTA's 16 row groups in the order of one bulk tensor copy (the maps of both kernels,
// gemm_detail::encode_weight_maps): gated GEMM1 [8 gate groups][8 up groups], otherwise 16 consecutive groups. Warp w
// reads slots (w, 8 + w) when gated, (2w, 2w + 1) otherwise; lane l its 16 bytes at l * 16 of each.
inline constexpr int kSlotWeightBytes = kGroupsPerCta * nvfp4::kChunkBytes;       // 8192
inline constexpr int kSlotScaleBytes = kGroupsPerCta * nvfp4::kChunkScaleBytes;   // 1024

// The two tile sizes (MoeTactic::tile_tokens): 16 token rows (two n8 halves), or 32 (four): an expert
// with 17..32 rows then streams its weights once instead of twice, for 8 more accumulators and one
// more copy warp.
//   kStages:   ring depth; kPrefetch chunks (kc+1 .. kc+kPrefetch) are in flight while chunk kc is
//              decoded. kStages > kPrefetch, so the refill of chunk kc + kPrefetch waits only for every
//              warp to be done with chunk kc + kPrefetch - kStages: warps drift up to
//              kStages - kPrefetch chunks apart instead of meeting at a barrier every chunk.
//   kCopyWarps: the warps that fill one stage (16 activation rows per warp: lane l of the group's
//              warp c copies the 8 segments 8 (l % 2) .. of row 16 c + l / 2; lane 0 of its first warp
//              also issues the two bulk tensor copies, weights and scales). Chunk kn is filled by
//              group kn % kFillGroups (warps [kCopyWarps g, +kCopyWarps)).
// NOTE (rotating fill): with one filling warp for every chunk, that warp carried ~45 more instructions
// per chunk than the others and paced the CTA when few CTAs share an SM (qwen3-30b-a3b T = 1: +7%
// layer time against per-lane copies); rotating the fill spreads it over all warps.
template <int TileRows>
struct StreamTile {
  static_assert(TileRows == 16 || TileRows == 32, "tile_tokens is 16 or 32");
  static constexpr int kTileRows = TileRows;
  static constexpr int kHalves = TileRows / 8;                        // n8 accumulator tiles
  static constexpr int kCtasPerSm = TileRows == 16 ? 4 : 3;          // __launch_bounds__ min blocks
  // NOTE (depths): the bytes in flight per SM are those of the per-warp rings this replaced (16-row
  // tiles: 4 CTAs x 2 chunks x 9 KiB ~ 74 KB, which streamed 4.18 TB/s in the copy-only pattern of
  // bench/micro/weight_stream_pattern.cu). 32-row tiles: 3 CTAs per SM (80 registers, 4 stages of
  // 17.5 KiB, prefetch 2) took 0-21% off (geomean 0.90) against 2 per SM with 6 stages, prefetch 3
  // (16 warps per SM left the decode latency exposed). With 16-row tiles, 3 chunks in flight (slack 1
  // between the warps) was 3% slower on every decode row, and a ring sized per launch (up to 16 stages
  // for small grids) gained nothing.
  // NOTE: the mbarriers sit after the ring; with them in front (under the GEMM1 staging overlay) the
  // GEMM1 tests failed with NaN rows, not explained yet.
  static constexpr int kStages = 4;    // 16 rows: 53 KiB per CTA; 32 rows: 70 KiB
  static constexpr int kPrefetch = 2;
  static constexpr int kActStageBytes = TileRows * kActRowStride;    // 4352 / 8704 B
  static constexpr int kActOffset = kSlotWeightBytes + kSlotScaleBytes;  // in a stage
  static constexpr int kStageBytes = kActOffset + kActStageBytes;   // 13568 / 17920 B
  static constexpr int kTmaBytes = kActOffset;                      // expect_tx per stage: weights + scales
  static constexpr int kRingBytes = kStages * kStageBytes;
  static constexpr int kBarrierOffset = kRingBytes;
  static constexpr int kSmemBytes = kBarrierOffset + 2 * kStages * 8;  // + full[], empty[] mbarriers
  static constexpr int kCopyWarps = TileRows / 16;
  static constexpr int kFillGroups = kWarps / kCopyWarps;             // 8 / 4: a power of two
  static constexpr int kLaneCopies = 8;                              // 16-byte segments per copy lane and chunk
  static constexpr int kFullArrivals = kCopyWarps * 32 + 1;          // cp.async arrivals + the expect_tx one
  static constexpr int kStgStride = TileRows + 8;  // floats per staging row: float2 writes conflict-free
  static constexpr int kPartialFloats = kThreads * 4 * kHalves;      // one split's partial of an output tile
  static_assert(kStages > kPrefetch && kPrefetch >= 1, "the ring must be deeper than the prefetch");
  static_assert(kCopyWarps * 32 * kLaneCopies == TileRows * (kActRowBytes / 16), "activation copies split evenly");
  static_assert((kFillGroups & (kFillGroups - 1)) == 0, "kn % kFillGroups as a mask");
  // NOTE: kCtasPerSm x (dynamic + 1 KiB reserved per block + 128 B static) within 227 KiB.
  static_assert(kCtasPerSm * (kSmemBytes + 1024 + 128) <= 227 * 1024, "kCtasPerSm CTAs must fit in shared memory");
  static_assert(kRowsPerCta * kStgStride * 4 <= kRingBytes, "GEMM1 staging overlays the ring");
  static_assert(kStgStride % 32 == 8 || kStgStride % 32 == 24, "8 rows x 4 lanes of float2 on distinct banks");
  // NOTE: bulk tensor copies need 16-byte aligned shared destinations; 128 keeps every stage on a line.
  static_assert(kStageBytes % 128 == 0 && kActOffset % 16 == 0 && kBarrierOffset % 8 == 0, "ring alignment");
  static_assert(kActRowStride % 128 == 16, "8 consecutive rows on 8 distinct 16-byte bank groups");
};

struct StreamParams {
  Params base;               // shared with the wgmma kernel (n_ctas = CTAs along N)
  int split_k;               // CTAs along K per output tile
  int chunks_per_split;      // ceil(chunks / split_k)
  int32_t* counters;         // [max_tiles * n_ctas] arrival counters (split_k > 1), zero between launches
  float* partials;           // [max_tiles * n_ctas * split_k][StreamTile::kPartialFloats] (split_k > 1)
  GemmEarlyStart early;      // what the CTA does before its dependency wait (kernels/launch.hpp)
  int32_t* tile_ready;       // [max_tiles] GEMM1: signalled per tile; GEMM2 (TileReady): waited for; or null
  int tile_ready_count;      // GEMM2 (TileReady): GEMM1's CTAs along N
};

// The bulk tensor copy maps of one launch (encoded on the host by gemm_detail::encode_weight_maps with
// kGroupsPerCta slots), passed as a __grid_constant__ parameter.
struct StreamMaps {
  CUtensorMap w;      // prepacked weights, box = the CTA's 16 slots of one chunk
  CUtensorMap scale;  // the same over the prepacked scales
};

// ---- main loop ----------------------------------------------------------------------------------------
// What the stage copies of one CTA need (set up once per CTA by the kernel).
struct StageSource {
  const CUtensorMap* w_map;
  const CUtensorMap* s_map;
  int group0;                 // first group coordinate of the box (within the half when gated)
  int expert;
  bool gated;                 // 5-D maps (half coordinate 0: the box spans both halves)
  const __nv_bfloat16* a_row; // copy lanes: this lane's activation row (column 0), p.a past the tile's rows
  bool row_ok;                // the row is one of the tile's valid rows
};


// The two bulk tensor copies of chunk kn's weights and scales into the stage at `stage`, completing on
// `full` (with its expect_tx arrival). One thread.
template <class C>
__device__ __forceinline__ void issue_weight_copies(const StageSource& src, uint32_t stage, uint32_t full, int kn) {
  sm90::mbar_arrive_expect_tx(full, C::kTmaBytes);  // out-of-bounds parts of a box count as well
  sm90::copy_weight_chunk(src.w_map, src.s_map, stage, stage + kSlotWeightBytes, full, kn, src.group0, src.expert,
                          src.gated);
}


// This lane's 8 activation segments in stage 0 when its warp fills a stage (row 16 c + l / 2, c = the
// warp's place in its fill group; segments 8 (l % 2) ..).
template <class C>
__device__ __forceinline__ uint32_t act_copy_dst(uint32_t smem_base, int warp, int lane) {
  return smem_base + C::kActOffset + (16 * (warp % C::kCopyWarps) + lane / 2) * kActRowStride +
         (lane & 1) * C::kLaneCopies * 16;
}
// NOTE: an activation row past the tile's rows is zeroed once in every stage (before the CTA barrier
// that precedes the main loop) instead of being zero-filled by cp.async every chunk: the MMA columns
// of those tokens are never stored, but a stale NaN there would still be read.
template <class C>
__device__ __forceinline__ void zero_idle_act_row(uint32_t smem_base, int warp, int lane) {
  const uint32_t dst = act_copy_dst<C>(smem_base, warp, lane);
#pragma unroll
  for (int s = 0; s < C::kStages; ++s)
#pragma unroll
    for (int i = 0; i < C::kLaneCopies; ++i) sm90::sts128_zero(dst + s * C::kStageBytes + i * 16);
}

// Chunks [c0, c1) of this CTA's split. slot_a / slot_b: the warp's slots (rows g / g+8 of its m16
// tile). weights_issued: the weight copies of chunks [c0, c0 + kPrefetch) (those below c1) were issued
// into stages 0.. before the loop (issue_weight_copies, the early start). A warp whose rows lie past N
// decodes the zeros that the bulk copies fill in there; its results are never stored.
// NOTE: no branch around that decode: the warp-uniform `if` cost a branch and a WARPSYNC per chunk in
// every warp (SASS) to spare the last N tile's idle warps some work.
//
// Per chunk kc (iteration order):
//   a. refill (the warps of fill group kn % kFillGroups only): chunk kn = kc + kPrefetch (if < c1) into
//      stage kn % kStages: wait until every warp is done with the stage's previous chunk (empty[],
//      skipped in the first pass); lane 0 of the group arrives on full[] with expect_tx of the two bulk
//      copies and issues them; every lane of the group issues its 8 activation segments (zero-filled
//      past K; rows past the tile's are zero already) and arrives on full[] once they have landed
//      (cp.async.mbarrier.arrive.noinc).
//   b. wait: full[] of chunk kc's stage (every byte of the stage landed).
//   c. decode + MMA as described in the file header; then every lane arrives on empty[] of the stage.
// The loop runs in passes of kStages chunks, unrolled, so that every stage offset, every parity and
// every source offset (chunk - pass start) is a compile-time constant.
// NOTE (no deadlock): chunk m is filled at its filler's iteration m - kPrefetch, after every warp is
// done with chunk m - kStages; the slowest warp (at iteration i) waits only for chunk i, whose filler
// is at an iteration >= i > i - kPrefetch, and every warp is past chunk i - kStages + kPrefetch.
template <class C, int NT>
__device__ __forceinline__ void mainloop(const Params& p, uint32_t smem_base, const StageSource& src,
                                         int slot_a, int slot_b, int c0, int c1, bool weights_issued,
                                         float (&acc)[C::kHalves][4]) {
  static_assert(NT <= C::kTileRows, "mma width past the tile");
  constexpr int kStages = C::kStages, kPrefetch = C::kPrefetch, kStageBytes = C::kStageBytes;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4;
  const uint32_t full_bar = smem_base + C::kBarrierOffset;  // [kStages] mbarriers, 8 B each
  const uint32_t empty_bar = full_bar + kStages * 8;        // [kStages]
  // This lane's weight words and scale bytes in stage 0 (stage s: + s * kStageBytes).
  uint32_t wa_addr = smem_base + slot_a * nvfp4::kChunkBytes + lane * 16;
  uint32_t wb_addr = smem_base + slot_b * nvfp4::kChunkBytes + lane * 16;
  uint32_t sa_addr = smem_base + kSlotWeightBytes + slot_a * nvfp4::kChunkScaleBytes + g * 8;
  uint32_t sb_addr = smem_base + kSlotWeightBytes + slot_b * nvfp4::kChunkScaleBytes + g * 8;
  // NOTE: the loop invariants pass through an empty asm so that ptxas keeps them in registers: under
  // the 64-register cap it otherwise rebuilt the lane addresses, the chunk bound (from the kernel
  // parameters) in every chunk, ~25 of the ~196 instructions of a non-filling warp (SASS).
  int last = c1;
  asm volatile("" : "+r"(wa_addr), "+r"(wb_addr), "+r"(sa_addr), "+r"(sb_addr), "+r"(last));
  // When this warp fills: lane l copies row 16 (w % kCopyWarps) + l / 2, segments 8 (l % 2) .. + 7.
  const int fill_group = warp / C::kCopyWarps;
  const bool tma_lane = warp % C::kCopyWarps == 0 && lane == 0;
  const int seg0 = (lane & 1) * C::kLaneCopies;
  const uint32_t copy_dst = act_copy_dst<C>(smem_base, warp, lane);

  // Chunk kn into stage j % kStages, by this warp's fill group (kn % kFillGroups == fill_group).
  auto refill = [&](int kn, int j, bool first_pass, uint32_t e_parity, bool skip_tma) {
    if (kn >= last) return;  // warp-uniform
    const int s = j % kStages;
    if (!first_pass) sm90::mbar_wait(empty_bar + s * 8, e_parity);
    const uint32_t full = full_bar + s * 8, stage = smem_base + s * kStageBytes;  // (slots, 512 B) ...
    // skip_tma: the prefetched chunks' weights are in flight already (the kernel's early start).
    if (tma_lane && !skip_tma) issue_weight_copies<C>(src, stage, full, kn);
    // Rows past the tile's are zero in every stage (zero_idle_act_row) and never copied.
    if (src.row_ok) {
      const int col = kn * nvfp4::kChunkK + seg0 * 8;  // K % 16 == 0: a segment is wholly in or out
      const uint32_t dst = copy_dst + s * kStageBytes;
      if (col + 8 * C::kLaneCopies <= p.K) {  // all 8 segments inside K: one base, immediate offsets
        const __nv_bfloat16* from = src.a_row + col;
#pragma unroll
        for (int i = 0; i < C::kLaneCopies; ++i) sm90::cp_async16(dst + i * 16, from + 8 * i, 16u);
      } else {  // the last chunk when K % 128 != 0: segments past K are zero-filled, nothing is read
        // NOTE: a rolled loop: this path runs once per CTA at most, but unrolled it was ~75 of the ~150
        // instructions of each refill copy in the unrolled main loop (SASS), which the SMs fetch.
#pragma unroll 1
        for (int i = 0; i < C::kLaneCopies; ++i) {
          const bool ok = col + 8 * i < p.K;
          sm90::cp_async16(dst + i * 16, ok ? src.a_row + col + 8 * i : src.a_row, ok ? 16u : 0u);
        }
      }
    }
    sm90::cp_async_arrive_noinc(full);  // at once for a lane without copies
  };
  // ldmatrix row address of this lane: matrices (tokens 0-7, seg 2s), (0-7, 2s+1), (8-15, 2s), (8-15, 2s+1)
  // for lanes 0-7, 8-15, 16-23, 24-31 (x2 uses the first two): row lr, segment 2s + hi.
  const int lr = (lane & 7) + ((lane >> 4) << 3), hi = (lane >> 3) & 1;
  uint32_t ldsm_base = smem_base + C::kActOffset + lr * kActRowStride + hi * 16;
  asm volatile("" : "+r"(ldsm_base));  // kept in a register (NOTE above)

#pragma unroll
  for (int j = 0; j < kPrefetch; ++j)
    if (((c0 + j) & (C::kFillGroups - 1)) == fill_group) refill(c0 + j, j, true, 0, weights_issued);
  // NOTE: in the loop, chunk kc + kPrefetch is this warp's to fill when kc == fill_at (every
  // kFillGroups-th chunk): one compare per chunk instead of recomputing kn, its group and the bound.
  int fill_at = c0 + ((fill_group - c0 - kPrefetch) & (C::kFillGroups - 1));
  uint32_t pass_parity = 0;  // parity of the current pass's full[] phases (and of its empty[] phases)
#pragma unroll 1
  for (int base = c0; base < last; base += kStages) {
    const bool first = base == c0;
#pragma unroll
    for (int d = 0; d < kStages; ++d) {
      const int kc = base + d;
      if (kc >= last) break;  // CTA-uniform
      // Chunk kn = kc + kPrefetch: in this pass (j < kStages: its stage was last used in the previous
      // pass, phase parity ^ 1) or in the next one (j >= kStages: used in this pass, phase parity).
      const int j = d + kPrefetch;
      if (kc == fill_at) {  // warp-uniform
        fill_at += C::kFillGroups;
        if (j < kStages) refill(kc + kPrefetch, j, first, pass_parity ^ 1u, false);
        else refill(kc + kPrefetch, j, false, pass_parity, false);
      }
      sm90::mbar_wait(full_bar + d * 8, pass_parity);
      const uint32_t off = d * kStageBytes;
      const uint4 wa = sm90::lds128(wa_addr + off);
      const uint4 wb = sm90::lds128(wb_addr + off);
      const uint2 sa = sm90::lds64(sa_addr + off);
      const uint2 sb = sm90::lds64(sb_addr + off);
      const uint32_t stage = ldsm_base + off;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        uint32_t f[2][4];  // k16 steps 2q, 2q+1
        nvfp4::decode_fragments(wa, wb, sa, sb, q, f[0], f[1]);
#pragma unroll
        for (int st = 0; st < 2; ++st) {
          const int s = 2 * q + st;  // k16 step of the chunk: 16-byte segments 2s, 2s+1
          const uint32_t addr = stage + s * 32;  // segment 2s (+ hi in the lane's base)
          if constexpr (NT >= 16) {
#pragma unroll
            for (int q16 = 0; q16 < NT / 16; ++q16) {  // tokens 16 q16 .. 16 q16 + 15
              uint32_t b0, b1, b2, b3;
              sm90::ldsm_x4(addr + q16 * 16 * kActRowStride, b0, b1, b2, b3);
              sm90::mma_16816(acc[2 * q16], f[st], b0, b1);
              sm90::mma_16816(acc[2 * q16 + 1], f[st], b2, b3);
            }
          } else {
            uint32_t b0, b1;
            sm90::ldsm_x2(addr, b0, b1);
            sm90::mma_16816(acc[0], f[st], b0, b1);
          }
        }
      }
      // NOTE: every lane arrives (empty[] counts kThreads): a lane's arrival (release) orders its own
      // reads of the stage, whose results the MMAs above consumed, before any refill that waits on it.
      // One instruction per warp, where the elected arrival after __syncwarp cost ~4 (SASS).
      sm90::mbar_arrive(empty_bar + d * 8);
    }
    pass_parity ^= 1u;
  }
}

// ---- GEMM2 with the finalize fused (top_k >= 2) --------------------------------------------------------
// After this CTA's y stores: each valid row arrives on the counter of (its token, this N tile); the CTA
// that brings a counter to top_k resets it and finalizes that token over the tile's columns,
// out = bf16(sum_j w_j * y_j) with slots j in order from 0 (nvfp4::finalize_token8, the finalize
// kernel's arithmetic: the same bits). s_token: [kTileRows] shared ints.
// NOTE (ordering): the CTA barrier orders every y store of the CTA before the arrivals; each arrival
// is an acq_rel atomic at gpu scope, whose release side publishes those stores (release is cumulative
// over what the barrier ordered before it) and whose acquire side, for the last arrival, makes the
// other CTAs' released y visible; the barrier after it passes that on to the CTA, which reads y
// through L2 (__ldcg), never a stale L1 line. No full fence per thread (the split-K path's pattern).
// A token's rows lie in different tiles (different experts) or in this one; each row arrives once.

__device__ __forceinline__ void gemm2_finalize_tile(const Params& p, int ntile, int64_t row_start, int valid_rows,
                                                    int32_t* s_token) {
  __syncthreads();
  const int tid = threadIdx.x, k = p.fin_top_k;
  if (tid < valid_rows) {
    const int32_t token = p.row_to_entry[row_start + tid] / k;
    int32_t* counter = p.fin_counters + static_cast<int64_t>(token) * p.n_ctas + ntile;
    const bool last = sm90::atomic_add_acq_rel_gpu(counter, 1) == k - 1;
    if (last) *counter = 0;  // every row of the token has arrived: ready for the next launch
    s_token[tid] = last ? token : -1;
  }
  __syncthreads();
  constexpr int kItems = kRowsPerCta / 8;  // 8 output columns per item
  const int n0 = ntile * kRowsPerCta;
  for (int it = tid; it < valid_rows * kItems; it += kThreads) {
    const int32_t token = s_token[it / kItems];
    const int n = n0 + (it % kItems) * 8;
    if (token < 0 || n >= p.N) continue;  // N % 16 == 0: an item is wholly in or out
    float acc[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) acc[q] = 0.0f;
    nvfp4::finalize_token8<4>(acc, k, static_cast<int64_t>(token) * k, p.out_weights, nullptr, 0, p.y + n, p.N);
    nvfp4::store_bf16x8(p.out + static_cast<int64_t>(token) * p.N + n, acc);
  }
}

// ---- the GEMM1 -> GEMM2 hand-off per tile (GemmEarlyStart::TileReady) --------------------------------
// GEMM1: after the CTA barrier that follows every act store of the tile's columns, one thread adds 1
// (release at gpu scope: cumulative over the stores the barrier ordered before it, as in
// gemm2_finalize_tile). GEMM2: one thread polls with acquire loads, then a CTA barrier passes that on;
// the activations are read by cp.async.cg (L2), never a stale L1 line.
// NOTE (no deadlock): a GEMM2 CTA becomes resident only once every GEMM1 CTA has triggered its
// dependents (after its own wait) or left, so every GEMM1 CTA it may wait for already runs.
__device__ __forceinline__ void signal_tile_ready(int32_t* flag) { sm90::red_add_release_gpu(flag); }
__device__ __forceinline__ void wait_tile_ready(const int32_t* flag, int count) {
  auto ready = [&] { return sm90::ld_acquire_gpu(flag) >= count; };
  if (ready()) return;
  const uint64_t t0 = sm90::global_ns();
  while (!ready()) {
    __nanosleep(64);
    // A GEMM1 that does not signal (a launch-order error) traps here after ~4 s instead of hanging.
    if (sm90::global_ns() - t0 > 4000000000ull) __trap();
  }
}


// ---- GEMM1 epilogue: one (token, 2 columns) pair per thread -----------------------------------------
// The arithmetic of sm90gemm::gemm1_items (activation, then the NVFP4 fake-quantization of each
// 16-column block), spread finer: pair q of token row r is item r * cols / 2 + q, so the 8 pairs of a
// 16-column block are 8 consecutive lanes, which combine their block's amax with three shuffles (a
// maximum: the same scale bits in any order). Output columns [i0, i0 + cols) of the tile's rows.
// NOTE (why not gemm1_epilogue's 16-column items): a decode tile has 1..32 token rows, i.e. 4..128
// items of 16 columns for 256 threads. At T = 1 one warp per CTA ran the whole epilogue, 16
// activations per thread in ~1000 instructions that every SM fetched cold (ncu source counters,
// qwen3-30b-a3b T = 1: most of GEMM1's "no instruction" stalls, on a single warp). Pairs give every
// warp a share and need a fraction of the code.
template <Activation K, int kStride>
__device__ __forceinline__ void gemm1_pairs(const Params& p, const float* stg, const float* bias, int64_t out_base,
                                            int cols, int valid_rows, float gs, float inv_gs) {
  constexpr bool kGated = K != Activation::Relu2;
  constexpr int kUpRow = kRowsPerCta / 2;  // kStride: floats per staging row (StreamTile::kStgStride)
  const int per_row = cols / 2;  // cols % 16 == 0: a whole number of 8-lane blocks per row
  const int total = per_row * valid_rows;
  const int lane = threadIdx.x % 32;
  // Warp-uniform trip count: every lane takes part in the shuffles. total % 8 == 0, so a dead lane's
  // 8-lane group is dead as a whole and never mixes into a live block's amax.
  for (int base = threadIdx.x - lane; base < total; base += kThreads) {
    const int it = base + lane;
    const bool live = it < total;
    const int tok = live ? it / per_row : 0, col = live ? (it % per_row) * 2 : 0;
    const float* src = stg + col * kStride + tok;  // staging row = output column (gate), + kUpRow (up)
    float h0 = src[0], h1 = src[kStride];
    float u0 = kGated ? src[kUpRow * kStride] : 0.0f, u1 = kGated ? src[(kUpRow + 1) * kStride] : 0.0f;
    if (bias != nullptr && live) {  // kernel-uniform but for dead lanes: h = alpha * acc + b (expert biases)
      h0 = __fadd_rn(h0, bias[col]);
      h1 = __fadd_rn(h1, bias[col + 1]);
      if (kGated) {
        u0 = __fadd_rn(u0, bias[p.out_cols + col]);
        u1 = __fadd_rn(u1, bias[p.out_cols + col + 1]);
      }
    }
    float x0 = expert_gemm::activation<K>(p.act, h0, u0, expert_gemm::activation_denominator<K>(p.act, h0));
    float x1 = expert_gemm::activation<K>(p.act, h1, u1, expert_gemm::activation_denominator<K>(p.act, h1));
    if (p.quantize) {  // kernel-uniform
      float amax = nvfp4::amax_update(nvfp4::amax_update(0.0f, x0), x1);
#pragma unroll
      for (int m = 1; m < 8; m <<= 1) amax = nvfp4::amax_combine(amax, __shfl_xor_sync(0xffffffffu, amax, m));
      const uint32_t sf = nvfp4::nvfp4_block_scale(amax, gs);
      const float osc = nvfp4::nvfp4_output_scale(sf, inv_gs), sf_value = nvfp4::e4m3_to_float(sf);
      x0 = __fmul_rn(nvfp4::e2m1_round_value(__fmul_rn(x0, osc)), sf_value);
      x1 = __fmul_rn(nvfp4::e2m1_round_value(__fmul_rn(x1, osc)), sf_value);
    }
    if (live)
      *reinterpret_cast<uint32_t*>(p.act_out + out_base + tok * static_cast<int64_t>(p.out_cols) + col) =
          nvfp4::pack_bf16x2(x0, x1);
  }
}

// gemm1_pairs as an expert_gemm::gemm1_epilogue loop (that function's setup: valid columns, the expert's
// re-quantization scale, the activation kind as a template parameter).
template <int kStride>
struct Gemm1Pairs {
  template <Activation K>
  __device__ __forceinline__ static void run(const Params& p, const float* stg, const float* bias, int64_t out_base,
                                             int cols, int valid_rows, float gs, float inv_gs) {
    gemm1_pairs<K, kStride>(p, stg, bias, out_base, cols, valid_rows, gs, inv_gs);
  }
};

// ---- kernel -------------------------------------------------------------------------------------------
// kOp = p.epilogue: GEMM2 (y or the fused top-1 finalize), the gated GEMM1 or the plain (relu2) GEMM1.
// NOTE: the op is a template parameter so that each kernel holds one kind of weight copy (the gated
// GEMM1's 5-D boxes, the others' 4-D): with the op at run time, both copy paths sat at every unrolled
// stage of GEMM1's main loop, 10-12% of its code (nvdisasm), which the SMs fetch.
template <Epilogue kOp, int TileRows>
__global__ void __launch_bounds__(kThreads, StreamTile<TileRows>::kCtasPerSm)
    expert_gemm_stream_kernel(const StreamParams sp, const __grid_constant__ StreamMaps maps) {
  constexpr bool kGemm2 = kOp == Epilogue::Gemm2;
  using C = StreamTile<TileRows>;
  constexpr int kTileRows = C::kTileRows, kHalves = C::kHalves, kStgStride = C::kStgStride;
  constexpr int kPartialFloats = C::kPartialFloats;
  extern __shared__ __align__(128) uint8_t smem[];  // C::kSmemBytes: the ring, mbarriers
  __shared__ int s_last;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const uint32_t smem_base = sm90::smem_addr(smem);
  const Params& p = sp.base;
  // The early start (GemmEarlyStart, kernel-uniform): AfterWait waits here; TileTable finds the tile,
  // issues the ring's first weight copies and then waits (below).
  // NOTE: a tile's weights do not depend on the previous kernels, only which tile (expert) it is; the
  // ring's first chunks then land while the previous kernel still runs instead of after a launch
  // boundary plus an HBM round trip.
  const bool issue_early = sp.early != GemmEarlyStart::AfterWait;
  const bool tile_wait = sp.early == GemmEarlyStart::TileReady;  // GEMM2 only (the launcher checks)
  if (!issue_early) dependent_launch_prologue();
  // NOTE: the grid covers max_tiles(T*k, E, rows) tiles; at decode most are past *num_tiles (deepseek-r1
  // T = 64: 9408 of 16128 GEMM2 CTAs, ncu), so a CTA first finds whether it has a tile, in 32-bit
  // arithmetic (with the two 64-bit divisions by n_ctas and split_k, every warp of every CTA ran 83
  // instructions up to that check, SASS).
  const unsigned bid = blockIdx.x, n_ctas = static_cast<unsigned>(p.n_ctas), split_k = static_cast<unsigned>(sp.split_k);
  const int tile = static_cast<int>(bid / (n_ctas * split_k));
  // NOTE: the tile table is read through L2 (__ldcg) in both modes: the early start reads it before the
  // wait (written >= 2 launches earlier, never a stale L1 line); after the wait, L2 costs one load per
  // CTA at most what a plain load costs, and one form serves both.
  // NOTE: the tile's table entries are loaded with *num_tiles, not after the check: one L2 round trip
  // fewer before the first weight copy (tile < max_tiles: inside the table; past *num_tiles an entry
  // may be stale, and is not used).
  const int num_tiles = __ldcg(p.num_tiles);
  const int expert = __ldcg(p.tile_expert + tile);
  const int64_t tile_row0 = __ldcg(p.tile_row_start + tile);
  if (tile >= num_tiles) {  // the whole CTA leaves before any ring barrier
    // NOTE: every CTA waits before it ends, so the grid's completion still implies its predecessors'.
    // With TileReady it does not (it would hold its slot until GEMM1 ends): GEMM2's completion then
    // implies that every GEMM1 CTA with a tile has signalled, i.e. has stored its act columns.
    if (issue_early && !tile_wait) dependent_wait();
    return;
  }
  const int ntile = static_cast<int>(bid % n_ctas);
  const int split = static_cast<int>((bid / n_ctas) % split_k);
  // NOTE: the barriers and the map prefetch do not depend on the previous kernel: before its wait.
  if (tid == 0) {
    for (int i = 0; i < C::kStages; ++i) {
      sm90::mbar_init(smem_base + C::kBarrierOffset + i * 8, C::kFullArrivals);        // full[i]
      sm90::mbar_init(smem_base + C::kBarrierOffset + (C::kStages + i) * 8, kThreads);  // empty[i]
    }
    sm90::mbar_init_fence();
    sm90::tma_prefetch(&maps.w);
    sm90::tma_prefetch(&maps.scale);
  }
  const int valid_rows =
      static_cast<int>(min(static_cast<int64_t>(kTileRows), __ldcg(p.expert_offsets + expert + 1) - tile_row0));
  // NOTE: the epilogue's per-expert scalars are read here and kept in shared memory (published by the
  // barrier before the main loop): read after the main loop, each cost an L2 round trip at the end of
  // every CTA (SASS), on the critical path when the grid is one wave.
  __shared__ float s_alpha, s_act_scale;
  if (tid == 0) {
    s_alpha = p.alpha[expert];
    s_act_scale = !kGemm2 && p.quantize ? p.act_scale[expert] : 0.0f;
  }
  constexpr bool gated = kOp == Epilogue::Gemm1Gated;
  StageSource src{&maps.w, &maps.scale, gated ? ntile * (kGroupsPerCta / 2) : ntile * kGroupsPerCta, expert, gated,
                  p.a, false};
  {
    const int arow = 16 * (warp % C::kCopyWarps) + lane / 2;  // this lane's tile row when its warp fills
    if (arow < valid_rows) {
      int64_t src_row = tile_row0 + arow;  // GEMM1 with the gather fused: the token of the row's entry
      if (!kGemm2 && p.a_row_to_entry != nullptr)
        src_row = p.a_row_to_entry[src_row] / p.a_top_k;
      src.a_row = p.a + src_row * static_cast<int64_t>(p.K);
      src.row_ok = true;
    }
  }

  int slot_a, slot_b;  // the warp's slots (rows g and g+8 of its m16 tile)
  if (gated) {
    slot_a = warp;
    slot_b = kGroupsPerCta / 2 + warp;
  } else {
    slot_a = 2 * warp;
    slot_b = 2 * warp + 1;
  }
  const int c0 = split * sp.chunks_per_split;
  const int c1 = min(p.chunks, c0 + sp.chunks_per_split);
  // NOTE: the chunks the main loop prefetches (kPrefetch), not the whole first pass (kStages): skipping
  // copies inside the loop cost a select per refill there, ~1% at T >= 8.
  if (issue_early && tid == 0) {  // the prefetched chunks' weights (the mbarriers are this thread's)
#pragma unroll
    for (int j = 0; j < C::kPrefetch; ++j)
      if (c0 + j < c1)
        issue_weight_copies<C>(src, smem_base + j * C::kStageBytes, smem_base + C::kBarrierOffset + j * 8, c0 + j);
  }
  // Fill group 0 covers every tile row: its lanes zero the idle ones.
  if (warp < C::kCopyWarps && !src.row_ok) zero_idle_act_row<C>(smem_base, warp, lane);
  __syncthreads();  // the barriers are initialised and the idle rows zeroed before any thread arrives or waits
  if (tile_wait) {  // the tile's act columns from here on; the other inputs are >= 2 launches old
    if (tid == 0) wait_tile_ready(sp.tile_ready + tile, sp.tile_ready_count);
    __syncthreads();
    dependent_trigger();
  } else if (issue_early) {
    dependent_launch_prologue();  // the activations (and the epilogue's inputs) from here on
  }

  float acc[kHalves][4];
#pragma unroll
  for (int h = 0; h < kHalves; ++h)
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[h][r] = 0.0f;
  if (valid_rows <= 8) mainloop<C, 8>(p, smem_base, src, slot_a, slot_b, c0, c1, issue_early, acc);
  else if (kTileRows == 16 || valid_rows <= 16)
    mainloop<C, 16>(p, smem_base, src, slot_a, slot_b, c0, c1, issue_early, acc);
  else mainloop<C, kTileRows>(p, smem_base, src, slot_a, slot_b, c0, c1, issue_early, acc);
  // NOTE: the epilogue reloads the tile's row start (L1/L2 hit) rather than keeping it live across the
  // main loop.
  const int64_t row_start = p.tile_row_start[tile];

  if (sp.split_k > 1) {
    // Publish this split's partial (fragment order: kHalves x 16 B per thread, stored and summed whole).
    const int64_t out_tile = static_cast<int64_t>(tile) * p.n_ctas + ntile;
    float* part = sp.partials + (out_tile * sp.split_k) * kPartialFloats + tid * 4 * kHalves;
    float4* mine = reinterpret_cast<float4*>(part + static_cast<int64_t>(split) * kPartialFloats);
#pragma unroll
    for (int h = 0; h < kHalves; ++h) mine[h] = make_float4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
    __threadfence();  // the partial is visible device-wide before this CTA's arrival
    __syncthreads();
    if (tid == 0) {
      const int prev = atomicAdd(sp.counters + out_tile, 1);
      const int last = prev == sp.split_k - 1;
      if (last) sp.counters[out_tile] = 0;  // every split has arrived: ready for the next launch
      s_last = last;
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();  // acquire side of the counter: the other splits' partials are read after it
    // Fixed order 0..split_k-1 (deterministic); __ldcg: straight from L2, never a stale L1 line.
    // NOTE (loads first): the partials of kSplitBatch splits are loaded before the first add; with a
    // split's loads and adds per iteration, the last CTA of every output tile waited for split_k L2
    // round trips in a row (SASS: each split's loads issued after the previous split's adds).
    constexpr int kSplitBatch = 8 / kHalves;  // 32 floats in flight per thread
#pragma unroll 1
    for (int s0 = 0; s0 < sp.split_k; s0 += kSplitBatch) {
      float4 v[kSplitBatch][kHalves];
#pragma unroll
      for (int b = 0; b < kSplitBatch; ++b) {
        if (s0 + b >= sp.split_k) break;
        const float4* src = reinterpret_cast<const float4*>(part + static_cast<int64_t>(s0 + b) * kPartialFloats);
#pragma unroll
        for (int h = 0; h < kHalves; ++h) v[b][h] = __ldcg(src + h);
      }
#pragma unroll
      for (int b = 0; b < kSplitBatch; ++b) {
        if (s0 + b >= sp.split_k) break;
#pragma unroll
        for (int h = 0; h < kHalves; ++h) {
          if (s0 + b == 0) {
            acc[h][0] = v[b][h].x, acc[h][1] = v[b][h].y, acc[h][2] = v[b][h].z, acc[h][3] = v[b][h].w;
          } else {
            acc[h][0] = __fadd_rn(acc[h][0], v[b][h].x), acc[h][1] = __fadd_rn(acc[h][1], v[b][h].y);
            acc[h][2] = __fadd_rn(acc[h][2], v[b][h].z), acc[h][3] = __fadd_rn(acc[h][3], v[b][h].w);
          }
        }
      }
    }
  }

  const float alpha = s_alpha;
  if constexpr (kGemm2) {
    const int n_g = ntile * kRowsPerCta + 16 * warp + g;  // row g of the warp's m16 tile
    const bool top1 = p.out != nullptr && p.fin_counters == nullptr;  // top-1: finalize's arithmetic, 0 + w * y, bf16
    // NOTE (loads first): the thread's 2 * kHalves token rows' entries (and top-1 weights) are loaded
    // before the first store; loaded per store, each waited for the previous store (SASS: the
    // compiler does not move a load above a store that may alias it).
    int64_t entry[kHalves][2];
    float w[kHalves][2];
#pragma unroll
    for (int h = 0; h < kHalves; ++h)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int tok = 8 * h + 2 * t + c;
        entry[h][c] = tok < valid_rows ? p.row_to_entry[row_start + tok] : 0;
      }
#pragma unroll
    for (int h = 0; h < kHalves; ++h)
#pragma unroll
      for (int c = 0; c < 2; ++c)
        w[h][c] = top1 && p.out_weights != nullptr && 8 * h + 2 * t + c < valid_rows ? p.out_weights[entry[h][c]] : 1.0f;
#pragma unroll
    for (int h = 0; h < kHalves; ++h)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int n = n_g + (r >= 2 ? 8 : 0);
        const int tok = 8 * h + 2 * t + (r & 1);
        if (tok < valid_rows && n < p.N) {
          const int64_t e = entry[h][r & 1];
          const float y = expert_gemm::epilogue_scale(alpha, acc[h][r]);
          if (top1) p.out[e * p.N + n] = __float2bfloat16_rn(__fadd_rn(0.0f, __fmul_rn(w[h][r & 1], y)));
          else p.y[e * p.N + n] = y;
        }
      }
    if (p.fin_counters != nullptr) {
      __shared__ int32_t s_token[kTileRows];
      gemm2_finalize_tile(p, ntile, row_start, valid_rows, s_token);
    }
  } else {
    // Staging tile stg[row][token] (fp32): gated: gate column 8w+g at row 8w+g, its up column at row
    // 64 + 8w + g; relu2: weight row 16w+g (+8) at the same row. It overlays the weight ring.
    __syncthreads();  // every warp is done with its last ldmatrix
    float* stg = reinterpret_cast<float*>(smem);
    const int row_g = gated ? 8 * warp + g : 16 * warp + g;
    const int row_g8 = gated ? kRowsPerCta / 2 + 8 * warp + g : 16 * warp + g + 8;
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      const int tok = 8 * h + 2 * t;
      *reinterpret_cast<float2*>(stg + row_g * kStgStride + tok) = make_float2(
          expert_gemm::epilogue_scale(alpha, acc[h][0]), expert_gemm::epilogue_scale(alpha, acc[h][1]));
      *reinterpret_cast<float2*>(stg + row_g8 * kStgStride + tok) = make_float2(
          expert_gemm::epilogue_scale(alpha, acc[h][2]), expert_gemm::epilogue_scale(alpha, acc[h][3]));
    }
    __syncthreads();
    const int cols_cta = gated ? kRowsPerCta / 2 : kRowsPerCta;
    expert_gemm::gemm1_epilogue<Gemm1Pairs<kStgStride>>(p, stg, ntile * cols_cta, cols_cta, row_start, valid_rows,
                                                     s_act_scale, expert);
    if (sp.tile_ready != nullptr) {  // kernel-uniform
      __syncthreads();  // every act store of the CTA
      if (tid == 0) signal_tile_ready(sp.tile_ready + tile);
    }
  }
}

}  // namespace fp4moe::kernels::sm90stream
