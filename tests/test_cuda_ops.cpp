// CUDA backend op by op against the CPU ops (src/ops), forward and backward.
// The kernels' own contracts the op-case table (test_backend_ops.cpp, through the Backend interface)
// does not reach stay here: `+=` vs `=` variants, in-place and strided buffers, fp32 outputs, the
// device routing plan, exact copies; the embedding lookup and SwiGLU (the table's embedding and
// experts cases) went to the table.
//
// Every CUDA op gets inputs whose values are exactly representable in bf16, and the CPU reference
// runs in fp32 on those same values.  Tolerances (and why):
//   - bf16 outputs: the rule of tests/cuda_test_util.h -- error <= 2x the error of a naive
//     same-precision implementation (for single-step ops that is the reference rounded to bf16;
//     for attention, PyTorch-style eager attention with bf16 scores and probabilities);
//   - fp32 outputs of fp32 maths on identical inputs: max error <= 1e-6 .. 1e-5 x max|ref|, the
//     spread of fp32 summation orders over the reduction lengths used here (<= 1000 terms);
//   - exact operations (copies, permutations, the routing decisions) must match exactly.
// Without a GPU (or built without CUDA) every test here skips with the reason, except the first,
// which checks that the backend reports its absence cleanly.
#include <cmath>
#include <optional>
#include <cstring>
#include <fstream>
#include <memory>
#include <numeric>
#include <ostream>
#include <sstream>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "core/rng.h"
#include "cuda/attention_cudnn.h"
#include "cuda/grouped_gemm.h"
#include "cuda/ops.h"
#include "cuda/runtime.h"
#include "cuda_test_util.h"
#include "gradcheck.h"
#include "ops/attention.h"
#include "ops/cross_entropy.h"
#include "ops/matmul.h"
#include "ops/moe_dispatch.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/router.h"
#include "ops/swiglu.h"
#include "optim/adamw.h"

namespace moetron {
namespace {

using testing::DeviceBuffers;
using testing::expect_bf16_rule;
using testing::expect_close;
using testing::random_vector;
using testing::round_bf16;

// bf16-valued random data.
std::vector<float> rnd(size_t n, uint32_t seed, float scale = 1.0f) { return round_bf16(random_vector(n, seed, scale)); }

// cuBLASLt is opened at the first CUDA context, not at program start: linked, it costs every process
// ~210 MB of resident memory before main() (src/cuda/cublaslt.cuh).  The first test of this file, so
// no earlier test has made a context; needs no GPU (the library loads without one).
TEST(CudaBackend, CublasLtLoadsOnFirstUseOnly) {
  if (!gpu::cuda_compiled()) {
    EXPECT_THROW(gpu::load_gpu_libraries(), Error);
    GTEST_SKIP() << "built without CUDA";
  }
  auto mapped = [] {
    std::ifstream maps("/proc/self/maps");
    std::stringstream ss;
    ss << maps.rdbuf();
    return ss.str().find("libcublasLt") != std::string::npos;
  };
  EXPECT_FALSE(mapped()) << "libcublasLt is mapped before any CUDA context was made";
  EXPECT_EQ(gpu::load_gpu_libraries(), "CUBLAS_STATUS_SUCCESS");
  EXPECT_TRUE(mapped());
}

TEST(CudaBackend, ReportsWhetherItCanRun) {
  const std::string why = gpu::cuda_unavailable_reason();
  if (!gpu::cuda_compiled()) {
    EXPECT_EQ(why, "built without CUDA");
  }
  if (why.empty()) {
    const gpu::DeviceInfo info = gpu::device_info();
    EXPECT_FALSE(info.name.empty());
    EXPECT_GT(info.total_bytes, 0u);
    return;
  }
  // No usable device: creating a context fails with an Error that says why (never a crash).
  try {
    gpu::Context ctx;
    ADD_FAILURE() << "a Context was created although: " << why;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(gpu::cuda_compiled() ? "CUDA" : "built without CUDA"), std::string::npos)
        << e.what();
  }
}

// cuDNN's fused attention (src/cuda/attention_cudnn.h) is compiled into a CUDA build -- its frontend
// headers come from scripts/fetch-gpu-headers.sh, which the setup runs -- and says, without a GPU,
// why it cannot run (never a crash); where libcudnn loads it names what the graph does not express.
TEST(CudaBackend, CudnnAttentionIsCompiledAndSaysWhyNot) {
  if (!gpu::cuda_compiled()) GTEST_SKIP() << "built without CUDA";
  gpu::CudnnAttention a(nullptr);
  EXPECT_EQ(a.unavailable().find("built without"), std::string::npos) << a.unavailable();
  std::printf("cuDNN attention here: %s\n", a.unavailable().empty() ? a.version().c_str() : a.unavailable().c_str());
  const gpu::CudnnSdpaShape plain{1, 16, 4, 2, 64, 0}, odd{1, 16, 4, 2, 12, 0};
  if (!a.unavailable().empty()) {
    EXPECT_EQ(a.why_not(plain, false), a.unavailable());
    return;
  }
  EXPECT_NE(a.version().find("cuDNN 9."), std::string::npos) << a.version();
  EXPECT_EQ(a.why_not(plain, false), "");
  EXPECT_NE(a.why_not(plain, true).find("padding mask"), std::string::npos);
  EXPECT_NE(a.why_not(odd, false).find("head dim 12"), std::string::npos);
}

// The CUTLASS grouped GEMM is compiled into a CUDA build (its headers come from
// scripts/fetch-gpu-headers.sh); without a GPU it says so rather than crash.
TEST(CudaBackend, GroupedGemmIsCompiled) {
  if (!gpu::cuda_compiled()) GTEST_SKIP() << "built without CUDA";
  const std::string why = gpu::grouped_gemm_unavailable();
  EXPECT_EQ(why.find("built without"), std::string::npos) << why;
  std::printf("grouped GEMM here: %s\n", why.empty() ? "CUTLASS sm_90a" : why.c_str());
}

class CudaOps : public ::testing::Test {
 protected:
  void SetUp() override {
    MOETRON_REQUIRE_GPU();
    ctx = std::make_unique<gpu::Context>();
    buf = std::make_unique<DeviceBuffers>(*ctx, size_t(256) << 20);
  }
  std::unique_ptr<gpu::Context> ctx;
  std::unique_ptr<DeviceBuffers> buf;
};

TEST_F(CudaOps, ConvertRoundsToNearestEvenAsTheHost) {
  std::vector<float> x = random_vector(4096, 1, 3.0f);
  const float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, 1.0f + 1.0f / 256, 1.0f + 3.0f / 256, 65504.0f, 1e30f,
                            -2.5e-20f};
  for (float s : specials) x.push_back(s);
  float* d = buf->copy(x);
  gpu::Bf16* b = buf->bf16_zero(x.size());
  gpu::convert_to_bf16(*ctx, b, d, x.size());
  const std::vector<float> back = buf->get_bf16(b, x.size());
  for (size_t i = 0; i < x.size(); i++) EXPECT_EQ(f32_bits(back[i]), f32_bits(round_bf16(x[i]))) << "element " << i;
  float* f = buf->zero<float>(x.size());
  gpu::convert_to_f32(*ctx, f, b, x.size());
  const std::vector<float> widened = buf->get(f, x.size());
  for (size_t i = 0; i < x.size(); i++) EXPECT_EQ(f32_bits(widened[i]), f32_bits(back[i]));
}

