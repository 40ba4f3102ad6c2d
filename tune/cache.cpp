// tune/cache.cpp — the tuning cache file (format in fp4moe/tune.hpp), problem keys, device keys.
//
// load() never throws: a runner must start with the heuristic tactics whatever the file holds, so
// every failure becomes one warning line (for the whole file, or one line summing up the ignored
// entries). save() writes a temporary file and renames it, so a concurrent reader sees the old or
// the new file, never a mix.
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <tuple>

#include "fp4moe/error.hpp"
#include "fp4moe/tune.hpp"
#include "tune/tactic_json.hpp"

#ifndef FP4MOE_VERSION_STRING
#error "FP4MOE_VERSION_STRING must be defined by the build (CMakeLists.txt: the project version)"
#endif

namespace fp4moe {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

constexpr const char* kFormatTag = "fp4moe-tune-cache";
// 2: a tactic has split_k1 / split_k2 (one K split per GEMM) instead of one split_k.
constexpr int kFormatVersion = 2;
constexpr size_t kMaxFileBytes = size_t(64) << 20;  // a cache is a few hundred KiB; refuse absurd files
constexpr int kMaxJsonDepth = 16;                   // the format nests 4 deep; bounds parser recursion
constexpr size_t kMaxEntryReasons = 3;              // ignored entries named in the one warning line

// nlohmann's parser recurses per nesting level: refuse deep input before parsing it.
bool nesting_within(std::string_view text, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (char ch : text) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (ch == '\\') escaped = true;
      else if (ch == '"') in_string = false;
    } else if (ch == '"') {
      in_string = true;
    } else if (ch == '[' || ch == '{') {
      if (++depth > max_depth) return false;
    } else if (ch == ']' || ch == '}') {
      --depth;
    }
  }
  return true;
}

// Field readers: each throws fp4moe::Error naming "<where>.<key>".
const json& field(const json& o, const char* key, const std::string& where) {
  check(o.contains(key), where, ".", key, ": missing");
  return o.at(key);
}

int64_t int_field(const json& o, const char* key, const std::string& where, int64_t lo, int64_t hi) {
  const json& v = field(o, key, where);
  check(v.is_number_integer(), where, ".", key, ": expected an integer, got ", v.dump());
  if (v.is_number_unsigned())
    check(v.get<uint64_t>() <= static_cast<uint64_t>(hi), where, ".", key, ": must be in [", lo, ", ", hi, "], got ",
          v.dump());
  const int64_t x = v.get<int64_t>();
  check(x >= lo && x <= hi, where, ".", key, ": must be in [", lo, ", ", hi, "], got ", x);
  return x;
}

std::string string_field(const json& o, const char* key, const std::string& where) {
  const json& v = field(o, key, where);
  check(v.is_string(), where, ".", key, ": expected a string, got ", v.dump());
  return v.get<std::string>();
}

bool bool_field(const json& o, const char* key, const std::string& where) {
  const json& v = field(o, key, where);
  check(v.is_boolean(), where, ".", key, ": expected true or false, got ", v.dump());
  return v.get<bool>();
}

double time_field(const json& o, const char* key, const std::string& where) {
  const json& v = field(o, key, where);
  check(v.is_number(), where, ".", key, ": expected a number of microseconds, got ", v.dump());
  const double us = v.get<double>();
  check(std::isfinite(us) && us > 0, where, ".", key, ": must be finite and > 0, got ", v.dump());
  return us;
}

json problem_to_object(const MoeProblem& p) {
  json j = json::object();
  j["num_experts"] = p.num_experts;
  j["hidden"] = p.hidden;
  j["inter"] = p.inter;
  j["top_k"] = p.routing.top_k;
  j["routing_method"] = std::string(to_string(p.routing.method));
  j["n_group"] = p.routing.n_group;
  j["topk_group"] = p.routing.topk_group;
  j["apply_router_weight_on_input"] = p.routing.apply_router_weight_on_input;
  j["activation"] = std::string(to_string(p.activation.kind));
  j["act_quant"] = std::string(to_string(p.act_quant));
  // NOTE: written for MXFP4 only: an entry without it is NVFP4, as every file written before the field.
  if (p.weight_format != WeightFormat::NVFP4) j["weight_format"] = std::string(to_string(p.weight_format));
  return j;
}

