// tests/kernels/route_test.cu — launch_route against reference::route (docs/numerics.md, "Routing methods").
//
// Every routing method, E in {8, 16, 128, 256, 512}, k in {1, 2, 4, 8, 32} (k <= E), fp32 and bf16
// logits, logits with exact ties, NaN logits, DeepSeekV3 with and without groups, T from 0 to 8193.
// Outputs are poisoned before each launch; ids must be identical, weights within 1e-6 relative.
// Where launch_route_permute applies (route_permute_fits: T * k <= 256, T <= 16), every case also runs
// it and compares its routing and permutation with launch_route then launch_permute, bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "fp4moe/format.hpp"
#include "fp4moe/problem.hpp"
#include "fp4moe/reference.hpp"
#include "kernels/gpu_test_util.hpp"
#include "kernels/launch.hpp"
#include "kernels/permute_buffers.hpp"

namespace fp4moe {
namespace {

using test::DeviceBuffer;

enum class LogitKind { Normal, Ties, WithNan, AllEqual };

struct RouteCase {
  RoutingParams params;
  int T = 1;
  int E = 8;
  bool bf16 = false;
  bool with_bias = false;
  LogitKind kind = LogitKind::Normal;
  uint64_t seed = 1;
  int quant_hidden = 0;  // > 0: also quantize a random hidden [T, quant_hidden] (RouteArgs::quant_out)

  std::string describe() const {
    std::ostringstream os;
    os << to_string(params.method) << " T=" << T << " E=" << E << " k=" << params.top_k
       << " n_group=" << params.n_group << " topk_group=" << params.topk_group
       << " scale=" << params.routed_scaling_factor << (bf16 ? " bf16" : " f32")
       << (with_bias ? " bias" : "") << " kind=" << static_cast<int>(kind) << " seed=" << seed
       << " quant_hidden=" << quant_hidden;
    return os.str();
  }
};

bool weight_close(float got, float want) {
  if (std::isnan(want)) return std::isnan(got);
  if (got == want) return true;
  return std::fabs(static_cast<double>(got) - want) <= 1e-6 * std::fabs(static_cast<double>(want));
}

// The permutation outputs of one launch (launch_permute or launch_route_permute), poisoned first; two
// zero_words ranges set to non-zero words that the launch must clear.
struct PermuteOutputs : test::PermuteBuffers {
  DeviceBuffer<int32_t> words;

