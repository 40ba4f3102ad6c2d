// fuzz/checkpoint_layer_fuzz.cpp — libFuzzer target for io::Checkpoint (open + load_layer) and
// io::inspect_checkpoint on whole one-file checkpoints: the gpt-oss MXFP4 layout (fused expert blocks,
// ue8m0 scales, biases, router bias) and the NVFP4 per-expert layouts.
//
// Steps per input:
//   1. split the bytes at the first NUL: before it is config.json, after it model.safetensors (no NUL:
//      no weights file); write both into one scratch checkpoint directory (tmpfs when available);
//   2. inspect_checkpoint must not throw (it records every problem), and must call the checkpoint
//      servable only when every MoE layer it lists loads below;
//   3. Checkpoint::open, then load_layer for the first MoE layers (at most 4), and for gpt-oss also as
//      tensor-parallel rank 1 of 2 when I allows it; fp4moe::Error is the expected outcome for bad
//      input, and its message must name the checkpoint directory;
//   4. a layer that loads must be usable: every tensor sized by its problem, MXFP4 scales without code
//      255, biases finite, and (when small) the CPU reference runs it on two tokens without error.
// Anything else (a crash, another exception type, a sanitizer report, a failed check) is a finding:
// the target aborts with a message. Seeds: fuzz/corpus/checkpoint_layer/ (fuzz_make_seeds).
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <string>
#include <string_view>

#include "fp4moe/checkpoint.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/reference.hpp"

namespace {

using namespace fp4moe;

[[noreturn]] void finding(const std::string& what) {
  std::fprintf(stderr, "checkpoint_layer_fuzz: FINDING: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

std::string scratch_dir() {
  if (const char* d = std::getenv("FP4MOE_FUZZ_TMPDIR"); d && *d) return d;
  if (::access("/dev/shm", W_OK) == 0) return "/dev/shm";
  if (const char* d = std::getenv("TMPDIR"); d && *d) return d;
  return "/tmp";
}

struct Scratch {
  std::string dir, config, weights;
  Scratch() {
    dir = scratch_dir() + "/fp4moe_fuzz_ckpt_" + std::to_string(::getpid());
    ::mkdir(dir.c_str(), 0700);
    config = dir + "/config.json";
    weights = dir + "/model.safetensors";
  }
  ~Scratch() {
    ::unlink(config.c_str());
    ::unlink(weights.c_str());
    ::rmdir(dir.c_str());
  }
};

void write_file(const std::string& path, std::string_view bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!f.good()) finding("cannot write the scratch file " + path);
}

void expect_size(size_t got, int64_t want, const char* what) {
  if (static_cast<int64_t>(got) != want)
    finding(std::string("loaded layer: ") + what + " has " + std::to_string(got) + " elements, expected " +
            std::to_string(want));
}

void check_layer(const io::MoeLayerWeights& w) {
  const MoeProblem& p = w.problem;
  const int64_t E = p.num_experts, H = p.hidden, I = p.inter, blk = p.weight_block(), n13 = p.w13_rows();
  expect_size(w.w13.size(), E * n13 * (H / 2), "w13");
  expect_size(w.w13_scale.size(), E * n13 * (H / blk), "w13_scale");
  expect_size(w.w2.size(), E * H * (I / 2), "w2");
  expect_size(w.w2_scale.size(), E * H * (I / blk), "w2_scale");
  expect_size(w.router_weight.size(), w.total_experts * H, "router_weight");
  if (p.weight_format == WeightFormat::MXFP4) {
    if (format::find_ue8m0_nan(w.w13_scale.data(), int64_t(w.w13_scale.size())) >= 0 ||
        format::find_ue8m0_nan(w.w2_scale.data(), int64_t(w.w2_scale.size())) >= 0)
      finding("loaded MXFP4 layer holds a ue8m0 code 255");
    expect_size(w.w13_bias.size(), E * n13, "w13_bias");
    if (w.inter_begin == 0) expect_size(w.w2_bias.size(), E * H, "w2_bias");
    expect_size(w.router_bias.size(), w.total_experts, "router_bias");
    if (!w.w13_scale_2.empty() || !w.w2_scale_2.empty()) finding("loaded MXFP4 layer has global scales");
  } else {
    expect_size(w.w13_scale_2.size(), E, "w13_scale_2");
    expect_size(w.w2_scale_2.size(), E, "w2_scale_2");
  }
  for (const auto* v : {&w.w13_bias, &w.w2_bias, &w.router_bias, &w.routing_bias})
    for (float x : *v)
      if (!std::isfinite(x)) finding("loaded layer holds a non-finite bias");
  // The CPU reference on two tokens: the layer the loader accepted must run (small layers only).
  if (w.expert_begin == 0 && w.expert_end == w.total_experts && E * H * I <= (int64_t(1) << 20)) {
    const io::MoeCase c = w.to_case(io::random_hidden_states(2, H, 1), 2);
    try {
      reference::moe_forward(c.problem, 2, c.hidden_states.data(), c.router(), c.weights());
    } catch (const Error& e) {
      finding(std::string("the reference refuses a layer the loader accepted: ") + e.what());
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Scratch scratch;
  const std::string_view all(reinterpret_cast<const char*>(data), size);
  const size_t nul = all.find('\0');
  write_file(scratch.config, all.substr(0, nul));
  if (nul == std::string_view::npos) ::unlink(scratch.weights.c_str());
  else write_file(scratch.weights, all.substr(nul + 1));

  io::InspectReport report;
  try {
    report = io::inspect_checkpoint(scratch.dir, 4);
  } catch (const std::exception& e) {
    finding(std::string("inspect_checkpoint threw: ") + e.what());
  }
  int64_t loaded = 0;
  bool tp_step = false;
  try {
    const io::Checkpoint ck = io::Checkpoint::open(scratch.dir);
    const io::CheckpointConfig& cfg = ck.config();
    for (int64_t L = 0; L < cfg.num_layers && loaded < 4; ++L) {
      if (!cfg.is_moe_layer(L)) continue;
      check_layer(ck.load_layer(L));
      ++loaded;
      if (cfg.family == io::ModelFamily::GptOss && cfg.problem.inter / 32 >= 2) {
        io::LoadOptions lo;
        lo.tp_rank = 1;
        lo.tp_size = 2;
        tp_step = true;
        check_layer(ck.load_layer(L, lo));
        tp_step = false;
      }
    }
  } catch (const Error& e) {
    if (std::strstr(e.what(), scratch.dir.c_str()) == nullptr)
      finding(std::string("fp4moe::Error does not name the checkpoint: ") + e.what());
    if (tp_step) finding(std::string("tensor-parallel rank 1 fails where the whole layer loads: ") + e.what());
    if (report.servable() && static_cast<int64_t>(report.loaded_layers.size()) > loaded)
      finding(std::string("inspect called the checkpoint servable, but a layer it loaded fails: ") + e.what());
  } catch (const std::exception& e) {
    finding(std::string("unexpected exception (not fp4moe::Error): ") + e.what());
  } catch (...) {
    finding("unexpected non-std exception");
  }
  return 0;
}
