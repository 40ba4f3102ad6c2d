// runner/ep_dispatch.hpp — expert-parallel all-to-all: which prepared rows go to which rank, and where
// each entry's expert output comes back from (CPU code, no CUDA; the oracle of the device-side plan).
//
// The layer over N ranks, rank r holding experts io::expert_range(E, r, N):
//   1. prepare (MoeRunner::prepare) on the token's rank: S rows of rows_top_k ids each (one row per
//      token, or one per entry with per-expert input scales; runner.hpp, StageRows).
//   2. dispatch: a row goes once to every rank that holds one of its ids, with the ids mapped to that
//      rank's local ids and every other slot marked -1 (no GEMM row there). Sent rows are
//      destination-major, in ascending source row within a destination.
//   3. experts (MoeRunner::experts) on each rank over the rows it received, concatenated in source
//      rank order: y [rows * rows_top_k, H] fp32 per entry.
//   4. combine: each rank returns the y of the entries it computed (the slots of its received rows that
//      have a local id, compact_entries), in the order it received them; the source gathers entry
//      (s, j)'s y from its expert's rank (gather_index), then finalizes with the global ids and weights:
//      the same y and the same slot-ordered sum as the single-GPU layer.
#pragma once

#include <cstdint>
#include <vector>

#include "fp4moe/problem.hpp"

namespace fp4moe::ep {

// The rank of `ranks` holding expert e (io::expert_range's split), -1 for an id outside [0, E).
int owner_rank(int64_t num_experts, int ranks, int64_t expert);

// One source rank's dispatch of its prepared rows.
struct DispatchPlan {
  int ranks = 1;
  int64_t num_rows = 0;               // S: the source's prepared rows
  int rows_top_k = 0;                 // ids per row
  std::vector<int64_t> send_offsets;  // [ranks + 1]: rows for rank d are [send_offsets[d], send_offsets[d+1])
  std::vector<int64_t> send_rows;     // [sent]: the source row of each sent row
  std::vector<int32_t> send_ids;      // [sent * rows_top_k]: the destination's local expert ids, -1 elsewhere
  // [ranks + 1]: the entries (slots with a local id) of the rows for rank d are
  // [send_entry_offsets[d], send_entry_offsets[d+1]): what rank d computes and returns.
  std::vector<int64_t> send_entry_offsets;
  // [S * rows_top_k]: where entry (s, j)'s y is in the combined y (the ranks' returned entries concatenated
  // in rank order, each rank's in (sent row, slot) order); -1 for an id outside [0, E).
  std::vector<int64_t> gather_index;

  int64_t sent() const { return send_offsets.empty() ? 0 : send_offsets.back(); }
  int64_t send_count(int d) const { return send_offsets[d + 1] - send_offsets[d]; }
  int64_t entries_sent() const { return send_entry_offsets.empty() ? 0 : send_entry_offsets.back(); }
  int64_t entry_count(int d) const { return send_entry_offsets[d + 1] - send_entry_offsets[d]; }
};

// The plan for S rows with ids [S, rows_top_k] over experts [0, E) on `ranks` ranks.
DispatchPlan plan_dispatch(const int32_t* ids, int64_t num_rows, int rows_top_k, int64_t num_experts, int ranks);

// The rows every rank receives, from the send counts of every source (counts[src * ranks + dst], what the
// count exchange gives each rank): rows from source src land on rank d at rows
// [offsets[src], offsets[src + 1]) of d's received rows (source-major), offsets = receive_offsets(.., d).
std::vector<int64_t> receive_offsets(const std::vector<int64_t>& counts, int ranks, int d);

// The entries a rank computes from its received rows' local ids [entries]: the indices with an id >= 0,
// ascending (the order the combine returns their y in).
std::vector<int64_t> compact_entries(const int32_t* ids, int64_t entries);

// A fixed receive capacity (rows per rank, the buffers sized once): throws fp4moe::Error naming the rank
// and its count when a rank would receive more, before anything is sent.
void check_receive_capacity(const std::vector<int64_t>& counts, int ranks, int64_t capacity_rows);

// Bytes on the wire per sent row: the row (NVFP4: H/2 packed values + H/16 e4m3 scales; bf16: 2H) and
// its rows_top_k int32 ids. Router weights stay on the source rank (its finalize applies them).
int64_t dispatch_row_bytes(const MoeProblem& problem, int rows_top_k);
// Bytes on the wire per returned entry: its fp32 y row (4H).
int64_t combine_entry_bytes(const MoeProblem& problem);

// The rows of one destination, gathered into `out` (send_count(d) rows of row_bytes each), from
// `rows` (S rows of row_bytes each): the host form of the packing the device does per destination.
void pack_rows(const DispatchPlan& plan, int d, const uint8_t* rows, int64_t row_bytes, uint8_t* out);

// ---- the all-gather scheme (every rank gets every row; fp32 partial outputs summed on the token's rank)
// A rank's local ids of the whole layer's ids [n]: id - first where first <= id < first + count, else -1.
std::vector<int32_t> localize_ids(const int32_t* ids, int64_t n, int64_t first, int64_t count);
// out[t, h] = the sum over s = 0, 1, ..., ranks - 1 in that order of partials[s, t, h] (fp32 adds):
// rank s's partial output for this rank's T tokens, as the reduce-scatter's all-to-all delivers them;
// with ids [T, top_k], a token with an id outside [0, num_experts) gets a NaN row.
std::vector<float> sum_partials(const float* partials, int ranks, int64_t tokens, int64_t hidden,
                                const int32_t* ids = nullptr, int top_k = 0, int64_t num_experts = 0);

}  // namespace fp4moe::ep
