#include "ops/sigmoid.h"

#include <cmath>

#include "core/error.h"

namespace moetron::ops {

void sigmoid_forward(float* s, const float* x, long n) {
  MOETRON_OP_CHECK(n >= 0, "sigmoid_forward", "bad count {}", n);
  // Evaluated in double and rounded once: no overflow of exp(-x) for very negative x either way.
  for (long i = 0; i < n; i++) s[i] = (float)(1.0 / (1.0 + std::exp(-(double)x[i])));
}

void sigmoid_backward(float* dx, const float* ds, const float* s, long n) {
  MOETRON_OP_CHECK(n >= 0, "sigmoid_backward", "bad count {}", n);
  for (long i = 0; i < n; i++) dx[i] = (float)((double)ds[i] * (double)s[i] * (1.0 - (double)s[i]));
}

}  // namespace moetron::ops