  PermuteOutputs(const int32_t* ids, int T, int k, int E, int tile_rows)
      : test::PermuteBuffers(ids, T, k, E, tile_rows, 0xA5) {
    words.allocate(40);
    words.poison(0xA5);
    args.zero_words[0] = words.get();
    args.zero_count[0] = 25;
    args.zero_words[2] = words.get() + 30;
    args.zero_count[2] = 7;
  }
  bool ok() const { return test::PermuteBuffers::ok() && words.ok(); }
  // Every array, in a fixed order (the whole buffers: poison past the written part must match too).
  std::vector<std::vector<int32_t>> download() const {
    return {offsets.download(),     row_to_entry.download(),   entry_to_row.download(), tile_expert.download(),
            tile_row_start.download(), num_tiles.download(), words.download()};
  }
};

// launch_route_permute against launch_route then launch_permute on the route's ids (`args`, already
// run by run_case; `ids`, `w`, `quant` its outputs): every output bit for bit, both tile heights.
void check_route_permute(const RouteCase& c, const kernels::RouteArgs& args, const std::vector<int32_t>& ids,
                         const std::vector<float>& w, const std::vector<uint16_t>& quant) {
  const int k = c.params.top_k;
  for (int tile_rows : {16, 32}) {
    SCOPED_TRACE(testing::Message() << "route_permute, tile_rows=" << tile_rows);
    PermuteOutputs separate(args.topk_ids, c.T, k, c.E, tile_rows);
    ASSERT_TRUE(separate.ok());
    CUDA_ASSERT(kernels::launch_permute(separate.args, nullptr));

    DeviceBuffer<int32_t> d_ids(ids.size());
    DeviceBuffer<float> d_w(w.size());
    DeviceBuffer<uint16_t> d_quant(quant.size());
    ASSERT_TRUE(d_ids.ok() && d_w.ok() && d_quant.ok());
    d_ids.poison();
    d_w.poison();
    d_quant.poison();
    kernels::RouteArgs fused = args;
    fused.topk_ids = d_ids.get();
    fused.topk_weights = d_w.get();
    if (args.quant_out != nullptr) fused.quant_out = reinterpret_cast<__nv_bfloat16*>(d_quant.get());
    PermuteOutputs one_launch(d_ids.get(), c.T, k, c.E, tile_rows);
    ASSERT_TRUE(one_launch.ok());
    CUDA_ASSERT(kernels::launch_route_permute(fused, one_launch.args, nullptr));
    CUDA_ASSERT(cudaDeviceSynchronize());

    EXPECT_EQ(d_ids.download(), ids);
    const std::vector<float> got_w = d_w.download();
    ASSERT_EQ(got_w.size(), w.size());
    for (size_t i = 0; i < w.size(); ++i)
      EXPECT_EQ(test::float_bits(got_w[i]), test::float_bits(w[i])) << "weight " << i;
    if (args.quant_out != nullptr) EXPECT_EQ(d_quant.download(), quant);
    const auto want = separate.download(), got = one_launch.download();
    const char* names[] = {"expert_offsets", "row_to_entry", "entry_to_row", "tile_expert", "tile_row_start",
                           "num_tiles", "zero_words"};
    for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(got[i], want[i]) << names[i];
    const std::vector<int32_t> words = got.back();
    for (int i = 0; i < 25; ++i) EXPECT_EQ(words[i], 0) << "zero_words[0][" << i << "]";
    EXPECT_NE(words[27], 0) << "a word outside the ranges was written";
  }
}

// Runs one case and checks it; returns false after the first reported mismatch batch.
void run_case(const RouteCase& c) {
  SCOPED_TRACE(c.describe());
  std::mt19937_64 rng(c.seed);
  const int64_t n = static_cast<int64_t>(c.T) * c.E;
  std::vector<float> logits(n);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::uniform_int_distribution<int> small(-4, 4);
  for (int64_t i = 0; i < n; ++i) {
    switch (c.kind) {
      case LogitKind::Normal: logits[i] = normal(rng); break;
      case LogitKind::Ties: logits[i] = 0.5f * static_cast<float>(small(rng)); break;  // many exact ties
      case LogitKind::AllEqual: logits[i] = 0.25f; break;
      case LogitKind::WithNan:
        logits[i] = (rng() % 7 == 0) ? std::nanf("") : (rng() % 11 == 0 ? -INFINITY : normal(rng));
        break;
    }
    if (c.kind == LogitKind::Ties && rng() % 13 == 0) logits[i] = -0.0f;  // -0 ties +0
  }
  std::vector<uint16_t> logits_bf16;
  if (c.bf16) {
    logits_bf16.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      logits_bf16[i] = format::bf16_from_float(logits[i]);
      logits[i] = format::bf16_to_float(logits_bf16[i]);  // the CPU sees the widened values
    }
  }
  std::vector<float> bias;
  if (c.with_bias) {
    bias.resize(c.E);
    for (int e = 0; e < c.E; ++e)
      bias[e] = c.kind == LogitKind::Ties || c.kind == LogitKind::AllEqual ? 0.125f * static_cast<float>(e % 3)
                                                                          : 0.1f * normal(rng);
  }
  const reference::Routing want =
      reference::route(c.params, c.T, c.E, logits.data(), c.with_bias ? bias.data() : nullptr);

