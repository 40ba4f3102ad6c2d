// tune/log.cpp — FP4MOE_LOG: off | info (default) | debug, read once per process.
//
// Lives in tune/ because its first users are the tuning cache warnings and the per-forward tactic
// line of the runner; it has no dependency beyond the C library.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "fp4moe/tune.hpp"

namespace fp4moe {

LogLevel parse_log_level(const char* value, std::string* warning) {
  const std::string_view v = value ? value : "";
  if (v.empty() || v == "info") return LogLevel::Info;
  if (v == "off") return LogLevel::Off;
  if (v == "debug") return LogLevel::Debug;
  if (warning) *warning = "FP4MOE_LOG: unknown value '" + std::string(v) + "', expected off, info or debug; using info";
  return LogLevel::Info;
}

LogLevel log_level() {
  // A function-local static: read and reported once, thread-safe; forwards only load an int.
  static const LogLevel level = [] {
    std::string warning;
    const LogLevel l = parse_log_level(std::getenv("FP4MOE_LOG"), &warning);
    if (!warning.empty()) std::fprintf(stderr, "fp4moe: warning: %s\n", warning.c_str());
    return l;
  }();
  return level;
}

void log_line(std::string_view line, LogLevel level) {
  if (level == LogLevel::Off || log_level() < level) return;
  std::fprintf(stderr, "fp4moe: %.*s\n", static_cast<int>(line.size()), line.data());
}

void log_warning(std::string_view text) {
  if (log_level() == LogLevel::Off) return;
  std::fprintf(stderr, "fp4moe: warning: %.*s\n", static_cast<int>(text.size()), text.data());
}

}  // namespace fp4moe
