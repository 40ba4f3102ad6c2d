// tests/tune/cache_test.cpp — the tune cache file: round trip through a file, lookups keyed by device,
// version and problem, and every kind of bad file or entry ignored with one warning, never a throw.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "error_message.hpp"
#include "fp4moe/presets.hpp"
#include "fp4moe/tune.hpp"

namespace fp4moe {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

std::string temp_path(const std::string& name) {
  const fs::path dir = fs::path(FP4MOE_TEST_TMPDIR) / "tune";
  fs::create_directories(dir);
  const fs::path p = dir / name;
  fs::remove(p);
  return p.string();
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

DeviceKey h200() { return {std::string(fp4moe_version()), "NVIDIA H200", 132, 12080}; }

const MoeTactic kWgmma256{GemmKernel::Sm90Wgmma, 256, 1, 1};
const MoeTactic kStream4{GemmKernel::Sm90Stream, 16, 4, 4};

// A cache with two problems on the H200 and one entry of another GPU.
TuneCache sample_cache() {
  TuneCache c;
  const MoeProblem ds = preset("deepseek-r1", ActQuant::W4A4Scalar);
  const MoeProblem qwen = preset("qwen3-30b-a3b", ActQuant::W4A16);
  c.set(h200(), ds, 1, kStream4, 20.5, 31.0);
  c.set(h200(), ds, 60, kWgmma256, 900.25, 950.0);
  c.set(h200(), qwen, bucket_of(1 << 21), kWgmma256, 5000, 5100);
  DeviceKey h100 = h200();
  h100.gpu_name = "NVIDIA H100 80GB HBM3";
  c.set(h100, ds, 1, MoeTactic{GemmKernel::Sm90Stream, 16, 2, 2}, 25, 30);
  return c;
}

TEST(TuneCache, RoundTripsThroughAFile) {
  const std::string path = temp_path("round_trip.json");
  const TuneCache saved = sample_cache();
  saved.save(path);
  EXPECT_FALSE(fs::exists(path + ".tmp." + std::to_string(::getpid()))) << "the temporary file is renamed away";

  TuneCache loaded;
  const CacheLoadResult r = loaded.load(path);
  EXPECT_TRUE(r.file_found);
  EXPECT_FALSE(r.file_ignored);
  EXPECT_EQ(r.entries_loaded, 4u);
  EXPECT_EQ(r.entries_ignored, 0u);
  EXPECT_TRUE(r.warnings.empty()) << r.warnings.front();
  ASSERT_EQ(loaded.entries().size(), 4u);

  const MoeProblem ds = preset("deepseek-r1", ActQuant::W4A4Scalar);
  EXPECT_EQ(loaded.lookup(h200(), ds, 1), kStream4);
  EXPECT_EQ(loaded.lookup(h200(), ds, 60), kWgmma256);
  EXPECT_EQ(loaded.lookup(h200(), ds, 2), std::nullopt);
  EXPECT_EQ(loaded.lookup(h200(), preset("qwen3-30b-a3b", ActQuant::W4A16), num_buckets() - 1), kWgmma256);
  EXPECT_EQ(loaded.lookup(h200(), preset("qwen3-30b-a3b", ActQuant::W4A4Scalar), num_buckets() - 1), std::nullopt)
      << "act_quant is part of the problem key";
  for (const TuneEntry& e : loaded.entries()) {
    if (e.device == h200() && e.bucket == 1) {
      EXPECT_EQ(e.tactic_us, 20.5);
      EXPECT_EQ(e.heuristic_us, 31.0);
      EXPECT_EQ(e.heuristic, heuristic_tactic(ds, 1));
    }
  }
  // Saving what was loaded gives the same bytes (entries are written sorted).
  const std::string again = temp_path("round_trip_again.json");
  loaded.save(again);
  EXPECT_EQ(read_file(again), read_file(path));
  const std::string text = read_file(path);
  EXPECT_THAT(text, HasSubstr(R"("format": "fp4moe-tune-cache")"));
  EXPECT_THAT(text, HasSubstr(R"("format_version": 2)"));
  EXPECT_THAT(text, HasSubstr(R"("bucket_hi": null)"));  // the open bucket
}

TEST(TuneCache, ProblemKeyHoldsWhatChangesTheWorkOnly) {
  MoeProblem a = preset("deepseek-r1", ActQuant::W4A4Scalar);
  EXPECT_EQ(problem_key(a),
            "E=256 H=7168 I=2048 k=8 routing=deepseek_v3(n_group=8,topk_group=4) act=swiglu quant=w4a4_scalar");
  MoeProblem b = a;
  b.routing.routed_scaling_factor = 1.0f;  // changes values, not the work
  EXPECT_EQ(problem_key(a), problem_key(b));
  b.routing.topk_group = 2;
  EXPECT_NE(problem_key(a), problem_key(b));
  EXPECT_THAT(problem_key(preset("llama4-scout")), HasSubstr("routing=llama4(weight_on_input)"));
  EXPECT_THAT(problem_key(preset("gpt-oss-120b")), HasSubstr("act=swiglu_oai"));
  // The weight format: MXFP4 keys say so, NVFP4 keys are what they were before the field.
  EXPECT_EQ(problem_key(preset("gpt-oss-120b")),
            "E=128 H=2880 I=2880 k=4 routing=renormalize act=swiglu_oai quant=w4a16 weights=mxfp4");
  EXPECT_EQ(problem_key(preset("gpt-oss-120b-nvfp4")), "E=128 H=2880 I=2880 k=4 routing=renormalize act=swiglu_oai quant=w4a16");
}

// MXFP4 and NVFP4 problems of the same shape are tuned apart; the format survives a save and load; an
// entry without the field (every file written before it) reads as NVFP4.
TEST(TuneCache, WeightFormatIsPartOfTheKey) {
  const MoeProblem mx = preset("gpt-oss-20b"), nv = [] {
    MoeProblem p = preset("gpt-oss-20b");
    p.weight_format = WeightFormat::NVFP4;
    return p;
  }();
  TuneCache c;
  c.set(h200(), mx, 3, kWgmma256, 10, 12);
  c.set(h200(), nv, 3, kStream4, 9, 12);
  EXPECT_EQ(c.entries().size(), 2u);
  EXPECT_EQ(c.lookup(h200(), mx, 3), kWgmma256);
  EXPECT_EQ(c.lookup(h200(), nv, 3), kStream4);
  const std::string path = temp_path("formats.json");
  c.save(path);
  const std::string text = read_file(path);
  EXPECT_THAT(text, HasSubstr(R"("weight_format": "mxfp4")"));
  EXPECT_EQ(text.find(R"("weight_format": "nvfp4")"), std::string::npos);  // NVFP4 entries as before
  TuneCache back;
  const CacheLoadResult r = back.load(path);
  EXPECT_EQ(r.entries_loaded, 2u);
  EXPECT_EQ(back.lookup(h200(), mx, 3), kWgmma256);
  EXPECT_EQ(back.lookup(h200(), nv, 3), kStream4);
  // An old file's entry (no weight_format) is NVFP4: the MXFP4 problem finds nothing in it.
  TuneCache old;
  old.set(h200(), nv, 5, kStream4, 9, 12);
  old.save(path);
  TuneCache old_back;
  old_back.load(path);
  EXPECT_EQ(old_back.lookup(h200(), nv, 5), kStream4);
  EXPECT_FALSE(old_back.lookup(h200(), mx, 5).has_value());
}

TEST(TuneCache, SetReplacesTheSameKeyAndRefusesInvalidTactics) {
  TuneCache c = sample_cache();
  const MoeProblem ds = preset("deepseek-r1", ActQuant::W4A4Scalar);
  c.set(h200(), ds, 1, kWgmma256, 19, 31);
  EXPECT_EQ(c.entries().size(), 4u);
  EXPECT_EQ(c.lookup(h200(), ds, 1), kWgmma256);
  MoeProblem narrow = ds;
  narrow.hidden = 896;  // 7 and 3 chunks along K: no split 4 in either GEMM
  narrow.inter = 384;
  expect_error([&] { c.set(h200(), narrow, 1, kStream4, 1, 1); }, "is invalid for E=256 H=896 I=384");
  expect_error([&] { c.set(h200(), ds, num_buckets(), kWgmma256, 1, 1); }, "bucket index must be in [0, 102), got 102");
  expect_error([&] { c.set(h200(), ds, 1, kWgmma256, 0, 1); }, "tactic_us must be finite and > 0");
}

TEST(TuneCache, ForeignDeviceAndStaleVersionAreNotLookedUp) {
  const std::string path = temp_path("foreign.json");
  sample_cache().save(path);
  TuneCache c;
  c.load(path);
  const MoeProblem ds = preset("deepseek-r1", ActQuant::W4A4Scalar);
  DeviceKey other_sms = h200();
  other_sms.sm_count = 114;
  DeviceKey other_cuda = h200();
  other_cuda.cuda_runtime = 12040;
  DeviceKey older = h200();
  older.fp4moe_version = "0.0.1";
  for (const DeviceKey& d : {other_sms, other_cuda, older}) EXPECT_EQ(c.lookup(d, ds, 60), std::nullopt);
  DeviceKey h100 = h200();
  h100.gpu_name = "NVIDIA H100 80GB HBM3";
  EXPECT_EQ(c.lookup(h100, ds, 1), (MoeTactic{GemmKernel::Sm90Stream, 16, 2, 2}));
}

// The text of a file with one valid entry, where `edit` replaces a substring of it.
std::string cache_text_with(const std::string& from, const std::string& to) {
  const std::string path = temp_path("template.json");
  TuneCache c;
  c.set(h200(), preset("deepseek-r1", ActQuant::W4A4Scalar), 60, kWgmma256, 900, 950);
  c.save(path);
  std::string text = read_file(path);
  const size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at != std::string::npos) text.replace(at, from.size(), to);
  return text;
}

struct BadFile {
  const char* name;
  std::string text;
  const char* warning;
};

TEST(TuneCache, CorruptOrForeignFilesGiveAnEmptyCacheAndOneWarning) {
  const std::string good = cache_text_with("", "");
  const BadFile cases[] = {
      {"empty", "", "not valid JSON"},
      {"truncated", good.substr(0, good.size() / 2), "not valid JSON (truncated or corrupt)"},
      {"binary", std::string("\x00\xff\x13garbage", 10), "not valid JSON"},
      {"array", "[]", "not a tune cache"},
      {"wrong_tag", cache_text_with("fp4moe-tune-cache", "other-tool-cache"), "not a tune cache"},
      {"older_version", cache_text_with(R"("format_version": 2)", R"("format_version": 1)"),
       "format_version 1, this build reads 2"},
      {"newer_version", cache_text_with(R"("format_version": 2)", R"("format_version": 3)"),
       "format_version 3, this build reads 2"},
      {"version_string", cache_text_with(R"("format_version": 2)", R"("format_version": "2")"),
       "\"format_version\" missing or not an integer"},
      {"entries_object", R"({"format":"fp4moe-tune-cache","format_version":2,"entries":{}})",
       "\"entries\" missing or not an array"},
      {"deep", std::string(100000, '['), "nested too deep"},
  };
  for (const BadFile& bad : cases) {
    SCOPED_TRACE(bad.name);
    const std::string path = temp_path(std::string("bad_") + bad.name + ".json");
    write_file(path, bad.text);
    TuneCache c = sample_cache();  // load replaces whatever was there
    CacheLoadResult r;
    EXPECT_NO_THROW(r = c.load(path));
    EXPECT_TRUE(r.file_found);
    EXPECT_TRUE(r.file_ignored);
    EXPECT_TRUE(c.empty());
    ASSERT_EQ(r.warnings.size(), 1u);
    EXPECT_THAT(r.warnings[0], HasSubstr(path));
    EXPECT_THAT(r.warnings[0], HasSubstr(bad.warning));
  }
}

TEST(TuneCache, MissingFileAndDirectoryAreWarnings) {
  TuneCache c;
  const CacheLoadResult missing = c.load(temp_path("does_not_exist.json"));
  EXPECT_FALSE(missing.file_found);
  ASSERT_EQ(missing.warnings.size(), 1u);
  EXPECT_THAT(missing.warnings[0], HasSubstr("not found"));
  const CacheLoadResult dir = c.load(FP4MOE_TEST_TMPDIR);
  EXPECT_TRUE(dir.file_ignored);
  EXPECT_THAT(dir.warnings.at(0), HasSubstr("directory"));
}

TEST(TuneCache, BadEntriesAreIgnoredOneByOneWithOneWarning) {
  const struct {
    const char* name;
    std::string from, to;
    const char* reason;
  } cases[] = {
      {"invalid_tactic", R"("tile_tokens": 256)", R"("tile_tokens": 32)",
       "entries[0].tactic sm90_wgmma/t32/s1 is invalid for E=256"},
      {"kernel_type", R"("kernel": "sm90_wgmma")", R"("kernel": 3)", "entries[0].tactic.kernel: expected a string"},
      {"sm_count_type", R"("sm_count": 132)", R"("sm_count": "132")", "entries[0].sm_count: expected an integer"},
      {"time_negative", R"("tactic_us": 900.0)", R"("tactic_us": -1)", "entries[0].tactic_us: must be finite and > 0"},
      {"bucket_range", R"("bucket_hi": 1024)", R"("bucket_hi": 1000)", "has another range than this build's"},
      {"bucket_beyond", R"("bucket": 60)", R"("bucket": 500)", "beyond this build's ladder"},
      {"bad_problem", R"("top_k": 8)", R"("top_k": 300)", "entries[0].problem.top_k: must be in [1, 32]"},
      {"bad_routing", R"("routing_method": "deepseek_v3")", R"("routing_method": "magic")",
       "entries[0].problem.routing_method: unknown name 'magic'"},
      {"missing_device", R"("gpu_name": "NVIDIA H200",)", "", "entries[0].gpu_name: missing"},
  };
  for (const auto& bad : cases) {
    SCOPED_TRACE(bad.name);
    const std::string text = cache_text_with(bad.from, bad.to);
    // Append a second, valid entry after the broken one: it must survive.
    TuneCache extra;
    extra.set(h200(), preset("tiny"), 3, MoeTactic{GemmKernel::Sm90Wgmma, 128, 1, 1}, 5, 6);
    const std::string extra_path = temp_path("extra.json");
    extra.save(extra_path);
    const std::string extra_text = read_file(extra_path);
    const std::string extra_entry = extra_text.substr(extra_text.find("\"entries\": [") + 12);
    std::string combined = text;
    const size_t close = combined.rfind(']');
    combined = combined.substr(0, close) + "," + extra_entry;

    const std::string path = temp_path(std::string("entry_") + bad.name + ".json");
    write_file(path, combined);
    TuneCache c;
    CacheLoadResult r;
    EXPECT_NO_THROW(r = c.load(path));
    EXPECT_FALSE(r.file_ignored);
    EXPECT_EQ(r.entries_loaded, 1u);
    EXPECT_EQ(r.entries_ignored, 1u);
    ASSERT_EQ(r.warnings.size(), 1u);
    EXPECT_THAT(r.warnings[0], HasSubstr("ignored 1 of 2 entries"));
    EXPECT_THAT(r.warnings[0], HasSubstr(bad.reason));
    EXPECT_EQ(c.lookup(h200(), preset("tiny"), 3), (MoeTactic{GemmKernel::Sm90Wgmma, 128, 1, 1}));
  }
}

TEST(TuneCache, SaveToAnUnwritablePlaceThrowsNamingThePath) {
  expect_error([] { sample_cache().save("/nonexistent-dir/cache.json"); }, "/nonexistent-dir/cache.json");
}

}  // namespace
}  // namespace fp4moe
