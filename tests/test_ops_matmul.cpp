// Tests for ops/matmul: nn.Linear convention forward/backward and the sgemm helper.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "gradcheck.h"
#include "ops/matmul.h"

namespace moetron {
namespace {

using testing::random_vector;

// Tolerance for fp32 dot products of K O(1) terms against a double reference: the rounding error
// grows like K * 6e-8 * sum|a*b| in the worst case; 1e-5 * (1 + sum|a*b|) covers K <= 100.
void expect_close_to(const std::vector<float>& got, const std::vector<double>& ref, const std::vector<double>& mag,
                     const char* what) {
  ASSERT_EQ(got.size(), ref.size());
  for (size_t i = 0; i < ref.size(); i++)
    EXPECT_NEAR(got[i], ref[i], 1e-5 * (1.0 + mag[i])) << what << " element " << i;
}

TEST(OpsMatmul, ForwardMatchesReference) {
  const int N = 7, IC = 13, OC = 5;
  const auto x = random_vector((size_t)N * IC, 1);
  const auto w = random_vector((size_t)OC * IC, 2);
  std::vector<float> out(N * OC, 42.0f);
  ops::matmul_forward(out.data(), x.data(), w.data(), N, IC, OC);
  std::vector<double> ref(N * OC, 0.0), mag(N * OC, 0.0);
  for (int n = 0; n < N; n++)
    for (int o = 0; o < OC; o++)
      for (int i = 0; i < IC; i++) {
        ref[n * OC + o] += (double)x[n * IC + i] * w[o * IC + i];
        mag[n * OC + o] += std::fabs((double)x[n * IC + i] * w[o * IC + i]);
      }
  expect_close_to(out, ref, mag, "out");

  // The accumulating variant adds to what is there.
  auto acc = random_vector(N * OC, 3);
  std::vector<double> ref2(N * OC), mag2(mag);
  for (int i = 0; i < N * OC; i++) {
    ref2[i] = ref[i] + acc[i];
    mag2[i] += std::fabs(acc[i]);
  }
  ops::matmul_forward_accumulate(acc.data(), x.data(), w.data(), N, IC, OC);
  expect_close_to(acc, ref2, mag2, "accumulated out");
}

TEST(OpsMatmul, GradientsMatchFiniteDifference) {
  const int N = 6, IC = 9, OC = 4;
  auto x = random_vector((size_t)N * IC, 4);
  auto w = random_vector((size_t)OC * IC, 5);
  const auto r = random_vector((size_t)N * OC, 6);
  std::vector<float> out(N * OC), dx(N * IC, 77.0f), dw(OC * IC, 0.0f);
  ops::matmul_backward(dx.data(), dw.data(), r.data(), x.data(), w.data(), N, IC, OC);
  auto loss = [&] {
    ops::matmul_forward(out.data(), x.data(), w.data(), N, IC, OC);
    return testing::weighted_sum(out, r);
  };
  testing::expect_gradient_close(testing::finite_difference(x, dx, loss), "matmul dinp");
  testing::expect_gradient_close(testing::finite_difference(w, dw, loss), "matmul dweight");
}

TEST(OpsMatmul, BackwardAssignsInputAndAccumulatesWeightAndSkipsNull) {
  const int N = 5, IC = 8, OC = 3;
  const auto x = random_vector((size_t)N * IC, 7);
  const auto w = random_vector((size_t)OC * IC, 8);
  const auto r = random_vector((size_t)N * OC, 9);
  std::vector<float> dx1(N * IC, 0.0f), dx2(N * IC, -5.0f), dw1(OC * IC, 0.0f);
  ops::matmul_backward(dx1.data(), dw1.data(), r.data(), x.data(), w.data(), N, IC, OC);
  auto dw2 = dw1;
  ops::matmul_backward(dx2.data(), dw2.data(), r.data(), x.data(), w.data(), N, IC, OC);
  EXPECT_EQ(dx1, dx2);
  for (int i = 0; i < OC * IC; i++) EXPECT_FLOAT_EQ(dw2[i], 2.0f * dw1[i]);

  auto dw3 = dw1;
  ops::matmul_backward(nullptr, dw3.data(), r.data(), x.data(), w.data(), N, IC, OC);
  for (int i = 0; i < OC * IC; i++) EXPECT_FLOAT_EQ(dw3[i], 2.0f * dw1[i]);
  std::vector<float> dx3(N * IC, 1.0f);
  ops::matmul_backward(dx3.data(), nullptr, r.data(), x.data(), w.data(), N, IC, OC);
  EXPECT_EQ(dx3, dx1);

  // N = 0: no rows, the weight gradient is untouched.
  auto dw4 = dw1;
  ops::matmul_backward(nullptr, dw4.data(), r.data(), x.data(), w.data(), 0, IC, OC);
  EXPECT_EQ(dw4, dw1);
}

TEST(OpsMatmul, SgemmTransposesLeadingDimensionsAndBeta) {
  // C[M,N] (ldc = N + 2) = alpha op(A) op(B) + beta C with padded leading dimensions.
  const int M = 4, N = 3, K = 5;
  const float alpha = 0.5f, beta = -2.0f;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      const int lda = (ta ? M : K) + 1, ldb = (tb ? K : N) + 3, ldc = N + 2;
      const auto A = random_vector((size_t)(ta ? K : M) * lda, 10);
      const auto B = random_vector((size_t)(tb ? N : K) * ldb, 11);
      auto C = random_vector((size_t)M * ldc, 12);
      const auto C0 = C;
      ops::sgemm(ta, tb, M, N, K, alpha, A.data(), lda, B.data(), ldb, beta, C.data(), ldc);
      for (int i = 0; i < M; i++) {
        for (int j = 0; j < N; j++) {
          double s = 0.0;
          for (int k = 0; k < K; k++) {
            const double a = ta ? A[k * lda + i] : A[i * lda + k];
            const double b = tb ? B[j * ldb + k] : B[k * ldb + j];
            s += a * b;
          }
          const double ref = alpha * s + beta * C0[i * ldc + j];
          EXPECT_NEAR(C[i * ldc + j], ref, 1e-5) << "ta " << ta << " tb " << tb;
        }
        for (int j = N; j < ldc; j++) EXPECT_EQ(C[i * ldc + j], C0[i * ldc + j]);  // padding kept
      }
    }
  }
  // K = 0: C = beta * C (and exactly 0 for beta = 0, even over NaN).
  std::vector<float> C = {1.0f, NAN, 3.0f, 4.0f};
  ops::sgemm(false, false, 2, 2, 0, 1.0f, nullptr, 1, nullptr, 2, 0.0f, C.data(), 2);
  for (float c : C) EXPECT_EQ(c, 0.0f);
  std::vector<float> D = {1.0f, 2.0f, 3.0f, 4.0f};
  ops::sgemm(false, false, 2, 2, 0, 1.0f, nullptr, 1, nullptr, 2, 3.0f, D.data(), 2);
  EXPECT_EQ(D, (std::vector<float>{3.0f, 6.0f, 9.0f, 12.0f}));
}

}  // namespace
}  // namespace moetron
