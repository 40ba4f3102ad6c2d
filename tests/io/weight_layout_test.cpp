// tests/io/weight_layout_test.cpp — canonical_expert_weights: swizzled scales and [up; gate] rows come
// back bit for bit in the canonical layout; bad options are errors that say why. Tensor-parallel shards:
// each rank is a plain layer whose outputs sum to the whole layer's.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "error_message.hpp"
#include "fp4moe/case_file.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/presets.hpp"
#include "fp4moe/reference.hpp"
#include "fp4moe/weight_layout.hpp"
#include "layout_fixtures.hpp"

namespace fp4moe {
namespace {

TEST(WeightLayout, CanonicalInputIsCopiedUnchanged) {
  const MoeProblem p = preset("tiny");
  const io::MoeCase c = io::make_random_packed_case(p, 1, 5);
  const io::CanonicalExpertWeights w = io::canonical_expert_weights(p, c.weights(), {});
  EXPECT_EQ(w.w13, c.w13);
  EXPECT_EQ(w.w13_scale, c.w13_scale);
  EXPECT_EQ(w.w2_scale, c.w2_scale);
}

TEST(WeightLayout, SwizzledScalesAndUpGateRowsComeBackCanonical) {
  const MoeProblem p = preset("tiny");
  io::MoeCase c = io::make_random_packed_case(p, 1, 6);
  io::add_random_expert_biases(c, 6);
  const test::SwizzledUpGateWeights other(c);
  ASSERT_NE(other.w13_bias, c.w13_bias);
  const io::CanonicalExpertWeights w =
      io::canonical_expert_weights(p, other.weights(c), {.scales_swizzled = true, .w13_up_gate = true});
  EXPECT_EQ(w.w13, c.w13);
  EXPECT_EQ(w.w13_scale, c.w13_scale);
  EXPECT_EQ(w.w2_scale, c.w2_scale);
  EXPECT_EQ(w.w13_bias, c.w13_bias);  // the bias's [up; gate] halves swapped back too
}

TEST(WeightLayout, ErrorsNameTheTensorOrOption) {
  MoeProblem p = preset("tiny");
  const io::MoeCase c = io::make_random_packed_case(p, 1, 7);
  reference::MoeWeights w = c.weights();
  w.w2_scale = nullptr;
  expect_error([&] { io::canonical_expert_weights(p, w, {}); }, "w2_scale is null");
  p.activation.kind = Activation::Relu2;  // w13 then has I rows: the case's first half serves
  expect_error([&] { io::canonical_expert_weights(p, c.weights(), {.w13_up_gate = true}); },
               "w13_up_gate needs a gated activation");
}

}  // namespace
}  // namespace fp4moe

