// fp4moe/presets.hpp — the model presets (docs/architecture.md, "Interfaces").
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "fp4moe/problem.hpp"

namespace fp4moe {

// deepseek-r1, qwen3-30b-a3b, qwen3-235b-a22b, llama4-scout, gpt-oss-120b, gpt-oss-20b, gpt-oss-120b-nvfp4,
// kimi-k2, glm-4.6, qwen3-next-80b-a3b, tiny. gpt-oss-120b and gpt-oss-20b have MXFP4 weights (w4a16
// only; gpt-oss-120b-nvfp4 is the NVFP4 stand-in); the others NVFP4. The quantization mode is set by
// the caller (default w4a16). Throws fp4moe::Error listing the names, or, for a mode an MXFP4 preset
// cannot run, saying so.
MoeProblem preset(std::string_view name, ActQuant mode = ActQuant::W4A16);
std::vector<std::string> preset_names();
// The weight format of a preset (the modes it takes: every mode for NVFP4, w4a16 for MXFP4).
WeightFormat preset_weight_format(std::string_view name);

}  // namespace fp4moe
