// tests/kernels/ep_dispatch_test.cu — the device-side expert-parallel plan and row gathers
// (kernels/ep_dispatch.cu) against the CPU plan (runner/ep_dispatch.hpp): every output equal, on random
// routings with invalid ids, on a rank that gets nothing and one that gets every row, for N = 2, 4, 8;
// outputs poisoned before each launch.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <cstring>
#include <vector>

#include "kernels/gpu_test_util.hpp"
#include "fp4moe/format.hpp"
#include "kernels/launch.hpp"
#include "runner/ep_dispatch.hpp"
#include "routing_ids.hpp"

namespace fp4moe {
namespace {

using test::DeviceBuffer;
using test::random_ids;

template <typename A, typename B>
void expect_same(const std::vector<A>& got, const std::vector<B>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(int64_t(got[i]), int64_t(want[i])) << what << "[" << i << "]";
}

// The device plan of ids [S, k] over N ranks equals ep::plan_dispatch's; then the pack (send_rows) and
// the combine gather (gather_index) move the rows the CPU pack_rows moves.
void check_device_plan(const std::vector<int32_t>& ids, int S, int k, int E, int N) {
  SCOPED_TRACE("N=" + std::to_string(N) + " S=" + std::to_string(S) + " k=" + std::to_string(k) + " E=" + std::to_string(E));
  const ep::DispatchPlan want = ep::plan_dispatch(ids.data(), S, k, E, N);
  const int cap = std::max(1, S * std::min(N, k));
  DeviceBuffer<int32_t> d_ids(std::max<size_t>(ids.size(), 1)), offsets(N + 1), rows(cap), send_ids(size_t(cap) * k),
      entry_offsets(N + 1), gather(std::max(1, S * k));
  d_ids.upload(ids);
  for (auto* b : {&offsets, &rows, &send_ids, &entry_offsets, &gather}) b->poison();
  kernels::EpPlanArgs a;
  a.ids = d_ids.get();
  a.num_rows = S;
  a.rows_top_k = k;
  a.num_experts = E;
  a.ranks = N;
  a.send_offsets = offsets.get();
  a.send_rows = rows.get();
  a.send_ids = send_ids.get();
  a.send_entry_offsets = entry_offsets.get();
  a.gather_index = gather.get();
  CUDA_ASSERT(kernels::launch_ep_plan(a, nullptr));
  CUDA_ASSERT(cudaDeviceSynchronize());
  const std::vector<int32_t> got_offsets = offsets.download();
  expect_same(got_offsets, want.send_offsets, "send_offsets");
  expect_same(entry_offsets.download(), want.send_entry_offsets, "send_entry_offsets");
  const size_t sent = size_t(want.sent());
  expect_same(rows.download(sent), want.send_rows, "send_rows");
  expect_same(send_ids.download(sent * k), want.send_ids, "send_ids");
  expect_same(gather.download(size_t(S) * k), want.gather_index, "gather_index");

  // Pack, with row sizes that take each copy word: 16-byte (NVFP4 values of H = 7168), 4-byte, 1-byte.
  for (int64_t row_bytes : {int64_t(3584), int64_t(12), int64_t(5)}) {
    std::vector<uint8_t> src(size_t(std::max(1, S)) * row_bytes);
    for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 131 + 7);
    DeviceBuffer<uint8_t> d_src(src), d_dst(size_t(cap) * row_bytes);
    d_dst.poison(0xA5);
    kernels::GatherRowsArgs g;
    g.index = rows.get();
    g.max_rows = cap;
    g.device_count = offsets.get() + N;  // the plan's total, read on the device
    g.src = d_src.get();
    g.dst = d_dst.get();
    g.row_bytes = row_bytes;
    CUDA_ASSERT(kernels::launch_gather_rows(g, nullptr));
    const std::vector<uint8_t> got = d_dst.download();
    std::vector<uint8_t> packed;
    for (int d = 0; d < N; ++d) {
      std::vector<uint8_t> one(size_t(want.send_count(d) * row_bytes));
      ep::pack_rows(want, d, src.data(), row_bytes, one.data());
      packed.insert(packed.end(), one.begin(), one.end());
    }
    ASSERT_EQ(std::memcmp(got.data(), packed.data(), packed.size()), 0) << "pack, row_bytes " << row_bytes;
    for (size_t i = packed.size(); i < got.size(); ++i) ASSERT_EQ(got[i], 0xA5) << "past the sent rows, byte " << i;
  }

