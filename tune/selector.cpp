// tune/selector.cpp — TacticSelector: the tactic of every bucket, chosen once per runner, so that a
// forward only maps T to its bucket and reads the table (no allocation, no key comparison).
#include <string>

#include "fp4moe/error.hpp"
#include "fp4moe/tune.hpp"

namespace fp4moe {

TacticSelector::TacticSelector(const MoeProblem& problem, const DeviceKey& device, const TuneCache* cache) {
  build(problem, device, cache);
}

TacticSelector TacticSelector::from_file(const MoeProblem& problem, const DeviceKey& device, const std::string& path) {
  const std::string resolved = path.empty() ? tune_cache_path_from_env() : path;
  TacticSelector s;
  if (resolved.empty()) {
    s.build(problem, device, nullptr);
    return s;
  }
  TuneCache cache;
  const CacheLoadResult loaded = cache.load(resolved);
  s.build(problem, device, &cache);
  s.warnings_.insert(s.warnings_.begin(), loaded.warnings.begin(), loaded.warnings.end());
  return s;
}

int64_t tactic_tokens(const MoeProblem& p, int64_t T) {
  const int64_t E = p.num_experts, total = p.routing.total_experts;
  if (T <= 0 || !p.routing.skip_foreign_ids || total <= E || E < 1) return T;
  return (T * E + total - 1) / total;  // T < 2^31, E <= 2^16: no overflow
}

void TacticSelector::build(const MoeProblem& problem, const DeviceKey& device, const TuneCache* cache) {
  problem_ = problem;
  choices_.assign(kNumBuckets, Choice{});
  for (int b = 0; b < kNumBuckets; ++b)
    choices_[b] = {heuristic_tactic(problem, bucket_range(b).representative), b, Choice::Source::Heuristic};
  if (!cache) return;

  const std::string key = problem_key(problem);
  size_t foreign = 0, invalid = 0;
  std::string foreign_example, invalid_example;
  for (const TuneEntry& e : cache->entries()) {
    if (problem_key(e.problem) != key) continue;  // another problem: not ours to judge
    if (!(e.device == device)) {
      if (foreign++ == 0) foreign_example = e.device.describe();
      continue;
    }
    // The cache checked the tactic against its stored problem; check it against ours too, since the
    // runner must never launch an invalid tactic whatever the file said.
    const std::string why = why_invalid(problem, e.tactic);
    if (!why.empty()) {
      if (invalid++ == 0) invalid_example = describe(e.tactic) + ": " + why;
      continue;
    }
    choices_[e.bucket] = {e.tactic, e.bucket, Choice::Source::Cache};
  }
  if (foreign > 0)
    warnings_.push_back(detail::concat(
        "tune cache: ", foreign, " entries for ", key, " were tuned on another device or fp4moe version (e.g. ",
        foreign_example, "), not on this one (", device.describe(),
        "): ignored; re-run `fp4moe tune` on this machine"));
  if (invalid > 0)
    warnings_.push_back(detail::concat("tune cache: ", invalid, " entries for ", key,
                                       " hold a tactic invalid for this problem (e.g. ", invalid_example,
                                       "): ignored"));
}

int TacticSelector::cached_buckets() const {
  int n = 0;
  for (const Choice& c : choices_) n += c.source == Choice::Source::Cache;
  return n;
}

std::string_view to_string(TacticSelector::Choice::Source source) {
  return source == TacticSelector::Choice::Source::Cache ? "cache" : "heuristic";
}

std::string describe_choice(const MoeProblem& problem, int64_t T, const TacticSelector::Choice& choice) {
  return detail::concat("forward ", problem.describe(), " T=", T, " bucket ", choice.bucket, " ",
                        describe_bucket(choice.bucket), " tactic ", describe(choice.tactic), " (",
                        to_string(choice.source), ")");
}

}  // namespace fp4moe
