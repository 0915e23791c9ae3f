// Tests for ops/rope: HF rotate-half rotary embedding, forward and backward.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/error.h"
#include "gradcheck.h"
#include "ops/rope.h"

namespace moetron {
namespace {

using testing::random_vector;

// Naive reference: the angle in fp32 exactly as transformers computes it (fp32 pow, reciprocal
// and product), then the rotation in double.
std::vector<float> rope_reference(const std::vector<float>& x, const std::vector<int32_t>& pos, int H, int HD,
                                  float theta) {
  const long N = (long)pos.size();
  const int half = HD / 2;
  std::vector<float> y(x.size());
  for (long n = 0; n < N; n++) {
    for (int h = 0; h < H; h++) {
      for (int j = 0; j < half; j++) {
        const float inv = 1.0f / std::pow(theta, (float)(2 * j) / (float)HD);
        const float angle = (float)pos[n] * inv;
        const double c = std::cos((double)angle), s = std::sin((double)angle);
        const long o = (n * H + h) * HD;
        const double x1 = x[o + j], x2 = x[o + j + half];
        y[o + j] = (float)(x1 * c - x2 * s);
        y[o + j + half] = (float)(x2 * c + x1 * s);
      }
    }
  }
  return y;
}

TEST(OpsRope, ForwardMatchesReference) {
  const int H = 3, HD = 16;
  const float theta = 10000.0f;
  const std::vector<int32_t> pos = {0, 1, 2, 5, 17, 100, 2047, 4096};
  const long N = (long)pos.size();
  auto x = random_vector(N * H * HD, 1);
  std::vector<float> y(x.size());
  ops::rope_forward(y.data(), x.data(), pos.data(), N, H, HD, theta);
  const auto ref = rope_reference(x, pos, H, HD, theta);
  // fp32 products of O(1) values: a few ulp.
  for (size_t i = 0; i < y.size(); i++) EXPECT_NEAR(y[i], ref[i], 2e-6) << "element " << i;
  // Position 0 is the identity.
  for (int i = 0; i < H * HD; i++) EXPECT_EQ(y[i], x[i]);
}

// cos/sin of the rotary angle as computed by transformers 5.x MixtralRotaryEmbedding
// (head_dim 128, rope_theta 1e6), printed with 9 significant digits:
//   cos, sin = MixtralRotaryEmbedding(MixtralConfig(head_dim=128, rope_theta=1e6, ...))(x, pos)
// {pos, j, cos[j], sin[j]}.  Feeding a one-hot x (x[j] = 1) through rope_forward yields
// out[j] = cos[j] and out[j + HD/2] = sin[j].
struct RopeGolden {
  int pos, j;
  float c, s;
};
const RopeGolden kHfGolden[] = {
    {1, 0, 0.540302336f, 0.841470957f},       {1, 1, 0.69250387f, 0.721414149f},
    {1, 5, 0.94281441f, 0.333318174f},        {1, 20, 0.99991107f, 0.01333482f},
    {1, 63, 1.0f, 1.24093776e-06f},           {7, 0, 0.753902256f, 0.656986594f},
    {7, 1, 0.800726116f, -0.599030614f},      {7, 5, -0.72287184f, 0.690982163f},
    {7, 20, 0.995646358f, 0.0932110026f},     {7, 63, 1.0f, 8.68656389e-06f},
    {4095, 0, -0.0659759939f, -0.997821212f}, {4095, 1, 0.313858807f, 0.949469686f},
    {4095, 5, -0.987344682f, 0.158588961f},   {4095, 20, -0.361771375f, -0.932266831f},
    {4095, 63, 0.999987066f, 0.0050816182f},  {32767, 0, 0.982263327f, 0.187506557f},
    {32767, 1, -0.998487711f, 0.0549756922f}, {32767, 5, 0.449299395f, 0.893381238f},
    {32767, 20, -0.962802351f, -0.27020672f}, {32767, 63, 0.999173403f, 0.0406506024f},
    {100000, 0, -0.9993608f, 0.0357487984f},  {100000, 1, -0.714835703f, 0.699292481f},
    {100000, 5, -0.864971578f, 0.501820862f}, {100000, 20, 0.0844962075f, 0.996423781f},
    {100000, 63, 0.992310226f, 0.123775534f}, {131071, 0, -0.817983508f, -0.575241685f},
    {131071, 1, -0.590004981f, 0.807399631f}, {131071, 5, 0.664185464f, -0.747567832f},
    {131071, 20, 0.422612876f, 0.90631032f},  {131071, 63, 0.986801445f, 0.161934748f},
};

TEST(OpsRope, MatchesTransformersAngles) {
  const int HD = 128, half = HD / 2;
  const float theta = 1e6f;
  for (const auto& g : kHfGolden) {
    std::vector<float> x(HD, 0.0f), y(HD);
    x[g.j] = 1.0f;
    const int32_t pos = g.pos;
    ops::rope_forward(y.data(), x.data(), &pos, 1, 1, HD, theta);
    // torch evaluates cos/sin with ~1 ulp (SLEEF) and we round the double value: ~1e-7.
    // An angle formed in double instead of fp32 misses by up to ~4e-3 at pos 1e5.
    EXPECT_NEAR(y[g.j], g.c, 1e-6) << "pos " << g.pos << " j " << g.j;
    EXPECT_NEAR(y[g.j + half], g.s, 1e-6) << "pos " << g.pos << " j " << g.j;
  }
}

TEST(OpsRope, InPlaceEqualsOutOfPlace) {
  const int H = 2, HD = 8;
  const std::vector<int32_t> pos = {3, 9, 0, 250};
  const long N = (long)pos.size();
  auto x = random_vector(N * H * HD, 2);
  std::vector<float> y(x.size());
  ops::rope_forward(y.data(), x.data(), pos.data(), N, H, HD, 10000.0f);
  auto z = x;
  ops::rope_forward(z.data(), z.data(), pos.data(), N, H, HD, 10000.0f);
  EXPECT_EQ(y, z);
  std::vector<float> d(x.size());
  ops::rope_backward(d.data(), x.data(), pos.data(), N, H, HD, 10000.0f);
  auto e = x;
  ops::rope_backward(e.data(), e.data(), pos.data(), N, H, HD, 10000.0f);
  EXPECT_EQ(d, e);
}

// Inference computes a pass's angles once (rope_angles) and rotates every layer's q and k with them:
// bitwise rope_forward, in place or not, for head counts of q and of k, and enough rows to run in parallel.
TEST(OpsRope, AnglesComputedOnceGiveBitwiseRopeForward) {
  const int HD = 64;
  for (const long N : {1L, 5L, 300L}) {
    std::vector<int32_t> pos(N);
    for (long n = 0; n < N; n++) pos[n] = (int32_t)((n * 7919) % 70000);
    std::vector<float> cs(N * HD / 2), sn(N * HD / 2);
    ops::rope_angles(cs.data(), sn.data(), pos.data(), N, HD, 1e6f);
    for (const int H : {16, 8}) {
      auto x = random_vector(N * H * HD, 3 + H);
      std::vector<float> want(x.size()), got(x.size());
      ops::rope_forward(want.data(), x.data(), pos.data(), N, H, HD, 1e6f);
      ops::rope_forward_angles(got.data(), x.data(), cs.data(), sn.data(), N, H, HD);
      EXPECT_EQ(want, got) << "N " << N << " H " << H;
      ops::rope_forward_angles(x.data(), x.data(), cs.data(), sn.data(), N, H, HD);
      EXPECT_EQ(want, x) << "in place, N " << N << " H " << H;
    }
  }
}

TEST(OpsRope, BackwardInvertsForward) {
  const int H = 2, HD = 12;
  const std::vector<int32_t> pos = {1, 4, 77, 1000};
  const long N = (long)pos.size();
  auto x = random_vector(N * H * HD, 3);
  std::vector<float> y(x.size()), z(x.size());
  ops::rope_forward(y.data(), x.data(), pos.data(), N, H, HD, 500000.0f);
  ops::rope_backward(z.data(), y.data(), pos.data(), N, H, HD, 500000.0f);
  for (size_t i = 0; i < x.size(); i++) EXPECT_NEAR(z[i], x[i], 1e-6);  // two fp32 rotations
}

TEST(OpsRope, GradientMatchesFiniteDifference) {
  const int H = 3, HD = 8;
  const float theta = 10000.0f;
  const std::vector<int32_t> pos = {0, 2, 5, 31, 400};
  const long N = (long)pos.size();
  auto x = random_vector(N * H * HD, 4);
  const auto r = random_vector(x.size(), 5);
  std::vector<float> y(x.size()), dx(x.size());
  ops::rope_backward(dx.data(), r.data(), pos.data(), N, H, HD, theta);
  auto loss = [&] {
    ops::rope_forward(y.data(), x.data(), pos.data(), N, H, HD, theta);
    return testing::weighted_sum(y, r);
  };
  testing::expect_gradient_close(testing::finite_difference(x, dx, loss), "rope dinp");
}

TEST(OpsRope, OddHeadDimIsAnError) {
  std::vector<float> x(3), y(3);
  const int32_t pos = 0;
  EXPECT_THROW(ops::rope_forward(y.data(), x.data(), &pos, 1, 1, 3, 10000.0f), Error);
}

}  // namespace
}  // namespace moetron

