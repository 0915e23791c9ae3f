// The AVX2 kernels of attention over a cache (attention_rows_impl.h): several keys' dot products at
// once, and weighted sums of value rows in independent fma chains -- the operations of the portable
// code (attention_rows.cpp), so the same bits.
#include <cmath>

#include "backend/kernels/attention_rows_impl.h"

namespace moetron::kernels {

namespace {

MOETRON_AVX2 inline float dot_finish(__m256 acc, const float* a, const float* b, int i, int n) {
  const __m128 t = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));  // l0+l4, l1+l5, ...
  const __m128 u = _mm_hadd_ps(t, t);  // (l0+l4)+(l1+l5), (l2+l6)+(l3+l7)
  float s = _mm_cvtss_f32(u) + _mm_cvtss_f32(_mm_shuffle_ps(u, u, 1));
  for (; i < n; i++) s = std::fma(a[i], b[i], s);
  return s;
}

// dot_finish for eight keys' accumulators at once, when n is a multiple of 8 (no tail): the same
// additions, lane-parallel -- t = lo + hi per key (permute2f128 pairs the keys' halves), u = hadd(t),
// s = u0 + u1 (the second hadd) -- then the keys put back in order and scaled, as dot_finish * scale.
MOETRON_AVX2 inline __m256 finish8(const __m256* a, float scale) {
  __m256 t[4];
  for (int p = 0; p < 4; p++)
    t[p] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x20),
                         _mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x31));  // t(a_2p) | t(a_2p+1)
  const __m256 h0 = _mm256_hadd_ps(t[0], t[1]);  // u(a0), u(a2) | u(a1), u(a3)
  const __m256 h1 = _mm256_hadd_ps(t[2], t[3]);  // u(a4), u(a6) | u(a5), u(a7)
  const __m256 s = _mm256_hadd_ps(h0, h1);       // s(a0), s(a2), s(a4), s(a6) | s(a1), s(a3), s(a5), s(a7)
  return _mm256_mul_ps(_mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)), _mm256_set1_ps(scale));
}

}  // namespace

// s[j] = scale * dot(q, k + j * ld) for j < count: eight keys at a time where n has no tail (a head's
// 64 or 128 values: the horizontal sums, one per key, were most of the work), then four, then one.
MOETRON_AVX2 void dot_rows_avx2(float* s, const float* q, const float* k, size_t ld, int count, int n, float scale) {
  const int n8 = n & ~7;
  int j = 0;
  if (n8 == n)
    for (; j + 8 <= count; j += 8) {
      const float* k0 = k + (size_t)j * ld;
      __m256 a[8];
      for (int t = 0; t < 8; t++) a[t] = _mm256_setzero_ps();
      for (int i = 0; i < n8; i += 8) {
        const __m256 x = _mm256_loadu_ps(q + i);
        for (int t = 0; t < 8; t++) a[t] = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + (size_t)t * ld + i), a[t]);
      }
      _mm256_storeu_ps(s + j, finish8(a, scale));
    }
  for (; j + 4 <= count; j += 4) {
    const float* k0 = k + (size_t)j * ld;
    const float *k1 = k0 + ld, *k2 = k1 + ld, *k3 = k2 + ld;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int i = 0; i < n8; i += 8) {
      const __m256 x = _mm256_loadu_ps(q + i);
      a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + i), a0);
      a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k1 + i), a1);
      a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k2 + i), a2);
      a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k3 + i), a3);
    }
    s[j] = dot_finish(a0, q, k0, n8, n) * scale;
    s[j + 1] = dot_finish(a1, q, k1, n8, n) * scale;
    s[j + 2] = dot_finish(a2, q, k2, n8, n) * scale;
    s[j + 3] = dot_finish(a3, q, k3, n8, n) * scale;
  }
  for (; j < count; j++) {
    const float* kj = k + (size_t)j * ld;
    __m256 a0 = _mm256_setzero_ps();
    for (int i = 0; i < n8; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(kj + i), a0);
    s[j] = dot_finish(a0, q, kj, n8, n) * scale;
  }
}

