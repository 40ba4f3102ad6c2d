// reference/moe.cpp — the CPU MoE layer of docs/numerics.md, "The layer, step by step" (the oracle every GPU kernel is tested against).
//
// moe_forward, for T tokens, top-k, entry = token-slot pair t*k + j, e = id of the entry:
//   0. Check every argument (fp4moe::Error naming it); T = 0 returns empty results.
//   1. Routing: route() of routing.cpp, or the precomputed ids/weights (ids checked in [0, E)).
//   2. Permutation: entries grouped by expert (expert-major, ascending entry within an expert), so
//      that each expert's GEMM operands are contiguous rows.
//   3. GEMM1 input per entry: x = bf16 hidden as float; with apply_router_weight_on_input (k = 1)
//      x = bf16(x * bf16(w)) and the finalize weight becomes 1. w4a16: a = x. w4a4: a = q*sf values
//      of quantize_nvfp4(x, s) with s = max_e w13_input_scale[e] (scalar, once per token) or
//      w13_input_scale[e] (per expert). The global scale is not folded in: it is in alpha1.
//   4. GEMM1: h_n = alpha1[e] * float(sum_K a_k * W_nk), W = q*sf of w13[e] (each row of each expert
//      that received tokens is decoded once), the sum in double, rounded to fp32 once;
//      alpha1 = w13_scale_2[e] (w4a16) or w13_scale_2[e] * a_input_scale (w4a4), fp32.
//      MXFP4 weights: W = q * 2^(c - 127) (format::dequantize_mxfp4) and alpha1 = alpha2 = 1 (no global
//      scale); a ue8m0 NaN code (255) is refused in step 0.
//   5. Activation (apply_activation) on gate rows [0, I) and up rows [I, 2I) (relu2: the I rows).
//      w4a16: bf16(act); w4a4: q*sf of quantize_nvfp4(act, w2_input_scale[e]).
//   6. GEMM2: y = alpha2[e] * float(double sum), alpha2 = w2_scale_2[e] (* w2_input_scale[e] w4a4).
//   7. Finalize: acc = 0.0f; acc += w_j * y_j over the slots in order (fp32, no fma); bf16(acc).
// Threads (std::thread, hardware_concurrency): GEMM work items are (expert, block of weight rows),
// elementwise steps are chunks of rows or tokens. Every output element is computed by one item in a
// fixed order, so the result does not depend on the thread count.
//
// moe_forward_fp32 runs steps 2-7 on unquantized fp32 weights: no activation quantization, no bf16
// rounding of the activation, alpha = 1, and x * w in fp32 for apply_router_weight_on_input.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "fp4moe/error.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/reference.hpp"
#include "reference/dot.hpp"
#include "reference/layer_scales.hpp"
#include "reference/parallel.hpp"

