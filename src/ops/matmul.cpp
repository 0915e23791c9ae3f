#include "ops/matmul.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include "core/rng.h"
#include "ops/blas.h"

namespace moetron::ops {

void sgemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
           const float* B, int ldb, float beta, float* C, int ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    for (int i = 0; i < M; i++)
      for (int j = 0; j < N; j++) C[(long)i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[(long)i * ldc + j];
    return;
  }
  blas_sgemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void matmul_forward(float* out, const float* inp, const float* weight, int N, int IC, int OC) {
  sgemm(false, true, N, OC, IC, 1.0f, inp, IC, weight, IC, 0.0f, out, OC);
}

void matmul_forward_accumulate(float* out, const float* inp, const float* weight, int N, int IC,
                               int OC) {
  sgemm(false, true, N, OC, IC, 1.0f, inp, IC, weight, IC, 1.0f, out, OC);
}

void matmul_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                     const float* weight, int N, int IC, int OC) {
  if (dinp) sgemm(false, false, N, IC, OC, 1.0f, dout, OC, weight, IC, 0.0f, dinp, IC);
  if (dweight && N > 0) sgemm(true, false, OC, IC, N, 1.0f, dout, OC, inp, IC, 1.0f, dweight, IC);
}

}  // namespace moetron::ops

namespace moetron::ops {

double measure_sgemm_gflops(int n, int reps) {
  std::vector<float> a((size_t)n * n), b((size_t)n * n), c((size_t)n * n);
  for (size_t i = 0; i < a.size(); i++) {
    a[i] = (float)normal_at(1, 2, i);
    b[i] = (float)normal_at(1, 3, i);
  }
  double best = 0.0;
  for (int rep = 0; rep <= reps; rep++) {
    const auto t0 = std::chrono::steady_clock::now();
    sgemm(false, true, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rep > 0) best = std::max(best, 2.0 * n * (double)n * n / s / 1e9);
  }
  return best;
}

}  // namespace moetron::ops
