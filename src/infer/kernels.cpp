// Decoding kernels; see kernels.h.  GCC vector extensions (8 floats) with several independent
// accumulators so the FMA latency is hidden; each output row is computed by one thread in a fixed
// order, so results do not depend on the thread count.
#include "infer/kernels.h"

#include <cstring>

#include "core/error.h"

namespace moetron::infer {

namespace {

typedef float v8f __attribute__((vector_size(32)));
// By reference, never by value: a vector-typed argument changes the ABI without AVX.
inline void ld(v8f& r, const float* p) { std::memcpy(&r, p, sizeof(r)); }
inline float hsum(const v8f& v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// Multiply-adds below which a product runs on one thread: 1M (4 MiB of fp32 weights, ~0.4 ms of one
// core's memory bandwidth).  A fork/join costs microseconds on an idle machine but up to a scheduler
// time slice when the cores are shared with other processes, so decoding (one product after another,
// a few dozen per token) only splits the products where the saving is large either way.
constexpr long kParallelMin = 1L << 20;
constexpr int RB = 4;                     // rows per block

// y[r] (=, or += when acc) for RB consecutive rows of W starting at `w`.
inline void rows4(float* y, const float* w, const float* x, int IC, bool acc) {
  v8f a[RB][2] = {};
  int c = 0;
  for (; c + 16 <= IC; c += 16) {
    v8f x0, x1;
    ld(x0, x + c);
    ld(x1, x + c + 8);
    for (int r = 0; r < RB; r++) {
      v8f w0, w1;
      ld(w0, w + (long)r * IC + c);
      ld(w1, w + (long)r * IC + c + 8);
      a[r][0] += w0 * x0;
      a[r][1] += w1 * x1;
    }
  }
  for (int r = 0; r < RB; r++) {
    float s = hsum(a[r][0] + a[r][1]);
    for (int cc = c; cc < IC; cc++) s += w[(long)r * IC + cc] * x[cc];
    y[r] = acc ? y[r] + s : s;
  }
}

inline void row1(float* y, const float* w, const float* x, int IC, bool acc) {
  const float s = dot(w, x, IC);
  *y = acc ? *y + s : s;
}

// Rows [r0, r1) of one product.
inline void rows(float* y, const float* W, const float* x, int r0, int r1, int IC, bool acc) {
  int r = r0;
  for (; r + RB <= r1; r += RB) rows4(y + r, W + (long)r * IC, x, IC, acc);
  for (; r < r1; r++) row1(y + r, W + (long)r * IC, x, IC, acc);
}

}  // namespace

float dot(const float* a, const float* b, int n) {
  v8f s0 = {}, s1 = {}, s2 = {}, s3 = {};
  int i = 0;
  for (; i + 32 <= n; i += 32) {
    v8f a0, a1, a2, a3, b0, b1, b2, b3;
    ld(a0, a + i);
    ld(a1, a + i + 8);
    ld(a2, a + i + 16);
    ld(a3, a + i + 24);
    ld(b0, b + i);
    ld(b1, b + i + 8);
    ld(b2, b + i + 16);
    ld(b3, b + i + 24);
    s0 += a0 * b0;
    s1 += a1 * b1;
    s2 += a2 * b2;
    s3 += a3 * b3;
  }
  for (; i + 8 <= n; i += 8) {
    v8f a0, b0;
    ld(a0, a + i);
    ld(b0, b + i);
    s0 += a0 * b0;
  }
  float s = hsum((s0 + s1) + (s2 + s3));
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}

void axpy(float* y, float alpha, const float* x, int n) {
  for (int i = 0; i < n; i++) y[i] += alpha * x[i];
}

void gemv(float* y, const float* W, const float* x, int OC, int IC, bool accumulate) {
  const int blocks = (OC + 63) / 64;  // 64-row work items
#pragma omp parallel for schedule(static) if ((long)OC * IC >= kParallelMin)
  for (int b = 0; b < blocks; b++) {
    const int r0 = b * 64, r1 = r0 + 64 < OC ? r0 + 64 : OC;
    rows(y, W, x, r0, r1, IC, accumulate);
  }
}

void gemv_batch(const GemvTask* tasks, int n_tasks, int IC) {
  constexpr int kMaxTasks = 16;
  MOETRON_ASSERT(n_tasks >= 0 && n_tasks <= kMaxTasks);
  int first_block[kMaxTasks + 1];  // blocks of 64 rows, numbered across the tasks
  long macs = 0;
  first_block[0] = 0;
  for (int t = 0; t < n_tasks; t++) {
    first_block[t + 1] = first_block[t] + (tasks[t].OC + 63) / 64;
    macs += (long)tasks[t].OC * IC;
  }
#pragma omp parallel for schedule(static) if (macs >= kParallelMin)
  for (int b = 0; b < first_block[n_tasks]; b++) {
    int t = 0;
    while (b >= first_block[t + 1]) t++;
    const GemvTask& k = tasks[t];
    const int r0 = (b - first_block[t]) * 64, r1 = r0 + 64 < k.OC ? r0 + 64 : k.OC;
    rows(k.y, k.W, k.x, r0, r1, IC, k.accumulate);
  }
}

void gemv3(float* ya, const float* Wa, int OCa, float* yb, const float* Wb, int OCb, float* yc, const float* Wc,
           int OCc, const float* x, int IC) {
  const GemvTask tasks[3] = {{ya, Wa, x, OCa}, {yb, Wb, x, OCb}, {yc, Wc, x, OCc}};
  gemv_batch(tasks, 3, IC);
}

}  // namespace moetron::infer