namespace fp4moe::reference {
namespace {

using format::kBlockSize;

inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
inline double silu(double g) { return g / (1.0 + std::exp(-g)); }
inline double gelu_erf(double g) { return 0.5 * g * (1.0 + std::erf(g / std::sqrt(2.0))); }

using detail::bf16_round;

// Grouping of the T*k entries by expert (step 2).
// Expert-major, stable. Ids outside [0, E) (another rank's experts, skip_foreign_ids) go to a last
// bucket E after every expert: its rows belong to no expert and are never computed.
struct Permutation {
  std::vector<int64_t> offsets;       // [E + 2]: rows of expert e are [offsets[e], offsets[e+1]); bucket E: foreign
  std::vector<int64_t> row_of_entry;  // [T*k]
  std::vector<int64_t> entry_of_row;  // [T*k]
  int64_t local_rows() const { return offsets[offsets.size() - 2]; }  // rows of this rank's experts
};

Permutation permute(const std::vector<int32_t>& ids, int64_t num_experts) {
  Permutation p;
  const int64_t n = static_cast<int64_t>(ids.size());
  auto bucket = [num_experts](int32_t id) { return id >= 0 && id < num_experts ? int64_t(id) : num_experts; };
  p.offsets.assign(static_cast<size_t>(num_experts) + 2, 0);
  for (int32_t e : ids) ++p.offsets[bucket(e) + 1];
  for (int64_t e = 0; e <= num_experts; ++e) p.offsets[e + 1] += p.offsets[e];
  std::vector<int64_t> fill(p.offsets.begin(), p.offsets.end() - 1);
  p.row_of_entry.resize(n);
  p.entry_of_row.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = fill[bucket(ids[i])]++;
    p.row_of_entry[i] = r;
    p.entry_of_row[r] = i;
  }
  return p;
}

// Provides rows [n0, n1) of expert e's weight matrix [N, K] as fp32 values, either decoded into
// `buf` or pointing into the caller's memory.
using RowSource =
    std::function<const float*(int64_t e, int64_t n0, int64_t n1, std::vector<float>& buf)>;

// C[r, n] = alpha[e] * float(detail::dot(A[r], W_e[n])) for every row r of every expert e (step 4 / 6).
// A [R, K] and C [R, N] are in permuted order. Work item: (expert, block of weight rows): its
// weight rows are produced once and kept in cache while every row of A for that expert streams by.
void expert_gemm(const Permutation& perm, int64_t num_experts, int64_t K, int64_t N, const float* A,
                 const float* alpha, const float* bias, const RowSource& rows, float* C) {
  // About 64 KiB of fp32 weight rows per block (4..64 rows); A rows go by in chunks of the same size.
  const int64_t block = std::clamp<int64_t>(16384 / K, 4, 64);
  const int64_t blocks_per_expert = (N + block - 1) / block;
  std::vector<int64_t> items;  // expert ids with rows, one entry per (expert, block) below
  for (int64_t e = 0; e < num_experts; ++e)
    if (perm.offsets[e + 1] > perm.offsets[e]) items.push_back(e);
  const int64_t n_items = static_cast<int64_t>(items.size()) * blocks_per_expert;
  struct Scratch {
    std::vector<float> w;              // the block's weight rows from `rows`, when decoded
    std::vector<double> w64, a64, d;   // (block, K) weight rows and A rows as double; one row's dots
  };
  std::vector<Scratch> scratch(static_cast<size_t>(detail::workers_for(n_items)));
  detail::parallel_for(n_items, [&](int64_t item, int worker) {
    Scratch& sc = scratch[worker];
    const int64_t e = items[item / blocks_per_expert];
    const int64_t n0 = (item % blocks_per_expert) * block;
    const int64_t n1 = std::min(N, n0 + block);
    const float* W = rows(e, n0, n1, sc.w);
    sc.w64.assign(W, W + (n1 - n0) * K);
    const float a = alpha[e];
    const int64_t r_begin = perm.offsets[e], r_end = perm.offsets[e + 1];
    for (int64_t rc = r_begin; rc < r_end; rc += block) {
      const int64_t rc_end = std::min(r_end, rc + block);
      sc.a64.assign(A + rc * K, A + rc_end * K);
      sc.d.resize(static_cast<size_t>(n1 - n0));
      for (int64_t r = rc; r < rc_end; ++r) {
        detail::dot_rows(sc.a64.data() + (r - rc) * K, sc.w64.data(), K, n1 - n0, K, sc.d.data());
        for (int64_t n = n0; n < n1; ++n) {
          const float acc = static_cast<float>(sc.d[n - n0]);
          C[r * N + n] = bias != nullptr ? a * acc + bias[e * N + n] : a * acc;  // fp32 multiply, then the fp32 add
        }
      }
    }
  });
}

// Expert rows decoded into `buf` (detail::decode_expert_rows).
RowSource quantized_rows(WeightFormat wf, const uint8_t* w, const uint8_t* w_scale, int64_t N, int64_t K) {
  return [=](int64_t e, int64_t n0, int64_t n1, std::vector<float>& buf) -> const float* {
    buf.resize(static_cast<size_t>((n1 - n0) * K));
    detail::decode_expert_rows(wf, w, w_scale, e, n0, n1, N, K, buf.data());
    return buf.data();
  };
}

// MXFP4: no ue8m0 NaN code (255) in `codes` [E, rows, K/32] (docs/numerics.md, "MXFP4 weights").
void check_ue8m0_codes(const uint8_t* codes, int64_t E, int64_t rows, int64_t K, const char* name) {
  const int64_t blocks = K / format::kMxfp4BlockSize;
  const int64_t i = format::find_ue8m0_nan(codes, E * rows * blocks);
  if (i < 0) return;
  throw Error(fp4moe::detail::concat("moe_forward: weights.", name, ": ue8m0 block scale code 255 (NaN) at expert ",
                                     i / (rows * blocks), ", row ", (i / blocks) % rows, ", block ", i % blocks,
                                     " (K elements [", (i % blocks) * format::kMxfp4BlockSize, ", ",
                                     (i % blocks + 1) * format::kMxfp4BlockSize, ")); MXFP4 scales must be codes 0..254"));
}

RowSource fp32_rows(const float* w, int64_t N, int64_t K) {
  return [=](int64_t e, int64_t n0, int64_t, std::vector<float>&) -> const float* {
    return w + (e * N + n0) * K;
  };
}

// q*sf values of quantize_nvfp4(x, scale), one row of `cols` values.
void quantize_dequantize_row(const float* x, int64_t cols, float scale, float* out,
                             std::vector<uint8_t>& packed, std::vector<uint8_t>& sf) {
  packed.resize(static_cast<size_t>(cols / 2));
  sf.resize(static_cast<size_t>(cols / kBlockSize));
  format::quantize_nvfp4(x, 1, cols, scale, packed.data(), sf.data());
  format::dequantize_nvfp4(packed.data(), sf.data(), 1, cols, out);
}

// Chunks of `chunk` consecutive indices in [0, n), in parallel.
template <typename Fn>
void parallel_chunks(int64_t n, int64_t chunk, Fn&& fn) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  detail::parallel_for(chunks, [&](int64_t c, int worker) {
    const int64_t end = std::min(n, (c + 1) * chunk);
    for (int64_t i = c * chunk; i < end; ++i) fn(i, worker);
  });
}

