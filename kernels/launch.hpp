// kernels/launch.hpp — host-side launchers of the CUDA kernels (private to the library).
//
// Data flow of one MoE forward (T tokens, k slots, "entry" = token-slot pair t*k + j, "row" = an
// entry's position in expert-major permuted order):
//
//   route_topk            logits [T,E] (f32|bf16), bias [E]     -> topk_ids [T,k] i32, topk_weights [T,k] f32
//   permute_build         topk_ids [T,k]                        -> expert_offsets [E+1], row_to_entry [T*k],
//                                                                  entry_to_row [T*k], GEMM tile table
//                         (at decode both steps may run as one launch: launch_route_permute)
//   gather_quantize       hidden [T,H] bf16, entry_to_row       -> a1 [T*k,H] bf16 (GEMM1 A operand values:
//                                                                  x for w4a16, q*sf for w4a4)
//   gemm1_act             a1, w13 fp4 + e4m3, alpha1 [E]        -> act [T*k,I] bf16 (bf16(act) for w4a16,
//                                                                  q*sf of its NVFP4 re-quantization for w4a4)
//   gemm2                 act, w2 fp4 + e4m3, alpha2 [E]        -> y [T*k,H] f32, row r stored at entry row_to_entry[r]
//   finalize              y, topk_weights                        -> out [T,H] bf16 (fp32 sum in slot order)
//   quantize_nvfp4        bf16 [T,H] -> packed e2m1 [T,H/2] + e4m3 scales (linear or 128x4 swizzled)
//
// All pointers are device pointers. Every launcher checks its launch and returns cudaSuccess or the
// CUDA error; none synchronises or allocates.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "fp4moe/problem.hpp"
#include "fp4moe/tactic.hpp"

