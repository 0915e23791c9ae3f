// Tests for ops/swiglu: out = silu(gate) * up, gate and up packed as [N, 2I].
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "gradcheck.h"
#include "ops/exp.h"
#include "ops/swiglu.h"

namespace moetron {
namespace {

using testing::random_vector;

TEST(OpsSwiglu, ForwardMatchesReference) {
  const long N = 5;
  const int I = 11;
  auto gate_up = random_vector(N * 2 * I, 1, 3.0f);
  std::vector<float> out(N * I);
  ops::swiglu_forward(out.data(), gate_up.data(), N, I);
  for (long n = 0; n < N; n++)
    for (int i = 0; i < I; i++) {
      const double g = gate_up[n * 2 * I + i], u = gate_up[n * 2 * I + I + i];
      const double ref = g / (1.0 + std::exp(-g)) * u;
      EXPECT_NEAR(out[n * I + i], ref, 1e-6 * (1.0 + std::fabs(ref))) << n << "," << i;  // a few fp32 roundings
    }
}

TEST(OpsSwiglu, GradientsMatchFiniteDifference) {
  const long N = 4;
  const int I = 9;
  auto gate_up = random_vector(N * 2 * I, 3, 2.0f);
  const auto r = random_vector(N * I, 5);
  std::vector<float> out(N * I), dgate_up(N * 2 * I, 5.0f);
  ops::swiglu_backward(dgate_up.data(), r.data(), gate_up.data(), N, I);
  auto loss = [&] {
    ops::swiglu_forward(out.data(), gate_up.data(), N, I);
    return testing::weighted_sum(out, r);
  };
  testing::expect_gradient_close(testing::finite_difference(gate_up, dgate_up, loss), "swiglu dgate_up");
}

// exp_f32 (SiLU's e^-g): within 2^-23 of e^x over fp32's range, exp_nonpositive's bits for x <= 0, and
// the stated values at the edges.
TEST(OpsSwiglu, ExpIsWithinTwoToTheMinus23OverTheFp32Range) {
  std::mt19937 g(7);
  std::uniform_real_distribution<float> wide(-87.3f, 88.72f), near0(-1.0f, 1.0f);
  double worst = 0;
  for (int i = 0; i < 2000000; i++) {
    const float x = i % 2 ? wide(g) : near0(g);
    const double ref = std::exp((double)x);
    worst = std::max(worst, std::fabs((double)ops::exp_f32(x) - ref) / ref);
    if (x <= 0) {
      ASSERT_EQ(ops::exp_f32(x), ops::exp_nonpositive(x)) << x;
    }
  }
  EXPECT_LT(worst, std::ldexp(1.0, -23));
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

// swiglu_forward_exp_f32's vectorised loop and its scalar tail compute exactly g / (1 + exp_f32(-g)) *
// up: bitwise, for a width with a tail whatever the vector length; and swiglu_forward with libm's expf.
TEST(OpsSwiglu, ForwardIsItsStatedArithmeticBitwise) {
  const long N = 3;
  const int I = 37;
  auto gate_up = random_vector(N * 2 * I, 9, 6.0f);
  std::vector<float> out(N * I), lib(N * I);
  ops::swiglu_forward_exp_f32(out.data(), gate_up.data(), N, I);
  ops::swiglu_forward(lib.data(), gate_up.data(), N, I);
  for (long n = 0; n < N; n++)
    for (int i = 0; i < I; i++) {
      const float g = gate_up[n * 2 * I + i], u = gate_up[n * 2 * I + I + i];
      const float want = g / (1.0f + ops::exp_f32(-g)) * u;
      ASSERT_EQ(std::bit_cast<uint32_t>(out[n * I + i]), std::bit_cast<uint32_t>(want)) << n << "," << i;
      ASSERT_EQ(std::bit_cast<uint32_t>(lib[n * I + i]), std::bit_cast<uint32_t>(g / (1.0f + std::exp(-g)) * u));
    }
}

TEST(OpsSwiglu, SaturatedGatesStayFinite) {
  // One row: gates then ups.
  const std::vector<float> gate_up = {-1000.0f, -100.0f, 0.0f, 100.0f, 1000.0f, 2.0f, 2.0f, 2.0f, 2.0f, 2.0f};
  const std::vector<float> dout(5, 1.0f);
  std::vector<float> out(5), d(10);
  ops::swiglu_forward(out.data(), gate_up.data(), 1, 5);
  ops::swiglu_backward(d.data(), dout.data(), gate_up.data(), 1, 5);
  for (int i = 0; i < 5; i++) EXPECT_TRUE(std::isfinite(out[i])) << i;
  for (int i = 0; i < 10; i++) EXPECT_TRUE(std::isfinite(d[i])) << i;
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_EQ(out[2], 0.0f);
  EXPECT_FLOAT_EQ(out[4], 2000.0f);
  EXPECT_FLOAT_EQ(d[4], 2.0f);  // silu'(g) -> 1 for large g, times up
  EXPECT_FLOAT_EQ(d[2], 1.0f);  // silu'(0) = 1/2, times up = 2
  EXPECT_EQ(d[0], 0.0f);
  EXPECT_FLOAT_EQ(d[5 + 4], 1000.0f);  // d/dup = silu(g)
}

}  // namespace
}  // namespace moetron
