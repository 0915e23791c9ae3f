#include "ops/clamp.h"

#include "core/error.h"

namespace moetron::ops {

void clamp_forward(float* x, uint8_t* mask, float c, long n) {
  MOETRON_OP_CHECK(n >= 0 && c >= 0.0f, "clamp_forward", "bad count {} or bound {}", n, c);
#pragma omp parallel for schedule(static) if (n >= (1 << 16))
  for (long i = 0; i < n; i++) {
    const float v = x[i];
    const bool keep = v >= -c && v <= c;  // NaN: not kept, and stays NaN (as torch.clamp)
    mask[i] = keep ? 1 : 0;
    if (v > c) x[i] = c;
    else if (v < -c) x[i] = -c;
  }
}

void clamp_backward(float* dx, const uint8_t* mask, long n) {
  MOETRON_OP_CHECK(n >= 0, "clamp_backward", "bad count {}", n);
#pragma omp parallel for schedule(static) if (n >= (1 << 16))
  for (long i = 0; i < n; i++)
    if (!mask[i]) dx[i] = 0.0f;
}

}  // namespace moetron::ops
