// io/random_packed_case.cpp — random NVFP4 and MXFP4 cases drawn in the packed domain (see case_file.hpp).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "fp4moe/case_file.hpp"
#include "fp4moe/format.hpp"
#include "reference/parallel.hpp"

namespace fp4moe::io {
namespace {

// SplitMix64 (Steele, Lea, Flood 2014): a 64-bit state stepped by a constant and a bijective mix; one
// multiply-xorshift chain per 8 random bytes.
struct SplitMix64 {
  uint64_t state;
  uint64_t operator()() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
};

// NOTE: presets hold GBs of weights (kimi-k2: 9.5 GB of codes and scales), which one mt19937_64 and a
// uniform_int_distribution per scale byte drew at ~150 MB/s. The bytes are cut into fixed blocks, each
// drawn by its own SplitMix64 seeded from (seed, tensor, block), on every core: the values depend on
// the seed only, never on the thread count.
constexpr int64_t kBlockBytes = int64_t(1) << 20;

// Fills `bytes` (whole tensor) with `draw(r, out, n)` over blocks of kBlockBytes, where r is the
// block's generator and out / n its bytes.
template <typename Draw>
void fill_blocks(std::vector<uint8_t>& bytes, uint64_t seed, uint64_t tensor, Draw draw) {
  const int64_t n = static_cast<int64_t>(bytes.size());
  const int64_t blocks = (n + kBlockBytes - 1) / kBlockBytes;
  SplitMix64 seeder{seed ^ (tensor * 0xD1B54A32D192ED03ull)};
  const uint64_t base = seeder();
  reference::detail::parallel_for(blocks, [&](int64_t b, int) {
    // The block's start state: a mixed (bijective) function of (base, b), so that the blocks' streams
    // (states start + i * golden ratio) do not overlap as they would from starts b * golden ratio apart.
    SplitMix64 r{SplitMix64{base + static_cast<uint64_t>(b)}()};
    const int64_t begin = b * kBlockBytes;
    draw(r, bytes.data() + begin, std::min(kBlockBytes, n - begin));
  });
}

// Uniform random bytes.
void draw_codes(SplitMix64& r, uint8_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const uint64_t v = r();
    std::memcpy(out + i, &v, 8);
  }
  if (i < n) {
    const uint64_t v = r();
    std::memcpy(out + i, &v, static_cast<size_t>(n - i));
  }
}

// e4m3 codes 0x30..0x48 (values 2^-1 .. 2^2): 25 codes, byte x -> 0x30 + (25 x >> 8) (10 or 11 of the 256
// byte values each).
void draw_scales(SplitMix64& r, uint8_t* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) {
    uint64_t v = r();
    for (int64_t j = i; j < std::min(i + 8, n); ++j, v >>= 8)
      out[j] = static_cast<uint8_t>(0x30 + ((25u * static_cast<uint32_t>(v & 0xFF)) >> 8));
  }
}

// MXFP4 ue8m0 codes of one tensor [E, rows, blocks]: expert e's codes are base[e] + 0..3, one offset
// per byte from the block's generator (the byte's two low bits).
void draw_ue8m0(SplitMix64& r, uint8_t* out, int64_t n, int64_t first, int64_t per_expert, const uint8_t* base) {
  for (int64_t i = 0; i < n; i += 8) {
    uint64_t v = r();
    for (int64_t j = i; j < std::min(i + 8, n); ++j, v >>= 8)
      out[j] = static_cast<uint8_t>(base[(first + j) / per_expert] + (v & 0x3));
  }
}

}  // namespace

