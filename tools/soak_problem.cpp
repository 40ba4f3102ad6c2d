// tools/soak_problem.cpp — the random problems of `fp4moe soak` and their check (tools/soak_problem.hpp).
//
// Every draw comes from SplitMix64 streams keyed by (seed, index, purpose), with integer arithmetic of
// our own instead of the standard distributions (whose algorithms the standard leaves open), so a
// problem's parameters are the same on every platform. The data itself is io::make_random_packed_case.
#include "tools/soak_problem.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <sstream>

#include "fp4moe/error.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/safetensors.hpp"
#include "fp4moe/tune.hpp"

namespace fp4moe::soak {
namespace {

uint64_t splitmix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The key of stream `purpose` of problem (seed, index).
uint64_t stream_key(uint64_t seed, int64_t index, uint64_t purpose) {
  return splitmix(splitmix(seed) ^ splitmix(static_cast<uint64_t>(index) * 4 + purpose));
}

class Rng {
 public:
  explicit Rng(uint64_t key) : state_(key) {}
  uint64_t next() { return splitmix(state_++); }
  // Uniform in [lo, hi] (inclusive).
  int64_t uniform(int64_t lo, int64_t hi) {
    const uint64_t span = static_cast<uint64_t>(hi - lo) + 1;
    return lo + static_cast<int64_t>(next() % span);
  }
  double unit() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  bool chance(double p) { return unit() < p; }
  // Log-uniform integer in [lo, hi] (lo >= 1): small values as likely per octave as large ones.
  int64_t log_uniform(int64_t lo, int64_t hi) {
    const double a = std::log(static_cast<double>(lo)), b = std::log(static_cast<double>(hi) + 1.0);
    const int64_t v = static_cast<int64_t>(std::exp(a + (b - a) * unit()));
    return std::clamp(v, lo, hi);
  }