  // The combine: entry e's row of the combined y (the returned entries in rank order) back at entry e;
  // entries with an invalid id keep their poison.
  const int64_t H = 24;  // fp32 rows of 96 bytes
  std::vector<float> combined(std::max<size_t>(size_t(want.entries_sent()), 1) * H);
  for (size_t i = 0; i < combined.size(); ++i) combined[i] = float(i) * 0.5f + 1.0f;
  DeviceBuffer<float> d_combined(combined), y(size_t(std::max(1, S * k)) * H);
  y.poison();
  kernels::GatherRowsArgs g;
  g.index = gather.get();
  g.max_rows = S * k;
  g.src = d_combined.get();
  g.dst = y.get();
  g.row_bytes = H * 4;
  CUDA_ASSERT(kernels::launch_gather_rows(g, nullptr));
  const std::vector<float> got = y.download();
  for (int64_t e = 0; e < int64_t(S) * k; ++e) {
    const int64_t from = want.gather_index[e];
    for (int64_t h = 0; h < H; ++h)
      ASSERT_EQ(test::float_bits(got[e * H + h]), from < 0 ? 0xFFFFFFFFu : test::float_bits(combined[from * H + h]))
          << "entry " << e << " element " << h;
  }
}

TEST(EpDispatchKernel, RandomRoutingsEqualTheCpuPlan) {
  FP4MOE_REQUIRE_SM90();
  for (int N : {2, 4, 8})
    for (int S : {0, 1, 37, 4096, 5000})
      for (int k : {1, 2, 8})
        for (int E : {64, 257}) {
          const std::vector<int32_t> ids = random_ids(S, k, E, 7919u * N + 31u * S + 7u * k + E, 0.05);
          check_device_plan(ids, S, k, E, N);
          if (HasFatalFailure()) return;
        }
}

TEST(EpDispatchKernel, ARankThatGetsNothingAndOneThatGetsEverything) {
  FP4MOE_REQUIRE_SM90();
  const int E = 16, S = 37, k = 2, N = 4;
  std::vector<int32_t> ids(S * k);
  for (int s = 0; s < S; ++s) ids[s * k] = s % 4, ids[s * k + 1] = 4 + s % 4;  // ranks 0 and 1 only
  check_device_plan(ids, S, k, E, N);
  for (int s = 0; s < S; ++s) ids[s * k] = 12, ids[s * k + 1] = 15;  // both slots on rank 3
  check_device_plan(ids, S, k, E, N);
  std::fill(ids.begin(), ids.end(), -1);  // nothing sent, nothing gathered
  check_device_plan(ids, S, k, E, N);
  check_device_plan(std::vector<int32_t>(size_t(S), 3), S, 1, E, 8);  // one row per entry, all on rank 1
}

// A destination's entries with a local id, listed on the device as ep::compact_entries lists them.
TEST(EpDispatchKernel, CompactEntriesEqualTheCpuList) {
  FP4MOE_REQUIRE_SM90();
  for (int n : {1, 37, 1024, 5000, 65536})
    for (double invalid : {0.0, 0.5, 1.0}) {
      SCOPED_TRACE("entries=" + std::to_string(n) + " invalid=" + std::to_string(invalid));
      const std::vector<int32_t> ids = random_ids(n, 1, 16, 17u * n + unsigned(invalid * 10), invalid);
      const std::vector<int64_t> want = ep::compact_entries(ids.data(), n);
      DeviceBuffer<int32_t> d_ids(ids), list(static_cast<size_t>(n));
      list.poison();
      kernels::CompactEntriesArgs a;
      a.ids = d_ids.get();
      a.num_entries = n;
      a.list = list.get();
      CUDA_ASSERT(kernels::launch_compact_entries(a, nullptr));
      const std::vector<int32_t> got = list.download();
      expect_same(std::vector<int32_t>(got.begin(), got.begin() + int64_t(want.size())), want, "list");
      for (size_t i = want.size(); i < got.size(); ++i) ASSERT_EQ(uint32_t(got[i]), 0xFFFFFFFFu) << "past the list, " << i;
    }
}

TEST(EpDispatchKernel, LocalizeIdsEqualTheCpuMap) {
  FP4MOE_REQUIRE_SM90();
  for (int n : {1, 37, 5000, 100000})
    for (auto [first, count] : {std::pair<int, int>{0, 16}, {5, 3}, {15, 1}}) {
      SCOPED_TRACE("ids=" + std::to_string(n) + " experts [" + std::to_string(first) + ", " + std::to_string(first + count) + ")");
      const std::vector<int32_t> ids = random_ids(n, 1, 16, 31u * n + unsigned(first), 0.1);  // 10% outside [0, E)
      const std::vector<int32_t> want = ep::localize_ids(ids.data(), n, first, count);
      DeviceBuffer<int32_t> d_ids(ids), local(static_cast<size_t>(n));
      local.poison();
      kernels::LocalizeIdsArgs a;
      a.ids = d_ids.get();
      a.num_ids = n;
      a.first_expert = first;
      a.num_local_experts = count;
      a.local = local.get();
      CUDA_ASSERT(kernels::launch_localize_ids(a, nullptr));
      expect_same(local.download(), want, "local ids");
    }
}

// The ranks' partials summed in rank order: the same fp32 bits as the CPU sum, rounded once to bf16 (or
// kept fp32), and a NaN row for a token with an id outside [0, E).
TEST(EpDispatchKernel, SumPartialsEqualTheCpuSums) {
  FP4MOE_REQUIRE_SM90();
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int N : {1, 2, 8})
    for (int T : {1, 37, 1000}) {
      SCOPED_TRACE("N=" + std::to_string(N) + " T=" + std::to_string(T));
      const int H = 264, k = 4, E = 16;
      std::vector<float> partials(size_t(N) * T * H);
      for (float& v : partials) v = normal(rng) * 100.0f;
      const std::vector<int32_t> ids = random_ids(T, k, E, unsigned(N * 1000 + T), 0.02);
      const std::vector<float> want = ep::sum_partials(partials.data(), N, T, H, ids.data(), k, E);
      DeviceBuffer<float> d_partials(partials), out_f32(size_t(T) * H);
      DeviceBuffer<int32_t> d_ids(ids);
      DeviceBuffer<uint16_t> out(size_t(T) * H);
      out_f32.poison();
      out.poison();
      kernels::SumPartialsArgs a;
      a.partials = d_partials.get();
      a.ranks = N;
      a.num_tokens = T;
      a.hidden_size = H;
      a.topk_ids = d_ids.get();
      a.top_k = k;
      a.num_experts = E;
      a.out_f32 = out_f32.get();
      CUDA_ASSERT(kernels::launch_sum_partials(a, nullptr));
      a.out_f32 = nullptr;
      a.out = reinterpret_cast<__nv_bfloat16*>(out.get());
      CUDA_ASSERT(kernels::launch_sum_partials(a, nullptr));
      const std::vector<float> got_f32 = out_f32.download();
      const std::vector<uint16_t> got = out.download();
      for (size_t i = 0; i < want.size(); ++i) {
        if (std::isnan(want[i])) {
          ASSERT_TRUE(std::isnan(got_f32[i]) && std::isnan(format::bf16_to_float(got[i]))) << "element " << i;
          continue;
        }
        uint32_t w, g;
        std::memcpy(&w, &want[i], 4);
        std::memcpy(&g, &got_f32[i], 4);
        ASSERT_EQ(g, w) << "fp32 element " << i;
        ASSERT_EQ(got[i], format::bf16_from_float(want[i])) << "bf16 element " << i;
      }
    }
  kernels::SumPartialsArgs bad;
  bad.ranks = 1;
  bad.num_tokens = 1;
  bad.hidden_size = 6;  // not a multiple of 4
  EXPECT_EQ(kernels::launch_sum_partials(bad, nullptr), cudaErrorInvalidValue);
}

TEST(EpDispatchKernel, OneRankPerExpert) {
  FP4MOE_REQUIRE_SM90();
  const std::vector<int32_t> ids = random_ids(300, 4, 8, 5, 0.1);
  check_device_plan(ids, 300, 4, 8, 8);
}

}  // namespace
}  // namespace fp4moe