// ---- tensor parallelism ------------------------------------------------------------------------------
namespace fp4moe {
namespace {

TEST(TensorParallel, RangesSplitTheIntermediateSizeInWholeScaleBlocks) {
  EXPECT_EQ(io::tensor_parallel_range(2048, 0, 8), std::make_pair(int64_t(0), int64_t(256)));
  EXPECT_EQ(io::tensor_parallel_range(2048, 7, 8), std::make_pair(int64_t(1792), int64_t(2048)));
  EXPECT_EQ(io::tensor_parallel_range(96, 0, 1), std::make_pair(int64_t(0), int64_t(96)));
  // gpt-oss-120b: 180 blocks over 8 ranks, the first 4 hold 23.
  EXPECT_EQ(io::tensor_parallel_range(2880, 0, 8), std::make_pair(int64_t(0), int64_t(368)));
  EXPECT_EQ(io::tensor_parallel_range(2880, 3, 8), std::make_pair(int64_t(1104), int64_t(1472)));
  EXPECT_EQ(io::tensor_parallel_range(2880, 4, 8), std::make_pair(int64_t(1472), int64_t(1824)));
  EXPECT_EQ(io::tensor_parallel_range(2880, 7, 8), std::make_pair(int64_t(2528), int64_t(2880)));
  expect_error([] { io::tensor_parallel_range(32, 0, 3); }, "I = 32 must be a multiple of 16 with at least tp_size = 3 blocks");
  expect_error([] { io::tensor_parallel_range(40, 0, 2); }, "I = 40 must be a multiple of 16");
  expect_error([] { io::tensor_parallel_range(2048, 2, 2); }, "tp_rank must be in [0, 2), got 2");
  expect_error([] { io::tensor_parallel_range(2048, 0, 0); }, "tp_size must be >= 1, got 0");
}

struct TpCase {
  ActQuant mode;
  Activation activation;
  int size;
  WeightFormat format = WeightFormat::NVFP4;
};

class TensorParallelLayer : public ::testing::TestWithParam<TpCase> {};

// Each rank's layer is a plain MoE layer with its share of I: its GEMM2 input is the whole layer's restricted
// to its columns, bit for bit; its y sums to the whole y up to fp32 order; its bf16 outputs sum to the
// whole output up to the rounding of each partial.
TEST_P(TensorParallelLayer, RanksSumToTheWholeLayer) {
  const TpCase tc = GetParam();
  MoeProblem p = preset("tiny", tc.mode);
  p.activation.kind = tc.activation;
  p.weight_format = tc.format;
  const int64_t T = 19, H = p.hidden, I = p.inter, k = p.top_k();
  const io::MoeCase c = io::make_random_packed_case(p, T, 40 + tc.size);
  reference::MoeTrace whole;
  const reference::MoeResult full = reference::moe_forward(p, T, c.hidden_states.data(), c.router(), c.weights(), &whole);
  std::vector<double> y_sum(T * k * H, 0.0), out_sum(T * H, 0.0), y_abs(T * k * H, 0.0);
  std::vector<float> out_f32_sum(T * H, 0.0f);  // fp32, in rank order: what an fp32 all-reduce adds
  for (int r = 0; r < tc.size; ++r) {
    const io::TensorParallelShard s = io::tensor_parallel_shard(p, c.weights(), r, tc.size);
    const int64_t part = s.inter_end - s.inter_begin;
    ASSERT_EQ(s.problem.inter, part);
    reference::MoeTrace trace;
    const reference::MoeResult out =
        reference::moe_forward(s.problem, T, c.hidden_states.data(), c.router(), s.weights(), &trace);
    EXPECT_EQ(out.topk_ids, full.topk_ids);
    for (int64_t row = 0; row < T * k; ++row)
      for (int64_t i = 0; i < part; ++i)
        ASSERT_EQ(trace.act_out[row * part + i], whole.act_out[row * I + s.inter_begin + i])
            << "rank " << r << " row " << row << " column " << i;
    for (size_t i = 0; i < y_sum.size(); ++i) {
      y_sum[i] += trace.gemm2_out[i];
      y_abs[i] += std::fabs(trace.gemm2_out[i]);
    }
    for (size_t i = 0; i < out_sum.size(); ++i) {
      out_sum[i] += format::bf16_to_float(out.output[i]);
      out_f32_sum[i] += out.output_f32[i];
      ASSERT_EQ(out.output[i], format::bf16_from_float(out.output_f32[i])) << "rank " << r << " element " << i;
    }
  }
  for (size_t i = 0; i < y_sum.size(); ++i)
    ASSERT_NEAR(y_sum[i], whole.gemm2_out[i], 1e-6 * y_abs[i] + 1e-30) << "y element " << i;
  // fp32 partials: the bound is what was added, sum_j |w_j| * sum_ranks |y_j|.
  std::vector<double> bound(T * H, 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j)
      for (int64_t h = 0; h < H; ++h)
        bound[t * H + h] += std::fabs(full.topk_weights[t * k + j]) * y_abs[(t * k + j) * H + h];
  test::expect_partials_sum_to_the_layer(out_f32_sum, full, bound, 2e-6);  // y itself sums in another order
  double num = 0, den = 0;
  for (size_t i = 0; i < out_sum.size(); ++i) {
    const double want = format::bf16_to_float(full.output[i]);
    num += (out_sum[i] - want) * (out_sum[i] - want);
    den += want * want;
  }
  EXPECT_LT(std::sqrt(num / den), 5e-3);  // each rank's partial output is rounded to bf16 once
}

INSTANTIATE_TEST_SUITE_P(Modes, TensorParallelLayer,
                         ::testing::Values(TpCase{ActQuant::W4A16, Activation::SwiGLU, 2},
                                           TpCase{ActQuant::W4A4Scalar, Activation::SwiGLU, 4},
                                           TpCase{ActQuant::W4A4Scalar, Activation::SwiGLU, 3},  // 48, 48, 32
                                           TpCase{ActQuant::W4A4PerExpert, Activation::SwiGLUOai, 2},
                                           TpCase{ActQuant::W4A4Scalar, Activation::Relu2, 8},
                                           TpCase{ActQuant::W4A16, Activation::GeGLU, 1},
                                           // MXFP4: tiny's I = 128 is 4 blocks of 32 (3 ranks: 64, 32, 32)
                                           TpCase{ActQuant::W4A16, Activation::SwiGLUOai, 2, WeightFormat::MXFP4},
                                           TpCase{ActQuant::W4A16, Activation::Relu2, 3, WeightFormat::MXFP4},
                                           TpCase{ActQuant::W4A16, Activation::SwiGLU, 4, WeightFormat::MXFP4}));

TEST(TensorParallel, ShardErrorsNameTheTensor) {
  const MoeProblem p = preset("tiny", ActQuant::W4A4Scalar);
  const io::MoeCase c = io::make_random_packed_case(p, 1, 3);
  reference::MoeWeights w = c.weights();
  w.w2_input_scale = nullptr;
  expect_error([&] { io::tensor_parallel_shard(p, w, 0, 2); }, "w2_input_scale is null (act_quant w4a4_scalar needs it)");
  expect_error([&] { io::tensor_parallel_shard(p, c.weights(), 0, 9); }, "with at least tp_size = 9 blocks of 16");
}

TEST(TensorParallel, Mxfp4ShardsHoldWhole32ColumnBlocks) {
  EXPECT_EQ(io::tensor_parallel_range(2880, 0, 8, 32), std::make_pair(int64_t(0), int64_t(384)));  // 90 blocks: 12, 12, 11...
  EXPECT_EQ(io::tensor_parallel_range(2880, 7, 8, 32), std::make_pair(int64_t(2528), int64_t(2880)));
  MoeProblem p = preset("tiny");
  p.weight_format = WeightFormat::MXFP4;
  const io::MoeCase c = io::make_random_packed_case(p, 1, 3);
  const io::TensorParallelShard s = io::tensor_parallel_shard(p, c.weights(), 1, 2);
  EXPECT_EQ(s.inter_begin, 64);
  EXPECT_EQ(s.w2_scale.size(), size_t(p.num_experts * p.hidden * 64 / 32));
  EXPECT_EQ(s.w13_scale.size(), size_t(p.num_experts * 2 * 64 * p.hidden / 32));
  EXPECT_TRUE(s.w13_scale_2.empty() && s.w2_scale_2.empty());
  EXPECT_EQ(s.weights().w13_scale_2, nullptr);
  expect_error([&] { io::tensor_parallel_shard(p, c.weights(), 0, 5); }, "with at least tp_size = 5 blocks of 32");
  expect_error([] { io::tensor_parallel_range(2880, 0, 8, 8); }, "scale block must be 16 (NVFP4) or 32 (MXFP4)");
}

// ---- MXFP4 as NVFP4 --------------------------------------------------------------------------------

// An MXFP4 problem with E experts whose codes of expert e lie in [lo[e], lo[e] + span[e]) (every code
// of that range present in each tensor), random e2m1 codes.
io::MoeCase mx_case_with_codes(const std::vector<int>& lo, const std::vector<int>& span, uint64_t seed) {
  MoeProblem p;
  p.num_experts = static_cast<int64_t>(lo.size());
  p.hidden = 640;  // 20 blocks of 32
  p.inter = 576;   // 18 blocks of 32
  p.routing.top_k = 2;
  p.activation.kind = Activation::SwiGLUOai;
  p.weight_format = WeightFormat::MXFP4;
  io::MoeCase c = io::make_random_packed_case(p, 4, seed);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  for (auto* s : {&c.w13_scale, &c.w2_scale}) {
    const int64_t per_expert = static_cast<int64_t>(s->size()) / p.num_experts;
    for (int64_t e = 0; e < p.num_experts; ++e)
      for (int64_t i = 0; i < per_expert; ++i)  // the first span[e] blocks take every code once
        (*s)[e * per_expert + i] = static_cast<uint8_t>(lo[e] + (i < span[e] ? i : int64_t(rng() % span[e])));
  }
  return c;
}

TEST(Nvfp4Equivalent, DequantizedWeightsEqualTheMxfp4OnesBitForBit) {
  // Spans of 1, 7 and exactly 18 powers of two, from code 0 up to code 254 (bases above 245 lowered).
  const std::vector<int> lo = {0, 118, 100, 237, 250, 127, 246};
  const std::vector<int> span = {18, 7, 18, 18, 5, 1, 9};
  const io::MoeCase c = mx_case_with_codes(lo, span, 5);
  const MoeProblem& p = c.problem;
  const io::Nvfp4EquivalentScales nv = io::nvfp4_equivalent(p, c.weights());
  const int64_t E = p.num_experts;
  for (int64_t e = 0; e < E; ++e) {
    const int base = std::min(lo[e], 245);
    EXPECT_EQ(nv.w13_scale_2[e], std::ldexp(1.0f, base - 118)) << "expert " << e;
    EXPECT_EQ(nv.w2_scale_2[e], std::ldexp(1.0f, base - 118)) << "expert " << e;
  }
  struct Tensor {
    const std::vector<uint8_t>& packed;
    const std::vector<uint8_t>& mx_scale;
    const std::vector<uint8_t>& nv_scale;
    const std::vector<float>& scale_2;
    int64_t rows, K;
  };
  for (const Tensor& t : {Tensor{c.w13, c.w13_scale, nv.w13_scale, nv.w13_scale_2, p.w13_rows(), p.hidden},
                          Tensor{c.w2, c.w2_scale, nv.w2_scale, nv.w2_scale_2, p.hidden, p.inter}}) {
    ASSERT_EQ(t.nv_scale.size(), size_t(E * t.rows * t.K / 16));
    std::vector<float> mx(E * t.rows * t.K), q_sf(E * t.rows * t.K);
    format::dequantize_mxfp4(t.packed.data(), t.mx_scale.data(), E * t.rows, t.K, mx.data());
    format::dequantize_nvfp4(t.packed.data(), t.nv_scale.data(), E * t.rows, t.K, q_sf.data());
    for (int64_t i = 0; i < E * t.rows * t.K; ++i) {
      const int64_t e = i / (t.rows * t.K);
      const float v = q_sf[i] * t.scale_2[e];  // what the kernels compute: (q * sf) * alpha
      ASSERT_EQ(std::memcmp(&v, &mx[i], sizeof v), 0)
          << "expert " << e << " element " << i << ": " << v << " vs " << mx[i] << " (code "
          << int(t.mx_scale[i / 32]) << ")";
    }
    // Every scale is an e4m3 value 2^-9 .. 2^8 that the prepack takes (no NaN, no zero).
    for (uint8_t sc : t.nv_scale) {
      const float v = format::e4m3_to_float(sc);
      ASSERT_TRUE(v >= std::ldexp(1.0f, -9) && v <= 256.0f && std::exp2(std::round(std::log2(v))) == v) << int(sc);
    }
  }
}

// The layer on weights of realistic magnitudes (codes 105..126, spans up to 18): the NVFP4-equivalent
// weights give the MXFP4 reference's output bit for bit (each GEMM's sum scales by an exact power of two).
TEST(Nvfp4Equivalent, LayerEqualsTheMxfp4LayerBitForBit) {
  for (bool biases : {false, true}) {
    io::MoeCase c = mx_case_with_codes({105, 118, 109, 120}, {18, 7, 18, 3}, 11);
    if (biases) io::add_random_expert_biases(c, 12);
    const MoeProblem& p = c.problem;
    const io::Nvfp4EquivalentScales nv = io::nvfp4_equivalent(p, c.weights());
    reference::MoeTrace tm, tn;
    const reference::MoeResult mx =
        reference::moe_forward(p, c.num_tokens, c.hidden_states.data(), c.router(), c.weights(), &tm);
    MoeProblem pn = p;
    pn.weight_format = WeightFormat::NVFP4;
    const reference::MoeResult as_nv =
        reference::moe_forward(pn, c.num_tokens, c.hidden_states.data(), c.router(), nv.weights(c.weights()), &tn);
    EXPECT_EQ(as_nv.topk_ids, mx.topk_ids);
    EXPECT_EQ(tn.gemm1_out, tm.gemm1_out);
    EXPECT_EQ(tn.gemm2_out, tm.gemm2_out);
    EXPECT_EQ(as_nv.output, mx.output);
  }
}

TEST(Nvfp4Equivalent, SpanOf19IsRefusedNamingTensorExpertAndCodes) {
  {
    const io::MoeCase c = mx_case_with_codes({120, 100, 120}, {3, 19, 3}, 6);
    expect_error([&] { io::nvfp4_equivalent(c.problem, c.weights()); },
                 "nvfp4_equivalent: w13_scale of expert 1 spans ue8m0 codes 100 .. 118 (19 powers of two): the GPU "
                 "kernels take at most 18 powers of two of ue8m0 scales per expert and tensor");
  }
  {  // w2 alone too wide
    io::MoeCase c = mx_case_with_codes({120, 120}, {3, 3}, 7);
    const int64_t per_expert = static_cast<int64_t>(c.w2_scale.size()) / 2;
    c.w2_scale[per_expert + 5] = 141;  // expert 1: 120 .. 141
    expect_error([&] { io::nvfp4_equivalent(c.problem, c.weights()); }, "w2_scale of expert 1 spans ue8m0 codes 120 .. 141");
    c.w2_scale[per_expert + 5] = 255;
    expect_error([&] { io::nvfp4_equivalent(c.problem, c.weights()); }, "w2_scale: ue8m0 block scale code 255 (NaN) at expert 1");
  }
  const io::MoeCase ok = mx_case_with_codes({120}, {3}, 8);
  MoeProblem nv = ok.problem;
  nv.weight_format = WeightFormat::NVFP4;
  expect_error([&] { io::nvfp4_equivalent(nv, ok.weights()); }, "weight_format must be mxfp4, got nvfp4");
}

TEST(WeightLayout, Mxfp4CanonicalSwapsUpGateAndRefusesSwizzledScales) {
  MoeProblem p = preset("tiny");
  p.weight_format = WeightFormat::MXFP4;
  const io::MoeCase c = io::make_random_packed_case(p, 1, 9);
  const io::CanonicalExpertWeights same = io::canonical_expert_weights(p, c.weights(), {});
  EXPECT_EQ(same.w13_scale, c.w13_scale);
  EXPECT_EQ(same.w2_scale, c.w2_scale);
  const io::CanonicalExpertWeights swapped = io::canonical_expert_weights(p, c.weights(), {.w13_up_gate = true});
  const int64_t I = p.inter, cols = p.hidden / 32;
  for (int64_t e = 0; e < p.num_experts; ++e)
    for (int64_t r = 0; r < 2 * I; ++r)
      for (int64_t b = 0; b < cols; ++b)
        ASSERT_EQ(swapped.w13_scale[(e * 2 * I + r) * cols + b], c.w13_scale[(e * 2 * I + (r + I) % (2 * I)) * cols + b]);
  expect_error([&] { io::canonical_expert_weights(p, c.weights(), {.scales_swizzled = true}); },
               "scales_swizzled is not built for mxfp4 weights");
}

}  // namespace
}  // namespace fp4moe
