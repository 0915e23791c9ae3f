// Tests for the shared row softmax (src/ops/softmax.h; its exp: test_ops_exp.cpp): the softmax against a
// long-double reference, its stated arithmetic bitwise (the vectorised loop gives what one value at a
// time gives), shift invariance without overflow, and that the router's
// probabilities are exactly it.  Its gradient is the router's (test_ops_router checks that by finite
// differences through router_backward).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "ops/router.h"
#include "ops/softmax.h"

namespace moetron {
namespace {

std::vector<float> random_row(int n, float spread, uint32_t seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> u(-spread, spread);
  std::vector<float> x(n);
  for (auto& v : x) v = u(g);
  return x;
}

TEST(Softmax, MatchesALongDoubleReferenceAndSumsToOne) {
  for (int n : {1, 2, 7, 8, 33, 300, 4097}) {
    const std::vector<float> x = random_row(n, 12.0f, 17u + n);
    std::vector<float> p = x;
    ops::softmax_inplace(p.data(), n);
    long double mx = x[0], sum = 0;
    for (float v : x) mx = std::max(mx, (long double)v);
    for (float v : x) sum += std::exp((long double)v - mx);
    double total = 0;
    for (int j = 0; j < n; j++) {
      const long double ref = std::exp((long double)x[j] - mx) / sum;
      // Relative error: the fp32 difference d = x - max rounds by up to |d| 2^-24 (absolute), which
      // exp turns into relative; exp itself < 1 ulp (2^-23), the double sum of n such values 2^-23,
      // the inverse and the product 2^-24 each: at most (|d| + 6) 2^-24.
      const double d = std::fabs((double)x[j] - (double)mx), u = std::ldexp(1.0, -24);
      EXPECT_NEAR((double)p[j], (double)ref, (d + 6) * u * (double)ref) << "n " << n << " j " << j;
      total += p[j];
    }
    EXPECT_NEAR(total, 1.0, 1e-5) << "n " << n;
  }
}

TEST(Softmax, FollowsItsStatedArithmetic) {
  const int n = 50;
  const std::vector<float> x = random_row(n, 5.0f, 3u);
  std::vector<float> p = x;
  ops::softmax_inplace(p.data(), n);
  float mx = x[0];
  for (float v : x) mx = std::max(mx, v);
  double sum = 0;
  std::vector<float> e(n);
  for (int j = 0; j < n; j++) sum += (e[j] = ops::exp_nonpositive(x[j] - mx));
  const float inv = (float)(1.0 / sum);
  for (int j = 0; j < n; j++) EXPECT_EQ(p[j], e[j] * inv) << j;  // bitwise
}

// softmax_rows: each row bitwise what softmax_inplace gives it alone, in groups of 4 and a remainder,
// a row holding a NaN or -inf among them.
TEST(Softmax, RowsAreEachRowAlone) {
  for (const int rows : {1, 3, 4, 5, 9})
    for (const int n : {1, 2, 17, 64}) {
      const size_t ld = (size_t)n + 3;
      std::vector<float> x((size_t)rows * ld);
      for (int r = 0; r < rows; r++) {
        const std::vector<float> v = random_row(n, 4.0f, 100u + r * 7 + n);
        std::copy(v.begin(), v.end(), x.begin() + (size_t)r * ld);
      }
      if (rows > 2) x[ld + n / 2] = NAN;
      if (rows > 3) x[2 * ld] = -INFINITY;
      std::vector<float> got = x;
      ops::softmax_rows(got.data(), rows, n, ld);
      for (int r = 0; r < rows; r++) {
        std::vector<float> want(x.begin() + (size_t)r * ld, x.begin() + (size_t)r * ld + n);
        ops::softmax_inplace(want.data(), n);
        ASSERT_EQ(0, std::memcmp(got.data() + (size_t)r * ld, want.data(), sizeof(float) * n))
            << rows << " " << n << " " << r;
        for (size_t j = n; j < ld && (size_t)r * ld + j < x.size(); j++)  // the gaps untouched
          ASSERT_EQ(0, std::memcmp(&got[(size_t)r * ld + j], &x[(size_t)r * ld + j], sizeof(float)));
      }
    }
}

TEST(Softmax, LargeLogitsStayFiniteAndShiftingChangesNothing) {
  // Multiples of 1/8 in [-8, 8]: x + 1024 is exact, and exp(1024) alone would overflow fp32.
  const int n = 64;
  std::vector<float> x(n), y(n);
  for (int j = 0; j < n; j++) {
    x[j] = (float)((j * 37) % 129 - 64) / 8.0f;
    y[j] = x[j] + 1024.0f;
  }
  ops::softmax_inplace(x.data(), n);
  ops::softmax_inplace(y.data(), n);
  for (int j = 0; j < n; j++) {
    ASSERT_TRUE(std::isfinite(y[j])) << j;
    EXPECT_EQ(x[j], y[j]) << j;
  }
}

TEST(Softmax, IsTheRoutersProbabilities) {
  const int E = 8, K = 2;
  const std::vector<float> logits = random_row(E, 3.0f, 99u);
  std::vector<float> probs(E), w(K), p = logits;
  std::vector<int32_t> idx(K);
  ops::route_token(probs.data(), idx.data(), w.data(), logits.data(), E, K, /*renormalize=*/false);
  ops::softmax_inplace(p.data(), E);
  for (int e = 0; e < E; e++) EXPECT_EQ(probs[e], p[e]) << e;
}

}  // namespace
}  // namespace moetron
