// tools/bench_command.hpp — the `fp4moe bench` subcommand.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "fp4moe/problem.hpp"

namespace fp4moe::tools {

struct BenchCommandOptions {
  std::string models;
  std::string tokens = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192,16384";
  std::string mode = "w4a4_scalar";
  std::string json, csv;
  int reps = 30;
  int idle_ms = 0, warmup_ms = 0;  // BenchOptions
  std::string l2_flush = "read";   // BenchOptions::l2_flush
  std::string tactic;      // force a tactic (describe() form, e.g. sm90_wgmma/t256/s1)
  bool no_refcheck = false;  // time without checking the output (experiments that knowingly break it)
  int tp_size = 1;         // time tensor-parallel rank 0's layer (its share of I) instead of the whole layer
  bool expert_biases = false;  // presets: random expert biases (gpt-oss) on the random weights
  int ep_size = 1;         // presets: time expert-parallel rank 0's layer (BenchOptions::ep_size)
  bool nccl = false;       // with ep_all2all / dp_allgather: one rank per GPU over NCCL
  std::string parallel = "ep_allreduce";  // with ep_size: ep_allreduce (rank 0's layer) or ep_all2all
  std::string checkpoint;  // instead of --model: a checkpoint directory ...
  int64_t layer = -1;      // ... and its MoE layer
  CLI::App* command = nullptr;
};

void add_bench_command(CLI::App& app, BenchCommandOptions& options);
int run_bench_command(const BenchCommandOptions& options);
// The non-empty items of a comma-separated list ("a,,b" -> {a, b}); --model lists of bench and tune.
std::vector<std::string> split_list(const std::string& list);
// A --tokens list ("1,2,4"): integers >= 1; throws fp4moe::Error naming the bad item (also `fp4moe tune`).
std::vector<int64_t> parse_tokens(const std::string& list);
// The mode that bench and tune run weights of `format` in: `given`, except that MXFP4 weights (one mode,
// w4a16) take w4a16 when --mode was not on `command`'s line; an explicit other mode is left for
// preset()'s error naming the preset.
ActQuant mode_for_format(WeightFormat format, ActQuant given, const CLI::App* command);

}  // namespace fp4moe::tools
