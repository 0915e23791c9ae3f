// Attention over a KV cache, a query and a head at a time (attention_rows.h): the arithmetic every
// level does, the portable code and the dispatch to the AVX2 kernels (attention_rows_avx2.cpp).
#include "backend/kernels/attention_rows.h"

#include <immintrin.h>

#include <cmath>

#include "backend/kernels/attention_rows_impl.h"
#include "backend/kernels/simd.h"

namespace moetron::kernels {

namespace {

// ---- attention over a cache: dot products and weighted sums of short rows ---------------------------
//
// dot's arithmetic: lane k (k < 8) accumulates a[i] b[i] for i = k mod 8 by fma in i order, the lanes
// are summed as ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)), then the tail is added by fma in
// order.  axpy's: y[i] = fma(alpha, x[i], y[i]).  fma rounds once, so the portable code (std::fma)
// and the AVX2 code give the same bits; the AVX2 code runs several keys at once, as a head's 64-value
// rows are too short for one dot product to fill the FMA units.

float dot_generic(const float* a, const float* b, int n) {
  float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; k++) l[k] = std::fma(a[i + k], b[i + k], l[k]);
  float s = ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]));
  for (; i < n; i++) s = std::fma(a[i], b[i], s);
  return s;
}

}  // namespace

float dot(const float* a, const float* b, int n) {
  if (simd_level() == SimdLevel::generic) return dot_generic(a, b, n);
  float s;
  dot_rows_avx2(&s, a, b, 0, 1, n, 1.0f);
  return s;
}

void axpy(float* y, float alpha, const float* x, int n) {
  if (simd_level() == SimdLevel::generic) {
    for (int i = 0; i < n; i++) y[i] = std::fma(alpha, x[i], y[i]);
    return;
  }
  axpy_rows_avx2(y, &alpha, x, 0, 1, n);
}

// Into L2 (prefetcht1): attention's blocks of 16 cached rows are up to 32 KiB, an L1's worth (0.49B
// bf16 decode, one thread, 2-core Zen 4 EPYC VM, 3 alternating runs: attention 0.569 -> 0.524 ms a
// step; 8 sequences together 250.5 and 248.5 tokens/s).
void prefetch_rows(const float* p, size_t ld, int count, int n) {
  for (int j = 0; j < count; j++) {
    const char* r = reinterpret_cast<const char*>(p + (size_t)j * ld);
    for (size_t b = 0; b < sizeof(float) * (size_t)n; b += 64) _mm_prefetch(r + b, _MM_HINT_T1);
  }
}

void dot_rows(float* s, const float* q, const float* k, size_t ld, int count, int n, float scale) {
  if (simd_level() != SimdLevel::generic) return dot_rows_avx2(s, q, k, ld, count, n, scale);
  for (int j = 0; j < count; j++) s[j] = dot_generic(q, k + (size_t)j * ld, n) * scale;
}

void axpy_rows(float* o, const float* w, const float* v, size_t ld, int count, int n) {
  if (simd_level() != SimdLevel::generic) return axpy_rows_avx2(o, w, v, ld, count, n);
  for (int j = 0; j < count; j++) axpy(o, w[j], v + (size_t)j * ld, n);
}

void axpy_rows2(float* o0, float* o1, const float* w0, const float* w1, const float* v, size_t ld, int count, int n) {
  if (simd_level() != SimdLevel::generic) return axpy_rows2_avx2(o0, o1, w0, w1, v, ld, count, n);
  axpy_rows(o0, w0, v, ld, count, n);
  axpy_rows(o1, w1, v, ld, count, n);
}

}  // namespace moetron::kernels
