// tests/kernels/permute_test.cu — launch_permute against an independent CPU computation.
//
// The CPU side: a stable sort of the entries t*k+j by expert (ids outside [0, E) last), expert offsets
// from counts, and the tile table by walking the experts in order. Everything must match bit for bit
// (offsets, both permutation arrays, tile count and table) for T in {0, 1, 3, 17, 255, 1000, 8191,
// 8193}, k up to 32, E up to 512 (the one-block and the three-launch paths), all tokens on one
// expert, experts without tokens, and invalid ids. Outputs and scratch are poisoned first.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/gpu_test_util.hpp"
#include "kernels/launch.hpp"
#include "kernels/permute_buffers.hpp"

namespace fp4moe {
namespace {

using test::DeviceBuffer;

enum class IdKind {
  Distinct,    // each token picks k distinct experts at random (real routing)
  Skewed,      // a few hot experts, most experts empty
  OneExpert,   // every entry on the same expert
  Repeats,     // arbitrary ids with repeats inside a token
  SomeInvalid  // a few ids outside [0, E)
};

struct Expected {
  std::vector<int32_t> offsets, row_to_entry, entry_to_row, tile_expert, tile_row_start;
};

Expected cpu_permute(const std::vector<int32_t>& ids, int E, int tile_rows) {
  const int64_t n = static_cast<int64_t>(ids.size());
  auto bucket = [&](int64_t i) { return (ids[i] >= 0 && ids[i] < E) ? ids[i] : E; };
  Expected x;
  x.row_to_entry.resize(n);
  std::iota(x.row_to_entry.begin(), x.row_to_entry.end(), 0);
  std::stable_sort(x.row_to_entry.begin(), x.row_to_entry.end(),
                   [&](int32_t a, int32_t b) { return bucket(a) < bucket(b); });
  x.entry_to_row.resize(n);
  for (int64_t r = 0; r < n; ++r) x.entry_to_row[x.row_to_entry[r]] = static_cast<int32_t>(r);
  std::vector<int32_t> counts(E + 1, 0);
  for (int64_t i = 0; i < n; ++i) ++counts[bucket(i)];
  x.offsets.assign(E + 1, 0);
  for (int e = 0; e < E; ++e) x.offsets[e + 1] = x.offsets[e] + counts[e];
  for (int e = 0; e < E; ++e)
    for (int32_t start = x.offsets[e]; start < x.offsets[e + 1]; start += tile_rows) {
      x.tile_expert.push_back(e);
      x.tile_row_start.push_back(start);
    }
  return x;
}

std::vector<int32_t> make_ids(IdKind kind, int T, int k, int E, std::mt19937_64& rng) {
  std::vector<int32_t> ids(static_cast<size_t>(T) * k);
  std::vector<int32_t> perm(E);
  std::iota(perm.begin(), perm.end(), 0);
  const int hot = std::max(1, std::min(E, k + 1));  // hot experts of the skewed case
  const int32_t one = static_cast<int32_t>(rng() % E);
  for (int t = 0; t < T; ++t) {
    if (kind == IdKind::Distinct) {
      for (int j = 0; j < k; ++j) {  // partial Fisher-Yates
        const int pick = j + static_cast<int>(rng() % (E - j));
        std::swap(perm[j], perm[pick]);
        ids[static_cast<size_t>(t) * k + j] = perm[j];
      }
      continue;
    }
    for (int j = 0; j < k; ++j) {
      int32_t id = 0;
      switch (kind) {
        case IdKind::Skewed: id = static_cast<int32_t>((rng() % hot) * (E / hot)); break;
        case IdKind::OneExpert: id = one; break;
        case IdKind::Repeats: id = static_cast<int32_t>(rng() % E); break;
        case IdKind::SomeInvalid:
          id = static_cast<int32_t>(rng() % E);
          if (rng() % 17 == 0) id = (rng() % 2) ? -1 : E + static_cast<int32_t>(rng() % 5);
          break;
        case IdKind::Distinct: break;
      }
      ids[static_cast<size_t>(t) * k + j] = id;
    }
  }
  return ids;
}

template <typename T>
void expect_equal(const std::vector<T>& got, const std::vector<T>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int reported = 0;
  for (size_t i = 0; i < got.size() && reported < 8; ++i)
    if (got[i] != want[i]) {
      ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want " << want[i];
      ++reported;
    }
}

void run_case(int T, int k, int E, int tile_rows, IdKind kind, uint64_t seed) {
  std::ostringstream name;
  name << "T=" << T << " k=" << k << " E=" << E << " tile_rows=" << tile_rows
       << " kind=" << static_cast<int>(kind) << " seed=" << seed;
  SCOPED_TRACE(name.str());
  std::mt19937_64 rng(seed);
  const std::vector<int32_t> ids = make_ids(kind, T, k, E, rng);
  const Expected want = cpu_permute(ids, E, tile_rows);
  const int64_t n = static_cast<int64_t>(T) * k;
  const int64_t tiles_cap = kernels::max_tiles(n, E, tile_rows);
  ASSERT_LE(static_cast<int64_t>(want.tile_expert.size()), tiles_cap);

  DeviceBuffer<int32_t> d_ids(ids);
  test::PermuteBuffers out(d_ids.get(), T, k, E, tile_rows);
  ASSERT_TRUE(d_ids.ok() && out.ok());
  kernels::PermuteArgs& a = out.args;
  // The words the launch clears for later kernels (GEMM2's fused-finalize and split-K counters, the
  // tile_ready counts): 7 per token + 1 in range 0, 3 in range 2, none in range 1, tiles_cap in range 3.
  const int64_t zero_count = 7 * static_cast<int64_t>(T) + 1;
  DeviceBuffer<int32_t> d_zero(static_cast<size_t>(zero_count) + 1), d_zero2(4),
      d_zero3(static_cast<size_t>(tiles_cap) + 1);
  ASSERT_TRUE(d_zero.ok() && d_zero2.ok() && d_zero3.ok());
  a.zero_words[0] = d_zero.get();
  a.zero_count[0] = zero_count;
  a.zero_words[2] = d_zero2.get();
  a.zero_count[2] = 3;
  a.zero_words[3] = d_zero3.get();
  a.zero_count[3] = tiles_cap;
  // Twice on the same buffers: the result must not depend on what the previous run left behind.
  for (int rep = 0; rep < 2; ++rep) {
    d_zero.poison();
    d_zero2.poison();
    d_zero3.poison();
    CUDA_ASSERT(kernels::launch_permute(a, nullptr));
    CUDA_ASSERT(cudaDeviceSynchronize());
    const std::vector<int32_t> zeroed = d_zero.download(), zeroed2 = d_zero2.download();
    ASSERT_EQ(std::count(zeroed.begin(), zeroed.end() - 1, 0), zero_count) << "zero_words[0] not cleared";
    ASSERT_EQ(zeroed.back(), -1) << "a word past zero_count[0] was written";
    ASSERT_EQ(std::count(zeroed2.begin(), zeroed2.end() - 1, 0), 3) << "zero_words[2] not cleared";
    ASSERT_EQ(zeroed2.back(), -1) << "a word past zero_count[2] was written";
    const std::vector<int32_t> zeroed3 = d_zero3.download();
    ASSERT_EQ(std::count(zeroed3.begin(), zeroed3.end() - 1, 0), tiles_cap) << "zero_words[3] not cleared";
    ASSERT_EQ(zeroed3.back(), -1) << "a word past zero_count[3] was written";
    expect_equal(out.offsets.download(), want.offsets, "expert_offsets");
    expect_equal(out.row_to_entry.download(), want.row_to_entry, "row_to_entry");
    expect_equal(out.entry_to_row.download(), want.entry_to_row, "entry_to_row");
    const int32_t nt = out.num_tiles.download()[0];
    ASSERT_EQ(nt, static_cast<int32_t>(want.tile_expert.size()));
    expect_equal(out.tile_expert.download(nt), want.tile_expert, "tile_expert");
    expect_equal(out.tile_row_start.download(nt), want.tile_row_start, "tile_row_start");
  }
}

constexpr int kTokens[] = {0, 1, 3, 17, 255, 1000, 8191, 8193};

TEST(PermuteKernel, RandomDistinctExperts) {
  FP4MOE_REQUIRE_SM90();
  uint64_t seed = 1000;
  int tr = 0;
  for (int T : kTokens)
    for (int E : {8, 16, 128, 256, 512})
      for (int k : {1, 2, 4, 8, 32}) {
        if (k > E) continue;
        run_case(T, k, E, (tr++ % 2) ? 64 : 128, IdKind::Distinct, ++seed);
      }
}

TEST(PermuteKernel, SkewedAndEmptyExperts) {
  FP4MOE_REQUIRE_SM90();
  uint64_t seed = 2000;
  for (int T : kTokens)
    for (int E : {8, 256, 512})
      for (int k : {1, 8, 32}) {
        if (k > E) continue;
        run_case(T, k, E, 16, IdKind::Skewed, ++seed);
      }
}

TEST(PermuteKernel, AllTokensOnOneExpert) {
  FP4MOE_REQUIRE_SM90();
  uint64_t seed = 3000;
  for (int T : kTokens)
    for (int E : {8, 512})
      for (int k : {1, 8, 32}) {
        if (k > E) continue;
        run_case(T, k, E, 128, IdKind::OneExpert, ++seed);
      }
}

// The one-block path's limit (permute_block::kWarpCountEntries = 1024 entries) and the entry past it,
// its second entry per thread (from 513 entries), and the route launch's limit
// (permute_block::kSmallEntries = 256), which the permute launch crosses with the same kernel.
TEST(PermuteKernel, SmallPathLimit) {
  FP4MOE_REQUIRE_SM90();
  uint64_t seed = 6000;
  for (int T : {32, 33, 64, 65, 100, 127, 128, 129}) {
    run_case(T, 8, 256, 16, IdKind::Distinct, ++seed);
    run_case(T, 8, 16, 16, IdKind::Skewed, ++seed);
    run_case(T, 8, 512, 16, IdKind::SomeInvalid, ++seed);
  }
  for (int T : {256, 257, 512, 513, 777, 1024, 1025}) {
    run_case(T, 1, 16, 16, IdKind::OneExpert, ++seed);
    run_case(T, 1, 128, 16, IdKind::Repeats, ++seed);
  }
  run_case(8, 32, 512, 16, IdKind::Distinct, ++seed);
  run_case(16, 32, 512, 1, IdKind::OneExpert, ++seed);  // 512 entries, 512 one-row tiles of one expert
  run_case(32, 32, 512, 1, IdKind::OneExpert, ++seed);  // 1024 entries, 1024 one-row tiles of one expert
  run_case(32, 32, 512, 1, IdKind::Distinct, ++seed);   // 1024 entries over 512 experts, one-row tiles
}

TEST(PermuteKernel, RepeatedAndInvalidIds) {
  FP4MOE_REQUIRE_SM90();
  uint64_t seed = 4000;
  for (int T : {1, 17, 1000, 8193})
    for (int E : {16, 512}) {
      run_case(T, 4, E, 64, IdKind::Repeats, ++seed);
      run_case(T, 8, E, 64, IdKind::SomeInvalid, ++seed);
    }
}

TEST(PermuteKernel, TileSizes) {
  FP4MOE_REQUIRE_SM90();
  uint64_t seed = 5000;
  for (int tile_rows : {1, 7, 16, 64, 128, 256})
    for (int T : {3, 1000, 8193}) run_case(T, 8, 256, tile_rows, IdKind::Distinct, ++seed);
}

TEST(PermuteKernel, RejectsBadArguments) {
  kernels::PermuteArgs a;
  a.num_tokens = 0;
  a.top_k = 1;
  a.num_experts = 513;  // > 512
  a.tile_rows = 64;
  EXPECT_EQ(kernels::launch_permute(a, nullptr), cudaErrorInvalidValue);
  a.num_experts = 8;
  a.tile_rows = 0;
  EXPECT_EQ(kernels::launch_permute(a, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(kernels::permute_scratch_bytes(0, 8), 0u);
}

}  // namespace
}  // namespace fp4moe