MoeProblem problem_from_object(const json& o, const std::string& where) {
  check(o.is_object(), where, ": expected an object, got ", o.dump());
  constexpr int64_t kMaxDim = int64_t(1) << 31;
  MoeProblem p;
  p.num_experts = int_field(o, "num_experts", where, 1, kMaxDim);
  p.hidden = int_field(o, "hidden", where, 1, kMaxDim);
  p.inter = int_field(o, "inter", where, 1, kMaxDim);
  p.routing.top_k = static_cast<int>(int_field(o, "top_k", where, 1, 32));
  p.routing.method = parse_routing_method(string_field(o, "routing_method", where), where + ".routing_method");
  p.routing.n_group = static_cast<int>(int_field(o, "n_group", where, 1, kMaxDim));
  p.routing.topk_group = static_cast<int>(int_field(o, "topk_group", where, 1, kMaxDim));
  p.routing.apply_router_weight_on_input = bool_field(o, "apply_router_weight_on_input", where);
  p.activation.kind = parse_activation(string_field(o, "activation", where), where + ".activation");
  p.act_quant = parse_act_quant(string_field(o, "act_quant", where), where + ".act_quant");
  if (o.contains("weight_format"))
    p.weight_format = parse_weight_format(string_field(o, "weight_format", where), where + ".weight_format");
  p.validate();
  return p;
}

// Keeps only the fields of problem_key, so equal keys give equal stored problems.
MoeProblem key_fields(const MoeProblem& p) {
  MoeProblem k;
  k.num_experts = p.num_experts;
  k.hidden = p.hidden;
  k.inter = p.inter;
  k.routing.method = p.routing.method;
  k.routing.top_k = p.routing.top_k;
  if (p.routing.method == RoutingMethod::DeepSeekV3) {
    k.routing.n_group = p.routing.n_group;
    k.routing.topk_group = p.routing.topk_group;
  }
  k.routing.apply_router_weight_on_input = p.routing.apply_router_weight_on_input;
  k.activation.kind = p.activation.kind;
  k.act_quant = p.act_quant;
  k.weight_format = p.weight_format;
  return k;
}

json entry_to_object(const TuneEntry& e) {
  const BucketRange r = bucket_range(e.bucket);
  json j = json::object();
  j["fp4moe_version"] = e.device.fp4moe_version;
  j["gpu_name"] = e.device.gpu_name;
  j["sm_count"] = e.device.sm_count;
  j["cuda_runtime"] = e.device.cuda_runtime;
  j["problem"] = problem_to_object(e.problem);
  j["bucket"] = e.bucket;
  j["bucket_lo"] = r.lo;
  j["bucket_hi"] = r.open() ? json(nullptr) : json(r.hi);
  j["representative"] = r.representative;
  j["tactic"] = tune::tactic_to_object(e.tactic);
  j["tactic_us"] = e.tactic_us;
  j["heuristic"] = tune::tactic_to_object(e.heuristic);
  j["heuristic_us"] = e.heuristic_us;
  return j;
}

TuneEntry entry_from_object(const json& o, const std::string& where) {
  check(o.is_object(), where, ": expected an object, got ", o.type_name());
  TuneEntry e;
  e.device.fp4moe_version = string_field(o, "fp4moe_version", where);
  e.device.gpu_name = string_field(o, "gpu_name", where);
  e.device.sm_count = static_cast<int>(int_field(o, "sm_count", where, 1, INT32_MAX));
  e.device.cuda_runtime = static_cast<int>(int_field(o, "cuda_runtime", where, 0, INT32_MAX));
  e.problem = problem_from_object(field(o, "problem", where), where + ".problem");
  e.bucket = static_cast<int>(int_field(o, "bucket", where, 0, INT32_MAX));
  check(e.bucket < kNumBuckets, where, ".bucket: ", e.bucket, " is beyond this build's ladder of ", kNumBuckets,
        " buckets (stale entry)");
  // The ladder is fixed, but an entry written by a build with another ladder must not be misread.
  const BucketRange r = bucket_range(e.bucket);
  const json& hi = field(o, "bucket_hi", where);
  const bool same_range = int_field(o, "bucket_lo", where, 0, INT64_MAX) == r.lo &&
                          (r.open() ? hi.is_null() : int_field(o, "bucket_hi", where, 0, INT64_MAX) == r.hi) &&
                          int_field(o, "representative", where, 0, INT64_MAX) == r.representative;
  check(same_range, where, ": bucket ", e.bucket, " has another range than this build's ", describe_bucket(e.bucket),
        " (stale entry)");
  e.tactic = tune::tactic_from_object(field(o, "tactic", where), where + ".tactic");
  const std::string why = why_invalid(e.problem, e.tactic);
  check(why.empty(), where, ".tactic ", describe(e.tactic), " is invalid for ", problem_key(e.problem), ": ", why);
  e.tactic_us = time_field(o, "tactic_us", where);
  e.heuristic = tune::tactic_from_object(field(o, "heuristic", where), where + ".heuristic");
  e.heuristic_us = time_field(o, "heuristic_us", where);
  return e;
}

