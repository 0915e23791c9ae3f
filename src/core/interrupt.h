// Ctrl-C (SIGINT) or SIGTERM during a command that writes files.  The handler only records the
// signal; the writers poll it between chunks (check_interrupted) and throw Interrupted, so the
// temporaries are removed by the same unwinding that removes them on any other error, and the
// command exits 128 + the signal.  A second signal ends the process at once (the default action),
// for a command busy somewhere that does not poll.
#pragma once

#include <signal.h>

#include "core/error.h"

namespace moetron {

class Interrupted : public Error {
 public:
  explicit Interrupted(int signal);
  int signal() const { return signal_; }

 private:
  int signal_;
};

// Installs the handlers for its lifetime (one scope at a time) and restores the previous ones.
class InterruptScope {
 public:
  InterruptScope();
  ~InterruptScope();
  InterruptScope(const InterruptScope&) = delete;
  InterruptScope& operator=(const InterruptScope&) = delete;

 private:
  struct sigaction old_int_ {}, old_term_{};
};

// Throws Interrupted when SIGINT or SIGTERM arrived while an InterruptScope is active; else nothing.
void check_interrupted();

}  // namespace moetron
