// runner/ep_dispatch.cpp — the all-to-all dispatch plan (runner/ep_dispatch.hpp).
#include "runner/ep_dispatch.hpp"

#include <algorithm>
#include <cstring>
#include <limits>

#include "fp4moe/checkpoint.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/expert_parallel.hpp"
#include "fp4moe/format.hpp"

namespace fp4moe::ep {

int owner_rank(int64_t num_experts, int ranks, int64_t expert) {
  if (expert < 0 || expert >= num_experts) return -1;
  // io::expert_range: the first E mod N ranks hold one expert more.
  const int64_t base = num_experts / ranks, rem = num_experts % ranks, big = rem * (base + 1);
  return static_cast<int>(expert < big ? expert / (base + 1) : rem + (expert - big) / base);
}

DispatchPlan plan_dispatch(const int32_t* ids, int64_t num_rows, int rows_top_k, int64_t num_experts, int ranks) {
  check(ranks >= 1 && ranks <= num_experts, "plan_dispatch: ranks must be in [1, E=", num_experts, "], got ", ranks);
  check(num_rows >= 0, "plan_dispatch: num_rows must be >= 0, got ", num_rows);
  check(rows_top_k >= 1, "plan_dispatch: rows_top_k must be >= 1, got ", rows_top_k);
  check(num_rows == 0 || ids != nullptr, "plan_dispatch: ids is null, expected [", num_rows, ", ", rows_top_k, "]");
  DispatchPlan p;
  p.ranks = ranks;
  p.num_rows = num_rows;
  p.rows_top_k = rows_top_k;
  const int64_t k = rows_top_k, entries = num_rows * k;
  std::vector<int64_t> first(static_cast<size_t>(ranks));
  for (int d = 0; d < ranks; ++d) first[d] = io::expert_range(num_experts, d, ranks).first;

  // Counts: a row goes to a rank once however many of its slots that rank holds.
  p.send_offsets.assign(static_cast<size_t>(ranks) + 1, 0);
  p.send_entry_offsets.assign(static_cast<size_t>(ranks) + 1, 0);
  std::vector<char> goes(static_cast<size_t>(ranks));
  for (int64_t s = 0; s < num_rows; ++s) {
    std::fill(goes.begin(), goes.end(), 0);
    for (int64_t j = 0; j < k; ++j)
      if (int d = owner_rank(num_experts, ranks, ids[s * k + j]); d >= 0) goes[d] = 1, ++p.send_entry_offsets[d + 1];
    for (int d = 0; d < ranks; ++d) p.send_offsets[d + 1] += goes[d];
  }
  for (int d = 0; d < ranks; ++d) {
    p.send_offsets[d + 1] += p.send_offsets[d];
    p.send_entry_offsets[d + 1] += p.send_entry_offsets[d];
  }

  p.send_rows.resize(static_cast<size_t>(p.sent()));
  p.send_ids.assign(static_cast<size_t>(p.sent() * k), -1);
  p.gather_index.assign(static_cast<size_t>(entries), -1);
  std::vector<int64_t> fill(p.send_offsets.begin(), p.send_offsets.end() - 1);
  std::vector<int64_t> entry_fill(p.send_entry_offsets.begin(), p.send_entry_offsets.end() - 1);
  std::vector<int64_t> slot_of(static_cast<size_t>(ranks));
  for (int64_t s = 0; s < num_rows; ++s) {
    std::fill(slot_of.begin(), slot_of.end(), -1);
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = ids[s * k + j];
      const int d = owner_rank(num_experts, ranks, e);
      if (d < 0) continue;
      if (slot_of[d] < 0) {
        slot_of[d] = fill[d]++;
        p.send_rows[slot_of[d]] = s;
      }
      p.send_ids[slot_of[d] * k + j] = static_cast<int32_t>(e - first[d]);
      p.gather_index[s * k + j] = entry_fill[d]++;  // rows ascend within d, slots within a row
    }
  }
  return p;
}

std::vector<int64_t> compact_entries(const int32_t* ids, int64_t entries) {
  check(entries >= 0 && (entries == 0 || ids != nullptr), "compact_entries: need ids for ", entries, " entries");
  std::vector<int64_t> out;
  for (int64_t e = 0; e < entries; ++e)
    if (ids[e] >= 0) out.push_back(e);
  return out;
}

std::vector<int64_t> receive_offsets(const std::vector<int64_t>& counts, int ranks, int d) {
  check(ranks >= 1 && counts.size() == size_t(ranks) * size_t(ranks), "receive_offsets: counts must hold ranks^2 = ",
        int64_t(ranks) * ranks, " values, got ", counts.size());
  check(d >= 0 && d < ranks, "receive_offsets: rank must be in [0, ", ranks, "), got ", d);
  std::vector<int64_t> offsets(static_cast<size_t>(ranks) + 1, 0);
  for (int src = 0; src < ranks; ++src) {
    const int64_t n = counts[size_t(src) * ranks + d];
    check(n >= 0, "receive_offsets: count from rank ", src, " to rank ", d, " is negative (", n, ")");
    offsets[src + 1] = offsets[src] + n;
  }
  return offsets;
}

