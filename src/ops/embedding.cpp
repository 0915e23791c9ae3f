// Token embedding lookup.  N tokens, C hidden, V vocab.
// Parameter gradients accumulate (+=).
#include "ops/embedding.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace moetron::ops {

namespace {

// Below this many elements a parallel region costs more than it saves.
constexpr long kParallelMin = 1 << 15;

// Checks every id outside any parallel region (an exception must not escape an OpenMP region).
void check_tokens(const char* op, const int32_t* tokens, long N, int V) {
  for (long n = 0; n < N; n++) {
    const int32_t id = tokens[n];
    MOETRON_OP_CHECK(id >= 0 && id < V, op, "token id {} at position {} is outside the vocabulary [0, {})", id, n, V);
  }
}

}  // namespace

void embedding_forward(float* out, const int32_t* tokens, const float* wte, long N, int C, int V) {
  MOETRON_OP_CHECK(N >= 0 && C > 0 && V > 0, "embedding_forward", "bad dimensions N={} C={} V={}", N, C, V);
  check_tokens("embedding_forward", tokens, N, V);
#pragma omp parallel for schedule(static) if (N * C >= kParallelMin)
  for (long n = 0; n < N; n++) {
    std::memcpy(out + n * C, wte + (long)tokens[n] * C, sizeof(float) * C);
  }
}

void embedding_backward(float* dwte, const float* dout, const int32_t* tokens, long N, int C, int V) {
  MOETRON_OP_CHECK(N >= 0 && C > 0 && V > 0, "embedding_backward", "bad dimensions N={} C={} V={}", N, C, V);
  check_tokens("embedding_backward", tokens, N, V);
  // Parallel over column chunks: each dwte element is owned by one thread and receives its
  // contributions in token order, so the result is bitwise independent of the thread count.
  constexpr int CHUNK = 64;
  const int nchunks = (C + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static) if (N * C >= kParallelMin)
  for (int ch = 0; ch < nchunks; ch++) {
    const int c0 = ch * CHUNK;
    const int c1 = std::min(C, c0 + CHUNK);
    for (long n = 0; n < N; n++) {
      float* dst = dwte + (long)tokens[n] * C;
      const float* src = dout + n * C;
      for (int c = c0; c < c1; c++) dst[c] += src[c];
    }
  }
}

}  // namespace moetron::ops
