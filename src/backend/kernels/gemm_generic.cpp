// The prefill GEMM's portable code (gemm_impl.h): each output one fma chain over x's row and W's row
// in column order, x unpacked.
#include <cmath>

#include "backend/kernels/gemm_impl.h"

namespace moetron::kernels {

void gemm_generic(float* out, int ld_out, const float* x, int ld_x, const float* W, int ld_w, int n, int IC, int r0,
                  int R, float alpha, bool acc) {
  for (int r = 0; r < R; r++)
    for (int t = 0; t < n; t++) {
      const float* xr = x + (size_t)t * ld_x;
      const float* wr = W + (size_t)r * ld_w;
      float s = 0.0f;
      for (int k = 0; k < IC; k++) s = std::fma(xr[k], wr[k], s);
      float& o = out[(size_t)t * ld_out + r0 + r];
      o = acc ? o + alpha * s : alpha * s;
    }
}

void gemm_run_generic(float* out, int ld_out, const float* x, int ld_x, WeightRef W, int ld_w, int n, int IC, int OC,
                      float alpha, bool acc, std::vector<float>& scratch, bool parallel) {
  gemm_run<0>(out, ld_out, x, ld_x, W, ld_w, n, IC, OC, alpha, acc, scratch, parallel);
}

}  // namespace moetron::kernels
