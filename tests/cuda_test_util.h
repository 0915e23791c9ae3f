// Helpers shared by the CUDA tests (tests/test_cuda_*.cpp): skipping without a GPU, device buffers,
// bf16 rounding on the host, the error metric and the naive bf16 attention of the tolerance rule.
//
// The tolerance rule for bf16 paths (FlashAttention's, DESIGN §5): both the CUDA result and a
// NAIVE implementation in the same precision -- the same maths on the same bf16 inputs, every
// stored intermediate rounded to bf16 (attention: the scores and the probabilities materialised in
// bf16, as PyTorch's eager attention in bf16) -- are compared with an fp32/fp64 reference computed
// on the same input values, and the CUDA error must be at most twice the naive one:
//     err_cuda <= 2 * err_naive + floor,   err = max |x - ref|  over the tensor.
// floor = 1e-6 * max|ref| absorbs fp32 summation-order noise where the naive error happens to be
// ~0 (e.g. an output that is an exact bf16 copy); it is far below any bf16 rounding (4e-3 rel).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/dtype.h"
#include "cuda/runtime.h"

namespace moetron::testing {

// Skips the current test (from a test body or SetUp) when no CUDA device can be used.
#define MOETRON_REQUIRE_GPU()                                                                  \
  do {                                                                                         \
    const std::string why_ = ::moetron::gpu::cuda_unavailable_reason();                        \
    if (!why_.empty()) GTEST_SKIP() << "CUDA test skipped: " << why_;                          \
  } while (0)

inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }
inline std::vector<float> round_bf16(std::vector<float> v) {
  for (float& x : v) x = round_bf16(x);
  return v;
}
inline void round_bf16_inplace(float* p, size_t n) {
  for (size_t i = 0; i < n; i++) p[i] = round_bf16(p[i]);
}

inline double max_abs(const std::vector<float>& v) {
  double m = 0.0;
  for (float x : v) m = std::max(m, (double)std::fabs(x));
  return m;
}
inline double max_abs_err(const float* a, const float* ref, size_t n) {
  double m = 0.0;
  for (size_t i = 0; i < n; i++) {
    const double d = std::fabs((double)a[i] - (double)ref[i]);
    if (!(d <= m)) m = d;  // NaN wins
  }
  return m;
}
inline double max_abs_err(const std::vector<float>& a, const std::vector<float>& ref) {
  EXPECT_EQ(a.size(), ref.size());
  return max_abs_err(a.data(), ref.data(), std::min(a.size(), ref.size()));
}

// The rule above; `what` names the tensor in the failure message.
inline void expect_bf16_rule(const std::vector<float>& cuda, const std::vector<float>& naive,
                             const std::vector<float>& ref, const std::string& what) {
  const double e_cuda = max_abs_err(cuda, ref), e_naive = max_abs_err(naive, ref);
  const double floor = 1e-6 * max_abs(ref);
  EXPECT_LE(e_cuda, 2.0 * e_naive + floor)
      << what << ": CUDA error " << e_cuda << " vs naive bf16 error " << e_naive << " (max|ref| " << max_abs(ref)
      << ")";
}

// fp32 paths: max |a - ref| <= rel * max|ref| + abs.
inline void expect_close(const std::vector<float>& a, const std::vector<float>& ref, double rel, double abs,
                         const std::string& what) {
  const double e = max_abs_err(a, ref), bound = rel * max_abs(ref) + abs;
  EXPECT_LE(e, bound) << what << ": max error " << e << " > " << bound << " (max|ref| " << max_abs(ref) << ")";
}

// Device memory for one test: an arena plus typed upload/download helpers.
class DeviceBuffers {
 public:
  DeviceBuffers(gpu::Context& ctx, size_t bytes) : ctx_(ctx), arena_(bytes, "test buffers") {}
  gpu::Bf16* bf16(const std::vector<float>& host) {
    gpu::Bf16* p = arena_.take_n<gpu::Bf16>(std::max<size_t>(host.size(), 1));
    gpu::upload_bf16(ctx_, p, host.data(), host.size());
    return p;
  }
  gpu::Bf16* bf16_zero(size_t n) {
    gpu::Bf16* p = arena_.take_n<gpu::Bf16>(std::max<size_t>(n, 1));
    gpu::fill_zero(ctx_, p, n * 2);
    return p;
  }
  template <typename T>
  T* copy(const std::vector<T>& host) {
    T* p = arena_.take_n<T>(std::max<size_t>(host.size(), 1));
    gpu::copy_to_device(ctx_, p, host.data(), host.size() * sizeof(T));
    return p;
  }
  template <typename T>
  T* zero(size_t n) {
    T* p = arena_.take_n<T>(std::max<size_t>(n, 1));
    gpu::fill_zero(ctx_, p, n * sizeof(T));
    return p;
  }
  std::vector<float> get_bf16(const gpu::Bf16* p, size_t n) {
    std::vector<float> h(n);
    gpu::download_bf16(ctx_, h.data(), p, n);
    return h;
  }
  template <typename T>
  std::vector<T> get(const T* p, size_t n) {
    std::vector<T> h(n);
    gpu::copy_to_host(ctx_, h.data(), p, n * sizeof(T));
    return h;
  }

 private:
  gpu::Context& ctx_;
  gpu::DeviceArena arena_;
};

