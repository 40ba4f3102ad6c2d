// fuzz/checkpoint_config_fuzz.cpp — libFuzzer target for io::parse_checkpoint_config.
//
// Steps per input:
//   1. split the bytes at the first NUL: before it is config.json, after it hf_quant_config.json
//      (no NUL: no hf_quant_config.json, so config.json's "quantization_config" is used);
//   2. parse; fp4moe::Error is the expected outcome for bad input, and its message must name the
//      checkpoint (the `where` argument), as the contract in checkpoint.hpp says;
//   3. when it parses, the result must be usable: the problem validates, and asking which layers are
//      MoE layers (in range and out of range) answers without error.
// Anything else (a crash, another exception type, a sanitizer report, a failed check) is a finding:
// the target aborts with a message.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <string_view>

#include "fp4moe/checkpoint.hpp"
#include "fp4moe/error.hpp"

namespace {

constexpr const char* kWhere = "/fuzz/ckpt";

[[noreturn]] void finding(const std::string& what) {
  std::fprintf(stderr, "checkpoint_config_fuzz: FINDING: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

void check_result(const fp4moe::io::CheckpointConfig& cfg) {
  try {
    cfg.problem.validate();
  } catch (const fp4moe::Error& e) {
    finding(std::string("parse_checkpoint_config returned a problem that does not validate: ") + e.what());
  }
  if (cfg.num_layers < 1) finding("parse_checkpoint_config returned num_layers < 1");
  // The first and last layers (num_layers can be large), and two out of range.
  const int64_t n = cfg.num_layers;
  auto probe = [&](int64_t layer, bool in_range) {
    const std::string reason = cfg.dense_reason(layer);
    if (cfg.is_moe_layer(layer) != reason.empty()) finding("is_moe_layer disagrees with dense_reason");
    if (!in_range && reason.empty()) finding("an out-of-range layer is reported as a MoE layer");
  };
  for (int64_t l = 0; l < std::min<int64_t>(n, 64); ++l) probe(l, true);
  for (int64_t l = std::max<int64_t>(64, n - 8); l < n; ++l) probe(l, true);
  probe(-1, false);
  probe(n, false);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view all(reinterpret_cast<const char*>(data), size);
  const size_t nul = all.find('\0');
  const std::string_view config = all.substr(0, nul);
  const std::string_view quant = nul == std::string_view::npos ? std::string_view() : all.substr(nul + 1);
  try {
    const fp4moe::io::CheckpointConfig cfg = fp4moe::io::parse_checkpoint_config(config, quant, kWhere);
    check_result(cfg);
  } catch (const fp4moe::Error& e) {
    if (std::strstr(e.what(), kWhere) == nullptr)
      finding(std::string("fp4moe::Error does not name the checkpoint: ") + e.what());
  } catch (const std::exception& e) {
    finding(std::string("unexpected exception (not fp4moe::Error): ") + e.what());
  } catch (...) {
    finding("unexpected non-std exception");
  }
  return 0;
}
