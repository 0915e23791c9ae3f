// Vocabulary-parallel embedding and cross-entropy; see tp_ops.h.  The cross-entropy mirrors
// ops::cross_entropy_forward's arithmetic (fp32 exp of (logit - max), summed in double) so a
// tensor-parallel run differs from one process only by the order of the exp sums.
#include "dist/tp_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "ops/cross_entropy.h"

namespace moetron::dist {

namespace {
constexpr long kParallelMin = 1 << 15;
}

void embedding_forward_vocab_parallel(float* out, const int32_t* tokens, const float* wte_local, long N, int C,
                                      int64_t V0, int64_t Vr) {
#pragma omp parallel for schedule(static) if (N * C >= kParallelMin)
  for (long n = 0; n < N; n++) {
    const int64_t row = (int64_t)tokens[n] - V0;
    if (row >= 0 && row < Vr)
      std::memcpy(out + n * C, wte_local + row * C, sizeof(float) * C);
    else
      std::memset(out + n * C, 0, sizeof(float) * C);
  }
}

void embedding_backward_vocab_parallel(float* dwte_local, const float* dout, const int32_t* tokens, long N, int C,
                                       int64_t V0, int64_t Vr) {
  constexpr int CHUNK = 64;
  const int nchunks = (C + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static) if (N * C >= kParallelMin)
  for (int ch = 0; ch < nchunks; ch++) {
    const int c0 = ch * CHUNK, c1 = std::min(C, c0 + CHUNK);
    for (long n = 0; n < N; n++) {
      const int64_t row = (int64_t)tokens[n] - V0;
      if (row < 0 || row >= Vr) continue;
      float* dst = dwte_local + row * C;
      const float* src = dout + n * C;
      for (int c = c0; c < c1; c++) dst[c] += src[c];
    }
  }
}

double cross_entropy_forward_vocab_parallel(float* lse, const float* logits_local, const int32_t* targets, long N,
                                            int64_t Vr, int64_t V0, float scale, Comm& tp) {
  // 1. The row maxima over the whole vocabulary.
  std::vector<float> mx(N);
#pragma omp parallel for schedule(static) if (N * Vr >= kParallelMin)
  for (long n = 0; n < N; n++) {
    const float* x = logits_local + n * Vr;
    float m = Vr > 0 ? x[0] : -INFINITY;
    for (int64_t v = 1; v < Vr; v++) m = x[v] > m ? x[v] : m;  // a NaN logit makes the loss NaN
    mx[n] = m;
  }
  tp.all_reduce(mx.data(), (size_t)N, ReduceOp::max);
  // 2. Sums of exp(x - max) and the target logits (only the rank holding the target has it).
  std::vector<double> sums(2 * N, 0.0);
#pragma omp parallel for schedule(static) if (N * Vr >= kParallelMin)
  for (long n = 0; n < N; n++) {
    const float* x = logits_local + n * Vr;
    const float m = mx[n];
    double s = 0.0;
    for (int64_t v = 0; v < Vr; v++) s += (double)std::exp(x[v] - m);
    sums[n] = s;
    const int64_t t = (int64_t)targets[n] - V0;
    if (targets[n] != ops::IGNORE_INDEX && t >= 0 && t < Vr) sums[N + n] = (double)x[t];
  }
  tp.all_reduce(sums.data(), sums.size(), ReduceOp::sum);
  double total = 0.0;
  for (long n = 0; n < N; n++) {
    const double l = (double)mx[n] + std::log(sums[n]);
    lse[n] = (float)l;
    if (targets[n] != ops::IGNORE_INDEX) total += l - sums[N + n];
  }
  return total * (double)scale;
}

void cross_entropy_backward_vocab_parallel(float* dlogits_local, const float* logits_local, const float* lse,
                                           const int32_t* targets, long N, int64_t Vr, int64_t V0, float scale) {
#pragma omp parallel for schedule(static) if (N * Vr >= kParallelMin)
  for (long n = 0; n < N; n++) {
    const float* x = logits_local + n * Vr;
    float* d = dlogits_local + n * Vr;
    if (targets[n] == ops::IGNORE_INDEX) {
      for (int64_t v = 0; v < Vr; v++) d[v] = 0.0f;
      continue;
    }
    const float l = lse[n];
    for (int64_t v = 0; v < Vr; v++) d[v] = scale * std::exp(x[v] - l);
    const int64_t t = (int64_t)targets[n] - V0;
    if (t >= 0 && t < Vr) d[t] -= scale;
  }
}

}  // namespace moetron::dist
