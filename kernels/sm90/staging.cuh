// kernels/sm90/staging.cuh — the staging tile of the wgmma kernel's GEMM1 epilogue and the
// order of its items, host- and device-side, so that a CPU test (expert_gemm_staging_cpu_test.cpp)
// checks what the kernel relies on: every (token, 16-column block) item exactly once, the item loads
// of a warp on 32 banks, the accumulators' float2 staging stores on 32 banks per 16-lane phase.
//
// Staging tile: row r (a CTA-local weight row or output column) holds the tile's tokens as fp32,
// token t at r * stride(tile_rows) + row_shift(r) + t.
// Items: (token, 16-column block) pairs, 8 tokens x `blocks` blocks per token group, tokens fastest, so
// the 32 lanes of a warp take 8 tokens x 4 blocks: each 16-byte store of the warp writes 8 token rows
// (4 x 16 B in each) instead of 32, and the shift puts the 4 blocks' rows (16 apart) on different banks.
#pragma once

#include "kernels/host_device.cuh"

namespace fp4moe::kernels::sm90::staging {

// Floats that row r starts after r * stride: uniform over the 8 rows of a float2 staging store's
// phase (rows 8m..8m+7 share r / 16), different for 4 consecutive 16-row blocks.
FP4MOE_HD constexpr int row_shift(int row) { return ((row >> 4) & 3) * 8; }

// Floats per staging row for a tile of tile_rows tokens: room for a row and its shift (up to 24), and
// 8 mod 32 so that a float2 store's 16 lanes per phase (rows g = 0..3, tokens 2t) fall on 32 banks.
FP4MOE_HD constexpr int stride(int tile_rows) { return (tile_rows + 24 + 23) / 32 * 32 + 8; }

// Items of a tile with valid_rows token rows and `blocks` 16-column blocks (token groups of 8 rounded
// up: the lanes past valid_rows skip their item).
FP4MOE_HD constexpr int item_count(int valid_rows, int blocks) { return (valid_rows + 7) / 8 * blocks * 8; }

struct Item {
  int token, block;
};
FP4MOE_HD constexpr Item item(int index, int blocks) {
  const int rest = index >> 3;
  return Item{(rest / blocks) * 8 + (index & 7), rest % blocks};
}

}  // namespace fp4moe::kernels::sm90::staging
