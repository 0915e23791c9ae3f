// Tests for ops/swiglu: out = silu(gate) * up, gate and up packed as [N, 2I].
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
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
