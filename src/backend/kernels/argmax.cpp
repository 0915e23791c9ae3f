// The index of the largest value (argmax.h): two vectorised passes with AVX2 at any SIMD level above
// the portable one, else std::max_element.
#include "backend/kernels/argmax.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "backend/kernels/targets.h"
#include "core/error.h"

namespace moetron::kernels {

namespace {

// ---- argmax ------------------------------------------------------------------------------------------
//
// Two passes over x: the largest value m (and whether any value is NaN), then the first index holding
// a value equal to m.  Equal is ==, so -0 and +0 are one value, as for std::max_element's <.

// The largest of x[0, n) and whether x holds a NaN; lane-wise maxima, so the order of the values
// does not matter (max of finite floats is exact).
MOETRON_AVX2 float max_avx2(const float* x, int n, bool& nan) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 bad = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    m = _mm256_max_ps(m, v);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, m);
  float best = lanes[0];
  for (int k = 1; k < 8; k++) best = std::max(best, lanes[k]);
  nan = _mm256_movemask_ps(bad) != 0;
  for (; i < n; i++) {
    nan = nan || std::isnan(x[i]);
    best = std::max(best, x[i]);
  }
  return best;
}

MOETRON_AVX2 int first_equal_avx2(const float* x, int n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  int i = 0;
  for (; i + 8 <= n; i += 8)
    if (const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), mv, _CMP_EQ_OQ)))
      return i + __builtin_ctz((unsigned)hit);
  for (; i < n; i++)
    if (x[i] == m) return i;
  return n;  // not reached: m is one of the values
}

}  // namespace

int argmax_at(SimdLevel level, const float* x, int n) {
  MOETRON_ASSERT(n >= 1);
  check_simd_level(level);
  if (level != SimdLevel::generic) {
    bool nan = false;
    const float m = max_avx2(x, n, nan);
    if (!nan) return first_equal_avx2(x, n, m);
  }
  return (int)(std::max_element(x, x + n) - x);  // NaNs: its order of comparisons decides
}

int argmax(const float* x, int n) { return argmax_at(simd_level(), x, n); }

}  // namespace moetron::kernels
