// io/weight_layout.cpp — input weight layouts to the canonical one, MXFP4 weights as their exact NVFP4
// equivalent, and tensor-parallel shards (fp4moe/weight_layout.hpp).
#include "fp4moe/weight_layout.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

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
  check(!options.scales_swizzled || p.weight_format == WeightFormat::NVFP4,
        "scales_swizzled is not built for mxfp4 weights (their ue8m0 scales are taken in the linear layout)");
  const int64_t blk = p.weight_block();  // K elements per scale byte: 16 (NVFP4) or 32 (MXFP4)

  CanonicalExpertWeights c;
  c.w13.assign(w.w13, w.w13 + E * N13 * H / 2);
  c.w13_scale.resize(E * N13 * H / blk);
  c.w2_scale.resize(E * H * I / blk);
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
      swap_halves(c.w13_scale, H / blk);
      swap_halves(c.w13_bias, 1);
    }
  }
  return c;
}

std::pair<int64_t, int64_t> tensor_parallel_range(int64_t inter, int rank, int size, int64_t block) {
  check(size >= 1, "tensor parallelism: tp_size must be >= 1, got ", size);
  check(rank >= 0 && rank < size, "tensor parallelism: tp_rank must be in [0, ", size, "), got ", rank);
  check(block == 16 || block == 32, "tensor parallelism: the scale block must be 16 (NVFP4) or 32 (MXFP4), got ", block);
  const int64_t blocks = inter / block;  // whole scale blocks of w2
  check(inter > 0 && inter % block == 0 && blocks >= size, "tensor parallelism: the intermediate size I = ", inter,
        " must be a multiple of ", block, " with at least tp_size = ", size, " blocks of ", block,
        " (each rank holds whole ", block, "-column scale blocks of w2)");
  const int64_t base = blocks / size, rem = blocks % size;  // the first rem ranks hold one more block
  const int64_t begin = rank * base + std::min<int64_t>(rank, rem);
  return {block * begin, block * (begin + base + (rank < rem ? 1 : 0))};
}

TensorParallelShard tensor_parallel_shard(const MoeProblem& p, const reference::MoeWeights& w, int rank, int size) {
  // NOTE: shapes only, not p.validate(): an expert-parallel rank's problem (local E, routing over the
  // whole layer's experts) is not a valid problem on its own, and is sharded all the same.
  const bool mxfp4 = p.weight_format == WeightFormat::MXFP4;
  const int64_t blk = p.weight_block();  // K elements per scale byte; a rank holds whole blocks of I
  check(p.num_experts >= 1 && p.hidden >= blk && p.hidden % blk == 0, "tensor_parallel_shard: needs E >= 1 and H a ",
        "multiple of ", blk, " (", to_string(p.weight_format), "), got E = ", p.num_experts, ", H = ", p.hidden);
  check(!mxfp4 || p.act_quant == ActQuant::W4A16, "tensor_parallel_shard: mxfp4 weights need act_quant w4a16, got ",
        to_string(p.act_quant));
  const auto [begin, end] = tensor_parallel_range(p.inter, rank, size, blk);
  for (auto [ptr, name] : {std::pair<const void*, const char*>{w.w13, "w13"}, {w.w13_scale, "w13_scale"},
                           {w.w2, "w2"}, {w.w2_scale, "w2_scale"}})
    check(ptr != nullptr, "tensor_parallel_shard: ", name, " is null");
  if (!mxfp4)  // MXFP4 has no global scale
    for (auto [ptr, name] : {std::pair<const void*, const char*>{w.w13_scale_2, "w13_scale_2"},
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
  s.w13_scale.resize(E * rows * (H / blk));
  if (w.w13_bias != nullptr) s.w13_bias.resize(E * rows);
  s.w2.resize(E * H * (part / 2));
  s.w2_scale.resize(E * H * (part / blk));
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t half = 0; half < halves; ++half) {  // gate rows [begin, end), then up rows I + [begin, end)
      const int64_t from = e * N13 + half * I + begin, to = e * rows + half * part;
      std::copy_n(w.w13 + from * (H / 2), part * (H / 2), s.w13.begin() + to * (H / 2));
      std::copy_n(w.w13_scale + from * (H / blk), part * (H / blk), s.w13_scale.begin() + to * (H / blk));
      if (w.w13_bias != nullptr) std::copy_n(w.w13_bias + from, part, s.w13_bias.begin() + to);
    }
    for (int64_t h = 0; h < H; ++h) {  // w2 row h: columns [begin, end) of I
      const int64_t row = e * H + h;
      std::copy_n(w.w2 + row * (I / 2) + begin / 2, part / 2, s.w2.begin() + row * (part / 2));
      std::copy_n(w.w2_scale + row * (I / blk) + begin / blk, part / blk, s.w2_scale.begin() + row * (part / blk));
    }
  }
  auto copy = [E](const float* v) { return v ? std::vector<float>(v, v + E) : std::vector<float>(E, 1.0f); };
  if (!mxfp4) {  // MXFP4: the four stay empty (null in weights())
    s.w13_scale_2 = copy(w.w13_scale_2);
    s.w13_input_scale = copy(w.w13_input_scale);
    s.w2_scale_2 = copy(w.w2_scale_2);
    s.w2_input_scale = copy(w.w2_input_scale);
  }
  s.w13_input_scale_max = w.w13_input_scale_max;
  // NOTE: GEMM2's bias is added once per output: by rank 0, so that the ranks' outputs sum to the layer's.
  if (w.w2_bias != nullptr && rank == 0) s.w2_bias.assign(w.w2_bias, w.w2_bias + E * H);
  return s;
}

