// tests/reference/mxfp4_test.cpp — the reference layer on MXFP4 weights (docs/numerics.md, "MXFP4 weights"):
// each stage against a plain computation from weights dequantized here as q * 2^(c - 127) in double
// (GEMMs summed in double: equal up to the reference's one fp32 rounding), with biases and every
// activation; ue8m0 NaN codes refused naming the tensor, expert, row and block; no global scales read.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "error_message.hpp"
#include "fp4moe/case_file.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/presets.hpp"
#include "fp4moe/reference.hpp"

namespace fp4moe {
namespace {

constexpr double kE2m1[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};

// Expert matrices [E, N, K] as doubles, decoded without format/.
std::vector<double> dequantize(const std::vector<uint8_t>& packed, const std::vector<uint8_t>& codes, int64_t E,
                               int64_t N, int64_t K) {
  std::vector<double> w(E * N * K);
  for (int64_t i = 0; i < E * N * K; ++i) {
    const int nib = (packed[i / 2] >> (4 * (i % 2))) & 0xF;
    const double q = (nib & 8) ? -kE2m1[nib & 7] : kE2m1[nib & 7];
    w[i] = q * std::ldexp(1.0, int(codes[i / 32]) - 127);
  }
  return w;
}

MoeProblem mx_problem(Activation act) {
  MoeProblem p;
  p.num_experts = 6;
  p.hidden = 160;  // 5 blocks of 32
  p.inter = 96;
  p.routing.method = RoutingMethod::Renormalize;
  p.routing.top_k = 2;
  p.activation.kind = act;
  p.weight_format = WeightFormat::MXFP4;
  return p;
}

class ReferenceMxfp4 : public ::testing::TestWithParam<Activation> {};

TEST_P(ReferenceMxfp4, EveryStageMatchesDequantizeThenFp64) {
  const MoeProblem p = mx_problem(GetParam());
  const int64_t T = 13, k = p.top_k(), E = p.num_experts, H = p.hidden, I = p.inter, N13 = p.w13_rows();
  for (bool biases : {false, true}) {
    io::MoeCase c = io::make_random_packed_case(p, T, 41);
    ASSERT_EQ(c.w13_scale.size(), size_t(E * N13 * H / 32));
    ASSERT_TRUE(c.w13_scale_2.empty() && c.w2_scale_2.empty() && c.w13_input_scale.empty());
    if (biases) io::add_random_expert_biases(c, 42);
    reference::MoeTrace tr;
    const reference::MoeResult r =
        reference::moe_forward(p, T, c.hidden_states.data(), c.router(), c.weights(), &tr);
    const reference::Routing want_routing = reference::route(p.routing, T, E, c.router_logits.data(), nullptr);
    ASSERT_EQ(r.topk_ids, want_routing.ids);
    const std::vector<double> w13 = dequantize(c.w13, c.w13_scale, E, N13, H);
    const std::vector<double> w2 = dequantize(c.w2, c.w2_scale, E, H, I);
    // One GEMM output: the double sum (exact products), the bias added; the reference rounds the sum to
    // fp32 once and adds the bias in fp32, so the two agree to fp32 rounding of the magnitudes involved.
    auto expect_gemm = [&](const float* a, const double* w, int64_t K, double bias, float got, const std::string& where) {
      double sum = 0, mag = 0;
      for (int64_t i = 0; i < K; ++i) {
        sum += double(a[i]) * w[i];
        mag += std::fabs(double(a[i]) * w[i]);
      }
      const double want = sum + bias;
      ASSERT_LE(std::fabs(double(got) - want), 1.25e-7 * (mag + std::fabs(bias)) + 1e-300) << where;
    };
    for (int64_t entry = 0; entry < T * k; ++entry) {
      const int64_t t = entry / k, e = r.topk_ids[entry];
      for (int64_t i = 0; i < H; ++i)
        ASSERT_EQ(tr.gemm1_input[entry * H + i], format::bf16_to_float(c.hidden_states[t * H + i]));
      for (int64_t n = 0; n < N13; ++n)
        expect_gemm(&tr.gemm1_input[entry * H], &w13[(e * N13 + n) * H], H, biases ? c.w13_bias[e * N13 + n] : 0.0,
                    tr.gemm1_out[entry * N13 + n], "gemm1 entry " + std::to_string(entry) + " row " + std::to_string(n));
      for (int64_t i = 0; i < I; ++i) {  // w4a16: bf16 of the fp32 activation of the reference's own h
        const float g = tr.gemm1_out[entry * N13 + i], u = p.gated() ? tr.gemm1_out[entry * N13 + I + i] : 0.0f;
        const float want = format::bf16_to_float(format::bf16_from_float(reference::apply_activation(p.activation, g, u)));
        ASSERT_EQ(tr.act_out[entry * I + i], want) << "entry " << entry << " column " << i;
      }
      for (int64_t h = 0; h < H; ++h)
        expect_gemm(&tr.act_out[entry * I], &w2[(e * H + h) * I], I, biases ? c.w2_bias[e * H + h] : 0.0,
                    tr.gemm2_out[entry * H + h], "gemm2 entry " + std::to_string(entry) + " column " + std::to_string(h));
    }
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) {
        float acc = 0.0f;
        for (int64_t j = 0; j < k; ++j) acc = acc + r.topk_weights[t * k + j] * tr.gemm2_out[(t * k + j) * H + h];
        ASSERT_EQ(r.output_f32[t * H + h], acc);
        ASSERT_EQ(r.output[t * H + h], format::bf16_from_float(acc));
      }
  }
}

INSTANTIATE_TEST_SUITE_P(Activations, ReferenceMxfp4,
                         ::testing::Values(Activation::SwiGLUOai, Activation::SwiGLU, Activation::GeGLU,
                                           Activation::Relu2),
                         [](const auto& info) { return std::string(to_string(info.param)); });

TEST(ReferenceMxfp4Errors, NanScaleCodeIsRefusedNamingTensorExpertRowBlock) {
  const MoeProblem p = mx_problem(Activation::SwiGLUOai);
  const int64_t H = p.hidden, I = p.inter, N13 = p.w13_rows();
  io::MoeCase c = io::make_random_packed_case(p, 5, 3);
  auto run = [&] { reference::moe_forward(p, c.num_tokens, c.hidden_states.data(), c.router(), c.weights()); };
  run();  // the case itself is fine
  c.w13_scale[(4 * N13 + 7) * (H / 32) + 3] = 255;  // expert 4, row 7, block 3
  expect_error(run, "weights.w13_scale: ue8m0 block scale code 255 (NaN) at expert 4, row 7, block 3");
  c.w13_scale[(4 * N13 + 7) * (H / 32) + 3] = 120;
  c.w2_scale[(1 * H + 150) * (I / 32) + 2] = 255;  // expert 1, row 150, block 2
  expect_error(run, "weights.w2_scale: ue8m0 block scale code 255 (NaN) at expert 1, row 150, block 2");
}

TEST(ReferenceMxfp4Errors, OnlyW4a16AndBlocksOf32) {
  MoeProblem p = mx_problem(Activation::SwiGLU);
  p.act_quant = ActQuant::W4A4Scalar;
  expect_error([&] { p.validate(); }, "act_quant must be w4a16 with mxfp4 weights");
  p.act_quant = ActQuant::W4A16;
  p.inter = 80;
  expect_error([&] { p.validate(); }, "multiple of 32 with mxfp4 weights");
}

// The global scales of the weights struct are not read for MXFP4: arbitrary values change nothing.
TEST(ReferenceMxfp4Errors, GlobalScalesAreNotRead) {
  const MoeProblem p = mx_problem(Activation::SwiGLUOai);
  io::MoeCase c = io::make_random_packed_case(p, 7, 9);
  const reference::MoeResult plain = reference::moe_forward(p, 7, c.hidden_states.data(), c.router(), c.weights());
  const std::vector<float> junk(p.num_experts, -3.0f);
  reference::MoeWeights w = c.weights();
  w.w13_scale_2 = w.w2_scale_2 = junk.data();
  const reference::MoeResult again = reference::moe_forward(p, 7, c.hidden_states.data(), c.router(), w);
  EXPECT_EQ(again.output, plain.output);
}

}  // namespace
}  // namespace fp4moe
