#include "backend/attention_bf16.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/dtype.h"

namespace moetron {

namespace {

struct Shape {
  int B, T, NH, NKV, HD;
  size_t qi(int b, int t, int h) const { return (((size_t)b * T + t) * NH + h) * HD; }
  size_t ki(int b, int t, int g) const { return (((size_t)b * T + t) * NKV + g) * HD; }
};

inline float rb(float x, bool round) { return round ? bf16_to_f32(f32_to_bf16(x)) : x; }

bool visible(const ops::AttentionMask& m, int T, int b, int i, int j) {
  if (j > i) return false;
  if (m.sliding_window > 0 && i - j >= m.sliding_window) return false;
  if (m.attention_mask && m.attention_mask[b * T + j] == 0) return false;
  if (m.segment_ids && m.segment_ids[b * T + j] != m.segment_ids[b * T + i]) return false;
  return true;
}

}  // namespace

void attention_bf16_forward(float* out, float* probs32, float* probs16, const float* q, const float* k,
                            const float* v, const ops::AttentionMask& mask, int B, int T, int NH, int NKV, int HD,
                            bool round) {
  const Shape s{B, T, NH, NKV, HD};
  const int G = NH / NKV;
  const float scale = 1.0f / std::sqrt((float)HD);
  std::fill(out, out + (size_t)B * T * NH * HD, 0.0f);
  std::fill(probs32, probs32 + (size_t)B * NH * T * T, 0.0f);
  std::fill(probs16, probs16 + (size_t)B * NH * T * T, 0.0f);
#pragma omp parallel for collapse(2) schedule(static)
  for (int b = 0; b < B; b++)
    for (int h = 0; h < NH; h++) {
      std::vector<float> sc(T);
      for (int i = 0; i < T; i++) {
        float m = -INFINITY;
        for (int j = 0; j < T; j++) {
          double d = 0.0;
          for (int e = 0; e < HD; e++) d += (double)q[s.qi(b, i, h) + e] * k[s.ki(b, j, h / G) + e];
          sc[j] = rb(rb((float)d, round) * scale, round);
          if (visible(mask, T, b, i, j)) m = std::max(m, sc[j]);
        }
        if (m == -INFINITY) continue;  // no visible key: zeros
        double z = 0.0;
        for (int j = 0; j < T; j++)
          if (visible(mask, T, b, i, j)) z += std::exp((double)sc[j] - m);
        float* p32 = &probs32[(((size_t)b * NH + h) * T + i) * T];
        float* p16 = &probs16[(((size_t)b * NH + h) * T + i) * T];
        for (int j = 0; j < T; j++) {
          p32[j] = visible(mask, T, b, i, j) ? (float)(std::exp((double)sc[j] - m) / z) : 0.0f;
          p16[j] = rb(p32[j], round);
        }
        for (int e = 0; e < HD; e++) {
          double o = 0.0;
          for (int j = 0; j < T; j++) o += (double)p16[j] * v[s.ki(b, j, h / G) + e];
          out[s.qi(b, i, h) + e] = rb((float)o, round);
        }
      }
    }
}

void attention_bf16_backward(float* dq, float* dk, float* dv, const float* dout, const float* probs32,
                             const float* probs16, const float* q, const float* k, const float* v, int B, int T,
                             int NH, int NKV, int HD, bool round) {
  const Shape s{B, T, NH, NKV, HD};
  const int G = NH / NKV;
  const float scale = 1.0f / std::sqrt((float)HD);
  std::fill(dq, dq + (size_t)B * T * NH * HD, 0.0f);
  // Per query head: its dK / dV contributions (rounded, as autograd materialises them in bf16),
  // then summed over the G heads sharing a kv head in head order and rounded.
  std::vector<float> dk_h((size_t)B * NH * T * HD), dv_h(dk_h.size());
#pragma omp parallel for collapse(2) schedule(static)
  for (int b = 0; b < B; b++)
    for (int h = 0; h < NH; h++) {
      const int g = h / G;
      const float* P32 = &probs32[((size_t)b * NH + h) * T * T];
      const float* P16 = &probs16[((size_t)b * NH + h) * T * T];
      std::vector<float> ds((size_t)T * T), dp(T);
      for (int i = 0; i < T; i++) {
        double pdp = 0.0;
        for (int j = 0; j < T; j++) {
          double d = 0.0;
          for (int e = 0; e < HD; e++) d += (double)dout[s.qi(b, i, h) + e] * v[s.ki(b, j, g) + e];
          dp[j] = rb((float)d, round);
          pdp += (double)P32[(size_t)i * T + j] * dp[j];
        }
        for (int j = 0; j < T; j++) {
          const float dsij = rb((float)((double)P32[(size_t)i * T + j] * (dp[j] - pdp)), round);
          ds[(size_t)i * T + j] = rb(dsij * scale, round);
        }
      }
      for (int i = 0; i < T; i++)
        for (int e = 0; e < HD; e++) {
          double a = 0.0;
          for (int j = 0; j < T; j++) a += (double)ds[(size_t)i * T + j] * k[s.ki(b, j, g) + e];
          dq[s.qi(b, i, h) + e] = rb((float)a, round);
        }
      for (int j = 0; j < T; j++)
        for (int e = 0; e < HD; e++) {
          double a = 0.0, c = 0.0;
          for (int i = 0; i < T; i++) {
            a += (double)ds[(size_t)i * T + j] * q[s.qi(b, i, h) + e];
            c += (double)P16[(size_t)i * T + j] * dout[s.qi(b, i, h) + e];
          }
          const size_t o = (((size_t)b * NH + h) * T + j) * HD + e;
          dk_h[o] = rb((float)a, round);
          dv_h[o] = rb((float)c, round);
        }
    }
  for (int b = 0; b < B; b++)
    for (int j = 0; j < T; j++)
      for (int g = 0; g < NKV; g++)
        for (int e = 0; e < HD; e++) {
          double a = 0.0, c = 0.0;
          for (int h = g * G; h < (g + 1) * G; h++) {
            const size_t o = (((size_t)b * NH + h) * T + j) * HD + e;
            a += dk_h[o];
            c += dv_h[o];
          }
          dk[s.ki(b, j, g) + e] = rb((float)a, round);
          dv[s.ki(b, j, g) + e] = rb((float)c, round);
        }
}

}  // namespace moetron