// Steps 5-7 and the trace, shared by the quantized and the fp32 layer.
struct LayerShape {
  int64_t T, E, H, I, k, N1;
  bool gated;
};

// Step 5: act rows [R, I] from h rows [R, N1]; `finish(r, e, act_row)` rounds / quantizes in place.
template <typename Finish>
void activation_rows(const LayerShape& s, const ActivationParams& act, const Permutation& perm,
                     const std::vector<int32_t>& ids, const std::vector<float>& h,
                     std::vector<float>& out, Finish&& finish) {
  const int64_t R = s.T * s.k;
  out.resize(static_cast<size_t>(R * s.I));
  parallel_chunks(perm.local_rows(), 64, [&](int64_t r, int worker) {
    const float* hr = h.data() + r * s.N1;
    float* o = out.data() + r * s.I;
    for (int64_t i = 0; i < s.I; ++i)
      o[i] = apply_activation(act, hr[i], s.gated ? hr[s.I + i] : 0.0f);
    finish(r, ids[perm.entry_of_row[r]], o, worker);
  });
}

// Step 7: out[t] = sum_j w_j * y_j in fp32, slots in order (unit weights: w = 1); the slots of
// another rank's experts (skip_foreign_ids) add nothing.
template <typename Store>
void finalize(const LayerShape& s, const Permutation& perm, const std::vector<float>& weights,
              bool unit_weights, const std::vector<float>& y, Store&& store) {
  const int64_t local_rows = perm.local_rows();
  parallel_chunks(s.T, 16, [&](int64_t t, int) {
    for (int64_t n = 0; n < s.H; ++n) {
      float acc = 0.0f;
      for (int64_t j = 0; j < s.k; ++j) {
        const int64_t entry = t * s.k + j;
        if (perm.row_of_entry[entry] >= local_rows) continue;
        const float w = unit_weights ? 1.0f : weights[entry];
        const float prod = w * y[perm.row_of_entry[entry] * s.H + n];
        acc = acc + prod;
      }
      store(t * s.H + n, acc);
    }
  });
}

// Copies permuted rows [R, cols] back to entry order [T*k, cols].
std::vector<float> unpermute(const Permutation& perm, const std::vector<float>& rows, int64_t cols) {
  const int64_t R = static_cast<int64_t>(perm.entry_of_row.size());
  std::vector<float> out(static_cast<size_t>(R * cols));
  for (int64_t i = 0; i < R; ++i)
    std::memcpy(out.data() + i * cols, rows.data() + perm.row_of_entry[i] * cols,
                static_cast<size_t>(cols) * sizeof(float));
  return out;
}

