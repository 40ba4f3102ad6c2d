// tools/checkpoint_commands.hpp — `fp4moe inspect`, `fp4moe run --checkpoint`, `fp4moe make-fixture`.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>

namespace fp4moe::tools {

struct InspectCommandOptions {
  std::string dir;
  int64_t max_layers = -1;
  CLI::App* command = nullptr;
};
void add_inspect_command(CLI::App& app, InspectCommandOptions& options);
int run_inspect_command(const InspectCommandOptions& options);

// `fp4moe make-fixture` (hidden): writes a small random checkpoint, for tests and GPU checks.
struct MakeFixtureOptions {
  std::string dir, format = "modelopt", family = "deepseek";
  int64_t layers = 2, experts = 8, hidden = 64, inter = 32;
  int top_k = 2, shards = 2;
  uint64_t seed = 1;
  CLI::App* command = nullptr;
};
void add_make_fixture_command(CLI::App& app, MakeFixtureOptions& options);
int run_make_fixture_command(const MakeFixtureOptions& options);

// `fp4moe run --checkpoint DIR --layer L --tokens T`: random hidden states, logits from the router.
struct CheckpointRunOptions {
  std::string dir, out, device = "cpu", fusion = "rescale_to_max", act_quant;
  int64_t layer = -1, tokens = 16;
  uint64_t seed = 1;
};
int run_checkpoint_layer(const CheckpointRunOptions& options);

}  // namespace fp4moe::tools