MoeCase make_random_packed_case(const MoeProblem& p, int64_t T, uint64_t seed) {
  std::mt19937_64 rng(seed);
  MoeCase c;
  c.problem = p;
  c.num_tokens = T;
  const int64_t E = p.num_experts, H = p.hidden, I = p.inter, N13 = p.w13_rows(), k = p.top_k();
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> spread(0.8f, 1.2f);
  c.hidden_states.resize(T * H);
  float amax = 0;
  for (auto& v : c.hidden_states) {
    const float x = normal(rng);
    v = format::bf16_from_float(x);
    amax = std::max(amax, std::fabs(format::bf16_to_float(v)));
  }
  if (p.routing.method == RoutingMethod::Precomputed) {
    c.topk_ids.resize(T * k);
    c.topk_weights.resize(T * k);
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int32_t> all(E);
      for (int64_t e = 0; e < E; ++e) all[e] = static_cast<int32_t>(e);
      std::shuffle(all.begin(), all.end(), rng);
      for (int64_t j = 0; j < k; ++j) {
        c.topk_ids[t * k + j] = all[j];
        c.topk_weights[t * k + j] = std::fabs(normal(rng));
      }
    }
  } else {
    c.router_logits.resize(T * E);
    for (auto& v : c.router_logits) v = normal(rng);
    if (p.routing.method == RoutingMethod::DeepSeekV3) {
      c.routing_bias.resize(E);
      for (auto& v : c.routing_bias) v = 0.1f * normal(rng);
    }
  }
  if (p.weight_format == WeightFormat::MXFP4) {
    // ue8m0 codes: a per-expert base of 117..120 and per-block offsets 0..3 (codes 117..123, a span of
    // 7 powers of two): uniform e2m1 codes have an RMS of 2.9, so the weights' RMS is about 0.02 as
    // for NVFP4 below, with blocks from 2^-10 to 2^-4 times q. No global or input scales.
    std::vector<uint8_t> base13(E), base2(E);
    for (int64_t e = 0; e < E; ++e) {
      base13[e] = static_cast<uint8_t>(117 + rng() % 4);
      base2[e] = static_cast<uint8_t>(117 + rng() % 4);
    }
    auto fill_mx = [&](std::vector<uint8_t>& w, std::vector<uint8_t>& s, int64_t rows, int64_t cols, uint64_t tensor,
                       const std::vector<uint8_t>& base) {
      w.resize(E * rows * cols / 2);
      s.resize(E * rows * cols / 32);
      fill_blocks(w, seed, 2 * tensor, draw_codes);
      const int64_t per_expert = rows * cols / 32;
      // NOTE: the block's first byte index tells draw_ue8m0 which expert each byte belongs to.
      uint8_t* const s0 = s.data();
      fill_blocks(s, seed, 2 * tensor + 1, [&](SplitMix64& r, uint8_t* out, int64_t n) {
        draw_ue8m0(r, out, n, out - s0, per_expert, base.data());
      });
    };
    fill_mx(c.w13, c.w13_scale, N13, H, 0, base13);
    fill_mx(c.w2, c.w2_scale, H, I, 1, base2);
    return c;
  }
  auto fill = [&](std::vector<uint8_t>& w, std::vector<uint8_t>& s, int64_t rows, int64_t cols, uint64_t tensor) {
    w.resize(E * rows * cols / 2);
    s.resize(E * rows * cols / 16);
    fill_blocks(w, seed, 2 * tensor, draw_codes);
    fill_blocks(s, seed, 2 * tensor + 1, draw_scales);
  };
  fill(c.w13, c.w13_scale, N13, H, 0);
  fill(c.w2, c.w2_scale, H, I, 1);
  c.w13_scale_2.resize(E);
  c.w2_scale_2.resize(E);
  c.w13_input_scale.resize(E);
  c.w2_input_scale.resize(E);
  for (int64_t e = 0; e < E; ++e) {
    c.w13_scale_2[e] = 0.02f / (3.4f * 1.6f) * spread(rng);
    c.w2_scale_2[e] = 0.02f / (3.4f * 1.6f) * spread(rng);
    c.w13_input_scale[e] = std::max(amax, 1.0f) / (6.0f * 448.0f) * spread(rng);
    c.w2_input_scale[e] = 8.0f / (6.0f * 448.0f) * spread(rng);
  }
  return c;
}

}  // namespace fp4moe::io
