// AdamW, gradient clipping and learning-rate schedules against hand-computed values.
#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "optim/adamw.h"
#include "optim/lr_schedule.h"

using namespace moetron;

// Two steps of AdamW on three elements, against the torch.optim.AdamW update written out in double.
TEST(AdamW, MatchesTheTorchUpdateRule) {
  std::vector<float> p = {0.5f, -1.0f, 2.0f}, m(3, 0.0f), v(3, 0.0f);
  const std::vector<std::vector<float>> grads = {{0.1f, -0.2f, 0.3f}, {-0.05f, 0.4f, 0.0f}};
  const double lr = 0.01, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
  std::vector<double> rp = {0.5, -1.0, 2.0}, rm(3, 0.0), rv(3, 0.0);
  for (int t = 1; t <= 2; t++) {
    adamw_update(p.data(), m.data(), v.data(), grads[t - 1].data(), 3, 1.0f, lr, b1, b2, eps, wd, t);
    for (int i = 0; i < 3; i++) {
      const double g = grads[t - 1][i];
      rp[i] *= 1 - lr * wd;
      rm[i] = b1 * rm[i] + (1 - b1) * g;
      rv[i] = b2 * rv[i] + (1 - b2) * g * g;
      const double mhat = rm[i] / (1 - std::pow(b1, t));
      const double denom = std::sqrt(rv[i]) / std::sqrt(1 - std::pow(b2, t)) + eps;
      rp[i] -= lr * mhat / denom;
    }
  }
  // fp32 arithmetic on O(1) values: 1e-6 absolute.
  for (int i = 0; i < 3; i++) EXPECT_NEAR(p[i], rp[i], 1e-6) << i;
}

TEST(AdamW, GradScaleIsAppliedBeforeTheMoments) {
  std::vector<float> p1 = {1.0f}, m1 = {0.0f}, v1 = {0.0f}, p2 = {1.0f}, m2 = {0.0f}, v2 = {0.0f};
  const float g = 4.0f, half = 2.0f;
  adamw_update(p1.data(), m1.data(), v1.data(), &g, 1, 0.5f, 0.1, 0.9, 0.95, 1e-8, 0.0, 1);
  adamw_update(p2.data(), m2.data(), v2.data(), &half, 1, 1.0f, 0.1, 0.9, 0.95, 1e-8, 0.0, 1);
  EXPECT_EQ(m1[0], m2[0]);
  EXPECT_EQ(v1[0], v2[0]);
  EXPECT_EQ(p1[0], p2[0]);
}

TEST(GradClip, NormAndCoefficientAsTorch) {
  std::vector<float> g = {3.0f, 4.0f};
  EXPECT_DOUBLE_EQ(global_grad_norm(g.data(), 2), 5.0);
  EXPECT_DOUBLE_EQ(clip_coefficient(5.0, 1.0), 1.0 / (5.0 + 1e-6));
  EXPECT_DOUBLE_EQ(clip_coefficient(0.5, 1.0), 1.0);
  EXPECT_DOUBLE_EQ(clip_coefficient(5.0, 0.0), 1.0) << "max_norm 0 disables clipping";
  std::vector<float> big(100000, 0.5f);
  EXPECT_NEAR(global_grad_norm(big.data(), big.size()), std::sqrt(100000 * 0.25), 1e-9);
}

TEST(LrSchedule, WarmupThenCosineToMinLr) {
  LrSchedule s;
  s.lr = 1e-3;
  s.min_lr = 1e-4;
  s.warmup_steps = 10;
  s.decay_steps = 110;
  s.decay = LrDecay::cosine;
  EXPECT_DOUBLE_EQ(s.at(1), 1e-4);
  EXPECT_DOUBLE_EQ(s.at(5), 5e-4);
  EXPECT_DOUBLE_EQ(s.at(10), 1e-3);
  EXPECT_NEAR(s.at(60), 1e-4 + 0.9e-3 * 0.5, 1e-15);  // half way through the decay
  EXPECT_NEAR(s.at(110), 1e-4, 1e-15);
  EXPECT_NEAR(s.at(500), 1e-4, 1e-15) << "stays at min_lr after the horizon";
  for (long t = 11; t < 110; t++) EXPECT_LE(s.at(t + 1), s.at(t)) << "monotone decay at " << t;
}

TEST(LrSchedule, LinearAndConstant) {
  LrSchedule s;
  s.lr = 2.0;
  s.min_lr = 0.0;
  s.warmup_steps = 0;
  s.decay_steps = 4;
  s.decay = LrDecay::linear;
  EXPECT_DOUBLE_EQ(s.at(1), 1.5);
  EXPECT_DOUBLE_EQ(s.at(2), 1.0);
  EXPECT_DOUBLE_EQ(s.at(4), 0.0);
  s.decay = LrDecay::constant;
  EXPECT_DOUBLE_EQ(s.at(3), 2.0);
  EXPECT_EQ(lr_decay_from_string("cosine"), LrDecay::cosine);
  EXPECT_THROW(lr_decay_from_string("cosinus"), Error);
}
