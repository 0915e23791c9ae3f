// Tests for ops/swiglu: out = silu(gate) * up.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "gradcheck.h"
#include "ops/swiglu.h"

namespace moetron {
namespace {

using testing::random_vector;

TEST(OpsSwiglu, ForwardMatchesReference) {
  const long N = 5;
  const int I = 11;
  const auto gate = random_vector(N * I, 1, 3.0f);
  const auto up = random_vector(N * I, 2);
  std::vector<float> out(N * I);
  ops::swiglu_forward(out.data(), gate.data(), up.data(), N, I);
  for (long i = 0; i < N * I; i++) {
    const double g = gate[i];
    const double ref = g / (1.0 + std::exp(-g)) * up[i];
    EXPECT_NEAR(out[i], ref, 1e-6 * (1.0 + std::fabs(ref))) << i;  // a few fp32 roundings
  }
}

TEST(OpsSwiglu, GradientsMatchFiniteDifference) {
  const long N = 4;
  const int I = 9;
  auto gate = random_vector(N * I, 3, 2.0f);
  auto up = random_vector(N * I, 4);
  const auto r = random_vector(N * I, 5);
  std::vector<float> out(N * I), dgate(N * I, 5.0f), dup(N * I, 5.0f);
  ops::swiglu_backward(dgate.data(), dup.data(), r.data(), gate.data(), up.data(), N, I);
  auto loss = [&] {
    ops::swiglu_forward(out.data(), gate.data(), up.data(), N, I);
    return testing::weighted_sum(out, r);
  };
  testing::expect_gradient_close(testing::finite_difference(gate, dgate, loss), "swiglu dgate");
  testing::expect_gradient_close(testing::finite_difference(up, dup, loss), "swiglu dup");
}

TEST(OpsSwiglu, SaturatedGatesStayFinite) {
  const std::vector<float> gate = {-1000.0f, -100.0f, 0.0f, 100.0f, 1000.0f};
  const std::vector<float> up(5, 2.0f), dout(5, 1.0f);
  std::vector<float> out(5), dgate(5), dup(5);
  ops::swiglu_forward(out.data(), gate.data(), up.data(), 1, 5);
  ops::swiglu_backward(dgate.data(), dup.data(), dout.data(), gate.data(), up.data(), 1, 5);
  for (int i = 0; i < 5; i++) {
    EXPECT_TRUE(std::isfinite(out[i])) << i;
    EXPECT_TRUE(std::isfinite(dgate[i])) << i;
    EXPECT_TRUE(std::isfinite(dup[i])) << i;
  }
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_EQ(out[2], 0.0f);
  EXPECT_FLOAT_EQ(out[4], 2000.0f);
  EXPECT_FLOAT_EQ(dgate[4], 2.0f);  // silu'(g) -> 1 for large g, times up
  EXPECT_FLOAT_EQ(dgate[2], 1.0f);  // silu'(0) = 1/2, times up = 2
  EXPECT_EQ(dgate[0], 0.0f);
}

}  // namespace
}  // namespace moetron
