// Row softmax in fp32, the one the router and inference attention share: p = e^(x - max x) / sum,
// e^ by exp_nonpositive (relative error < 2^-23), the sum of the exponentials accumulated in double
// and its inverse rounded once to fp32.  (Training attention's forward keeps its own, mask-aware
// loop: ops/attention.cpp.)
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

namespace moetron::ops {

// In place over s[0..n), n >= 1 (=): max, then s[j] = exp_nonpositive(s[j] - max), sum (double, in
// order), then s[j] *= (float)(1 / sum).  Subtracting the maximum first keeps large logits finite,
// and makes the result bitwise the same for x and x + c whenever x + c is exact.
void softmax_inplace(float* s, int n);

// e^x for x <= 0 (a softmax's x - max) with a relative error below 2^-23 (measured against double exp
// over 4e7 points of [-87.3, 0]: at most 0.70 * 2^-23); 0 below -87.34 (where e^x leaves fp32's normal
// range) and for -inf, NaN for NaN.  Cody-Waite reduction x = n ln2 + r, |r| <= ln2 / 2, with ln2
// in two parts, then Cephes' degree-7 polynomial for e^r and 2^n built in the exponent bits.  Every
// step is an explicit fma or a single rounding, so the compiler's vectorised loop and its scalar tail
// give the same bits (libm's expf is a call per value, which kept the loop scalar: 10% of a small
// model's prefill).
inline float exp_nonpositive(float x) {
  const float magic = 12582912.0f;  // 1.5 * 2^23: t's low mantissa bits hold round(x log2 e)
  const float t = std::fma(x, 1.44269504088896341f, magic);
  const float n = t - magic;
  float r = std::fma(n, -0.693359375f, x);  // ln2's high part (exact in n * it for |n| < 2^10)
  r = std::fma(n, 2.12194440e-4f, r);       // minus its low part
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p, r * r, r) + 1.0f;
  const uint32_t bits = (std::bit_cast<uint32_t>(t) - std::bit_cast<uint32_t>(magic) + 127u) << 23;  // 2^n
  const float v = p * std::bit_cast<float>(bits);
  return x < -87.33654475f ? 0.0f : v;
}

}  // namespace moetron::ops
