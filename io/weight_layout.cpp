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
  if (w.w13_bias != nullptr) c.w13_bias.assign(w.w13_bias, w.w13_bias + E * N13);
  if (options.w13_up_gate) {
    for (int64_t e = 0; e < E; ++e) {  // swap the two halves of each expert's rows
      auto swap_halves = [&](auto& v, int64_t row_elems) {
        if (v.empty()) return;
        auto first = v.begin() + e * N13 * row_elems;
        std::swap_ranges(first, first + I * row_elems, first + I * row_elems);
      };
      swap_halves(c.w13, H / 2);
      swap_halves(c.w13_scale, H / 16);
      swap_halves(c.w13_bias, 1);
    }
  }
  return c;
}

std::pair<int64_t, int64_t> tensor_parallel_range(int64_t inter, int rank, int size) {
  check(size >= 1, "tensor parallelism: tp_size must be >= 1, got ", size);
  check(rank >= 0 && rank < size, "tensor parallelism: tp_rank must be in [0, ", size, "), got ", rank);
  const int64_t blocks = inter / 16;  // whole 16-column scale blocks of w2
  check(inter > 0 && inter % 16 == 0 && blocks >= size, "tensor parallelism: the intermediate size I = ", inter,
        " must be a multiple of 16 with at least tp_size = ", size, " blocks of 16 (each rank holds whole 16-column ",
        "scale blocks of w2)");
  const int64_t base = blocks / size, rem = blocks % size;  // the first rem ranks hold one more block
  const int64_t begin = rank * base + std::min<int64_t>(rank, rem);
  return {16 * begin, 16 * (begin + base + (rank < rem ? 1 : 0))};
}

TensorParallelShard tensor_parallel_shard(const MoeProblem& p, const reference::MoeWeights& w, int rank, int size) {
  // NOTE: shapes only, not p.validate(): an expert-parallel rank's problem (local E, routing over the
  // whole layer's experts) is not a valid problem on its own, and is sharded all the same.
  check(p.num_experts >= 1 && p.hidden >= 16 && p.hidden % 16 == 0, "tensor_parallel_shard: needs E >= 1 and H a ",
        "multiple of 16, got E = ", p.num_experts, ", H = ", p.hidden);
  const auto [begin, end] = tensor_parallel_range(p.inter, rank, size);
  for (auto [ptr, name] : {std::pair<const void*, const char*>{w.w13, "w13"}, {w.w13_scale, "w13_scale"},
                           {w.w2, "w2"}, {w.w2_scale, "w2_scale"}, {w.w13_scale_2, "w13_scale_2"},
                           {w.w2_scale_2, "w2_scale_2"}})
    check(ptr != nullptr, "tensor_parallel_shard: ", name, " is null");
  if (p.act_quant != ActQuant::W4A16)
    for (auto [ptr, name] : {std::pair<const float*, const char*>{w.w13_input_scale, "w13_input_scale"},
                             {w.w2_input_scale, "w2_input_scale"}})
      check(ptr != nullptr, "tensor_parallel_shard: ", name, " is null (act_quant ", to_string(p.act_quant), " needs it)");
  const int64_t E = p.num_experts, H = p.hidden, I = p.inter, N13 = p.w13_rows(), part = end - begin;
  TensorParallelShard s;
  s.problem = p;
  s.problem.inter = part;
  s.inter_begin = begin;
  s.inter_end = end;
  const int64_t halves = p.gated() ? 2 : 1, rows = halves * part;
  s.w13.resize(E * rows * (H / 2));
  s.w13_scale.resize(E * rows * (H / 16));
  if (w.w13_bias != nullptr) s.w13_bias.resize(E * rows);
  s.w2.resize(E * H * (part / 2));
  s.w2_scale.resize(E * H * (part / 16));
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t half = 0; half < halves; ++half) {  // gate rows [begin, end), then up rows I + [begin, end)
      const int64_t from = e * N13 + half * I + begin, to = e * rows + half * part;
      std::copy_n(w.w13 + from * (H / 2), part * (H / 2), s.w13.begin() + to * (H / 2));
      std::copy_n(w.w13_scale + from * (H / 16), part * (H / 16), s.w13_scale.begin() + to * (H / 16));
      if (w.w13_bias != nullptr) std::copy_n(w.w13_bias + from, part, s.w13_bias.begin() + to);
    }
    for (int64_t h = 0; h < H; ++h) {  // w2 row h: columns [begin, end) of I
      const int64_t row = e * H + h;
      std::copy_n(w.w2 + row * (I / 2) + begin / 2, part / 2, s.w2.begin() + row * (part / 2));
      std::copy_n(w.w2_scale + row * (I / 16) + begin / 16, part / 16, s.w2_scale.begin() + row * (part / 16));
    }
  }
  auto copy = [E](const float* v) { return v ? std::vector<float>(v, v + E) : std::vector<float>(E, 1.0f); };
  s.w13_scale_2 = copy(w.w13_scale_2);
  s.w13_input_scale = copy(w.w13_input_scale);
  s.w2_scale_2 = copy(w.w2_scale_2);
  s.w2_input_scale = copy(w.w2_input_scale);
  s.w13_input_scale_max = w.w13_input_scale_max;
  // NOTE: GEMM2's bias is added once per output: by rank 0, so that the ranks' outputs sum to the layer's.
  if (w.w2_bias != nullptr && rank == 0) s.w2_bias.assign(w.w2_bias, w.w2_bias + E * H);
  return s;
}

reference::MoeWeights TensorParallelShard::weights() const {
  reference::MoeWeights v{w13.data(), w13_scale.data(), w13_scale_2.data(), w13_input_scale.data(),
                          w2.data(),  w2_scale.data(),  w2_scale_2.data(),  w2_input_scale.data(), w13_input_scale_max};
  v.w13_bias = w13_bias.empty() ? nullptr : w13_bias.data();
  v.w2_bias = w2_bias.empty() ? nullptr : w2_bias.data();
  return v;
}

}  // namespace fp4moe::io