 private:
  uint64_t state_;
};

constexpr RoutingMethod kMethods[] = {RoutingMethod::Default,     RoutingMethod::Renormalize,
                                      RoutingMethod::RenormalizeNaive, RoutingMethod::TopK,
                                      RoutingMethod::Sigmoid,     RoutingMethod::SigmoidRenorm,
                                      RoutingMethod::TopKSigmoid, RoutingMethod::Llama4,
                                      RoutingMethod::DeepSeekV3,  RoutingMethod::Precomputed};
constexpr Activation kActivations[] = {Activation::SwiGLU, Activation::GeGLU, Activation::SwiGLUOai,
                                       Activation::Relu2};
constexpr ActQuant kModes[] = {ActQuant::W4A16, ActQuant::W4A4Scalar, ActQuant::W4A4PerExpert};

// A multiple of 16 in [16, 8192]: log-uniform, half of the time rounded up to a multiple of 128 (the
// GEMMs' K chunk), else ragged.
int64_t draw_dim(Rng& r, int64_t lo_blocks) {
  int64_t d = 16 * r.log_uniform(lo_blocks, 512);
  if (r.chance(0.5)) d = std::min<int64_t>(8192, (d + 127) / 128 * 128);
  return d;
}

int64_t halve16(int64_t d) { return std::max<int64_t>(16, d / 32 * 16); }
int64_t halve32(int64_t d) { return std::max<int64_t>(32, d / 64 * 32); }
int64_t round_up32(int64_t d) { return (d + 31) / 32 * 32; }

// Skewed to small and ragged counts: 3% none, 42% 1..16, 25% 17..256, 18% 257..2048, 9% up to 8192,
// 3% up to 16384; a fifth of them a power of two or one off it.
int64_t draw_tokens(Rng& r) {
  const double u = r.unit();
  int64_t lo = 0, hi = 0;
  if (u < 0.03) return 0;
  if (u < 0.45) lo = 1, hi = 16;
  else if (u < 0.70) lo = 17, hi = 256;
  else if (u < 0.88) lo = 257, hi = 2048;
  else if (u < 0.97) lo = 2049, hi = 8192;
  else lo = 8193, hi = kMaxTokens;
  int64_t t = r.uniform(lo, hi);
  if (r.chance(0.2)) {
    int64_t p = 1;
    while (p * 2 <= t) p *= 2;
    t = std::clamp<int64_t>(p + r.uniform(-1, 1), std::max<int64_t>(lo, 1), hi);
  }
  return t;
}

float draw_decimal(Rng& r, int64_t lo_eighths, int64_t hi_eighths) {
  return static_cast<float>(r.uniform(lo_eighths, hi_eighths)) / 8.0f;
}

bool is_invalid_id(int32_t id, int64_t E) { return id < 0 || id >= E; }

float bf16_ulp(float x) {
  const float a = std::fabs(x);
  if (a < 1e-30f) return 1e-30f;
  int exp = 0;
  std::frexp(a, &exp);  // a = m * 2^exp, m in [0.5, 1)
  return std::ldexp(1.0f, exp - 8);
}

bool precomputed_with_bad_ids(const io::MoeCase& c) {
  return c.problem.routing.method == RoutingMethod::Precomputed && !c.problem.routing.skip_foreign_ids &&
         !tokens_with_invalid_ids(c).empty();
}

}  // namespace

int64_t weight_bytes(const MoeProblem& p) {
  const int64_t elems = p.num_experts * (p.w13_rows() * p.hidden + p.hidden * p.inter);
  return elems / 2 + elems / p.weight_block();
}

std::string SoakProblem::describe() const {
  std::ostringstream os;
  os << "seed " << seed << " problem " << index << ": T=" << num_tokens << " " << problem.describe()
     << " tactic=" << (tactic ? fp4moe::describe(*tactic) : std::string("heuristic"));
  if (expert_biases) os << " expert_biases";
  if (routing_bias) os << " routing_bias";
  if (problem.routing.method != RoutingMethod::Precomputed) {
    os << " logits=" << (logits == LogitKind::Normal ? "normal" : logits == LogitKind::Ties ? "ties" : "all_equal")
       << (bf16_logits ? "/bf16" : "");
  }
  if (nan_hidden_tokens + inf_hidden_tokens > 0)
    os << " hidden_poison(nan=" << nan_hidden_tokens << ",inf=" << inf_hidden_tokens << ")";
  if (nan_logit_tokens + inf_logit_tokens > 0)
    os << " logit_poison(nan=" << nan_logit_tokens << ",inf=" << inf_logit_tokens << ")";
  if (invalid_id_tokens > 0) os << " invalid_id_tokens=" << invalid_id_tokens;
  os << " weights=" << weight_bytes(problem) << "B";
  return os.str();
}

SoakProblem make_problem(uint64_t seed, int64_t index) {
  check(index >= 0, "soak: problem index must be >= 0, got ", index);
  Rng r(stream_key(seed, index, 0));
  SoakProblem sp;
  sp.seed = seed;
  sp.index = index;
  MoeProblem& p = sp.problem;

  // ---- kinds ----
  p.routing.method = kMethods[r.uniform(0, 9)];
  p.activation.kind = kActivations[r.uniform(0, 3)];
  p.act_quant = kModes[r.uniform(0, 2)];
  if (p.activation.kind == Activation::SwiGLUOai && r.chance(0.5)) {
    p.activation.swiglu_alpha = draw_decimal(r, 8, 16);   // 1 .. 2
    p.activation.swiglu_beta = draw_decimal(r, 0, 12);    // 0 .. 1.5
    p.activation.swiglu_limit = draw_decimal(r, 24, 80);  // 3 .. 10
  }

  // ---- sizes ----
  sp.large = r.chance(0.02);
  const int64_t budget = sp.large ? kLargeWeightBytes : kSmallWeightBytes;
  if (sp.large) {
    p.num_experts = r.log_uniform(8, 512);
    p.hidden = draw_dim(r, 64);  // >= 1024
    p.inter = draw_dim(r, 32);
  } else {
    p.num_experts = r.log_uniform(1, 512);
    p.hidden = draw_dim(r, 1);
    p.inter = draw_dim(r, 1);
  }
  while (weight_bytes(p) > budget) {  // shrink a random one of E, H, I (never below its minimum)
    const int64_t which = r.uniform(0, 2);
    if (which == 0 && p.num_experts > 1) p.num_experts = p.num_experts / 2;
    else if (which == 1 && p.hidden > 16) p.hidden = halve16(p.hidden);
    else if (p.inter > 16) p.inter = halve16(p.inter);
    else if (p.hidden > 16) p.hidden = halve16(p.hidden);
    else p.num_experts = std::max<int64_t>(1, p.num_experts / 2);
  }

  // ---- weight format ----
  // NOTE: drawn from a stream of its own and applied only to the MXFP4 share, so that every NVFP4 problem
  // is the one the seed gave before MXFP4 problems existed. MXFP4: w4a16, H and I multiples of 32; the
  // random cases' ue8m0 codes span 7 powers of two per expert (within the kernels' 18).
  Rng fr(splitmix(stream_key(seed, index, 0) ^ 0x6D78667034ull));
  if (fr.chance(kMxfp4Share)) {
    p.weight_format = WeightFormat::MXFP4;
    p.act_quant = ActQuant::W4A16;
    p.hidden = round_up32(p.hidden);  // <= 8192 still
    p.inter = round_up32(p.inter);
    while (weight_bytes(p) > budget) {
      const int64_t which = fr.uniform(0, 2);
      if (which == 0 && p.num_experts > 1) p.num_experts = p.num_experts / 2;
      else if (which == 1 && p.hidden > 32) p.hidden = halve32(p.hidden);
      else if (p.inter > 32) p.inter = halve32(p.inter);
      else if (p.hidden > 32) p.hidden = halve32(p.hidden);
      else p.num_experts = std::max<int64_t>(1, p.num_experts / 2);
    }
  }
  const int64_t E = p.num_experts;

  // ---- routing ----
  RoutingParams& rp = p.routing;
  rp.top_k = static_cast<int>(r.log_uniform(1, std::min<int64_t>(E, 32)));
  if (rp.method == RoutingMethod::Llama4) rp.top_k = 1;
  if (rp.method == RoutingMethod::DeepSeekV3) {
    std::vector<int> groups;  // n_group: divides E, >= 2 experts per group unless 1, at most kMaxRoutingGroups
    for (int64_t g = 1; g <= std::min<int64_t>(E, kMaxRoutingGroups); ++g)
      if (E % g == 0 && (g == 1 || E / g >= 2)) groups.push_back(static_cast<int>(g));
    rp.n_group = groups[r.uniform(0, static_cast<int64_t>(groups.size()) - 1)];
    rp.topk_group = static_cast<int>(r.uniform(1, rp.n_group));
    rp.top_k = static_cast<int>(std::min<int64_t>(rp.top_k, int64_t(rp.topk_group) * (E / rp.n_group)));
    rp.routed_scaling_factor = draw_decimal(r, 4, 24);  // 0.5 .. 3
    sp.routing_bias = r.chance(0.8);
  }
  if (rp.top_k == 1) rp.apply_router_weight_on_input = r.chance(rp.method == RoutingMethod::Llama4 ? 0.7 : 0.2);

  // ---- tokens and inputs ----
  sp.num_tokens = draw_tokens(r);
  // GPU workspace: T * k rows of max(w13_rows, H) (a1, act, y) stay under 2^30 elements.
  const int64_t row = std::max(p.w13_rows(), p.hidden) * rp.top_k;
  sp.num_tokens = std::min(sp.num_tokens, (int64_t(1) << 30) / row);
  const int64_t T = sp.num_tokens;
  const bool precomputed = rp.method == RoutingMethod::Precomputed;
  if (precomputed) {
    if (T > 0 && r.chance(0.3)) sp.invalid_id_tokens = r.uniform(1, std::min<int64_t>(T, 8));
    rp.skip_foreign_ids = r.chance(sp.invalid_id_tokens > 0 ? 0.5 : 0.15);
    if (rp.skip_foreign_ids && r.chance(0.5)) rp.total_experts = E * r.uniform(2, 8);
  } else {
    const double u = r.unit();
    sp.logits = u < 0.6 ? LogitKind::Normal : u < 0.9 ? LogitKind::Ties : LogitKind::AllEqual;
    sp.bf16_logits = r.chance(0.3);
  }
  if (T > 0 && r.chance(0.12)) {  // poisoned tokens, at most T of them in all
    int64_t left = T - sp.invalid_id_tokens;
    auto take = [&](int64_t most) {
      const int64_t n = std::min(left, r.uniform(0, most));
      left -= n;
      return n;
    };
    sp.nan_hidden_tokens = take(3);
    sp.inf_hidden_tokens = take(2);
    if (!precomputed) {
      sp.nan_logit_tokens = take(3);
      sp.inf_logit_tokens = take(2);
    }
  }
  sp.expert_biases = r.chance(0.25);

  // ---- tactic ----
  if (r.chance(0.75)) {
    const std::vector<MoeTactic> tactics = candidate_tactics(p);
    sp.tactic = tactics[r.uniform(0, static_cast<int64_t>(tactics.size()) - 1)];
  }
  p.validate();
  return sp;
}

io::MoeCase make_case(const SoakProblem& sp) {
  const MoeProblem& p = sp.problem;
  const int64_t T = sp.num_tokens, E = p.num_experts, H = p.hidden, k = p.top_k();
  io::MoeCase c = io::make_random_packed_case(p, T, stream_key(sp.seed, sp.index, 1));
  Rng r(stream_key(sp.seed, sp.index, 2));
  if (!sp.routing_bias) c.routing_bias.clear();
  if (p.routing.method != RoutingMethod::Precomputed) {
    for (int64_t t = 0; t < T; ++t) {
      float* row = c.router_logits.data() + t * E;
      for (int64_t e = 0; e < E; ++e) {
        if (sp.logits == LogitKind::Ties) row[e] = std::round(row[e] * 2.0f) / 2.0f;
        if (sp.logits == LogitKind::AllEqual) row[e] = row[0];
        if (sp.bf16_logits) row[e] = format::bf16_to_float(format::bf16_from_float(row[e]));
      }
    }
    c.router_logits_bf16 = sp.bf16_logits;
  }
  if (sp.expert_biases) io::add_random_expert_biases(c, stream_key(sp.seed, sp.index, 3));

  // Distinct tokens for the poisoned inputs and the invalid ids (a partial shuffle).
  const int64_t special = sp.nan_hidden_tokens + sp.inf_hidden_tokens + sp.nan_logit_tokens + sp.inf_logit_tokens +
                          sp.invalid_id_tokens;
  check(special <= T, "soak: ", sp.describe(), ": more special tokens than tokens");
  std::vector<int64_t> order(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) order[t] = t;
  for (int64_t i = 0; i < special; ++i) std::swap(order[i], order[r.uniform(i, T - 1)]);
  int64_t next = 0;
  const float inf = std::numeric_limits<float>::infinity();
  auto poison_hidden = [&](int64_t n, bool nan) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = order[next++];
      const uint16_t bits = nan ? 0x7FC0 : (r.chance(0.5) ? 0x7F80 : 0xFF80);
      c.hidden_states[t * H + r.uniform(0, H - 1)] = bits;
    }
  };
  auto poison_logit = [&](int64_t n, bool nan) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = order[next++];
      c.router_logits[t * E + r.uniform(0, E - 1)] =
          nan ? std::numeric_limits<float>::quiet_NaN() : (r.chance(0.5) ? inf : -inf);
    }
  };
  poison_hidden(sp.nan_hidden_tokens, true);
  poison_hidden(sp.inf_hidden_tokens, false);
  poison_logit(sp.nan_logit_tokens, true);
  poison_logit(sp.inf_logit_tokens, false);
  for (int64_t i = 0; i < sp.invalid_id_tokens; ++i) {
    const int64_t t = order[next++];
    const int32_t bad[] = {-1, static_cast<int32_t>(E), static_cast<int32_t>(E + 7), -1000,
                           std::numeric_limits<int32_t>::max()};
    c.topk_ids[t * k + r.uniform(0, k - 1)] = bad[r.uniform(0, 4)];
  }
  return c;
}

