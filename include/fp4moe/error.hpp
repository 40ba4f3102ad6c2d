// fp4moe/error.hpp — the one error type of the CPU-side library.
//
// CPU code (format/, reference/, io/, the argument checks of runner/) throws fp4moe::Error with a
// message that names the argument or tensor, the expected and the actual value. Code that launches
// CUDA work returns fp4moe::Status instead and never throws across the CUDA boundary.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace fp4moe {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Status of an operation that launches device work. ok() or a message naming what is wrong.
struct Status {
  std::string message;  // empty when ok
  bool ok() const { return message.empty(); }
  static Status success() { return {}; }
  static Status failure(std::string m) { return Status{std::move(m)}; }
};

namespace detail {
template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
}  // namespace detail

// Throws fp4moe::Error built from the streamed arguments when cond is false.
//   check(H % 16 == 0, "hidden size H must be a multiple of 16, got ", H);
template <typename... Args>
inline void check(bool cond, Args&&... args) {
  if (!cond) throw Error(detail::concat(std::forward<Args>(args)...));
}

}  // namespace fp4moe
