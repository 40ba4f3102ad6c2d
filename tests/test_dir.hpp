// tests/test_dir.hpp — fresh paths under the build's test folder (FP4MOE_TEST_TMPDIR).
#pragma once

#include <filesystem>
#include <string>

namespace fp4moe::test {

// FP4MOE_TEST_TMPDIR/group/name, removed if it exists; its parent folder exists.
inline std::string fresh_dir(const std::string& group, const std::string& name) {
  const std::filesystem::path p = std::filesystem::path(FP4MOE_TEST_TMPDIR) / group / name;
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p.parent_path());
  return p.string();
}

}  // namespace fp4moe::test