std::vector<int64_t> tokens_with_invalid_ids(const io::MoeCase& c) {
  std::vector<int64_t> out;
  if (c.problem.routing.method != RoutingMethod::Precomputed) return out;
  const int64_t k = c.problem.top_k();
  for (int64_t t = 0; t < c.num_tokens; ++t)
    for (int64_t j = 0; j < k; ++j)
      if (is_invalid_id(c.topk_ids[t * k + j], c.problem.num_experts)) {
        out.push_back(t);
        break;
      }
  return out;
}

std::vector<int64_t> reference_tokens(const SoakProblem& sp, const io::MoeCase& c) {
  const MoeProblem& p = c.problem;
  const int64_t T = c.num_tokens, H = p.hidden, E = p.num_experts;
  const double per_token = double(p.top_k()) * double(p.w13_rows() * H + H * p.inter);
  const int64_t n = std::clamp<int64_t>(static_cast<int64_t>(4e9 / per_token), 16, std::max<int64_t>(T, 16));
  std::vector<int64_t> all(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) all[t] = t;
  if (n >= T) return all;
  std::vector<char> pick(static_cast<size_t>(T), 0);
  pick[0] = pick[T - 1] = 1;
  for (int64_t t = 0; t < T; ++t) {
    bool special = false;
    for (int64_t h = 0; h < H && !special; ++h) {
      const uint16_t b = c.hidden_states[t * H + h];
      special = (b & 0x7F80) == 0x7F80;  // inf or NaN
    }
    for (int64_t e = 0; e < E && !special && !c.router_logits.empty(); ++e)
      special = !std::isfinite(c.router_logits[t * E + e]);
    if (special) pick[t] = 1;
  }
  for (int64_t t : tokens_with_invalid_ids(c)) pick[t] = 1;
  int64_t have = std::count(pick.begin(), pick.end(), 1);
  Rng r(stream_key(sp.seed, sp.index, 3) ^ 0x5A5A5A5Aull);
  while (have < n) {
    const int64_t t = r.uniform(0, T - 1);
    if (!pick[t]) pick[t] = 1, ++have;
  }
  std::vector<int64_t> out;
  for (int64_t t = 0; t < T; ++t)
    if (pick[t]) out.push_back(t);
  return out;
}

