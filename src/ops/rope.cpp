// Rotary position embedding, HF "rotate half" convention.  N tokens, H heads, HD head dim.
// Activation gradients assign (=).
//
// The angle is computed exactly as transformers does in fp32:
//   inv_freq[j] = 1.0f / powf(theta, (float)(2j) / (float)HD)      (fp32 pow and reciprocal)
//   angle       = (float)pos * inv_freq[j]                        (fp32 product)
// and cos/sin are evaluated in double on that fp32 angle, then rounded to fp32.  Rounding the
// angle to fp32 matters: at pos ~ 1e5 the fp32 angle differs from the exact one by ~1e-2 rad.
#include "ops/rope.h"

#include <cmath>
#include <vector>

#include "core/error.h"

namespace moetron::ops {

namespace {

// Below this many elements a parallel region costs more than it saves.
constexpr long kParallelMin = 1 << 15;

std::vector<float> rope_inv_freq(int HD, float theta) {
  const int half = HD / 2;
  std::vector<float> inv_freq(half);
  for (int j = 0; j < half; j++) {
    const float exponent = (float)(2 * j) / (float)HD;
    inv_freq[j] = 1.0f / std::pow(theta, exponent);  // float overload: fp32 pow
  }
  return inv_freq;
}

// Row n's cos and sign * sin (half values each) of its angles (pos * inv_freq, fp32; cos, sin in double).
void angles_row(float* cs, float* sn, int32_t pos, const float* inv_freq, int half, float sign) {
  const float p = (float)pos;
  for (int j = 0; j < half; j++) {
    const float angle = p * inv_freq[j];
    cs[j] = (float)std::cos((double)angle);
    sn[j] = sign * (float)std::sin((double)angle);
  }
}

// One token's H heads rotated by its angles (cs, sn: R/2 values each): the first R dims of each
// head; the rest copied (when out is not inp).
void rotate_row(float* out, const float* inp, const float* cs, const float* sn, int H, int HD, int R) {
  const int half = R / 2;
  for (int h = 0; h < H; h++) {
    const float* x = inp + (size_t)h * HD;
    float* y = out + (size_t)h * HD;
    if (y != x)
      for (int j = R; j < HD; j++) y[j] = x[j];
    for (int j = 0; j < half; j++) {
      const float x1 = x[j], x2 = x[j + half];  // read both before writing (out may alias)
      // HF: q * cos + rotate_half(q) * sin, rotate_half(q) = cat(-q2, q1)
      y[j] = x1 * cs[j] + (-x2) * sn[j];
      y[j + half] = x2 * cs[j] + x1 * sn[j];
    }
  }
}

void check_dims(const char* op, long N, int H, int HD, int R = 0) {
  MOETRON_OP_CHECK(N >= 0 && H > 0 && HD > 0 && HD % 2 == 0, op, "bad dimensions N={} H={} HD={} (HD must be even)", N,
                   H, HD);
  MOETRON_OP_CHECK(R >= 0 && R <= HD && R % 2 == 0, op, "rotated dims R={} must be even and at most HD={}", R, HD);
}

// sign = +1: forward rotation; sign = -1: inverse rotation (the transpose, for the backward).
void rope_apply(const char* op, float* out, const float* inp, const int32_t* pos, long N, int H, int HD, float theta,
                float sign, int R) {
  check_dims(op, N, H, HD, R);
  MOETRON_OP_CHECK(theta > 0.0f, op, "rope theta must be positive, got {}", theta);
  if (R == 0) R = HD;
  const int half = R / 2;
  const std::vector<float> inv_freq = rope_inv_freq(R, theta);
#pragma omp parallel if (N * H * HD >= kParallelMin)
  {
    std::vector<float> cs(half), sn(half);
#pragma omp for schedule(static)
    for (long n = 0; n < N; n++) {
      angles_row(cs.data(), sn.data(), pos[n], inv_freq.data(), half, sign);
      rotate_row(out + n * H * HD, inp + n * H * HD, cs.data(), sn.data(), H, HD, R);
    }
  }
}

}  // namespace

void rope_forward(float* out, const float* inp, const int32_t* pos, long N, int H, int HD, float theta, int R) {
  rope_apply("rope_forward", out, inp, pos, N, H, HD, theta, 1.0f, R);
}

void rope_backward(float* dinp, const float* dout, const int32_t* pos, long N, int H, int HD, float theta, int R) {
  // The rotation is orthogonal, so the gradient is the inverse rotation (sin -> -sin).
  rope_apply("rope_backward", dinp, dout, pos, N, H, HD, theta, -1.0f, R);
}

void rope_angles(float* cs, float* sn, const int32_t* pos, long N, int HD, float theta) {
  check_dims("rope_angles", N, 1, HD);
  MOETRON_OP_CHECK(theta > 0.0f, "rope_angles", "rope theta must be positive, got {}", theta);
  const int half = HD / 2;
  const std::vector<float> inv_freq = rope_inv_freq(HD, theta);
  for (long n = 0; n < N; n++) angles_row(cs + n * half, sn + n * half, pos[n], inv_freq.data(), half, 1.0f);
}

void rope_forward_angles(float* out, const float* inp, const float* cs, const float* sn, long N, int H, int HD, int R) {
  check_dims("rope_forward_angles", N, H, HD, R);
  if (R == 0) R = HD;
  const int half = R / 2;
#pragma omp parallel for schedule(static) if (N * H * HD >= kParallelMin)
  for (long n = 0; n < N; n++) rotate_row(out + n * H * HD, inp + n * H * HD, cs + n * half, sn + n * half, H, HD, R);
}

}  // namespace moetron::ops
