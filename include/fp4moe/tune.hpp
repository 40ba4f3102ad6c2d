// fp4moe/tune.hpp — choosing the tactic of a forward (docs/architecture.md, "Layers"; tune/): the tactic
// registry, the token-count buckets, the tuning cache file and the per-forward selector. CPU code, no CUDA.
//
//   TuneCache cache;
//   CacheLoadResult r = cache.load(path);              // never throws; r.warnings: print once
//   TacticSelector sel(problem, device, &cache);       // once per runner: one choice per bucket
//   TacticSelector::Choice c = sel.select(T);          // per forward: no allocation, no lookup by key
//   if (log_level() >= LogLevel::Debug) log_line(describe_choice(problem, T, c));
//
// Every T >= 0 maps to exactly one bucket; a tactic is chosen per bucket, from the cache when it
// holds a valid entry for this device, fp4moe version and problem, else by heuristic_tactic().
// Validity of a tactic depends on the problem only, never on T, so a bucket's tactic serves every
// T of the bucket.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fp4moe/problem.hpp"
#include "fp4moe/tactic.hpp"

namespace fp4moe {

// ---- logging (FP4MOE_LOG) ------------------------------------------------------------------------------

enum class LogLevel : int {
  Off = 0,    // nothing, not even warnings
  Info = 1,   // warnings and one-time notes (the default)
  Debug = 2,  // also one line per forward: problem, T, bucket, tactic and its source
};

// Parses an FP4MOE_LOG value: "off", "info", "debug" (or empty / null: info). An unknown value gives
// info and sets *warning (when non-null) to a message naming the value and the accepted ones.
LogLevel parse_log_level(const char* value, std::string* warning = nullptr);
// The level from FP4MOE_LOG, read once per process (an unknown value is reported once on stderr).
LogLevel log_level();
// Writes "fp4moe: <line>\n" to stderr when log_level() >= level.
void log_line(std::string_view line, LogLevel level = LogLevel::Info);
// Writes "fp4moe: warning: <text>\n" to stderr unless log_level() is Off.
void log_warning(std::string_view text);

// ---- tactic codec --------------------------------------------------------------------------------------

// {"kernel":"sm90_wgmma","tile_tokens":128,"split_k1":1,"split_k2":1} (compact, keys in this order).
std::string tactic_to_json(const MoeTactic& tactic);
// Parses the object above; throws fp4moe::Error naming the field ("tactic.kernel: ..."). Unknown keys
// are errors too (a typo must not silently give a default).
MoeTactic tactic_from_json(std::string_view text);

// ---- registry ------------------------------------------------------------------------------------------

// Every valid tactic for the problem, in the registry's table order. Never empty for a problem the
// runner accepts (H, I multiples of 16).
std::vector<MoeTactic> candidate_tactics(const MoeProblem& problem);
// Why the tactic cannot run this problem, or "" when it can: the one definition of a valid tactic (the
// runner refuses to launch any other). Rules per kernel family (tables in fp4moe/tactic.hpp):
//   sm90_wgmma:  tile_tokens in kWgmmaTileTokens {64, 128, 256}, split_k1 = split_k2 = 1; every problem
//                with H, I multiples of 16.
//   sm90_stream: tile_tokens in kStreamTileTokens {16, 32}; split_k1 (GEMM1, K = H) and split_k2 (GEMM2,
//                K = I) each in kStreamSplitK {1, 2, 4, 6}, and a split s > 1 only where its GEMM has at
//                least 2 * s chunks of 128 along K, so every split CTA gets at least two chunks to
//                pipeline.
std::string why_invalid(const MoeProblem& problem, const MoeTactic& tactic);
inline bool tactic_valid(const MoeProblem& problem, const MoeTactic& tactic) {
  return why_invalid(problem, tactic).empty();
}
// The tactic without profiling, for the bucket of T (it depends on T only through the bucket's
// representative R). With m = R * k / E (expected tokens per expert):
//   m < m_switch (28 where both GEMMs together have <= 32 K chunks of 128, 17 for <= 48, else 16):
//              sm90_stream; tile_tokens 32 when m > 12, else 16; split_k1 = split_k2 = the largest s of
//              4, 2 that keeps experts_hit * ceil(min(w13 rows, H) / 128) * s <= 5 * 132 CTAs
//              (experts_hit = min(E, R * k)) and leaves >= 10 chunks of 128 per split in both
//              GEMMs, else 1;
//   m < 48 and E <= 128: sm90_wgmma t64;
//   m < 384:   sm90_wgmma t128;
//   else:      sm90_wgmma t256.
// Always valid for the problem. Throws fp4moe::Error for T < 0.
MoeTactic heuristic_tactic(const MoeProblem& problem, int64_t T);

// The token count whose bucket chooses the tactic of a forward of T tokens: T, or for an
// expert-parallel rank (skip_foreign_ids with routing.total_experts > E) ceil(T * E / total_experts),
// the tokens that give its E experts the slots an even routing sends them (deepseek-r1 over 8 ranks,
// T = 64: 8). T < 0 is returned as is (bucket_of refuses it).
int64_t tactic_tokens(const MoeProblem& problem, int64_t T);

// ---- buckets -------------------------------------------------------------------------------------------
//
// The ladder (fixed: the cache stores bucket indices, a change of the ladder makes old entries stale):
//   buckets   0..32:  T = 0, 1, ..., 32            one bucket per T
//   buckets  33..44:  (32, 128] in steps of 8     [33,40], [41,48], ..., [121,128]
//   buckets  45..56:  (128, 512] in steps of 32   [129,160], ..., [481,512]
//   buckets  57..100: (512, 2^20], each power of two split in quarters: (2^p, 2^p * 5/4], ...,
//                     (2^p * 7/4, 2^(p+1)] for p = 9..19 (each bucket at most 1.25x its start)
//   bucket   101:     (2^20, INT64_MAX], the open bucket
// A bucket's representative (the T it is tuned at) is its upper end; for the open bucket 2^20 * 5/4.

struct BucketRange {
  int64_t lo = 0;              // first T of the bucket
  int64_t hi = 0;              // last T (inclusive); INT64_MAX for the open bucket
  int64_t representative = 0;  // the T that tuning measures and the heuristic assumes
  bool open() const { return hi == INT64_MAX; }
};

constexpr int kNumBuckets = 102;
constexpr int64_t kLastClosedBucketEnd = int64_t(1) << 20;

inline constexpr int num_buckets() { return kNumBuckets; }
// The bucket of T; throws fp4moe::Error for T < 0.
int bucket_of(int64_t T);
// Throws fp4moe::Error when b is not in [0, num_buckets()).
BucketRange bucket_range(int b);
// e.g. "[17, 17]", "[33, 40]", "[1048577, inf)"
std::string describe_bucket(int b);
// The buckets `fp4moe tune` profiles, in increasing order: when `tokens` is empty every bucket from 1
// whose representative is <= max_tokens, otherwise the buckets holding the given T (each counted
// once; T = 0, bucket 0, launches nothing and is skipped). Throws fp4moe::Error for a T < 0.
std::vector<int> buckets_to_tune(int64_t max_tokens, const std::vector<int64_t>& tokens);

// ---- cache file ----------------------------------------------------------------------------------------
//
// JSON, written by `fp4moe tune`, read by the runner and `fp4moe tune --show`:
//   {
//     "format": "fp4moe-tune-cache",
//     "format_version": 2,
//     "entries": [
//       {
//         "fp4moe_version": "0.1.0", "gpu_name": "NVIDIA H200", "sm_count": 132, "cuda_runtime": 12080,
//         "problem": {"num_experts": 256, "hidden": 7168, "inter": 2048, "top_k": 8,
//                     "routing_method": "deepseek_v3", "n_group": 8, "topk_group": 4,
//                     "apply_router_weight_on_input": false, "activation": "swiglu",
//                     "act_quant": "w4a4_scalar"},
//         "bucket": 57, "bucket_lo": 513, "bucket_hi": 640, "representative": 640,
//         "tactic": {"kernel": "sm90_wgmma", "tile_tokens": 128, "split_k1": 1, "split_k2": 1},
//         "tactic_us": 812.5,
//         "heuristic": {"kernel": "sm90_wgmma", "tile_tokens": 128, "split_k1": 1, "split_k2": 1},
//         "heuristic_us": 812.5
//       }
//     ]
//   }
// "bucket_hi" is null for the open bucket. A file of another format_version is ignored with a warning
// (version 1 had one "split_k" for both GEMMs). An entry whose bucket range differs from this build's
// ladder, whose problem is invalid, whose tactic is invalid for its problem, or whose times are not
// finite and positive is ignored with a warning.

// Where the tactics were measured. An entry is used only when all four fields are equal.
struct DeviceKey {
  std::string fp4moe_version;  // fp4moe_version() of the build that tuned
  std::string gpu_name;        // cudaDeviceProp::name
  int sm_count = 0;            // cudaDeviceProp::multiProcessorCount
  int cuda_runtime = 0;        // cudaRuntimeGetVersion, e.g. 12080
  friend bool operator==(const DeviceKey&, const DeviceKey&) = default;
  // e.g. "NVIDIA H200 (132 SMs, CUDA runtime 12080, fp4moe 0.1.0)"
  std::string describe() const;
};

// The version of this build (the CMake project version), e.g. "0.1.0".
std::string_view fp4moe_version();

// Canonical key of the fields that change the work of the GEMMs: E, H, I, k, routing method with
// n_group / topk_group (DeepSeekV3) and router weight on input, activation, act_quant, and the weight
// format (" weights=mxfp4" for MXFP4; NVFP4 keys have no such part, so cache files written before the
// field read as NVFP4, and their entries keep their keys). Scalars that
// only change values (routed_scaling_factor, swiglu alpha/beta/limit) are left out so that problems
// differing only in them share their tuning. e.g.
//   "E=256 H=7168 I=2048 k=8 routing=deepseek_v3(n_group=8,topk_group=4) act=swiglu quant=w4a4_scalar"
std::string problem_key(const MoeProblem& problem);

struct TuneEntry {
  DeviceKey device;
  MoeProblem problem;  // only the fields of problem_key() are stored
  int bucket = 0;
  MoeTactic tactic;          // the fastest tactic measured at the bucket's representative T
  double tactic_us = 0;      // its time per forward, microseconds
  MoeTactic heuristic;       // heuristic_tactic(problem, representative)
  double heuristic_us = 0;   // its time per forward, microseconds
};

struct CacheLoadResult {
  bool file_found = false;         // false: no file at the path (a warning says so)
  bool file_ignored = false;       // true: unreadable, corrupt or another format: the cache is empty
  size_t entries_loaded = 0;
  size_t entries_ignored = 0;      // entries dropped for a reason named in warnings
  std::vector<std::string> warnings;  // for the caller to print once; at most a few lines
};

class TuneCache {
 public:
  // Replaces the contents with the file's valid entries. Never throws: a missing, unreadable,
  // corrupt or foreign-format file leaves the cache empty with one warning.
  CacheLoadResult load(const std::string& path);
  // Writes the cache (entries sorted) to path + ".tmp.<pid>", then renames it over path, so a reader
  // never sees a half-written file. Throws fp4moe::Error naming the path on failure.
  void save(const std::string& path) const;