// DeepSeek's interleaved pairs (rope.h): transformers rotates (2j, 2j+1) and writes the result
// de-interleaved; moetron keeps the pairs in place.  The two agree up to that permutation, at an
// offset inside the head, and the dims outside [offset, offset + R) pass unchanged.
TEST(RopeSpec, InterleavedIsRotateHalfOfThePermutedDims) {
  const int N = 5, H = 2, HD = 12, off = 4, R = 8;
  std::vector<float> x(N * H * HD);
  for (size_t i = 0; i < x.size(); i++) x[i] = std::sin(0.37f * (float)i) + 0.1f * (float)(i % 7);
  std::vector<int32_t> pos = {0, 3, 17, 250, 4000};
  moetron::ops::RopeSpec spec{10000.0f};
  spec.rotary_dim = R;
  spec.offset = off;
  spec.interleaved = true;
  std::vector<float> y(x.size());
  moetron::ops::rope_forward(y.data(), x.data(), pos.data(), N, H, HD, spec);
  // The reference: de-interleave the rotated dims (2j -> j, 2j+1 -> j + R/2) of a copy of x, apply
  // rotate-half to an R-dim head, interleave back.
  std::vector<float> xr(N * H * R), yr(xr.size());
  for (int n = 0; n < N * H; n++)
    for (int j = 0; j < R / 2; j++) {
      xr[n * R + j] = x[n * HD + off + 2 * j];
      xr[n * R + j + R / 2] = x[n * HD + off + 2 * j + 1];
    }
  moetron::ops::rope_forward(yr.data(), xr.data(), pos.data(), N, H, R, 10000.0f);
  for (int n = 0; n < N * H; n++) {
    for (int d = 0; d < off; d++) {
      EXPECT_EQ(y[n * HD + d], x[n * HD + d]);
    }
    for (int j = 0; j < R / 2; j++) {
      EXPECT_EQ(y[n * HD + off + 2 * j], yr[n * R + j]) << n << " " << j;
      EXPECT_EQ(y[n * HD + off + 2 * j + 1], yr[n * R + j + R / 2]) << n << " " << j;
    }
  }
}

