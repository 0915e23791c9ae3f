// e^x in fp32 written as explicit fma steps (no libm call), so loops over it vectorise and their
// vector body and scalar tail give the same bits: softmax's e^(x - max), SiLU's e^-g.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

namespace moetron::ops {

// e^r for the reduced argument of e^x, x = n ln2 + r (n = round(x log2 e), |r| <= ln2 / 2; ln2 in two
// parts): Cephes' degree-7 polynomial, every step an explicit fma or a single rounding.
inline float exp_reduced(float x, float n) {
  float r = std::fma(n, -0.693359375f, x);  // ln2's high part (exact in n * it for |n| < 2^10)
  r = std::fma(n, 2.12194440e-4f, r);       // minus its low part
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  return std::fma(p, r * r, r) + 1.0f;
}

// e^x for x <= 0 (a softmax's x - max) with a relative error below 2^-23 (measured against double exp
// over 4e7 points of [-87.3, 0]: at most 0.70 * 2^-23); 0 below -87.34 (where e^x leaves fp32's normal
// range) and for -inf, NaN for NaN.  Cody-Waite reduction (exp_reduced), then 2^n built in the
// exponent bits.  Every step is an explicit fma or a single rounding, so the compiler's vectorised loop
// and its scalar tail give the same bits (libm's expf is a call per value, which kept the loop scalar:
// 10% of a small model's prefill).
inline float exp_nonpositive(float x) {
  const float magic = 12582912.0f;  // 1.5 * 2^23: t's low mantissa bits hold round(x log2 e)
  const float t = std::fma(x, 1.44269504088896341f, magic);
  const float p = exp_reduced(x, t - magic);
  const uint32_t bits = (std::bit_cast<uint32_t>(t) - std::bit_cast<uint32_t>(magic) + 127u) << 23;  // 2^n
  const float v = p * std::bit_cast<float>(bits);
  return x < -87.33654475f ? 0.0f : v;
}

// e^x over fp32's whole range with the same relative error (< 2^-23) and the same steps as
// exp_nonpositive (bitwise equal to it for x <= 0), for SiLU's e^-g: 0 below -87.34, +inf above
// 88.72 (beyond the largest fp32), NaN for NaN.  2^n is applied as 2^h 2^(n-h), h = n / 2 (each
// within the exponent's range for n up to 128; the first product is exact).
inline float exp_f32(float x) {
  const float magic = 12582912.0f;
  const float t = std::fma(x, 1.44269504088896341f, magic);
  const float p = exp_reduced(x, t - magic);
  const int32_t n = (int32_t)(std::bit_cast<uint32_t>(t) - std::bit_cast<uint32_t>(magic));
  const int32_t h = n >> 1;
  const float s1 = std::bit_cast<float>((uint32_t)(h + 127) << 23);
  const float s2 = std::bit_cast<float>((uint32_t)(n - h + 127) << 23);
  const float v = (p * s1) * s2;
  return x < -87.33654475f ? 0.0f : x > 88.72283935f ? INFINITY : v;
}

}  // namespace moetron::ops