  // Adds the entry or replaces the one with the same device, problem key and bucket. Throws
  // fp4moe::Error when the tactic is invalid for the problem, the bucket is out of range or a time
  // is not finite and positive.
  void set(const TuneEntry& entry);
  // Same, with heuristic = heuristic_tactic(problem, representative of the bucket).
  void set(const DeviceKey& device, const MoeProblem& problem, int bucket, const MoeTactic& tactic,
           double tactic_us, double heuristic_us);
  // The tuned tactic of this device, fp4moe version, problem and bucket, if any.
  std::optional<MoeTactic> lookup(const DeviceKey& device, const MoeProblem& problem, int bucket) const;

  const std::vector<TuneEntry>& entries() const { return entries_; }
  bool empty() const { return entries_.empty(); }
  void clear() { entries_.clear(); }

 private:
  std::vector<TuneEntry> entries_;
};

// The cache path the runner uses when none is given through the API: FP4MOE_TUNE_CACHE, or "".
std::string tune_cache_path_from_env();
// The cache path of the CLI: FP4MOE_TUNE_CACHE, or "./fp4moe-tune-cache.json".
std::string default_tune_cache_path();

// ---- per-forward selection -----------------------------------------------------------------------------

class TacticSelector {
 public:
  struct Choice {
    enum class Source { Cache, Heuristic };
    MoeTactic tactic;
    int bucket = 0;
    Source source = Source::Heuristic;
  };

