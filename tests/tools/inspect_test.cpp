// tests/tools/inspect_test.cpp — `fp4moe inspect`, `fp4moe run --checkpoint` and `make-fixture` through
// the command line: structure printed, exit 2 with file and tensor on broken checkpoints, and the
// checkpoint run equal bit for bit to the same layer run through the case-file interface.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>

#include "fp4moe/case_file.hpp"
#include "fp4moe/checkpoint.hpp"
#include "fp4moe/reference.hpp"
#include "fp4moe/safetensors.hpp"
#include "test_dir.hpp"
#include "tools/cli_run.hpp"

namespace fp4moe {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

std::string fresh_dir(const std::string& name) { return test::fresh_dir("inspect", name); }

TEST(Inspect, PrintsTheStructureOfBothFormats) {
  for (auto format : {io::CheckpointFormat::ModelOpt, io::CheckpointFormat::CompressedTensors}) {
    const std::string dir = fresh_dir(std::string("ok_") + std::string(io::to_string(format)));
    io::FixtureOptions o;
    o.format = format;
    o.family = io::ModelFamily::DeepSeekV3;
    o.num_layers = 3;
    io::write_fixture(dir, o);
    const CliRun r = cli("inspect " + dir);
    EXPECT_EQ(r.status, 0) << r.output;
    EXPECT_THAT(r.output, AllOf(HasSubstr(std::string("format:     ") + std::string(io::to_string(format))),
                                HasSubstr("deepseek_v3"), HasSubstr("moe layers: 2 (1..2), loaded cleanly: 2"),
                                HasSubstr("8 routed, top-k 2"), HasSubstr("shared experts in 2 layers"),
                                HasSubstr("w13 [8, 64, 32]"), HasSubstr("w2_scale [8, 64, 2]"),
                                HasSubstr("weight_scale:"), HasSubstr("non-finite 0"), HasSubstr("problems:   none"),
                                HasSubstr("servable:   yes")));
    EXPECT_THAT(r.output, HasSubstr(format == io::CheckpointFormat::ModelOpt ? "input_scale:" : "input_global_scale:"));
  }
}

TEST(Inspect, BrokenCheckpointExitsTwoNamingFileAndTensor) {
  const std::string dir = fresh_dir("broken");
  io::FixtureOptions o;
  o.family = io::ModelFamily::Mixtral;
  o.num_shards = 1;
  io::write_fixture(dir, o);
  const std::string file = dir + "/model.safetensors";
  std::vector<io::TensorData> ts;
  {
    const io::SafetensorsFile f = io::SafetensorsFile::open(file);
    for (const auto& [name, t] : f.tensors()) {
      if (name == "model.layers.1.block_sparse_moe.experts.5.w2.input_scale") continue;
      io::TensorData d{name, t.dtype, t.shape, {}};
      d.bytes.assign(t.data.begin(), t.data.end());
      if (name == "model.layers.0.block_sparse_moe.experts.2.w1.weight_scale_2") {
        const float zero = 0.0f;
        std::memcpy(d.bytes.data(), &zero, 4);
      }
      ts.push_back(std::move(d));
    }
  }
  io::write_safetensors(file, ts, {});
  const CliRun r = cli("inspect " + dir);
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_THAT(r.output, AllOf(HasSubstr("missing tensor 'model.layers.1.block_sparse_moe.experts.5.w2.input_scale'"),
                              HasSubstr(file + ": tensor 'model.layers.0.block_sparse_moe.experts.2.w1.weight_scale_2'"),
                              HasSubstr("problems:   2"), HasSubstr("servable:   NO")));
  const CliRun run = cli("run --checkpoint " + dir + " --layer 1 --tokens 3");
  EXPECT_EQ(run.status, 2);
  EXPECT_THAT(run.output, HasSubstr("experts.5.w2.input_scale"));

  const CliRun missing = cli("inspect " + fresh_dir("does_not_exist"));
  EXPECT_EQ(missing.status, 2);
  EXPECT_THAT(missing.output, HasSubstr("not a directory"));
}

TEST(RunCheckpoint, CpuEqualsTheSameLayerThroughTheCaseFile) {
  for (auto family : {io::ModelFamily::DeepSeekV3, io::ModelFamily::Llama4}) {
    const std::string dir = fresh_dir(std::string("run_") + std::string(io::to_string(family)));
    const CliRun made = cli("make-fixture " + dir + " --family " + std::string(io::to_string(family)) +
                            " --format compressed-tensors --layers 2 --experts 8 --seed 5");
    ASSERT_EQ(made.status, 0) << made.output;
    const int64_t T = 13, L = 1;
    const std::string out = dir + "_out.safetensors";
    const CliRun r = cli("run --checkpoint " + dir + " --layer 1 --tokens 13 --seed 9 --device cpu --out " + out);
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_THAT(r.output, HasSubstr("output rms"));

    // The same layer, built through the library and the case-file interface.
    const io::Checkpoint ck = io::Checkpoint::open(dir);
    const io::MoeLayerWeights w = ck.load_layer(L);
    const io::MoeCase c = w.to_case(io::random_hidden_states(T, w.problem.hidden, 9), T);
    const std::string case_path = dir + "_case.safetensors", case_out = dir + "_case_out.safetensors";
    io::save_case(case_path, c);
    const CliRun rc = cli("run --case " + case_path + " --out " + case_out + " --device cpu");
    ASSERT_EQ(rc.status, 0) << rc.output;
    const reference::MoeResult a = io::load_result(out), b = io::load_result(case_out);
    EXPECT_EQ(a.output, b.output);
    EXPECT_EQ(a.topk_ids, b.topk_ids);
    EXPECT_EQ(a.topk_weights, b.topk_weights);
    const reference::MoeResult direct =
        reference::moe_forward(c.problem, T, c.hidden_states.data(), c.router(), c.weights());
    EXPECT_EQ(a.output, direct.output);
    EXPECT_EQ(a.output.size(), static_cast<size_t>(T * w.problem.hidden));
  }
}

TEST(RunCheckpoint, ErrorsExitTwo) {
  const std::string dir = fresh_dir("errors");
  io::FixtureOptions o;
  io::write_fixture(dir, o);  // deepseek: layer 0 dense
  const CliRun dense = cli("run --checkpoint " + dir + " --layer 0 --tokens 2");
  EXPECT_EQ(dense.status, 2);
  EXPECT_THAT(dense.output, AllOf(HasSubstr("layer 0 is dense"), HasSubstr("first_k_dense_replace=1")));
  const CliRun no_layer = cli("run --checkpoint " + dir + " --tokens 2");
  EXPECT_EQ(no_layer.status, 2);
  EXPECT_THAT(no_layer.output, HasSubstr("--layer is required"));
  const CliRun strict = cli("run --checkpoint " + dir + " --layer 1 --fusion nope");
  EXPECT_EQ(strict.status, 2);
  EXPECT_THAT(strict.output, HasSubstr("rescale_to_max"));
  // bench --checkpoint loads and checks the layer before any GPU work.
  const CliRun bench_dense = cli("bench --checkpoint " + dir + " --layer 0 --tokens 1");
  EXPECT_EQ(bench_dense.status, 2);
  EXPECT_THAT(bench_dense.output, HasSubstr("layer 0 is dense"));
  const CliRun bench_both = cli("bench --model tiny --checkpoint " + dir + " --layer 1");
  EXPECT_EQ(bench_both.status, 2);
  EXPECT_THAT(bench_both.output, HasSubstr("either --model"));
}

}  // namespace
}  // namespace fp4moe
