// Rotary position embedding; see rope.h for the conventions.
//
// The angle is computed exactly as transformers does in fp32:
//   inv_freq[j] = 1.0f / powf(theta, (float)(2j) / (float)R)      (fp32 pow and reciprocal)
//   angle       = (float)pos * inv_freq[j]                       (fp32 product)
// and cos/sin are evaluated in double on that fp32 angle, then rounded to fp32.  Rounding the
// angle to fp32 matters: at pos ~ 1e5 the fp32 angle differs from the exact one by ~1e-2 rad.
#include "ops/rope.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"

namespace moetron::ops {

namespace {

// Below this many elements a parallel region costs more than it saves.
constexpr long kParallelMin = 1 << 15;

// Row n's cos and sign * sin (R/2 values each) of its angles, times the attention factor.
void angles_row(float* cs, float* sn, int32_t pos, const float* inv_freq, int half, float sign, float af) {
  const float p = (float)pos;
  for (int j = 0; j < half; j++) {
    const float angle = p * inv_freq[j];
    cs[j] = (float)std::cos((double)angle) * af;
    sn[j] = sign * ((float)std::sin((double)angle) * af);
  }
}

// One token's H heads rotated by its angles: the pairs of dims [offset, offset + R) of each head;
// the rest copied (when out is not inp).
void rotate_row(float* out, const float* inp, const float* cs, const float* sn, int H, int HD, int R,
                const RopeSpec& spec) {
  const int half = R / 2, o = spec.offset;
  for (int h = 0; h < H; h++) {
    const float* x = inp + (size_t)h * HD;
    float* y = out + (size_t)h * HD;
    if (y != x) {
      for (int j = 0; j < o; j++) y[j] = x[j];
      for (int j = o + R; j < HD; j++) y[j] = x[j];
    }
    for (int j = 0; j < half; j++) {
      const int a = spec.interleaved ? o + 2 * j : o + j, b = spec.interleaved ? a + 1 : a + half;
      const float x1 = x[a], x2 = x[b];  // read both before writing (out may alias)
      // HF: q * cos + rotate_half(q) * sin, rotate_half(q) = cat(-q2, q1)
      y[a] = x1 * cs[j] + (-x2) * sn[j];
      y[b] = x2 * cs[j] + x1 * sn[j];
    }
  }
}

int check(const char* op, long N, int H, int HD, const RopeSpec& spec) {
  const int R = spec.rotated(HD);
  MOETRON_OP_CHECK(N >= 0 && H > 0 && HD > 0, op, "bad dimensions N={} H={} HD={}", N, H, HD);
  MOETRON_OP_CHECK(spec.offset >= 0 && R > 0 && R % 2 == 0 && spec.offset + R <= HD, op,
                   "rotated dims [{}, {}) must be an even, non-empty range inside the head of HD={}", spec.offset,
                   spec.offset + R, HD);
  MOETRON_OP_CHECK(spec.theta > 0.0f, op, "rope theta must be positive, got {}", spec.theta);
  return R;
}

// sign = +1: forward rotation; sign = -1: inverse rotation (the transpose, for the backward).
void rope_apply(const char* op, float* out, const float* inp, const int32_t* pos, long N, int H, int HD,
                const RopeSpec& spec, float sign) {
  const int R = check(op, N, H, HD, spec), half = R / 2;
  const std::vector<float> inv_freq = rope_inv_freq(spec, R);
#pragma omp parallel if (N * H * HD >= kParallelMin)
  {
    std::vector<float> cs(half), sn(half);
#pragma omp for schedule(static)
    for (long n = 0; n < N; n++) {
      angles_row(cs.data(), sn.data(), pos[n], inv_freq.data(), half, sign, spec.attention_factor);
      rotate_row(out + n * H * HD, inp + n * H * HD, cs.data(), sn.data(), H, HD, R, spec);
    }
  }
}

}  // namespace

std::vector<float> rope_inv_freq(const RopeSpec& spec, int R) {
  const int half = R / 2;
  std::vector<float> inv_freq(half);
  for (int j = 0; j < half; j++) {
    const float exponent = (float)(2 * j) / (float)R;
    if (!spec.yarn) {
      inv_freq[j] = 1.0f / std::pow(spec.theta, exponent);  // float overload: fp32 pow
      continue;
    }
    // transformers' _compute_yarn_parameters: extrapolated below the ramp, interpolated (/ factor)
    // above it, linearly blended across [low, high] (high nudged when equal, as transformers does).
    const float pos_freq = std::pow(spec.theta, exponent);
    const float extrapolation = 1.0f / pos_freq, interpolation = 1.0f / (spec.yarn_factor * pos_freq);
    const float high = spec.yarn_high == spec.yarn_low ? spec.yarn_high + 0.001f : spec.yarn_high;
    const float ramp = std::clamp(((float)j - spec.yarn_low) / (high - spec.yarn_low), 0.0f, 1.0f);
    const float extrapolation_factor = 1.0f - ramp;
    inv_freq[j] = interpolation * (1.0f - extrapolation_factor) + extrapolation * extrapolation_factor;
  }
  return inv_freq;
}

void rope_forward(float* out, const float* inp, const int32_t* pos, long N, int H, int HD, const RopeSpec& spec) {
  rope_apply("rope_forward", out, inp, pos, N, H, HD, spec, 1.0f);
}

void rope_backward(float* dinp, const float* dout, const int32_t* pos, long N, int H, int HD, const RopeSpec& spec) {
  // The rotation is orthogonal (times the attention factor), so the gradient is the inverse rotation.
  rope_apply("rope_backward", dinp, dout, pos, N, H, HD, spec, -1.0f);
}

void rope_angles(float* cs, float* sn, const int32_t* pos, long N, int R, const RopeSpec& spec) {
  RopeSpec whole = spec;  // the angles of an R-dim rotation
  whole.offset = 0;
  whole.rotary_dim = R;
  check("rope_angles", N, 1, R, whole);
  const int half = R / 2;
  const std::vector<float> inv_freq = rope_inv_freq(spec, R);
  for (long n = 0; n < N; n++)
    angles_row(cs + n * half, sn + n * half, pos[n], inv_freq.data(), half, 1.0f, spec.attention_factor);
}

void rope_forward_angles(float* out, const float* inp, const float* cs, const float* sn, long N, int H, int HD,
                         const RopeSpec& spec) {
  const int R = check("rope_forward_angles", N, H, HD, spec), half = R / 2;
#pragma omp parallel for schedule(static) if (N * H * HD >= kParallelMin)
  for (long n = 0; n < N; n++)
    rotate_row(out + n * H * HD, inp + n * H * HD, cs + n * half, sn + n * half, H, HD, R, spec);
}

}  // namespace moetron::ops
