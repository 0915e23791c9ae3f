// Row softmax in fp32, the one the router and inference attention share: p = exp(x - max x) / sum,
// the sum of the exponentials accumulated in double and its inverse rounded once to fp32.
// (Training attention's forward keeps its own, mask-aware loop: ops/attention.cpp.)
#pragma once

namespace moetron::ops {

// In place over s[0..n), n >= 1 (=).  Subtracting the maximum first keeps large logits finite, and
// makes the result bitwise the same for x and x + c whenever x + c is exact.
void softmax_inplace(float* s, int n);

}  // namespace moetron::ops
