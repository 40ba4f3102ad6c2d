// reference/rounding_slack.cpp — how far a layer computed in another fp32 order may be from moe_forward
// (docs/numerics.md, "The whole layer").
//
// output_rounding_slack, for each entry (token t, slot j, expert e) that moe_forward computed:
//   1. The GEMM1 outputs h = alpha1 * acc (+ bias) are in doubt by dh = gemm1_error * |alpha1| * ||a|| * ||w_n||
//      (Cauchy-Schwarz: ||a|| ||w_n|| >= sum_k |a_k w_nk|, the sum the kernel tolerance table scales).
//   2. The activation then lies in [v_lo, v_hi], its range over the box g +- dg, u +- du: act is f(g) * phi(u)
//      with phi monotone and f falling then rising (one minimum, at g_min), so the range is spanned by
//      g in {g - dg, g + dg, g_min if inside} times u in {u - du, u + du}.
//   3. Its rounding: w4a16, bf16 of the two ends; w4a4, the NVFP4 re-quantization of the 16-block with
//      every value at either end of its range: when the block scale is the same at both ends the codes of
//      v_lo and v_hi bound the outcome, otherwise each value of the block may move by half the block's
//      amax (the kernel table's bound for a re-quantization flip). delta_i: the largest change from the
//      reference's rounded value.
//   4. Each doubtful value moves output t by at most |w_j * alpha2| * sum_i |W2[h, i]| * delta_i; the
//      slots' bounds add up.
// Values that are not finite have no slack: they poison their token, which the comparison checks apart.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "fp4moe/error.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/reference.hpp"
#include "reference/layer_scales.hpp"
#include "reference/parallel.hpp"

