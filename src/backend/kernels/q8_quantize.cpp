// Q8_0 weights made at load (quantize_q8_0, q8.h): llama.cpp's rule, 8 values a step with AVX2.
#include "backend/kernels/q8.h"

#include <limits>
#include <vector>

#include "backend/kernels/gemv.h"
#include "backend/kernels/simd.h"
#include "backend/kernels/targets.h"
#include "core/error.h"

namespace moetron::kernels {

namespace {

// core/dtype.h's quantize_q8_0_block, 8 values a step, with the same operations: max |x| (exact in
// any order), d = amax / 127, x * (1 / d), truncation and the half step away from zero -- so the same
// bytes (Q8Kernels.QuantizationIsLlamaCppsRule checks it against roundf).  Loading a model quantizes
// every weight: 0.49B values in 2.1 s on 2 threads with the scalar rule.  A non-finite value goes to
// the scalar rule (d NaN).
MOETRON_AVX2 void q8_quantize_block_avx2(const float* x, int8_t* q, float& d) {
  const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  __m256 v[4], m = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  for (int k = 0; k < 4; k++) {
    v[k] = _mm256_loadu_ps(x + 8 * k);
    const __m256 a = _mm256_andnot_ps(sign, v[k]);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));  // inf or NaN
    m = _mm256_max_ps(m, a);
  }
  if (_mm256_movemask_ps(bad)) return quantize_q8_0_block(x, q, d);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);
  d = amax / 127.0f;
  const __m256 id = _mm256_set1_ps(d != 0 ? 1.0f / d : 0.0f), half = _mm256_set1_ps(0.5f),
               mhalf = _mm256_set1_ps(-0.5f);
  __m256i r[4];
  for (int k = 0; k < 4; k++) {
    const __m256 s = _mm256_mul_ps(v[k], id);
    const __m256i t = _mm256_cvttps_epi32(s);
    const __m256 frac = _mm256_sub_ps(s, _mm256_cvtepi32_ps(t));
    const __m256i up = _mm256_castps_si256(_mm256_cmp_ps(frac, half, _CMP_GE_OQ));      // -1 where rounding up
    const __m256i down = _mm256_castps_si256(_mm256_cmp_ps(frac, mhalf, _CMP_LE_OQ));  // -1 where rounding down
    r[k] = _mm256_add_epi32(_mm256_sub_epi32(t, up), down);
  }
  // int32 -> int8 (within [-127, 127]); the packs interleave 128-bit lanes, the permute restores order.
  const __m256i p16a = _mm256_packs_epi32(r[0], r[1]), p16b = _mm256_packs_epi32(r[2], r[3]);
  const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

}  // namespace

bool quantize_q8_0(WeightRef W, size_t rows, int IC, int8_t* q, uint16_t* d) {
  MOETRON_ASSERT(IC % kQ8Block == 0 && !W.q8());
  const int nb = IC / kQ8Block;
  const bool simd = simd_level() != SimdLevel::generic;
  bool ok = true;
#pragma omp parallel reduction(&& : ok)
  {
    std::vector<float> row((size_t)IC);
#pragma omp for schedule(static)
    for (size_t r = 0; r < rows; r++) {
      widen_row(row.data(), W, r, IC);
      for (int b = 0; b < nb; b++) {
        float s;
        const float* x = row.data() + (size_t)b * kQ8Block;
        int8_t* qb = q + r * IC + (size_t)b * kQ8Block;
        if (simd)
          q8_quantize_block_avx2(x, qb, s);
        else
          quantize_q8_0_block(x, qb, s);
        ok = ok && s <= 65504.0f;  // NaN (non-finite weights) fails too
        d[r * nb + b] = f32_to_f16(s);
      }
    }
  }
  return ok;
}

}  // namespace moetron::kernels
