// tests/tune/tune_show_test.cpp — `fp4moe tune --show` through the command line: the table of a small
// cache, exit 2 with a clear message for a missing or corrupt file, and for profiling without a GPU.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "fp4moe/presets.hpp"
#include "fp4moe/tune.hpp"
#include "tools/cli_run.hpp"

namespace fp4moe {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

std::string temp_path(const std::string& name) {
  const fs::path dir = fs::path(FP4MOE_TEST_TMPDIR) / "tune_cli";
  fs::create_directories(dir);
  fs::remove(dir / name);
  return (dir / name).string();
}

TEST(TuneShow, PrintsTheCacheAsATable) {
  const std::string path = temp_path("show.json");
  const DeviceKey h200{std::string(fp4moe_version()), "NVIDIA H200", 132, 12080};
  DeviceKey old = h200;
  old.fp4moe_version = "0.0.1";
  const MoeProblem ds = preset("deepseek-r1", ActQuant::W4A4Scalar);
  TuneCache c;
  c.set(h200, ds, 60, MoeTactic{GemmKernel::Sm90Wgmma, 256, 1, 1}, 800, 1000);
  c.set(h200, ds, 1, MoeTactic{GemmKernel::Sm90Stream, 16, 4, 4}, 20, 30);
  c.set(old, ds, 1, MoeTactic{GemmKernel::Sm90Stream, 16, 1, 1}, 21, 30);
  c.save(path);

  const CliRun r = cli("tune --show --cache " + path);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output,
              AllOf(HasSubstr("tune cache " + path + ": 3 entries, 2 device/problem groups"),
                    HasSubstr("device:  NVIDIA H200 (132 SMs, CUDA runtime 12080, fp4moe " +
                              std::string(fp4moe_version()) + ")\n"),
                    HasSubstr("fp4moe 0.0.1)  [another fp4moe version: ignored by this build]"),
                    HasSubstr("problem: " + problem_key(ds)), HasSubstr("bucket"), HasSubstr("tuned us"),
                    HasSubstr("heuristic us"), HasSubstr("speedup")));
  // Rows: bucket, range, tactic, times, speedup = heuristic / tuned.
  EXPECT_THAT(r.output, HasSubstr("sm90_stream/t16/s4"));
  EXPECT_THAT(r.output, HasSubstr("[897, 1024]"));
  EXPECT_THAT(r.output, HasSubstr("800.0"));
  EXPECT_THAT(r.output, HasSubstr("1.25x"));
  EXPECT_THAT(r.output, HasSubstr("1.50x"));
}

TEST(TuneShow, TheCachePathComesFromTheEnvironment) {
  const std::string path = temp_path("env.json");
  TuneCache c;
  c.set(DeviceKey{std::string(fp4moe_version()), "GPU", 1, 1}, preset("tiny"), 0, MoeTactic{}, 1, 1);
  c.save(path);
  // The child process inherits the variable.
  ASSERT_EQ(setenv("FP4MOE_TUNE_CACHE", path.c_str(), 1), 0);
  const CliRun with_env = cli("tune --show");
  unsetenv("FP4MOE_TUNE_CACHE");
  EXPECT_EQ(with_env.status, 0) << with_env.output;
  EXPECT_THAT(with_env.output, HasSubstr("tune cache " + path + ": 1 entries"));
}

TEST(TuneShow, MissingFileExitsTwoNamingThePath) {
  const std::string path = temp_path("missing.json");
  const CliRun r = cli("tune --show --cache " + path);
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_THAT(r.output, AllOf(HasSubstr("fp4moe: error: tune --show: no tune cache at '" + path + "' (from --cache)"),
                              HasSubstr("fp4moe tune --model PRESET")));
}

TEST(TuneShow, CorruptFileExitsTwoWithOneWarning) {
  const std::string path = temp_path("corrupt.json");
  std::ofstream(path) << "{\"format\": \"fp4moe-tune-cache\", \"format_version\": 2, \"entries\": [";
  const CliRun r = cli("tune --show --cache " + path);
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr("fp4moe: warning: tune cache '" + path + "' ignored: not valid JSON"));
  EXPECT_THAT(r.output, Not(HasSubstr("internal error")));
}

// Without a GPU (CI): a clear error. On a GPU machine the tiny preset is tuned and the cache written.
TEST(TuneShow, ProfilingWithoutAGpuIsAClearError) {
  const std::string path = temp_path("tiny_cache.json");
  const CliRun r = cli("tune --model tiny --max-tokens 40 --cache " + path);
  if (r.status == 0) {
    EXPECT_THAT(r.output, HasSubstr("tune tiny (w4a4_scalar): 33 buckets"));
    const CliRun show = cli("tune --show --cache " + path);
    EXPECT_EQ(show.status, 0) << show.output;
    return;
  }
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr("fp4moe tune: profiling needs a Hopper GPU"));
}

TEST(TuneShow, TokenListsAreCheckedBeforeAnyGpuWork) {
  const std::string path = temp_path("token_list_cache.json");
  const CliRun bad = cli("tune --model tiny --tokens 512,x --cache " + path);
  EXPECT_EQ(bad.status, 2) << bad.output;
  EXPECT_THAT(bad.output, HasSubstr("--tokens: expected a comma-separated list of integers >= 1, got 'x'"));
  const CliRun both = cli("tune --model tiny --tokens 512 --max-tokens 1024 --cache " + path);
  EXPECT_NE(both.status, 0) << both.output;
  EXPECT_THAT(both.output, HasSubstr("excludes"));
}

}  // namespace
}  // namespace fp4moe
