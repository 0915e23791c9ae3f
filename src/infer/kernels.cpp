// Decoding kernels; see kernels.h.  GCC vector extensions (8 floats) with several independent
// accumulators so the FMA latency is hidden; each output row is computed by one thread in a fixed
// order, so results do not depend on the thread count.
#include "infer/kernels.h"

#include <cstring>

#include "core/dtype.h"
#include "core/error.h"

namespace moetron::infer {

namespace {

typedef float v8f __attribute__((vector_size(32)));
// By reference, never by value: a vector-typed argument changes the ABI without AVX.
inline void ld(v8f& r, const float* p) { std::memcpy(&r, p, sizeof(r)); }
inline float hsum(const v8f& v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// Weights are fp32, or bf16 (the top half of an fp32, so widening is exact): the same arithmetic on
// the same values either way, from half the bytes.  Rows are streamed one after another (contiguous
// memory, which the hardware prefetchers follow best), 64 columns per step into four 16-float
// accumulators.
typedef float v16f __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));
inline void ld16(v16f& r, const float* p) { std::memcpy(&r, p, sizeof(r)); }
inline void ldw16(v16f& r, const float* p) { ld16(r, p); }
inline void ldw16(v16f& r, const uint16_t* p) {
  v16h h;
  std::memcpy(&h, p, sizeof(h));
  const v16u w = __builtin_convertvector(h, v16u) << 16;
  std::memcpy(&r, &w, sizeof(r));
}
inline float wval(float v) { return v; }
inline float wval(uint16_t h) { return bf16_to_f32(h); }
inline float hsum16(const v16f& v) {
  float t[16];
  std::memcpy(t, &v, sizeof(t));
  float s8[8];
  for (int i = 0; i < 8; i++) s8[i] = t[i] + t[i + 8];
  return ((s8[0] + s8[4]) + (s8[1] + s8[5])) + ((s8[2] + s8[6]) + (s8[3] + s8[7]));
}

template <class WT>
inline float row_dot(const WT* w, const float* x, int IC) {
  v16f a0 = {}, a1 = {}, a2 = {}, a3 = {};
  int c = 0;
  for (; c + 64 <= IC; c += 64) {
    v16f x0, x1, x2, x3, w0, w1, w2, w3;
    ld16(x0, x + c);
    ld16(x1, x + c + 16);
    ld16(x2, x + c + 32);
    ld16(x3, x + c + 48);
    ldw16(w0, w + c);
    ldw16(w1, w + c + 16);
    ldw16(w2, w + c + 32);
    ldw16(w3, w + c + 48);
    a0 += w0 * x0;
    a1 += w1 * x1;
    a2 += w2 * x2;
    a3 += w3 * x3;
  }
  for (; c + 16 <= IC; c += 16) {
    v16f x0, w0;
    ld16(x0, x + c);
    ldw16(w0, w + c);
    a0 += w0 * x0;
  }
  float s = hsum16((a0 + a1) + (a2 + a3));
  for (; c < IC; c++) s += wval(w[c]) * x[c];
  return s;
}

// Rows [r0, r1) of one product.
template <class WT>
inline void rows(float* y, const WT* W, const float* x, int r0, int r1, int IC, bool acc) {
  for (int r = r0; r < r1; r++) {
    const float s = row_dot(W + (long)r * IC, x, IC);
    y[r] = acc ? y[r] + s : s;
  }
}

inline void task_rows(const GemvTask& k, int r0, int r1, int IC) {
  if (k.Wh)
    rows(k.y, k.Wh, k.x, r0, r1, IC, k.accumulate);
  else
    rows(k.y, k.W, k.x, r0, r1, IC, k.accumulate);
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
  const GemvTask t{y, W, nullptr, x, OC, accumulate};
  gemv_batch(&t, 1, IC);
}

void gemv_bf16(float* y, const uint16_t* W, const float* x, int OC, int IC, bool accumulate) {
  const GemvTask t{y, nullptr, W, x, OC, accumulate};
  gemv_batch(&t, 1, IC);
}

void gemv_batch(const GemvTask* tasks, int n_tasks, int IC, long parallel_min_macs) {
  constexpr int kMaxTasks = 16;
  MOETRON_ASSERT(n_tasks >= 0 && n_tasks <= kMaxTasks);
  int first_block[kMaxTasks + 1];  // blocks of 64 rows, numbered across the tasks
  long macs = 0;
  first_block[0] = 0;
  for (int t = 0; t < n_tasks; t++) {
    first_block[t + 1] = first_block[t] + (tasks[t].OC + 63) / 64;
    macs += (long)tasks[t].OC * IC;
  }
#pragma omp parallel for schedule(static) if (macs >= parallel_min_macs)
  for (int b = 0; b < first_block[n_tasks]; b++) {
    int t = 0;
    while (b >= first_block[t + 1]) t++;
    const GemvTask& k = tasks[t];
    const int r0 = (b - first_block[t]) * 64, r1 = r0 + 64 < k.OC ? r0 + 64 : k.OC;
    task_rows(k, r0, r1, IC);
  }
}

void gemv3(float* ya, const float* Wa, int OCa, float* yb, const float* Wb, int OCb, float* yc, const float* Wc,
           int OCc, const float* x, int IC) {
  const GemvTask tasks[3] = {{ya, Wa, nullptr, x, OCa}, {yb, Wb, nullptr, x, OCb}, {yc, Wc, nullptr, x, OCc}};
  gemv_batch(tasks, 3, IC);
}

}  // namespace moetron::infer
