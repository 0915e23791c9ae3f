#include "core/interrupt.h"

#include <csignal>

namespace moetron {

namespace {

// The one piece of process-wide state this needs: a handler can only talk to the program through a
// volatile sig_atomic_t (as train's stop signal does).
volatile std::sig_atomic_t g_signal = 0;

extern "C" void on_interrupt(int sig) {
  if (g_signal != 0) {  // the second one: end now
    ::signal(sig, SIG_DFL);
    ::raise(sig);
    return;
  }
  g_signal = sig;
}

}  // namespace

Interrupted::Interrupted(int signal)
    : Error(fmt::format("interrupted by {}; the files being written were removed",
                        signal == SIGINT ? "SIGINT (Ctrl-C)" : "SIGTERM")),
      signal_(signal) {}

SignalHandlerScope::SignalHandlerScope(void (*handler)(int)) {
  struct sigaction sa {};
  sa.sa_handler = handler;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, &old_int_);
  sigaction(SIGTERM, &sa, &old_term_);
}

SignalHandlerScope::~SignalHandlerScope() {
  sigaction(SIGINT, &old_int_, nullptr);
  sigaction(SIGTERM, &old_term_, nullptr);
}

InterruptScope::InterruptScope() : handlers_((g_signal = 0, on_interrupt)) {}

InterruptScope::~InterruptScope() { g_signal = 0; }

void check_interrupted() {
  if (const int sig = g_signal; sig != 0) throw Interrupted(sig);
}

}  // namespace moetron
