// tune/tactic_json.cpp — the JSON form of a tactic:
// {"kernel":"sm90_wgmma","tile_tokens":128,"split_k1":1,"split_k2":1}.
//
// Parsing is strict (every key present, no unknown key, integers in int range) because a cache entry
// that silently fell back to a default field would run a tactic nobody measured. Whether the tactic
// is valid for a problem is the registry's business, not the codec's.
#include "tune/tactic_json.hpp"

#include <climits>
#include <string>

#include "fp4moe/error.hpp"
#include "fp4moe/tune.hpp"

namespace fp4moe {
namespace tune {
namespace {

using json = nlohmann::ordered_json;

int int_field(const json& object, const char* key, std::string_view where) {
  check(object.contains(key), where, ".", key, ": missing");
  const json& v = object.at(key);
  check(v.is_number_integer(), where, ".", key, ": expected an integer, got ", v.dump());
  const bool in_range = v.is_number_unsigned() ? v.get<uint64_t>() <= uint64_t(INT_MAX)
                                               : v.get<int64_t>() >= INT_MIN && v.get<int64_t>() <= INT_MAX;
  check(in_range, where, ".", key, ": out of the int range: ", v.dump());
  return v.get<int>();
}

}  // namespace

json tactic_to_object(const MoeTactic& t) {
  json j = json::object();
  j["kernel"] = std::string(to_string(t.kernel));
  j["tile_tokens"] = t.tile_tokens;
  j["split_k1"] = t.split_k1;
  j["split_k2"] = t.split_k2;
  return j;
}

MoeTactic tactic_from_object(const json& object, std::string_view where) {
  check(object.is_object(), where, ": expected an object like {\"kernel\":\"sm90_wgmma\",\"tile_tokens\":128,"
        "\"split_k1\":1,\"split_k2\":1}, got ", object.dump());
  for (const auto& item : object.items()) {
    const std::string& key = item.key();
    check(key == "kernel" || key == "tile_tokens" || key == "split_k1" || key == "split_k2", where, ".", key,
          ": unknown key (expected kernel, tile_tokens, split_k1, split_k2)");
  }
  MoeTactic t;
  check(object.contains("kernel"), where, ".kernel: missing");
  const json& kernel = object.at("kernel");
  check(kernel.is_string(), where, ".kernel: expected a string, got ", kernel.dump());
  t.kernel = parse_gemm_kernel(kernel.get<std::string>(), std::string(where) + ".kernel");
  t.tile_tokens = int_field(object, "tile_tokens", where);
  t.split_k1 = int_field(object, "split_k1", where);
  t.split_k2 = int_field(object, "split_k2", where);
  return t;
}

}  // namespace tune

std::string tactic_to_json(const MoeTactic& tactic) { return tune::tactic_to_object(tactic).dump(); }

MoeTactic tactic_from_json(std::string_view text) {
  const nlohmann::ordered_json j = nlohmann::ordered_json::parse(text.begin(), text.end(), nullptr, false);
  check(!j.is_discarded(), "tactic: invalid JSON: '", text, "'");
  return tune::tactic_from_object(j, "tactic");
}

}  // namespace fp4moe