void check_receive_capacity(const std::vector<int64_t>& counts, int ranks, int64_t capacity_rows) {
  for (int d = 0; d < ranks; ++d) {
    const int64_t n = receive_offsets(counts, ranks, d).back();
    check(n <= capacity_rows, "expert-parallel dispatch: rank ", d, " would receive ", n,
          " rows, over the receive capacity of ", capacity_rows, " rows per rank (size the buffers for more tokens)");
  }
}

int64_t dispatch_row_bytes(const MoeProblem& problem, int rows_top_k) {
  const int64_t H = problem.hidden;
  const int64_t row = problem.act_quant == ActQuant::W4A16 ? 2 * H : H / 2 + H / format::kBlockSize;
  return row + 4 * int64_t(rows_top_k);
}

int64_t combine_entry_bytes(const MoeProblem& problem) { return 4 * problem.hidden; }

void pack_rows(const DispatchPlan& plan, int d, const uint8_t* rows, int64_t row_bytes, uint8_t* out) {
  check(d >= 0 && d < plan.ranks, "pack_rows: rank must be in [0, ", plan.ranks, "), got ", d);
  for (int64_t p = plan.send_offsets[d]; p < plan.send_offsets[d + 1]; ++p)
    std::memcpy(out + (p - plan.send_offsets[d]) * row_bytes, rows + plan.send_rows[p] * row_bytes,
                static_cast<size_t>(row_bytes));
}

std::vector<int32_t> localize_ids(const int32_t* ids, int64_t n, int64_t first, int64_t count) {
  check(n == 0 || ids != nullptr, "localize_ids: ids is null, expected ", n);
  std::vector<int32_t> local(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    local[i] = ids[i] >= first && ids[i] < first + count ? static_cast<int32_t>(ids[i] - first) : -1;
  return local;
}

std::vector<float> sum_partials(const float* partials, int ranks, int64_t tokens, int64_t hidden, const int32_t* ids,
                                int top_k, int64_t num_experts) {
  check(ranks >= 1, "sum_partials: ranks must be >= 1, got ", ranks);
  const int64_t n = tokens * hidden;
  std::vector<float> out(static_cast<size_t>(n), 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    float sum = partials[i];
    for (int s = 1; s < ranks; ++s) sum += partials[s * n + i];
    out[i] = sum;
  }
  for (int64_t t = 0; ids && t < tokens; ++t)
    for (int j = 0; j < top_k; ++j)
      if (ids[t * top_k + j] < 0 || ids[t * top_k + j] >= num_experts)
        std::fill(out.begin() + t * hidden, out.begin() + (t + 1) * hidden, std::numeric_limits<float>::quiet_NaN());
  return out;
}

}  // namespace fp4moe::ep

namespace fp4moe {

const char* to_string(ExpertParallelScheme scheme) {
  switch (scheme) {
    case ExpertParallelScheme::AllToAll: return "all_to_all";
    case ExpertParallelScheme::AllGather: return "all_gather";
  }
  return "unknown";
}

ExpertParallelWeights expert_parallel_weights(const MoeProblem& p, const reference::MoeWeights& whole, int rank,
                                              int size) {
  check(size >= 1 && size <= p.num_experts && rank >= 0 && rank < size, "expert_parallel_weights: rank ", rank,
        " of ", size, " ranks (E = ", p.num_experts, ")");
  const int64_t begin = io::expert_range(p.num_experts, rank, size).first;
  const int64_t H = p.hidden, I = p.inter, N13 = p.w13_rows();
  const int64_t block = p.weight_format == WeightFormat::MXFP4 ? 32 : 16;
  auto at = [begin](const auto* v, int64_t per_expert) { return v ? v + begin * per_expert : nullptr; };
  ExpertParallelWeights w;
  reference::MoeWeights& l = w.local;
  l.w13 = at(whole.w13, N13 * H / 2);
  l.w13_scale = at(whole.w13_scale, N13 * H / block);
  l.w13_scale_2 = at(whole.w13_scale_2, 1);
  l.w13_input_scale = at(whole.w13_input_scale, 1);
  l.w2 = at(whole.w2, H * I / 2);
  l.w2_scale = at(whole.w2_scale, H * I / block);
  l.w2_scale_2 = at(whole.w2_scale_2, 1);
  l.w2_input_scale = at(whole.w2_input_scale, 1);
  l.w13_bias = at(whole.w13_bias, N13);
  l.w2_bias = at(whole.w2_bias, H);
  w.layer_w13_input_scale = whole.w13_input_scale;
  w.layer_w2_bias = whole.w2_bias;
  return w;
}

}  // namespace fp4moe