Outcome reference_outcome(const io::MoeCase& c, const std::vector<int64_t>& tokens, bool with_slack) {
  MoeProblem p = c.problem;
  const int64_t E = p.num_experts, H = p.hidden, k = p.top_k(), n = static_cast<int64_t>(tokens.size());
  const bool precomputed = p.routing.method == RoutingMethod::Precomputed;
  if (precomputed_with_bad_ids(c)) p.routing.skip_foreign_ids = true;
  std::vector<uint16_t> hidden(static_cast<size_t>(n * H));
  std::vector<float> logits, weights;
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = tokens[i];
    std::copy_n(c.hidden_states.begin() + t * H, H, hidden.begin() + i * H);
    if (precomputed) {
      ids.insert(ids.end(), c.topk_ids.begin() + t * k, c.topk_ids.begin() + (t + 1) * k);
      weights.insert(weights.end(), c.topk_weights.begin() + t * k, c.topk_weights.begin() + (t + 1) * k);
    } else {
      logits.insert(logits.end(), c.router_logits.begin() + t * E, c.router_logits.begin() + (t + 1) * E);
    }
  }
  reference::RouterInput router;
  if (precomputed) {
    router.topk_ids = ids.data();
    router.topk_weights = weights.data();
  } else {
    router.logits = logits.data();
    router.bias = c.routing_bias.empty() ? nullptr : c.routing_bias.data();
  }
  Outcome o;
  try {
    reference::MoeTrace trace;
    o.result = reference::moe_forward(p, n, hidden.data(), router, c.weights(), with_slack ? &trace : nullptr);
    if (with_slack) o.slack = reference::output_rounding_slack(p, c.weights(), o.result, trace);
  } catch (const Error& e) {
    o.refused = true;
    o.message = e.what();
  }
  return o;
}

