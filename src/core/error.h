// Errors: every failure in moetron is a moetron::Error whose message names where it came
// from (a file and field, or an op) and what was expected. Callers at the CLI boundary print
// the message and exit non-zero; nothing inside the library calls exit() or abort().
#pragma once

#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace moetron {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// An Error in what the user handed over (a file, a directory), found before any work: the CLI exits
// 2 for it (1 for other errors), as for a usage error.
class InputError : public Error {
 public:
  explicit InputError(const std::string& what) : Error(what) {}
};

// Throws Error with a formatted message: fail("{}: header length {} exceeds file size {}", path, n, size).
template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace moetron

// Internal invariant check for programming errors (not user input): names the source location.
#define MOETRON_ASSERT(cond)                                                                  \
  do {                                                                                        \
    if (!(cond)) ::moetron::fail("internal error at {}:{}: assertion '{}' failed", __FILE__, \
                                 __LINE__, #cond);                                            \
  } while (0)

// Check for an op's preconditions; the message starts with the op's name: "[rmsnorm_forward] ...".
#define MOETRON_OP_CHECK(cond, op, ...)                                  \
  do {                                                                   \
    if (!(cond)) ::moetron::fail("[{}] {}", op, fmt::format(__VA_ARGS__)); \
  } while (0)
