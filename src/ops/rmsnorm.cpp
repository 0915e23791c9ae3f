// RMSNorm as in HF MixtralRMSNorm.  N rows, C features.
//   forward: rstd = 1/sqrt(mean(x^2) + eps) (fp32, as HF), out = weight * (x * rstd).
// Parameter gradients accumulate (+=); activation gradients assign (=).
#include "ops/rmsnorm.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace moetron::ops {

namespace {
// Below this many elements a parallel region costs more than it saves.
constexpr long kParallelMin = 1 << 15;

// dweight_c += sum_n dy[n,c] * (x[n,c] * r[n]).  Parallel over column chunks, rows summed in order
// within each chunk: deterministic for any thread count.
void accumulate_dweight(float* dweight, const float* dout, const float* inp, const float* rstd, long N, int C) {
  if (dweight == nullptr) return;  // a frozen weight
  constexpr int CHUNK = 64;
  const int nchunks = (C + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static) if (N * C >= kParallelMin)
  for (int ch = 0; ch < nchunks; ch++) {
    const int c0 = ch * CHUNK;
    const int w = std::min(C, c0 + CHUNK) - c0;
    double acc[CHUNK] = {};
    for (long n = 0; n < N; n++) {
      const float* x = inp + n * C + c0;
      const float* dy = dout + n * C + c0;
      const float r = rstd[n];
      for (int c = 0; c < w; c++) acc[c] += (double)dy[c] * (double)(x[c] * r);
    }
    for (int c = 0; c < w; c++) dweight[c0 + c] += (float)acc[c];
  }
}

}  // namespace

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, long N, int C, float eps) {
  MOETRON_OP_CHECK(N >= 0 && C > 0, "rmsnorm_forward", "bad dimensions N={} C={}", N, C);
#pragma omp parallel for schedule(static) if (N * C >= kParallelMin)
  for (long n = 0; n < N; n++) {
    const float* x = inp + n * C;
    float* y = out + n * C;
    double ss = 0.0;
    for (int c = 0; c < C; c++) ss += (double)x[c] * (double)x[c];
    const float var = (float)(ss / C);
    const float r = (float)(1.0 / std::sqrt((double)(var + eps)));
    rstd[n] = r;
    for (int c = 0; c < C; c++) y[c] = weight[c] * (x[c] * r);
  }
}

void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      const float* rstd, long N, int C) {
  MOETRON_OP_CHECK(N >= 0 && C > 0, "rmsnorm_backward", "bad dimensions N={} C={}", N, C);
  // dinp: y_i = w_i x_i r with r = (mean(x^2) + eps)^(-1/2), dr/dx_i = -r^3 x_i / C, so
  //   dx_i = r w_i dy_i - (r^3 / C) x_i sum_j w_j dy_j x_j.
#pragma omp parallel for schedule(static) if (N * C >= kParallelMin)
  for (long n = 0; n < N; n++) {
    const float* x = inp + n * C;
    const float* dy = dout + n * C;
    float* dx = dinp + n * C;
    const float r = rstd[n];
    double dot = 0.0;
    for (int c = 0; c < C; c++) dot += (double)weight[c] * (double)dy[c] * (double)x[c];
    const float coef = (float)((double)r * r * r * dot / C);
    for (int c = 0; c < C; c++) dx[c] = r * weight[c] * dy[c] - coef * x[c];
  }
  accumulate_dweight(dweight, dout, inp, rstd, N, C);
}

void row_dot(float* out, const float* a, const float* b, const float* w, long N, int C) {
  MOETRON_OP_CHECK(N >= 0 && C > 0, "row_dot", "bad dimensions N={} C={}", N, C);
#pragma omp parallel for schedule(static) if (N * C >= kParallelMin)
  for (long n = 0; n < N; n++) {
    double s = 0.0;
    for (int c = 0; c < C; c++) s += (w ? (double)w[c] : 1.0) * (double)a[n * C + c] * (double)b[n * C + c];
    out[n] = (float)s;
  }
}

void rmsnorm_forward_stats(float* out, float* rstd, const float* inp, const float* weight, const float* ss, long N,
                           int C, int width, float ss_scale, float eps) {
  MOETRON_OP_CHECK(N >= 0 && C > 0 && width >= C, "rmsnorm_forward_stats", "bad dimensions N={} C={} width={}", N, C,
                   width);
#pragma omp parallel for schedule(static) if (N * C >= kParallelMin)
  for (long n = 0; n < N; n++) {
    const float var = (float)((double)ss[n] * ss_scale / width);
    const float r = (float)(1.0 / std::sqrt((double)(var + eps)));
    rstd[n] = r;
    for (int c = 0; c < C; c++) out[n * C + c] = weight[c] * (inp[n * C + c] * r);
  }
}

void rmsnorm_backward_stats(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                            const float* rstd, const float* dot, long N, int C, int width, float dot_scale) {
  MOETRON_OP_CHECK(N >= 0 && C > 0 && width >= C, "rmsnorm_backward_stats", "bad dimensions N={} C={} width={}", N,
                   C, width);
#pragma omp parallel for schedule(static) if (N * C >= kParallelMin)
  for (long n = 0; n < N; n++) {
    const float r = rstd[n];
    const float coef = (float)((double)r * r * r * ((double)dot[n] * dot_scale) / width);
    for (int c = 0; c < C; c++) dinp[n * C + c] = r * weight[c] * dout[n * C + c] - coef * inp[n * C + c];
  }
  accumulate_dweight(dweight, dout, inp, rstd, N, C);
}

}  // namespace moetron::ops
