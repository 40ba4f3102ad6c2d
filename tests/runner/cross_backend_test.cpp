// tests/runner/cross_backend_test.cpp — the two backends of `fp4moe run --case` agree on every case
// file: the fixture cases of the tests and 1,000 problems of the soak (tools/soak_problem.hpp), each
// saved as a case file, loaded and run by the CPU reference and by the GPU runner. Either both accept
// it, with outputs within the tolerance table of docs/numerics.md ("The whole layer"; soak::check_outcome),
// or both refuse it with the same message.
#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <filesystem>
#include <future>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "fp4moe/bench.hpp"
#include "fp4moe/case_file.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/reference.hpp"
#include "fp4moe/runner.hpp"
#include "reference/parallel.hpp"
#include "test_dir.hpp"
#include "tools/soak_problem.hpp"

namespace fp4moe {
namespace {

bool have_gpu() {
  std::string why;
  return cuda_device_available(&why);
}

#define SKIP_WITHOUT_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no sm_90 GPU"

// One backend on a case file: load_case, then the layer (the reference on `tokens` when given).
soak::Outcome run_file(const std::string& path, bool gpu, std::optional<MoeTactic> tactic,
                       const std::vector<int64_t>* tokens, io::MoeCase* loaded) {
  soak::Outcome o;
  try {
    io::MoeCase c = io::load_case(path);
    if (gpu) {
      o.result = run_case_on_gpu(c, nullptr, tactic);
    } else if (tokens) {
      o = soak::reference_outcome(c, *tokens);
    } else {
      o.result = reference::moe_forward(c.problem, c.num_tokens, c.hidden_states.data(), c.router(), c.weights());
    }
    if (loaded) *loaded = std::move(c);
  } catch (const Error& e) {
    o.refused = true;
    o.message = e.what();
  }
  return o;
}

// The CPU side of a case file: the loaded case, the tokens the reference computed, its outcome.
struct CpuSide {
  io::MoeCase c;
  std::vector<int64_t> tokens;
  soak::Outcome cpu;
};

CpuSide cpu_side(const std::string& path, std::optional<MoeTactic> tactic, const soak::SoakProblem* sp) {
  CpuSide s;
  if (sp) {  // the soak's token sample for large problems (the case itself, to pick it, is loaded once more)
    try {
      s.c = io::load_case(path);
      s.tokens = soak::reference_tokens(*sp, s.c);
    } catch (const Error&) {
    }
    s.cpu = run_file(path, false, tactic, &s.tokens, &s.c);
  } else {
    s.cpu = run_file(path, false, tactic, nullptr, &s.c);
    for (int64_t t = 0; t < s.c.num_tokens; ++t) s.tokens.push_back(t);
  }
  return s;
}

// "" when both backends agree on the case file.
std::string compare(const CpuSide& s, const soak::Outcome& gpu) {
  const soak::Outcome& cpu = s.cpu;
  if (cpu.refused && gpu.refused)
    return cpu.message == gpu.message ? std::string()
                                      : "refused with different messages: cpu '" + cpu.message + "', gpu '" + gpu.message + "'";
  if (cpu.refused) return "the CPU refuses ('" + cpu.message + "'), the GPU accepts";
  if (gpu.refused) return "the GPU refuses ('" + gpu.message + "'), the CPU accepts";
  return soak::check_outcome(s.c, s.tokens, cpu, gpu, /*bad_id_rows_nan=*/false);
}

std::string agree(const std::string& path) {
  return compare(cpu_side(path, std::nullopt, nullptr), run_file(path, true, std::nullopt, nullptr, nullptr));
}

// ---- the fixture case files ----------------------------------------------------------------------
// The kinds of case the tests write (tests/io/case_file_test.cpp, tests/tools/cli_test.cpp): a case of
// every routing input, activation and mode, bf16 logits, no input scales, zero tokens, expert biases,
// and the bad values that a loader refuses.

MoeProblem small_problem(Activation act, RoutingMethod method, ActQuant quant) {
  MoeProblem p;
  p.num_experts = 4;
  p.hidden = 32;
  p.inter = 48;
  p.routing.method = method;
  p.routing.top_k = 2;
  p.activation.kind = act;
  p.act_quant = quant;
  return p;
}

std::vector<std::string> write_fixtures() {
  const std::string dir = test::fresh_dir("cross-backend", "fixtures");
  std::filesystem::create_directories(dir);
  std::vector<std::string> paths;
  auto save = [&](const std::string& name, const io::MoeCase& c) {
    paths.push_back(dir + "/" + name + ".safetensors");
    io::save_case(paths.back(), c);
  };
  save("gated-f32-logits", io::make_random_case(small_problem(Activation::SwiGLU, RoutingMethod::Renormalize,
                                                              ActQuant::W4A4PerExpert), 5, {.seed = 3}));
  save("relu2-precomputed", io::make_random_case(small_problem(Activation::Relu2, RoutingMethod::Precomputed,
                                                               ActQuant::W4A4Scalar), 6, {.seed = 4}));
  {
    MoeProblem p = small_problem(Activation::SwiGLUOai, RoutingMethod::DeepSeekV3, ActQuant::W4A16);
    p.num_experts = 8;
    p.routing.n_group = 4;
    p.routing.topk_group = 2;
    p.routing.routed_scaling_factor = 2.5f;
    io::MoeCase c = io::make_random_case(p, 7, {.seed = 5});
    c.router_logits_bf16 = true;
    save("deepseek-bf16-logits-swiglu-oai", c);
  }
  {
    MoeProblem p = small_problem(Activation::GeGLU, RoutingMethod::Llama4, ActQuant::W4A16);
    p.routing.top_k = 1;
    p.routing.apply_router_weight_on_input = true;
    io::MoeCase c = io::make_random_case(p, 9, {.seed = 6});
    c.w13_input_scale.clear();
    c.w2_input_scale.clear();
    save("llama4-geglu-w4a16-no-input-scales", c);
  }
  save("zero-tokens", io::make_random_case(small_problem(Activation::SwiGLU, RoutingMethod::Renormalize,
                                                         ActQuant::W4A16), 0, {.seed = 7}));
  {
    io::MoeCase c = io::make_random_case(small_problem(Activation::SwiGLUOai, RoutingMethod::TopK, ActQuant::W4A4Scalar),
                                         11, {.seed = 8});
    io::add_random_expert_biases(c, 9);
    save("expert-biases", c);
  }
  for (RoutingMethod m : {RoutingMethod::Default, RoutingMethod::RenormalizeNaive, RoutingMethod::Sigmoid,
                          RoutingMethod::SigmoidRenorm, RoutingMethod::TopKSigmoid})
    save("method-" + std::string(to_string(m)),
         io::make_random_case(small_problem(Activation::SwiGLU, m, ActQuant::W4A4PerExpert), 13, {.seed = 10}));
  {  // MXFP4 weights (ue8m0 scales of 32, no global scales), with gpt-oss's biases
    MoeProblem p = small_problem(Activation::SwiGLUOai, RoutingMethod::Renormalize, ActQuant::W4A16);
    p.hidden = 64;
    p.inter = 96;
    p.weight_format = WeightFormat::MXFP4;
    io::MoeCase c = io::make_random_case(p, 10, {.seed = 11});
    io::add_random_expert_biases(c, 12);
    save("mxfp4-swiglu-oai-biases", c);
    c.w2_scale[7] = 255;  // ue8m0 NaN
    save("bad-mxfp4-nan-code", c);
  }
  // Bad values: refused when loaded.
  {
    io::MoeCase c = io::make_random_case(small_problem(Activation::SwiGLU, RoutingMethod::Renormalize, ActQuant::W4A16), 3);
    c.w2_scale_2[1] = std::numeric_limits<float>::quiet_NaN();
    save("bad-nan-scale-2", c);
  }
  {
    io::MoeCase c = io::make_random_case(small_problem(Activation::SwiGLU, RoutingMethod::Precomputed, ActQuant::W4A16), 3);
    c.topk_ids[3] = 4;
    save("bad-out-of-range-id", c);
  }
  {
    io::MoeCase c = io::make_random_case(small_problem(Activation::SwiGLU, RoutingMethod::Renormalize, ActQuant::W4A16), 3);
    c.w13_scale[5] = 0x7F;  // e4m3 NaN
    save("bad-nan-block-scale", c);
  }
  return paths;
}

// Case files that the CPU tests of this build left in its test folder (the fixtures of
// tests/io/case_file_test.cpp and tests/tools/cli_test.cpp), when they ran here first.
std::vector<std::string> left_fixtures() {
  std::vector<std::string> paths;
  for (const char* group : {"io", "tools"}) {
    const std::filesystem::path dir = std::filesystem::path(FP4MOE_TEST_TMPDIR) / group;
    std::error_code ec;
    if (!std::filesystem::is_directory(dir, ec)) continue;
    for (const auto& entry : std::filesystem::directory_iterator(dir, ec))
      if (entry.path().extension() == ".safetensors") paths.push_back(entry.path().string());
  }
  std::sort(paths.begin(), paths.end());
  return paths;
}

TEST(CrossBackend, FixtureCaseFiles) {
  SKIP_WITHOUT_GPU();
  std::vector<std::string> paths = write_fixtures();
  const std::vector<std::string> left = left_fixtures();
  paths.insert(paths.end(), left.begin(), left.end());
  std::printf("cross-backend: %zu fixture case files (%zu left by the CPU tests)\n", paths.size(), left.size());
  int64_t accepted = 0, refused = 0;
  for (const std::string& path : paths) {
    EXPECT_EQ(agree(path), "") << path;
    try {
      (void)io::load_case(path);
      ++accepted;
    } catch (const Error&) {
      ++refused;
    }
  }
  EXPECT_GE(accepted, 10);
  EXPECT_GE(refused, 3);
}

// ---- 1,000 soak problems, in shards of 100 (each well inside a test's time limit) --------------------
constexpr uint64_t kSoakSeed = 1;
constexpr int kShards = 10, kPerShard = 100;

class CrossBackendSoak : public ::testing::TestWithParam<int> {};

// NOTE: the GPU side runs the problems in order on this thread while threads of their own write the next
// problems' case files and run their references (serial for a small problem, on every core for a
// large one, as `fp4moe soak` does): the shard then takes about the GPU's time, not the sum of both.
TEST_P(CrossBackendSoak, ProblemsAsCaseFiles) {
  SKIP_WITHOUT_GPU();
  const std::string dir = test::fresh_dir("cross-backend", "soak-" + std::to_string(GetParam()));
  std::filesystem::create_directories(dir);
  struct Problem {
    soak::SoakProblem sp;
    std::string path;
    CpuSide cpu;
  };
  auto prepare = [&dir](int64_t i) {
    Problem p;
    p.sp = soak::make_problem(kSoakSeed, i);
    p.path = dir + "/problem-" + std::to_string(i) + ".safetensors";
    std::optional<reference::detail::SerialScope> serial;
    if (!p.sp.large) serial.emplace();
    soak::save_problem_case(p.path, p.sp, soak::make_case(p.sp));
    p.cpu = cpu_side(p.path, p.sp.tactic, &p.sp);
    return p;
  };
  const int64_t begin = int64_t(GetParam()) * kPerShard, end = begin + kPerShard;
  const int64_t ahead = std::max(1, reference::detail::max_workers() - 1);
  std::deque<std::future<Problem>> pending;
  int64_t next = begin;
  for (int64_t i = begin; i < end; ++i) {
    for (; next < end && next < i + ahead; ++next) pending.push_back(std::async(std::launch::async, prepare, next));
    Problem p = pending.front().get();
    pending.pop_front();
    EXPECT_EQ(compare(p.cpu, run_file(p.path, true, p.sp.tactic, nullptr, nullptr)), "") << p.sp.describe();
    std::filesystem::remove(p.path);
  }
}

INSTANTIATE_TEST_SUITE_P(Shards, CrossBackendSoak, ::testing::Range(0, kShards));

}  // namespace
}  // namespace fp4moe
