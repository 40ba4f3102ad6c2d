// io/weight_layout.cpp — input weight layouts to the canonical one (fp4moe/weight_layout.hpp).
#include "fp4moe/weight_layout.hpp"

#include <algorithm>

#include "fp4moe/error.hpp"
#include "fp4moe/format.hpp"

namespace fp4moe::io {

CanonicalExpertWeights canonical_expert_weights(const MoeProblem& p, const reference::MoeWeights& w,
                                                const WeightPrepOptions& options) {
  const int64_t E = p.num_experts, H = p.hidden, I = p.inter, N13 = p.w13_rows();
  for (auto [ptr, name] : {std::pair<const void*, const char*>{w.w13, "w13"}, {w.w13_scale, "w13_scale"},
                           {w.w2_scale, "w2_scale"}})
    check(ptr != nullptr, name, " is null");
  check(!options.w13_up_gate || p.gated(), "w13_up_gate needs a gated activation (relu2 has no gate/up halves)");

  CanonicalExpertWeights c;
  c.w13.assign(w.w13, w.w13 + E * N13 * H / 2);
  c.w13_scale.resize(E * N13 * H / 16);
  c.w2_scale.resize(E * H * I / 16);
  if (options.scales_swizzled) {
    format::scales_swizzled_to_linear(w.w13_scale, E, N13, H / 16, c.w13_scale.data());
    format::scales_swizzled_to_linear(w.w2_scale, E, H, I / 16, c.w2_scale.data());
  } else {
    std::copy_n(w.w13_scale, c.w13_scale.size(), c.w13_scale.begin());
    std::copy_n(w.w2_scale, c.w2_scale.size(), c.w2_scale.begin());
  }
  if (options.w13_up_gate) {
    for (int64_t e = 0; e < E; ++e) {  // swap the two halves of each expert's rows
      auto swap_halves = [&](std::vector<uint8_t>& v, int64_t row_bytes) {
        auto first = v.begin() + e * N13 * row_bytes;
        std::swap_ranges(first, first + I * row_bytes, first + I * row_bytes);
      };
      swap_halves(c.w13, H / 2);
      swap_halves(c.w13_scale, H / 16);
    }
  }
  return c;
}

}  // namespace fp4moe::io