  // One choice per bucket, precomputed: the cache's entry for (device, problem, bucket) when valid,
  // else the heuristic. cache may be null (heuristic only). Entries for this problem tuned on another
  // device or fp4moe version are ignored with one warning (warnings()).
  TacticSelector(const MoeProblem& problem, const DeviceKey& device, const TuneCache* cache);
  // Loads the cache file at path (when path is "": tune_cache_path_from_env(); when that is "" too:
  // heuristic only, no warning). The load's warnings are kept in warnings().
  static TacticSelector from_file(const MoeProblem& problem, const DeviceKey& device, const std::string& path);

  // The choice for a forward of T >= 0 tokens: the bucket of tactic_tokens(problem, T) (throws
  // fp4moe::Error for T < 0). No allocation.
  const Choice& select(int64_t T) const { return choices_[bucket_of(tactic_tokens(problem_, T))]; }
  const std::vector<Choice>& choices() const { return choices_; }  // indexed by bucket
  int cached_buckets() const;                                       // choices with Source::Cache
  // For the caller to print once (log_warning), e.g. right after creating the runner.
  const std::vector<std::string>& warnings() const { return warnings_; }

 private:
  TacticSelector() = default;
  void build(const MoeProblem& problem, const DeviceKey& device, const TuneCache* cache);
  MoeProblem problem_;
  std::vector<Choice> choices_;
  std::vector<std::string> warnings_;
};

std::string_view to_string(TacticSelector::Choice::Source source);  // "cache" | "heuristic"

// The FP4MOE_LOG=debug line of one forward, e.g.
//   "forward E=128 H=2048 I=768 k=8 routing=renormalize act=swiglu quant=w4a16 T=300 bucket 46 [289, 320]
//    tactic sm90_wgmma/t128/s1 (cache)"
std::string describe_choice(const MoeProblem& problem, int64_t T, const TacticSelector::Choice& choice);

}  // namespace fp4moe
