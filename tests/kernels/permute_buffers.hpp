// tests/kernels/permute_buffers.hpp — the device outputs of one permutation (launch_permute,
// launch_route_permute) and the PermuteArgs that point at them: the set-up the route, permute and
// expert GEMM tests share.
#pragma once

#include <cstdint>

#include "kernels/gpu_test_util.hpp"
#include "kernels/launch.hpp"

namespace fp4moe::test {

// For the T*k ids at `ids` over E experts and tiles of tile_rows rows: expert_offsets [E+1],
// row_to_entry and entry_to_row [T*k], tile_expert and tile_row_start [max_tiles(T*k, E, tile_rows)],
// num_tiles [1] (each filled with `poison_byte`) and launch_permute's scratch. args points at them;
// its zero_words ranges are left empty for the test to set.
struct PermuteBuffers {
  DeviceBuffer<int32_t> offsets, row_to_entry, entry_to_row, tile_expert, tile_row_start, num_tiles;
  DeviceBuffer<uint8_t> scratch;
  kernels::PermuteArgs args;

  PermuteBuffers(const int32_t* ids, int T, int k, int E, int tile_rows, uint8_t poison_byte = 0xFF) {
    const int64_t n = static_cast<int64_t>(T) * k, tiles = kernels::max_tiles(n, E, tile_rows);
    offsets.allocate(E + 1);
    row_to_entry.allocate(n);
    entry_to_row.allocate(n);
    tile_expert.allocate(tiles);
    tile_row_start.allocate(tiles);
    num_tiles.allocate(1);
    scratch.allocate(kernels::permute_scratch_bytes(n, E));
    poison(poison_byte);
    scratch.poison();
    args.topk_ids = ids;
    args.num_tokens = T;
    args.top_k = k;
    args.num_experts = E;
    args.tile_rows = tile_rows;
    args.expert_offsets = offsets.get();
    args.row_to_entry = row_to_entry.get();
    args.entry_to_row = entry_to_row.get();
    args.tile_expert = tile_expert.get();
    args.tile_row_start = tile_row_start.get();
    args.num_tiles = num_tiles.get();
    args.scratch = scratch.get();
  }
  bool ok() const {
    return offsets.ok() && row_to_entry.ok() && entry_to_row.ok() && tile_expert.ok() && tile_row_start.ok() &&
           num_tiles.ok() && scratch.ok();
  }
  // Every output (not the scratch) filled with `byte` again.
  void poison(uint8_t byte = 0xFF) {
    for (auto* b : {&offsets, &row_to_entry, &entry_to_row, &tile_expert, &tile_row_start, &num_tiles}) b->poison(byte);
  }
};

}  // namespace fp4moe::test