// Row-major reference C = alpha op(A) op(B) + beta C in double.
std::vector<float> gemm_ref(bool ta, bool tb, int M, int N, int K, float alpha, const std::vector<float>& A,
                            const std::vector<float>& B, float beta, const std::vector<float>& C) {
  std::vector<float> out(C);
  for (int m = 0; m < M; m++)
    for (int n = 0; n < N; n++) {
      double s = 0.0;
      for (int k = 0; k < K; k++)
        s += (double)(ta ? A[(size_t)k * M + m] : A[(size_t)m * K + k]) * (tb ? B[(size_t)n * K + k] : B[(size_t)k * N + n]);
      out[(size_t)m * N + n] = (float)(alpha * s + beta * (double)C[(size_t)m * N + n]);
    }
  return out;
}

TEST_F(CudaOps, GemmEveryTransposeInBf16AndFp32) {
  const int M = 40, N = 56, K = 72;
  for (int ta = 0; ta < 2; ta++)
    for (int tb = 0; tb < 2; tb++) {
      SCOPED_TRACE(::testing::Message() << "trans_a " << ta << " trans_b " << tb);
      const std::vector<float> A = rnd((size_t)M * K, 10 + ta), B = rnd((size_t)K * N, 20 + tb);
      const std::vector<float> C0 = rnd((size_t)M * N, 30);
      const long lda = ta ? M : K, ldb = tb ? K : N;
      const std::vector<float> ref = gemm_ref(ta, tb, M, N, K, 1.5f, A, B, 0.5f, C0);
      // bf16 operands, bf16 output
      gpu::Bf16* c16 = buf->bf16(C0);
      gpu::gemm(*ctx, ta, tb, M, N, K, 1.5f, buf->bf16(A), lda, buf->bf16(B), ldb, 0.5f, c16, N, DType::BF16,
                DType::BF16);
      expect_bf16_rule(buf->get_bf16(c16, C0.size()), round_bf16(ref), ref, "bf16 gemm, bf16 out");
      // bf16 operands, fp32 output (fp32 accumulation: summation order only)
      float* c32 = buf->copy(C0);
      gpu::gemm(*ctx, ta, tb, M, N, K, 1.5f, buf->bf16(A), lda, buf->bf16(B), ldb, 0.5f, c32, N, DType::BF16,
                DType::F32);
      expect_close(buf->get(c32, C0.size()), ref, 1e-5, 0.0, "bf16 gemm, fp32 out");
      // fp32 operands: true fp32 (no TF32: that would miss by ~1e-3)
      const std::vector<float> Af = random_vector((size_t)M * K, 40), Bf = random_vector((size_t)K * N, 50);
      const std::vector<float> reff = gemm_ref(ta, tb, M, N, K, 1.5f, Af, Bf, 0.5f, C0);
      float* cf = buf->copy(C0);
      gpu::gemm(*ctx, ta, tb, M, N, K, 1.5f, buf->copy(Af), lda, buf->copy(Bf), ldb, 0.5f, cf, N, DType::F32,
                DType::F32);
      expect_close(buf->get(cf, C0.size()), reff, 1e-5, 0.0, "fp32 gemm");
    }
}

// The grouped GEMM (cuda/grouped_gemm.h): on an H100 every group's product in one CUTLASS launch,
// both B layouts, alpha and beta, an empty group, groups of a few rows and of several tiles, and a
// strided A and D -- each group against the double reference under the bf16 rule.  Elsewhere it
// declines (returns false) and the caller's per-expert loop runs.
TEST_F(CudaOps, GroupedGemmEveryGroupAsItsOwnGemm) {
  const std::string why = gpu::grouped_gemm_unavailable();
  const int N = 48, K = 64, groups = 4;
  const long lda = 72, ldd = 56;  // wider than K and N: strided operands
  const std::vector<int64_t> offsets = {0, 3, 3, 133, 200};  // group 1 empty
  const long rows = offsets.back();
  const std::vector<float> A = rnd((size_t)rows * lda, 1), D0 = rnd((size_t)rows * ldd, 2);
  for (bool trans_b : {true, false}) {
    SCOPED_TRACE(trans_b ? "B as [N, K]" : "B as [K, N]");
    const std::vector<float> B = rnd((size_t)groups * N * K, trans_b ? 3 : 4, 0.3f);
    gpu::Bf16* d = buf->bf16(D0);
    const bool ran = gpu::grouped_gemm_bf16(*ctx, trans_b, d, buf->bf16(A), buf->bf16(B), offsets, groups, N, K, lda,
                                            ldd, 1.5f, 0.5f);
    if (!why.empty()) {
      EXPECT_FALSE(ran) << "declined here: " << why;
      continue;
    }
    ASSERT_TRUE(ran);
    const std::vector<float> got = buf->get_bf16(d, D0.size());
    for (int g = 0; g < groups; g++) {
      const long r0 = offsets[g], m = offsets[g + 1] - r0;
      if (m == 0) continue;
      std::vector<float> a((size_t)m * K), c((size_t)m * N), out((size_t)m * N);
      for (long i = 0; i < m; i++)
        for (int k = 0; k < K; k++) a[i * K + k] = round_bf16(A[(r0 + i) * lda + k]);
      for (long i = 0; i < m; i++)
        for (int n = 0; n < N; n++) {
          c[i * N + n] = round_bf16(D0[(r0 + i) * ldd + n]);
          out[i * N + n] = got[(r0 + i) * ldd + n];
        }
      std::vector<float> b(B.begin() + (size_t)g * N * K, B.begin() + (size_t)(g + 1) * N * K);
      for (float& v : b) v = round_bf16(v);
      const std::vector<float> ref = gemm_ref(false, trans_b, (int)m, N, K, 1.5f, a, b, 0.5f, c);
      expect_bf16_rule(out, round_bf16(ref), ref, "group " + std::to_string(g));
    }
    // Columns past N in the strided D are untouched.
    for (long i = 0; i < rows; i++)
      for (long n = N; n < ldd; n++) ASSERT_EQ(got[i * ldd + n], round_bf16(D0[i * ldd + n])) << i << "," << n;
  }
}