  const int k = c.params.top_k;
  DeviceBuffer<float> d_logits_f32;
  DeviceBuffer<uint16_t> d_logits_bf16;
  if (c.bf16) d_logits_bf16 = DeviceBuffer<uint16_t>(logits_bf16);
  else d_logits_f32 = DeviceBuffer<float>(logits);
  DeviceBuffer<float> d_bias;
  if (c.with_bias) d_bias = DeviceBuffer<float>(bias);
  DeviceBuffer<int32_t> d_ids(static_cast<size_t>(c.T) * k);
  DeviceBuffer<float> d_w(static_cast<size_t>(c.T) * k);
  ASSERT_TRUE(d_ids.ok() && d_w.ok() && d_logits_f32.ok() && d_logits_bf16.ok() && d_bias.ok());
  d_ids.poison();
  d_w.poison();

  kernels::RouteArgs args;
  args.logits = c.bf16 ? static_cast<const void*>(d_logits_bf16.get()) : d_logits_f32.get();
  args.logits_bf16 = c.bf16;
  args.bias = c.with_bias ? d_bias.get() : nullptr;
  args.num_tokens = c.T;
  args.num_experts = c.E;
  args.params = c.params;
  args.topk_ids = d_ids.get();
  args.topk_weights = d_w.get();
  // quant_hidden: random bf16 rows with varied magnitudes; the quantized rows must be the CPU codec's
  // q * sf values (format::quantize_nvfp4 then dequantize_nvfp4 without the global scale), bit for bit.
  const int64_t H = c.quant_hidden;
  std::vector<uint16_t> hidden_bits(static_cast<size_t>(std::max<int64_t>(c.T * H, 1)));
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_int_distribution<int> expo(-6, 6);
  for (auto& b : hidden_bits) b = format::bf16_from_float(std::ldexp(unit(rng), expo(rng)));
  const std::vector<float> input_scale = {0.0137f};
  DeviceBuffer<uint16_t> d_hidden(hidden_bits), d_quant(hidden_bits.size());
  DeviceBuffer<float> d_scale(input_scale);
  if (H > 0) {
    ASSERT_TRUE(d_hidden.ok() && d_quant.ok() && d_scale.ok());
    d_quant.poison();
    args.quant_out = reinterpret_cast<__nv_bfloat16*>(d_quant.get());
    args.hidden = reinterpret_cast<const __nv_bfloat16*>(d_hidden.get());
    args.hidden_size = static_cast<int>(H);
    args.input_scale = d_scale.get();
  }
  CUDA_ASSERT(kernels::launch_route(args, nullptr));
  CUDA_ASSERT(cudaDeviceSynchronize());
  if (H > 0) {
    const std::vector<uint16_t> got = d_quant.download();
    std::vector<float> row(static_cast<size_t>(H)), deq(static_cast<size_t>(H));
    std::vector<uint8_t> packed(static_cast<size_t>(H / 2)), sf(static_cast<size_t>(H / 16));
    int64_t wrong = 0;
    for (int64_t t = 0; t < c.T; ++t) {
      for (int64_t i = 0; i < H; ++i) row[i] = format::bf16_to_float(hidden_bits[t * H + i]);
      format::quantize_nvfp4(row.data(), 1, H, input_scale[0], packed.data(), sf.data());
      format::dequantize_nvfp4(packed.data(), sf.data(), 1, H, deq.data());
      for (int64_t i = 0; i < H; ++i)
        if (got[t * H + i] != format::bf16_from_float(deq[i]) && wrong++ < 8)
          ADD_FAILURE() << "quantized token " << t << " element " << i << ": got bits " << got[t * H + i]
                        << ", want " << format::bf16_from_float(deq[i]);
    }
    EXPECT_EQ(wrong, 0);
  }

