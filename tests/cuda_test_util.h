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

#include "backend/attention_bf16.h"
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
// The bf16 CPU backend's attention (src/backend/attention_bf16.h) with its saved probabilities
// kept here: q[B,T,NH,HD], k/v[B,T,NKV,HD] packed, all values already bf16.
struct NaiveAttention {
  int B, T, NH, NKV, HD;
  const int32_t* amask = nullptr;  // host [B,T] or null
  const int32_t* seg = nullptr;    // host [B,T] or null
  int window = 0;
  bool round = true;  // false: the same computation without bf16 rounding (checks this code itself)

  bool visible(int b, int i, int j) const {
    if (j > i) return false;
    if (window > 0 && i - j >= window) return false;
    if (amask && amask[b * T + j] == 0) return false;
    if (seg && seg[b * T + j] != seg[b * T + i]) return false;
    return true;
  }
  size_t qi(int b, int t, int h) const { return (((size_t)b * T + t) * NH + h) * HD; }
  size_t ki(int b, int t, int g) const { return (((size_t)b * T + t) * NKV + g) * HD; }
  ops::AttentionMask mask() const {
    ops::AttentionMask m;
    m.attention_mask = amask;
    m.segment_ids = seg;
    m.sliding_window = window;
    return m;
  }
  void forward(std::vector<float>& out, const std::vector<float>& q, const std::vector<float>& k,
               const std::vector<float>& v) {
    out.assign((size_t)B * T * NH * HD, 0.0f);
    probs32.assign((size_t)B * NH * T * T, 0.0f);
    probs16.assign((size_t)B * NH * T * T, 0.0f);
    attention_bf16_forward(out.data(), probs32.data(), probs16.data(), q.data(), k.data(), v.data(), mask(), B, T, NH,
                           NKV, HD, round);
  }
  void backward(std::vector<float>& dq, std::vector<float>& dk, std::vector<float>& dv, const std::vector<float>& dout,
                const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v) const {
    dq.assign((size_t)B * T * NH * HD, 0.0f);
    dk.assign((size_t)B * T * NKV * HD, 0.0f);
    dv.assign((size_t)B * T * NKV * HD, 0.0f);
    attention_bf16_backward(dq.data(), dk.data(), dv.data(), dout.data(), probs32.data(), probs16.data(), q.data(),
                            k.data(), v.data(), B, T, NH, NKV, HD, round);
  }

  std::vector<float> probs32 = {}, probs16 = {};
};

}  // namespace moetron::testing