TEST_F(CudaOps, Fp32GemmWithOddShapes) {
  // The router's GEMMs: E = 3 columns, unaligned row strides.
  const int M = 29, N = 3, K = 47;
  const std::vector<float> A = random_vector((size_t)M * K, 1), B = random_vector((size_t)N * K, 2), C0(M * N, 0.0f);
  float* c = buf->zero<float>(C0.size());
  gpu::gemm(*ctx, false, true, M, N, K, 1.0f, buf->copy(A), K, buf->copy(B), K, 0.0f, c, N, DType::F32, DType::F32);
  expect_close(buf->get(c, C0.size()), gemm_ref(false, true, M, N, K, 1.0f, A, B, 0.0f, C0), 1e-5, 0.0, "odd fp32");
}

TEST_F(CudaOps, MatmulForwardAndBackward) {
  const int N = 50, IC = 64, OC = 96;
  const std::vector<float> x = rnd((size_t)N * IC, 1), w = rnd((size_t)OC * IC, 2, 0.2f), dout = rnd((size_t)N * OC, 3);
  std::vector<float> ref((size_t)N * OC);
  ops::matmul_forward(ref.data(), x.data(), w.data(), N, IC, OC);
  gpu::Bf16 *dx = buf->bf16(x), *dw = buf->bf16(w);
  gpu::Bf16* out = buf->bf16_zero(ref.size());
  gpu::matmul_forward(*ctx, out, dx, dw, N, IC, OC);
  expect_bf16_rule(buf->get_bf16(out, ref.size()), round_bf16(ref), ref, "matmul_forward");

  const std::vector<float> base = random_vector(ref.size(), 4);
  float* acc = buf->copy(base);
  gpu::matmul_forward_f32(*ctx, acc, dx, dw, N, IC, OC, true);
  std::vector<float> ref_acc(base);
  for (size_t i = 0; i < ref.size(); i++) ref_acc[i] += ref[i];
  expect_close(buf->get(acc, ref.size()), ref_acc, 1e-5, 0.0, "matmul_forward_f32 accumulate");

  std::vector<float> dinp_ref((size_t)N * IC), dw_ref = random_vector(w.size(), 5);
  float* dwg = buf->copy(dw_ref);  // accumulates onto these
  ops::matmul_backward(dinp_ref.data(), dw_ref.data(), dout.data(), x.data(), w.data(), N, IC, OC);
  gpu::Bf16* dinp = buf->bf16_zero(dinp_ref.size());
  gpu::matmul_backward(*ctx, dinp, dwg, buf->bf16(dout), dx, dw, N, IC, OC);
  expect_bf16_rule(buf->get_bf16(dinp, dinp_ref.size()), round_bf16(dinp_ref), dinp_ref, "matmul dinp");
  expect_close(buf->get(dwg, w.size()), dw_ref, 1e-5, 0.0, "matmul dweight (+=)");
}

TEST_F(CudaOps, RmsnormForwardAndBackward) {
  const long N = 37;
  const int C = 200;
  const std::vector<float> x = random_vector((size_t)N * C, 1, 2.0f), dout = random_vector((size_t)N * C, 3);
  std::vector<float> w = random_vector(C, 2, 0.1f);
  for (float& v : w) v += 1.0f;
  std::vector<float> out((size_t)N * C), rstd(N);
  ops::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, 1e-5f);
  float *dx = buf->copy(x), *dwt = buf->copy(w);
  gpu::Bf16* o16 = buf->bf16_zero(out.size());
  float* o32 = buf->zero<float>(out.size());
  float* r = buf->zero<float>(N);
  gpu::rmsnorm_forward(*ctx, o16, DType::BF16, r, dx, dwt, N, C, 1e-5f);
  gpu::rmsnorm_forward(*ctx, o32, DType::F32, nullptr, dx, dwt, N, C, 1e-5f);
  expect_bf16_rule(buf->get_bf16(o16, out.size()), round_bf16(out), out, "rmsnorm out (bf16)");
  expect_close(buf->get(o32, out.size()), out, 1e-5, 0.0, "rmsnorm out (fp32)");
  expect_close(buf->get(r, N), rstd, 1e-5, 0.0, "rmsnorm rstd");

  std::vector<float> dinp((size_t)N * C), dw_ref = random_vector(C, 4);
  float* dwg = buf->copy(dw_ref);
  ops::rmsnorm_backward(dinp.data(), dw_ref.data(), dout.data(), x.data(), w.data(), rstd.data(), N, C);
  float* ddout = buf->copy(dout);
  float* di = buf->zero<float>(dinp.size());
  gpu::rmsnorm_backward(*ctx, di, dwg, ddout, dx, dwt, r, N, C, false);
  expect_close(buf->get(di, dinp.size()), dinp, 1e-5, 0.0, "rmsnorm dinp (=)");
  expect_close(buf->get(dwg, C), dw_ref, 1e-5, 0.0, "rmsnorm dweight (+=)");
  // accumulate into the residual-stream gradient
  const std::vector<float> res = random_vector(dinp.size(), 5);
  float* dres = buf->copy(res);
  gpu::rmsnorm_backward(*ctx, dres, nullptr, ddout, dx, dwt, r, N, C, true);
  std::vector<float> res_ref(res);
  for (size_t i = 0; i < res.size(); i++) res_ref[i] += dinp[i];
  expect_close(buf->get(dres, res.size()), res_ref, 1e-5, 0.0, "rmsnorm dinp (+=)");
}