namespace fp4moe::kernels {

// ---- routing --------------------------------------------------------------------------------------
struct RouteArgs {
  const void* logits = nullptr;  // [T, E]
  bool logits_bf16 = false;      // false: fp32
  const float* bias = nullptr;   // [E] or nullptr (DeepSeekV3)
  int num_tokens = 0;
  int num_experts = 0;
  RoutingParams params;          // method != Precomputed
  int32_t* topk_ids = nullptr;   // [T, k]
  float* topk_weights = nullptr; // [T, k]
  // Optional, W4A4 with a scalar input scale: the route kernel also writes each token's row of hidden
  // fake-quantized to NVFP4 (q * sf in bf16, gather_quantize's scalar arithmetic) to quant_out: the
  // operand that GEMM1 gathers per entry (Gemm1Args::a_row_to_entry).
  __nv_bfloat16* quant_out = nullptr;     // [T, H] or nullptr
  const __nv_bfloat16* hidden = nullptr;  // [T, H], 16-byte aligned
  int hidden_size = 0;                    // H, a multiple of 16
  const float* input_scale = nullptr;     // [1] a1 (dequant direction)
};
cudaError_t launch_route(const RouteArgs& args, cudaStream_t stream);

// ---- permutation ----------------------------------------------------------------------------------
// Expert-major, stable (within an expert, rows ascend by entry index t*k+j), computed on the device.
// The tile table lists the GEMM row tiles: tile i covers rows [tile_row_start[i], +tile_rows) of
// expert tile_expert[i], clipped to the expert's end. *num_tiles is written on the device; at most
// max_tiles(T*k, E, tile_rows) tiles exist. Ids outside [0, E) (bad precomputed routing) are placed
// after every expert: expert_offsets[E] counts the valid entries only, their rows belong to no expert.
struct PermuteArgs {
  const int32_t* topk_ids = nullptr;  // [T, k]
  int num_tokens = 0;
  int top_k = 0;
  int num_experts = 0;
  int tile_rows = 0;                  // GEMM row-tile size the table is built for
  int32_t* expert_offsets = nullptr;  // [E + 1]
  int32_t* row_to_entry = nullptr;    // [T*k]
  int32_t* entry_to_row = nullptr;    // [T*k]
  int32_t* tile_expert = nullptr;     // [max_tiles]
  int32_t* tile_row_start = nullptr;  // [max_tiles]
  int32_t* num_tiles = nullptr;       // [1]
  void* scratch = nullptr;            // permute_scratch_bytes(T*k, E) bytes
  // Also set to zero by the launch (its one-block kernel), for later kernels of the forward: GEMM2's
  // fused-finalize counters, the split-K arrival counters, the GEMM1 -> GEMM2 tile_ready counts. Costs no launch (and no memset) of its own.
  static constexpr int kZeroRanges = 4;
  int32_t* zero_words[kZeroRanges] = {};  // range i: [zero_count[i]]
  int64_t zero_count[kZeroRanges] = {};
};
inline int64_t max_tiles(int64_t num_entries, int64_t num_experts, int64_t tile_rows) {
  return (num_entries + tile_rows - 1) / tile_rows + (num_entries < num_experts ? num_entries : num_experts);
}
size_t permute_scratch_bytes(int64_t num_entries, int64_t num_experts);
cudaError_t launch_permute(const PermuteArgs& args, cudaStream_t stream);

// ---- routing and permutation in one launch (decode) -------------------------------------------------
// launch_route then launch_permute on the routed ids, as one launch of one block: the same outputs,
// bit for bit, and one kernel boundary fewer in the forward's chain of dependent launches. Only where
// route_permute_fits: T * k <= 256 entries (permute_block::kSmallEntries, the permutation's one-block
// path) and T <= permute_block::kWarps (one token per warp of the block), and T = 1 for DeepSeekV3
// (whose routing takes a block per token). permute.topk_ids, num_tokens, top_k and num_experts must be
// the route's; otherwise, or where it does not fit, cudaErrorInvalidValue.
bool route_permute_fits(const RoutingParams& params, int64_t num_tokens);
cudaError_t launch_route_permute(const RouteArgs& route, const PermuteArgs& permute, cudaStream_t stream);

// ---- activation quantization ----------------------------------------------------------------------
enum class ScaleLayout { Linear, Swizzled128x4 };
// x [rows, cols] bf16 -> packed [rows, cols/2], scales [rows, cols/16] (linear) or swizzled
// (format::swizzled_scales_size(1, rows, cols/16) bytes, padding written as zero).
// input_scale: device pointer to one fp32 (dequant direction).
cudaError_t launch_quantize_nvfp4(const __nv_bfloat16* x, int64_t rows, int64_t cols,
                                  const float* input_scale, uint8_t* packed, uint8_t* scales,
                                  ScaleLayout layout, cudaStream_t stream);

// ---- the rows between the layer's stages (MoeRunner::prepare / experts) -----------------------------
// prepare: hidden [T, H] -> rows [S, H], S = T (one row per token) or T*k (per_entry: row t*k + j for
// entry (t, j)), each row the GEMM1 operand of gather_quantize's arithmetic:
//   w4a16:            bf16 rows x (times bf16(w[entry]) first when scale_by_weight)
//   w4a4_scalar:      NVFP4(x or its weighted form, input_scale[0]) as packed e2m1 [S, H/2] + e4m3 scales
//   w4a4_per_expert:  NVFP4 with input_scale[topk_ids[entry]] (per_entry only; an id outside [0, E) gives
//                     NaN scales)
// Scales are [S, H/16] (linear) or the 128x4-swizzled matrix of format::swizzled_scales_size(1, S, H/16)
// bytes, padding written as zero.
struct PrepareRowsArgs {
  const __nv_bfloat16* hidden = nullptr;  // [T, H], 16-byte aligned
  const int32_t* topk_ids = nullptr;      // [T, k] (w4a4_per_expert)
  const float* topk_weights = nullptr;    // [T, k] (scale_by_weight)
  const float* input_scale = nullptr;     // [1] or [E], dequant direction (w4a4)
  int num_tokens = 0;
  int top_k = 1;
  int hidden_size = 0;
  int num_experts = 0;
  bool per_entry = false;
  bool scale_by_weight = false;           // needs per_entry
  ActQuant mode = ActQuant::W4A16;
  ScaleLayout scale_layout = ScaleLayout::Linear;
  void* values = nullptr;                 // bf16 [S, H] (16-byte aligned) or packed [S, H/2] (8-byte aligned)
  uint8_t* scales = nullptr;              // NVFP4 rows only
};
cudaError_t launch_prepare_rows(const PrepareRowsArgs& args, cudaStream_t stream);
// NVFP4 rows (packed [rows, cols/2], scales linear or swizzled as prepare writes them) -> bf16 q * sf
// [rows, cols], exact: the GEMM1 operand.
cudaError_t launch_dequantize_rows(const uint8_t* packed, const uint8_t* scales, ScaleLayout layout, int64_t rows,
                                   int64_t cols, __nv_bfloat16* out, cudaStream_t stream);

// GEMM1 A operand, permuted: a1[entry_to_row[t*k + j]] = values of token t (j = 0..k-1).
//   w4a16:            bf16 x[t] (times bf16(w) first when scale_by_weight)
//   w4a4_scalar:      q*sf of NVFP4(x[t], input_scale[0])
//   w4a4_per_expert:  q*sf of NVFP4(x[t], input_scale[e]) with e the row's expert
struct GatherArgs {
  const __nv_bfloat16* hidden = nullptr;  // [T, H]
  const int32_t* entry_to_row = nullptr;  // [T*k] (from launch_permute)
  const int32_t* topk_ids = nullptr;      // [T, k] (the row's expert)
  const float* topk_weights = nullptr;    // [T, k] (scale_by_weight)
  const float* input_scale = nullptr;     // [1] scalar mode, [E] per-expert mode, unused in w4a16
  int num_tokens = 0;
  int top_k = 0;
  int hidden_size = 0;
  int num_experts = 0;                    // E, the bound of topk_ids (required by w4a4_per_expert;
                                          // a row whose id is outside [0, E) gets NaN values)
  ActQuant mode = ActQuant::W4A16;
  bool scale_by_weight = false;           // apply_router_weight_on_input: x' = bf16(x * bf16(w))
  __nv_bfloat16* a1 = nullptr;            // [T*k, H]
};
cudaError_t launch_gather_quantize(const GatherArgs& args, cudaStream_t stream);

// ---- expert GEMMs ---------------------------------------------------------------------------------
// Expert weights in the layout of the GEMM kernels (kernels/nvfp4/weight_layout.cuh): every group of 8
// rows and 128-wide K chunk is 512 bytes in the order the MMA fragments want, K padded with zeros to a
// multiple of 128 (padded_cols); N is not padded. Scales get their own 8-bit code (one per 16 K
// elements). Built once on the host from the canonical layout.
struct PrepackedWeights {
  int64_t num_experts = 0;
  int64_t rows = 0;          // N
  int64_t cols = 0;          // K
  int64_t padded_cols = 0;   // K rounded up to 128
  size_t weight_bytes = 0;   // num_experts * rows * padded_cols / 2
  size_t scale_bytes = 0;    // num_experts * rows * padded_cols / 16
};
// w [E, N, K/2] e2m1 pairs (element 2j in the low nibble of byte j), w_scale [E, N, K/16] e4m3 (linear)
// -> w_out (weight_bytes), scale_out (scale_bytes), resized here. Exact: the kernels decode q * sf.
// Throws fp4moe::Error when N or K is not a positive multiple of 16 or a scale is NaN (0x7F/0xFF);
// a negative scale is folded into the weights' signs.
PrepackedWeights prepack_expert_weights(const uint8_t* w, const uint8_t* w_scale, int64_t E, int64_t N,
                                        int64_t K, std::vector<uint8_t>& w_out,
                                        std::vector<uint8_t>& scale_out);

// What a streaming GEMM launch (GemmKernel::Sm90Stream) may do before its programmatic-dependent-launch
// wait (kernels/dependent_launch.cuh), i.e. while the previous kernel of the stream still runs. The
// caller states which inputs were written two or more kernel launches earlier in the stream (or
// before the first of its launches that uses dependent launch): the runner, which knows its order.
//   AfterWait  nothing: every input is read after the wait (the default; any launch order).
//   TileTable  expert_offsets, tile_expert, tile_row_start and num_tiles are that old: each CTA reads
//              its tile and issues the weight copies of its ring's first chunks before the wait (the
//              activations after it), e.g. GEMM1 after a gather_quantize launch that follows permute.
//   TileReady  (GEMM2 only) as TileTable, and instead of waiting for the whole previous launch, each CTA
//              waits until its tile's GEMM1 CTAs have stored their act columns: tile_ready[tile] ==
//              tile_ready_count. The previous launch must be a streaming GEMM1 of the same tile table
//              that signals tile_ready (ExpertGemmArgs::tile_ready); GEMM2's CTAs then run while
//              GEMM1's last wave drains. A CTA that waits ~4 s without its count traps (a launch-order
//              error becomes a kernel error, not a hang).
// The wgmma kernel waits first in every mode but TileReady, which it rejects (it reads nothing early).
enum class GemmEarlyStart : int { AfterWait = 0, TileTable = 1, TileReady = 2 };

// CTAs along N of a streaming GEMM with N weight rows (128 rows each): GEMM1's is the tile_ready_count
// of the GEMM2 that follows it.
inline int64_t gemm_stream_ctas_along_n(int64_t N_rows) { return (N_rows + 127) / 128; }

// Shared by GEMM1 and GEMM2: rows of expert e are [expert_offsets[e], expert_offsets[e+1]).
struct ExpertGemmArgs {
  const __nv_bfloat16* a = nullptr;       // [rows, K] permuted activations (exact bf16 values; see a_row_to_entry)
  int64_t rows = 0;                       // rows of a (T*k): the bound of the wgmma kernel's copies
  const uint8_t* w = nullptr;             // prepacked weights (PrepackedWeights::weight_bytes)
  const uint8_t* w_scale = nullptr;       // prepacked scales (PrepackedWeights::scale_bytes)
  PrepackedWeights weights;               // what w / w_scale hold (checked against E, N, K)
  const float* alpha = nullptr;           // [E] global scale for the epilogue
  const int32_t* expert_offsets = nullptr;// [E+1]
  const int32_t* tile_expert = nullptr;   // tile table from launch_permute (built with gemm_tile_rows())
  const int32_t* tile_row_start = nullptr;
  const int32_t* num_tiles = nullptr;
  int64_t max_tiles = 0;                  // grid bound, max_tiles(T*k, E, gemm_tile_rows())
  int num_experts = 0;
  int64_t K = 0;                          // reduction size (H for GEMM1, I for GEMM2)
  int64_t N = 0;                          // weight rows (w13_rows for GEMM1, H for GEMM2)
  MoeTactic tactic;                       // which kernel; the tile table is built for its tile_tokens
  // Streaming kernel with s > 1 only (s = tactic.split_k1 for GEMM1, tactic.split_k2 for GEMM2):
  // gemm_stream_workspace_bytes(max_tiles, N, tactic.tile_tokens, s) bytes,
  // 16-byte aligned, ZEROED ONCE by the caller when allocated (its arrival counters are reset to zero by
  // every launch that uses them, so CUDA-graph replays and later launches need no memset). Launches that
  // use the same workspace must be stream-ordered.
  void* split_workspace = nullptr;
  GemmEarlyStart early_start = GemmEarlyStart::AfterWait;  // see GemmEarlyStart
  // Streaming kernel only (else cudaErrorInvalidValue): the per-tile hand-off of GemmEarlyStart::TileReady,
  // [max_tiles] int32 that must be ZERO WHEN GEMM1 STARTS (the runner's permute launch clears it,
  // PermuteArgs::zero_words; the GEMMs do not reset it). GEMM1: the CTA that stores an output tile's act
  // columns (the last split's) then adds 1 to tile_ready[tile] (release, GPU scope). GEMM2 with
  // early_start TileReady: waits for tile_ready[tile] == tile_ready_count (acquire), the GEMM1's
  // gemm_stream_ctas_along_n(N); GEMM2 without TileReady takes no tile_ready.
  int32_t* tile_ready = nullptr;
  int tile_ready_count = 0;
};
// One-time per-device setup of the GEMM kernels (shared-memory opt-in). The launchers call it too,
// but a caller that captures CUDA graphs calls it before capturing (MoeRunner::prepare_weights does).
cudaError_t configure_expert_gemm();

// Token rows per GEMM tile: the tile table passed to the GEMMs must be built with this
// (gemm_tile_rows() is the default tactic's).
int gemm_tile_rows();
int gemm_tile_rows(const MoeTactic& tactic);

struct Gemm1Args : ExpertGemmArgs {
  ActivationParams activation;            // gated: w rows [gate (I); up (I)]; relu2: I rows
  ActQuant mode = ActQuant::W4A16;
  const float* act_scale = nullptr;       // [E] w2_input_scale (w4a4 re-quantization), else unused
  __nv_bfloat16* act = nullptr;           // [T*k, I]
  // The gather fused into GEMM1's activation copies (both kernels). `a` is then the un-permuted
  // activation [T, K] (rows = T) and GEMM row r reads a[a_row_to_entry[r] / a_top_k] (the permute
  // kernel's row_to_entry, entry = token * top_k + slot).
  const int32_t* a_row_to_entry = nullptr;
  int a_top_k = 0;                        // >= 1 with a_row_to_entry
  const float* bias = nullptr;            // [E, N] w13_bias (expert biases): h = alpha * acc + bias, or nullptr
};
// Runs the kernel of args.tactic (the streaming kernel for sm90_stream, split args.tactic.split_k1 ways
// along K).
cudaError_t launch_gemm1_act(const Gemm1Args& args, cudaStream_t stream);

struct Gemm2Args : ExpertGemmArgs {
  const int32_t* row_to_entry = nullptr;  // [T*k]
  float* y = nullptr;                     // [T*k, H], indexed by entry, 16-byte aligned
  // Top-1 routing (k == 1) may fuse finalize: with `out` set, the GEMM writes out[t] = bf16(0 + w[t] * y[t])
  // (finalize's arithmetic; w = 1 when out_weights is null) and y is not written.
  __nv_bfloat16* out = nullptr;           // [T, H] or nullptr
  const float* out_weights = nullptr;     // [T] or nullptr (unit weights); [T, k] with finalize_counters
  // Streaming kernel (sm90_stream) only, else cudaErrorInvalidValue: the finalize fused for top_k >= 2.
  // With finalize_counters, y is written as usual, and then per (token, 128-column N tile) the CTA whose
  // row is the last of the token's finalize_top_k rows to arrive writes out[token] over that tile as
  // launch_finalize does (slots in order, w = out_weights[token * k + slot] or 1; bit for bit). The
  // counters, gemm2_finalize_counter_count(T, N) int32, must be zero when the launch starts; every
  // launch leaves them zero. Every entry must have a GEMM row (ids in range).
  int32_t* finalize_counters = nullptr;
  int finalize_top_k = 0;
};
// int32 arrival counters of GEMM2's fused finalize for T tokens and N output columns.
inline int64_t gemm2_finalize_counter_count(int64_t num_tokens, int64_t N) { return num_tokens * ((N + 127) / 128); }
// Runs the kernel of args.tactic (the streaming kernel split args.tactic.split_k2 ways along K).
cudaError_t launch_gemm2(const Gemm2Args& args, cudaStream_t stream);

// ---- streaming expert GEMMs (GemmKernel::Sm90Stream, kernels/sm90_expert_gemm_stream.cuh) ------
// Same arguments and results as launch_gemm1_act / launch_gemm2 (up to the fp32 summation order), for
// few token rows per expert: the tile table must be built with tile_rows (16 or 32) and
// max_tiles(T*k, E, tile_rows). split_k (1..kMaxStreamSplitK) CTAs share the K range of
// an output tile; split_k > 1 needs args.split_workspace (see ExpertGemmArgs). The split partial sums
// are added in fixed split order: results are deterministic run to run.
inline constexpr int kMaxStreamSplitK = 64;
bool gemm_stream_tile_supported(int tile_rows);  // 16 or 32
// The streaming kernels' shared-memory opt-in; called by configure_expert_gemm and by the launchers.
cudaError_t configure_expert_gemm_stream();
size_t gemm_stream_workspace_bytes(int64_t max_tiles, int64_t N_rows, int tile_rows, int split_k);
// The arrival counters at the start of that workspace (for launches with this max_tiles): a caller
// that cannot guarantee they are still zero (a workspace shared with other work) clears these bytes.
size_t gemm_stream_counter_bytes(int64_t max_tiles, int64_t N_rows);
cudaError_t launch_gemm1_act_stream(const Gemm1Args& args, int tile_rows, int split_k, cudaStream_t stream);
cudaError_t launch_gemm2_stream(const Gemm2Args& args, int tile_rows, int split_k, cudaStream_t stream);

// ---- finalize -------------------------------------------------------------------------------------
// out[t] = bf16( sum_j w[t,j] * y[t*k+j] ), fp32, slots in order; w = 1 when unit_weights.
struct FinalizeArgs {
  const float* y = nullptr;             // [T*k, H]
  const float* topk_weights = nullptr;  // [T, k]
  int num_tokens = 0;
  int top_k = 0;
  int hidden_size = 0;
  bool unit_weights = false;            // apply_router_weight_on_input
  const int32_t* topk_ids = nullptr;    // [T, k] or nullptr: when given, a slot whose id is outside
  int num_experts = 0;                  //   [0, num_experts) makes its token's output row NaN, or
  bool skip_foreign_ids = false;        //   with skip_foreign_ids adds nothing (another rank's expert)
  __nv_bfloat16* out = nullptr;         // [T, H], or
  float* out_f32 = nullptr;             //   [T, H] the fp32 sums, not rounded (exactly one of the two)
  const float* bias = nullptr;          // [E, H] w2_bias (expert biases): each slot adds w * (y + bias[id]);
                                        //   needs topk_ids and num_experts. nullptr: none
};
cudaError_t launch_finalize(const FinalizeArgs& args, cudaStream_t stream);

// ---- expert-parallel dispatch (runner/ep_dispatch.hpp is the CPU oracle; the same outputs) ----------
// Over N ranks (rank d holding experts [first(d), first(d+1)), io::expert_range's split) a source's S
// rows of rows_top_k ids each: a row goes once to every rank that holds one of its ids, destination-major,
// ascending source row within a destination. Written on the device, no host synchronisation:
struct EpPlanArgs {
  const int32_t* ids = nullptr;      // [S, rows_top_k]
  int num_rows = 0;                  // S
  int rows_top_k = 0;
  int num_experts = 0;               // E
  int ranks = 0;                     // N, 1 <= N <= E
  int32_t* send_offsets = nullptr;   // [N + 1]: rows for rank d are [send_offsets[d], send_offsets[d+1])
  int32_t* send_rows = nullptr;      // [S * min(N, rows_top_k)]: the source row of each sent row
  int32_t* send_ids = nullptr;       // [that * rows_top_k]: the destination's local ids, -1 elsewhere
  int32_t* send_entry_offsets = nullptr;  // [N + 1]: the slots with an id on rank d (the entries it
                                          //   returns) are [send_entry_offsets[d], send_entry_offsets[d+1])
  int32_t* gather_index = nullptr;   // [S * rows_top_k]: entry (s, j)'s row in the combined y (the ranks'
                                     //   returned entries in rank order), -1 for an id outside [0, E)
};
cudaError_t launch_ep_plan(const EpPlanArgs& args, cudaStream_t stream);

// The entries a rank computed from its received rows (ids [num_entries], local, -1: none): list[i] =
// the i-th entry with an id >= 0, ascending (ep::compact_entries); the rest of list is not written.
struct CompactEntriesArgs {
  const int32_t* ids = nullptr;
  int num_entries = 0;
  int32_t* list = nullptr;  // [num_entries]
};
cudaError_t launch_compact_entries(const CompactEntriesArgs& args, cudaStream_t stream);

// dst row i = src row index[i] (row_bytes each) for i < count, where count is *device_count when given
// (read on the device: the plan's send_offsets[N]), else max_rows; rows with index[i] < 0 are left as
// they are. Packs the rows of every destination (index = send_rows) and gathers the combined y back
// into entry order (index = gather_index).
struct GatherRowsArgs {
  const int32_t* index = nullptr;         // [max_rows]
  int max_rows = 0;
  const int32_t* device_count = nullptr;  // [1] or nullptr
  const void* src = nullptr;
  void* dst = nullptr;
  int64_t row_bytes = 0;
};
cudaError_t launch_gather_rows(const GatherRowsArgs& args, cudaStream_t stream);

// ---- expert-parallel all-gather (ep::localize_ids / ep::sum_partials are the CPU oracles) -----------
// local[i] = ids[i] - first_expert where first_expert <= ids[i] < first_expert + num_local_experts, else -1.
struct LocalizeIdsArgs {
  const int32_t* ids = nullptr;  // [num_ids] the whole layer's
  int num_ids = 0;
  int first_expert = 0;
  int num_local_experts = 0;
  int32_t* local = nullptr;      // [num_ids]
};
cudaError_t launch_localize_ids(const LocalizeIdsArgs& args, cudaStream_t stream);

// out[t, h] = sum over s = 0..ranks-1, in order, of partials[s, t, h] (fp32), rounded to bf16 once, or
// written as fp32: the sum of the ranks' partial outputs for this rank's tokens.
struct SumPartialsArgs {
  const float* partials = nullptr;  // [ranks, T, H]
  int ranks = 0;
  int num_tokens = 0;
  int hidden_size = 0;              // a multiple of 4 (float4 loads)
  __nv_bfloat16* out = nullptr;     // [T, H], or
  float* out_f32 = nullptr;         //   [T, H] (exactly one of the two)
  const int32_t* topk_ids = nullptr;  // [T, k] the tokens' whole-layer ids, or nullptr: a token with an id
  int top_k = 0;                      //   outside [0, num_experts) gets a NaN row, as the single layer's
  int num_experts = 0;                //   finalize gives it
};
cudaError_t launch_sum_partials(const SumPartialsArgs& args, cudaStream_t stream);

}  // namespace fp4moe::kernels