std::string compare_outputs(const std::vector<uint16_t>& tested, const std::vector<uint16_t>& ref, int64_t rows,
                            int64_t H, const std::vector<float>& slack) {
  if (tested.size() != ref.size() || static_cast<int64_t>(ref.size()) != rows * H)
    return detail::concat("output has ", tested.size(), " elements, the reference ", ref.size(), " (rows ", rows,
                          " x H ", H, ")");
  if (!slack.empty() && slack.size() != ref.size())
    return detail::concat("rounding slack has ", slack.size(), " elements, the output ", ref.size());
  double num = 0, den = 0;
  int64_t off = 0, finite = 0;
  for (int64_t t = 0; t < rows; ++t) {
    double row_sq = 0;
    int64_t row_n = 0;
    for (int64_t h = 0; h < H; ++h) {
      const float r = format::bf16_to_float(ref[t * H + h]);
      if (std::isfinite(r)) row_sq += double(r) * r, ++row_n;
    }
    // Absolute floor: results that nearly cancel move by more than their own ulp when a rounding of
    // the activation flips; 1e-3 of the row's RMS covers that (docs/numerics.md, "The whole layer").
    const float floor = row_n > 0 ? 1e-3f * static_cast<float>(std::sqrt(row_sq / row_n)) : 0.0f;
    for (int64_t h = 0; h < H; ++h) {
      const float r = format::bf16_to_float(ref[t * H + h]), g = format::bf16_to_float(tested[t * H + h]);
      if (std::isnan(r)) {
        if (!std::isnan(g)) return detail::concat("output row ", t, " column ", h, ": ", g, " where the reference has NaN");
        continue;
      }
      if (std::isinf(r)) {
        if (g != r) return detail::concat("output row ", t, " column ", h, ": ", g, " where the reference has ", r);
        continue;
      }
      if (std::isnan(g)) return detail::concat("output row ", t, " column ", h, ": NaN where the reference has ", r);
      ++finite;
      num += double(g - r) * (g - r);
      den += double(r) * r;
      const float allowed = bf16_ulp(r) * 1.01f + floor + (slack.empty() ? 0.0f : slack[t * H + h]);
      if (std::fabs(g - r) > allowed) ++off;
    }
  }
  const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  if (!(rel < 5e-3)) return detail::concat("output relative L2 error ", rel, " (bound 5e-3)");
  if (off > static_cast<int64_t>(0.005 * finite) + 1)
    return detail::concat("output: ", off, " of ", finite, " finite elements beyond 1 bf16 ulp + 1e-3 row RMS",
                          slack.empty() ? std::string() : detail::concat(" + rounding slack (on ",
                              std::count_if(slack.begin(), slack.end(), [](float v) { return v > 0.0f; }), " elements)"),
                          " (at most ", static_cast<int64_t>(0.005 * finite) + 1, ")");
  return {};
}