TEST_F(CudaOps, RopeForwardAndBackwardOnAStridedBuffer) {
  const long N = 18;
  const int H = 3, HD = 16;
  const long stride = (long)H * HD + 8;  // q inside a wider row, as in the fused qkv buffer
  for (float theta : {1e4f, 1e6f}) {
    std::vector<int32_t> pos(N);
    for (long n = 0; n < N; n++) pos[n] = (int32_t)(n < 9 ? n : 4990 + n * 7);
    const std::vector<float> buf_host = rnd((size_t)N * stride, 1);
    for (int dir = 0; dir < 2; dir++) {
      // reference on the packed [N,H,HD] view
      std::vector<float> packed((size_t)N * H * HD), ref(packed.size());
      for (long n = 0; n < N; n++)
        std::memcpy(&packed[(size_t)n * H * HD], &buf_host[(size_t)n * stride], sizeof(float) * H * HD);
      if (dir == 0)
        ops::rope_forward(ref.data(), packed.data(), pos.data(), N, H, HD, theta);
      else
        ops::rope_backward(ref.data(), packed.data(), pos.data(), N, H, HD, theta);
      gpu::Bf16* d = buf->bf16(buf_host);
      if (dir == 0)
        gpu::rope_forward(*ctx, d, d, stride, buf->copy(pos), N, H, HD, theta);
      else
        gpu::rope_backward(*ctx, d, d, stride, buf->copy(pos), N, H, HD, theta);
      const std::vector<float> got_all = buf->get_bf16(d, buf_host.size());
      std::vector<float> got(packed.size());
      for (long n = 0; n < N; n++) {
        std::memcpy(&got[(size_t)n * H * HD], &got_all[(size_t)n * stride], sizeof(float) * H * HD);
        for (long c = (long)H * HD; c < stride; c++)
          EXPECT_EQ(got_all[(size_t)n * stride + c], buf_host[(size_t)n * stride + c]) << "column outside the heads";
      }
      expect_bf16_rule(got, round_bf16(ref), ref, dir == 0 ? "rope forward" : "rope backward");
    }
  }
}

struct AttnCase {
  const char* name;
  int B, T, NH, NKV, HD;
  int window = 0;
  bool padding = false, segments = false, fused = false;
};

void PrintTo(const AttnCase& c, std::ostream* os) {
  *os << c.name << " (B=" << c.B << " T=" << c.T << " NH=" << c.NH << " NKV=" << c.NKV << " HD=" << c.HD
      << " window=" << c.window << ")";
}

class CudaAttention : public CudaOps, public ::testing::WithParamInterface<AttnCase> {};

// log2-domain logsumexp of the scaled scores of one query (0 when nothing is visible).
double lse2_ref(const testing::NaiveAttention& na, const std::vector<float>& q, const std::vector<float>& k, int b,
                int h, int i) {
  const int G = na.NH / na.NKV;
  double m = -INFINITY;
  std::vector<double> s(na.T, -INFINITY);
  for (int j = 0; j < na.T; j++) {
    if (!na.visible(b, i, j)) continue;
    double d = 0.0;
    for (int e = 0; e < na.HD; e++) d += (double)q[na.qi(b, i, h) + e] * k[na.ki(b, j, h / G) + e];
    s[j] = d / std::sqrt((double)na.HD);
    m = std::max(m, s[j]);
  }
  if (m == -INFINITY) return 0.0;
  double z = 0.0;
  for (int j = 0; j < na.T; j++)
    if (s[j] > -INFINITY) z += std::exp(s[j] - m);
  return (m + std::log(z)) / std::log(2.0);
}

// Runs everywhere: the naive attention of the rule, without rounding, is the CPU reference.
TEST(NaiveAttention, WithoutRoundingItIsTheCpuReference) {
  const int B = 2, T = 33, NH = 4, NKV = 2, HD = 8;
  const size_t nq = (size_t)B * T * NH * HD, nk = (size_t)B * T * NKV * HD;
  const std::vector<float> q = rnd(nq, 1, 1.5f), k = rnd(nk, 2, 1.5f), v = rnd(nk, 3), dout = rnd(nq, 4);
  std::vector<int32_t> amask((size_t)B * T, 1), seg((size_t)B * T, 0);
  for (int t = 25; t < T; t++) amask[T + t] = 0;
  for (int t = 12; t < T; t++) seg[t] = 1;
  ops::AttentionMask m;
  m.attention_mask = amask.data();
  m.segment_ids = seg.data();
  m.sliding_window = 9;
  std::vector<float> out_ref(nq), probs((size_t)B * NH * T * T), dq_ref(nq), dk_ref(nk), dv_ref(nk);
  ops::attention_forward(out_ref.data(), probs.data(), q.data(), k.data(), v.data(), m, B, T, NH, NKV, HD);
  ops::attention_backward(dq_ref.data(), dk_ref.data(), dv_ref.data(), dout.data(), probs.data(), q.data(), k.data(),
                          v.data(), B, T, NH, NKV, HD);
  testing::NaiveAttention na{B, T, NH, NKV, HD, amask.data(), seg.data(), 9, false};
  std::vector<float> out, dq, dk, dv;
  na.forward(out, q, k, v);
  na.backward(dq, dk, dv, dout, q, k, v);
  expect_close(out, out_ref, 1e-5, 0.0, "out");
  expect_close(dq, dq_ref, 1e-5, 0.0, "dq");
  expect_close(dk, dk_ref, 1e-5, 0.0, "dk");
  expect_close(dv, dv_ref, 1e-5, 0.0, "dv");
  // With rounding the error is bf16-sized: well above fp32 noise, well below O(1).
  testing::NaiveAttention nb{B, T, NH, NKV, HD, amask.data(), seg.data(), 9, true};
  nb.forward(out, q, k, v);
  nb.backward(dq, dk, dv, dout, q, k, v);
  const double e = testing::max_abs_err(out, out_ref) / testing::max_abs(out_ref);
  EXPECT_GT(e, 1e-4);
  EXPECT_LT(e, 3e-2);
}

