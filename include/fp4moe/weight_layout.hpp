// fp4moe/weight_layout.hpp — the expert weights' input layouts, brought to the canonical one of
// docs/case-file.md (linear block scales, w13 rows [gate; up]) once at weight preparation (the GPU runner's
// MoeRunner::prepare_weights and the Python layer's CPU backend both start from it), and the
// tensor-parallel shards of canonical weights.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "fp4moe/problem.hpp"
#include "fp4moe/reference.hpp"

namespace fp4moe {

struct WeightPrepOptions {
  bool scales_swizzled = false;  // w13_scale / w2_scale given in the 128x4-swizzled layout
  bool w13_up_gate = false;      // w13 rows given as [up; gate] (FlashInfer order) instead of [gate; up]
};

namespace io {

// The tensors that a layout option can change, in the canonical layout (w2 itself never changes).
struct CanonicalExpertWeights {
  std::vector<uint8_t> w13;        // [E, w13_rows, H/2]  e2m1 pairs, rows [gate; up]
  std::vector<uint8_t> w13_scale;  // [E, w13_rows, H/16] e4m3, linear (MXFP4: [E, w13_rows, H/32] ue8m0)
  std::vector<uint8_t> w2_scale;   // [E, H, I/16]        e4m3, linear (MXFP4: [E, H, I/32] ue8m0)
  std::vector<float> w13_bias;     // [E, w13_rows] rows [gate; up], or empty (no bias given)
};

// Copies w13, w13_scale, w2_scale and w13_bias of `weights` (sized by `problem`, scales of its
// weight_format: e4m3 [.., K/16] or MXFP4 ue8m0 [.., K/32]) into the canonical layout (swizzled scales
// are NVFP4 only): swizzled scales are unswizzled (format::scales_swizzled_to_linear), [up; gate] halves swapped
// per expert (the bias's too). Throws fp4moe::Error when a tensor is null or w13_up_gate is asked of an ungated activation
// (the messages name the tensor or option; callers prefix their own name).
CanonicalExpertWeights canonical_expert_weights(const MoeProblem& problem, const reference::MoeWeights& weights,
                                                const WeightPrepOptions& options);

// ---- tensor parallelism ----------------------------------------------------------------------------
// Rank r of n holds a contiguous range of whole 16-column blocks of the intermediate size I of every
// expert (the I/16 blocks split as evenly as they go, the first ranks one more: I = 2880 over 8 ranks is
// 368 columns on ranks 0-3 and 352 on 4-7): those rows of gate and of up in w13 (relu2: of its I rows),
// those columns of w2, and their block scales; the per-expert scales (scale_2, input scales) stay whole.
// No e4m3 block of w2 (16 along I) and no block of the re-quantized activation (w4a4) straddles two
// ranks, so a rank's layer is a plain MoE layer with its share of I, its GEMM2 input is the whole
// layer's restricted to its columns (bit for bit), and the sum of the ranks' outputs is the whole
// layer's output up to fp32 summation order and the bf16 rounding of each rank's partial output (the
// caller all-reduces them). Expert biases: w13_bias keeps the rank's rows; w2_bias, added once per
// output, stays with rank 0 only.

// [begin, end) of I held by rank `rank` of `size`, in whole scale blocks of `block` columns (16 for
// NVFP4, 32 for MXFP4: MoeProblem::weight_block()); needs I / block >= size. Throws fp4moe::Error
// naming the bad value.
std::pair<int64_t, int64_t> tensor_parallel_range(int64_t inter, int rank, int size, int64_t block = 16);

// The expert weights of one tensor-parallel rank, owned.
struct TensorParallelShard {
  MoeProblem problem;              // the whole problem with inter = this rank's share of I
  int64_t inter_begin = 0, inter_end = 0;
  std::vector<uint8_t> w13, w13_scale;  // [E, 2 I_r, H/2], [E, 2 I_r, H/16]  rows [gate; up] (relu2: I_r rows)
  std::vector<uint8_t> w2, w2_scale;    // [E, H, I_r/2], [E, H, I_r/16]      I_r = inter_end - inter_begin
  std::vector<float> w13_scale_2, w13_input_scale, w2_scale_2, w2_input_scale;  // [E], as given (1.0 when absent)
  float w13_input_scale_max = 0.0f;                                             // as given
  std::vector<float> w13_bias;  // [E, 2 I_r] the rank's rows, or empty (no bias)
  std::vector<float> w2_bias;   // [E, H] on rank 0, else empty
  reference::MoeWeights weights() const;  // views into this object
};

// Canonical weights of `problem` -> rank `rank` of `size` (size 1: a copy). MXFP4: whole 32-column
// blocks of I, the ue8m0 scales sliced alike, the [E] scale vectors left empty (w4a16 only).
TensorParallelShard tensor_parallel_shard(const MoeProblem& problem, const reference::MoeWeights& weights, int rank,
                                          int size);

// ---- MXFP4 weights as NVFP4 ------------------------------------------------------------------------
// The GPU kernels take NVFP4 (e4m3 block scales of 16, their prepacked code covering 2^-9 .. 448 exactly,
// times an fp32 alpha per expert). An MXFP4 expert tensor whose ue8m0 codes span at most
// kMaxUe8m0Span powers of two (c_max - c_min <= 17) is exactly an NVFP4 one: with the base b = min(c_min,
// 245), each 32-block's code c becomes the e4m3 value 2^(c - b - 9) (2^-9 .. 2^8, e4m3 subnormals
// included) in both of its 16-blocks, and scale_2[e] = 2^(b - 118), so q * e4m3 * scale_2 = q * 2^(c-127)
// bit for bit (docs/numerics.md, "MXFP4 weights").
inline constexpr int kMaxUe8m0Span = 18;

struct Nvfp4EquivalentScales {
  std::vector<uint8_t> w13_scale, w2_scale;     // [E, w13_rows, H/16], [E, H, I/16] e4m3, linear
  std::vector<float> w13_scale_2, w2_scale_2;   // [E]
  // `mx` (the MXFP4 weights these came from) with these scales: w13, w2 and the biases from `mx`, no input scales.
  reference::MoeWeights weights(const reference::MoeWeights& mx) const;
};

// Canonical MXFP4 weights of `problem` (weight_format mxfp4) -> their NVFP4-equivalent scales. Throws
// fp4moe::Error naming the tensor, the expert and both codes when a tensor's codes of one expert span
// more than 18 powers of two ("the GPU kernels take at most 18 powers of two of ue8m0 scales per expert
// and tensor"), or naming the expert, row and block of a NaN code (255).
Nvfp4EquivalentScales nvfp4_equivalent(const MoeProblem& problem, const reference::MoeWeights& weights);

}  // namespace io
}  // namespace fp4moe
