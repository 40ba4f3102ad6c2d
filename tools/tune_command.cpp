// tools/tune_command.cpp — `fp4moe tune`: --show prints the tuning cache; profiling is run_tune_profile.
#include "tools/tune_command.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <tuple>
#include <vector>

#include "fp4moe/bench.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/presets.hpp"
#include "fp4moe/runner.hpp"
#include "fp4moe/tune.hpp"
#include "tools/bench_command.hpp"  // split_list, parse_tokens, mode_for_format

namespace fp4moe::tools {
namespace {

std::string where_path_came_from(const TuneOptions& o) {
  if (!o.cache.empty()) return "from --cache";
  if (!tune_cache_path_from_env().empty()) return "from FP4MOE_TUNE_CACHE";
  return "the default; set --cache or FP4MOE_TUNE_CACHE for another";
}

std::string format_us(double us) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", us);
  return buf;
}

}  // namespace

void add_tune_command(CLI::App& app, TuneOptions& o) {
  CLI::App* c = app.add_subcommand("tune", "Profile the tactics per token-count bucket into the tune cache, or show it");
  c->add_option("--model", o.models, "Preset name(s), comma-separated (profiling)");
  CLI::Option* max_tokens = c->add_option("--max-tokens", o.max_tokens, "Largest token count to tune for (profiling)")
                                ->capture_default_str()
                                ->check(CLI::Range(int64_t(1), kLastClosedBucketEnd));
  c->add_option("--tokens", o.tokens,
                "Tune only the buckets of these token counts, comma-separated, e.g. 512,1024 (profiling; instead of "
                "--max-tokens)")
      ->excludes(max_tokens);
  c->add_option("--mode", o.mode,
                "w4a16, w4a4_scalar or w4a4_per_expert (profiling); MXFP4 weights (gpt-oss-120b, gpt-oss-20b) run "
                "w4a16 only, which is their mode when --mode is not given")
      ->capture_default_str();
  c->add_option("--cache", o.cache, "Tune cache file (default: FP4MOE_TUNE_CACHE, else ./fp4moe-tune-cache.json)");
  c->add_option("--l2-flush", o.l2_flush,
                "How each replay's weights are made cold, as in `fp4moe bench` (profiling): read or write")
      ->check(CLI::IsMember({"read", "write"}))
      ->capture_default_str();
  c->add_flag("--show", o.show, "Print the cache as a table instead of profiling");
  o.command = c;
}

int run_tune_command(const TuneOptions& o) {
  if (!o.show) return run_tune_profile(o);
  const std::string path = o.cache.empty() ? default_tune_cache_path() : o.cache;
  std::error_code ec;
  check(std::filesystem::exists(path, ec), "tune --show: no tune cache at '", path, "' (", where_path_came_from(o),
        "); `fp4moe tune --model PRESET` on a GPU writes one");
  return show_tune_cache(path);
}

int show_tune_cache(const std::string& path) {
  check(std::filesystem::exists(path), "tune --show: no tune cache at '", path, "'");
  TuneCache cache;
  const CacheLoadResult loaded = cache.load(path);
  for (const std::string& w : loaded.warnings) std::fprintf(stderr, "fp4moe: warning: %s\n", w.c_str());
  if (loaded.file_ignored) return 2;

  // Group by (device, problem); rows ordered by bucket.
  using GroupKey = std::tuple<std::string, int, int, std::string, std::string>;
  std::map<GroupKey, std::vector<const TuneEntry*>> groups;
  for (const TuneEntry& e : cache.entries())
    groups[{e.device.gpu_name, e.device.sm_count, e.device.cuda_runtime, e.device.fp4moe_version,
            problem_key(e.problem)}]
        .push_back(&e);

  std::printf("tune cache %s: %zu entries, %zu device/problem groups (this build: fp4moe %s)\n", path.c_str(),
              cache.entries().size(), groups.size(), std::string(fp4moe_version()).c_str());
  for (auto& [key, rows] : groups) {
    std::sort(rows.begin(), rows.end(), [](const TuneEntry* a, const TuneEntry* b) { return a->bucket < b->bucket; });
    const DeviceKey& device = rows.front()->device;
    const bool stale = device.fp4moe_version != fp4moe_version();
    std::printf("\ndevice:  %s%s\n", device.describe().c_str(),
                stale ? "  [another fp4moe version: ignored by this build]" : "");
    std::printf("problem: %s\n", std::get<4>(key).c_str());
    std::printf("  %6s  %-20s  %-20s  %10s  %-20s  %12s  %8s\n", "bucket", "tokens", "tactic", "tuned us", "heuristic",
                "heuristic us", "speedup");
    for (const TuneEntry* e : rows) {
      std::printf("  %6d  %-20s  %-20s  %10s  %-20s  %12s  %7.2fx\n", e->bucket, describe_bucket(e->bucket).c_str(),
                  describe(e->tactic).c_str(), format_us(e->tactic_us).c_str(), describe(e->heuristic).c_str(),
                  format_us(e->heuristic_us).c_str(), e->heuristic_us / e->tactic_us);
    }
  }
  return 0;
}

int run_tune_profile(const TuneOptions& o) {
  check(!o.models.empty(), "tune: --model PRESET[,PRESET] is required (or --show)");
  const std::vector<std::string> models = split_list(o.models);
  const ActQuant given_mode = parse_act_quant(o.mode, "--mode");
  auto mode_for = [&](const std::string& m) { return mode_for_format(preset_weight_format(m), given_mode, o.command); };
  for (const std::string& m : models) (void)preset(m, mode_for(m));  // unknown names fail before any GPU work
  TuneProfileOptions po;
  po.max_tokens = o.max_tokens;
  po.l2_flush = parse_l2_flush(o.l2_flush, "--l2-flush");
  if (!o.tokens.empty()) po.tokens = parse_tokens(o.tokens);
  std::string why;
  if (!cuda_device_available(&why)) {
    std::fprintf(stderr, "fp4moe tune: profiling needs a Hopper GPU (%s); `fp4moe tune --show` prints an existing cache\n",
                 why.c_str());
    return 2;
  }
  const std::string path = o.cache.empty() ? default_tune_cache_path() : o.cache;
  TuneCache cache;
  std::error_code ec;
  if (std::filesystem::exists(path, ec)) {  // entries of other problems / devices are kept
    const CacheLoadResult loaded = cache.load(path);
    for (const std::string& w : loaded.warnings) std::fprintf(stderr, "fp4moe: warning: %s\n", w.c_str());
  }
  for (const std::string& m : models) {
    const auto t0 = std::chrono::steady_clock::now();
    const ActQuant mode = mode_for(m);
    const std::vector<TuneEntry> entries = tune_problem(m, preset(m, mode), po);
    int changed = 0;
    for (const TuneEntry& e : entries) {
      cache.set(e);
      changed += e.tactic == e.heuristic ? 0 : 1;
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("tune %s (%s): %zu buckets in %.1f s, %d where the tuned tactic differs from the heuristic\n",
                m.c_str(), std::string(to_string(mode)).c_str(), entries.size(), s, changed);
    cache.save(path);  // after each preset: an interrupted run keeps what it measured
  }
  std::printf("tune cache: %s\n", path.c_str());
  return 0;
}

}  // namespace fp4moe::tools
