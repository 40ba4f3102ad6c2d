// tests/reference/moe_test.cpp — reference::moe_forward, moe_forward_fp32 and apply_activation.
//
// 1. Each activation on known values (silu(0) = 0, gelu(0) = 0, the swiglu_oai clamps, relu2).
// 2. Layers small enough to compute by hand (E = 2, H = I = 16): weights are permutation matrices of
//    exactly representable FP4 values with power-of-two block scales, so every intermediate value is
//    exact and the expected outputs are written out in the test; w4a16 and both w4a4 modes, the
//    lossy w4a4 quantization of a block whose amax is 4, apply_router_weight_on_input.
// 3. Random layers against a straightforward single-threaded implementation of docs/numerics.md, "The layer, step by step", written
//    here (every mode, activation and a few routing methods), bit for bit.
// 4. Every argument error with its message.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "error_message.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/reference.hpp"

namespace fp4moe::reference {
namespace {

const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

// ---- independent helpers -------------------------------------------------------------------------
uint16_t bf16_bits(float f) {  // round to nearest even (inputs here are finite)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float bf16_value(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
float bf16_round(float f) { return bf16_value(bf16_bits(f)); }

// e2m1 code of a value of {0, 0.5, 1, 1.5, 2, 3, 4, 6} and their negatives.
uint8_t e2m1_code(float v) {
  static const float mags[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (uint8_t c = 0; c < 8; ++c) {
    if (mags[c] == std::fabs(v)) return static_cast<uint8_t>(c | (v < 0 ? 8 : 0));
  }
  ADD_FAILURE() << v << " is not an e2m1 value";
  return 0;
}
// e4m3 code of a power of two 2^p, p in [-6, 8]: exponent field p + 7, mantissa 0.
uint8_t e4m3_pow2(int p) { return static_cast<uint8_t>((p + 7) << 3); }

// An NVFP4 matrix [N, K] built from values q[n][k] (e2m1 values) and one power-of-two block scale
// 2^p for every block: the dequantized values are q * 2^p exactly.
struct Fp4Matrix {
  std::vector<uint8_t> packed, scales;
};
Fp4Matrix make_fp4(const std::vector<float>& q, int64_t N, int64_t K, int p) {
  Fp4Matrix m;
  m.packed.assign(N * K / 2, 0);
  m.scales.assign(N * K / 16, e4m3_pow2(p));
  for (int64_t i = 0; i < N * K; ++i)
    m.packed[i / 2] |= static_cast<uint8_t>(e2m1_code(q[i]) << (4 * (i % 2)));
  return m;
}

// A whole small layer, owned.
struct Layer {
  MoeProblem problem;
  int64_t T = 0;
  std::vector<uint16_t> hidden;
  std::vector<float> logits, bias;
  std::vector<int32_t> ids;
  std::vector<float> topk_weights;
  std::vector<uint8_t> w13, w13_scale, w2, w2_scale;
  std::vector<float> w13_scale_2, w13_input_scale, w2_scale_2, w2_input_scale;

  MoeWeights weights() const {
    return {w13.data(), w13_scale.data(), w13_scale_2.data(), w13_input_scale.data(),
            w2.data(),  w2_scale.data(),  w2_scale_2.data(),  w2_input_scale.data()};
  }
  RouterInput router() const {
    RouterInput r;
    if (problem.routing.method == RoutingMethod::Precomputed) {
      r.topk_ids = ids.data();
      r.topk_weights = topk_weights.data();
    } else {
      r.logits = logits.data();
      r.bias = bias.empty() ? nullptr : bias.data();
    }
    return r;
  }
  MoeResult run(MoeTrace* trace = nullptr) const {
    return moe_forward(problem, T, hidden.data(), router(), weights(), trace);
  }
};

// ---- 1. activations ------------------------------------------------------------------------------
ActivationParams act_of(Activation kind) {
  ActivationParams a;
  a.kind = kind;
  return a;
}

TEST(ReferenceMoeActivation, SwiGLU) {
  const ActivationParams a = act_of(Activation::SwiGLU);
  EXPECT_EQ(apply_activation(a, 0.0f, 5.0f), 0.0f);  // silu(0) = 0
  EXPECT_EQ(apply_activation(a, 1.0f, 2.0f), static_cast<float>(2.0 / (1.0 + std::exp(-1.0))));
  EXPECT_EQ(apply_activation(a, -2.0f, 3.0f),
            static_cast<float>(-2.0 / (1.0 + std::exp(2.0)) * 3.0));
  EXPECT_EQ(apply_activation(a, -200.0f, 1.0f), -0.0f);  // silu -> 0 for very negative gates
  EXPECT_TRUE(std::isnan(apply_activation(a, kNaN, 1.0f)));
}

TEST(ReferenceMoeActivation, GeGLUWithErf) {
  const ActivationParams a = act_of(Activation::GeGLU);
  EXPECT_EQ(apply_activation(a, 0.0f, 7.0f), 0.0f);  // gelu(0) = 0
  EXPECT_EQ(apply_activation(a, 1.0f, 2.0f),
            static_cast<float>(0.5 * (1.0 + std::erf(1.0 / std::sqrt(2.0))) * 2.0));
  // Not the tanh approximation: gelu_erf(-1) = -0.15865525..., tanh form -0.15880801...
  EXPECT_NEAR(apply_activation(a, -1.0f, 1.0f), -0.158655254, 1e-8);
}

TEST(ReferenceMoeActivation, SwiGLUOaiClampsGateAboveAndUpBothWays) {
  const ActivationParams a = act_of(Activation::SwiGLUOai);  // alpha 1.702, beta 1, limit 7
  const double alpha = 1.702f;
  auto expected = [&](double g, double u) {
    return static_cast<float>(g / (1.0 + std::exp(-alpha * g)) * (u + 1.0));
  };
  EXPECT_EQ(apply_activation(a, 0.0f, 3.0f), 0.0f);
  EXPECT_EQ(apply_activation(a, 2.0f, 0.5f), expected(2.0, 0.5));
  EXPECT_EQ(apply_activation(a, 10.0f, 10.0f), expected(7.0, 7.0));    // g' = 7, u' = 7
  EXPECT_EQ(apply_activation(a, 10.0f, -10.0f), expected(7.0, -7.0));  // u' = -7
  EXPECT_EQ(apply_activation(a, -10.0f, 3.0f), expected(-10.0, 3.0));  // the gate is not clamped below
  EXPECT_EQ(apply_activation(a, 7.0f, -7.0f), expected(7.0, -7.0));
  ActivationParams b = a;  // custom alpha / beta / limit
  b.swiglu_alpha = 1.0f;
  b.swiglu_beta = 0.0f;
  b.swiglu_limit = 2.0f;
  EXPECT_EQ(apply_activation(b, 3.0f, 5.0f), static_cast<float>(2.0 / (1.0 + std::exp(-2.0)) * 2.0));
  EXPECT_TRUE(std::isnan(apply_activation(a, kNaN, 1.0f)));
  EXPECT_TRUE(std::isnan(apply_activation(a, 1.0f, kNaN)));
}

TEST(ReferenceMoeActivation, Relu2IgnoresUp) {
  const ActivationParams a = act_of(Activation::Relu2);
  EXPECT_EQ(apply_activation(a, -3.0f, 100.0f), 0.0f);
  EXPECT_EQ(apply_activation(a, 3.0f, 100.0f), 9.0f);
  EXPECT_EQ(apply_activation(a, 0.5f, kNaN), 0.25f);
  EXPECT_EQ(apply_activation(a, 3.0e19f, 0.0f), kInf);  // 9e38 overflows fp32
  EXPECT_TRUE(std::isnan(apply_activation(a, kNaN, 0.0f)));
}

// ---- 2. hand-computed layers ---------------------------------------------------------------------
constexpr int64_t kH = 16, kI = 16;

// Expert 0: w13 = identity, w2 = identity. Expert 1: w13 = 2 * reversal (h_n = 2 x_{15-n}),
// w2 = identity. Block scales 1 (or 2^p13 / 2^p2), global scales as given.
Layer hand_layer(Activation act, ActQuant quant, int64_t T, const std::vector<float>& x,
                 float s13_0, float s13_1, float s2_0, float s2_1) {
  Layer L;
  L.problem.num_experts = 2;
  L.problem.hidden = kH;
  L.problem.inter = kI;
  L.problem.activation.kind = act;
  L.problem.act_quant = quant;
  L.problem.routing.method = RoutingMethod::TopK;
  L.problem.routing.top_k = 2;
  L.T = T;
  for (float v : x) L.hidden.push_back(bf16_bits(v));
  const int64_t N1 = act == Activation::Relu2 ? kI : 2 * kI;
  std::vector<float> q13(2 * N1 * kH, 0.0f), q2(2 * kH * kI, 0.0f);
  for (int64_t n = 0; n < N1; ++n) {
    q13[(0 * N1 + n) * kH + n % kH] = 1.0f;
    q13[(1 * N1 + n) * kH + (kH - 1 - n % kH)] = 2.0f;
  }
  for (int64_t e = 0; e < 2; ++e)
    for (int64_t n = 0; n < kH; ++n) q2[(e * kH + n) * kI + n] = 1.0f;
  Fp4Matrix m13 = make_fp4(q13, 2 * N1, kH, 0), m2 = make_fp4(q2, 2 * kH, kI, 0);
  L.w13 = m13.packed;
  L.w13_scale = m13.scales;
  L.w2 = m2.packed;
  L.w2_scale = m2.scales;
  L.w13_scale_2 = {s13_0, s13_1};
  L.w2_scale_2 = {s2_0, s2_1};
  L.w13_input_scale = {1.0f, 1.0f};
  L.w2_input_scale = {1.0f, 1.0f};
  return L;
}

const std::vector<float> kX0 = {1, -1, 2, 0.5f, 0, 3, -2, 1.5f, 4, -0.5f, 6, 1, 0, 0, 2, -3};
// x for token 1: 2 at 0, 1 at 15.
std::vector<float> x_token1() {
  std::vector<float> x(kH, 0.0f);
  x[0] = 2.0f;
  x[15] = 1.0f;
  return x;
}

TEST(ReferenceMoe, HandComputedRelu2W4A16) {
  std::vector<float> x = kX0;
  const std::vector<float> x1 = x_token1();
  x.insert(x.end(), x1.begin(), x1.end());
  // Expert 0: h = x, y = relu2(x). Expert 1: h_n = 0.5 * 2 x_{15-n} = x_{15-n}, y = 3 relu2(h).
  Layer L = hand_layer(Activation::Relu2, ActQuant::W4A16, 2, x, 1.0f, 0.5f, 1.0f, 3.0f);
  L.logits = {0.5f, 0.5f,     // token 0: tie -> ids {0, 1}, weights 0.5, 0.5
              0.25f, 0.75f};  // token 1: ids {1, 0}, weights 0.75, 0.25
  MoeTrace trace;
  const MoeResult r = L.run(&trace);
  ASSERT_EQ(r.topk_ids, (std::vector<int32_t>{0, 1, 1, 0}));
  ASSERT_EQ(r.topk_weights, (std::vector<float>{0.5f, 0.5f, 0.75f, 0.25f}));
  ASSERT_EQ(r.output.size(), 2u * kH);

  // Token 1, by hand: expert 1 gives y_0 = 3 * 1^2 = 3, y_15 = 3 * 2^2 = 12; expert 0 gives
  // y_0 = 4, y_15 = 1. out_0 = 0.75 * 3 + 0.25 * 4 = 3.25, out_15 = 0.75 * 12 + 0.25 * 1 = 9.25.
  for (int64_t n = 0; n < kH; ++n) {
    const float expected = n == 0 ? 3.25f : (n == 15 ? 9.25f : 0.0f);
    EXPECT_EQ(bf16_value(r.output[kH + n]), expected) << "n " << n;
  }
  // Token 0: 0.5 * relu2(x_n) + 0.5 * 3 * relu2(x_{15-n}), rounded to bf16.
  const float hand0[16] = {0.5f * 1 + 1.5f * 0,   0.5f * 0 + 1.5f * 4,    0.5f * 4 + 1.5f * 0,
                           0.5f * 0.25f + 1.5f * 0, 0.5f * 0 + 1.5f * 1,  0.5f * 9 + 1.5f * 36,
                           0.5f * 0 + 1.5f * 0,   0.5f * 2.25f + 1.5f * 16, 0.5f * 16 + 1.5f * 2.25f,
                           0.5f * 0 + 1.5f * 0,   0.5f * 36 + 1.5f * 9,   0.5f * 1 + 1.5f * 0,
                           0.5f * 0 + 1.5f * 0.25f, 0.5f * 0 + 1.5f * 4,  0.5f * 4 + 1.5f * 0,
                           0.5f * 0 + 1.5f * 1};
  for (int64_t n = 0; n < kH; ++n)
    EXPECT_EQ(bf16_value(r.output[n]), bf16_round(hand0[n])) << "n " << n;

  // The trace, by entry t*k + j: GEMM1 input is x; act_out of entry (0, slot 1) = relu2(x_{15-n}).
  ASSERT_EQ(trace.gemm1_input.size(), 4u * kH);
  ASSERT_EQ(trace.act_out.size(), 4u * kI);
  ASSERT_EQ(trace.gemm2_out.size(), 4u * kH);
  for (int64_t n = 0; n < kH; ++n) {
    EXPECT_EQ(trace.gemm1_input[1 * kH + n], kX0[n]);
    const float h1 = kX0[kH - 1 - n];
    EXPECT_EQ(trace.act_out[1 * kI + n], h1 > 0 ? h1 * h1 : 0.0f);
    EXPECT_EQ(trace.gemm2_out[1 * kH + n], 3.0f * (h1 > 0 ? h1 * h1 : 0.0f));
  }
}

TEST(ReferenceMoe, HandComputedSwiGLUW4A16) {
  // k = 1, renormalize (weight exactly 1). Expert 0: gate rows identity (g_n = 0.25 x_n with
  // w13_scale_2 = 0.25), up rows all 0.5 (u_n = 0.25 * 0.5 * sum x). w2 identity, scale 2.
  Layer L;
  L.problem.num_experts = 2;
  L.problem.hidden = kH;
  L.problem.inter = kI;
  L.problem.routing.method = RoutingMethod::Renormalize;
  L.problem.routing.top_k = 1;
  L.T = 1;
  for (float v : kX0) L.hidden.push_back(bf16_bits(v));
  L.logits = {3.0f, -1.0f};
  std::vector<float> q13(2 * 2 * kI * kH, 0.0f), q2(2 * kH * kI, 0.0f);
  for (int64_t n = 0; n < kI; ++n) {
    q13[n * kH + n] = 1.0f;
    for (int64_t i = 0; i < kH; ++i) q13[(kI + n) * kH + i] = 0.5f;
  }
  for (int64_t n = 0; n < kH; ++n) q2[n * kI + n] = 1.0f;
  Fp4Matrix m13 = make_fp4(q13, 4 * kI, kH, 0), m2 = make_fp4(q2, 2 * kH, kI, 0);
  L.w13 = m13.packed;
  L.w13_scale = m13.scales;
  L.w2 = m2.packed;
  L.w2_scale = m2.scales;
  L.w13_scale_2 = {0.25f, 1.0f};
  L.w2_scale_2 = {2.0f, 1.0f};
  L.w13_input_scale = {1.0f, 1.0f};
  L.w2_input_scale = {1.0f, 1.0f};
  MoeTrace trace;
  const MoeResult r = L.run(&trace);
  ASSERT_EQ(r.topk_ids, (std::vector<int32_t>{0}));
  ASSERT_EQ(r.topk_weights, (std::vector<float>{1.0f}));
  double sum_x = 0;
  for (float v : kX0) sum_x += v;  // 15.5
  const double u = 0.25 * 0.5 * sum_x;
  for (int64_t n = 0; n < kI; ++n) {
    const double g = 0.25 * kX0[n];
    const float act = bf16_round(static_cast<float>(g / (1.0 + std::exp(-g)) * u));
    EXPECT_EQ(trace.act_out[n], act) << n;
    EXPECT_EQ(bf16_value(r.output[n]), bf16_round(2.0f * act)) << n;
  }
  EXPECT_EQ(trace.act_out[4], 0.0f);  // x_4 = 0: silu(0) * u = 0
}

// Values in {0, +-3, +-6}: blocks quantize exactly with scale 1 (amax 6 -> sf = 1), and relu2 gives
// {0, 9, 36}, which re-quantize exactly too (amax 36 -> sf = 6; 9 = 1.5 * 6). So w4a4 = w4a16.
TEST(ReferenceMoe, HandComputedRelu2W4A4Exact) {
  const std::vector<float> x = {6, -3, 3, 0, -6, 6, 3, 3, 0, 0, -3, 6, 3, -6, 0, 3};
  for (ActQuant q : {ActQuant::W4A16, ActQuant::W4A4Scalar, ActQuant::W4A4PerExpert}) {
    Layer L = hand_layer(Activation::Relu2, q, 1, x, 1.0f, 0.5f, 1.0f, 3.0f);
    L.logits = {0.75f, 0.25f};
    MoeTrace trace;
    const MoeResult r = L.run(&trace);
    ASSERT_EQ(r.topk_ids, (std::vector<int32_t>{0, 1}));
    for (int64_t n = 0; n < kH; ++n) {
      const float a = x[n] > 0 ? x[n] * x[n] : 0.0f, b = x[15 - n] > 0 ? x[15 - n] * x[15 - n] : 0.0f;
      // 0.75 * a + 0.25 * 3 * b with a, b in {0, 9, 36}: at most 8 significant bits, exact in bf16.
      EXPECT_EQ(bf16_value(r.output[n]), 0.75f * a + 0.75f * b) << to_string(q) << " n " << n;
      EXPECT_EQ(trace.gemm1_input[n], x[n]) << to_string(q);
    }
  }
}

// A block whose amax is 4 does not quantize exactly: sf = e4m3(4/6) = 0.6875, osc = 1/0.6875, and
// 4 -> 6 * 0.6875 = 4.125, 1 -> 1.5 * 0.6875 = 1.03125, 2 -> 3 * 0.6875 = 2.0625, 3 -> 4 * 0.6875 =
// 2.75, 0.5 -> 0.5 * 0.6875 = 0.34375, -2 -> -2.0625.
TEST(ReferenceMoe, W4A4QuantizesTheGemm1InputLossily) {
  const std::vector<float> x = {4, 1, 2, 3, 0.5f, -2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  const std::vector<float> q = {4.125f, 1.03125f, 2.0625f, 2.75f, 0.34375f, -2.0625f};
  Layer a16 = hand_layer(Activation::Relu2, ActQuant::W4A16, 1, x, 1.0f, 0.5f, 1.0f, 3.0f);
  Layer a4 = hand_layer(Activation::Relu2, ActQuant::W4A4PerExpert, 1, x, 1.0f, 0.5f, 1.0f, 3.0f);
  a16.logits = a4.logits = {0.75f, 0.25f};
  MoeTrace t16, t4;
  const MoeResult r16 = a16.run(&t16), r4 = a4.run(&t4);
  for (int n = 0; n < 6; ++n) {
    EXPECT_EQ(t16.gemm1_input[n], x[n]);
    EXPECT_EQ(t4.gemm1_input[n], q[n]) << n;
    EXPECT_EQ(t4.gemm1_input[kH + n], q[n]) << n;  // slot 1 (expert 1, same input scale)
  }
  // Expert 0, n = 0: w4a16 relu2(4) = 16; w4a4 relu2(4.125) = 17.015625, re-quantized with scale 1
  // in a block of amax 17.015625 (sf = e4m3(2.8359) = 2.75): 17.015625 / 2.75 = 6.19 -> 6 -> 16.5.
  EXPECT_EQ(t16.act_out[0], 16.0f);
  EXPECT_EQ(t4.act_out[0], 16.5f);
  EXPECT_NE(r16.output, r4.output);
}

// Scalar mode quantizes with max_e w13_input_scale (2 here): sf = 0.5 and the GEMM1 input values are
// x / 2 for both experts; per-expert mode uses 1 for expert 0 (x) and 2 for expert 1 (x / 2). alpha1
// compensates exactly, so both give the same output.
TEST(ReferenceMoe, W4A4ScalarUsesTheMaxInputScalePerExpertItsOwn) {
  const std::vector<float> x = {6, -3, 3, 0, -6, 6, 3, 3, 0, 0, -3, 6, 3, -6, 0, 3};
  Layer sc = hand_layer(Activation::Relu2, ActQuant::W4A4Scalar, 1, x, 1.0f, 0.5f, 1.0f, 3.0f);
  Layer pe = hand_layer(Activation::Relu2, ActQuant::W4A4PerExpert, 1, x, 1.0f, 0.5f, 1.0f, 3.0f);
  sc.w13_input_scale = pe.w13_input_scale = {1.0f, 2.0f};
  sc.logits = pe.logits = {0.75f, 0.25f};
  MoeTrace tsc, tpe;
  const MoeResult rsc = sc.run(&tsc), rpe = pe.run(&tpe);
  for (int64_t n = 0; n < kH; ++n) {
    EXPECT_EQ(tsc.gemm1_input[n], x[n] / 2) << n;       // entry (0, 0), expert 0
    EXPECT_EQ(tsc.gemm1_input[kH + n], x[n] / 2) << n;  // entry (0, 1), expert 1
    EXPECT_EQ(tpe.gemm1_input[n], x[n]) << n;
    EXPECT_EQ(tpe.gemm1_input[kH + n], x[n] / 2) << n;
  }
  EXPECT_EQ(rsc.output, rpe.output);
  for (int64_t n = 0; n < kH; ++n) {
    const float a = x[n] > 0 ? x[n] * x[n] : 0.0f, b = x[15 - n] > 0 ? x[15 - n] * x[15 - n] : 0.0f;
    EXPECT_EQ(bf16_value(rsc.output[n]), 0.75f * a + 0.75f * b) << n;
  }
}

// Llama-4 style: k = 1, weight sigmoid(logit); x becomes bf16(x * bf16(w)) and the finalize weight
// is 1; topk_weights still reports w.
TEST(ReferenceMoe, ApplyRouterWeightOnInput) {
  std::vector<float> x(kH, 0.0f);
  x[0] = 2.0f;
  x[1] = 1.0f;
  x[2] = -2.0f;
  x[3] = 2.25f;
  for (bool on_input : {false, true}) {
    Layer L = hand_layer(Activation::Relu2, ActQuant::W4A16, 1, x, 1.0f, 1.0f, 1.0f, 1.0f);
    L.problem.routing.method = RoutingMethod::Llama4;
    L.problem.routing.top_k = 1;
    L.problem.routing.apply_router_weight_on_input = on_input;
    L.logits = {0.0f, -1.0f};  // expert 0, sigmoid(0) = 0.5
    MoeTrace trace;
    const MoeResult r = L.run(&trace);
    ASSERT_EQ(r.topk_ids, (std::vector<int32_t>{0}));
    EXPECT_EQ(r.topk_weights[0], 0.5f);
    if (on_input) {  // relu2(0.5 * 2) = 1, weight 1; relu2(0.5) = 0.25
      EXPECT_EQ(trace.gemm1_input[0], 1.0f);
      EXPECT_EQ(bf16_value(r.output[0]), 1.0f);
      EXPECT_EQ(bf16_value(r.output[1]), 0.25f);
    } else {  // 0.5 * relu2(2) = 2; 0.5 * relu2(1) = 0.5
      EXPECT_EQ(trace.gemm1_input[0], 2.0f);
      EXPECT_EQ(bf16_value(r.output[0]), 2.0f);
      EXPECT_EQ(bf16_value(r.output[1]), 0.5f);
    }
    EXPECT_EQ(bf16_value(r.output[2]), 0.0f);
  }
  // The weight is rounded to bf16 before the multiply: sigmoid(1) = 0.7310586 -> 0.73046875.
  Layer L = hand_layer(Activation::Relu2, ActQuant::W4A16, 1, x, 1.0f, 1.0f, 1.0f, 1.0f);
  L.problem.routing.method = RoutingMethod::Llama4;
  L.problem.routing.top_k = 1;
  L.problem.routing.apply_router_weight_on_input = true;
  L.logits = {1.0f, -1.0f};
  MoeTrace trace;
  const MoeResult r = L.run(&trace);
  EXPECT_EQ(r.topk_weights[0], static_cast<float>(1.0 / (1.0 + std::exp(-1.0))));
  EXPECT_EQ(trace.gemm1_input[0], 1.4609375f);  // bf16(2 * 0.73046875)
  EXPECT_EQ(trace.gemm1_input[1], 0.73046875f);
  EXPECT_EQ(trace.gemm1_input[3], 1.640625f);  // bf16(2.25 * 0.73046875); with the fp32 w: 1.6484375
  // out = bf16(relu2(1.4609375)) with weight 1 (exact square 2.13433837890625 -> bf16 2.140625).
  EXPECT_EQ(bf16_value(r.output[0]), bf16_round(1.4609375f * 1.4609375f));
}

TEST(ReferenceMoe, PrecomputedRoutingUsesTheGivenIdsAndWeights) {
  const std::vector<float> x = {6, -3, 3, 0, -6, 6, 3, 3, 0, 0, -3, 6, 3, -6, 0, 3};
  Layer topk = hand_layer(Activation::Relu2, ActQuant::W4A16, 1, x, 1.0f, 0.5f, 1.0f, 3.0f);
  topk.logits = {0.25f, 0.75f};
  Layer pre = topk;
  pre.problem.routing.method = RoutingMethod::Precomputed;
  pre.ids = {1, 0};
  pre.topk_weights = {0.75f, 0.25f};
  const MoeResult a = topk.run(), b = pre.run();
  EXPECT_EQ(a.topk_ids, b.topk_ids);
  EXPECT_EQ(a.topk_weights, b.topk_weights);
  EXPECT_EQ(a.output, b.output);
  // Both slots on the same expert is allowed.
  pre.ids = {0, 0};
  pre.topk_weights = {0.5f, 0.5f};
  const MoeResult c = pre.run();
  for (int64_t n = 0; n < kH; ++n)
    EXPECT_EQ(bf16_value(c.output[n]), x[n] > 0 ? x[n] * x[n] : 0.0f);
}

TEST(ReferenceMoe, ZeroTokensGiveEmptyResults) {
  Layer L = hand_layer(Activation::SwiGLU, ActQuant::W4A4Scalar, 0, {}, 1.0f, 1.0f, 1.0f, 1.0f);
  MoeTrace trace;
  trace.act_out.assign(5, 1.0f);
  const MoeResult r = moe_forward(L.problem, 0, nullptr, RouterInput{}, L.weights(), &trace);
  EXPECT_TRUE(r.output.empty());
  EXPECT_TRUE(r.topk_ids.empty());
  EXPECT_TRUE(r.topk_weights.empty());
  EXPECT_TRUE(trace.act_out.empty());
  const std::vector<float> w(1, 0.0f);
  EXPECT_TRUE(moe_forward_fp32(L.problem, 0, nullptr, Routing{}, w.data(), w.data()).empty());
}

// A NaN in one token's hidden state poisons that token's output only.
TEST(ReferenceMoe, NonFiniteInputPoisonsOnlyItsToken) {
  std::vector<float> x = kX0;
  x.insert(x.end(), kX0.begin(), kX0.end());
  for (ActQuant q : {ActQuant::W4A16, ActQuant::W4A4Scalar}) {
    Layer L = hand_layer(Activation::SwiGLU, q, 2, x, 1.0f, 1.0f, 1.0f, 1.0f);
    L.hidden[3] = 0x7FC0;  // NaN in token 0
    L.logits = {0.5f, 0.25f, 0.5f, 0.25f};
    const MoeResult r = L.run();
    Layer clean = L;
    clean.hidden[3] = bf16_bits(kX0[3]);
    const MoeResult c = clean.run();
    bool any_nan = false;
    for (int64_t n = 0; n < kH; ++n) any_nan |= std::isnan(bf16_value(r.output[n]));
    EXPECT_TRUE(any_nan);
    for (int64_t n = 0; n < kH; ++n) EXPECT_EQ(r.output[kH + n], c.output[kH + n]) << n;
  }
}

// ---- 3. random layers against a plain implementation ----------------------------------------------
// Straight from docs/numerics.md, "The layer, step by step": one token-slot at a time, sums in order.
std::vector<uint16_t> plain_moe(const Layer& L, const std::vector<int32_t>& ids,
                                const std::vector<float>& w) {
  const MoeProblem& p = L.problem;
  const int64_t E = p.num_experts, H = p.hidden, I = p.inter, k = p.top_k(), N1 = p.w13_rows();
  const bool w4a4 = p.act_quant != ActQuant::W4A16;
  const float a1_max = *std::max_element(L.w13_input_scale.begin(), L.w13_input_scale.end());
  auto qdq = [](std::vector<float> v, float s) {
    std::vector<uint8_t> packed(v.size() / 2), sf(v.size() / 16);
    format::quantize_nvfp4(v.data(), 1, static_cast<int64_t>(v.size()), s, packed.data(), sf.data());
    format::dequantize_nvfp4(packed.data(), sf.data(), 1, static_cast<int64_t>(v.size()), v.data());
    return v;
  };
  auto act_fn = [&](double g, double u) -> double {
    const ActivationParams& a = p.activation;
    switch (a.kind) {
      case Activation::SwiGLU: return g / (1 + std::exp(-g)) * u;
      case Activation::GeGLU: return 0.5 * g * (1 + std::erf(g / std::sqrt(2.0))) * u;
      case Activation::SwiGLUOai: {
        const double L7 = a.swiglu_limit, gg = std::min(g, L7), uu = std::max(-L7, std::min(u, L7));
        return gg / (1 + std::exp(-static_cast<double>(a.swiglu_alpha) * gg)) * (uu + a.swiglu_beta);
      }
      case Activation::Relu2: return std::max(g, 0.0) * std::max(g, 0.0);
    }
    return 0;
  };
  std::vector<float> W13(E * N1 * H), W2(E * H * I);
  format::dequantize_nvfp4(L.w13.data(), L.w13_scale.data(), E * N1, H, W13.data());
  format::dequantize_nvfp4(L.w2.data(), L.w2_scale.data(), E * H, I, W2.data());
  std::vector<uint16_t> out(L.T * H);
  for (int64_t t = 0; t < L.T; ++t) {
    std::vector<float> acc(H, 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = ids[t * k + j];
      std::vector<float> x(H);
      for (int64_t i = 0; i < H; ++i) x[i] = bf16_value(L.hidden[t * H + i]);
      float fw = w[t * k + j];
      if (p.routing.apply_router_weight_on_input) {
        for (auto& v : x) v = bf16_round(v * bf16_round(fw));
        fw = 1.0f;
      }
      float alpha1 = L.w13_scale_2[e];
      if (p.act_quant == ActQuant::W4A4Scalar) {
        x = qdq(x, a1_max);
        alpha1 = L.w13_scale_2[e] * a1_max;
      } else if (p.act_quant == ActQuant::W4A4PerExpert) {
        x = qdq(x, L.w13_input_scale[e]);
        alpha1 = L.w13_scale_2[e] * L.w13_input_scale[e];
      }
      std::vector<float> h(N1);
      for (int64_t n = 0; n < N1; ++n) {
        double s = 0;
        for (int64_t i = 0; i < H; ++i) s += static_cast<double>(x[i]) * W13[(e * N1 + n) * H + i];
        h[n] = alpha1 * static_cast<float>(s);
      }
      std::vector<float> act(I);
      for (int64_t i = 0; i < I; ++i)
        act[i] = static_cast<float>(act_fn(h[i], p.gated() ? h[I + i] : 0.0));
      float alpha2 = L.w2_scale_2[e];
      if (w4a4) {
        act = qdq(act, L.w2_input_scale[e]);
        alpha2 = L.w2_scale_2[e] * L.w2_input_scale[e];
      } else {
        for (auto& v : act) v = bf16_round(v);
      }
      for (int64_t n = 0; n < H; ++n) {
        double s = 0;
        for (int64_t i = 0; i < I; ++i) s += static_cast<double>(act[i]) * W2[(e * H + n) * I + i];
        const float y = alpha2 * static_cast<float>(s);
        const float prod = fw * y;
        acc[n] = acc[n] + prod;
      }
    }
    for (int64_t n = 0; n < H; ++n) out[t * H + n] = bf16_bits(acc[n]);
  }
  return out;
}

Layer random_layer(uint64_t seed, int64_t E, int64_t H, int64_t I, int k, int64_t T, Activation act,
                   ActQuant q, RoutingMethod method) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd;
  Layer L;
  L.problem.num_experts = E;
  L.problem.hidden = H;
  L.problem.inter = I;
  L.problem.routing.method = method;
  L.problem.routing.top_k = k;
  L.problem.activation.kind = act;
  L.problem.act_quant = q;
  L.T = T;
  const int64_t N1 = L.problem.w13_rows();
  for (int64_t i = 0; i < T * H; ++i) L.hidden.push_back(bf16_bits(nd(rng)));
  for (int64_t i = 0; i < T * E; ++i) L.logits.push_back(nd(rng));
  // Weights: random normal rows quantized with format/ (realistic block scales).
  std::vector<float> w13(E * N1 * H), w2(E * H * I);
  for (auto& v : w13) v = 0.05f * nd(rng);
  for (auto& v : w2) v = 0.05f * nd(rng);
  L.w13.resize(w13.size() / 2);
  L.w13_scale.resize(w13.size() / 16);
  L.w2.resize(w2.size() / 2);
  L.w2_scale.resize(w2.size() / 16);
  format::quantize_nvfp4(w13.data(), E * N1, H, 0.0005f, L.w13.data(), L.w13_scale.data());
  format::quantize_nvfp4(w2.data(), E * H, I, 0.0005f, L.w2.data(), L.w2_scale.data());
  for (int64_t e = 0; e < E; ++e) {
    L.w13_scale_2.push_back(0.0005f * (1.0f + 0.1f * e));
    L.w2_scale_2.push_back(0.0005f);
    L.w13_input_scale.push_back(0.004f + 0.001f * static_cast<float>(e % 3));
    L.w2_input_scale.push_back(0.01f / (1.0f + static_cast<float>(e % 2)));
  }
  return L;
}

TEST(ReferenceMoe, MatchesAPlainImplementationOnRandomLayers) {
  struct Case {
    Activation act;
    ActQuant q;
    RoutingMethod method;
    int k;
    bool on_input;
  };
  const Case cases[] = {
      {Activation::SwiGLU, ActQuant::W4A16, RoutingMethod::Renormalize, 3, false},
      {Activation::SwiGLU, ActQuant::W4A4Scalar, RoutingMethod::Default, 2, false},
      {Activation::GeGLU, ActQuant::W4A4PerExpert, RoutingMethod::Sigmoid, 3, false},
      {Activation::SwiGLUOai, ActQuant::W4A16, RoutingMethod::TopK, 4, false},
      {Activation::SwiGLUOai, ActQuant::W4A4PerExpert, RoutingMethod::RenormalizeNaive, 2, false},
      {Activation::Relu2, ActQuant::W4A4Scalar, RoutingMethod::SigmoidRenorm, 3, false},
      {Activation::Relu2, ActQuant::W4A16, RoutingMethod::DeepSeekV3, 2, false},
      {Activation::SwiGLU, ActQuant::W4A4Scalar, RoutingMethod::Llama4, 1, true},
      {Activation::GeGLU, ActQuant::W4A16, RoutingMethod::TopKSigmoid, 1, true},
  };
  uint64_t seed = 11;
  for (const Case& c : cases) {
    Layer L = random_layer(seed++, 6, 48, 32, c.k, 37, c.act, c.q, c.method);
    L.problem.routing.apply_router_weight_on_input = c.on_input;
    const std::string what = L.problem.describe();
    const MoeResult r = L.run();
    const Routing expected_routing =
        route(L.problem.routing, L.T, L.problem.num_experts, L.logits.data(), nullptr);
    ASSERT_EQ(r.topk_ids, expected_routing.ids) << what;
    ASSERT_EQ(r.topk_weights, expected_routing.weights) << what;
    const std::vector<uint16_t> expected = plain_moe(L, r.topk_ids, r.topk_weights);
    ASSERT_EQ(r.output.size(), expected.size());
    int64_t differ = 0;
    for (size_t i = 0; i < expected.size(); ++i) differ += r.output[i] != expected[i];
    EXPECT_EQ(differ, 0) << what;
  }
}

// Shapes large enough that the GEMMs split each expert into several blocks of weight rows and
// stream the token rows in several chunks; one expert gets no tokens.
TEST(ReferenceMoe, MatchesAPlainImplementationOnLargerShapes) {
  for (ActQuant q : {ActQuant::W4A16, ActQuant::W4A4PerExpert}) {
    Layer L = random_layer(23, 5, 1024, 256, 2, 150, Activation::SwiGLU, q, RoutingMethod::Renormalize);
    for (int64_t t = 0; t < L.T; ++t) L.logits[t * 5 + 4] = -100.0f;  // expert 4 stays empty
    const MoeResult r = L.run();
    for (int32_t id : r.topk_ids) ASSERT_NE(id, 4);
    EXPECT_EQ(r.output, plain_moe(L, r.topk_ids, r.topk_weights)) << to_string(q);
  }
}

// All tokens on one expert, other experts empty; the result does not depend on which of several
// identical experts is used.
TEST(ReferenceMoe, AllTokensOnOneExpert) {
  Layer L = random_layer(5, 4, 32, 16, 1, 300, Activation::SwiGLU, ActQuant::W4A4PerExpert,
                         RoutingMethod::Precomputed);
  L.ids.assign(300, 2);
  L.topk_weights.assign(300, 1.0f);
  const MoeResult r = L.run();
  EXPECT_EQ(r.output, plain_moe(L, L.ids, L.topk_weights));
}

// ---- moe_forward_fp32 ----------------------------------------------------------------------------
TEST(ReferenceMoeFp32, EqualsTheQuantizedLayerWhenEverythingIsExact) {
  const std::vector<float> x = {6, -3, 3, 0, -6, 6, 3, 3, 0, 0, -3, 6, 3, -6, 0, 3};
  Layer L = hand_layer(Activation::Relu2, ActQuant::W4A4Scalar, 1, x, 1.0f, 1.0f, 1.0f, 1.0f);
  L.logits = {0.75f, 0.25f};
  const MoeResult q = L.run();
  // The same weights in fp32 (block scales 1, global scales 1).
  std::vector<float> w13(2 * kI * kH), w2(2 * kH * kI);
  format::dequantize_nvfp4(L.w13.data(), L.w13_scale.data(), 2 * kI, kH, w13.data());
  format::dequantize_nvfp4(L.w2.data(), L.w2_scale.data(), 2 * kH, kI, w2.data());
  const Routing routing{q.topk_ids, q.topk_weights};
  const std::vector<float> f = moe_forward_fp32(L.problem, 1, L.hidden.data(), routing, w13.data(),
                                                w2.data());
  ASSERT_EQ(f.size(), static_cast<size_t>(kH));
  for (int64_t n = 0; n < kH; ++n) EXPECT_EQ(f[n], bf16_value(q.output[n])) << n;
}

TEST(ReferenceMoeFp32, NoRoundingAnywhere) {
  // k = 1, swiglu with g = x_n, u = 1 (up rows pick x_15 = 1): out_n = float(silu(x_n) * 1) * w,
  // not rounded to bf16; apply_router_weight_on_input multiplies x by w in fp32.
  std::vector<float> x(kH);
  for (int64_t i = 0; i < kH; ++i) x[i] = 0.125f * static_cast<float>(i) - 0.75f;
  x[15] = 1.0f;
  MoeProblem p;
  p.num_experts = 1;
  p.hidden = kH;
  p.inter = kI;
  p.routing.top_k = 1;
  std::vector<uint16_t> hidden;
  for (float v : x) hidden.push_back(bf16_bits(v));
  std::vector<float> w13(2 * kI * kH, 0.0f), w2(kH * kI, 0.0f);
  for (int64_t n = 0; n < kI; ++n) {
    w13[n * kH + n] = 1.0f;
    w13[(kI + n) * kH + 15] = 1.0f;
    w2[n * kI + n] = 1.0f;
  }
  const float w = 0.7f;
  const Routing routing{{0}, {w}};
  const std::vector<float> f = moe_forward_fp32(p, 1, hidden.data(), routing, w13.data(), w2.data());
  p.routing.apply_router_weight_on_input = true;
  const std::vector<float> g = moe_forward_fp32(p, 1, hidden.data(), routing, w13.data(), w2.data());
  auto silu = [](double v) { return v / (1.0 + std::exp(-v)); };
  for (int64_t n = 0; n < 15; ++n) {
    const float act = static_cast<float>(silu(x[n]) * 1.0);
    EXPECT_EQ(f[n], w * act) << n;
    const float xw = x[n] * w, uw = 1.0f * w;
    EXPECT_EQ(g[n], static_cast<float>(silu(xw) * uw)) << n;
  }
}

// ---- 4. argument errors --------------------------------------------------------------------------
TEST(ReferenceMoeErrors, EveryBadArgumentIsNamed) {
  const std::vector<float> x(kH, 1.0f);
  const Layer base = hand_layer(Activation::Relu2, ActQuant::W4A4PerExpert, 1, x, 1, 1, 1, 1);
  Layer L = base;
  L.logits = {1.0f, 0.0f};
  auto run = [](const Layer& l) { return [l] { l.run(); }; };

  {  // the problem itself
    Layer b = L;
    b.problem.hidden = 20;
    expect_error(run(b), "MoeProblem.hidden");
  }
  expect_error([&] { moe_forward(L.problem, -1, L.hidden.data(), L.router(), L.weights()); },
               "num_tokens must be >= 0, got -1");
  expect_error([&] { moe_forward(L.problem, 1, nullptr, L.router(), L.weights()); },
               "hidden is null");
  {
    Layer b = L;
    b.problem.routing.apply_router_weight_on_input = true;
    expect_error(run(b), "apply_router_weight_on_input");
  }
  // Null weight tensors.
  const char* names[] = {"w13", "w13_scale", "w13_scale_2", "w2", "w2_scale", "w2_scale_2"};
  for (int i = 0; i < 6; ++i) {
    MoeWeights w = L.weights();
    switch (i) {
      case 0: w.w13 = nullptr; break;
      case 1: w.w13_scale = nullptr; break;
      case 2: w.w13_scale_2 = nullptr; break;
      case 3: w.w2 = nullptr; break;
      case 4: w.w2_scale = nullptr; break;
      default: w.w2_scale_2 = nullptr; break;
    }
    expect_error([&] { moe_forward(L.problem, 1, L.hidden.data(), L.router(), w); },
                 std::string("weights.") + names[i] + " is null");
  }
  {  // w4a4 needs input scales; w4a16 does not
    MoeWeights w = L.weights();
    w.w13_input_scale = nullptr;
    expect_error([&] { moe_forward(L.problem, 1, L.hidden.data(), L.router(), w); },
                 "weights.w13_input_scale is null");
    w = L.weights();
    w.w2_input_scale = nullptr;
    expect_error([&] { moe_forward(L.problem, 1, L.hidden.data(), L.router(), w); },
                 "weights.w2_input_scale is null");
    MoeProblem p16 = L.problem;
    p16.act_quant = ActQuant::W4A16;
    w.w13_input_scale = nullptr;
    EXPECT_NO_THROW(moe_forward(p16, 1, L.hidden.data(), L.router(), w));
  }
  // Bad global / input scales, named with the expert.
  for (float bad : {0.0f, -1.0f, kNaN, kInf}) {
    Layer b = L;
    b.w13_scale_2[1] = bad;
    expect_error(run(b), "w13_scale_2[1] (expert 1) must be finite and > 0");
    b = L;
    b.w2_scale_2[0] = bad;
    expect_error(run(b), "w2_scale_2[0] (expert 0) must be finite and > 0");
    b = L;
    b.w13_input_scale[1] = bad;
    expect_error(run(b), "w13_input_scale[1] (expert 1) must be finite and > 0");
    b = L;
    b.w2_input_scale[1] = bad;
    expect_error(run(b), "w2_input_scale[1] (expert 1) must be finite and > 0");
  }
  {
    Layer b = L;
    b.w2_input_scale[0] = 1e-40f;  // subnormal: 1/s overflows
    expect_error(run(b), "w2_input_scale[0] (expert 0) must have a finite fp32 reciprocal");
  }
  // Router input.
  {
    RouterInput r;  // no logits
    expect_error([&] { moe_forward(L.problem, 1, L.hidden.data(), r, L.weights()); },
                 "router.logits is null");
    const int32_t ids[2] = {0, 1};
    r = L.router();
    r.topk_ids = ids;
    expect_error([&] { moe_forward(L.problem, 1, L.hidden.data(), r, L.weights()); },
                 "must be null with routing_method topk");
  }
  {
    Layer b = L;
    b.problem.routing.method = RoutingMethod::Precomputed;
    b.ids = {0, 2};
    b.topk_weights = {0.5f, 0.5f};
    expect_error(run(b), "router.topk_ids[0, 1] (token 0, slot 1) must be an expert id in [0, 2), got 2");
    b.ids = {-1, 0};
    expect_error(run(b), "(token 0, slot 0) must be an expert id in [0, 2), got -1");
    b.ids = {0, 1};
    RouterInput r = b.router();
    r.logits = b.logits.data();
    expect_error([&] { moe_forward(b.problem, 1, b.hidden.data(), r, b.weights()); },
                 "router.logits must be null with routing_method precomputed");
    r = b.router();
    r.topk_weights = nullptr;
    expect_error([&] { moe_forward(b.problem, 1, b.hidden.data(), r, b.weights()); },
                 "router.topk_weights is null");
    r = b.router();
    r.topk_ids = nullptr;
    expect_error([&] { moe_forward(b.problem, 1, b.hidden.data(), r, b.weights()); },
                 "router.topk_ids is null");
  }
}

TEST(ReferenceMoeErrors, Fp32LayerArguments) {
  MoeProblem p;
  p.num_experts = 2;
  p.hidden = kH;
  p.inter = kI;
  p.routing.top_k = 1;
  const std::vector<uint16_t> hidden(2 * kH, 0);
  const std::vector<float> w13(2 * 2 * kI * kH, 0.0f), w2(2 * kH * kI, 0.0f);
  const Routing ok{{0, 1}, {1.0f, 1.0f}};
  EXPECT_NO_THROW(moe_forward_fp32(p, 2, hidden.data(), ok, w13.data(), w2.data()));
  expect_error([&] { moe_forward_fp32(p, 2, hidden.data(), Routing{{0}, {1.0f}}, w13.data(), w2.data()); },
               "routing.ids must hold T * k = 2 ids, got 1");
  expect_error([&] { moe_forward_fp32(p, 2, hidden.data(), Routing{{0, 1}, {1.0f}}, w13.data(), w2.data()); },
               "routing.weights must hold T * k = 2 weights, got 1");
  expect_error([&] { moe_forward_fp32(p, 2, hidden.data(), Routing{{0, 5}, {1, 1}}, w13.data(), w2.data()); },
               "routing.ids[1, 0] (token 1, slot 0) must be an expert id in [0, 2), got 5");
  expect_error([&] { moe_forward_fp32(p, 2, hidden.data(), ok, nullptr, w2.data()); }, "w13 is null");
  expect_error([&] { moe_forward_fp32(p, 2, hidden.data(), ok, w13.data(), nullptr); }, "w2 is null");
  expect_error([&] { moe_forward_fp32(p, 2, nullptr, ok, w13.data(), w2.data()); }, "hidden is null");
  expect_error([&] { moe_forward_fp32(p, -2, hidden.data(), ok, w13.data(), w2.data()); },
               "num_tokens must be >= 0, got -2");
}

}  // namespace
}  // namespace fp4moe::reference
