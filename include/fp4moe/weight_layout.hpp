// fp4moe/weight_layout.hpp — the expert weights' input layouts, brought to the canonical one of
// DESIGN.md §3 (linear block scales, w13 rows [gate; up]) once at weight preparation. The GPU runner
// (MoeRunner::prepare_weights) and the Python layer's CPU backend both start from it.
#pragma once

#include <cstdint>
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
  std::vector<uint8_t> w13_scale;  // [E, w13_rows, H/16] e4m3, linear
  std::vector<uint8_t> w2_scale;   // [E, H, I/16]        e4m3, linear
};

// Copies w13, w13_scale and w2_scale of `weights` (sized by `problem`) into the canonical layout:
// swizzled scales are unswizzled (format::scales_swizzled_to_linear), [up; gate] halves swapped per
// expert. Throws fp4moe::Error when a tensor is null or w13_up_gate is asked of an ungated activation
// (the messages name the tensor or option; callers prefix their own name).
CanonicalExpertWeights canonical_expert_weights(const MoeProblem& problem, const reference::MoeWeights& weights,
                                                const WeightPrepOptions& options);

}  // namespace io
}  // namespace fp4moe
