// Tests for ops/rmsnorm (HF MixtralRMSNorm semantics).
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <vector>

#include "gradcheck.h"
#include "ops/rmsnorm.h"

namespace moetron {
namespace {

using testing::random_vector;

TEST(OpsRmsnorm, ForwardMatchesReference) {
  const long N = 6;
  const int C = 37;
  const float eps = 1e-5f;
  auto x = random_vector(N * C, 1, 2.0f);
  for (int c = 0; c < C; c++) x[2 * C + c] *= 1e-3f;  // a row where eps matters
  const auto w = random_vector(C, 2);
  std::vector<float> out(N * C), rstd(N);
  ops::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, eps);
  for (long n = 0; n < N; n++) {
    double ss = 0.0;
    for (int c = 0; c < C; c++) ss += (double)x[n * C + c] * x[n * C + c];
    const double r = 1.0 / std::sqrt(ss / C + eps);
    EXPECT_NEAR(rstd[n], r, 1e-6 * r) << "row " << n;  // fp32 rounding of r
    for (int c = 0; c < C; c++) {
      const double ref = (double)w[c] * x[n * C + c] * r;
      // three fp32 roundings of an O(1..5) value
      EXPECT_NEAR(out[n * C + c], ref, 1e-6 * (1.0 + std::fabs(ref))) << "row " << n << " c " << c;
    }
  }
}

TEST(OpsRmsnorm, GradientsMatchFiniteDifference) {
  const long N = 5;
  const int C = 24;
  const float eps = 1e-6f;
  auto x = random_vector(N * C, 3);
  auto w = random_vector(C, 4);
  for (auto& v : w) v += 1.0f;
  const auto r = random_vector(N * C, 5);
  std::vector<float> out(N * C), rstd(N), dx(N * C, 123.0f), dw(C, 0.0f);
  ops::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, eps);
  ops::rmsnorm_backward(dx.data(), dw.data(), r.data(), x.data(), w.data(), rstd.data(), N, C);
  auto loss = [&] {
    ops::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, eps);
    return testing::weighted_sum(out, r);
  };
  testing::expect_gradient_close(testing::finite_difference(x, dx, loss), "rmsnorm dinp");
  testing::expect_gradient_close(testing::finite_difference(w, dw, loss), "rmsnorm dweight");
}

TEST(OpsRmsnorm, WeightGradientAccumulatesAndInputGradientAssigns) {
  const long N = 4;
  const int C = 80;  // more than one 64-column chunk
  auto x = random_vector(N * C, 6);
  auto w = random_vector(C, 7);
  const auto r = random_vector(N * C, 8);
  std::vector<float> out(N * C), rstd(N);
  ops::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, 1e-5f);
  std::vector<float> dx1(N * C, 0.0f), dx2(N * C, -7.0f), dw1(C, 0.0f);
  ops::rmsnorm_backward(dx1.data(), dw1.data(), r.data(), x.data(), w.data(), rstd.data(), N, C);
  auto dw2 = dw1;
  ops::rmsnorm_backward(dx2.data(), dw2.data(), r.data(), x.data(), w.data(), rstd.data(), N, C);
  EXPECT_EQ(dx1, dx2);                                                 // assigned, whatever was there
  for (int c = 0; c < C; c++) EXPECT_FLOAT_EQ(dw2[c], 2.0f * dw1[c]);  // accumulated
}

TEST(OpsRmsnorm, BackwardIsDeterministicAcrossThreadCounts) {
  const long N = 1024;
  const int C = 96;
  auto x = random_vector(N * C, 9);
  auto w = random_vector(C, 10);
  const auto r = random_vector(N * C, 11);
  std::vector<float> out(N * C), rstd(N);
  ops::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, 1e-5f);
  auto run = [&](int threads) {
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    std::vector<float> dx(N * C), dw(C, 0.0f);
    ops::rmsnorm_backward(dx.data(), dw.data(), r.data(), x.data(), w.data(), rstd.data(), N, C);
    omp_set_num_threads(saved);
    dx.insert(dx.end(), dw.begin(), dw.end());
    return dx;
  };
  EXPECT_EQ(run(1), run(2));
}

}  // namespace
}  // namespace moetron
