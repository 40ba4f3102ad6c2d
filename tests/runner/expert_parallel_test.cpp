// tests/runner/expert_parallel_test.cpp — the expert-parallel layer with all-to-all dispatch and combine,
// and its all-gather scheme (ExpertParallelAllGather.*: within the layer tolerance, exact on one rank)
// (fp4moe/expert_parallel.hpp) on N virtual ranks of one GPU, against the single-GPU layer on the same
// tokens: with every rank's experts on the single layer's tactic the outputs, ids and weights are equal
// bit for bit (docs/numerics.md, "Expert parallelism"); with each rank's own tactic, within the layer
// tolerance. Every quantization mode, every routing method, biases and MXFP4 weights, T = 0, 1, 37 and
// 4096 per rank, a rank that receives nothing and one that receives everything, the receive capacity,
// the traffic against the CPU plan and bad arguments. Outputs poisoned before each run.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "error_message.hpp"
#include "fp4moe/case_file.hpp"
#include "fp4moe/checkpoint.hpp"
#include "fp4moe/expert_parallel.hpp"
#include "fp4moe/runner.hpp"
#include "layout_fixtures.hpp"
#include "small_problem.hpp"
#include "runner/device_buffer.hpp"
#include "runner/ep_dispatch.hpp"
#include "runner/layer_buffers.hpp"
#include "runner/output_match.hpp"

