// tools/fp4moe_main.cpp — the `fp4moe` command line: run, demo.
//
//   fp4moe run --case CASE.safetensors --out OUT.safetensors [--device cpu|cuda]
//   fp4moe demo [--model tiny] [--tokens 64] [--device auto|cpu|cuda] [--seed 1]
//   fp4moe bench (--model PRESET[,PRESET] | --checkpoint DIR --layer L) --tokens LIST [--mode M] [--json F] [--csv F]
//   fp4moe run --checkpoint DIR --layer L --tokens T [--device cpu|cuda] [--out OUT] [--seed S]
//   fp4moe inspect DIR
//   fp4moe tune --show [--cache FILE]
//   fp4moe soak --out DIR [--problems N] [--seed S] [--start I] [--device cuda|cpu]
#include <CLI/CLI.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <string>

#include "fp4moe/bench.hpp"
#include "fp4moe/case_file.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/presets.hpp"
#include "fp4moe/reference.hpp"
#include "fp4moe/runner.hpp"
#include "tools/bench_command.hpp"
#include "tools/checkpoint_commands.hpp"
#include "tools/soak_command.hpp"
#include "tools/tune_command.hpp"

namespace fp4moe::tools {
namespace {

enum class Device { Auto, Cpu, Cuda };

Device parse_device(const std::string& s) {
  if (s == "auto") return Device::Auto;
  if (s == "cpu") return Device::Cpu;
  if (s == "cuda") return Device::Cuda;
  throw Error("--device must be one of auto, cpu, cuda; got '" + s + "'");
}

// Resolves auto to cuda when a usable GPU and the GPU path exist, else cpu (saying why).
bool use_gpu(Device d, bool quiet) {
  std::string why;
  const bool available = cuda_device_available(&why);
  if (d == Device::Cuda && !available) throw Error("--device cuda: no usable GPU: " + why);
  if (d == Device::Auto && !available && !quiet) std::printf("device: cpu reference (%s)\n", why.c_str());
  return d != Device::Cpu && available;
}

int cmd_run(const std::string& case_path, const std::string& out_path, const std::string& device) {
  const Device d = parse_device(device);
  io::MoeCase c = io::load_case(case_path);
  reference::MoeResult result;
  if (use_gpu(d, true)) {
    result = run_case_on_gpu(c);
  } else {
    result = reference::moe_forward(c.problem, c.num_tokens, c.hidden_states.data(), c.router(), c.weights());
  }
  io::save_result(out_path, c.problem, c.num_tokens, result);
  std::printf("%s: T=%lld %s -> %s\n", device == "cuda" ? "cuda" : "cpu", static_cast<long long>(c.num_tokens),
              c.problem.describe().c_str(), out_path.c_str());
  return 0;
}

struct ErrorStats {
  double rel_l2 = 0, max_abs = 0;
};

ErrorStats compare(const std::vector<uint16_t>& out_bf16, const std::vector<float>& ref) {
  double num = 0, den = 0, mx = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double o = format::bf16_to_float(out_bf16[i]), r = ref[i];
    num += (o - r) * (o - r);
    den += r * r;
    mx = std::max(mx, std::fabs(o - r));
  }
  return {den > 0 ? std::sqrt(num / den) : std::sqrt(num), mx};
}

int cmd_demo(const std::string& model, int64_t tokens, const std::string& device, uint64_t seed) {
  const Device d = parse_device(device);
  const bool gpu = use_gpu(d, false);
  MoeProblem problem = preset(model, ActQuant::W4A16);
  std::printf("fp4moe demo: %s MoE layer, preset '%s'\n",
              problem.weight_format == WeightFormat::MXFP4 ? "MXFP4" : "NVFP4", model.c_str());
  std::printf("  problem: T=%lld %s\n", static_cast<long long>(tokens), problem.describe().c_str());
  std::printf("  device:  %s\n", gpu ? "cuda (fp4moe kernels)" : "cpu (reference)");
  std::vector<float> w13_fp32, w2_fp32;
  io::RandomCaseOptions opts;
  opts.seed = seed;
  io::MoeCase c = io::make_random_case(problem, tokens, opts, &w13_fp32, &w2_fp32);
  const reference::MoeResult routed =
      reference::moe_forward(c.problem, c.num_tokens, c.hidden_states.data(), c.router(), c.weights());
  reference::Routing routing{routed.topk_ids, routed.topk_weights};
  const std::vector<float> exact =
      reference::moe_forward_fp32(problem, tokens, c.hidden_states.data(), routing, w13_fp32.data(), w2_fp32.data());
  std::printf("  yardstick: the same layer in fp32 with the unquantized (bf16) weights\n\n");
  std::printf("  %-16s %12s %14s %14s\n", "mode", "time", "rel L2 error", "max abs error");
  for (ActQuant mode : {ActQuant::W4A16, ActQuant::W4A4Scalar, ActQuant::W4A4PerExpert}) {
    if (problem.weight_format == WeightFormat::MXFP4 && mode != ActQuant::W4A16) {
      std::printf("  %-16s %12s   (mxfp4 weights run in w4a16 only)\n", std::string(to_string(mode)).c_str(), "-");
      continue;
    }
    c.problem.act_quant = mode;
    reference::MoeResult r;
    double ms = 0;
    if (gpu) {
      r = run_case_on_gpu(c, &ms);
    } else {
      const auto t0 = std::chrono::steady_clock::now();
      r = reference::moe_forward(c.problem, c.num_tokens, c.hidden_states.data(), c.router(), c.weights());
      ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    }
    const ErrorStats s = compare(r.output, exact);
    std::printf("  %-16s %9.3f ms %14.3e %14.3e\n", std::string(to_string(mode)).c_str(), ms, s.rel_l2, s.max_abs);
  }
  std::printf("\n  w4a16 quantizes the weights only; w4a4 also quantizes the activations to NVFP4,\n"
              "  so its error is larger. Time: %s.\n",
              gpu ? "one layer forward on the GPU (CUDA events, after a warm-up)" : "one reference forward on the CPU");
  return 0;
}

}  // namespace
}  // namespace fp4moe::tools

