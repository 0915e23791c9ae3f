#include "cli/flag_range.h"

#include "core/error.h"

namespace moetron::cli {

void check_flag_range(const char* flag, long long n, long long lo, long long hi) {
  if (n < lo || n > hi) throw InputError(fmt::format("{} {}: expected an integer in [{}, {}]", flag, n, lo, hi));
}

}  // namespace moetron::cli
