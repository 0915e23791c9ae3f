#include "ops/bias.h"

#include "core/error.h"

namespace moetron::ops {

namespace {
constexpr long kParallelMin = 1 << 15;
}

void bias_backward(float* dbias, const float* dout, long N, int C) {
  MOETRON_OP_CHECK(N >= 0 && C > 0, "bias_backward", "bad dimensions N={} C={}", N, C);
#pragma omp parallel for schedule(static) if (N * C >= kParallelMin)
  for (int c = 0; c < C; c++) {
    double s = 0.0;
    for (long n = 0; n < N; n++) s += (double)dout[n * C + c];
    dbias[c] += (float)s;
  }
}

}  // namespace moetron::ops
