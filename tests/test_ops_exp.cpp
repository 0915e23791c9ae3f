// Tests for ops/exp.h, the exponentials written as explicit fma steps: exp_nonpositive (softmax's) and
// exp_f32 (SiLU's) within 2^-23 (relative) of double exp over their ranges, exp_f32 bitwise
// exp_nonpositive where both apply, and the stated values at the edges.
#include <cmath>
#include <functional>
#include <random>

#include <gtest/gtest.h>

#include "ops/exp.h"

namespace moetron {
namespace {

// The largest relative error of f against double exp over 2e6 points, half uniform over [lo, hi] and
// half over [near_lo, near_hi] (around 0, where the reduction's rounding shows).
double worst_relative_error(const std::function<float(float)>& f, float lo, float hi, float near_lo, float near_hi,
                            uint32_t seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> wide(lo, hi), near0(near_lo, near_hi);
  double worst = 0;
  for (int i = 0; i < 2000000; i++) {
    const float x = i % 2 ? wide(g) : near0(g);
    const double ref = std::exp((double)x);
    worst = std::max(worst, std::fabs((double)f(x) - ref) / ref);
  }
  return worst;
}

TEST(OpsExp, NonPositiveIsWithinTwoToTheMinus23) {
  // Relative, as the softmax bound of test_ops_softmax assumes.
  EXPECT_LT(worst_relative_error(ops::exp_nonpositive, -87.3f, 0.0f, -1.0f, 0.0f, 5), std::ldexp(1.0, -23));
  EXPECT_EQ(ops::exp_nonpositive(0.0f), 1.0f);
  EXPECT_EQ(ops::exp_nonpositive(-INFINITY), 0.0f);
  EXPECT_EQ(ops::exp_nonpositive(-100.0f), 0.0f);
  EXPECT_TRUE(std::isnan(ops::exp_nonpositive(NAN)));
}

TEST(OpsExp, F32IsWithinTwoToTheMinus23OverTheFp32Range) {
  EXPECT_LT(worst_relative_error(ops::exp_f32, -87.3f, 88.72f, -1.0f, 1.0f, 7), std::ldexp(1.0, -23));
  std::mt19937 g(11);
  std::uniform_real_distribution<float> neg(-90.0f, 0.0f);
  for (int i = 0; i < 100000; i++) {
    const float x = neg(g);
    ASSERT_EQ(ops::exp_f32(x), ops::exp_nonpositive(x)) << x;
  }
  // The largest finite results: e^x for the last floats below ln(FLT_MAX), 2^n with n = 128.
  for (const float x : {88.7228317f, 88.72f, 88.5f, 88.0f}) {
    const double ref = std::exp((double)x);
    EXPECT_TRUE(std::isfinite(ops::exp_f32(x))) << x;
    EXPECT_LT(std::fabs((double)ops::exp_f32(x) - ref) / ref, std::ldexp(1.0, -23)) << x;
  }
  EXPECT_EQ(ops::exp_f32(88.7228394f), INFINITY);  // e^x above FLT_MAX (+ half an ulp)
  EXPECT_EQ(ops::exp_f32(1000.0f), INFINITY);
  EXPECT_EQ(ops::exp_f32(INFINITY), INFINITY);
  EXPECT_EQ(ops::exp_f32(0.0f), 1.0f);
  EXPECT_EQ(ops::exp_f32(-100.0f), 0.0f);
  EXPECT_EQ(ops::exp_f32(-INFINITY), 0.0f);
  EXPECT_TRUE(std::isnan(ops::exp_f32(NAN)));
}

}  // namespace
}  // namespace moetron
