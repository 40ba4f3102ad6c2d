// tune/tactic_json.hpp — MoeTactic <-> nlohmann::json object (private to tune/; the public API in
// fp4moe/tune.hpp works on text so that nlohmann stays out of the public headers).
#pragma once

#include <nlohmann/json.hpp>

#include <string_view>

#include "fp4moe/tactic.hpp"

namespace fp4moe::tune {

nlohmann::ordered_json tactic_to_object(const MoeTactic& tactic);
// Throws fp4moe::Error naming the field as "<where>.<key>" (e.g. "tactic.split_k1").
MoeTactic tactic_from_object(const nlohmann::ordered_json& object, std::string_view where);

}  // namespace fp4moe::tune
