// fp4moe/tactic.hpp — how the expert GEMMs of one MoE forward are run: a plain, printable struct
// (docs/architecture.md, "Layers": the problem says what is computed, the tactic how). One tactic serves
// both GEMMs of a forward (they share the permutation's tile table, built for tile_tokens); the K split
// is per GEMM.
//
// Validity is decided by the tactic registry alone (why_invalid / tactic_valid in fp4moe/tune.hpp,
// tune/registry.cpp, from the tables below). It depends on the problem only, never on the token count
// T: a tactic chosen for a bucket of T is valid for every T.
#pragma once

#include <array>
#include <charconv>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "fp4moe/error.hpp"

namespace fp4moe {

enum class GemmKernel : int {
  // sm90 wgmma kernel: 1 producer + 2 consumer warpgroups, weights x tokens tile, a shared-memory ring
  // filled by bulk tensor copies (TMA).
  //   tile_tokens 128: 256 weight rows per CTA; tile_tokens 64 (two CTAs per SM) and 256: 128.
  Sm90Wgmma = 0,
  // sm90 streaming kernel for few tokens per expert: mma.sync on weights that the CTA streams through a
  // ring of bulk tensor copies (one K chunk per stage, shared by all its warps).
  Sm90Stream = 1,
};

struct MoeTactic {
  GemmKernel kernel = GemmKernel::Sm90Wgmma;
  int tile_tokens = 128;  // token rows per GEMM tile (the permutation's tile table is built for it)
  // CTAs along K per output tile (Sm90Stream only; 1 = none), per GEMM: the two GEMMs reduce over
  // different K (GEMM1: H, GEMM2: I) and have different grids, so each has its own split.
  int split_k1 = 1;  // GEMM1 (K = H)
  int split_k2 = 1;  // GEMM2 (K = I)

  friend bool operator==(const MoeTactic&, const MoeTactic&) = default;
};

// The tables of the tactic registry (tune/registry.cpp): the tile heights each kernel is instantiated
// for and the K splits a streaming GEMM may take. why_invalid reads these and nothing else decides
// validity; the kernels' launchers only bound-check what they are given.
inline constexpr std::array<int, 3> kWgmmaTileTokens = {64, 128, 256};
inline constexpr std::array<int, 2> kStreamTileTokens = {16, 32};
// NOTE: split 6 serves GEMM2s with few CTAs along N and long K (llama4-scout T = 2 and 4, w4a16:
// 68.6 -> 64.0 us and 82.2 -> 81.0 us against the best of 1, 2, 4); splits 3 and 8 won no bucket.
inline constexpr std::array<int, 4> kStreamSplitK = {1, 2, 4, 6};

inline std::string_view to_string(GemmKernel k) {
  switch (k) {
    case GemmKernel::Sm90Wgmma: return "sm90_wgmma";
    case GemmKernel::Sm90Stream: return "sm90_stream";
  }
  return "unknown";
}

// The kernel of a name of to_string(GemmKernel); throws fp4moe::Error naming `what` and the accepted names.
inline GemmKernel parse_gemm_kernel(std::string_view name, std::string_view what = "kernel") {
  for (GemmKernel k : {GemmKernel::Sm90Wgmma, GemmKernel::Sm90Stream})
    if (to_string(k) == name) return k;
  throw Error(detail::concat(what, ": unknown kernel '", name, "', expected one of: sm90_wgmma, sm90_stream"));
}

// e.g. "sm90_wgmma/t128/s1"; "/s<a>" when both GEMMs split a ways, else "/s<a>x<b>" (GEMM1 a, GEMM2 b),
// e.g. "sm90_stream/t16/s1x4".
inline std::string describe(const MoeTactic& t) {
  std::string s = std::string(to_string(t.kernel)) + "/t" + std::to_string(t.tile_tokens) + "/s" +
                  std::to_string(t.split_k1);
  if (t.split_k2 != t.split_k1) {
    // NOTE: appended in two steps; "x" + std::to_string(...) trips GCC 12's -Wrestrict (a false positive).
    s += 'x';
    s += std::to_string(t.split_k2);
  }
  return s;
}

// The inverse of describe(); also accepts "/s<a>x<a>" (the same as "/s<a>"). nullopt when `s` is not of
// that form.
inline std::optional<MoeTactic> parse_tactic(std::string_view s) {
  const size_t a = s.find("/t"), b = s.find("/s", a == std::string_view::npos ? 0 : a + 2);
  if (a == std::string_view::npos || b == std::string_view::npos) return std::nullopt;
  MoeTactic t;
  const std::string_view kernel = s.substr(0, a);
  if (kernel == to_string(GemmKernel::Sm90Wgmma)) t.kernel = GemmKernel::Sm90Wgmma;
  else if (kernel == to_string(GemmKernel::Sm90Stream)) t.kernel = GemmKernel::Sm90Stream;
  else return std::nullopt;
  auto number = [](std::string_view v, int& out) {
    const auto r = std::from_chars(v.data(), v.data() + v.size(), out);
    return r.ec == std::errc() && r.ptr == v.data() + v.size() && out >= 1;
  };
  const std::string_view splits = s.substr(b + 2);
  const size_t x = splits.find('x');
  if (!number(s.substr(a + 2, b - a - 2), t.tile_tokens) || !number(splits.substr(0, x), t.split_k1))
    return std::nullopt;
  t.split_k2 = t.split_k1;
  if (x != std::string_view::npos && !number(splits.substr(x + 1), t.split_k2)) return std::nullopt;
  return t;
}

}  // namespace fp4moe
