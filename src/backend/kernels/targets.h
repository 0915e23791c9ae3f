// The target attributes each instruction set's kernels are compiled with (whatever the build's
// -march; simd_level() chooses among them at run time), and the horizontal sum the AVX2 and AVX-512
// kernels share.  Internal to backend/kernels.
#pragma once

#include <immintrin.h>

// The matrix-vector, Q8_0, attention and argmax kernels.
#define MOETRON_AVX2 __attribute__((target("avx2,fma,f16c")))
#define MOETRON_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))
#define MOETRON_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
// The prefill GEMM's.
#define MOETRON_GEMM_AVX2 __attribute__((target("avx2,fma")))
#define MOETRON_GEMM_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))

namespace moetron::kernels {

MOETRON_AVX2 inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

}  // namespace moetron::kernels