std::string check_outcome(const io::MoeCase& c, const std::vector<int64_t>& tokens, const Outcome& ref,
                          const Outcome& tested, bool bad_id_rows_nan) {
  if (ref.refused) {
    if (!tested.refused) return "accepted a call that the reference refuses: " + ref.message;
    if (tested.message != ref.message)
      return "refused with another message than the reference's: '" + tested.message + "' (reference: '" +
             ref.message + "')";
    return {};
  }
  const bool bad_ids = precomputed_with_bad_ids(c);
  if (bad_ids && !bad_id_rows_nan)
    return tested.refused ? std::string() : "accepted expert ids outside [0, E) that the reference refuses";
  if (tested.refused) return "refused a call that the reference accepts: " + tested.message;

  const MoeProblem& p = c.problem;
  const int64_t T = c.num_tokens, H = p.hidden, k = p.top_k(), n = static_cast<int64_t>(tokens.size());
  const reference::MoeResult& g = tested.result;
  const reference::MoeResult& r = ref.result;
  if (static_cast<int64_t>(g.output.size()) != T * H || static_cast<int64_t>(g.topk_ids.size()) != T * k ||
      static_cast<int64_t>(g.topk_weights.size()) != T * k)
    return detail::concat("result sizes output ", g.output.size(), " ids ", g.topk_ids.size(), " weights ",
                          g.topk_weights.size(), ", expected T*H = ", T * H, " and T*k = ", T * k);
  std::vector<char> bad(static_cast<size_t>(T), 0);
  if (bad_ids)
    for (int64_t t : tokens_with_invalid_ids(c)) bad[t] = 1;
  std::vector<uint16_t> rows_tested, rows_ref;
  std::vector<int64_t> kept_rows;  // the reference rows compared
  rows_tested.reserve(static_cast<size_t>(n * H));
  rows_ref.reserve(static_cast<size_t>(n * H));
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = tokens[i];
    for (int64_t j = 0; j < k; ++j) {
      const int32_t gi = g.topk_ids[t * k + j], ri = r.topk_ids[i * k + j];
      if (gi != ri) return detail::concat("topk_ids[", t, ", ", j, "] = ", gi, ", the reference's ", ri);
      const float gw = g.topk_weights[t * k + j], rw = r.topk_weights[i * k + j];
      // NOTE: an infinite logit gives an infinite weight (topk: the raw logit), equal only to itself.
      const bool same = std::isnan(rw)   ? std::isnan(gw)
                        : std::isinf(rw) ? gw == rw
                                         : std::fabs(gw - rw) <= 1e-6 * std::fabs(rw) + 1e-30;
      if (!same) return detail::concat("topk_weights[", t, ", ", j, "] = ", gw, ", the reference's ", rw);
    }
    if (bad[t]) {  // an id outside [0, E): the whole row NaN
      for (int64_t h = 0; h < H; ++h)
        if (!std::isnan(format::bf16_to_float(g.output[t * H + h])))
          return detail::concat("output row ", t, " (an expert id outside [0, E)) column ", h, " is ",
                                format::bf16_to_float(g.output[t * H + h]), ", expected NaN");
      continue;
    }
    rows_tested.insert(rows_tested.end(), g.output.begin() + t * H, g.output.begin() + (t + 1) * H);
    rows_ref.insert(rows_ref.end(), r.output.begin() + i * H, r.output.begin() + (i + 1) * H);
    kept_rows.push_back(i);
    ++kept;
  }
  auto slack_rows = [&](const std::vector<float>& slack) {
    std::vector<float> rows;
    rows.reserve(static_cast<size_t>(kept * H));
    for (const int64_t i : kept_rows) rows.insert(rows.end(), slack.begin() + i * H, slack.begin() + (i + 1) * H);
    return rows;
  };
  std::string m = compare_outputs(rows_tested, rows_ref, kept, H, ref.slack.empty() ? std::vector<float>{} : slack_rows(ref.slack));
  if (!m.empty() && ref.slack.empty()) {
    // NOTE: the slack costs most of a reference run, and only outputs the check without it refuses need it.
    const Outcome again = reference_outcome(c, tokens, true);
    if (!again.refused && again.result.output == r.output) m = compare_outputs(rows_tested, rows_ref, kept, H, slack_rows(again.slack));
  }
  return m.empty() ? m : m + " (over " + std::to_string(kept) + " reference rows)";
}

void save_problem_case(const std::string& path, const SoakProblem& sp, const io::MoeCase& c) {
  const std::string tmp = path + ".tmp";
  io::save_case(tmp, c);
  std::vector<io::TensorData> tensors;
  std::map<std::string, std::string> meta;
  {
    const io::SafetensorsFile f = io::SafetensorsFile::open(tmp);
    meta = f.metadata();
    for (const auto& [name, view] : f.tensors()) {
      io::TensorData t{name, view.dtype, view.shape, {}};
      t.bytes.assign(view.data.begin(), view.data.end());
      tensors.push_back(std::move(t));
    }
  }
  meta["soak_seed"] = std::to_string(sp.seed);
  meta["soak_index"] = std::to_string(sp.index);
  meta["soak_tactic"] = sp.tactic ? describe(*sp.tactic) : "heuristic";
  meta["soak_skip_foreign_ids"] = sp.problem.routing.skip_foreign_ids ? "1" : "0";
  meta["soak_total_experts"] = std::to_string(sp.problem.routing.total_experts);
  meta["soak_problem"] = sp.describe();
  io::write_safetensors(tmp, tensors, meta);
  std::filesystem::rename(tmp, path);
}

}  // namespace fp4moe::soak
