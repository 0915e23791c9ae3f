#include "cli/threads.h"

#include <algorithm>
#include <thread>

#include "core/error.h"

namespace moetron::cli {

int max_compute_threads() { return 4 * std::max(1, (int)std::thread::hardware_concurrency()); }

void check_thread_count(const char* option, long long n, long long max) {
  const bool compute = max <= 0;
  if (compute) max = max_compute_threads();
  if (n < 0) fail("{} {}: expected a thread count >= 0 (0: the default)", option, n);
  if (n > max) {
    if (compute)
      fail("{} {}: at most {} (4 x the {} hardware threads of this machine); 0 or absent: all of them", option, n,
           max, max / 4);
    fail("{} {}: at most {}", option, n, max);
  }
}

}  // namespace moetron::cli