int main(int argc, char** argv) {
  using namespace fp4moe::tools;
  CLI::App app{"fp4moe: NVFP4 Mixture-of-Experts layers on Hopper GPUs"};
  app.require_subcommand(1);

  std::string case_path, out_path, device = "cpu";
  CheckpointRunOptions ckrun;
  CLI::App* run = app.add_subcommand("run", "Run one MoE layer from a case file (or a checkpoint layer) and write the result file");
  CLI::Option* case_opt = run->add_option("--case", case_path, "Case file (.safetensors, docs/case-file.md)");
  run->add_option("--out", out_path, "Output file (.safetensors: output, topk_ids, topk_weights)");
  run->add_option("--device", device, "cpu (the reference) or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  CLI::Option* ck_opt = run->add_option("--checkpoint", ckrun.dir, "Checkpoint directory (instead of --case)");
  ck_opt->excludes(case_opt);
  run->add_option("--layer", ckrun.layer, "With --checkpoint: the MoE layer index")->needs(ck_opt);
  run->add_option("--tokens", ckrun.tokens, "With --checkpoint: number of random tokens T")->needs(ck_opt)->capture_default_str();
  run->add_option("--seed", ckrun.seed, "With --checkpoint: seed of the hidden states")->needs(ck_opt)->capture_default_str();
  run->add_option("--fusion", ckrun.fusion, "With --checkpoint: w1/w3 scale fusion policy: rescale_to_max or error")
      ->needs(ck_opt)->capture_default_str();
  run->add_option("--act-quant", ckrun.act_quant, "With --checkpoint: override the act_quant of the checkpoint")->needs(ck_opt);

  std::string model = "tiny", demo_device = "auto";
  int64_t tokens = 64;
  uint64_t seed = 1;
  CLI::App* demo = app.add_subcommand("demo", "Build a preset from random weights, run it, print its error");
  demo->add_option("--model", model, "Model preset")->capture_default_str();
  demo->add_option("--tokens", tokens, "Number of tokens T")->capture_default_str()->check(CLI::Range(int64_t(0), int64_t(1) << 20));
  demo->add_option("--device", demo_device, "auto, cpu or cuda")->capture_default_str()->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  demo->add_option("--seed", seed, "Random seed")->capture_default_str();

  BenchCommandOptions bench;
  add_bench_command(app, bench);

  InspectCommandOptions inspect;
  add_inspect_command(app, inspect);
  MakeFixtureOptions fixture;
  add_make_fixture_command(app, fixture);
  TuneOptions tune;
  add_tune_command(app, tune);
  SoakOptions soak;
  add_soak_command(app, soak);

  CLI11_PARSE(app, argc, argv);
  try {
    if (run->parsed() && !ckrun.dir.empty()) {
      ckrun.out = out_path;
      ckrun.device = device;
      return run_checkpoint_layer(ckrun);
    }
    if (run->parsed()) {
      fp4moe::check(!case_path.empty(), "run: --case CASE (or --checkpoint DIR) is required");
      fp4moe::check(!out_path.empty(), "run --case: --out OUT is required");
      return cmd_run(case_path, out_path, device);
    }
    if (inspect.command->parsed()) return run_inspect_command(inspect);
    if (fixture.command->parsed()) return run_make_fixture_command(fixture);
    if (bench.command->parsed()) return run_bench_command(bench);
    if (tune.command->parsed()) return run_tune_command(tune);
    if (soak.command->parsed()) return run_soak_command(soak);
    if (demo->parsed()) return cmd_demo(model, tokens, demo_device, seed);
  } catch (const fp4moe::Error& e) {
    std::fprintf(stderr, "fp4moe: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fp4moe: internal error: %s\n", e.what());
    return 3;
  }
  return 1;
}
