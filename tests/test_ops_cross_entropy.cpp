// Tests for ops/cross_entropy: summed, scaled softmax cross-entropy with ignore index.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "gradcheck.h"
#include "ops/cross_entropy.h"

namespace moetron {
namespace {

using ops::IGNORE_INDEX;
using testing::random_vector;

// Naive double reference: per-row lse and the scaled summed loss.
double reference_loss(std::vector<double>& lse, const std::vector<float>& logits, const std::vector<int32_t>& targets,
                      int V, double scale) {
  const long N = (long)targets.size();
  lse.assign(N, 0.0);
  double loss = 0.0;
  for (long n = 0; n < N; n++) {
    double m = -INFINITY;
    for (int v = 0; v < V; v++) m = std::max(m, (double)logits[n * V + v]);
    double s = 0.0;
    for (int v = 0; v < V; v++) s += std::exp((double)logits[n * V + v] - m);
    lse[n] = m + std::log(s);
    if (targets[n] != IGNORE_INDEX) loss += lse[n] - logits[n * V + targets[n]];
  }
  return loss * scale;
}

TEST(OpsCrossEntropy, ForwardMatchesReference) {
  const int V = 33;
  const std::vector<int32_t> targets = {3, IGNORE_INDEX, 0, 32, IGNORE_INDEX, 7};
  const long N = (long)targets.size();
  auto logits = random_vector(N * V, 1, 3.0f);
  const float scale = 1.0f / 4.0f;  // four counted rows
  std::vector<float> lse(N);
  const double loss = ops::cross_entropy_forward(lse.data(), logits.data(), targets.data(), N, V, scale);
  std::vector<double> ref_lse;
  const double ref = reference_loss(ref_lse, logits, targets, V, scale);
  // fp32 exp/lse of O(10) values: ~1e-6 relative.
  EXPECT_NEAR(loss, ref, 1e-5 * std::fabs(ref));
  for (long n = 0; n < N; n++) EXPECT_NEAR(lse[n], ref_lse[n], 1e-5) << "row " << n;
}

TEST(OpsCrossEntropy, LargeLogitsAreStable) {
  const int V = 4;
  const std::vector<float> logits = {1000.0f, 999.0f, -1000.0f, 0.0f, -5e3f, -5e3f, -5e3f, -5e3f};
  const std::vector<int32_t> targets = {1, 2};
  std::vector<float> lse(2), d(8);
  const double loss = ops::cross_entropy_forward(lse.data(), logits.data(), targets.data(), 2, V, 1.0f);
  // Row 0: lse = 1000 + log(1 + e^-1); loss = lse - 999.  Row 1: uniform, loss = log 4.
  const double expect = (1000.0 + std::log1p(std::exp(-1.0)) - 999.0) + std::log(4.0);
  EXPECT_NEAR(loss, expect, 1e-4);  // lse is fp32 near 1000: ulp 6e-5
  ops::cross_entropy_backward(d.data(), logits.data(), lse.data(), targets.data(), 2, V, 1.0f);
  for (float x : d) EXPECT_TRUE(std::isfinite(x));
  // lse is saved in fp32: near |lse| = 5000 its ulp is 4.9e-4, so exp(x - lse) carries a relative
  // error up to ~2.5e-4 (a property of the fp32 lse in the op's contract; realistic |logits| < 100
  // give < 4e-6).  Row 0 (|lse| ~ 1000, ulp 6.1e-5): p = 1/(1+e) to ~3e-5.
  EXPECT_NEAR(d[0], 1.0 / (1.0 + std::exp(-1.0)), 5e-5);
  EXPECT_NEAR(d[1], 1.0 / (1.0 + std::exp(1.0)) - 1.0, 5e-5);
  EXPECT_EQ(d[2], 0.0f);
  EXPECT_NEAR(d[4], 0.25, 1e-4);
  EXPECT_NEAR(d[6], -0.75, 1e-4);
}

TEST(OpsCrossEntropy, NanLogitGivesNanLoss) {
  std::vector<float> logits = {0.5f, NAN, 1.0f, 2.0f, 0.0f, 1.0f};
  const std::vector<int32_t> targets = {0, 1};
  std::vector<float> lse(2);
  EXPECT_TRUE(std::isnan(ops::cross_entropy_forward(lse.data(), logits.data(), targets.data(), 2, 3, 1.0f)));
  logits[1] = 0.0f;
  logits[0] = NAN;  // first element of a row
  EXPECT_TRUE(std::isnan(ops::cross_entropy_forward(lse.data(), logits.data(), targets.data(), 2, 3, 1.0f)));
}

TEST(OpsCrossEntropy, GradientMatchesFiniteDifference) {
  const int V = 11;
  const std::vector<int32_t> targets = {2, 10, IGNORE_INDEX, 0, 5};
  const long N = (long)targets.size();
  auto logits = random_vector(N * V, 2);
  const float scale = 0.5f;
  std::vector<float> lse(N), dlogits(N * V, 99.0f);
  ops::cross_entropy_forward(lse.data(), logits.data(), targets.data(), N, V, scale);
  ops::cross_entropy_backward(dlogits.data(), logits.data(), lse.data(), targets.data(), N, V, scale);
  for (int v = 0; v < V; v++) EXPECT_EQ(dlogits[2 * V + v], 0.0f);  // ignored row, assigned
  auto loss = [&] { return ops::cross_entropy_forward(lse.data(), logits.data(), targets.data(), N, V, scale); };
  testing::expect_gradient_close(testing::finite_difference(logits, dlogits, loss), "ce dlogits");
}

TEST(OpsCrossEntropy, InPlaceBackwardEqualsOutOfPlace) {
  const int V = 50;
  const std::vector<int32_t> targets = {1, IGNORE_INDEX, 49, 0};
  const long N = (long)targets.size();
  auto logits = random_vector(N * V, 3);
  std::vector<float> lse(N), d(N * V);
  ops::cross_entropy_forward(lse.data(), logits.data(), targets.data(), N, V, 0.25f);
  ops::cross_entropy_backward(d.data(), logits.data(), lse.data(), targets.data(), N, V, 0.25f);
  ops::cross_entropy_backward(logits.data(), logits.data(), lse.data(), targets.data(), N, V, 0.25f);
  EXPECT_EQ(d, logits);
}

TEST(OpsCrossEntropy, BadTargetIsAnErrorNamingRowAndValue) {
  const int V = 8;
  auto logits = random_vector(3 * V, 4);
  std::vector<float> lse(3), d(3 * V);
  for (int32_t bad : {8, -1, -101, 123456}) {
    const std::vector<int32_t> targets = {0, IGNORE_INDEX, bad};
    try {
      ops::cross_entropy_forward(lse.data(), logits.data(), targets.data(), 3, V, 1.0f);
      ADD_FAILURE() << "no error for target " << bad;
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("cross_entropy_forward"), std::string::npos) << msg;
      EXPECT_NE(msg.find("row 2"), std::string::npos) << msg;
      EXPECT_NE(msg.find("target " + std::to_string(bad)), std::string::npos) << msg;
    }
    EXPECT_THROW(ops::cross_entropy_backward(d.data(), logits.data(), lse.data(), targets.data(), 3, V, 1.0f), Error);
  }
}

TEST(OpsCrossEntropy, LossIsDeterministicAcrossThreadCounts) {
  const long N = 600;
  const int V = 500;  // N*V large enough to run in parallel
  auto logits = random_vector(N * V, 5, 2.0f);
  std::mt19937 gen(6);
  std::uniform_int_distribution<int32_t> dist(0, V - 1);
  std::vector<int32_t> targets(N);
  for (long n = 0; n < N; n++) targets[n] = (n % 7 == 0) ? IGNORE_INDEX : dist(gen);
  auto run = [&](int threads) {
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    std::vector<float> lse(N);
    const double loss = ops::cross_entropy_forward(lse.data(), logits.data(), targets.data(), N, V, 1.0f / N);
    omp_set_num_threads(saved);
    return loss;
  };
  const double a = run(2), b = run(2), c = run(1), d = run(3);
  EXPECT_EQ(a, b);  // bitwise
  EXPECT_EQ(a, c);
  EXPECT_EQ(a, d);
}

}  // namespace
}  // namespace moetron