namespace fp4moe {
namespace {

#define SKIP_WITHOUT_GPU()                                   \
  do {                                                       \
    std::string why_;                                        \
    if (!cuda_device_available(&why_)) GTEST_SKIP() << why_; \
  } while (0)

using test::small_problem;

std::string label(const MoeProblem& p, int N, const std::vector<int64_t>& tokens) {
  std::string s = std::string(to_string(p.act_quant)) + " " + std::string(to_string(p.routing.method)) + " N=" +
                  std::to_string(N) + " T=";
  for (size_t r = 0; r < tokens.size(); ++r) s += (r ? "," : "") + std::to_string(tokens[r]);
  return s;
}

// The single-GPU layer over all ranks' tokens: output bits, ids, weights (and the tactic it ran).
struct SingleLayer {
  std::vector<uint16_t> output;
  std::vector<int32_t> ids;
  std::vector<float> weights;
  MoeTactic tactic;
};

SingleLayer run_single(const io::MoeCase& c) {
  const MoeProblem& p = c.problem;
  const int64_t T = c.num_tokens, k = p.top_k();
  auto runner = MoeRunner::create(p, T);
  EXPECT_TRUE(runner->prepare_weights(c.weights()).ok());
  test::LayerBuffers buf(p, T, *runner);
  const bool routed = p.routing.method == RoutingMethod::Precomputed;
  if (!routed) EXPECT_EQ(buf.upload(c), cudaSuccess);
  if (routed) {
    EXPECT_EQ(cudaMemcpy(buf.hidden.ptr, c.hidden_states.data(), c.hidden_states.size() * 2, cudaMemcpyHostToDevice),
              cudaSuccess);
    EXPECT_EQ(cudaMemcpy(buf.ids.ptr, c.topk_ids.data(), c.topk_ids.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(buf.weights.ptr, c.topk_weights.data(), c.topk_weights.size() * 4, cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  EXPECT_EQ(buf.poison_output(), cudaSuccess);
  ForwardArgs a = buf.args;
  if (routed) a.router_logits = nullptr;
  SingleLayer out;
  out.tactic = runner->tactic_for(T);
  if (T > 0) {
    const Status s = routed ? runner->forward_routed(nullptr, a) : runner->forward(nullptr, a);
    EXPECT_TRUE(s.ok()) << s.message;
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaError_t e;
  out.output = buf.output(&e);
  out.ids.resize(size_t(T * k));
  out.weights.resize(size_t(T * k));
  if (T > 0) {
    EXPECT_EQ(cudaMemcpy(out.ids.data(), buf.ids.ptr, out.ids.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(out.weights.data(), buf.weights.ptr, out.weights.size() * 4, cudaMemcpyDeviceToHost),
              cudaSuccess);
  }
  return out;
}

// One rank's layer and buffers: tokens [first, first + T) of the case.
struct Rank {
  std::unique_ptr<ExpertParallelLayer> layer;
  std::optional<test::ExpertRangeWeights> local;
  int64_t first = 0, T = 0;
  std::optional<DeviceBuffer> hidden, logits, ids, weights, out;
  ExpertParallelArgs args;
  Status status;
};

// The N ranks of one run; tokens[r] tokens on rank r, on virtual ranks of the current GPU or on the
// given communicators (rank r on devices[r]).
struct VirtualRun {
  VirtualRun(const io::MoeCase& c, const std::vector<int64_t>& tokens, const ExpertParallelOptions& options,
             int64_t max_tokens = -1, std::vector<std::unique_ptr<Communicator>> given = {},
             std::vector<int> devices = {})
      : c(c),
        N(int(tokens.size())),
        comms(given.empty() ? make_virtual_ranks(int(tokens.size()), -1, 20.0) : std::move(given)),
        ranks(tokens.size()) {
    const MoeProblem& p = c.problem;
    const int64_t H = p.hidden, E = p.num_experts, k = p.top_k();
    int current = 0;
    EXPECT_EQ(cudaGetDevice(&current), cudaSuccess);
    device.assign(size_t(N), current);
    for (size_t r = 0; r < devices.size() && r < size_t(N); ++r) device[r] = devices[r];
    const int64_t group_max = *std::max_element(tokens.begin(), tokens.end());
    int64_t first = 0;
    for (int r = 0; r < N; ++r) {
      Rank& rk = ranks[r];
      rk.first = first;
      rk.T = tokens[r];
      first += tokens[r];
      EXPECT_EQ(cudaSetDevice(device[r]), cudaSuccess);
      // NOTE: every rank the group's largest T, as a deployment gives every rank the same max_tokens: the
      // default receive capacity, size() * max_tokens rows, then holds whatever a rank receives.
      rk.layer = ExpertParallelLayer::create(p, max_tokens >= 0 ? max_tokens : group_max, *comms[r], options, device[r]);
      const auto [begin, end] = io::expert_range(E, r, N);
      rk.local.emplace(c, begin, end, std::vector<int32_t>{});
      ExpertParallelWeights w;
      w.local = rk.local->weights();
      w.layer_w13_input_scale = c.w13_input_scale.empty() ? nullptr : c.w13_input_scale.data();
      w.layer_w2_bias = c.w2_bias.empty() ? nullptr : c.w2_bias.data();
      const Status s = rk.layer->prepare_weights(w);
      EXPECT_TRUE(s.ok()) << s.message;
      const size_t T = size_t(rk.T);
      rk.hidden.emplace(T * H * 2, "hidden");
      rk.logits.emplace(T * E * 4, "logits");
      rk.ids.emplace(T * k * 4, "ids");
      rk.weights.emplace(T * k * 4, "weights");
      rk.out.emplace(T * H * 4, "out");
      if (T) {
        EXPECT_EQ(cudaMemcpy(rk.hidden->ptr, &c.hidden_states[rk.first * H], T * H * 2, cudaMemcpyHostToDevice), cudaSuccess);
        if (!c.router_logits.empty())
          EXPECT_EQ(cudaMemcpy(rk.logits->ptr, &c.router_logits[rk.first * E], T * E * 4, cudaMemcpyHostToDevice),
                    cudaSuccess);
      }
      rk.args.num_tokens = rk.T;
      rk.args.hidden = rk.hidden->ptr;
      rk.args.topk_ids = rk.ids->as<int32_t>();
      rk.args.topk_weights = rk.weights->as<float>();
      rk.args.output = rk.out->ptr;
      if (p.routing.method != RoutingMethod::Precomputed) rk.args.router_logits = rk.logits->ptr;
    }
    EXPECT_EQ(cudaSetDevice(current), cudaSuccess);
  }

  // Every rank's forward on its own host thread and stream; outputs, ids (with logits) poisoned first.
  void forward() {
    const MoeProblem& p = c.problem;
    const int64_t H = p.hidden, k = p.top_k();
    for (Rank& rk : ranks) {
      const size_t T = size_t(rk.T);
      EXPECT_EQ(cudaSetDevice(device[&rk - ranks.data()]), cudaSuccess);
      EXPECT_EQ(cudaMemset(rk.out->ptr, 0xFF, T * H * 4), cudaSuccess);
      if (p.routing.method == RoutingMethod::Precomputed) {
        if (T) {
          EXPECT_EQ(cudaMemcpy(rk.ids->ptr, &c.topk_ids[rk.first * k], T * k * 4, cudaMemcpyHostToDevice), cudaSuccess);
          EXPECT_EQ(cudaMemcpy(rk.weights->ptr, &c.topk_weights[rk.first * k], T * k * 4, cudaMemcpyHostToDevice),
                    cudaSuccess);
        }
      } else {
        EXPECT_EQ(cudaMemset(rk.ids->ptr, 0xFF, T * k * 4), cudaSuccess);
        EXPECT_EQ(cudaMemset(rk.weights->ptr, 0xFF, T * k * 4), cudaSuccess);
      }
    }
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<std::thread> threads;
    for (Rank& rk : ranks)
      threads.emplace_back([&rk, dev = device[&rk - ranks.data()]] {
        cudaStream_t stream = nullptr;
        if (cudaSetDevice(dev) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) {
          rk.status = Status::failure("cudaSetDevice failed");
          return;
        }
        if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
          rk.status = Status::failure("cudaStreamCreate failed");
          return;
        }
        rk.status = rk.layer->forward(stream, rk.args);
        if (cudaStreamSynchronize(stream) != cudaSuccess && rk.status.ok()) rk.status = Status::failure("stream failed");
        cudaStreamDestroy(stream);
      });
    for (std::thread& t : threads) t.join();
  }

  // The ranks' outputs (bf16 bits), ids and weights, concatenated in token order.
  SingleLayer gathered() const {
    const int64_t H = c.problem.hidden, k = c.problem.top_k();
    SingleLayer g;
    for (const Rank& rk : ranks) {
      const size_t T = size_t(rk.T);
      std::vector<uint16_t> o(T * H);
      std::vector<int32_t> i(T * k);
      std::vector<float> w(T * k);
      if (T) {
        EXPECT_EQ(cudaMemcpy(o.data(), rk.out->ptr, o.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
        EXPECT_EQ(cudaMemcpy(i.data(), rk.ids->ptr, i.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
        EXPECT_EQ(cudaMemcpy(w.data(), rk.weights->ptr, w.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      }
      g.output.insert(g.output.end(), o.begin(), o.end());
      g.ids.insert(g.ids.end(), i.begin(), i.end());
      g.weights.insert(g.weights.end(), w.begin(), w.end());
    }
    return g;
  }

  io::MoeCase c;
  int N;
  std::vector<std::unique_ptr<Communicator>> comms;
  std::vector<Rank> ranks;
  std::vector<int> device;  // of each rank
};

// The case of all ranks' tokens; `all_on_rank` >= 0 routes every token to that rank's experts only.
io::MoeCase make_case(const MoeProblem& p, const std::vector<int64_t>& tokens, uint64_t seed, int all_on_rank = -1,
                      bool biases = false) {
  const int64_t T = std::accumulate(tokens.begin(), tokens.end(), int64_t(0));
  io::MoeCase c = io::make_random_packed_case(p, T, seed);
  if (biases) io::add_random_expert_biases(c, seed + 1);
  if (all_on_rank >= 0) {
    const auto [begin, end] = io::expert_range(p.num_experts, all_on_rank, int(tokens.size()));
    const int64_t k = p.top_k();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < k; ++j) c.topk_ids[t * k + j] = int32_t(begin + (t + j) % (end - begin));
  }
  return c;
}

// The ranks (virtual, or the given communicators on `devices`) against the single layer on its tactic:
// ids and weights bit for bit; the output bit for bit with AllToAll (and AllGather on one rank), within
// the layer tolerance with AllGather (each rank sums its own slots of a token, the token's rank sums the
// ranks' fp32 partials: another fp32 order).
void expect_equal_to_single_layer(const io::MoeCase& c, const std::vector<int64_t>& tokens,
                                  ExpertParallelScheme scheme = ExpertParallelScheme::AllToAll,
                                  std::vector<std::unique_ptr<Communicator>> comms = {},
                                  std::vector<int> devices = {}) {
  const std::string what = std::string(to_string(scheme)) + " " + label(c.problem, int(tokens.size()), tokens);
  const SingleLayer single = run_single(c);
  ExpertParallelOptions options;
  options.tactic = single.tactic;
  options.scheme = scheme;
  VirtualRun run(c, tokens, options, -1, std::move(comms), std::move(devices));
  run.forward();
  for (const Rank& rk : run.ranks) ASSERT_TRUE(rk.status.ok()) << what << ": " << rk.status.message;
  const SingleLayer ep = run.gathered();
  ASSERT_EQ(ep.ids, single.ids) << what;
  ASSERT_EQ(std::memcmp(ep.weights.data(), single.weights.data(), ep.weights.size() * 4), 0) << what;
  if (scheme == ExpertParallelScheme::AllGather && tokens.size() > 1) {
    test::expect_output_matches(ep.output, single.output, c.num_tokens, c.problem.hidden, what);
    return;
  }
  int64_t differ = 0;
  for (size_t i = 0; i < ep.output.size(); ++i) differ += ep.output[i] != single.output[i];
  EXPECT_EQ(differ, 0) << what << ": " << differ << " of " << ep.output.size() << " output elements differ";
}

// Every quantization mode and routing method, T = 37, 0 and 1 on the ranks, the group sizes in turn.
void every_mode_and_routing_method(ExpertParallelScheme scheme, const std::vector<int>& group_sizes, uint64_t seed) {
  size_t turn = 0;
  constexpr int64_t kTokens[3] = {37, 0, 1};
  for (ActQuant mode : {ActQuant::W4A16, ActQuant::W4A4Scalar, ActQuant::W4A4PerExpert})
    for (RoutingMethod m : {RoutingMethod::Default, RoutingMethod::Renormalize, RoutingMethod::RenormalizeNaive,
                            RoutingMethod::TopK, RoutingMethod::Sigmoid, RoutingMethod::SigmoidRenorm,
                            RoutingMethod::TopKSigmoid, RoutingMethod::Llama4, RoutingMethod::DeepSeekV3,
                            RoutingMethod::Precomputed}) {
      const int N = group_sizes[turn++ % group_sizes.size()];
      std::vector<int64_t> tokens(static_cast<size_t>(N));
      for (int r = 0; r < N; ++r) tokens[r] = kTokens[r % 3];
      expect_equal_to_single_layer(make_case(small_problem(mode, m), tokens, ++seed), tokens, scheme);
      if (::testing::Test::HasFatalFailure()) return;
    }
}

// 4096 tokens on every rank of 2, 4 and 8, a mode each.
void four_thousand_tokens_per_rank(ExpertParallelScheme scheme, uint64_t seed) {
  const ActQuant modes[3] = {ActQuant::W4A4Scalar, ActQuant::W4A16, ActQuant::W4A4PerExpert};
  int i = 0;
  for (int N : {2, 4, 8}) {
    const MoeProblem p = small_problem(modes[i++], RoutingMethod::Renormalize);
    const std::vector<int64_t> tokens(size_t(N), 4096);
    expect_equal_to_single_layer(make_case(p, tokens, seed + N), tokens, scheme);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// Expert biases (swiglu_oai) with NVFP4 and MXFP4 weights in w4a16, and with NVFP4 in w4a4_scalar.
void biases_and_mxfp4_weights(ExpertParallelScheme scheme, uint64_t seed) {
  MoeProblem p = small_problem(ActQuant::W4A16, RoutingMethod::Renormalize);
  p.activation.kind = Activation::SwiGLUOai;
  p.hidden = 512;
  p.inter = 320;
  for (WeightFormat f : {WeightFormat::NVFP4, WeightFormat::MXFP4}) {
    p.weight_format = f;
    const std::vector<int64_t> tokens = {37, 1, 64};
    expect_equal_to_single_layer(make_case(p, tokens, seed, -1, /*biases=*/true), tokens, scheme);
    if (::testing::Test::HasFatalFailure()) return;
  }
  p.weight_format = WeightFormat::NVFP4;
  p.act_quant = ActQuant::W4A4Scalar;
  const std::vector<int64_t> tokens = {5, 0, 90, 33};
  expect_equal_to_single_layer(make_case(p, tokens, seed + 100, -1, true), tokens, scheme);
}

// Every token on rank 2's experts: ranks 0, 1 and 3 compute nothing, rank 2 every entry.
void experts_of_one_rank_only(ExpertParallelScheme scheme, uint64_t seed) {
  for (ActQuant mode : {ActQuant::W4A16, ActQuant::W4A4Scalar, ActQuant::W4A4PerExpert}) {
    const MoeProblem p = small_problem(mode, RoutingMethod::Precomputed);
    const std::vector<int64_t> tokens = {37, 1, 0, 300};
    expect_equal_to_single_layer(make_case(p, tokens, seed, /*all_on_rank=*/2), tokens, scheme);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(ExpertParallelAllToAll, EveryModeAndRoutingMethodEqualsTheSingleLayer) {
  SKIP_WITHOUT_GPU();
  every_mode_and_routing_method(ExpertParallelScheme::AllToAll, {2, 4, 8}, 1000);
}

TEST(ExpertParallelAllToAll, FourThousandTokensPerRankOnTwoFourAndEightRanks) {
  SKIP_WITHOUT_GPU();
  four_thousand_tokens_per_rank(ExpertParallelScheme::AllToAll, 2000);
}

TEST(ExpertParallelAllToAll, ARankThatReceivesNothingAndOneThatReceivesEverything) {
  SKIP_WITHOUT_GPU();
  experts_of_one_rank_only(ExpertParallelScheme::AllToAll, 3000);
}

TEST(ExpertParallelAllToAll, ExpertBiasesAndMxfp4Weights) {
  SKIP_WITHOUT_GPU();
  biases_and_mxfp4_weights(ExpertParallelScheme::AllToAll, 4000);
}

// Each rank on its own tactic (the default): the output within the layer tolerance of the single layer.
TEST(ExpertParallelAllToAll, OwnTacticsStayWithinTheLayerTolerance) {
  SKIP_WITHOUT_GPU();
  const MoeProblem p = small_problem(ActQuant::W4A4Scalar, RoutingMethod::Renormalize);
  const std::vector<int64_t> tokens = {1024, 3, 200, 0};
  const io::MoeCase c = make_case(p, tokens, 5000);
  const SingleLayer single = run_single(c);
  VirtualRun run(c, tokens, {});
  run.forward();
  for (const Rank& rk : run.ranks) ASSERT_TRUE(rk.status.ok()) << rk.status.message;
  const SingleLayer ep = run.gathered();
  ASSERT_EQ(ep.ids, single.ids);
  test::expect_output_matches(ep.output, single.output, c.num_tokens, p.hidden, "own tactics");
}

// The traffic each rank reports is the CPU plan's: row copies at H/2 + H/16 + 4 * rows_top_k bytes
// (NVFP4) or 2H + 4 * rows_top_k (bf16), and 4H bytes per computed entry back.
TEST(ExpertParallelAllToAll, TrafficIsTheCpuPlans) {
  SKIP_WITHOUT_GPU();
  for (ActQuant mode : {ActQuant::W4A4Scalar, ActQuant::W4A16, ActQuant::W4A4PerExpert}) {
    const MoeProblem p = small_problem(mode, RoutingMethod::Precomputed);
    const std::vector<int64_t> tokens = {37, 100, 0, 5};
    const int N = int(tokens.size());
    const io::MoeCase c = make_case(p, tokens, 6000);
    VirtualRun run(c, tokens, {});
    run.forward();
    const int64_t H = p.hidden, k = p.top_k();
    const bool per_entry = mode == ActQuant::W4A4PerExpert;
    const int rk = per_entry ? 1 : int(k);
    std::vector<int64_t> received(size_t(N), 0), entries(size_t(N), 0);
    std::vector<ep::DispatchPlan> plans;
    for (const Rank& r : run.ranks) {
      const int64_t S = per_entry ? r.T * k : r.T;
      plans.push_back(ep::plan_dispatch(c.topk_ids.data() + r.first * k, S, rk, p.num_experts, N));
      for (int d = 0; d < N; ++d) received[d] += plans.back().send_count(d), entries[d] += plans.back().entry_count(d);
    }
    const int64_t row_bytes = (mode == ActQuant::W4A16 ? 2 * H : H / 2 + H / 16) + 4 * rk;
    for (int r = 0; r < N; ++r) {
      ASSERT_TRUE(run.ranks[r].status.ok()) << run.ranks[r].status.message;
      const ExpertParallelTraffic t = run.ranks[r].layer->last_traffic();
      EXPECT_EQ(t.rows_sent, plans[r].sent()) << "rank " << r;
      EXPECT_EQ(t.dispatch_bytes, plans[r].sent() * row_bytes) << "rank " << r;
      EXPECT_EQ(t.rows_received, received[r]) << "rank " << r;
      EXPECT_EQ(t.combine_bytes, entries[r] * 4 * H) << "rank " << r;
    }
  }
}

// time_stages: every stage of every rank has a time once a forward has run; without it, an error.
TEST(ExpertParallelAllToAll, StageTimesOnlyWhenAskedFor) {
  SKIP_WITHOUT_GPU();
  const MoeProblem p = small_problem(ActQuant::W4A4Scalar, RoutingMethod::Precomputed);
  const std::vector<int64_t> tokens = {37, 64};
  const io::MoeCase c = make_case(p, tokens, 6500);
  ExpertParallelOptions timed;
  timed.time_stages = true;
  VirtualRun run(c, tokens, timed);
  ExpertParallelStageTimes before;
  const Status none_yet = run.ranks[0].layer->last_stage_times(before);
  ASSERT_FALSE(none_yet.ok());
  EXPECT_NE(none_yet.message.find("no forward has run"), std::string::npos) << none_yet.message;
  run.forward();
  for (const Rank& r : run.ranks) {
    ASSERT_TRUE(r.status.ok()) << r.status.message;
    ExpertParallelStageTimes t;
    const Status s = r.layer->last_stage_times(t);
    ASSERT_TRUE(s.ok()) << s.message;
    EXPECT_GT(t.dispatch_us, 0.0);
    EXPECT_GT(t.experts_us, 0.0);
    EXPECT_GT(t.combine_us, 0.0);
    EXPECT_GE(t.exchange_us, 0.0);
  }
  VirtualRun plain(c, tokens, {});
  plain.forward();
  ExpertParallelStageTimes t;
  const Status s = plain.ranks[0].layer->last_stage_times(t);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message.find("without time_stages"), std::string::npos) << s.message;
}

// A forward that would overflow a rank's receive buffers fails on every rank, naming that rank, before
// any row is sent; the group stays usable.
TEST(ExpertParallelAllToAll, ReceiveCapacityOverflowFailsOnEveryRank) {
  SKIP_WITHOUT_GPU();
  const MoeProblem p = small_problem(ActQuant::W4A4Scalar, RoutingMethod::Precomputed);
  const std::vector<int64_t> tokens = {40, 40};
  const io::MoeCase all_on_one = make_case(p, tokens, 7000, /*all_on_rank=*/1);
  ExpertParallelOptions options;
  options.receive_capacity_rows = 60;
  VirtualRun run(all_on_one, tokens, options);
  run.forward();
  for (const Rank& rk : run.ranks) {
    ASSERT_FALSE(rk.status.ok());
    EXPECT_NE(rk.status.message.find("rank 1 would receive 80 rows, over the receive capacity of 60 rows per rank"),
              std::string::npos)
        << rk.status.message;
  }
  // The same group and layers with a routing that fits: every rank succeeds.
  run.c = make_case(p, tokens, 7001);
  run.forward();
  for (const Rank& rk : run.ranks) EXPECT_TRUE(rk.status.ok()) << rk.status.message;
}

// The NCCL communicator: one rank on this GPU, and two ranks on two GPUs where there are two.
TEST(ExpertParallelNccl, OneAndTwoGpusEqualTheSingleLayer) {
  SKIP_WITHOUT_GPU();
  try {
    const auto probe = make_nccl_ranks({0});
    ASSERT_EQ(probe.size(), 1u);
    EXPECT_EQ(probe[0]->size(), 1);
    EXPECT_EQ(probe[0]->rank(), 0);
  } catch (const Error& e) {
    GTEST_SKIP() << e.what();  // no NCCL on this machine
  }
  constexpr ExpertParallelScheme kSchemes[2] = {ExpertParallelScheme::AllToAll, ExpertParallelScheme::AllGather};
  for (ExpertParallelScheme scheme : kSchemes)
    for (ActQuant mode : {ActQuant::W4A16, ActQuant::W4A4Scalar, ActQuant::W4A4PerExpert}) {
      const MoeProblem p = small_problem(mode, RoutingMethod::Renormalize);
      expect_equal_to_single_layer(make_case(p, {37}, 9000), {37}, scheme, make_nccl_ranks({0}), {0});
      if (HasFatalFailure()) return;
    }
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  if (count < 2) GTEST_SKIP() << "two ranks need two GPUs; this machine has " << count;
  for (ExpertParallelScheme scheme : kSchemes)
    for (ActQuant mode : {ActQuant::W4A16, ActQuant::W4A4Scalar, ActQuant::W4A4PerExpert}) {
      const MoeProblem p = small_problem(mode, RoutingMethod::DeepSeekV3);
      const std::vector<int64_t> tokens = {37, 300};
      expect_equal_to_single_layer(make_case(p, tokens, 9100), tokens, scheme, make_nccl_ranks({0, 1}), {0, 1});
      if (HasFatalFailure()) return;
    }
}

// ---- ExpertParallelScheme::AllGather: within the layer tolerance, bit for bit on one rank ------------
TEST(ExpertParallelAllGather, EveryModeAndRoutingMethodIsCloseToTheSingleLayer) {
  SKIP_WITHOUT_GPU();
  every_mode_and_routing_method(ExpertParallelScheme::AllGather, {2, 4, 8, 1}, 11000);
}

TEST(ExpertParallelAllGather, FourThousandTokensPerRankOnTwoFourAndEightRanks) {
  SKIP_WITHOUT_GPU();
  four_thousand_tokens_per_rank(ExpertParallelScheme::AllGather, 12000);
}

TEST(ExpertParallelAllGather, ExpertsOfOneRankOnly) {
  SKIP_WITHOUT_GPU();
  experts_of_one_rank_only(ExpertParallelScheme::AllGather, 13000);
}

TEST(ExpertParallelAllGather, ExpertBiasesAndMxfp4Weights) {
  SKIP_WITHOUT_GPU();
  biases_and_mxfp4_weights(ExpertParallelScheme::AllGather, 13100);
}

// Rows and ids to every rank, every gathered token's fp32 partial back; a group with more rows than the
// receive capacity fails on every rank with the same message.
TEST(ExpertParallelAllGather, TrafficAndReceiveCapacity) {
  SKIP_WITHOUT_GPU();
  for (ActQuant mode : {ActQuant::W4A4Scalar, ActQuant::W4A16, ActQuant::W4A4PerExpert}) {
    const MoeProblem p = small_problem(mode, RoutingMethod::Precomputed);
    const std::vector<int64_t> tokens = {37, 100, 0, 5};
    const int N = int(tokens.size());
    const io::MoeCase c = make_case(p, tokens, 14000);
    ExpertParallelOptions options;
    options.scheme = ExpertParallelScheme::AllGather;
    VirtualRun run(c, tokens, options);
    run.forward();
    const int64_t H = p.hidden, k = p.top_k(), G = c.num_tokens;
    const int64_t per_token = mode == ActQuant::W4A4PerExpert ? k : 1;  // rows per token
    const int64_t row_bytes = mode == ActQuant::W4A16 ? 2 * H : H / 2 + H / 16;
    for (int r = 0; r < N; ++r) {
      ASSERT_TRUE(run.ranks[r].status.ok()) << run.ranks[r].status.message;
      const ExpertParallelTraffic t = run.ranks[r].layer->last_traffic();
      const int64_t S = tokens[r] * per_token;
      EXPECT_EQ(t.rows_sent, S * N) << "rank " << r;
      EXPECT_EQ(t.rows_received, G * per_token) << "rank " << r;
      EXPECT_EQ(t.dispatch_bytes, N * (S * row_bytes + tokens[r] * 8 * k)) << "rank " << r;
      EXPECT_EQ(t.combine_bytes, G * 4 * H) << "rank " << r;
    }
  }
  const MoeProblem p = small_problem(ActQuant::W4A4Scalar, RoutingMethod::Precomputed);
  const std::vector<int64_t> tokens = {40, 40};
  ExpertParallelOptions options;
  options.scheme = ExpertParallelScheme::AllGather;
  options.receive_capacity_rows = 60;
  VirtualRun run(make_case(p, tokens, 14100), tokens, options);
  run.forward();
  for (const Rank& rk : run.ranks) {
    ASSERT_FALSE(rk.status.ok());
    EXPECT_NE(rk.status.message.find("the group's 80 tokens are 80 rows, over the receive capacity of 60 rows"),
              std::string::npos)
        << rk.status.message;
  }
}

TEST(ExpertParallelAllToAll, BadArgumentsAreErrors) {
  SKIP_WITHOUT_GPU();
  const MoeProblem p = small_problem(ActQuant::W4A4Scalar, RoutingMethod::Renormalize);
  auto comms = make_virtual_ranks(2);
  MoeProblem rank_problem = p;
  rank_problem.routing.method = RoutingMethod::Precomputed;
  rank_problem.routing.skip_foreign_ids = true;
  expect_error([&] { ExpertParallelLayer::create(rank_problem, 8, *comms[0]); }, "skip_foreign_ids belongs to a rank");
  auto three = make_virtual_ranks(17);
  expect_error([&] { ExpertParallelLayer::create(p, 8, *three[0]); }, "the group size must be in [1, E=16], got 17");
  auto layer = ExpertParallelLayer::create(p, 8, *comms[0]);
  ExpertParallelArgs a;
  a.num_tokens = 4;
  Status s = layer->forward(nullptr, a);
  EXPECT_NE(s.message.find("weights are not prepared"), std::string::npos) << s.message;
  const io::MoeCase c = make_case(p, {8, 0}, 8000);
  const test::ExpertRangeWeights local(c, 0, 8, {});
  ExpertParallelWeights w;
  w.local = local.weights();
  s = layer->prepare_weights(w);
  EXPECT_NE(s.message.find("layer_w13_input_scale (the whole layer's [E]) is required"), std::string::npos) << s.message;
  w.layer_w13_input_scale = c.w13_input_scale.data();
  ASSERT_TRUE(layer->prepare_weights(w).ok());
  a.num_tokens = 9;
  s = layer->forward(nullptr, a);
  EXPECT_NE(s.message.find("num_tokens must be in [0, max_tokens=8], got 9"), std::string::npos) << s.message;
  a.num_tokens = 4;
  s = layer->forward(nullptr, a);
  EXPECT_NE(s.message.find("hidden is null"), std::string::npos) << s.message;
  // Graph capture: refused before anything is launched or exchanged.
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  s = layer->forward(stream, a);
  cudaGraph_t graph = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  if (graph) cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  EXPECT_NE(s.message.find("cannot be captured in a CUDA graph"), std::string::npos) << s.message;
}

}  // namespace
}  // namespace fp4moe
