// Row softmax in fp32, the one the router and inference attention share: p = e^(x - max x) / sum,
// e^ by exp_nonpositive (ops/exp.h: relative error < 2^-23), the sum of the exponentials accumulated
// in double and its inverse rounded once to fp32.  (Training attention's forward keeps its own, mask-aware
// loop: ops/attention.cpp.)
#pragma once

#include <cstddef>

#include "ops/exp.h"

namespace moetron::ops {

// In place over s[0..n), n >= 1 (=): max, then s[j] = exp_nonpositive(s[j] - max), sum (double, in
// order), then s[j] *= (float)(1 / sum).  Subtracting the maximum first keeps large logits finite,
// and makes the result bitwise the same for x and x + c whenever x + c is exact.
void softmax_inplace(float* s, int n);

// softmax_inplace on each of `rows` rows of n values (row r at s + r * ld), bitwise what it gives each
// row alone: the rows' in-order chains (the max, the double sum: a value's latency each) run side by
// side, 4 rows at a time (a prompt's attention: a row's heads of one kv head).
void softmax_rows(float* s, int rows, int n, size_t ld);

}  // namespace moetron::ops