auto sort_key(const TuneEntry& e) {
  return std::make_tuple(e.device.gpu_name, e.device.sm_count, e.device.cuda_runtime, e.device.fp4moe_version,
                         problem_key(e.problem), e.bucket);
}

}  // namespace

std::string_view fp4moe_version() { return FP4MOE_VERSION_STRING; }

std::string DeviceKey::describe() const {
  return detail::concat(gpu_name, " (", sm_count, " SMs, CUDA runtime ", cuda_runtime, ", fp4moe ", fp4moe_version,
                        ")");
}

std::string problem_key(const MoeProblem& p) {
  std::ostringstream os;
  os << "E=" << p.num_experts << " H=" << p.hidden << " I=" << p.inter << " k=" << p.routing.top_k
     << " routing=" << to_string(p.routing.method);
  const bool grouped = p.routing.method == RoutingMethod::DeepSeekV3;
  const bool on_input = p.routing.apply_router_weight_on_input;
  if (grouped || on_input) {
    os << '(';
    if (grouped) os << "n_group=" << p.routing.n_group << ",topk_group=" << p.routing.topk_group;
    if (on_input) os << (grouped ? "," : "") << "weight_on_input";
    os << ')';
  }
  os << " act=" << to_string(p.activation.kind) << " quant=" << to_string(p.act_quant);
  if (p.weight_format != WeightFormat::NVFP4) os << " weights=" << to_string(p.weight_format);
  return os.str();
}

