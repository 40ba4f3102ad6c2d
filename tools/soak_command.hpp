// tools/soak_command.hpp — the `fp4moe soak` subcommand: random problems through a backend, each
// checked against the CPU reference (tools/soak_problem.hpp).
//
//   fp4moe soak --out DIR [--problems N] [--seed S] [--start I] [--device cuda|cpu] [--time-limit SEC]
//
// Problem i is derived from (seed, i) alone: `--start I --problems 1` replays problem I. DIR receives
//   current         the index of the problem in progress (read by scripts/gpu-soak after a crash)
//   next            the first index not run, written when the command ends normally
//   mismatches.log  one line per mismatch (appended)
//   crashes.log     one line per problem after which the device was unusable (appended)
//   soak-S-I.safetensors / .txt  the case file of each mismatch and what differed
// Exit status: 0 every problem matched, 1 mismatches, 2 bad arguments or no usable GPU, 4 the device
// failed (a problem left it unusable: counted as a crash, DIR/next is the problem after it).
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>

namespace fp4moe::tools {

struct SoakOptions {
  int64_t problems = 10000;
  uint64_t seed = 1;
  int64_t start = 0;
  std::string out;
  std::string device = "cuda";  // the backend checked: cuda (the GPU runner) or cpu (the reference itself)
  double time_limit = 0;        // seconds; 0: none. No problem starts after it (DIR/next says where to resume).
  double progress_seconds = 2;  // a progress line at least this often
  CLI::App* command = nullptr;
};

void add_soak_command(CLI::App& app, SoakOptions& options);
int run_soak_command(const SoakOptions& options);

}  // namespace fp4moe::tools
