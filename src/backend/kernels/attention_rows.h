// Attention over a KV cache on the CPU, one query and head at a time: a query's dot products with
// cached keys and the weighted sums of cached values, by the same operations at every SIMD level.
#pragma once

#include <cstddef>

namespace moetron::kernels {

// sum_i a[i] b[i], in eight fma lanes (lane k: i = k mod 8), then ((l0 + l4) + (l1 + l5)) + ((l2 + l6) +
// (l3 + l7)) and the tail in order: the same operations at every SIMD level.
float dot(const float* a, const float* b, int n);

// y[n] += alpha * x[n] (fma per value)
void axpy(float* y, float alpha, const float* x, int n);

// Asks L2 for rows p + j * ld, j < count, of n floats each (no effect on any result).
void prefetch_rows(const float* p, size_t ld, int count, int n);

// Attention over a KV cache, one query and head at a time (k_j = k + j * ld, j < count):
// s[j] = dot(q, k_j, n) * scale, each bitwise what dot gives ...
void dot_rows(float* s, const float* q, const float* k, size_t ld, int count, int n, float scale);
// ... and o[n] += sum_j w[j] v_j (v_j = v + j * ld), j in order: bitwise `for j: axpy(o, w[j], v_j, n)`.
void axpy_rows(float* o, const float* w, const float* v, size_t ld, int count, int n);
// ... and the same for two outputs over the same rows (two heads sharing a kv head), bitwise
// axpy_rows(o0, w0, ...) then axpy_rows(o1, w1, ...).
void axpy_rows2(float* o0, float* o1, const float* w0, const float* w1, const float* v, size_t ld, int count, int n);

}  // namespace moetron::kernels