  const std::vector<int32_t> ids = d_ids.download();
  const std::vector<float> w = d_w.download();
  if (kernels::route_permute_fits(c.params, c.T))
    check_route_permute(c, args, ids, w, H > 0 ? d_quant.download() : std::vector<uint16_t>{});
  int reported = 0;
  for (size_t i = 0; i < ids.size() && reported < 8; ++i) {
    if (ids[i] != want.ids[i] || !weight_close(w[i], want.weights[i])) {
      ADD_FAILURE() << "token " << i / k << " slot " << i % k << ": got id " << ids[i] << " w "
                    << w[i] << ", want id " << want.ids[i] << " w " << want.weights[i];
      ++reported;
    }
  }
}

RoutingParams params_of(RoutingMethod m, int k, int n_group = 1, int topk_group = 1, float scale = 1.0f) {
  RoutingParams p;
  p.method = m;
  p.top_k = k;
  p.n_group = n_group;
  p.topk_group = topk_group;
  p.routed_scaling_factor = scale;
  return p;
}

// The two routing shapes the decode presets use most: Renormalize top-8 of 128 (qwen3) and DeepSeek-R1's
// DeepSeekV3 routing (top-8 of 256 in 8 groups, 4 kept, bias, scale 2.5).
RouteCase renormalize_128_case(int T, uint64_t seed) {
  RouteCase c;
  c.params = params_of(RoutingMethod::Renormalize, 8);
  c.E = 128;
  c.T = T;
  c.seed = seed;
  return c;
}
RouteCase deepseek_r1_case(int T, uint64_t seed) {
  RouteCase c;
  c.params = params_of(RoutingMethod::DeepSeekV3, 8, 8, 4, 2.5f);
  c.E = 256;
  c.T = T;
  c.with_bias = true;
  c.seed = seed;
  return c;
}

constexpr RoutingMethod kPlainMethods[] = {
    RoutingMethod::Default,     RoutingMethod::Renormalize,   RoutingMethod::RenormalizeNaive,
    RoutingMethod::TopK,        RoutingMethod::Sigmoid,       RoutingMethod::SigmoidRenorm,
    RoutingMethod::TopKSigmoid};
constexpr int kExperts[] = {8, 16, 128, 256, 512};
constexpr int kTopK[] = {1, 2, 4, 8, 32};
constexpr int kTokens[] = {1, 3, 17, 255, 1000};

TEST(RouteKernel, EveryPlainMethodAndShape) {
  FP4MOE_REQUIRE_SM90();
  uint64_t seed = 100;
  int shape = 0;
  for (RoutingMethod m : kPlainMethods)
    for (int E : kExperts)
      for (int k : kTopK) {
        if (k > E) continue;
        for (bool bf16 : {false, true}) {
          RouteCase c;
          c.params = params_of(m, k);
          c.E = E;
          c.T = kTokens[shape++ % 5];
          c.bf16 = bf16;
          c.seed = ++seed;
          run_case(c);
        }
      }
}

TEST(RouteKernel, ExactTiesGoToTheLowerId) {
  FP4MOE_REQUIRE_SM90();
  uint64_t seed = 200;
  for (RoutingMethod m : kPlainMethods)
    for (int E : {8, 128, 512})
      for (int k : {1, 4, 32}) {
        if (k > E) continue;
        for (LogitKind kind : {LogitKind::Ties, LogitKind::AllEqual}) {
          RouteCase c;
          c.params = params_of(m, k);
          c.E = E;
          c.T = 64;
          c.bf16 = (seed % 2) == 0;
          c.kind = kind;
          c.seed = ++seed;
          run_case(c);
        }
      }
}

TEST(RouteKernel, NanLogitsRankLast) {
  FP4MOE_REQUIRE_SM90();
  uint64_t seed = 300;
  for (RoutingMethod m : kPlainMethods)
    for (int E : {16, 256})
      for (int k : {2, 8}) {
        RouteCase c;
        c.params = params_of(m, k);
        c.E = E;
        c.T = 100;
        c.kind = LogitKind::WithNan;
        c.seed = ++seed;
        run_case(c);
      }
  RouteCase c;  // DeepSeekV3 with NaN logits (NaN choice scores rank last in groups too)
  c.params = params_of(RoutingMethod::DeepSeekV3, 8, 8, 4, 2.5f);
  c.E = 256;
  c.T = 100;
  c.with_bias = true;
  c.kind = LogitKind::WithNan;
  c.seed = ++seed;
  run_case(c);
}

TEST(RouteKernel, Llama4TopOne) {
  FP4MOE_REQUIRE_SM90();
  uint64_t seed = 400;
  for (int E : kExperts)
    for (bool bf16 : {false, true})
      for (LogitKind kind : {LogitKind::Normal, LogitKind::Ties}) {
        RouteCase c;
        c.params = params_of(RoutingMethod::Llama4, 1);
        c.E = E;
        c.T = 255;
        c.bf16 = bf16;
        c.kind = kind;
        c.seed = ++seed;
        run_case(c);
      }
}

// n_group values for E: 1, and a few that leave >= 2 experts per group (n_group <= 16).
std::vector<int> group_counts(int E) {
  std::vector<int> out{1};
  for (int g : {2, 4, 8, 16})
    if (E % g == 0 && E / g >= 2) out.push_back(g);
  return out;
}

TEST(RouteKernel, DeepSeekV3EveryShape) {
  FP4MOE_REQUIRE_SM90();
  uint64_t seed = 500;
  int shape = 0;
  for (int E : kExperts)
    for (int k : kTopK) {
      if (k > E) continue;
      for (int ng : group_counts(E)) {
        const int gsize = E / ng;
        // smallest topk_group that can hold k experts, at least min(4, ng) when possible
        int tg = std::max((k + gsize - 1) / gsize, std::min(4, ng));
        if (tg > ng) continue;
        for (bool bias : {false, true}) {
          RouteCase c;
          c.params = params_of(RoutingMethod::DeepSeekV3, k, ng, tg, bias ? 2.5f : 1.0f);
          c.E = E;
          c.T = kTokens[shape++ % 5];
          c.bf16 = (shape % 3) == 0;
          c.with_bias = bias;
          c.kind = (shape % 4) == 0 ? LogitKind::Ties : LogitKind::Normal;
          c.seed = ++seed;
          run_case(c);
        }
      }
    }
}

TEST(RouteKernel, QuantizesTokenRowsForTheGatheringGemm) {
  FP4MOE_REQUIRE_SM90();
  uint64_t seed = 900;
  for (int T : {1, 5, 33, 1000}) {  // the warp-per-token kernel (several tokens per CTA) and the CTA kernel
    RouteCase c = renormalize_128_case(T, ++seed);
    c.quant_hidden = 2048 + 16;  // 129 blocks: a ragged last pass over the lanes
    run_case(c);
    RouteCase d = deepseek_r1_case(T, ++seed);
    d.quant_hidden = 7168;
    run_case(d);
  }
  // Routing blocks outnumbering the quantizing ones (route_block_role's period 1, the quantizing
  // blocks last) and a period that does not divide the grid.
  for (int T : {255, 1000}) {
    for (int H : {16, 48}) {
      RouteCase c = renormalize_128_case(T, ++seed);
      c.quant_hidden = H;
      run_case(c);
      RouteCase d = deepseek_r1_case(T, ++seed);
      d.quant_hidden = H;
      run_case(d);
    }
  }
}

TEST(RouteKernel, DeepSeekR1AndLargeGroups) {
  FP4MOE_REQUIRE_SM90();
  uint64_t seed = 600;
  for (LogitKind kind : {LogitKind::Normal, LogitKind::Ties, LogitKind::AllEqual})
    for (bool bf16 : {false, true}) {
      RouteCase r1 = deepseek_r1_case(1000, ++seed);
      r1.bf16 = bf16;
      r1.kind = kind;
      run_case(r1);
      RouteCase big;  // E = 512, 16 groups
      big.params = params_of(RoutingMethod::DeepSeekV3, 8, 16, 4, 1.5f);
      big.E = 512;
      big.T = 255;
      big.bf16 = bf16;
      big.with_bias = true;
      big.kind = kind;
      big.seed = ++seed;
      run_case(big);
      RouteCase wide = big;  // k = 32 over 16 groups of 32 with 2 kept
      wide.params = params_of(RoutingMethod::DeepSeekV3, 32, 16, 2, 1.0f);
      wide.seed = ++seed;
      run_case(wide);
    }
}

TEST(RouteKernel, TokenCounts) {
  FP4MOE_REQUIRE_SM90();
  uint64_t seed = 700;
  for (int T : {0, 1, 3, 17, 255, 1000, 8191, 8193}) {
    RouteCase a = renormalize_128_case(T, ++seed);
    a.bf16 = true;
    run_case(a);
    run_case(deepseek_r1_case(T, ++seed));
  }
}

// Every shape that launch_route_permute takes (T * k <= 256, T <= 16; DeepSeekV3 at T = 1): run_case checks the
// one-launch routing and permutation against the two launches, bit for bit.
TEST(RouteKernel, RoutePermuteOneLaunch) {
  FP4MOE_REQUIRE_SM90();
  uint64_t seed = 1000;
  int shape = 0;
  for (RoutingMethod m : kPlainMethods)
    for (int E : kExperts)
      for (int k : kTopK) {
        if (k > E) continue;
        for (int T : {1, 2, 3, 4, 16, 17, 32}) {
          if (T * k > 256) continue;
          RouteCase c;
          c.params = params_of(m, k);
          c.E = E;
          c.T = T;
          c.bf16 = (shape % 2) == 1;
          c.kind = (shape % 5) == 0 ? LogitKind::Ties : LogitKind::Normal;
          c.quant_hidden = (shape % 3) == 0 ? 2048 + 16 : 0;
          c.seed = ++seed;
          ++shape;
          run_case(c);
        }
      }
  for (int E : {16, 128}) {
    RouteCase c;
    c.params = params_of(RoutingMethod::Llama4, 1);
    c.E = E;
    c.T = 32;
    c.seed = ++seed;
    run_case(c);
  }
  RouteCase r1 = deepseek_r1_case(1, ++seed);
  r1.quant_hidden = 7168;
  run_case(r1);
  RouteCase wide = r1;  // E = 512, k = 32, 16 groups
  wide.params = params_of(RoutingMethod::DeepSeekV3, 32, 16, 2, 1.0f);
  wide.E = 512;
  wide.quant_hidden = 0;
  wide.seed = ++seed;
  run_case(wide);
}

TEST(RouteKernel, RoutePermuteRejectsWhatDoesNotFit) {
  EXPECT_TRUE(kernels::route_permute_fits(params_of(RoutingMethod::Renormalize, 8), 16));
  EXPECT_FALSE(kernels::route_permute_fits(params_of(RoutingMethod::Renormalize, 8), 17));   // 2 tokens per warp
  EXPECT_TRUE(kernels::route_permute_fits(params_of(RoutingMethod::Renormalize, 16), 16));  // 256 entries
  EXPECT_FALSE(kernels::route_permute_fits(params_of(RoutingMethod::Renormalize, 32), 9));   // 288 entries
  EXPECT_TRUE(kernels::route_permute_fits(params_of(RoutingMethod::Llama4, 1), 16));
  EXPECT_FALSE(kernels::route_permute_fits(params_of(RoutingMethod::Llama4, 1), 17));   // 2 tokens per warp
  EXPECT_FALSE(kernels::route_permute_fits(params_of(RoutingMethod::Llama4, 1), 128));
  EXPECT_TRUE(kernels::route_permute_fits(params_of(RoutingMethod::DeepSeekV3, 8, 8, 4), 1));
  EXPECT_FALSE(kernels::route_permute_fits(params_of(RoutingMethod::DeepSeekV3, 8, 8, 4), 2));  // a block per token
  EXPECT_FALSE(kernels::route_permute_fits(params_of(RoutingMethod::Renormalize, 8), 0));
  int32_t* const ids = reinterpret_cast<int32_t*>(16);  // never dereferenced: every call is refused
  int32_t* const out = reinterpret_cast<int32_t*>(32);
  const float logits = 0.0f;
  kernels::RouteArgs r;
  r.logits = &logits;
  r.num_tokens = 33;
  r.num_experts = 128;
  r.params = params_of(RoutingMethod::Renormalize, 8);
  r.topk_ids = ids;
  r.topk_weights = reinterpret_cast<float*>(out);
  kernels::PermuteArgs pa;
  pa.topk_ids = ids;
  pa.num_tokens = 33;
  pa.top_k = 8;
  pa.num_experts = 128;
  pa.tile_rows = 16;
  pa.expert_offsets = pa.row_to_entry = pa.entry_to_row = pa.tile_expert = pa.tile_row_start = pa.num_tiles = out;
  EXPECT_EQ(kernels::launch_route_permute(r, pa, nullptr), cudaErrorInvalidValue);  // 264 entries
  r.num_tokens = pa.num_tokens = 16;
  pa.topk_ids = out;  // not the route's ids
  EXPECT_EQ(kernels::launch_route_permute(r, pa, nullptr), cudaErrorInvalidValue);
  pa.topk_ids = ids;
  pa.top_k = 4;  // not the route's k
  EXPECT_EQ(kernels::launch_route_permute(r, pa, nullptr), cudaErrorInvalidValue);
  pa.top_k = 8;
  pa.num_tiles = nullptr;  // an invalid permutation
  EXPECT_EQ(kernels::launch_route_permute(r, pa, nullptr), cudaErrorInvalidValue);
}

TEST(RouteKernel, RejectsBadArguments) {
  kernels::RouteArgs args;
  args.num_tokens = 0;
  args.num_experts = 8;
  args.params = params_of(RoutingMethod::Precomputed, 2);
  EXPECT_EQ(kernels::launch_route(args, nullptr), cudaErrorInvalidValue);
  args.params = params_of(RoutingMethod::Renormalize, 9);  // k > E
  EXPECT_EQ(kernels::launch_route(args, nullptr), cudaErrorInvalidValue);
  args.num_experts = 1024;  // E > 512
  args.params = params_of(RoutingMethod::Renormalize, 2);
  EXPECT_EQ(kernels::launch_route(args, nullptr), cudaErrorInvalidValue);
  args.num_experts = 16;
  args.params = params_of(RoutingMethod::DeepSeekV3, 2, 16, 1);  // groups of 1 expert
  EXPECT_EQ(kernels::launch_route(args, nullptr), cudaErrorInvalidValue);
  args.params = params_of(RoutingMethod::Renormalize, 2);  // T = 0 with valid params: a no-op
  EXPECT_EQ(kernels::launch_route(args, nullptr), cudaSuccess);
  alignas(16) static uint16_t rows[32];
  args.quant_out = reinterpret_cast<__nv_bfloat16*>(rows);  // quantizing needs hidden and its scale
  EXPECT_EQ(kernels::launch_route(args, nullptr), cudaErrorInvalidValue);
  const float scale = 1.0f;
  args.hidden = reinterpret_cast<const __nv_bfloat16*>(rows);
  args.input_scale = &scale;
  args.hidden_size = 24;  // not a multiple of 16
  EXPECT_EQ(kernels::launch_route(args, nullptr), cudaErrorInvalidValue);
  args.hidden_size = 16;
  EXPECT_EQ(kernels::launch_route(args, nullptr), cudaSuccess);  // T = 0: checked, nothing launched
}

}  // namespace
}  // namespace fp4moe
