// tests/test_dir.hpp — fresh paths under the build's test folder (FP4MOE_TEST_TMPDIR).
#pragma once

#include <gtest/gtest.h>

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

// FP4MOE_TEST_TMPDIR/group/<test suite>.<test name><suffix>: a file path of the running test; its folder
// exists.
inline std::string test_file_path(const std::string& group, const std::string& suffix) {
  const std::filesystem::path dir = std::filesystem::path(FP4MOE_TEST_TMPDIR) / group;
  std::filesystem::create_directories(dir);
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return (dir / (std::string(info->test_suite_name()) + "." + info->name() + suffix)).string();
}

}  // namespace fp4moe::test
