// Sends Ctrl-C to a moetron command in the middle of its write: for the tests that check that a
// command interrupted while writing leaves no temporary behind (core/interrupt.h).
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace moetron::testing {

struct Interrupted {
  bool mid_write = false;  // `writing()` held when the signal was sent
  int exit_status = -1;    // the command's exit status (-1: it died of a signal)
};

// A random bf16 Mixtral of 0.1B parameters (208 MB) in `dir`, vocabulary 320 (the tiny tokenizers'):
// large enough that writing a copy of it takes long enough to be interrupted.  True on success.
inline bool make_model_to_interrupt(const std::string& dir) {
  return std::system((std::string(MOETRON_BINARY) + " bench checkpoint --make-model " + dir +
                      " --hidden 512 --layers 4 --experts 8 --intermediate 2048 --vocab 320 > /dev/null")
                         .c_str()) == 0;
}

// Starts `MOETRON_BINARY args...` (output to /dev/null), polls `writing()` every 200 us until it holds
// (at most 120 s, or until the command ends), sends SIGINT and waits for the command.
inline Interrupted interrupt_mid_write(const std::vector<std::string>& args, const std::function<bool()>& writing) {
  std::vector<std::string> argv_s = {MOETRON_BINARY};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (FILE* f = std::freopen("/dev/null", "w", stdout)) (void)f;
    if (FILE* f = std::freopen("/dev/null", "w", stderr)) (void)f;
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  Interrupted r;
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (std::chrono::steady_clock::now() < deadline) {
    if (::waitpid(pid, &status, WNOHANG) == pid) {  // finished before the write was seen
      r.exit_status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      return r;
    }
    if (writing()) {
      r.mid_write = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  ::kill(pid, SIGINT);
  ::waitpid(pid, &status, 0);
  r.exit_status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

}  // namespace moetron::testing
