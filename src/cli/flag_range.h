// Numeric flags checked against their range with a message that names the flag and the range in
// plain integers (CLI11's PositiveNumber printed "not in range 0.000000 to 1.797...e308").
#pragma once

namespace moetron::cli {

// Error "FLAG N: expected an integer in [lo, hi]" unless lo <= n <= hi.
void check_flag_range(const char* flag, long long n, long long lo, long long hi);

}  // namespace moetron::cli
