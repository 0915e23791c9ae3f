// Thread counts from the command line (--threads, --http-threads): bounded, so that a typo such as
// `--threads 1000` on a 2-core machine is an error naming the option, not a run that oversubscribes
// the cores until it never finishes.
#pragma once

namespace moetron::cli {

// The most compute threads --threads accepts: 4 x the hardware threads (at least 4).
int max_compute_threads();

// Error "OPTION N: ..." unless 0 <= n <= max (0 is each option's default).  max <= 0: max_compute_threads().
void check_thread_count(const char* option, long long n, long long max = 0);

}  // namespace moetron::cli
