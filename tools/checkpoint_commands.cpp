// tools/checkpoint_commands.cpp — checkpoint subcommands of `fp4moe`.
//
//   inspect DIR [--layers N]: the report of io::inspect_checkpoint; exit 0 when servable, else 2.
//   run --checkpoint DIR --layer L --tokens T [--device cpu|cuda] [--out OUT] [--seed S]:
//     load layer L, draw hidden states (io::random_hidden_states), compute the router logits from the
//     real router weight, run the layer (reference or GPU via the case), save OUT, print a summary.
//   make-fixture DIR --format F --family M: write a small random checkpoint (hidden subcommand; gpt-oss:
//     --format mxfp4 --family gpt_oss).
#include "tools/checkpoint_commands.hpp"

#include <cmath>
#include <cstdio>

#include "fp4moe/bench.hpp"
#include "fp4moe/case_file.hpp"
#include "fp4moe/checkpoint.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/reference.hpp"
#include "fp4moe/runner.hpp"

namespace fp4moe::tools {

void add_inspect_command(CLI::App& app, InspectCommandOptions& o) {
  CLI::App* c = app.add_subcommand("inspect", "Check an NVFP4 or MXFP4 (gpt-oss) MoE checkpoint directory and print its structure");
  c->add_option("dir", o.dir, "Checkpoint directory (config.json, *.safetensors)")->required();
  c->add_option("--layers", o.max_layers, "Load at most this many MoE layers (default: all)");
  o.command = c;
}

int run_inspect_command(const InspectCommandOptions& o) {
  const io::InspectReport r = io::inspect_checkpoint(o.dir, o.max_layers);
  const std::string text = r.to_text();
  std::fputs(text.c_str(), r.servable() ? stdout : stderr);
  return r.servable() ? 0 : 2;
}

void add_make_fixture_command(CLI::App& app, MakeFixtureOptions& o) {
  CLI::App* c = app.add_subcommand("make-fixture", "Write a small random NVFP4 or MXFP4 (gpt-oss) MoE checkpoint (tests)");
  c->group("");  // hidden from --help
  c->add_option("dir", o.dir, "Output directory")->required();
  c->add_option("--format", o.format, "modelopt, compressed-tensors or mxfp4 (with --family gpt_oss)")->capture_default_str();
  c->add_option("--family", o.family, "deepseek, qwen3, llama4, mixtral or gpt_oss (with --format mxfp4)")->capture_default_str();
  c->add_option("--layers", o.layers, "Layers")->capture_default_str();
  c->add_option("--experts", o.experts, "Routed experts")->capture_default_str();
  c->add_option("--hidden", o.hidden, "Hidden size H")->capture_default_str();
  c->add_option("--inter", o.inter, "Expert intermediate size I")->capture_default_str();
  c->add_option("--top-k", o.top_k, "Experts per token")->capture_default_str();
  c->add_option("--shards", o.shards, "Shards (1: one model.safetensors)")->capture_default_str();
  c->add_option("--seed", o.seed, "Random seed")->capture_default_str();
  o.command = c;
}

int run_make_fixture_command(const MakeFixtureOptions& o) {
  io::FixtureOptions f;
  f.format = io::parse_checkpoint_format(o.format);
  f.family = io::parse_model_family(o.family);
  f.num_layers = o.layers;
  f.num_experts = o.experts;
  f.hidden = o.hidden;
  f.inter = o.inter;
  f.top_k = o.top_k;
  f.num_shards = o.shards;
  f.seed = o.seed;
  const io::Fixture fx = io::write_fixture(o.dir, f);
  std::printf("wrote %s: %s %s, %lld layers (%zu MoE), %s\n", o.dir.c_str(), std::string(to_string(f.format)).c_str(),
              std::string(to_string(f.family)).c_str(), static_cast<long long>(f.num_layers), fx.layers.size(),
              fx.config.problem.describe().c_str());
  return 0;
}

int run_checkpoint_layer(const CheckpointRunOptions& o) {
  check(o.device == "cpu" || o.device == "cuda", "--device must be cpu or cuda, got '", o.device, "'");
  check(o.layer >= 0, "--layer is required with --checkpoint (a MoE layer index)");
  check(o.tokens >= 0, "--tokens must be >= 0, got ", o.tokens);
  const io::Checkpoint ck = io::Checkpoint::open(o.dir);
  io::LoadOptions lo;
  lo.fusion = io::parse_scale_fusion_policy(o.fusion);
  io::MoeLayerWeights w = ck.load_layer(o.layer, lo);
  if (!o.act_quant.empty()) {
    w.problem.act_quant = parse_act_quant(o.act_quant, "--act-quant");
    w.problem.validate();  // e.g. a w4a4 mode on MXFP4 weights (w4a16 only)
  }
  io::MoeCase c = w.to_case(io::random_hidden_states(o.tokens, w.problem.hidden, o.seed), o.tokens);
  reference::MoeResult result;
  if (o.device == "cuda") {
    std::string why;
    check(cuda_device_available(&why), "--device cuda: no usable GPU: ", why);
    result = run_case_on_gpu(c);
  } else {
    result = reference::moe_forward(c.problem, c.num_tokens, c.hidden_states.data(), c.router(), c.weights());
  }
  if (!o.out.empty()) io::save_result(o.out, c.problem, c.num_tokens, result);
  double sumsq = 0;
  int64_t non_finite = 0;
  for (uint16_t v : result.output) {
    const float f = format::bf16_to_float(v);
    if (!std::isfinite(f)) ++non_finite;
    else sumsq += double(f) * f;
  }
  const double rms = result.output.empty() ? 0.0 : std::sqrt(sumsq / double(result.output.size()));
  std::printf("%s: %s layer %lld, T=%lld %s\n", o.device.c_str(), o.dir.c_str(), static_cast<long long>(o.layer),
              static_cast<long long>(o.tokens), c.problem.describe().c_str());
  if (w.problem.weight_format == WeightFormat::NVFP4)  // MXFP4 has no global scales to fuse
    std::printf("  w1/w3 fusion: %lld experts rescaled, %lld block scales changed, worst relative change %g\n",
                static_cast<long long>(w.fusion.experts_rescaled),
                static_cast<long long>(w.fusion.block_scales_changed), w.fusion.worst_relative_change);
  std::printf("  output rms %.6g, non-finite %lld%s%s\n", rms, static_cast<long long>(non_finite),
              o.out.empty() ? "" : " -> ", o.out.c_str());
  return 0;
}

}  // namespace fp4moe::tools
