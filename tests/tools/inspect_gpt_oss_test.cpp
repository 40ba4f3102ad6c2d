// tests/tools/inspect_gpt_oss_test.cpp — gpt-oss (MXFP4) checkpoints through the command line:
// `make-fixture --format mxfp4 --family gpt_oss`, `inspect` describing the layer, exit 2 naming file
// and tensor on broken files, `run --checkpoint --device cpu` equal bit for bit to the reference on the
// same layer (through the case-file interface too), and the w4a16-only mode refused before any work.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

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

std::string fresh_dir(const std::string& name) { return test::fresh_dir("inspect_gpt_oss", name); }

std::string make_fixture(const std::string& name, int shards = 2) {
  const std::string dir = fresh_dir(name);
  const CliRun made = cli("make-fixture " + dir + " --format mxfp4 --family gpt_oss --layers 2 --experts 8 --hidden 96 "
                          "--inter 64 --top-k 4 --shards " + std::to_string(shards) + " --seed 3");
  EXPECT_EQ(made.status, 0) << made.output;
  EXPECT_THAT(made.output, HasSubstr("mxfp4 gpt_oss, 2 layers (2 MoE)"));
  return dir;
}

TEST(InspectGptOss, DescribesTheLayer) {
  const std::string dir = make_fixture("ok");
  const CliRun r = cli("inspect " + dir);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output,
              AllOf(HasSubstr("format:     mxfp4 MXFP4 (group 32, ue8m0 scales, act_quant w4a16)"),
                    HasSubstr("model:      gpt_oss (family gpt_oss), 2 layers"),
                    HasSubstr("moe layers: 2 (0..1), loaded cleanly: 2"), HasSubstr("experts:    8 routed, top-k 4"),
                    HasSubstr("w13 [8, 128, 48] w13_scale [8, 128, 3] w2 [8, 96, 32] w2_scale [8, 96, 2]"),
                    HasSubstr("router_bias [8] w13_bias [8, 128] w2_bias [8, 96]"),
                    HasSubstr("activation: swiglu_oai (alpha 1.702, beta 1, limit 7), gate/up rows interleaved"),
                    HasSubstr("E=8 H=96 I=64 k=4 routing=renormalize"), HasSubstr("weights=mxfp4"),
                    HasSubstr("gate_up_proj_scales: 2 tensors, 6144 values"), HasSubstr("down_proj_scales: 2 tensors"),
                    HasSubstr("problems:   none"), HasSubstr("servable:   yes")));
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("w1/w3 fusion")));
}

TEST(InspectGptOss, BrokenFilesExitTwoNamingFileAndTensor) {
  const std::string dir = make_fixture("broken", 1);
  const std::string file = dir + "/model.safetensors";
  std::vector<io::TensorData> ts;
  {
    const io::SafetensorsFile f = io::SafetensorsFile::open(file);
    for (const auto& [name, t] : f.tensors()) {
      if (name == "model.layers.0.mlp.router.bias") continue;
      io::TensorData d{name, t.dtype, t.shape, {}};
      d.bytes.assign(t.data.begin(), t.data.end());
      if (name == "model.layers.1.mlp.experts.gate_up_proj_scales") d.bytes[17] = std::byte{0xFF};
      ts.push_back(std::move(d));
    }
  }
  io::write_safetensors(file, ts, {});
  const CliRun r = cli("inspect " + dir);
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_THAT(r.output, AllOf(HasSubstr("missing tensor 'model.layers.0.mlp.router.bias'"),
                              HasSubstr(file + ": tensor 'model.layers.1.mlp.experts.gate_up_proj_scales': expert 0 "
                                        "row 5 block 2 has ue8m0 code 255"),
                              HasSubstr("non-finite 1"), HasSubstr("problems:   2"), HasSubstr("servable:   NO")));
  for (const char* cmd : {"run --checkpoint ", "bench --tokens 1 --checkpoint "}) {
    const CliRun run = cli(std::string(cmd) + dir + " --layer 1");
    EXPECT_EQ(run.status, 2) << cmd;
    EXPECT_THAT(run.output, AllOf(HasSubstr(file), HasSubstr("gate_up_proj_scales"), HasSubstr("code 255"))) << cmd;
  }
  const CliRun bias = cli("run --checkpoint " + dir + " --layer 0 --tokens 2");
  EXPECT_EQ(bias.status, 2);
  EXPECT_THAT(bias.output, HasSubstr("missing tensor 'model.layers.0.mlp.router.bias'"));
}

TEST(RunCheckpointGptOss, CpuEqualsTheReferenceOnTheSameLayer) {
  const std::string dir = make_fixture("run");
  const int64_t T = 11, L = 1;
  const std::string out = dir + "_out.safetensors";
  const CliRun r = cli("run --checkpoint " + dir + " --layer 1 --tokens 11 --seed 4 --device cpu --out " + out);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output, AllOf(HasSubstr("weights=mxfp4"), HasSubstr("output rms"), HasSubstr("non-finite 0")));
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("w1/w3 fusion")));

  const io::MoeLayerWeights w = io::Checkpoint::open(dir).load_layer(L);
  const io::MoeCase c = w.to_case(io::random_hidden_states(T, w.problem.hidden, 4), T);
  ASSERT_FALSE(c.w13_bias.empty());
  const reference::MoeResult direct =
      reference::moe_forward(c.problem, T, c.hidden_states.data(), c.router(), c.weights());
  const reference::MoeResult a = io::load_result(out);
  EXPECT_EQ(a.output, direct.output);
  EXPECT_EQ(a.topk_ids, direct.topk_ids);
  EXPECT_EQ(a.topk_weights, direct.topk_weights);
  // Through the case-file interface: the same bytes.
  const std::string case_path = dir + "_case.safetensors", case_out = dir + "_case_out.safetensors";
  io::save_case(case_path, c);
  const CliRun rc = cli("run --case " + case_path + " --out " + case_out + " --device cpu");
  ASSERT_EQ(rc.status, 0) << rc.output;
  EXPECT_EQ(io::load_result(case_out).output, a.output);
}

TEST(RunCheckpointGptOss, OtherModesAreRefusedBeforeAnyWork) {
  const std::string dir = make_fixture("modes");
  const CliRun run = cli("run --checkpoint " + dir + " --layer 0 --tokens 2 --act-quant w4a4_scalar");
  EXPECT_EQ(run.status, 2);
  EXPECT_THAT(run.output, AllOf(HasSubstr("mxfp4"), HasSubstr("w4a16")));
  const CliRun bench = cli("bench --checkpoint " + dir + " --layer 0 --tokens 1 --mode w4a4_scalar");
  EXPECT_EQ(bench.status, 2);
  EXPECT_THAT(bench.output, AllOf(HasSubstr("mxfp4"), HasSubstr("w4a16")));
  EXPECT_THAT(bench.output, ::testing::Not(HasSubstr("measuring ceilings")));
  const CliRun mismatch = cli("make-fixture " + fresh_dir("mismatch") + " --format mxfp4 --family mixtral");
  EXPECT_EQ(mismatch.status, 2);
  EXPECT_THAT(mismatch.output, HasSubstr("the mxfp4 format and the gpt_oss family go together"));
}

}  // namespace
}  // namespace fp4moe