// YaRN's frequencies (transformers' _compute_yarn_parameters): dims below the ramp keep theta's,
// dims above it are divided by the factor, the ramp blends linearly; the attention factor scales
// the rotation (|y| = af |x| per pair).
TEST(RopeSpec, YarnFrequenciesAndAttentionFactor) {
  moetron::ops::RopeSpec spec{10000.0f};
  spec.yarn = true;
  spec.yarn_factor = 4.0f;
  spec.yarn_low = 1.0f;
  spec.yarn_high = 3.0f;
  spec.attention_factor = 1.25f;
  const int R = 10;
  const std::vector<float> f = moetron::ops::rope_inv_freq(spec, R);
  const auto plain = [](int j) { return 1.0f / std::pow(10000.0f, (float)(2 * j) / 10.0f); };
  EXPECT_FLOAT_EQ(f[0], plain(0));
  EXPECT_FLOAT_EQ(f[1], plain(1));         // ramp 0
  EXPECT_FLOAT_EQ(f[2], 0.5f * plain(2) + 0.5f * plain(2) / 4.0f);  // ramp 0.5
  EXPECT_FLOAT_EQ(f[3], plain(3) / 4.0f);  // ramp 1
  EXPECT_FLOAT_EQ(f[4], plain(4) / 4.0f);
  std::vector<float> x = {1.0f, 2.0f, -0.5f, 0.25f, 3.0f, 1.0f, 0.0f, -2.0f, 0.5f, 0.5f}, y(10);
  const int32_t p = 7;
  moetron::ops::rope_forward(y.data(), x.data(), &p, 1, 1, R, spec);
  for (int j = 0; j < R / 2; j++) {
    const double nx = std::hypot(x[j], x[j + 5]), ny = std::hypot(y[j], y[j + 5]);
    EXPECT_NEAR(ny, 1.25 * nx, 1e-5) << j;
  }
}

