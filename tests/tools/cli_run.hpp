// tests/tools/cli_run.hpp — runs the built `fp4moe` CLI (FP4MOE_CLI_PATH) and captures its result.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <string>

namespace fp4moe {

struct CliRun {
  int status;          // exit status, -1 when the process did not exit normally
  std::string output;  // stdout and stderr
};

inline CliRun cli(const std::string& args) {
  const std::string cmd = std::string(FP4MOE_CLI_PATH) + " " + args + " 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  EXPECT_NE(pipe, nullptr);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, pipe)) > 0) out.append(buf, n);
  const int raw = pclose(pipe);
  return {WIFEXITED(raw) ? WEXITSTATUS(raw) : -1, out};
}

}  // namespace fp4moe
