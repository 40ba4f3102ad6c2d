// tests/tools/cli_test.cpp — the `fp4moe` command line: run against the reference, demo, and the
// error path (message on stderr naming the problem, exit status 2).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include "fp4moe/bench.hpp"
#include "fp4moe/case_file.hpp"
#include "fp4moe/presets.hpp"
#include "fp4moe/reference.hpp"
#include "fp4moe/safetensors.hpp"
#include "tools/cli_run.hpp"

namespace fp4moe {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

std::string tmp_path(const std::string& name) {
  std::filesystem::create_directories(FP4MOE_TEST_TMPDIR);
  return std::string(FP4MOE_TEST_TMPDIR) + "/" + name;
}

TEST(Cli, HelpListsSubcommands) {
  const CliRun r = cli("--help");
  EXPECT_EQ(r.status, 0);
  EXPECT_THAT(r.output, AllOf(HasSubstr("run"), HasSubstr("demo"), HasSubstr("bench")));
}

TEST(Cli, RunOnCpuMatchesTheReferenceBitForBit) {
  for (ActQuant mode : {ActQuant::W4A16, ActQuant::W4A4Scalar}) {
    const io::MoeCase c = io::make_random_case(preset("tiny", mode), 19);
    const std::string in = tmp_path("cli_case.safetensors"), out = tmp_path("cli_out.safetensors");
    io::save_case(in, c);
    const CliRun r = cli("run --case " + in + " --out " + out + " --device cpu");
    ASSERT_EQ(r.status, 0) << r.output;
    const reference::MoeResult got = io::load_result(out);
    const reference::MoeResult want =
        reference::moe_forward(c.problem, c.num_tokens, c.hidden_states.data(), c.router(), c.weights());
    EXPECT_EQ(got.output, want.output);
    EXPECT_EQ(got.topk_ids, want.topk_ids);
    EXPECT_EQ(got.topk_weights, want.topk_weights);
  }
}

TEST(Cli, RunOnCpuTakesMxfp4CaseFiles) {
  MoeProblem p = preset("tiny");
  p.activation.kind = Activation::SwiGLUOai;
  p.weight_format = WeightFormat::MXFP4;
  io::MoeCase c = io::make_random_case(p, 9);
  io::add_random_expert_biases(c, 2);
  const std::string in = tmp_path("cli_mx_case.safetensors"), out = tmp_path("cli_mx_out.safetensors");
  io::save_case(in, c);
  const CliRun r = cli("run --case " + in + " --out " + out + " --device cpu");
  ASSERT_EQ(r.status, 0) << r.output;
  const reference::MoeResult got = io::load_result(out);
  const reference::MoeResult want =
      reference::moe_forward(c.problem, c.num_tokens, c.hidden_states.data(), c.router(), c.weights());
  EXPECT_EQ(got.output, want.output);
  EXPECT_EQ(got.topk_ids, want.topk_ids);
}

TEST(Cli, MissingCaseFileIsAnErrorNamingIt) {
  const CliRun r = cli("run --case /nonexistent/case.safetensors --out " + tmp_path("x.safetensors") + " --device cpu");
  EXPECT_EQ(r.status, 2);
  EXPECT_THAT(r.output, AllOf(HasSubstr("error"), HasSubstr("/nonexistent/case.safetensors")));
}

TEST(Cli, BadMetadataIsAnErrorNamingTheKey) {
  io::MoeCase c = io::make_random_case(preset("tiny"), 3);
  c.problem.routing.top_k = 1;
  const std::string path = tmp_path("cli_bad.safetensors");
  io::save_case(path, c);
  // Rewrite the file with top_k larger than E.
  io::SafetensorsFile f = io::SafetensorsFile::open(path);
  std::vector<io::TensorData> tensors;
  for (const auto& [name, view] : f.tensors()) {
    io::TensorData t{name, view.dtype, view.shape, {}};
    t.bytes.assign(view.data.begin(), view.data.end());
    tensors.push_back(std::move(t));
  }
  auto meta = f.metadata();
  meta["top_k"] = "100";
  const std::string bad = tmp_path("cli_bad_k.safetensors");
  io::write_safetensors(bad, tensors, meta);
  const CliRun r = cli("run --case " + bad + " --out " + tmp_path("y.safetensors") + " --device cpu");
  EXPECT_EQ(r.status, 2);
  EXPECT_THAT(r.output, AllOf(HasSubstr("top_k"), HasSubstr("100")));
}

TEST(Cli, UnknownDeviceIsRejected) {
  const CliRun r = cli("run --case a --out b --device tpu");
  EXPECT_NE(r.status, 0);
  EXPECT_THAT(r.output, HasSubstr("--device"));
}

TEST(Cli, DemoPrintsErrorsOfBothModes) {
  const CliRun r = cli("demo --device cpu");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output, AllOf(HasSubstr("tiny"), HasSubstr("w4a16"), HasSubstr("w4a4_scalar"), HasSubstr("rel L2")));
}

TEST(Cli, BenchWithAnUnknownPresetFailsBeforeAnyGpuWork) {
  const CliRun r = cli("bench --model no-such-model --tokens 1");
  EXPECT_EQ(r.status, 2);
  EXPECT_THAT(r.output, HasSubstr("no-such-model"));
}

