#include "ops/swiglu.h"

#include <cmath>

namespace moetron::ops {

void swiglu_forward(float* out, const float* gate, const float* up, long N, int I) {
  const long n = N * I;
#pragma omp parallel for schedule(static) if (n >= 32768)
  for (long i = 0; i < n; i++) {
    const float g = gate[i];
    const float sig = 1.0f / (1.0f + std::exp(-g));
    out[i] = g * sig * up[i];
  }
}

void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate,
                     const float* up, long N, int I) {
  const long n = N * I;
#pragma omp parallel for schedule(static) if (n >= 32768)
  for (long i = 0; i < n; i++) {
    const float g = gate[i];
    const float sig = 1.0f / (1.0f + std::exp(-g));
    const float silu = g * sig;
    // d silu/dg = sig * (1 + g * (1 - sig))
    dgate[i] = dout[i] * up[i] * sig * (1.0f + g * (1.0f - sig));
    dup[i] = dout[i] * silu;
  }
}

}  // namespace moetron::ops
