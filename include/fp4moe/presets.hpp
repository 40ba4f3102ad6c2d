// fp4moe/presets.hpp — the model presets (docs/architecture.md, "Interfaces").
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "fp4moe/problem.hpp"

namespace fp4moe {

// deepseek-r1, qwen3-30b-a3b, qwen3-235b-a22b, llama4-scout, gpt-oss-120b, tiny.
// The quantization mode is set by the caller (default w4a16). Throws fp4moe::Error listing the names.
MoeProblem preset(std::string_view name, ActQuant mode = ActQuant::W4A16);
std::vector<std::string> preset_names();

}  // namespace fp4moe
