// Small steps of an inference pass on one thread (backend/cpu_infer.h): below kThreadLimitMin
// multiply-adds (or elements) a step runs on the calling thread alone -- a fork/join may cost a
// scheduler time slice on a shared machine: at 16M, an earlier threshold, a small model's prefill ran
// almost all on one thread: 2 threads gave 5400 prompt tokens/s, at 2M 6860, on the 2-core VM with
// hidden 256.  The OpenMP regions inside the ops and the kernels follow omp_get_max_threads() at each
// call, which the limit sets for its scope.
#pragma once

#include <omp.h>

#include <optional>

namespace moetron {

constexpr long kThreadLimitMin = 1L << 21;

class ThreadLimit {
 public:
  explicit ThreadLimit(long work) : saved_(omp_get_max_threads()) {
    active_ = work < kThreadLimitMin && saved_ > 1;
    if (active_) omp_set_num_threads(1);
  }
  ~ThreadLimit() {
    if (active_) omp_set_num_threads(saved_);
  }
  ThreadLimit(const ThreadLimit&) = delete;
  ThreadLimit& operator=(const ThreadLimit&) = delete;

 private:
  int saved_;
  bool active_ = false;
};

// A ThreadLimit for a prompt's steps only: a decode pass's small steps keep the thread count (their ops'
// own thresholds run them on one thread), since changing it around every step made the next parallel
// region rebuild its team (2 threads, small model: q/k/v 0.030 -> 0.040 ms, attention 0.022 -> 0.029).
class PromptLimit {
 public:
  PromptLimit(bool decode, long work) {
    if (!decode) lim_.emplace(work);
  }

 private:
  std::optional<ThreadLimit> lim_;
};

}  // namespace moetron