void check_ids(const int32_t* ids, int64_t T, int k, int64_t E, const char* fn, const char* what) {
  for (int64_t t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) {
      const int32_t id = ids[t * k + j];
      check(id >= 0 && id < E, fn, ": ", what, "[", t, ", ", j, "] (token ", t, ", slot ", j,
            ") must be an expert id in [0, ", E, "), got ", id);
    }
}

void check_scales(const float* v, int64_t E, const char* name, bool reciprocal) {
  for (int64_t e = 0; e < E; ++e) {
    check(std::isfinite(v[e]) && v[e] > 0.0f, "moe_forward: ", name, "[", e, "] (expert ", e,
          ") must be finite and > 0, got ", v[e]);
    if (reciprocal)
      check(std::isfinite(1.0f / v[e]), "moe_forward: ", name, "[", e, "] (expert ", e,
            ") must have a finite fp32 reciprocal, got ", v[e]);
  }
}

}  // namespace

float apply_activation(const ActivationParams& act, float gate, float up) {
  const double g = gate, u = up;
  switch (act.kind) {
    case Activation::SwiGLU:
      return static_cast<float>(silu(g) * u);
    case Activation::GeGLU:
      return static_cast<float>(gelu_erf(g) * u);
    case Activation::SwiGLUOai: {
      const double L = act.swiglu_limit;
      const double alpha = act.swiglu_alpha, beta = act.swiglu_beta;
      const double gc = g > L ? L : g;                       // min(g, L); NaN stays NaN
      const double uc = u > L ? L : (u < -L ? -L : u);       // clamp(u, -L, L); NaN stays NaN
      return static_cast<float>(gc * sigmoid(alpha * gc) * (uc + beta));
    }
    case Activation::Relu2: {
      const double r = g < 0.0 ? 0.0 : g;  // max(h, 0); NaN stays NaN
      return static_cast<float>(r * r);
    }
  }
  throw Error(fp4moe::detail::concat("apply_activation: unknown activation kind ", static_cast<int>(act.kind)));
}

void check_input_scale_max(const MoeWeights& weights, int64_t num_experts, ActQuant act_quant) {
  const float m = weights.w13_input_scale_max;
  if (m == 0.0f) return;
  const bool w4a4 = act_quant != ActQuant::W4A16 && weights.w13_input_scale != nullptr;
  const float local_max = w4a4 ? *std::max_element(weights.w13_input_scale, weights.w13_input_scale + num_experts) : 0.0f;
  check(std::isfinite(m) && m > 0.0f && m >= local_max && std::isfinite(1.0f / m),
        "weights.w13_input_scale_max must be 0 (unset) or a finite scale with a finite fp32 reciprocal, >= the "
        "max of w13_input_scale (", local_max, "), got ", m);
}

void check_biases(const MoeWeights& weights, const MoeProblem& problem) {
  auto finite = [](const float* b, int64_t rows, int64_t cols, const char* name) {
    if (b == nullptr) return;
    for (int64_t i = 0; i < rows * cols; ++i)
      check(std::isfinite(b[i]), "weights.", name, "[", i / cols, ", ", i % cols, "] is not finite (", b[i], ")");
  };
  finite(weights.w13_bias, problem.num_experts, problem.w13_rows(), "w13_bias");
  finite(weights.w2_bias, problem.num_experts, problem.hidden, "w2_bias");
}

namespace detail {

LayerScales layer_scales(const MoeProblem& problem, const MoeWeights& weights) {
  const int64_t E = problem.num_experts;
  const bool w4a4 = problem.act_quant != ActQuant::W4A16;
  LayerScales s;
  s.a_scale.assign(static_cast<size_t>(E), 1.0f);
  if (problem.act_quant == ActQuant::W4A4Scalar) {
    const float a1 = weights.w13_input_scale_max > 0.0f
                         ? weights.w13_input_scale_max
                         : *std::max_element(weights.w13_input_scale, weights.w13_input_scale + E);
    std::fill(s.a_scale.begin(), s.a_scale.end(), a1);
  } else if (problem.act_quant == ActQuant::W4A4PerExpert) {
    s.a_scale.assign(weights.w13_input_scale, weights.w13_input_scale + E);
  }
  s.alpha1.assign(static_cast<size_t>(E), 1.0f);  // MXFP4: the weights' values are complete (w4a16 only)
  s.alpha2.assign(static_cast<size_t>(E), 1.0f);
  if (problem.weight_format == WeightFormat::MXFP4) return s;
  for (int64_t e = 0; e < E; ++e) {
    s.alpha1[e] = w4a4 ? weights.w13_scale_2[e] * s.a_scale[e] : weights.w13_scale_2[e];
    s.alpha2[e] = w4a4 ? weights.w2_scale_2[e] * weights.w2_input_scale[e] : weights.w2_scale_2[e];
  }
  return s;
}

}  // namespace detail