namespace {

// o[c, c + 8M) += sum_j w[j] (v + j * ld)[c, c + 8M), j in order, o held in M registers: M independent
// fma chains per key, so the keys go at the FMA units' rate rather than one chain's latency.
template <int M>
MOETRON_AVX2 inline void axpy_block_avx2(float* o, const float* w, const float* v, size_t ld, int count) {
  __m256 r[M];
  for (int t = 0; t < M; t++) r[t] = _mm256_loadu_ps(o + 8 * t);
  for (int j = 0; j < count; j++) {
    const __m256 wj = _mm256_set1_ps(w[j]);
    const float* vj = v + (size_t)j * ld;
    for (int t = 0; t < M; t++) r[t] = _mm256_fmadd_ps(wj, _mm256_loadu_ps(vj + 8 * t), r[t]);
  }
  for (int t = 0; t < M; t++) _mm256_storeu_ps(o + 8 * t, r[t]);
}

}  // namespace

// o[n] += sum_j w[j] (v + j * ld), j in order: 64 values at a time, then the rest of the multiples of 8
// in one pass (a head of 32 values: 4 chains, not 4 passes of one; prefill attention of the small
// model, one thread, 2-core Zen 4 EPYC VM: 1.45 -> 1.28 ms a prefill of 128 tokens), then a scalar tail.
MOETRON_AVX2 void axpy_rows_avx2(float* o, const float* w, const float* v, size_t ld, int count, int n) {
  using Block = void (*)(float*, const float*, const float*, size_t, int);
  static constexpr Block kBlocks[8] = {nullptr,           axpy_block_avx2<1>, axpy_block_avx2<2>, axpy_block_avx2<3>,
                                       axpy_block_avx2<4>, axpy_block_avx2<5>, axpy_block_avx2<6>, axpy_block_avx2<7>};
  int c = 0;
  for (; c + 64 <= n; c += 64) axpy_block_avx2<8>(o + c, w, v + c, ld, count);
  if ((n - c) / 8 > 0) kBlocks[(n - c) / 8](o + c, w, v + c, ld, count);
  c += (n - c) / 8 * 8;
  for (; c < n; c++)
    for (int j = 0; j < count; j++) o[c] = std::fma(w[j], v[(size_t)j * ld + c], o[c]);
}

namespace {

// axpy_rows for two outputs over the same rows v (two heads of one kv head): o0 += sum_j w0[j] v_j and
// o1 += sum_j w1[j] v_j, each value's fmas in key order, bitwise the two calls; each v_j load serves
// both, and the chains of the two run side by side, 32 values (8 chains) at a time.
template <int M>
MOETRON_AVX2 inline void axpy2_block_avx2(float* o0, float* o1, const float* w0, const float* w1, const float* v,
                                          size_t ld, int count) {
  __m256 r0[M], r1[M];
  for (int t = 0; t < M; t++) {
    r0[t] = _mm256_loadu_ps(o0 + 8 * t);
    r1[t] = _mm256_loadu_ps(o1 + 8 * t);
  }
  for (int j = 0; j < count; j++) {
    const __m256 a = _mm256_set1_ps(w0[j]), b = _mm256_set1_ps(w1[j]);
    const float* vj = v + (size_t)j * ld;
    for (int t = 0; t < M; t++) {
      const __m256 x = _mm256_loadu_ps(vj + 8 * t);
      r0[t] = _mm256_fmadd_ps(a, x, r0[t]);
      r1[t] = _mm256_fmadd_ps(b, x, r1[t]);
    }
  }
  for (int t = 0; t < M; t++) {
    _mm256_storeu_ps(o0 + 8 * t, r0[t]);
    _mm256_storeu_ps(o1 + 8 * t, r1[t]);
  }
}

}  // namespace

MOETRON_AVX2 void axpy_rows2_avx2(float* o0, float* o1, const float* w0, const float* w1, const float* v, size_t ld,
                                  int count, int n) {
  using Block = void (*)(float*, float*, const float*, const float*, const float*, size_t, int);
  static constexpr Block kBlocks[4] = {nullptr, axpy2_block_avx2<1>, axpy2_block_avx2<2>, axpy2_block_avx2<3>};
  int c = 0;
  for (; c + 32 <= n; c += 32) axpy2_block_avx2<4>(o0 + c, o1 + c, w0, w1, v + c, ld, count);
  if ((n - c) / 8 > 0) kBlocks[(n - c) / 8](o0 + c, o1 + c, w0, w1, v + c, ld, count);
  c += (n - c) / 8 * 8;
  for (; c < n; c++)
    for (int j = 0; j < count; j++) {
      o0[c] = std::fma(w0[j], v[(size_t)j * ld + c], o0[c]);
      o1[c] = std::fma(w1[j], v[(size_t)j * ld + c], o1[c]);
    }
}

}  // namespace moetron::kernels
