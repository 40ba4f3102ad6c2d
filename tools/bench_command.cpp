// tools/bench_command.cpp — `fp4moe bench`: ceilings, then per (model, T) the layer against its floor.
#include "tools/bench_command.hpp"

#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <optional>
#include <sstream>

#include "fp4moe/bench.hpp"
#include "fp4moe/checkpoint.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/presets.hpp"
#include "fp4moe/weight_layout.hpp"

namespace fp4moe::tools {
std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> v;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) v.push_back(item);
  return v;
}

ActQuant mode_for_format(WeightFormat format, ActQuant given, const CLI::App* command) {
  const bool mode_given = command != nullptr && command->count("--mode") > 0;
  return !mode_given && format == WeightFormat::MXFP4 ? ActQuant::W4A16 : given;
}

std::vector<int64_t> parse_tokens(const std::string& s) {
  std::vector<int64_t> v;
  for (const std::string& item : split_list(s)) {
    size_t used = 0;
    long long t = 0;
    try {
      t = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    check(used == item.size() && t >= 1, "--tokens: expected a comma-separated list of integers >= 1, got '", item, "'");
    v.push_back(t);
  }
  check(!v.empty(), "--tokens: no token counts given");
  return v;
}

namespace {

// --json and --csv of the rows so far (rewritten whole each time).
void write_results(const BenchCommandOptions& o, const Ceilings& c, const BenchOptions& opt,
                   const std::vector<BenchRow>& rows) {
  if (!o.json.empty()) {
    nlohmann::json j;
    j["gpu"] = c.gpu_name;
    j["sm_count"] = c.sm_count;
    j["ceilings"] = {{"copy_tbps", c.copy_tbps}, {"bf16_tflops", c.bf16_tflops}};
    j["l2_flush"] = std::string(to_string(opt.l2_flush));
    j["rows"] = nlohmann::json::array();
    for (const BenchRow& r : rows) {
      nlohmann::json row = {{"model", r.model}, {"mode", std::string(to_string(r.mode))}, {"tokens", r.tokens},
                            {"experts_hit", r.experts_hit}, {"median_us", r.median_us}, {"min_us", r.min_us},
                            {"floor_us", r.floor_us}, {"pct_of_floor", r.pct_of_floor}, {"tflops", r.tflops},
                            {"weight_tbps", r.weight_tbps}, {"weight_bytes", r.weight_bytes}, {"flops", r.flops},
                            {"tactic", r.tactic}, {"replays_us", r.replay_us},
                            {"stages_us", {{"route", r.stages.route_us}, {"permute", r.stages.permute_us},
                                           {"quantize", r.stages.quantize_us}, {"gemm1", r.stages.gemm1_us},
                                           {"gemm2", r.stages.gemm2_us}, {"finalize", r.stages.finalize_us}}}};
      // null without NVML: no number stands in for a measurement that was not made
      const ClockStats& cl = r.clock;
      row["clock"] = cl.samples > 0 ? nlohmann::json{{"samples", cl.samples}, {"sm_mhz", cl.mean_sm_mhz},
                                                     {"sm_min_mhz", cl.min_sm_mhz}, {"power_w", cl.mean_power_w},
                                                     {"power_capped_fraction", cl.power_capped_fraction}}
                                    : nlohmann::json(nullptr);
      j["rows"].push_back(row);
    }
    std::ofstream f(o.json);
    check(static_cast<bool>(f), "--json: cannot write '", o.json, "'");
    f << j.dump(2) << "\n";
  }
  if (!o.csv.empty()) {
    std::ofstream f(o.csv);
    check(static_cast<bool>(f), "--csv: cannot write '", o.csv, "'");
    f << "model,mode,tokens,experts_hit,median_us,min_us,floor_us,pct_of_floor,tflops,weight_tbps,route_us,"
         "permute_us,quantize_us,gemm1_us,gemm2_us,finalize_us,tactic,sm_mhz,power_w\n";
    for (const BenchRow& r : rows) {
      f << r.model << ',' << to_string(r.mode) << ',' << r.tokens << ',' << r.experts_hit << ',' << r.median_us << ','
        << r.min_us << ',' << r.floor_us << ',' << r.pct_of_floor << ',' << r.tflops << ',' << r.weight_tbps << ','
        << r.stages.route_us << ',' << r.stages.permute_us << ',' << r.stages.quantize_us << ','
        << r.stages.gemm1_us << ',' << r.stages.gemm2_us << ',' << r.stages.finalize_us << ',' << r.tactic << ',';
      if (r.clock.samples > 0) f << r.clock.mean_sm_mhz << ',' << r.clock.mean_power_w;
      else f << ',';  // empty fields without NVML
      f << '\n';
    }
  }
}

}  // namespace

void add_bench_command(CLI::App& app, BenchCommandOptions& o) {
  CLI::App* b = app.add_subcommand("bench", "Time the layer against its floor (CUDA-graph replay, cold L2)");
  b->add_option("--model", o.models, "Preset name(s), comma-separated");
  b->add_option("--checkpoint", o.checkpoint, "A checkpoint directory instead of presets (with --layer)");
  b->add_option("--layer", o.layer, "With --checkpoint: the MoE layer index");
  b->add_option("--tokens", o.tokens, "Token counts, comma-separated")->capture_default_str();
  b->add_option("--mode", o.mode,
                "w4a16, w4a4_scalar or w4a4_per_expert; MXFP4 weights (gpt-oss-120b, gpt-oss-20b) run w4a16 only, "
                "which is their mode when --mode is not given")
      ->capture_default_str();
  b->add_option("--json", o.json, "Write the results as JSON to this file");
  b->add_option("--csv", o.csv, "Write the results as CSV to this file");
  b->add_option("--reps", o.reps, "Timed replays per row (>= 20)")->capture_default_str();
  b->add_option("--idle-ms", o.idle_ms, "Rest the GPU this long before each row (rested-board timing)")
      ->check(CLI::Range(0, 600000))
      ->capture_default_str();
  b->add_option("--warmup-ms", o.warmup_ms, "Keep replaying this long before each row's timed replays (loaded-board timing)")
      ->check(CLI::Range(0, 600000))
      ->capture_default_str();
  b->add_option("--l2-flush", o.l2_flush,
                "How each replay's weights are made cold: read (a 256 MiB read leaves the L2 clean) or write (a "
                "256 MiB memset leaves it dirty, and the layer's reads then also pay the write-back)")
      ->check(CLI::IsMember({"read", "write"}))
      ->capture_default_str();
  b->add_option("--tactic", o.tactic,
                "Force a tactic, e.g. sm90_wgmma/t256/s1 or sm90_stream/t16/s1x4 (GEMM1 split 1 way along K, GEMM2 "
                "4 ways; default: the runner's choice)");
  b->add_option("--tp-size", o.tp_size,
                "Tensor parallelism: time rank 0's layer of N ranks (its share of I in whole 16-column blocks, "
                "32-column for MXFP4; the all-reduce of the ranks' outputs is not included)")
      ->capture_default_str();
  b->add_option("--ep-size", o.ep_size,
                "Expert parallelism (presets): time rank 0's layer of N ranks, its experts on the whole layer's "
                "routing (the routing and the all-reduce are not included)")
      ->capture_default_str();
  b->add_option("--parallel", o.parallel,
                "With --ep-size N: ep_allreduce times rank 0's layer (above); ep_all2all runs the N ranks of the "
                "all-to-all layer (FP4 dispatch, fp32 combine) as virtual ranks sharing this GPU: the step time of "
                "the whole group (device copies stand in for the wire), each stage's time and the bytes each row copy "
                "puts on the wire; dp_allgather the same for the layer's all-gather scheme")
      ->check(CLI::IsMember({"ep_allreduce", "ep_all2all", "dp_allgather"}))
      ->capture_default_str();
  b->add_flag("--nccl", o.nccl,
              "With --parallel ep_all2all or dp_allgather: one rank per GPU (GPUs 0..N-1) over NCCL instead of "
              "virtual ranks sharing one GPU");
  b->add_flag("--expert-biases", o.expert_biases,
              "Presets: random expert biases (w13_bias, w2_bias, as gpt-oss has) on the random weights");
  b->add_flag("--no-refcheck", o.no_refcheck,
              "Skip the check of each row's output against the CPU reference (timing experiments only)");
  o.command = b;
}

// --parallel ep_all2all / dp_allgather: the virtual ranks' step and stage times and wire bytes
// (fp4moe/bench.hpp, bench_expert_parallel).
template <typename PresetOf>
int run_expert_parallel_bench(const BenchCommandOptions& o, const std::vector<std::string>& models,
                   const std::vector<int64_t>& tokens, const PresetOf& preset_of) {
  const std::string what = "bench --parallel " + o.parallel;
  check(!models.empty(), what, ": give --model PRESET[,PRESET] (a checkpoint layer is not supported)");
  check(o.tp_size == 1, what, ": --tp-size is not supported with it");
  check(o.json.empty() && o.csv.empty(), what, ": --json and --csv are not written for it yet; read the table");
  check(o.tactic.empty(), what, ": --tactic is not supported with it (each rank's selector chooses)");
  ExpertParallelGroup group;
  group.ranks = o.ep_size;
  group.scheme = o.parallel == "dp_allgather" ? ExpertParallelScheme::AllGather : ExpertParallelScheme::AllToAll;
  group.nccl = o.nccl;
  BenchOptions opt;
  opt.reps = o.reps;
  opt.refcheck = !o.no_refcheck;
  opt.expert_biases = o.expert_biases;
  std::printf("expert parallelism, %s: %d %s; a step is every rank's forward (host wall time, stream "
              "synchronised; no L2 flush). dispatch/experts/combine: the slowest rank's device time of the stage "
              "(events), the exchanges excluded; exch: the exchanges with their waits for the other ranks (%s)\n",
              to_string(group.scheme), o.ep_size, o.nccl ? "ranks, one per GPU, over NCCL" : "virtual ranks sharing one GPU",
              o.nccl ? "NCCL" : "device copies here, not a network");
  std::printf("\n%-16s %-16s %3s %7s %10s %10s %9s %9s %9s %9s %10s %10s %10s %12s\n", "model", "mode", "N", "T/rank",
              "median_us", "min_us", "dispatch", "experts", "combine", "exch", "rows_sent", "B/row", "expected",
              "combine_MB");
  for (const auto& m : models) {
    const MoeProblem p = preset_of(m);
    for (const ExpertParallelBenchRow& r : bench_expert_parallel(m, p, tokens, group, opt, true))
      std::printf("%-16s %-16s %3d %7lld %10.1f %10.1f %9.1f %9.1f %9.1f %9.1f %10lld %10.1f %10lld %12.2f\n",
                  r.model.c_str(), std::string(to_string(r.mode)).c_str(), r.ranks,
                  static_cast<long long>(r.tokens_per_rank), r.median_us, r.min_us, r.dispatch_us, r.experts_us,
                  r.combine_us, r.exchange_us, static_cast<long long>(r.rows_sent),
                  r.rows_sent ? double(r.dispatch_bytes) / double(r.rows_sent) : 0.0,
                  static_cast<long long>(r.row_bytes_expected), double(r.combine_bytes) / 1e6);
  }
  return 0;
}

int run_bench_command(const BenchCommandOptions& o) {
  const ActQuant given_mode = parse_act_quant(o.mode, "--mode");
  auto mode_for = [&](WeightFormat f) { return mode_for_format(f, given_mode, o.command); };
  auto preset_of = [&](const std::string& m) { return preset(m, mode_for(preset_weight_format(m))); };
  const std::vector<int64_t> tokens = parse_tokens(o.tokens);
  const std::vector<std::string> models = split_list(o.models);
  check(models.empty() != o.checkpoint.empty(), "bench: give either --model PRESET[,PRESET] or --checkpoint DIR --layer L");
  check(o.tp_size >= 1, "bench: --tp-size must be >= 1, got ", o.tp_size);
  check(!o.expert_biases || o.checkpoint.empty(),
        "bench: --expert-biases adds random biases to the presets' random weights; a checkpoint layer has its own");
  check(o.ep_size == 1 || o.checkpoint.empty(), "bench: --ep-size is for presets; a checkpoint layer is not "
        "supported with it yet (load_layer's ep_rank / ep_size give a rank's experts, but the bench routes logits)");
  // The problem of tensor-parallel rank 0 (the whole problem when --tp-size is 1), and its row label.
  auto rank_problem = [&](MoeProblem p) {
    p.inter = io::tensor_parallel_range(p.inter, 0, o.tp_size, p.weight_block()).second;
    return p;
  };
  const std::string rank_label = (o.tp_size > 1 ? "/tp" + std::to_string(o.tp_size) : "") +
                               (o.ep_size > 1 ? "/ep" + std::to_string(o.ep_size) : "");
  for (const auto& m : models) {  // unknown names, bad splits: before any GPU work
    const MoeProblem p = rank_problem(preset_of(m));
    check(o.ep_size >= 1 && o.ep_size <= p.num_experts, "bench: --ep-size must be in [1, E = ", p.num_experts,
          "] for ", m, ", got ", o.ep_size);
  }
  std::optional<io::MoeLayerWeights> layer;
  if (!o.checkpoint.empty()) {  // the checkpoint loads (and is checked) before any GPU work
    check(o.layer >= 0, "bench --checkpoint: --layer L (>= 0) is required");
    io::LoadOptions lo;
    lo.tp_size = o.tp_size;
    layer = io::Checkpoint::open(o.checkpoint).load_layer(o.layer, lo);
    layer->problem.act_quant = mode_for(layer->problem.weight_format);
    layer->problem.validate();  // e.g. an explicit w4a4 mode on MXFP4 weights
  }

  check(!o.nccl || o.parallel != "ep_allreduce", "bench --nccl: give --parallel ep_all2all or dp_allgather with it");
  if (o.parallel == "ep_all2all" || o.parallel == "dp_allgather") return run_expert_parallel_bench(o, models, tokens, preset_of);

  std::fprintf(stderr, "bench: measuring ceilings ...\n");
  const Ceilings c = measure_ceilings();
  std::printf("GPU: %s (%d SMs)   copy %.2f TB/s (read+write)   bf16 GEMM %.0f TFLOP/s\n", c.gpu_name.c_str(),
              c.sm_count, c.copy_tbps, c.bf16_tflops);
  BenchOptions opt;
  opt.reps = o.reps;
  opt.idle_ms = o.idle_ms;
  opt.warmup_ms = o.warmup_ms;
  opt.refcheck = !o.no_refcheck;
  opt.expert_biases = o.expert_biases;
  opt.ep_size = o.ep_size;
  opt.l2_flush = parse_l2_flush(o.l2_flush, "--l2-flush");
  if (!opt.refcheck) std::fprintf(stderr, "bench: --no-refcheck: the outputs are NOT checked against the CPU reference\n");
  if (!o.tactic.empty()) {
    opt.tactic = parse_tactic(o.tactic);
    check(opt.tactic.has_value(), "--tactic: expected KERNEL/tTILE/sSPLIT or KERNEL/tTILE/sSPLIT1xSPLIT2 (e.g. ",
          "sm90_wgmma/t256/s1, sm90_stream/t16/s1x4), got '", o.tactic, "'");
  }
  std::printf("L2 flush before each replay: %s\n", std::string(to_string(opt.l2_flush)).c_str());
  std::vector<BenchRow> rows;
  for (const auto& m : models) {
    auto r = bench_model(m + rank_label, rank_problem(preset_of(m)), tokens, c, opt, true);
    rows.insert(rows.end(), r.begin(), r.end());
    // NOTE: after every preset, so that a run stopped by a time limit keeps the presets it finished.
    write_results(o, c, opt, rows);
  }
  if (layer) {
    const std::string label = "layer " + std::to_string(o.layer) + rank_label;
    std::fprintf(stderr, "bench %s of %s: %s\n", label.c_str(), o.checkpoint.c_str(), layer->problem.describe().c_str());
    rows = bench_weights(label, layer->problem, layer->weights(), tokens, c, opt, true);
    write_results(o, c, opt, rows);
  }

  // SM MHz: the mean SM clock during the timed replays ("-" without NVML).
  std::printf("\n%-16s %-16s %6s %5s %10s %10s %10s %7s %8s %8s %6s | %7s %7s %7s %7s %7s %7s  %s\n", "model", "mode",
              "T", "hit", "median_us", "min_us", "floor_us", "%floor", "TFLOP/s", "W TB/s", "SM MHz", "route", "permute",
              "quant", "gemm1", "gemm2", "final", "tactic");
  for (const BenchRow& r : rows) {
    const std::string mhz = r.clock.samples > 0 ? std::to_string(static_cast<int>(r.clock.mean_sm_mhz + 0.5)) : "-";
    std::printf("%-16s %-16s %6lld %5lld %10.1f %10.1f %10.1f %6.1f%% %8.1f %8.2f %6s | %7.1f %7.1f %7.1f %7.1f %7.1f %7.1f  %s\n",
                r.model.c_str(), std::string(to_string(r.mode)).c_str(), static_cast<long long>(r.tokens),
                static_cast<long long>(r.experts_hit), r.median_us, r.min_us, r.floor_us, r.pct_of_floor, r.tflops,
                r.weight_tbps, mhz.c_str(), r.stages.route_us, r.stages.permute_us, r.stages.quantize_us,
                r.stages.gemm1_us, r.stages.gemm2_us, r.stages.finalize_us, r.tactic.c_str());
  }
  return 0;
}

}  // namespace fp4moe::tools