MoeResult moe_forward(const MoeProblem& problem, int64_t num_tokens, const uint16_t* hidden,
                      const RouterInput& router, const MoeWeights& weights, MoeTrace* trace) {
  // ---- 0. arguments ----
  problem.validate();
  check(num_tokens >= 0, "moe_forward: num_tokens must be >= 0, got ", num_tokens);
  const LayerShape s{num_tokens,        problem.num_experts, problem.hidden, problem.inter,
                     problem.top_k(),   problem.w13_rows(),  problem.gated()};
  const bool w4a4 = problem.act_quant != ActQuant::W4A16;
  const RoutingParams& rp = problem.routing;
  check(!rp.apply_router_weight_on_input || s.k == 1,
        "moe_forward: apply_router_weight_on_input needs top_k == 1, got ", s.k);
  auto need = [](const void* p, const char* name, const char* expected) {
    check(p != nullptr, "moe_forward: weights.", name, " is null, expected ", expected);
  };
  const bool mxfp4 = problem.weight_format == WeightFormat::MXFP4;
  need(weights.w13, "w13", "u8 [E, w13_rows, H/2]");
  need(weights.w13_scale, "w13_scale", mxfp4 ? "ue8m0 [E, w13_rows, H/32]" : "e4m3 [E, w13_rows, H/16]");
  need(weights.w2, "w2", "u8 [E, H, I/2]");
  need(weights.w2_scale, "w2_scale", mxfp4 ? "ue8m0 [E, H, I/32]" : "e4m3 [E, H, I/16]");
  if (!mxfp4) {  // MXFP4 has no global scale (and w4a16 only: validate() refuses the other modes)
    need(weights.w13_scale_2, "w13_scale_2", "f32 [E]");
    need(weights.w2_scale_2, "w2_scale_2", "f32 [E]");
  }
  if (w4a4) {
    const std::string mode(to_string(problem.act_quant));
    check(weights.w13_input_scale != nullptr, "moe_forward: weights.w13_input_scale is null, "
          "expected f32 [E] (act_quant ", mode, " quantizes the GEMM1 input with it)");
    check(weights.w2_input_scale != nullptr, "moe_forward: weights.w2_input_scale is null, "
          "expected f32 [E] (act_quant ", mode, " quantizes the GEMM2 input with it)");
  }
  if (mxfp4) {
    check_ue8m0_codes(weights.w13_scale, s.E, s.N1, s.H, "w13_scale");
    check_ue8m0_codes(weights.w2_scale, s.E, s.H, s.I, "w2_scale");
  } else {
    check_scales(weights.w13_scale_2, s.E, "w13_scale_2", false);
    check_scales(weights.w2_scale_2, s.E, "w2_scale_2", false);
  }
  if (w4a4) {
    check_scales(weights.w13_input_scale, s.E, "w13_input_scale", true);
    check_scales(weights.w2_input_scale, s.E, "w2_input_scale", true);
  }
  check_input_scale_max(weights, s.E, problem.act_quant);
  check_biases(weights, problem);
  const bool precomputed = rp.method == RoutingMethod::Precomputed;
  if (precomputed) {
    check(router.logits == nullptr,
          "moe_forward: router.logits must be null with routing_method precomputed (the ids and "
          "weights are given in router.topk_ids / router.topk_weights)");
  } else {
    check(router.topk_ids == nullptr && router.topk_weights == nullptr, "moe_forward: router.topk_ids "
          "and router.topk_weights must be null with routing_method ", to_string(rp.method),
          " (they are for precomputed routing)");
  }

  MoeResult result;
  if (trace != nullptr) *trace = MoeTrace{};
  if (num_tokens == 0) return result;

  check(hidden != nullptr, "moe_forward: hidden is null, expected bf16 [T, H] with T = ", num_tokens);
  const int64_t T = s.T, E = s.E, H = s.H, I = s.I, k = s.k, R = T * k;

  // ---- 1. routing ----
  if (precomputed) {
    check(router.topk_ids != nullptr, "moe_forward: router.topk_ids is null, expected i32 [T, k] = [",
          T, ", ", k, "] with routing_method precomputed");
    check(router.topk_weights != nullptr, "moe_forward: router.topk_weights is null, expected f32 "
          "[T, k] = [", T, ", ", k, "] with routing_method precomputed");
    if (!rp.skip_foreign_ids) check_ids(router.topk_ids, T, static_cast<int>(k), E, "moe_forward", "router.topk_ids");
    result.topk_ids.assign(router.topk_ids, router.topk_ids + R);
    result.topk_weights.assign(router.topk_weights, router.topk_weights + R);
  } else {
    check(router.logits != nullptr, "moe_forward: router.logits is null, expected f32 [T, E] = [", T,
          ", ", E, "] with routing_method ", to_string(rp.method));
    Routing r = route(rp, T, E, router.logits, router.bias);
    result.topk_ids = std::move(r.ids);
    result.topk_weights = std::move(r.weights);
  }
  const std::vector<int32_t>& ids = result.topk_ids;

  // ---- 2. permutation ----
  const Permutation perm = permute(ids, E);

  // ---- 3. GEMM1 input [R, H], permuted ----
  const bool on_input = rp.apply_router_weight_on_input;
  std::vector<float> x(static_cast<size_t>(T * H));  // per token: bf16 x, or bf16(x * bf16(w))
  parallel_chunks(T, 64, [&](int64_t t, int) {
    const float wb = on_input ? bf16_round(result.topk_weights[t * k]) : 1.0f;
    for (int64_t i = 0; i < H; ++i) {
      const float xv = format::bf16_to_float(hidden[t * H + i]);
      x[t * H + i] = on_input ? bf16_round(xv * wb) : xv;
    }
  });
  const detail::LayerScales scales = detail::layer_scales(problem, weights);
  const std::vector<float>& a_scale = scales.a_scale;  // the GEMM1 input scale per expert
  std::vector<std::vector<uint8_t>> qbuf(static_cast<size_t>(detail::max_workers()));
  std::vector<std::vector<uint8_t>> sbuf(static_cast<size_t>(detail::max_workers()));
  if (problem.act_quant == ActQuant::W4A4Scalar) {
    // Every token once, with the one scalar scale.
    std::vector<float> q(static_cast<size_t>(T * H));
    parallel_chunks(T, 16, [&](int64_t t, int w) {
      quantize_dequantize_row(x.data() + t * H, H, a_scale[0], q.data() + t * H, qbuf[w], sbuf[w]);
    });
    x.swap(q);
  }
  std::vector<float> a(static_cast<size_t>(R * H));
  parallel_chunks(perm.local_rows(), 16, [&](int64_t r, int w) {
    const int64_t entry = perm.entry_of_row[r], t = entry / k;
    const float* src = x.data() + t * H;
    float* dst = a.data() + r * H;
    if (problem.act_quant == ActQuant::W4A4PerExpert)
      quantize_dequantize_row(src, H, a_scale[ids[entry]], dst, qbuf[w], sbuf[w]);
    else
      std::memcpy(dst, src, static_cast<size_t>(H) * sizeof(float));
  });
  x = {};

  // ---- 4. GEMM1 ----
  const std::vector<float>& alpha1 = scales.alpha1;
  const std::vector<float>& alpha2 = scales.alpha2;
  auto weight_rows = [&problem](const uint8_t* w, const uint8_t* w_scale, int64_t N, int64_t K) {
    return quantized_rows(problem.weight_format, w, w_scale, N, K);
  };
  std::vector<float> h(static_cast<size_t>(R * s.N1));
  expert_gemm(perm, E, H, s.N1, a.data(), alpha1.data(), weights.w13_bias,
              weight_rows(weights.w13, weights.w13_scale, s.N1, H), h.data());

  if (trace != nullptr) trace->gemm1_out = unpermute(perm, h, s.N1);

  // ---- 5. activation, rounded (w4a16) or re-quantized (w4a4) ----
  std::vector<float> act;
  activation_rows(s, problem.activation, perm, ids, h, act, [&](int64_t, int32_t e, float* row, int w) {
    if (w4a4) {  // in place: the quantization has read the whole row before the decode writes it
      quantize_dequantize_row(row, I, weights.w2_input_scale[e], row, qbuf[w], sbuf[w]);
    } else {
      for (int64_t i = 0; i < I; ++i) row[i] = bf16_round(row[i]);
    }
  });
  h = {};

  // ---- 6. GEMM2 ----
  std::vector<float> y(static_cast<size_t>(R * H));
  expert_gemm(perm, E, I, H, act.data(), alpha2.data(), weights.w2_bias,
              weight_rows(weights.w2, weights.w2_scale, H, I), y.data());

  // ---- 7. finalize ----
  result.output.resize(static_cast<size_t>(T * H));
  result.output_f32.resize(static_cast<size_t>(T * H));
  finalize(s, perm, result.topk_weights, on_input, y, [&](int64_t i, float v) {
    result.output_f32[i] = v;
    result.output[i] = format::bf16_from_float(v);
  });

  if (trace != nullptr) {
    trace->gemm1_input = unpermute(perm, a, H);
    trace->act_out = unpermute(perm, act, I);
    trace->gemm2_out = unpermute(perm, y, H);
  }
  return result;
}

