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

// `handler` for SIGINT and SIGTERM for the scope's lifetime; the previous handlers come back after.
// (InterruptScope below, and train's stop signal, which finishes the step and saves instead.)
class SignalHandlerScope {
 public:
  explicit SignalHandlerScope(void (*handler)(int));
  ~SignalHandlerScope();
  SignalHandlerScope(const SignalHandlerScope&) = delete;
  SignalHandlerScope& operator=(const SignalHandlerScope&) = delete;

 private:
  struct sigaction old_int_ {}, old_term_{};
};

// Installs the recording handler for its lifetime (one scope at a time).
class InterruptScope {
 public:
  InterruptScope();
  ~InterruptScope();

 private:
  SignalHandlerScope handlers_;
};

// Throws Interrupted when SIGINT or SIGTERM arrived while an InterruptScope is active; else nothing.
void check_interrupted();

}  // namespace moetron