namespace fp4moe::reference {
namespace {

using detail::bf16_round;
using format::kBlockSize;

// The 2-norm of each row [0, N) of expert e of a weight tensor [E, N, K], from its codes: a block's
// sum of squares is its scale squared times the sum of its codes' squares (exact in double).
void expert_row_norms(WeightFormat wf, const uint8_t* w, const uint8_t* w_scale, int64_t e, int64_t N, int64_t K,
                      std::vector<double>& out) {
  static const std::vector<double> pair_sq = [] {  // a byte's two e2m1 values, squared and added
    std::vector<double> t(256);
    for (int b = 0; b < 256; ++b) {
      const double lo = format::e2m1_to_float(static_cast<uint8_t>(b)), hi = format::e2m1_to_float(static_cast<uint8_t>(b >> 4));
      t[b] = lo * lo + hi * hi;
    }
    return t;
  }();
  const bool mx = wf == WeightFormat::MXFP4;
  const int64_t block = mx ? format::kMxfp4BlockSize : kBlockSize, blocks = K / block;
  out.resize(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* codes = w + (e * N + n) * (K / 2);
    const uint8_t* scales = w_scale + (e * N + n) * blocks;
    double sum = 0.0;
    for (int64_t b = 0; b < blocks; ++b) {
      double q = 0.0;
      for (int64_t j = 0; j < block / 2; ++j) q += pair_sq[codes[b * (block / 2) + j]];
      const double sf = mx ? format::ue8m0_to_float(scales[b]) : format::e4m3_to_float(scales[b]);
      sum += q * sf * sf;
    }
    out[n] = std::sqrt(sum);
  }
}

// q*sf values of quantize_nvfp4 of one block; returns the block's e4m3 scale code.
uint8_t quantize_block(const float* x, float input_scale, float* dq) {
  uint8_t packed[kBlockSize / 2], sf = 0;
  format::quantize_nvfp4(x, 1, kBlockSize, input_scale, packed, &sf);
  format::dequantize_nvfp4(packed, &sf, 1, kBlockSize, dq);
  return sf;
}

// Step 3 for one NVFP4 block of ranges [lo, hi] and the reference's q*sf values `chosen` -> delta, in
// q*sf units (the GEMM2 operand; alpha2 holds the input scale).
void nvfp4_block_delta(const float* lo, const float* hi, float input_scale, const float* chosen, float* delta) {
  float mag_lo[kBlockSize], mag_hi[kBlockSize], dq_hi[kBlockSize], dq_lo[kBlockSize], scratch[kBlockSize];
  float amax_hi = 0.0f;
  for (int i = 0; i < kBlockSize; ++i) {
    mag_lo[i] = lo[i] <= 0.0f && hi[i] >= 0.0f ? 0.0f : std::min(std::fabs(lo[i]), std::fabs(hi[i]));
    mag_hi[i] = std::max(std::fabs(lo[i]), std::fabs(hi[i]));
    amax_hi = std::max(amax_hi, mag_hi[i]);
  }
  // NOTE: the block scale is a monotone function of the block's amax alone.
  if (quantize_block(mag_lo, input_scale, scratch) != quantize_block(mag_hi, input_scale, scratch)) {
    const float gs = 1.0f / input_scale;  // q*sf values are v * gs up to the rounding
    for (int i = 0; i < kBlockSize; ++i) delta[i] = (0.5f * amax_hi + (hi[i] - lo[i])) * gs;
    return;
  }
  // NOTE: with the block scale fixed each code is monotone in its value, so the two ends bound it.
  quantize_block(hi, input_scale, dq_hi);
  quantize_block(lo, input_scale, dq_lo);
  for (int i = 0; i < kBlockSize; ++i)
    delta[i] = std::max(std::fabs(dq_hi[i] - chosen[i]), std::fabs(dq_lo[i] - chosen[i]));
}

// Where f, the gate factor of act(g, u) = f(g) * phi(u), has its minimum (NaN: f is monotone).
double gate_minimum(const ActivationParams& act) {
  constexpr double kSiluMinimum = -1.2784645427610738;  // 1 + g (1 - sigmoid(g)) = 0
  switch (act.kind) {
    case Activation::SwiGLU: return kSiluMinimum;
    case Activation::GeGLU: return -0.7517915241191297;  // Phi(g) + g phi(g) = 0
    case Activation::SwiGLUOai:  // min(g, L) * sigmoid(alpha min(g, L)) = silu(alpha g) / alpha below L
      return act.swiglu_alpha > 0.0f ? kSiluMinimum / act.swiglu_alpha : std::nan("");
    case Activation::Relu2: return 0.0;
  }
  return std::nan("");
}

// Step 2: the range of act over [g0, g1] x [u0, u1] (u ignored by relu2).
void activation_range(const ActivationParams& act, double g_min, float g0, float g1, float u0, float u1, float& lo,
                      float& hi) {
  const float gs[3] = {g0, g1, static_cast<float>(g_min)};
  const int n_g = g0 < g_min && g_min < g1 ? 3 : 2;
  lo = hi = apply_activation(act, g0, u0);
  for (int a = 0; a < n_g; ++a)
    for (const float u : {u0, u1}) {
      const float v = apply_activation(act, gs[a], u);
      lo = std::min(lo, v), hi = std::max(hi, v);
    }
}

double norm(const float* x, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += double(x[i]) * x[i];
  return std::sqrt(s);
}

}  // namespace

std::vector<float> output_rounding_slack(const MoeProblem& problem, const MoeWeights& weights,
                                         const MoeResult& result, const MoeTrace& trace, double gemm1_error) {
  const int64_t E = problem.num_experts, H = problem.hidden, I = problem.inter, k = problem.top_k();
  const int64_t N1 = problem.w13_rows();
  const bool gated = problem.gated(), w4a4 = problem.act_quant != ActQuant::W4A16;
  const int64_t R = static_cast<int64_t>(result.topk_ids.size()), T = R / k;
  check(static_cast<int64_t>(result.topk_weights.size()) == R && R == T * k, "output_rounding_slack: result has ",
        result.topk_ids.size(), " ids and ", result.topk_weights.size(), " weights, expected T * k of each (k = ", k,
        ")");
  check(static_cast<int64_t>(trace.gemm1_input.size()) == R * H &&
            static_cast<int64_t>(trace.gemm1_out.size()) == R * N1 &&
            static_cast<int64_t>(trace.act_out.size()) == R * I,
        "output_rounding_slack: the trace is not moe_forward's for this result (gemm1_input ",
        trace.gemm1_input.size(), ", gemm1_out ", trace.gemm1_out.size(), ", act_out ", trace.act_out.size(),
        " values for ", R, " entries)");
  std::vector<float> out(static_cast<size_t>(T * H), 0.0f);
  if (R == 0) return out;
  const detail::LayerScales scales = detail::layer_scales(problem, weights);
  const bool unit_weights = problem.routing.apply_router_weight_on_input;
  const double g_min = gate_minimum(problem.activation);

  std::vector<std::vector<int64_t>> entries(static_cast<size_t>(E));  // the entries of each expert
  for (int64_t i = 0; i < R; ++i) {
    const int32_t e = result.topk_ids[i];
    if (e >= 0 && e < E) entries[e].push_back(i);  // another rank's expert: the slot adds nothing
  }
  std::vector<int64_t> hit;
  for (int64_t e = 0; e < E; ++e)
    if (!entries[e].empty()) hit.push_back(e);

  std::vector<float> entry_slack(static_cast<size_t>(R * H), 0.0f);  // [R, H], step 4 per slot
  struct Scratch {
    std::vector<float> w2, w2_abs_t, lo, hi, delta;  // lo, hi: step 2's range per column
    std::vector<double> w13_norm, acc;
    std::vector<int64_t> doubtful;
  };
  std::vector<Scratch> scratch(static_cast<size_t>(detail::workers_for(static_cast<int64_t>(hit.size()))));
  detail::parallel_for(static_cast<int64_t>(hit.size()), [&](int64_t item, int worker) {
    Scratch& sc = scratch[worker];
    const int64_t e = hit[item];
    expert_row_norms(problem.weight_format, weights.w13, weights.w13_scale, e, N1, H, sc.w13_norm);
    bool w2_decoded = false;
    const double alpha1 = std::fabs(scales.alpha1[e]), alpha2 = std::fabs(scales.alpha2[e]);
    sc.lo.resize(static_cast<size_t>(I));
    sc.hi.resize(static_cast<size_t>(I));
    sc.delta.resize(static_cast<size_t>(I));
    for (const int64_t entry : entries[e]) {
      // ---- steps 1-2 ----
      const double dh = gemm1_error * alpha1 * norm(trace.gemm1_input.data() + entry * H, H);
      const float* h = trace.gemm1_out.data() + entry * N1;
      const float* chosen = trace.act_out.data() + entry * I;
      for (int64_t i = 0; i < I; ++i) {
        const double g = h[i], u = gated ? h[I + i] : 0.0;
        const double dg = dh * sc.w13_norm[i], du = gated ? dh * sc.w13_norm[I + i] : 0.0;
        activation_range(problem.activation, g_min, static_cast<float>(g - dg), static_cast<float>(g + dg),
                         static_cast<float>(u - du), static_cast<float>(u + du), sc.lo[i], sc.hi[i]);
      }
      // ---- step 3 ----
      auto finite = [&](int64_t i) { return std::isfinite(sc.lo[i]) && std::isfinite(sc.hi[i]) && std::isfinite(chosen[i]); };
      if (w4a4) {
        for (int64_t b = 0; b < I; b += kBlockSize) {
          bool ok = true;
          for (int64_t i = b; i < b + kBlockSize; ++i) ok = ok && finite(i);
          if (ok) {
            nvfp4_block_delta(sc.lo.data() + b, sc.hi.data() + b, weights.w2_input_scale[e], chosen + b, sc.delta.data() + b);
          } else {
            std::fill_n(sc.delta.begin() + b, kBlockSize, 0.0f);
          }
        }
      } else {
        for (int64_t i = 0; i < I; ++i) {
          const float lo = bf16_round(sc.lo[i]), hi = bf16_round(sc.hi[i]);
          sc.delta[i] = finite(i) ? std::max(std::fabs(lo - chosen[i]), std::fabs(hi - chosen[i])) : 0.0f;
        }
      }
      sc.doubtful.clear();
      for (int64_t i = 0; i < I; ++i)
        if (sc.delta[i] > 0.0f) sc.doubtful.push_back(i);
      if (sc.doubtful.empty()) continue;
      // ---- step 4 ----
      if (!w2_decoded) {  // |W2|^T [I, H]: a doubtful column's weights are one contiguous row
        sc.w2.resize(static_cast<size_t>(H * I));
        detail::decode_expert_rows(problem.weight_format, weights.w2, weights.w2_scale, e, 0, H, H, I, sc.w2.data());
        sc.w2_abs_t.resize(static_cast<size_t>(I * H));
        for (int64_t n = 0; n < H; ++n)
          for (int64_t i = 0; i < I; ++i) sc.w2_abs_t[i * H + n] = std::fabs(sc.w2[n * I + i]);
        w2_decoded = true;
      }
      sc.acc.assign(static_cast<size_t>(H), 0.0);
      for (const int64_t i : sc.doubtful) {
        const double d = sc.delta[i];
        const float* col = sc.w2_abs_t.data() + i * H;
        for (int64_t n = 0; n < H; ++n) sc.acc[n] += d * col[n];
      }
      const double coef = alpha2 * (unit_weights ? 1.0 : std::fabs(double(result.topk_weights[entry])));
      float* slack = entry_slack.data() + entry * H;
      for (int64_t n = 0; n < H; ++n) slack[n] = static_cast<float>(coef * sc.acc[n]);
    }
  });
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const float* s = entry_slack.data() + (t * k + j) * H;
      for (int64_t n = 0; n < H; ++n) out[t * H + n] += s[n];
    }
  return out;
}

}  // namespace fp4moe::reference