reference::MoeWeights TensorParallelShard::weights() const {
  auto ptr = [](const std::vector<float>& v) { return v.empty() ? nullptr : v.data(); };
  reference::MoeWeights v{w13.data(), w13_scale.data(), ptr(w13_scale_2), ptr(w13_input_scale),
                          w2.data(),  w2_scale.data(),  ptr(w2_scale_2),  ptr(w2_input_scale), w13_input_scale_max};
  v.w13_bias = w13_bias.empty() ? nullptr : w13_bias.data();
  v.w2_bias = w2_bias.empty() ? nullptr : w2_bias.data();
  return v;
}

}  // namespace fp4moe::io

// ---- MXFP4 as NVFP4 --------------------------------------------------------------------------------
namespace fp4moe::io {
namespace {

// Largest base code b whose global scale 2^(b - 118) is a finite fp32: 2^127 at b = 245.
constexpr int kMaxBase = 245;

// One tensor [E, rows, K/32] of ue8m0 codes -> e4m3 scales [E, rows, K/16] and scale_2 [E].
void convert_tensor(const uint8_t* codes, int64_t E, int64_t rows, int64_t K, const char* name,
                    std::vector<uint8_t>& e4m3, std::vector<float>& scale_2) {
  const int64_t blocks = K / 32, per_expert = rows * blocks;
  e4m3.resize(static_cast<size_t>(E * rows * (K / 16)));
  scale_2.resize(static_cast<size_t>(E));
  // e4m3 code of 2^(d - 9), d = 0..17 (2^-9 .. 2^8; d <= 2 are e4m3 subnormals).
  uint8_t code_of[kMaxUe8m0Span];
  for (int d = 0; d < kMaxUe8m0Span; ++d) code_of[d] = format::e4m3_from_float(std::ldexp(1.0f, d - 9));
  for (int64_t e = 0; e < E; ++e) {
    const uint8_t* ce = codes + e * per_expert;
    int lo = 255, hi = 0;
    for (int64_t i = 0; i < per_expert; ++i) {
      const int c = ce[i];
      if (c == format::kUe8m0Nan)
        throw Error(detail::concat("nvfp4_equivalent: ", name, ": ue8m0 block scale code 255 (NaN) at expert ", e,
                                   ", row ", i / blocks, ", block ", i % blocks));
      lo = std::min(lo, c);
      hi = std::max(hi, c);
    }
    if (per_expert == 0) lo = hi = 127;
    // NOTE: the base is the smallest code, lowered where 2^(code - 118) would overflow fp32 (codes above
    // 245): a span of 18 is then still inside 245..254 + 9 and every value keeps its bits.
    const int base = std::min(lo, kMaxBase);
    if (hi - base >= kMaxUe8m0Span)
      throw Error(detail::concat("nvfp4_equivalent: ", name, " of expert ", e, " spans ue8m0 codes ", lo, " .. ", hi,
                                 " (", hi - lo + 1, " powers of two): the GPU kernels take at most ", kMaxUe8m0Span,
                                 " powers of two of ue8m0 scales per expert and tensor"));
    const float s2 = std::ldexp(1.0f, base - 118);
    if (!(std::isfinite(s2) && s2 >= std::numeric_limits<float>::min()))
      throw Error(detail::concat("nvfp4_equivalent: ", name, " of expert ", e, ": the global scale 2^", base - 118,
                                 " is not a finite normal fp32"));
    scale_2[e] = s2;
    uint8_t* out = e4m3.data() + e * rows * (K / 16);
    for (int64_t i = 0; i < per_expert; ++i) {
      const uint8_t sc = code_of[ce[i] - base];
      out[2 * i] = sc;  // both 16-blocks of the 32-block
      out[2 * i + 1] = sc;
    }
  }
}

}  // namespace

Nvfp4EquivalentScales nvfp4_equivalent(const MoeProblem& p, const reference::MoeWeights& w) {
  check(p.weight_format == WeightFormat::MXFP4, "nvfp4_equivalent: the problem's weight_format must be mxfp4, got ",
        to_string(p.weight_format));
  check(p.hidden % 32 == 0 && p.inter % 32 == 0 && p.num_experts >= 1,
        "nvfp4_equivalent: needs E >= 1 and H, I multiples of 32, got E = ", p.num_experts, ", H = ", p.hidden,
        ", I = ", p.inter);
  check(w.w13_scale != nullptr, "nvfp4_equivalent: w13_scale is null");
  check(w.w2_scale != nullptr, "nvfp4_equivalent: w2_scale is null");
  Nvfp4EquivalentScales s;
  convert_tensor(w.w13_scale, p.num_experts, p.w13_rows(), p.hidden, "w13_scale", s.w13_scale, s.w13_scale_2);
  convert_tensor(w.w2_scale, p.num_experts, p.hidden, p.inter, "w2_scale", s.w2_scale, s.w2_scale_2);
  return s;
}

reference::MoeWeights Nvfp4EquivalentScales::weights(const reference::MoeWeights& mx) const {
  reference::MoeWeights v = mx;
  v.w13_scale = w13_scale.data();
  v.w2_scale = w2_scale.data();
  v.w13_scale_2 = w13_scale_2.data();
  v.w2_scale_2 = w2_scale_2.data();
  v.w13_input_scale = v.w2_input_scale = nullptr;
  v.w13_input_scale_max = 0.0f;
  return v;
}

}  // namespace fp4moe::io
