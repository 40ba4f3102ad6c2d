// tests/runner/ep_dispatch_cpu_test.cpp — the expert-parallel all-to-all plan (runner/ep_dispatch.hpp):
// counts, order, local ids and the combine's gather index, checked against their definitions on random
// and extreme routings, and the dispatch run through the CPU reference on virtual ranks: every entry's
// GEMM2 output comes back equal to the single layer's bit for bit.
#include "runner/ep_dispatch.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "error_message.hpp"
#include "fp4moe/case_file.hpp"
#include "fp4moe/checkpoint.hpp"
#include "fp4moe/expert_parallel.hpp"
#include "fp4moe/presets.hpp"
#include "fp4moe/reference.hpp"
#include "layout_fixtures.hpp"
#include "routing_ids.hpp"

namespace fp4moe {
namespace {

using test::random_ids;

// Every property of the plan, from its definition.
void check_plan(const ep::DispatchPlan& p, const std::vector<int32_t>& ids, int64_t S, int k, int64_t E, int N) {
  ASSERT_EQ(p.send_offsets.size(), size_t(N) + 1);
  ASSERT_EQ(p.send_offsets[0], 0);
  ASSERT_EQ(p.send_entry_offsets.size(), size_t(N) + 1);
  ASSERT_EQ(p.send_entry_offsets[0], 0);
  std::vector<int64_t> first(N);
  for (int d = 0; d < N; ++d) first[d] = io::expert_range(E, d, N).first;
  for (int d = 0; d < N; ++d) {
    // The rows with an id on d, ascending: exactly those sent to d, in that order.
    std::vector<int64_t> want;
    for (int64_t s = 0; s < S; ++s) {
      bool any = false;
      for (int j = 0; j < k; ++j) any |= ep::owner_rank(E, N, ids[s * k + j]) == d;
      if (any) want.push_back(s);
    }
    ASSERT_EQ(p.send_count(d), int64_t(want.size())) << "rank " << d;
    int64_t entry = p.send_entry_offsets[d];  // d's entries in (row, slot) order
    for (size_t i = 0; i < want.size(); ++i) {
      const int64_t pos = p.send_offsets[d] + int64_t(i), s = want[i];
      ASSERT_EQ(p.send_rows[pos], s);
      for (int j = 0; j < k; ++j) {
        const int32_t e = ids[s * k + j];
        const bool here = ep::owner_rank(E, N, e) == d;
        ASSERT_EQ(p.send_ids[pos * k + j], here ? e - int32_t(first[d]) : -1) << "row " << s << " slot " << j;
        if (here) ASSERT_EQ(p.gather_index[s * k + j], entry++);
      }
    }
    ASSERT_EQ(entry, p.send_entry_offsets[d + 1]) << "rank " << d;
  }
  for (int64_t s = 0; s < S; ++s)
    for (int j = 0; j < k; ++j)
      if (ep::owner_rank(E, N, ids[s * k + j]) < 0) ASSERT_EQ(p.gather_index[s * k + j], -1);
}

TEST(EpDispatch, OwnerRankIsTheExpertRangeSplit) {
  for (int64_t E : {1, 2, 7, 8, 64, 257})
    for (int N : {1, 2, 3, 4, 8})
      if (N <= E)
        for (int d = 0; d < N; ++d) {
          const auto [begin, end] = io::expert_range(E, d, N);
          for (int64_t e = begin; e < end; ++e) ASSERT_EQ(ep::owner_rank(E, N, e), d) << "E=" << E << " N=" << N;
        }
  EXPECT_EQ(ep::owner_rank(8, 2, -1), -1);
  EXPECT_EQ(ep::owner_rank(8, 2, 8), -1);
}

TEST(EpDispatch, RandomRoutingsOnTwoFourAndEightRanks) {
  for (int N : {2, 4, 8})
    for (int64_t S : {0, 1, 37, 4096})
      for (int k : {1, 2, 8}) {
        const int64_t E = 64;
        const std::vector<int32_t> ids = random_ids(S, k, E, 1000 * N + S + k, /*invalid=*/0.05);
        const ep::DispatchPlan p = ep::plan_dispatch(ids.data(), S, k, E, N);
        SCOPED_TRACE("N=" + std::to_string(N) + " S=" + std::to_string(S) + " k=" + std::to_string(k));
        check_plan(p, ids, S, k, E, N);
      }
}

TEST(EpDispatch, ARankThatGetsNothingAndOneThatGetsEverything) {
  const int64_t E = 16, S = 37;
  const int k = 2, N = 4;
  std::vector<int32_t> ids(S * k);
  for (int64_t s = 0; s < S; ++s) ids[s * k] = s % 4, ids[s * k + 1] = 4 + s % 4;  // ranks 0 and 1 only
  const ep::DispatchPlan p = ep::plan_dispatch(ids.data(), S, k, E, N);
  check_plan(p, ids, S, k, E, N);
  EXPECT_EQ(p.send_count(0), S);
  EXPECT_EQ(p.send_count(1), S);
  EXPECT_EQ(p.send_count(2), 0);
  EXPECT_EQ(p.send_count(3), 0);
  // Both slots on one rank: the row goes there once, with both local ids.
  for (int64_t s = 0; s < S; ++s) ids[s * k] = 12, ids[s * k + 1] = 15;
  const ep::DispatchPlan q = ep::plan_dispatch(ids.data(), S, k, E, N);
  check_plan(q, ids, S, k, E, N);
  EXPECT_EQ(q.sent(), S);
  EXPECT_EQ(q.send_count(3), S);
  EXPECT_EQ(q.entry_count(3), 2 * S);  // both slots come back
  EXPECT_EQ(q.send_ids[0], 0);
  EXPECT_EQ(q.send_ids[1], 3);
  // Only invalid ids: nothing is sent, nothing is gathered.
  std::fill(ids.begin(), ids.end(), -1);
  const ep::DispatchPlan r = ep::plan_dispatch(ids.data(), S, k, E, N);
  EXPECT_EQ(r.sent(), 0);
  EXPECT_EQ(r.entries_sent(), 0);
  for (int64_t g : r.gather_index) EXPECT_EQ(g, -1);
}

TEST(EpDispatch, CompactEntriesAreTheSlotsWithALocalId) {
  const int32_t ids[7] = {-1, 3, 0, -1, -1, 2, 7};
  EXPECT_EQ(ep::compact_entries(ids, 7), (std::vector<int64_t>{1, 2, 5, 6}));
  EXPECT_TRUE(ep::compact_entries(ids, 1).empty());
  EXPECT_TRUE(ep::compact_entries(nullptr, 0).empty());
  expect_error([] { ep::compact_entries(nullptr, 3); }, "compact_entries: need ids for 3 entries");
}

TEST(EpDispatch, WireBytesPerRow) {
  MoeProblem p = preset("deepseek-r1", ActQuant::W4A4Scalar);  // H = 7168, k = 8
  EXPECT_EQ(ep::dispatch_row_bytes(p, 8), 7168 / 2 + 7168 / 16 + 8 * 4);
  EXPECT_EQ(ep::dispatch_row_bytes(p, 1), 7168 / 2 + 7168 / 16 + 4);
  p.act_quant = ActQuant::W4A16;
  EXPECT_EQ(ep::dispatch_row_bytes(p, 8), 2 * 7168 + 8 * 4);
  EXPECT_EQ(ep::combine_entry_bytes(p), 4 * 7168);
}

// expert_parallel_weights' views hold exactly the bytes of the rank's experts (the tests' copies).
TEST(EpDispatch, ExpertParallelWeightsAreTheRanksExperts) {
  MoeProblem nvfp4 = preset("tiny", ActQuant::W4A4PerExpert);
  nvfp4.num_experts = 7;
  MoeProblem mxfp4 = nvfp4;
  mxfp4.act_quant = ActQuant::W4A16;
  mxfp4.weight_format = WeightFormat::MXFP4;
  for (const MoeProblem& p : {nvfp4, mxfp4}) {
    io::MoeCase c = io::make_random_packed_case(p, 0, 21);
    io::add_random_expert_biases(c, 22);
    const reference::MoeWeights whole = c.weights();
    for (int N : {1, 3, 7})
      for (int r = 0; r < N; ++r) {
        const auto [begin, end] = io::expert_range(p.num_experts, r, N);
        const test::ExpertRangeWeights want(c, begin, end, {});
        const ExpertParallelWeights got = expert_parallel_weights(p, whole, r, N);
        auto same = [](const auto* view, const auto& v) {
          return v.empty() ? view == nullptr : view != nullptr && std::memcmp(view, v.data(), v.size() * sizeof(v[0])) == 0;
        };
        const std::string at = "rank " + std::to_string(r) + " of " + std::to_string(N);
        EXPECT_TRUE(same(got.local.w13, want.w13)) << at;
        EXPECT_TRUE(same(got.local.w13_scale, want.w13_scale)) << at;
        EXPECT_TRUE(same(got.local.w13_scale_2, want.w13_scale_2)) << at;
        EXPECT_TRUE(same(got.local.w13_input_scale, want.w13_input_scale)) << at;
        EXPECT_TRUE(same(got.local.w2, want.w2)) << at;
        EXPECT_TRUE(same(got.local.w2_scale, want.w2_scale)) << at;
        EXPECT_TRUE(same(got.local.w2_scale_2, want.w2_scale_2)) << at;
        EXPECT_TRUE(same(got.local.w2_input_scale, want.w2_input_scale)) << at;
        EXPECT_TRUE(same(got.local.w13_bias, want.w13_bias)) << at;
        EXPECT_TRUE(same(got.local.w2_bias, want.w2_bias)) << at;
        EXPECT_EQ(got.layer_w13_input_scale, whole.w13_input_scale) << at;
        EXPECT_EQ(got.layer_w2_bias, whole.w2_bias) << at;
      }
  }
  EXPECT_THROW(expert_parallel_weights(nvfp4, reference::MoeWeights{}, 3, 3), Error);
  EXPECT_THROW(expert_parallel_weights(nvfp4, reference::MoeWeights{}, 0, 8), Error);
}

// The all-gather scheme's two host oracles, from their definitions.
TEST(EpDispatch, LocalizeIdsAndSumPartialsInRankOrder) {
  const std::vector<int32_t> ids = {0, 4, 5, 7, 8, -1, 16, 6};
  EXPECT_EQ(ep::localize_ids(ids.data(), 8, 4, 3), (std::vector<int32_t>{-1, 0, 1, -1, -1, -1, -1, 2}));
  // fp32 adds in rank order: (1e8 + 1) - 1e8 = 0 in fp32, where another order would give 1.
  const std::vector<float> partials = {1e8f, 2.0f, 1.0f, 3.0f, -1e8f, 4.0f};  // 3 ranks, T = 1, H = 2
  const std::vector<float> sum = ep::sum_partials(partials.data(), 3, 1, 2);
  EXPECT_EQ(sum[0], (1e8f + 1.0f) + -1e8f);
  EXPECT_EQ(sum[1], 9.0f);
  const std::vector<int32_t> token_ids = {3, 16};  // T = 1, k = 2: 16 is outside [0, 16)
  const std::vector<float> bad = ep::sum_partials(partials.data(), 3, 1, 2, token_ids.data(), 2, 16);
  EXPECT_TRUE(std::isnan(bad[0]) && std::isnan(bad[1]));
  EXPECT_STREQ(to_string(ExpertParallelScheme::AllGather), "all_gather");
}

TEST(EpDispatch, PackGathersTheRowsOfOneRank) {
  const int64_t E = 8, S = 9, row_bytes = 5;
  const int k = 2, N = 2;
  const std::vector<int32_t> ids = random_ids(S, k, E, 3);
  const ep::DispatchPlan p = ep::plan_dispatch(ids.data(), S, k, E, N);
  std::vector<uint8_t> rows(S * row_bytes);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<uint8_t>(i * 7 + 1);
  for (int d = 0; d < N; ++d) {
    std::vector<uint8_t> out(p.send_count(d) * row_bytes, 0xEE);
    ep::pack_rows(p, d, rows.data(), row_bytes, out.data());
    for (int64_t i = 0; i < p.send_count(d); ++i)
      ASSERT_EQ(std::memcmp(out.data() + i * row_bytes, rows.data() + p.send_rows[p.send_offsets[d] + i] * row_bytes, row_bytes), 0);
  }
}

TEST(EpDispatch, ArgumentErrors) {
  const int32_t ids[2] = {0, 1};
  expect_error([&] { ep::plan_dispatch(ids, 1, 2, 4, 0); }, "plan_dispatch: ranks must be in [1, E=4], got 0");
  expect_error([&] { ep::plan_dispatch(ids, 1, 2, 4, 5); }, "plan_dispatch: ranks must be in [1, E=4], got 5");
  expect_error([&] { ep::plan_dispatch(ids, 1, 0, 4, 2); }, "plan_dispatch: rows_top_k must be >= 1, got 0");
  expect_error([&] { ep::plan_dispatch(nullptr, 1, 2, 4, 2); }, "plan_dispatch: ids is null, expected [1, 2]");
  const ep::DispatchPlan p = ep::plan_dispatch(ids, 1, 2, 4, 2);
  uint8_t row = 0;
  expect_error([&] { ep::pack_rows(p, 2, &row, 1, &row); }, "pack_rows: rank must be in [0, 2), got 2");
}

// A virtual rank's experts on the n rows it received (bf16 hidden, the plan's local ids): the reference's
// GEMM2 output per entry, [n * rows_top_k, H].
std::vector<float> rank_gemm2_out(const test::ExpertRangeWeights& local, int64_t n, const uint16_t* rows,
                                  const std::vector<int32_t>& ids) {
  const std::vector<float> weights(ids.size(), 1.0f);  // the finalize, which applies them, is the source's
  reference::RouterInput router;
  router.topk_ids = ids.data();
  router.topk_weights = weights.data();
  reference::MoeTrace trace;
  (void)reference::moe_forward(local.problem, n, rows, router, local.weights(), &trace);
  return trace.gemm2_out;
}

// The dispatch through the CPU reference on N virtual ranks: the rows each rank receives, run with its
// experts and the plan's local ids, give back every entry's GEMM2 output equal to the single layer's.
// Per-token rows carry bf16 hidden states (the reference quantizes them as prepare would: w4a4_scalar
// with the whole layer's largest input scale); w4a4_per_expert sends one row per entry (rows_top_k 1).
class EpDispatchLayer : public ::testing::TestWithParam<std::tuple<ActQuant, int>> {};

TEST_P(EpDispatchLayer, EveryEntryComesBackAsTheSingleLayerComputesIt) {
  const auto [mode, N] = GetParam();
  const MoeProblem p = preset("tiny", mode);  // E = 8, k = 2
  const int64_t T = 37, H = p.hidden, k = p.top_k(), E = p.num_experts;
  const io::MoeCase c = io::make_random_packed_case(p, T, 91);
  reference::MoeTrace whole;
  const reference::MoeResult full = reference::moe_forward(p, T, c.hidden_states.data(), c.router(), c.weights(), &whole);

  const bool per_entry = mode == ActQuant::W4A4PerExpert;
  const int rk = per_entry ? 1 : static_cast<int>(k);
  const int64_t S = per_entry ? T * k : T;
  std::vector<uint16_t> rows(static_cast<size_t>(S * H));  // the prepared rows' inputs (bf16 hidden)
  for (int64_t s = 0; s < S; ++s)
    std::memcpy(&rows[s * H], &c.hidden_states[(per_entry ? s / k : s) * H], H * 2);
  const ep::DispatchPlan plan = ep::plan_dispatch(full.topk_ids.data(), S, rk, E, N);

  std::vector<float> combined;  // the ranks' returned y, in rank order
  for (int d = 0; d < N; ++d) {
    const auto [begin, end] = io::expert_range(E, d, N);
    test::ExpertRangeWeights local(c, begin, end, full.topk_ids);
    local.problem.routing.top_k = rk;
    const int64_t n = plan.send_count(d);
    std::vector<uint16_t> received(static_cast<size_t>(n * H));
    ep::pack_rows(plan, d, reinterpret_cast<const uint8_t*>(rows.data()), H * 2, reinterpret_cast<uint8_t*>(received.data()));
    const std::vector<int32_t> ids(plan.send_ids.begin() + plan.send_offsets[d] * rk, plan.send_ids.begin() + plan.send_offsets[d + 1] * rk);
    const std::vector<float> y = rank_gemm2_out(local, n, received.data(), ids);
    for (int64_t e : ep::compact_entries(ids.data(), int64_t(ids.size())))  // what rank d returns
      combined.insert(combined.end(), y.begin() + e * H, y.begin() + (e + 1) * H);
  }
  ASSERT_EQ(int64_t(combined.size()), plan.entries_sent() * H);
  for (int64_t entry = 0; entry < T * k; ++entry) {
    const int64_t g = plan.gather_index[entry];
    ASSERT_GE(g, 0);
    ASSERT_EQ(std::memcmp(&combined[g * H], &whole.gemm2_out[entry * H], H * sizeof(float)), 0) << "entry " << entry;
  }
}

INSTANTIATE_TEST_SUITE_P(ModesAndRanks, EpDispatchLayer,
                         ::testing::Combine(::testing::Values(ActQuant::W4A16, ActQuant::W4A4Scalar, ActQuant::W4A4PerExpert),
                                            ::testing::Values(2, 4, 8)));

TEST(EpDispatch, ReceiveOffsetsAndCapacity) {
  // counts[src * 3 + dst]
  const std::vector<int64_t> counts = {1, 0, 4,   //
                                       2, 5, 0,   //
                                       3, 0, 6};
  EXPECT_EQ(ep::receive_offsets(counts, 3, 0), (std::vector<int64_t>{0, 1, 3, 6}));
  EXPECT_EQ(ep::receive_offsets(counts, 3, 1), (std::vector<int64_t>{0, 0, 5, 5}));
  EXPECT_EQ(ep::receive_offsets(counts, 3, 2), (std::vector<int64_t>{0, 4, 4, 10}));
  ep::check_receive_capacity(counts, 3, 10);
  expect_error([&] { ep::check_receive_capacity(counts, 3, 9); },
               "expert-parallel dispatch: rank 2 would receive 10 rows, over the receive capacity of 9 rows per rank");
  expect_error([&] { ep::receive_offsets({1, 2}, 3, 0); }, "receive_offsets: counts must hold ranks^2 = 9 values, got 2");
  expect_error([&] { ep::receive_offsets(counts, 3, 3); }, "receive_offsets: rank must be in [0, 3), got 3");
}

// Every rank a source of its own tokens: each rank receives the rows of every source (source-major),
// runs its experts on them, and returns each source its block; every source's entries come back as
// its single layer computes them.
TEST(EpDispatch, EveryRankASourceOnFourVirtualRanks) {
  const MoeProblem p = preset("tiny", ActQuant::W4A4Scalar);  // E = 8, k = 2
  const int N = 4;
  const int64_t H = p.hidden, k = p.top_k(), E = p.num_experts;
  const int64_t tokens[N] = {37, 0, 1, 64}, first[N + 1] = {0, 37, 37, 38, 102};  // rank r: tokens [first[r], first[r+1])
  const io::MoeCase c = io::make_random_packed_case(p, first[N], 5);
  reference::MoeTrace whole;
  const reference::MoeResult full = reference::moe_forward(p, first[N], c.hidden_states.data(), c.router(), c.weights(), &whole);
  std::vector<ep::DispatchPlan> plans;
  std::vector<int64_t> counts(N * N);
  for (int r = 0; r < N; ++r) {
    plans.push_back(ep::plan_dispatch(full.topk_ids.data() + first[r] * k, tokens[r], int(k), E, N));
    for (int d = 0; d < N; ++d) counts[r * N + d] = plans[r].send_count(d);
  }
  // returned[d][src]: the y rank d returns to source src, [entries, H].
  std::vector<std::vector<std::vector<float>>> returned(N, std::vector<std::vector<float>>(N));
  for (int d = 0; d < N; ++d) {
    const std::vector<int64_t> offsets = ep::receive_offsets(counts, N, d);
    const int64_t n = offsets.back();
    std::vector<uint16_t> received(static_cast<size_t>(n * H));
    std::vector<int32_t> ids;
    for (int src = 0; src < N; ++src) {
      ep::pack_rows(plans[src], d, reinterpret_cast<const uint8_t*>(c.hidden_states.data() + first[src] * H), H * 2,
                    reinterpret_cast<uint8_t*>(received.data() + offsets[src] * H));
      ids.insert(ids.end(), plans[src].send_ids.begin() + plans[src].send_offsets[d] * k,
                 plans[src].send_ids.begin() + plans[src].send_offsets[d + 1] * k);
    }
    if (n == 0) continue;
    const auto [begin, end] = io::expert_range(E, d, N);
    const test::ExpertRangeWeights local(c, begin, end, full.topk_ids);
    const std::vector<float> y = rank_gemm2_out(local, n, received.data(), ids);
    for (int64_t e : ep::compact_entries(ids.data(), int64_t(ids.size()))) {
      const int64_t row = e / k;
      const int src = int(std::upper_bound(offsets.begin(), offsets.end(), row) - offsets.begin()) - 1;
      returned[d][src].insert(returned[d][src].end(), y.begin() + e * H, y.begin() + (e + 1) * H);
    }
  }
  for (int src = 0; src < N; ++src) {
    std::vector<float> combined;
    for (int d = 0; d < N; ++d) combined.insert(combined.end(), returned[d][src].begin(), returned[d][src].end());
    ASSERT_EQ(int64_t(combined.size()), plans[src].entries_sent() * H);
    for (int64_t entry = 0; entry < tokens[src] * k; ++entry) {
      const int64_t g = plans[src].gather_index[entry];
      ASSERT_GE(g, 0);
      ASSERT_EQ(std::memcmp(&combined[g * H], &whole.gemm2_out[(first[src] * k + entry) * H], H * sizeof(float)), 0)
          << "source " << src << " entry " << entry;
    }
  }
}

}  // namespace
}  // namespace fp4moe
