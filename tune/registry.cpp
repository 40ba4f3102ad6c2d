// tune/registry.cpp — the tactics the kernels provide, as a table, and the rules that say for which
// problems each is valid; plus the heuristic default (fp4moe/tune.hpp states the rules).
//
// Validity reads only the problem (H, I here), never T: a tactic chosen for a bucket is valid for
// every T of the bucket. The heuristic reads T only through the bucket's representative.
#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "fp4moe/error.hpp"
#include "fp4moe/tune.hpp"

namespace fp4moe {
namespace {

struct FamilyRule {
  GemmKernel kernel;
  std::span<const int> tile_tokens;  // the instantiated tile heights
  std::span<const int> split_k;      // the K splits each GEMM may take
};

constexpr int kNoSplit[] = {1};

// One row per kernel family, from the tables of fp4moe/tactic.hpp; candidate_tactics enumerates the
// product and filters by why_invalid.
const FamilyRule kFamilies[] = {
    {GemmKernel::Sm90Wgmma, kWgmmaTileTokens, kNoSplit},
    {GemmKernel::Sm90Stream, kStreamTileTokens, kStreamSplitK},
};

constexpr int64_t kKChunk = 128;  // K elements per pipeline stage of the streaming kernel
constexpr int64_t kNumSms = 132;  // H100/H200 SXM: the heuristic's split-K rule counts CTAs per SM

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t k_chunks(int64_t K) { return ceil_div(K, kKChunk); }

std::string list(std::span<const int> values) {
  std::string s = "{";
  for (int v : values) s += (s.size() > 1 ? ", " : "") + std::to_string(v);
  return s + "}";
}

bool contains(std::span<const int> values, int v) {
  return std::find(values.begin(), values.end(), v) != values.end();
}

}  // namespace

std::string why_invalid(const MoeProblem& p, const MoeTactic& t) {
  const FamilyRule* rule = nullptr;
  for (const FamilyRule& r : kFamilies)
    if (r.kernel == t.kernel) rule = &r;
  if (!rule) return detail::concat("kernel: unknown kernel id ", static_cast<int>(t.kernel));
  const std::string name(to_string(t.kernel));
  if (p.hidden < 16 || p.hidden % 16 != 0 || p.inter < 16 || p.inter % 16 != 0)
    return detail::concat(name, ": H and I must be multiples of 16 (>= 16), got H=", p.hidden, " I=", p.inter);
  if (!contains(rule->tile_tokens, t.tile_tokens))
    return detail::concat(name, ": tile_tokens must be in ", list(rule->tile_tokens), ", got ", t.tile_tokens);
  const auto split_error = [&](int split, const char* field, const char* gemm, int64_t K) -> std::string {
    if (!contains(rule->split_k, split))
      return detail::concat(name, ": ", field, " must be in ", list(rule->split_k), ", got ", split);
    // NOTE: a split CTA needs >= 2 K chunks to overlap its loads and math.
    if (split > 1 && k_chunks(K) < 2 * int64_t(split))
      return detail::concat(name, ": ", field, " ", split, " needs >= ", 2 * split, " chunks of ", kKChunk, " along ",
                            gemm, "'s K, got ", k_chunks(K), " (K=", K, ")");
    return "";
  };
  if (std::string e = split_error(t.split_k1, "split_k1", "GEMM1", p.hidden); !e.empty()) return e;
  if (std::string e = split_error(t.split_k2, "split_k2", "GEMM2", p.inter); !e.empty()) return e;
  return "";
}

std::vector<MoeTactic> candidate_tactics(const MoeProblem& p) {
  std::vector<MoeTactic> out;
  for (const FamilyRule& r : kFamilies)
    for (int tile : r.tile_tokens)
      for (int split1 : r.split_k)
        for (int split2 : r.split_k) {
          const MoeTactic t{r.kernel, tile, split1, split2};
          if (tactic_valid(p, t)) out.push_back(t);
        }
  return out;
}

MoeTactic heuristic_tactic(const MoeProblem& p, int64_t T) {
  const int64_t R = bucket_range(bucket_of(T)).representative;  // throws for T < 0
  const int64_t k = p.top_k(), E = std::max<int64_t>(p.num_experts, 1);
  // m = R * k / E tokens per expert; compared without division. R <= 2^21 and k <= 32: no overflow.
  const int64_t routed = R * k;
  // NOTE: the streaming kernel below m_switch tokens per expert, the wgmma kernel from there. The
  // wgmma kernel pays a pipeline fill and an epilogue per tile at one CTA per SM, which short
  // experts amortize over few K chunks; the streaming kernel's 32-row tiles run 3 CTAs per SM. So the
  // switch point falls with the K chunks of both GEMMs (ceil(H / 128) + ceil(I / 128)). Measured on
  // the H200 (fp4moe bench --tactic, stream/t32/s1 over wgmma/t128/s1, w4a16 and w4a4_scalar):
  //   22 chunks (qwen3-30b-a3b):    m = 16 0.86-0.88, 20 0.92-0.94, 24 0.94-0.95, 32 1.08-1.11
  //   44 (qwen3-235b-a22b):         m = 16 0.94-0.96, 20 1.03-1.04
  //   46 (gpt-oss-120b):            m = 16 0.97-0.98, 20 1.04-1.07
  //   72 (deepseek-r1):             m = 16 1.31-1.33;  104 (llama4-scout): m = 16 1.04-1.06
  // and at m = 12..14 the streaming kernel won on gpt-oss-120b and lost on deepseek-r1.
  const int64_t both_chunks = k_chunks(p.hidden) + k_chunks(p.inter);
  const int64_t m_switch = both_chunks <= 32 ? 28 : both_chunks <= 48 ? 17 : 16;
  if (routed < m_switch * E) {
    // Streaming kernel. Rules fitted to a decode tuning of the presets on an H200, for which they pick
    // the tuned tactic or one within ~3% of it:
    //   split K: the GEMM with fewer CTAs (128 output rows each) decides. Split by the largest s in
    //     {1, 2, 4} that keeps that grid at <= 5 CTAs per SM and every split >= 10 K chunks in both
    //     GEMMs (a split costs a partial write, a reduction and one more pipeline fill). One llama4-scout
    //     token (1 expert, GEMM2 40 CTAs, 40/64 chunks): s4, 65 us against 82 us with s2; qwen3-30b-a3b
    //     (6 chunks in GEMM2): never split, s1 39 us against 41 us with s2.
    //   32-token tiles once the mean rows per expert exceed 12: with 16-token tiles an expert that
    //     receives 17..32 rows streams its weights twice (qwen3-235b-a22b T = 256: 616 us against
    //     702 us with 16-token tiles).
    const int tile = routed > 12 * E ? 32 : 16;
    const int64_t experts_hit = std::min(E, routed);
    const int64_t fewer_rows = std::min(p.w13_rows(), p.hidden);
    const int64_t ctas = experts_hit * ceil_div(fewer_rows, 128);
    const int64_t chunks = std::min(k_chunks(p.hidden), k_chunks(p.inter));
    // Both GEMMs take that split (the tuner may split them differently).
    for (int split : {4, 2}) {
      const MoeTactic t{GemmKernel::Sm90Stream, tile, split, split};
      if (ctas * split <= 5 * kNumSms && chunks >= 10 * split && tactic_valid(p, t)) return t;
    }
    return {GemmKernel::Sm90Stream, tile, 1, 1};
  }
  // NOTE: 256-token tiles halve the decode per flop but halve the weight rows per CTA, and an expert
  // with a few rows more than a multiple of 256 pays a nearly empty tile. Measured on the H200
  // (fp4moe bench --tactic, w4a16): at m = 256 the 128-token tile wins (deepseek-r1
  // T = 8192 11407 vs 12074 us, gpt-oss-120b T = 8192 3209 vs 3501, llama4-scout T = 4096 1779 vs
  // 1805, qwen3-30b-a3b T = 4096 806 vs 804); at m = 512 the 256-token tile (llama4-scout T = 8192
  // 3116 vs 3503, qwen3-30b-a3b T = 8192 1444 vs 1463).
  // NOTE: 64-token tiles (128 weight rows, two CTAs per SM: one CTA's fill and epilogue under the
  // other's main loop) where experts get few rows. Measured on the H200 (fp4moe bench --tactic
  // sm90_wgmma/t64/s1 against the tuned tactic, w4a16): at m = 32
  // qwen3-30b-a3b 0.90, qwen3-235b-a22b 0.93, llama4-scout 0.92, gpt-oss-120b 0.91; at m = 64 0.95-1.01;
  // at m = 128 1.07-1.17. deepseek-r1 (E = 256) was slower at every m (1.02 at m = 16, 1.21 at m = 64).
  if (routed < 48 * E && E <= 128) return {GemmKernel::Sm90Wgmma, 64, 1, 1};
  if (routed < 384 * E) return {GemmKernel::Sm90Wgmma, 128, 1, 1};
  return {GemmKernel::Sm90Wgmma, 256, 1, 1};
}

}  // namespace fp4moe
