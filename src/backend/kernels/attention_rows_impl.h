// The AVX2 kernels of attention over a cache (attention_rows_avx2.cpp), for attention_rows.cpp's
// dispatch; internal to backend/kernels.
#pragma once

#include <cstddef>

#include "backend/kernels/targets.h"

namespace moetron::kernels {

// s[j] = scale * dot(q, k + j * ld), j < count.
MOETRON_AVX2 void dot_rows_avx2(float* s, const float* q, const float* k, size_t ld, int count, int n, float scale);
// o[n] += sum_j w[j] (v + j * ld), j < count in order.
MOETRON_AVX2 void axpy_rows_avx2(float* o, const float* w, const float* v, size_t ld, int count, int n);
// The same for two outputs over the same rows: o0 with w0, o1 with w1.
MOETRON_AVX2 void axpy_rows2_avx2(float* o0, float* o1, const float* w0, const float* w1, const float* v, size_t ld,
                                  int count, int n);

}  // namespace moetron::kernels
