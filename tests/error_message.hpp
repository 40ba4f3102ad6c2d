// tests/error_message.hpp — helpers for tests of fp4moe::Error messages.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "fp4moe/error.hpp"

namespace fp4moe {

// The message of the fp4moe::Error that fn throws, or "<no error>".
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

// Expects fn to throw an fp4moe::Error whose message contains needle.
inline void expect_error(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no fp4moe::Error thrown; expected one containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message '" << e.what() << "' lacks '" << needle << "'";
  }
}

}  // namespace fp4moe