TEST_P(CudaAttention, ForwardAndBackwardMeetTheFlashAttentionRule) {
  const AttnCase c = GetParam();
  const int B = c.B, T = c.T, NH = c.NH, NKV = c.NKV, HD = c.HD;
  const size_t nq = (size_t)B * T * NH * HD, nk = (size_t)B * T * NKV * HD;
  // Sharper than uniform attention (q, k scaled), so masking and the softmax matter.
  const std::vector<float> q = rnd(nq, 1, 1.5f), k = rnd(nk, 2, 1.5f), v = rnd(nk, 3), dout = rnd(nq, 4);
  std::vector<int32_t> amask, seg;
  if (c.padding) {
    amask.assign((size_t)B * T, 1);
    for (int t = T - T / 4; t < T; t++) amask[(size_t)(B - 1) * T + t] = 0;  // right padding
    amask[0] = 0;  // query 0 of row 0 then sees no key: zeros, lse 0
  }
  if (c.segments) {
    seg.assign((size_t)B * T, 0);
    for (int t = 0; t < T; t++) seg[t] = t < 30 ? 0 : (t < 55 ? 1 : 2);
  }
  ops::AttentionMask m;
  m.attention_mask = amask.empty() ? nullptr : amask.data();
  m.segment_ids = seg.empty() ? nullptr : seg.data();
  m.sliding_window = c.window;

  // fp32 reference on the bf16 values
  std::vector<float> out_ref(nq), probs((size_t)B * NH * T * T), dq_ref(nq), dk_ref(nk), dv_ref(nk);
  ops::attention_forward(out_ref.data(), probs.data(), q.data(), k.data(), v.data(), m, B, T, NH, NKV, HD);
  ops::attention_backward(dq_ref.data(), dk_ref.data(), dv_ref.data(), dout.data(), probs.data(), q.data(), k.data(),
                          v.data(), B, T, NH, NKV, HD);
  // naive bf16
  testing::NaiveAttention na{B, T, NH, NKV, HD, m.attention_mask, m.segment_ids, c.window};
  std::vector<float> out_naive, dq_naive, dk_naive, dv_naive;
  na.forward(out_naive, q, k, v);
  na.backward(dq_naive, dk_naive, dv_naive, dout, q, k, v);

  // CUDA: separate buffers, or one fused [N, Q+2KV] buffer as the model uses
  const long N = (long)B * T, Qw = (long)NH * HD, KVw = (long)NKV * HD, S = Qw + 2 * KVw;
  gpu::Bf16 *dq_, *dk_, *dv_, *gq, *gk, *gv;
  long qs = 0, ks = 0;
  if (c.fused) {
    std::vector<float> qkv((size_t)N * S);
    for (long n = 0; n < N; n++) {
      std::memcpy(&qkv[n * S], &q[n * Qw], sizeof(float) * Qw);
      std::memcpy(&qkv[n * S + Qw], &k[n * KVw], sizeof(float) * KVw);
      std::memcpy(&qkv[n * S + Qw + KVw], &v[n * KVw], sizeof(float) * KVw);
    }
    gq = buf->bf16(qkv);
    gk = gq + Qw;
    gv = gq + Qw + KVw;
    dq_ = buf->bf16_zero(qkv.size());
    dk_ = dq_ + Qw;
    dv_ = dq_ + Qw + KVw;
    qs = ks = S;
  } else {
    gq = buf->bf16(q);
    gk = buf->bf16(k);
    gv = buf->bf16(v);
    dq_ = buf->bf16_zero(nq);
    dk_ = buf->bf16_zero(nk);
    dv_ = buf->bf16_zero(nk);
  }
  gpu::AttentionMask gm;
  gm.attention_mask = amask.empty() ? nullptr : buf->copy(amask);
  gm.segment_ids = seg.empty() ? nullptr : buf->copy(seg);
  gm.sliding_window = c.window;
  gpu::Bf16* out = buf->bf16_zero(nq);
  float* lse = buf->zero<float>((size_t)B * NH * T);
  gpu::attention_forward(*ctx, out, lse, gq, gk, gv, gm, B, T, NH, NKV, HD, qs, ks);
  float* scratch = buf->zero<float>(gpu::attention_backward_scratch_floats(B, T, NH, HD));
  gpu::attention_backward(*ctx, dq_, dk_, dv_, scratch, buf->bf16(dout), out, lse, gq, gk, gv, gm, B, T, NH, NKV, HD,
                          qs, ks);

  const std::vector<float> out_cuda = buf->get_bf16(out, nq);
  expect_bf16_rule(out_cuda, out_naive, out_ref, "attention out");
  auto unpack = [&](gpu::Bf16* p, long width, long stride) {
    const std::vector<float> all = buf->get_bf16(p, (size_t)(N - 1) * (stride ? stride : width) + width);
    std::vector<float> r((size_t)N * width);
    for (long n = 0; n < N; n++)
      std::memcpy(&r[n * width], &all[n * (stride ? stride : width)], sizeof(float) * width);
    return r;
  };
  expect_bf16_rule(unpack(dq_, Qw, qs), dq_naive, dq_ref, "attention dq");
  expect_bf16_rule(unpack(dk_, KVw, ks), dk_naive, dk_ref, "attention dk");
  expect_bf16_rule(unpack(dv_, KVw, ks), dv_naive, dv_ref, "attention dv");

  const std::vector<float> lse_cuda = buf->get(lse, (size_t)B * NH * T);
  double worst = 0.0;
  for (int b = 0; b < B; b++)
    for (int h = 0; h < NH; h++)
      for (int i = 0; i < T; i++)
        worst = std::max(worst, std::fabs(lse_cuda[((size_t)b * NH + h) * T + i] - lse2_ref(na, q, k, b, h, i)));
  EXPECT_LE(worst, 1e-4) << "lse (log2 domain; fp32 scores of bf16 inputs)";
  if (c.padding) {
    for (int h = 0; h < NH; h++) {
      EXPECT_EQ(lse_cuda[(size_t)h * T], 0.0f) << "query 0 of row 0 sees no key";
      for (int e = 0; e < HD; e++) EXPECT_EQ(out_cuda[(size_t)h * HD + e], 0.0f);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, CudaAttention,
    ::testing::Values(AttnCase{"causal_gqa", 2, 100, 4, 2, 32}, AttnCase{"window_fused", 2, 100, 4, 2, 32, 23, false, false, true},
                      AttnCase{"padding_mqa", 2, 77, 4, 1, 64, 0, true}, AttnCase{"segments_mha", 2, 90, 2, 2, 16, 0, false, true},
                      AttnCase{"hd128_three_tiles", 1, 150, 2, 1, 128, 0, false, false, true},
                      AttnCase{"hd8_golden_shape", 2, 16, 4, 2, 8, 5, true},
                      AttnCase{"hd12_unaligned", 1, 40, 3, 1, 12, 0, false, true}),
    [](const ::testing::TestParamInfo<AttnCase>& info) { return std::string(info.param.name); });

TEST_F(CudaOps, RouterForwardStatsAndBackward) {
  struct RC {
    long N;
    int E, K;
  };
  // Softmax cases, then DeepSeek-V3's sigmoid rule (256 experts in 8 groups, 4 searched, K 8, the
  // selection bias) and Kimi-K2's (384 experts, one group).
  ops::RouterSpec ds;
  ds.sigmoid = true;
  ds.n_group = 8;
  ds.topk_group = 4;
  ds.scale = 2.5f;
  ops::RouterSpec kimi = ds;
  kimi.n_group = kimi.topk_group = 1;
  kimi.scale = 2.827f;
  struct SC {
    long N;
    int E, K;
    std::optional<ops::RouterSpec> spec;  // none: softmax, renormalised and not
  };
  for (const SC rc : {SC{300, 8, 2, {}}, SC{77, 3, 1, {}}, SC{64, 64, 6, {}}, SC{200, 256, 8, ds}, SC{50, 384, 8, kimi}}) {
    SCOPED_TRACE(::testing::Message() << "E=" << rc.E << " K=" << rc.K << (rc.spec ? " sigmoid" : ""));
    const long N = rc.N;
    const int E = rc.E, K = rc.K;
    const std::vector<float> logits = random_vector((size_t)N * E, 1, 2.0f);
    const std::vector<float> bias = random_vector((size_t)E, 3, 0.05f);
    std::vector<uint8_t> mask(N, 1);
    for (long n = 0; n < N; n += 5) mask[n] = 0;
    std::vector<float> probs((size_t)N * E), tw((size_t)N * K);
    std::vector<int32_t> ti((size_t)N * K);
   for (bool renorm : {true, false}) {
    SCOPED_TRACE(renorm ? "renormalised" : "not renormalised");
    ops::RouterSpec spec = rc.spec.value_or(ops::RouterSpec{});
    spec.renormalize = renorm;
    const float* hb = spec.sigmoid ? bias.data() : nullptr;
    ops::router_forward(probs.data(), ti.data(), tw.data(), logits.data(), hb, N, E, K, spec);
    float* dl = buf->copy(logits);
    float *gp = buf->zero<float>(probs.size()), *gw = buf->zero<float>(tw.size());
    int32_t* gi = buf->zero<int32_t>(ti.size());
    gpu::router_forward(*ctx, gp, gi, gw, dl, spec.sigmoid ? buf->copy(bias) : nullptr, N, E, K, spec);
    expect_close(buf->get(gp, probs.size()), probs, 1e-6, 0.0, "router probs");
    EXPECT_EQ(buf->get(gi, ti.size()), ti) << "top-k choices";
    expect_close(buf->get(gw, tw.size()), tw, 1e-6, 0.0, "top-k weights");

    ops::RouterLayerStats st;
    ops::router_layer_stats(st, logits.data(), probs.data(), ti.data(), mask.data(), N, E, K);
    uint8_t* gmask = buf->copy(mask);
    double* gst = buf->zero<double>(2 * E + 2);
    gpu::router_layer_stats(*ctx, gst, dl, gp, gi, gmask, N, E, K);
    const std::vector<double> s = buf->get(gst, 2 * E + 2);
    for (int e = 0; e < E; e++) {
      EXPECT_EQ(s[e], st.assigned[e]) << "assigned " << e;
      EXPECT_NEAR(s[E + e], st.prob_sum[e], 1e-9 * N) << "prob_sum " << e;
    }
    EXPECT_EQ(s[2 * E], st.tokens);
    EXPECT_NEAR(s[2 * E + 1], st.z_sum, 1e-9 * std::fabs(st.z_sum));

    const std::vector<float> dtw = random_vector(tw.size(), 2);
    std::vector<double> daux(E);
    for (int e = 0; e < E; e++) daux[e] = 0.01 * (e + 1);
    std::vector<float> dref((size_t)N * E);
    ops::router_backward(dref.data(), dtw.data(), daux.data(), mask.data(), probs.data(), ti.data(), tw.data(), N, E,
                         K, spec);
    float* gd = buf->zero<float>(dref.size());
    gpu::router_backward(*ctx, gd, buf->copy(dtw), daux.data(), gmask, gp, gi, gw, N, E, K, spec);
    expect_close(buf->get(gd, dref.size()), dref, 1e-5, 1e-9, "router dlogits");
    // z-loss accumulates on top
    ops::router_z_loss_backward(dref.data(), logits.data(), probs.data(), mask.data(), N, E, 0.3f);
    long real = 0;
    for (uint8_t x : mask) real += x;
    gpu::router_z_loss_backward(*ctx, gd, dl, gp, gmask, N, E, 0.3f, real);
    expect_close(buf->get(gd, dref.size()), dref, 1e-5, 1e-9, "router dlogits + z-loss");
   }
  }
}

// A routing with an empty expert (2) and skewed loads.
std::vector<int32_t> skewed_topk(long N, int K) {
  const int allowed[3] = {0, 1, 3};
  std::vector<int32_t> t((size_t)N * K);
  for (long n = 0; n < N; n++) {
    const int first = n % 4 == 0 ? 3 : (int)(mix64(n) % 2);  // expert 0/1 heavy, 3 light
    t[n * K] = first;
    for (int k = 1; k < K; k++) {
      int e = allowed[mix64(n * 31 + k) % 3];
      while (e == first) e = allowed[(mix64(n * 31 + k + 7) + (uint64_t)e) % 3];
      t[n * K + k] = e;
    }
  }
  return t;
}

struct MoeSetup {
  long N = 50;
  int E = 4, K = 2, C = 64, I = 48;
  std::vector<int32_t> topk;
  ops::MoePlan plan;
  gpu::MoePlanDevice gplan;
};

void build_plans(MoeSetup& s, gpu::Context& ctx, DeviceBuffers& buf) {
  s.topk = skewed_topk(s.N, s.K);
  ops::moe_plan_build(s.plan, s.topk.data(), s.N, s.E, s.K);
  const long M = s.N * s.K;
  gpu::moe_plan_build(ctx, s.gplan, buf.zero<int32_t>(M), buf.zero<int32_t>(M), buf.zero<int64_t>(s.E + 1),
                      buf.copy(s.topk), s.N, s.E, s.K);
}

TEST_F(CudaOps, MoePlanPermuteAndCombine) {
  MoeSetup s;
  build_plans(s, *ctx, *buf);
  const long N = s.N, M = N * s.K;
  const int C = s.C;
  ASSERT_EQ(s.plan.expert_offsets[3], s.plan.expert_offsets[2]) << "expert 2 is empty by construction";
  EXPECT_EQ(s.gplan.expert_offsets, s.plan.expert_offsets);
  EXPECT_EQ(buf->get(s.gplan.row_token, M), s.plan.row_token);
  EXPECT_EQ(buf->get(s.gplan.row_of, M), s.plan.row_of);

  const std::vector<float> x = rnd((size_t)N * C, 1);
  std::vector<float> xp((size_t)M * C);
  ops::moe_permute_forward(xp.data(), x.data(), s.plan, C);
  gpu::Bf16* gxp = buf->bf16_zero(xp.size());
  gpu::moe_permute_forward(*ctx, gxp, buf->bf16(x), s.gplan, C);
  EXPECT_EQ(buf->get_bf16(gxp, xp.size()), xp) << "permute is a copy";

  const std::vector<float> dxp = rnd((size_t)M * C, 2);
  std::vector<float> dx((size_t)N * C);
  ops::moe_permute_backward(dx.data(), dxp.data(), s.plan, C);
  gpu::Bf16* gdxp = buf->bf16(dxp);
  float* gdx = buf->zero<float>(dx.size());
  gpu::moe_permute_backward(*ctx, gdx, gdxp, s.gplan, C, false);
  expect_close(buf->get(gdx, dx.size()), dx, 1e-6, 0.0, "permute backward (=)");
  const std::vector<float> base = random_vector(dx.size(), 3);
  float* gacc = buf->copy(base);
  gpu::moe_permute_backward(*ctx, gacc, gdxp, s.gplan, C, true);
  std::vector<float> acc_ref(base);
  for (size_t i = 0; i < base.size(); i++) acc_ref[i] += dx[i];
  expect_close(buf->get(gacc, dx.size()), acc_ref, 1e-6, 0.0, "permute backward (+=)");

  const std::vector<float> y = rnd((size_t)M * C, 4), w = random_vector((size_t)N * s.K, 5), dout = random_vector((size_t)N * C, 6);
  std::vector<float> out((size_t)N * C);
  ops::moe_combine_forward(out.data(), y.data(), w.data(), s.plan, C);
  gpu::Bf16* gy = buf->bf16(y);
  float* gw = buf->copy(w);
  float* gout = buf->zero<float>(out.size());
  gpu::moe_combine_forward(*ctx, gout, gy, gw, s.gplan, C);
  expect_close(buf->get(gout, out.size()), out, 1e-6, 0.0, "combine forward");

  std::vector<float> dyp((size_t)M * C), dtw((size_t)N * s.K);
  ops::moe_combine_backward(dyp.data(), dtw.data(), dout.data(), y.data(), w.data(), s.plan, C);
  gpu::Bf16* gdyp = buf->bf16_zero(dyp.size());
  float* gdtw = buf->zero<float>(dtw.size());
  gpu::moe_combine_backward(*ctx, gdyp, gdtw, buf->copy(dout), gy, gw, s.gplan, C);
  expect_bf16_rule(buf->get_bf16(gdyp, dyp.size()), round_bf16(dyp), dyp, "combine dyperm");
  expect_close(buf->get(gdtw, dtw.size()), dtw, 1e-5, 0.0, "combine dtopk_weight");
}

TEST_F(CudaOps, GroupedExpertsForwardAndBackward) {
  MoeSetup s;
  build_plans(s, *ctx, *buf);
  const long M = s.N * s.K;
  const int C = s.C, I = s.I, E = s.E;
  const long IC = (long)I * C;
  const std::vector<float> xp = rnd((size_t)M * C, 1), w13 = rnd((size_t)E * 2 * IC, 2, 0.15f),
                           w2 = rnd((size_t)E * IC, 3, 0.15f);
  // fp32 reference and the naive bf16 chain (h13, act, y each rounded)
  std::vector<float> y_ref((size_t)M * C), h13_ref((size_t)M * 2 * I), act_ref((size_t)M * I);
  ops::moe_experts_forward(y_ref.data(), h13_ref.data(), act_ref.data(), xp.data(), w13.data(), w2.data(), s.plan, C, I);
  std::vector<float> y_nv(y_ref.size()), h13_nv(h13_ref.size()), act_nv(act_ref.size());
  for (int e = 0; e < E; e++) {
    const long off = s.plan.expert_offsets[e], rows = s.plan.expert_offsets[e + 1] - off;
    if (rows == 0) continue;
    ops::matmul_forward(&h13_nv[off * 2 * I], &xp[off * C], &w13[e * 2 * IC], (int)rows, C, 2 * I);
    testing::round_bf16_inplace(&h13_nv[off * 2 * I], rows * 2 * I);
    ops::swiglu_forward(&act_nv[off * I], &h13_nv[off * 2 * I], rows, I);
    testing::round_bf16_inplace(&act_nv[off * I], rows * I);
    ops::matmul_forward(&y_nv[off * C], &act_nv[off * I], &w2[e * IC], (int)rows, I, C);
    testing::round_bf16_inplace(&y_nv[off * C], rows * C);
  }
  gpu::Bf16 *gxp = buf->bf16(xp), *gw13 = buf->bf16(w13), *gw2 = buf->bf16(w2);
  gpu::Bf16 *gy = buf->bf16_zero(y_ref.size()), *gh = buf->bf16_zero(h13_ref.size()), *ga = buf->bf16_zero(act_ref.size());
  gpu::moe_experts_forward(*ctx, gy, DType::BF16, gh, ga, gxp, gw13, gw2, s.gplan, C, I);
  expect_bf16_rule(buf->get_bf16(gh, h13_ref.size()), h13_nv, h13_ref, "experts h13");
  expect_bf16_rule(buf->get_bf16(ga, act_ref.size()), act_nv, act_ref, "experts act");
  expect_bf16_rule(buf->get_bf16(gy, y_ref.size()), y_nv, y_ref, "experts y");

  // Backward on shared bf16 inputs h13 / act (so only the backward's own rounding differs).
  const std::vector<float> dy = rnd((size_t)M * C, 4), h13 = h13_nv, act = act_nv;
  const std::vector<float> dw13_0 = random_vector(w13.size(), 5, 0.01f), dw2_0 = random_vector(w2.size(), 6, 0.01f);
  std::vector<float> dx_ref((size_t)M * C), dw13_ref(dw13_0), dw2_ref(dw2_0), scratch((size_t)3 * M * I);
  ops::moe_experts_backward(dx_ref.data(), dw13_ref.data(), dw2_ref.data(), scratch.data(), dy.data(), h13.data(),
                            act.data(), xp.data(), w13.data(), w2.data(), s.plan, C, I);
  std::vector<float> dx_nv((size_t)M * C), dw13_nv(dw13_0), dw2_nv(dw2_0), dact((size_t)M * I), dh13((size_t)M * 2 * I);
  for (int e = 0; e < E; e++) {
    const long off = s.plan.expert_offsets[e], rows = s.plan.expert_offsets[e + 1] - off;
    if (rows == 0) continue;
    ops::matmul_backward(&dact[off * I], &dw2_nv[e * IC], &dy[off * C], &act[off * I], &w2[e * IC], (int)rows, I, C);
    testing::round_bf16_inplace(&dact[off * I], rows * I);
    ops::swiglu_backward(&dh13[off * 2 * I], &dact[off * I], &h13[off * 2 * I], rows, I);
    testing::round_bf16_inplace(&dh13[off * 2 * I], rows * 2 * I);
    ops::matmul_backward(&dx_nv[off * C], &dw13_nv[e * 2 * IC], &dh13[off * 2 * I], &xp[off * C], &w13[e * 2 * IC],
                         (int)rows, C, 2 * I);
    testing::round_bf16_inplace(&dx_nv[off * C], rows * C);
  }
  gpu::Bf16* gdy = buf->bf16(dy);
  gpu::Bf16* gdx = buf->bf16_zero(dx_ref.size());
  float *gdw13 = buf->copy(dw13_0), *gdw2 = buf->copy(dw2_0);
  gpu::Bf16* gscr = buf->bf16_zero((size_t)3 * M * I);
  gpu::Bf16 *gh13 = buf->bf16(h13), *gact = buf->bf16(act);
  gpu::moe_experts_backward(*ctx, gdx, DType::BF16, gdw13, gdw2, gscr, gdy, gh13, gact, gxp, gw13, gw2, s.gplan, C, I);
  const std::vector<float> dx_cuda = buf->get_bf16(gdx, dx_ref.size());
  expect_bf16_rule(dx_cuda, dx_nv, dx_ref, "experts dxperm");
  expect_bf16_rule(buf->get(gdw13, w13.size()), dw13_nv, dw13_ref, "experts dw13 (+=)");
  expect_bf16_rule(buf->get(gdw2, w2.size()), dw2_nv, dw2_ref, "experts dw2 (+=)");
  // dxperm may alias dy (the model does this): same result.
  gpu::moe_experts_backward(*ctx, gdy, DType::BF16, buf->zero<float>(w13.size()), buf->zero<float>(w2.size()), gscr, gdy,
                            gh13, gact,
                            gxp, gw13, gw2, s.gplan, C, I);
  EXPECT_EQ(buf->get_bf16(gdy, dx_ref.size()), dx_cuda);
}

TEST_F(CudaOps, CrossEntropyForwardAndBackwardInPlace) {
  const long N = 40;
  const int V = 1000;
  const std::vector<float> logits = random_vector((size_t)N * V, 1, 3.0f);
  std::vector<int32_t> t(N);
  for (long n = 0; n < N; n++) t[n] = n % 7 == 3 ? ops::IGNORE_INDEX : (int32_t)(mix64(n) % V);
  std::vector<float> lse(N), d((size_t)N * V);
  const double loss = ops::cross_entropy_forward(lse.data(), logits.data(), t.data(), N, V, 0.25f);
  ops::cross_entropy_backward(d.data(), logits.data(), lse.data(), t.data(), N, V, 0.25f);
  float* gl = buf->copy(logits);
  float *glse = buf->zero<float>(N), *grow = buf->zero<float>(N);
  int32_t* gt = buf->copy(t);
  const double gloss = gpu::cross_entropy_forward(*ctx, glse, grow, gl, gt, N, V, 0.25f);
  EXPECT_NEAR(gloss, loss, 1e-6 * std::fabs(loss));
  expect_close(buf->get(glse, N), lse, 1e-6, 0.0, "lse");
  gpu::Bf16* gd = buf->bf16_zero(d.size());
  gpu::cross_entropy_backward(*ctx, gd, V, gl, glse, gt, N, V, 0, 0.25f);
  const std::vector<float> dcuda = buf->get_bf16(gd, d.size());
  expect_bf16_rule(dcuda, round_bf16(d), d, "dlogits");
  // In place: the bf16 rows inside the fp32 rows (row stride 2V), as the model runs it.
  gpu::Bf16* inplace = reinterpret_cast<gpu::Bf16*>(gl);
  gpu::cross_entropy_backward(*ctx, inplace, 2L * V, gl, glse, gt, N, V, 0, 0.25f);
  const std::vector<float> all = buf->get_bf16(inplace, (size_t)N * 2 * V);
  for (long n = 0; n < N; n++)
    for (int v = 0; v < V; v++) ASSERT_EQ(all[(size_t)n * 2 * V + v], dcuda[(size_t)n * V + v]) << n << "," << v;
}

TEST_F(CudaOps, AdamWGradNormAndInit) {
  const size_t n = 10000;
  std::vector<float> p = random_vector(n, 1), m = random_vector(n, 2, 0.1f), v = random_vector(n, 3, 0.1f);
  for (float& x : v) x = x * x;
  const std::vector<float> g = random_vector(n, 4);
  float *gp = buf->copy(p), *gm = buf->copy(m), *gv = buf->copy(v);
  gpu::Bf16* gb = buf->bf16_zero(n);
  gpu::adamw_update(*ctx, gp, gb, gm, gv, buf->copy(g), n, 0.7f, 1e-3, 0.9, 0.95, 1e-8, 0.1, 3);
  adamw_update(p.data(), m.data(), v.data(), g.data(), n, 0.7f, 1e-3, 0.9, 0.95, 1e-8, 0.1, 3);
  const std::vector<float> pc = buf->get(gp, n);
  expect_close(pc, p, 1e-6, 0.0, "adamw param");
  expect_close(buf->get(gm, n), m, 1e-6, 0.0, "adamw exp_avg");
  expect_close(buf->get(gv, n), v, 1e-6, 0.0, "adamw exp_avg_sq");
  EXPECT_EQ(buf->get_bf16(gb, n), round_bf16(pc)) << "the bf16 copy is the rounded master";

  const size_t big = 300000;  // several chunks of the two-pass reduction
  const std::vector<float> gg = random_vector(big, 5);
  double* scratch = buf->zero<double>(gpu::grad_norm_scratch_doubles(big));
  const double norm = gpu::global_grad_norm(*ctx, scratch, buf->copy(gg), big);
  EXPECT_NEAR(norm, global_grad_norm(gg.data(), big), 1e-12 * norm);

  const uint64_t key = hash_name("model.layers.0.self_attn.q_proj.weight");
  float* gi = buf->zero<float>(5000);
  gpu::init_normal(*ctx, gi, 5000, 1234, key, 0.02, 0.0f);
  std::vector<float> ref(5000);
  for (size_t i = 0; i < ref.size(); i++) ref[i] = (float)(0.02 * normal_at(1234, key, i));
  expect_close(buf->get(gi, ref.size()), ref, 1e-6, 0.0, "init_normal vs core/rng.h");
}

}  // namespace
}  // namespace moetron