std::vector<float> moe_forward_fp32(const MoeProblem& problem, int64_t num_tokens,
                                    const uint16_t* hidden, const Routing& routing,
                                    const float* w13, const float* w2) {
  problem.validate();
  check(num_tokens >= 0, "moe_forward_fp32: num_tokens must be >= 0, got ", num_tokens);
  const LayerShape s{num_tokens,        problem.num_experts, problem.hidden, problem.inter,
                     problem.top_k(),   problem.w13_rows(),  problem.gated()};
  const int64_t T = s.T, E = s.E, H = s.H, k = s.k, R = T * k;
  check(!problem.routing.apply_router_weight_on_input || k == 1,
        "moe_forward_fp32: apply_router_weight_on_input needs top_k == 1, got ", k);
  check(w13 != nullptr, "moe_forward_fp32: w13 is null, expected f32 [E, w13_rows, H]");
  check(w2 != nullptr, "moe_forward_fp32: w2 is null, expected f32 [E, H, I]");
  check(static_cast<int64_t>(routing.ids.size()) == R,
        "moe_forward_fp32: routing.ids must hold T * k = ", R, " ids, got ", routing.ids.size());
  check(static_cast<int64_t>(routing.weights.size()) == R,
        "moe_forward_fp32: routing.weights must hold T * k = ", R, " weights, got ",
        routing.weights.size());
  if (T == 0) return {};
  check(hidden != nullptr, "moe_forward_fp32: hidden is null, expected bf16 [T, H] with T = ", T);
  check_ids(routing.ids.data(), T, static_cast<int>(k), E, "moe_forward_fp32", "routing.ids");

  const Permutation perm = permute(routing.ids, E);
  const bool on_input = problem.routing.apply_router_weight_on_input;
  std::vector<float> a(static_cast<size_t>(R * H));
  parallel_chunks(R, 16, [&](int64_t r, int) {
    const int64_t entry = perm.entry_of_row[r], t = entry / k;
    const float w = on_input ? routing.weights[entry] : 1.0f;
    for (int64_t i = 0; i < H; ++i) {
      const float xv = format::bf16_to_float(hidden[t * H + i]);
      a[r * H + i] = on_input ? xv * w : xv;
    }
  });
  const std::vector<float> ones(static_cast<size_t>(E), 1.0f);
  std::vector<float> h(static_cast<size_t>(R * s.N1));
  expert_gemm(perm, E, H, s.N1, a.data(), ones.data(), nullptr, fp32_rows(w13, s.N1, H), h.data());
  std::vector<float> act;
  activation_rows(s, problem.activation, perm, routing.ids, h, act, [](int64_t, int32_t, float*, int) {});
  h = {};
  std::vector<float> y(static_cast<size_t>(R * H));
  expert_gemm(perm, E, s.I, H, act.data(), ones.data(), nullptr, fp32_rows(w2, H, s.I), y.data());
  std::vector<float> out(static_cast<size_t>(T * H));
  finalize(s, perm, routing.weights, on_input, y, [&](int64_t i, float v) { out[i] = v; });
  return out;
}

}  // namespace fp4moe::reference