TEST(Cli, BenchAndTuneRejectAnUnknownL2Flush) {
  for (const char* command : {"bench --model tiny --tokens 1 --l2-flush sideways", "tune --model tiny --l2-flush sideways"}) {
    const CliRun r = cli(command);
    EXPECT_NE(r.status, 0) << command;  // a command-line error (CLI11's exit status), before any GPU work
    EXPECT_THAT(r.output, AllOf(HasSubstr("--l2-flush"), HasSubstr("sideways"))) << command;
  }
}

TEST(Cli, BenchTensorParallelSplitIsCheckedBeforeAnyGpuWork) {
  const CliRun r = cli("bench --model gpt-oss-120b-nvfp4 --tokens 1 --tp-size 181");  // I = 2880: 180 blocks of 16
  EXPECT_EQ(r.status, 2);
  EXPECT_THAT(r.output, HasSubstr("at least tp_size = 181 blocks of 16"));
  // MXFP4 (w4a16 without --mode): 90 blocks of 32
  const CliRun mx = cli("bench --model gpt-oss-120b --tokens 1 --tp-size 91");
  EXPECT_EQ(mx.status, 2);
  EXPECT_THAT(mx.output, HasSubstr("at least tp_size = 91 blocks of 32"));
  const CliRun zero = cli("bench --model tiny --tokens 1 --tp-size 0");
  EXPECT_EQ(zero.status, 2);
  EXPECT_THAT(zero.output, HasSubstr("--tp-size must be >= 1, got 0"));
}

TEST(Cli, BenchMxfp4PresetsTakeW4a16Only) {
  const CliRun r = cli("bench --model gpt-oss-20b --tokens 1,64 --mode w4a4_scalar");
  EXPECT_EQ(r.status, 2);
  EXPECT_THAT(r.output, AllOf(HasSubstr("preset 'gpt-oss-20b' has mxfp4 weights, which run in mode w4a16 only"),
                              HasSubstr("w4a4_scalar")));
}

TEST(Cli, BenchExpertBiasesAreForPresets) {
  const CliRun r = cli("bench --checkpoint /nonexistent --layer 0 --tokens 1 --expert-biases");
  EXPECT_EQ(r.status, 2);
  EXPECT_THAT(r.output, HasSubstr("--expert-biases adds random biases to the presets' random weights"));
  EXPECT_THAT(cli("bench --help").output, HasSubstr("--expert-biases"));
}

TEST(Cli, BenchExpertParallelSizeIsCheckedBeforeAnyGpuWork) {
  const CliRun r = cli("bench --model tiny --tokens 1 --ep-size 9");  // E = 8
  EXPECT_EQ(r.status, 2);
  EXPECT_THAT(r.output, HasSubstr("--ep-size must be in [1, E = 8] for tiny, got 9"));
  const CliRun ck = cli("bench --checkpoint /nonexistent --layer 0 --tokens 1 --ep-size 2");
  EXPECT_EQ(ck.status, 2);
  EXPECT_THAT(ck.output, HasSubstr("--ep-size is for presets"));
}

TEST(Cli, BenchAllToAllOptionsAreCheckedBeforeAnyGpuWork) {
  const CliRun j = cli("bench --model tiny --tokens 1 --ep-size 2 --parallel ep_all2all --json out.json");
  EXPECT_EQ(j.status, 2);
  EXPECT_THAT(j.output, HasSubstr("--json and --csv are not written for it yet"));
  const CliRun t = cli("bench --model tiny --tokens 1 --ep-size 2 --parallel ep_all2all --tp-size 2");
  EXPECT_EQ(t.status, 2);
  EXPECT_THAT(t.output, HasSubstr("--tp-size is not supported with it"));
  const CliRun bad = cli("bench --model tiny --tokens 1 --ep-size 2 --parallel all2all");
  EXPECT_NE(bad.status, 0);
  EXPECT_THAT(bad.output, HasSubstr("--parallel"));
  EXPECT_THAT(cli("bench --help").output, HasSubstr("ep_all2all"));
  const CliRun g = cli("bench --model tiny --tokens 1 --ep-size 2 --parallel dp_allgather --tactic sm90_stream/t16/s1");
  EXPECT_EQ(g.status, 2);
  EXPECT_THAT(g.output, HasSubstr("bench --parallel dp_allgather: --tactic is not supported"));
  const CliRun n = cli("bench --model tiny --tokens 1 --ep-size 2 --nccl");
  EXPECT_EQ(n.status, 2);
  EXPECT_THAT(n.output, HasSubstr("bench --nccl: give --parallel ep_all2all or dp_allgather with it"));
}

TEST(Cli, BenchHelpNamesBothL2Flushes) {
  const CliRun r = cli("bench --help");
  EXPECT_EQ(r.status, 0);
  EXPECT_THAT(r.output, AllOf(HasSubstr("--l2-flush"), HasSubstr("read"), HasSubstr("write")));
}

TEST(BenchOptions, ParsesL2FlushNamesAndRejectsOthers) {
  EXPECT_EQ(parse_l2_flush("read", "x"), L2Flush::Read);
  EXPECT_EQ(parse_l2_flush("write", "x"), L2Flush::Write);
  EXPECT_EQ(to_string(L2Flush::Read), "read");
  EXPECT_EQ(to_string(L2Flush::Write), "write");
  EXPECT_EQ(parse_l2_flush(to_string(BenchOptions{}.l2_flush), "x"), L2Flush::Read);  // the default
  try {
    parse_l2_flush("Read", "--l2-flush");
    FAIL() << "no error for 'Read'";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("--l2-flush"), HasSubstr("'Read'"), HasSubstr("read or write")));
  }
}

}  // namespace
}  // namespace fp4moe