CacheLoadResult TuneCache::load(const std::string& path) {
  entries_.clear();
  CacheLoadResult result;
  const auto ignore_file = [&](const std::string& why) {
    entries_.clear();
    result.file_ignored = true;
    result.entries_loaded = 0;
    result.warnings.push_back("tune cache '" + path + "' ignored: " + why +
                              "; using the heuristic tactics (re-run `fp4moe tune` to rewrite it)");
    return result;
  };
  try {
    std::error_code ec;
    if (!fs::exists(path, ec)) {
      result.warnings.push_back("tune cache '" + path + "' not found; using the heuristic tactics");
      return result;
    }
    result.file_found = true;
    if (fs::is_directory(path, ec)) return ignore_file("it is a directory");
    const auto size = fs::file_size(path, ec);
    if (ec) return ignore_file("cannot read its size: " + ec.message());
    if (size > kMaxFileBytes) return ignore_file(detail::concat("it has ", size, " bytes, more than a cache can"));
    std::ifstream in(path, std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (!in.good() && !in.eof()) return ignore_file("cannot read it");
    if (!nesting_within(text, kMaxJsonDepth)) return ignore_file("JSON nested too deep for a tune cache");
    const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return ignore_file("not valid JSON (truncated or corrupt)");
    if (!j.is_object() || !j.contains("format") || j.at("format") != kFormatTag)
      return ignore_file(std::string("not a tune cache (expected \"format\": \"") + kFormatTag + "\")");
    const json* version = j.contains("format_version") ? &j.at("format_version") : nullptr;
    if (!version || !version->is_number_integer())
      return ignore_file("\"format_version\" missing or not an integer");
    if (*version != kFormatVersion)
      return ignore_file(detail::concat("format_version ", version->dump(), ", this build reads ", kFormatVersion));
    if (!j.contains("entries") || !j.at("entries").is_array()) return ignore_file("\"entries\" missing or not an array");

    std::vector<std::string> reasons;
    size_t index = 0;
    for (const json& item : j.at("entries")) {
      const std::string where = detail::concat("entries[", index++, "]");
      try {
        set(entry_from_object(item, where));
      } catch (const std::exception& e) {  // fp4moe::Error or a json type error: this entry only
        ++result.entries_ignored;
        if (reasons.size() < kMaxEntryReasons) reasons.push_back(e.what());
      }
    }
    if (result.entries_ignored > 0) {
      std::string w = detail::concat("tune cache '", path, "': ignored ", result.entries_ignored, " of ", index,
                                     " entries: ");
      for (size_t i = 0; i < reasons.size(); ++i) w += (i ? "; " : "") + reasons[i];
      if (result.entries_ignored > reasons.size())
        w += detail::concat("; and ", result.entries_ignored - reasons.size(), " more");
      result.warnings.push_back(w);
    }
    result.entries_loaded = entries_.size();  // duplicates in the file: the later one counts once
    return result;
  } catch (const std::exception& e) {
    return ignore_file(std::string("unexpected error: ") + e.what());
  }
}

void TuneCache::save(const std::string& path) const {
  std::vector<const TuneEntry*> sorted;
  for (const TuneEntry& e : entries_) sorted.push_back(&e);
  std::sort(sorted.begin(), sorted.end(),
            [](const TuneEntry* a, const TuneEntry* b) { return sort_key(*a) < sort_key(*b); });
  json entries = json::array();
  for (const TuneEntry* e : sorted) entries.push_back(entry_to_object(*e));
  json top = json::object();
  top["format"] = kFormatTag;
  top["format_version"] = kFormatVersion;
  top["entries"] = std::move(entries);
  const std::string text = top.dump(2) + "\n";

  // Same directory as the target, so the rename stays on one file system and is atomic.
  const std::string tmp = detail::concat(path, ".tmp.", ::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    check(out.is_open(), "tune cache: cannot create '", tmp, "' to write '", path, "'");
    out << text;
    out.close();
    if (!out) {
      std::error_code ec;
      fs::remove(tmp, ec);
      throw Error("tune cache: cannot write '" + tmp + "' (disk full?)");
    }
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    std::error_code ignored;
    fs::remove(tmp, ignored);
    throw Error("tune cache: cannot rename '" + tmp + "' to '" + path + "': " + ec.message());
  }
}

void TuneCache::set(const TuneEntry& entry) {
  check(entry.bucket >= 0 && entry.bucket < kNumBuckets, "TuneCache::set: bucket must be in [0, ", kNumBuckets,
        "), got ", entry.bucket);
  const std::string why = why_invalid(entry.problem, entry.tactic);
  check(why.empty(), "TuneCache::set: tactic ", describe(entry.tactic), " is invalid for ", problem_key(entry.problem),
        ": ", why);
  check(std::isfinite(entry.tactic_us) && entry.tactic_us > 0, "TuneCache::set: tactic_us must be finite and > 0, got ",
        entry.tactic_us);
  check(std::isfinite(entry.heuristic_us) && entry.heuristic_us > 0,
        "TuneCache::set: heuristic_us must be finite and > 0, got ", entry.heuristic_us);
  TuneEntry stored = entry;
  stored.problem = key_fields(entry.problem);
  const std::string key = problem_key(stored.problem);
  for (TuneEntry& e : entries_) {
    if (e.device == stored.device && e.bucket == stored.bucket && problem_key(e.problem) == key) {
      e = std::move(stored);
      return;
    }
  }
  entries_.push_back(std::move(stored));
}

void TuneCache::set(const DeviceKey& device, const MoeProblem& problem, int bucket, const MoeTactic& tactic,
                    double tactic_us, double heuristic_us) {
  TuneEntry e;
  e.device = device;
  e.problem = problem;
  e.bucket = bucket;
  e.tactic = tactic;
  e.tactic_us = tactic_us;
  e.heuristic = heuristic_tactic(problem, bucket_range(bucket).representative);
  e.heuristic_us = heuristic_us;
  set(e);
}

std::optional<MoeTactic> TuneCache::lookup(const DeviceKey& device, const MoeProblem& problem, int bucket) const {
  const std::string key = problem_key(problem);
  for (const TuneEntry& e : entries_)
    if (e.bucket == bucket && e.device == device && problem_key(e.problem) == key) return e.tactic;
  return std::nullopt;
}

std::string tune_cache_path_from_env() {
  const char* p = std::getenv("FP4MOE_TUNE_CACHE");
  return p ? std::string(p) : std::string();
}

std::string default_tune_cache_path() {
  const std::string env = tune_cache_path_from_env();
  return env.empty() ? "./fp4moe-tune-cache.json" : env;
}

}  // namespace fp4moe
