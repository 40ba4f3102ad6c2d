// tests/kernels/expert_gemm_staging_cpu_test.cpp — the wgmma GEMM1 epilogue's staging tile and item
// order (kernels/sm90/staging.cuh) on the host: every (token, block) item once for every tile
// size, column and row count; the item loads of full warps and the accumulators' float2 staging stores
// free of shared-memory bank conflicts (the kernel's performance depends on both; its results on the
// first, which the GPU tests check too).
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <utility>

#include "kernels/sm90/staging.cuh"

namespace fp4moe {
namespace {

namespace st = kernels::sm90::staging;

constexpr int kTiles[] = {64, 128, 256};

// The largest number of distinct addresses of one instruction that share a bank (1: conflict-free).
int max_ways(const std::set<int>& words) {
  int per_bank[32] = {};
  int worst = 0;
  for (int w : words) worst = std::max(worst, ++per_bank[w % 32]);
  return worst;
}

TEST(ExpertGemmStaging, StrideHoldsRowAndShift) {
  for (int tile : kTiles) {
    EXPECT_GE(st::stride(tile), tile + st::row_shift(48)) << tile;
    EXPECT_EQ(st::stride(tile) % 32, 8) << tile;
  }
  EXPECT_EQ(st::stride(64), 104);
  EXPECT_EQ(st::stride(128), 168);
  EXPECT_EQ(st::stride(256), 296);
}

TEST(ExpertGemmStaging, EveryItemOnce) {
  for (int tile : kTiles)
    for (int blocks = 1; blocks <= 16; ++blocks)
      for (int valid = 1; valid <= tile; ++valid) {
        std::set<std::pair<int, int>> seen;
        for (int i = 0; i < st::item_count(valid, blocks); ++i) {
          const st::Item it = st::item(i, blocks);
          ASSERT_GE(it.block, 0);
          ASSERT_LT(it.block, blocks);
          if (it.token >= valid) continue;
          ASSERT_TRUE(seen.insert({it.token, it.block}).second) << tile << " " << blocks << " " << valid;
        }
        ASSERT_EQ(static_cast<int>(seen.size()), valid * blocks) << tile << " " << blocks << " " << valid;
      }
}

// A warp's 32 consecutive items load element e of their blocks (rows 16 block + e, plus an up offset
// of 64 or 128 rows) in one instruction: with blocks a multiple of 4, 32 distinct banks.
TEST(ExpertGemmStaging, ItemLoadsOnDistinctBanks) {
  for (int tile : kTiles)
    for (int blocks : {4, 8, 16})
      for (int up : {0, 64, 128})
        for (int w0 = 0; w0 < st::item_count(tile, blocks); w0 += 32)
          for (int e = 0; e < 16; ++e) {
            std::set<int> words;
            for (int i = w0; i < w0 + 32; ++i) {
              const st::Item it = st::item(i, blocks);
              const int row = up + 16 * it.block + e;
              words.insert(row * st::stride(tile) + st::row_shift(row) + it.token);
            }
            ASSERT_EQ(max_ways(words), 1) << tile << " " << blocks << " " << up << " " << w0 << " " << e;
          }
}

// The accumulator staging stores: lane (g = lane / 4, t = lane % 4) of m16 tile m writes a float2 at
// (row 8 m + g (+ an up offset), tokens 8 j + 2 t, +1); the 16 lanes of each phase on 32 banks.
TEST(ExpertGemmStaging, Float2StagingStoresOnDistinctBanks) {
  for (int tile : kTiles)
    for (int m = 0; m < 32; ++m)
      for (int up : {0, 64, 128})
        for (int j = 0; j < tile / 8; ++j)
          for (int phase = 0; phase < 2; ++phase) {
            std::set<int> words;
            for (int lane = 16 * phase; lane < 16 * phase + 16; ++lane) {
              const int row = up + 8 * m + lane / 4, token = 8 * j + 2 * (lane % 4);
              const int w = row * st::stride(tile) + st::row_shift(row) + token;
              words.insert(w);
              words.insert(w + 1);
            }
            ASSERT_EQ(max_ways(words), 1) << tile << " " << m << " " << up << " " << j;
          }
}

}  // namespace
}  // namespace fp4moe
