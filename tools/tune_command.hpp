// tools/tune_command.hpp — the `fp4moe tune` subcommand.
//
//   fp4moe tune --show [--cache FILE]                                   print the cache as tables
//   fp4moe tune --model PRESET[,PRESET] [--max-tokens N | --tokens T[,T]] [--cache FILE] [--l2-flush read|write]
//                                                                       profile (CUDA build; run_tune_profile)
//
// The cache path: --cache, else FP4MOE_TUNE_CACHE, else ./fp4moe-tune-cache.json.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>

namespace fp4moe::tools {

struct TuneOptions {
  std::string models;          // comma-separated presets (profiling)
  int64_t max_tokens = 16384;  // profile the buckets whose representative T is <= this (profiling)
  std::string tokens;          // else, when given: only the buckets of these T, comma-separated
  std::string mode = "w4a4_scalar";  // quant mode of the presets (profiling)
  std::string cache;           // "" = default_tune_cache_path()
  std::string l2_flush = "read";  // TuneProfileOptions::l2_flush (profiling)
  bool show = false;           // print the cache instead of profiling
  CLI::App* command = nullptr;
};

void add_tune_command(CLI::App& app, TuneOptions& options);
// --show: show_tune_cache; otherwise run_tune_profile. Returns the exit status.
int run_tune_command(const TuneOptions& options);
// Prints the cache at path grouped by device and problem, one row per bucket. Exit status: 0, or 2
// when the file is missing (fp4moe::Error) or unreadable / corrupt (warning on stderr).
int show_tune_cache(const std::string& path);

// The profiling half of `fp4moe tune`: for every preset of options.models and every bucket up to
// options.max_tokens (or of options.tokens), time every candidate tactic at the bucket's
// representative T and write the fastest (and the heuristic's time) to the cache (tune_problem of
// the runner; a build without CUDA reports that it needs one). Exit status 2 without a Hopper GPU.
int run_tune_profile(const TuneOptions& options);

}  // namespace fp4moe::tools