// ---- naive bf16 attention (PyTorch eager attention in bf16, as transformers runs it) ----------
//   q[B,T,NH,HD], k/v[B,T,NKV,HD] packed; all values already bf16.  Forward:
//   S = bf16(bf16(q k^T) * scale), masked; P = bf16(softmax_fp32(S)); out = bf16(P v).
//   Backward (autograd of the same graph): dP = bf16(dO v^T); dV_h = bf16(P^T dO);
//   dS = bf16(P32 * (dP - sum P32 dP)); dS' = bf16(dS * scale); dQ = bf16(dS' K);
//   dK_h = bf16(dS'^T Q); GQA sums the G heads' dK_h/dV_h and rounds (repeat_kv's backward).
struct NaiveAttention {
  int B, T, NH, NKV, HD;
  const int32_t* amask = nullptr;  // host [B,T] or null
  const int32_t* seg = nullptr;    // host [B,T] or null
  int window = 0;
  bool round = true;  // false: the same computation without bf16 rounding (checks this code itself)

  float rb(float x) const { return round ? round_bf16(x) : x; }
  bool visible(int b, int i, int j) const {
    if (j > i) return false;
    if (window > 0 && i - j >= window) return false;
    if (amask && amask[b * T + j] == 0) return false;
    if (seg && seg[b * T + j] != seg[b * T + i]) return false;
    return true;
  }
  size_t qi(int b, int t, int h) const { return (((size_t)b * T + t) * NH + h) * HD; }
  size_t ki(int b, int t, int g) const { return (((size_t)b * T + t) * NKV + g) * HD; }

  // probs32 / probs16 [B,NH,T,T] are kept for the backward.
  void forward(std::vector<float>& out, const std::vector<float>& q, const std::vector<float>& k,
               const std::vector<float>& v) {
    const int G = NH / NKV;
    const float scale = 1.0f / std::sqrt((float)HD);
    out.assign((size_t)B * T * NH * HD, 0.0f);
    probs32.assign((size_t)B * NH * T * T, 0.0f);
    probs16.assign((size_t)B * NH * T * T, 0.0f);
    std::vector<float> s(T);
    for (int b = 0; b < B; b++)
      for (int h = 0; h < NH; h++)
        for (int i = 0; i < T; i++) {
          float m = -INFINITY;
          for (int j = 0; j < T; j++) {
            double d = 0.0;
            for (int e = 0; e < HD; e++) d += (double)q[qi(b, i, h) + e] * k[ki(b, j, h / G) + e];
            s[j] = rb(rb((float)d) * scale);
            if (visible(b, i, j)) m = std::max(m, s[j]);
          }
          if (m == -INFINITY) continue;  // no visible key: zeros
          double z = 0.0;
          for (int j = 0; j < T; j++)
            if (visible(b, i, j)) z += std::exp((double)s[j] - m);
          float* p32 = &probs32[(((size_t)b * NH + h) * T + i) * T];
          float* p16 = &probs16[(((size_t)b * NH + h) * T + i) * T];
          for (int j = 0; j < T; j++) {
            p32[j] = visible(b, i, j) ? (float)(std::exp((double)s[j] - m) / z) : 0.0f;
            p16[j] = rb(p32[j]);
          }
          for (int e = 0; e < HD; e++) {
            double o = 0.0;
            for (int j = 0; j < T; j++) o += (double)p16[j] * v[ki(b, j, h / G) + e];
            out[qi(b, i, h) + e] = rb((float)o);
          }
        }
  }

  void backward(std::vector<float>& dq, std::vector<float>& dk, std::vector<float>& dv, const std::vector<float>& dout,
                const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v) const {
    const int G = NH / NKV;
    const float scale = 1.0f / std::sqrt((float)HD);
    dq.assign((size_t)B * T * NH * HD, 0.0f);
    std::vector<double> dk_acc((size_t)B * T * NKV * HD, 0.0), dv_acc((size_t)B * T * NKV * HD, 0.0);
    std::vector<float> ds((size_t)T * T), dp(T);
    for (int b = 0; b < B; b++)
      for (int h = 0; h < NH; h++) {
        const int g = h / G;
        const float* P32 = &probs32[((size_t)b * NH + h) * T * T];
        const float* P16 = &probs16[((size_t)b * NH + h) * T * T];
        for (int i = 0; i < T; i++) {
          double pdp = 0.0;
          for (int j = 0; j < T; j++) {
            double d = 0.0;
            for (int e = 0; e < HD; e++) d += (double)dout[qi(b, i, h) + e] * v[ki(b, j, g) + e];
            dp[j] = rb((float)d);
            pdp += (double)P32[(size_t)i * T + j] * dp[j];
          }
          for (int j = 0; j < T; j++) {
            const float dsij = rb((float)((double)P32[(size_t)i * T + j] * (dp[j] - pdp)));
            ds[(size_t)i * T + j] = rb(dsij * scale);
          }
        }
        for (int i = 0; i < T; i++)
          for (int e = 0; e < HD; e++) {
            double a = 0.0;
            for (int j = 0; j < T; j++) a += (double)ds[(size_t)i * T + j] * k[ki(b, j, g) + e];
            dq[qi(b, i, h) + e] = rb((float)a);
          }
        for (int j = 0; j < T; j++)
          for (int e = 0; e < HD; e++) {
            double a = 0.0, c = 0.0;
            for (int i = 0; i < T; i++) {
              a += (double)ds[(size_t)i * T + j] * q[qi(b, i, h) + e];
              c += (double)P16[(size_t)i * T + j] * dout[qi(b, i, h) + e];
            }
            dk_acc[ki(b, j, g) + e] += rb((float)a);
            dv_acc[ki(b, j, g) + e] += rb((float)c);
          }
      }
    dk.resize(dk_acc.size());
    dv.resize(dv_acc.size());
    for (size_t i = 0; i < dk_acc.size(); i++) {
      dk[i] = rb((float)dk_acc[i]);
      dv[i] = rb((float)dv_acc[i]);
    }
  }

  std::vector<float> probs32 = {}, probs16 = {};
};

}  // namespace moetron::testing
