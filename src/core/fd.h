// POSIX file descriptors: closing on scope exit, and errno as text for messages.
#pragma once

#include <unistd.h>

#include <string>
#include <system_error>

namespace moetron {

// Closes `fd` (when >= 0) on scope exit.
struct Fd {
  int fd = -1;
  Fd() = default;
  explicit Fd(int f) : fd(f) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// strerror's text for an errno value (thread-safe).
inline std::string errno_text(int err) { return std::generic_category().message(err); }

}  // namespace moetron
