// Linear-layer biases (Qwen2-MoE's q/k/v projections): the forward adds bias[C] to every row
// (ops share the router's add_bias_rows); the backward is the column sum of the output gradient.
//   N rows, C features.
#pragma once

namespace moetron::ops {

// dbias[C] += sum over rows n of dout[n, c]  (accumulate: a parameter gradient).  Each column sums
// its rows in row order, so the result does not depend on the number of threads.
void bias_backward(float* dbias, const float* dout, long N, int C);

}  // namespace moetron::ops
