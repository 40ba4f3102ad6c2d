// fp4moe/bench.hpp — the repository's tools around the layer (the fp4moe_tools target, used by the CLI
// and the tests; not installed, not part of the public API of fp4moe/runner.hpp): measuring the layer
// against its floor (docs/performance.md, "Method"), tuning, and running a case file on the GPU.
//
//   Ceilings c = measure_ceilings();                  // copy bandwidth, bf16 GEMM rate, this GPU, now
//   auto rows = bench_model("deepseek-r1", preset("deepseek-r1", mode), {1, 8, 64}, c, opts);
//
// Layer time: CUDA-graph replays of one forward (captured per T), each replay timed with events and
// preceded by an L2 flush so that weights come from HBM; median and min over `reps` replays after
// `warmup`. Stage times come from a separate instrumented (non-graph) run.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fp4moe/case_file.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/expert_parallel.hpp"
#include "fp4moe/problem.hpp"
#include "fp4moe/reference.hpp"
#include "fp4moe/runner.hpp"
#include "fp4moe/tactic.hpp"
#include "fp4moe/tune.hpp"

namespace fp4moe {

// Runs a host-memory case through a MoeRunner on the current device (tools and tests, not a serving
// path): allocates, uploads, runs forward or forward_routed, downloads, synchronises. When ms is
// non-null, the layer is also timed (CUDA events around 10 forwards after a warm-up) and the mean
// milliseconds per forward are stored there. With `tactic`, every forward uses it
// (MoeRunner::force_tactic). Throws fp4moe::Error on any failure.
reference::MoeResult run_case_on_gpu(const io::MoeCase& c, double* ms = nullptr,
                                     std::optional<MoeTactic> tactic = std::nullopt);

// The stages of a forward that forward_marked marks: route, permute, gather_quantize, gemm1_act, gemm2,
// finalize.
inline constexpr int kForwardStages = 6;

// The runner's benchmark hook (MoeRunner::forward_marked, protected).
struct RunnerDiagnostics {
  static Status forward_marked(MoeRunner& runner, CUstream_st* stream, const ForwardArgs& args, bool routed,
                               CUevent_st* const* marks) {
    return runner.forward_marked(stream, args, routed, marks);
  }
};
// forward (routed=false) or forward_routed (routed=true) that records marks[0] before the first launch
// and marks[1..kForwardStages] after each stage (a stage that the forward fuses into another still gets
// its mark, right after the previous one). marks: kForwardStages + 1 events.
inline Status forward_marked(MoeRunner& runner, CUstream_st* stream, const ForwardArgs& args, bool routed,
                             CUevent_st* const* marks) {
  return RunnerDiagnostics::forward_marked(runner, stream, args, routed, marks);
}

struct Ceilings {
  double copy_tbps = 0;    // device-to-device copy, bytes read + written per second / 1e12
  double bf16_tflops = 0;  // cuBLAS bf16 GEMM 8192^3, fp32 accumulation
  std::string gpu_name;
  int sm_count = 0;
};
Ceilings measure_ceilings();

// How a replay's weights are made cold in HBM (the bench's and the tuner's L2 flush before every replay).
//   Read:  a kernel reads a 256 MiB buffer: the L2 then holds clean lines, which the layer's reads
//          replace at no cost.
//   Write: cudaMemset of that buffer: the L2 then holds ~50 MB of dirty lines, and each line the
//          layer's reads replace is first written back to HBM, so a layer that reads less than the L2
//          moves up to twice its bytes (qwen3-30b-a3b T = 1: 21 MB of weights, ~21 MB of write-back).
enum class L2Flush { Read, Write };
inline std::string_view to_string(L2Flush flush) { return flush == L2Flush::Read ? "read" : "write"; }
// "read" or "write"; throws fp4moe::Error naming `what` otherwise.
inline L2Flush parse_l2_flush(std::string_view name, std::string_view what) {
  if (name == "read") return L2Flush::Read;
  if (name == "write") return L2Flush::Write;
  throw Error(detail::concat(what, ": expected read or write, got '", name, "'"));
}

struct BenchOptions {
  int warmup = 5;
  int reps = 30;   // >= 20
  // NOTE (power state): on an H200 the replays of a large row run 7-17% slower once the board has been
  // busy for ~20-60 ms, so a row's median depends on how long the GPU rested before it. idle_ms rests
  // before each row's warm-up (the first replays then start from a rested board); warmup_ms keeps
  // replaying (with the L2 flush) after the counted warm-up until that long has passed (the timed
  // replays then see the loaded board). 0: off.
  int idle_ms = 0;
  int warmup_ms = 0;
  uint64_t seed = 1;
  std::optional<MoeTactic> tactic;  // force this tactic (MoeRunner::force_tactic); default: the runner's choice
  bool refcheck = true;             // check each row's first tokens against the CPU reference (throws on a mismatch)
  bool expert_biases = false;       // bench_model: random expert biases (gpt-oss) on the random weights
  // bench_model, expert parallelism: time rank 0 of ep_size ranks: its experts (io::expert_range) on the
  // whole layer's routing of random logits (computed on the CPU, mapped to the rank's experts; another
  // rank's slot adds nothing: RoutingParams::skip_foreign_ids). The routing itself, which every rank
  // runs (GpuRouter), and the all-reduce are not in the time.
  int ep_size = 1;
  L2Flush l2_flush = L2Flush::Read;
};

// The SM clock and board power of one GPU over a window (NVML samples, runner/clock_monitor.hpp); a
// bench row's window holds its timed replays, not its rest or warm-up.
struct ClockStats {
  int samples = 0;  // 0: no measurement (NVML unavailable, or the window was shorter than a period)
  double mean_sm_mhz = 0, min_sm_mhz = 0, max_sm_mhz = 0;
  double mean_power_w = 0, max_power_w = 0;
  double power_capped_fraction = 0;  // of the samples: the clock held down by the software power cap
};

// Per stage of the layer: the time between the event record nodes around it in a graph of
// forward_marked (medians of 5 replays). The nodes serialise the stages, so their sum exceeds
// the layer time by the launch overlap that the plain forward gets (programmatic dependent launch).
struct StageTimes {
  double route_us = 0, permute_us = 0, quantize_us = 0, gemm1_us = 0, gemm2_us = 0, finalize_us = 0;
};

struct BenchRow {
  std::string model;
  ActQuant mode = ActQuant::W4A16;
  int64_t tokens = 0;
  int64_t experts_hit = 0;    // from the routing of this run
  double median_us = 0, min_us = 0;
  std::vector<double> replay_us;  // every timed replay in launch order (median_us and min_us summarize it)
  double weight_bytes = 0;    // FP4 weights + block scales of the experts hit, in the problem's format
  double bytes = 0;           // weight_bytes + activations in and out
  double flops = 0;           // 2 * T * k * (w13_rows * H + H * I)
  double floor_us = 0;        // max(bytes / copy rate, flops / bf16 rate)
  double pct_of_floor = 0;    // 100 * floor / median
  double tflops = 0;          // flops / median
  double weight_tbps = 0;     // weight_bytes / median
  std::string tactic;         // describe() of the tactic the runner used
  StageTimes stages;
  ClockStats clock;           // during the timed replays (sampled every 1 ms)
};

// One runner per model (prepared once with random NVFP4 weights), one row per token count.
// progress: when true, one line per row on stderr.
std::vector<BenchRow> bench_model(const std::string& model, const MoeProblem& problem,
                                  const std::vector<int64_t>& tokens, const Ceilings& ceilings,
                                  const BenchOptions& options, bool progress = true);

// The same with given weights (e.g. a checkpoint's layer, io::MoeLayerWeights::weights()). Inputs are
// random; routing uses the problem's method on random logits (a real router is not needed to time
// the layer). `label` names the rows.
std::vector<BenchRow> bench_weights(const std::string& label, const MoeProblem& problem,
                                    const reference::MoeWeights& weights, const std::vector<int64_t>& tokens,
                                    const Ceilings& ceilings, const BenchOptions& options, bool progress = true);

// The expert-parallel layer (ExpertParallelLayer, either scheme) over the ranks of an ExpertParallelGroup:
// every rank routes T tokens of random logits of its own, and the ranks' forwards run on their own host
// threads and streams. A row's time is the host wall time of one step (every rank's forward, stream
// synchronised); with virtual ranks every rank shares this one GPU and device copies stand in for the
// wire: the work of the whole group, not of one rank on a GPU of its own. No L2 flush. Traffic from the
// ranks' last forward. options.refcheck checks rank 0's first tokens against the CPU reference.
struct ExpertParallelBenchRow {
  std::string model;
  ExpertParallelScheme scheme = ExpertParallelScheme::AllToAll;
  ActQuant mode = ActQuant::W4A16;
  int ranks = 1;
  int64_t tokens_per_rank = 0;
  double median_us = 0, min_us = 0;  // a step: every rank's forward, host wall time
  // Medians over the steps of the slowest rank's device time per stage (ExpertParallelStageTimes):
  // the exchanges are excluded from these three and given apart in exchange_us.
  double dispatch_us = 0, experts_us = 0, combine_us = 0, exchange_us = 0;
  int64_t rows_sent = 0;           // row copies over all ranks (to themselves included)
  int64_t dispatch_bytes = 0;      // their wire bytes (ExpertParallelTraffic, summed over the ranks)
  int64_t combine_bytes = 0;       // fp32 sent back: computed entries' y, or (AllGather) partial outputs
  // AllToAll: H/2 + H/16 + 4 * rows_top_k (NVFP4 rows) or 2H + 4 * rows_top_k (bf16); AllGather: the
  // row and 8 * rows_top_k (the token's k ids and weights over its k / rows_top_k rows)
  int64_t row_bytes_expected = 0;
};
// The group bench_expert_parallel runs: `ranks` virtual ranks sharing the current GPU, or (nccl) one
// rank per GPU 0..ranks-1 over NCCL (make_nccl_ranks), where the exchanges are the real wire.
struct ExpertParallelGroup {
  int ranks = 1;
  ExpertParallelScheme scheme = ExpertParallelScheme::AllToAll;
  bool nccl = false;
};
std::vector<ExpertParallelBenchRow> bench_expert_parallel(const std::string& model, const MoeProblem& problem,
                                                          const std::vector<int64_t>& tokens,
                                                          const ExpertParallelGroup& group,
                                                          const BenchOptions& options, bool progress = true);

// ---- tuning (`fp4moe tune`) ----
struct TuneProfileOptions {
  int64_t max_tokens = 16384;  // buckets whose representative T is <= this (bucket 0, T = 0, has no work)
  std::vector<int64_t> tokens;  // when not empty: only the buckets of these T (max_tokens is ignored)
  int reps = 15;               // timed graph replays per (bucket, tactic), L2 flushed before each
  uint64_t seed = 1;
  bool progress = true;        // a progress line on stderr
  L2Flush l2_flush = L2Flush::Read;  // as the bench's (BenchOptions)
};
// For every bucket of buckets_to_tune(max_tokens, tokens): times every candidate tactic of the problem
// (candidate_tactics) at the bucket's representative T on random weights and inputs routed by the
// problem's method (CUDA-graph replays, median), and returns one entry per bucket with the fastest tactic
// and the heuristic's time. Screening: the heuristic is timed first with `reps` replays; the others with
// as many as fit in ~100 ms (at least 7); a candidate whose first replay is more than 1.5x the best median
// so far is recorded as slower after that one replay. Confirmation: the heuristic and the two fastest
// others are timed again, in turns, twice each; the entry's times are the medians of those replays, and a
// tactic within 1.5% of the heuristic's time does not replace it (replay noise). Throws fp4moe::Error on
// any failure.
std::vector<TuneEntry> tune_problem(const std::string& label, const MoeProblem& problem,
                                    const TuneProfileOptions& options);

}  // namespace fp4moe
