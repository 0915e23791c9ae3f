// kernels::gemm_nt, the prefill GEMM (backend/kernels/gemm.h): every SIMD level gives exactly the stated
// fma chain, writes only the [n, OC] entries of out, and does not depend on the thread count.
#include <omp.h>

#include <cmath>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "backend/kernels/gemm.h"
#include "backend/kernels/gemv.h"
#include "backend/kernels/q8.h"
#include "core/rng.h"

using namespace moetron;
using namespace moetron::kernels;

namespace {

std::vector<float> random_values(size_t n, uint64_t seed) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; i++) v[i] = (float)normal_at(seed, 1, i);
  return v;
}

// The contract, written out: one fma chain over the columns in order from 0, times alpha, then added.
void reference(float* out, int ld_out, const float* x, int ld_x, const float* W, int ld_w, int n, int IC, int OC,
               float alpha, bool acc) {
  for (int t = 0; t < n; t++)
    for (int r = 0; r < OC; r++) {
      float s = 0.0f;
      for (int k = 0; k < IC; k++) s = std::fma(x[(size_t)t * ld_x + k], W[(size_t)r * ld_w + k], s);
      const float v = alpha * s;
      float& o = out[(size_t)t * ld_out + r];
      o = acc ? o + v : v;
    }
}

std::vector<SimdLevel> levels() {
  std::vector<SimdLevel> l = {SimdLevel::generic};
  if (simd_level() != SimdLevel::generic) l.push_back(SimdLevel::avx2);
  if (simd_level() == SimdLevel::avx512) l.push_back(SimdLevel::avx512);
  return l;
}

}  // namespace

TEST(Gemm, EveryLevelIsTheStatedFmaChainBitwise) {
  int cases = 0;
  for (const int n : {1, 5, 8, 9, 16, 24, 31, 32, 33, 40, 45, 70, 96})
    for (const int OC : {1, 5, 6, 7, 8, 9, 13, 17, 64})
      for (const int IC : {0, 1, 3, 64, 257})
        for (const bool acc : {false, true}) {
          const float alpha = acc ? 0.37f : 1.0f;
          const int ld_x = IC + 3, ld_w = IC + 1, ld_out = OC + 2;
          const auto x = random_values((size_t)n * ld_x, 1000 + n * 7 + IC);
          const auto W = random_values((size_t)OC * ld_w, 2000 + OC * 11 + IC);
          const auto init = random_values((size_t)n * ld_out, 3000 + n + OC);
          std::vector<float> want = init;
          reference(want.data(), ld_out, x.data(), ld_x, W.data(), ld_w, n, IC, OC, alpha, acc);
          for (const SimdLevel level : levels()) {
            SCOPED_TRACE(::testing::Message() << "level " << simd_name(level) << " n " << n << " OC " << OC << " IC "
                                              << IC << " acc " << acc);
            std::vector<float> got = init, scratch;
            gemm_nt_at(level, got.data(), ld_out, x.data(), ld_x, {W.data()}, ld_w, n, IC, OC, alpha, acc, scratch);
            // Bitwise, the padding columns of out included (untouched).
            ASSERT_EQ(0, std::memcmp(got.data(), want.data(), sizeof(float) * got.size()));
            cases++;
          }
        }
  EXPECT_GE(cases, 13 * 9 * 5 * 2);
}

TEST(Gemm, ThreadsSplitTheRowsWithoutChangingTheBits) {
  const int n = 40, IC = 256, OC = 300;  // 3M multiply-adds: split across threads
  const auto x = random_values((size_t)n * IC, 1), W = random_values((size_t)OC * IC, 2);
  std::vector<float> scratch, one((size_t)n * OC), two(one.size());
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  gemm_nt(one.data(), OC, x.data(), IC, {W.data()}, IC, n, IC, OC, 1.0f, false, scratch);
  omp_set_num_threads(2);
  gemm_nt(two.data(), OC, x.data(), IC, {W.data()}, IC, n, IC, OC, 1.0f, false, scratch);
  omp_set_num_threads(saved);
  EXPECT_EQ(0, std::memcmp(one.data(), two.data(), sizeof(float) * one.size()));
  std::vector<float> want(one.size());
  reference(want.data(), OC, x.data(), IC, W.data(), IC, n, IC, OC, 1.0f, false);
  EXPECT_EQ(0, std::memcmp(one.data(), want.data(), sizeof(float) * one.size()));
}

// bf16, f16 and Q8_0 weights are widened a few rows at a time: the result is bitwise the product
// with their fp32 widening, at every level.
TEST(Gemm, StoredWeightsGiveWhatTheirFp32WideningGives) {
  const int n = 37, IC = 96, OC = 45;
  const auto x = random_values((size_t)n * IC, 5), W = random_values((size_t)OC * IC, 6);
  std::vector<uint16_t> bf((size_t)OC * IC), f16(bf.size());
  for (size_t i = 0; i < bf.size(); i++) {
    bf[i] = f32_to_bf16(W[i]);
    f16[i] = f32_to_f16(W[i]);
  }
  std::vector<int8_t> q((size_t)OC * IC);
  std::vector<uint16_t> d((size_t)OC * IC / kQ8Block);
  ASSERT_TRUE(quantize_q8_0({W.data()}, OC, IC, q.data(), d.data()));
  const WeightRef stored[] = {{bf.data(), DType::BF16}, {f16.data(), DType::F16}, {q.data(), DType::U8, d.data()}};
  for (const WeightRef& Wr : stored) {
    std::vector<float> wide((size_t)OC * IC);
    for (int r = 0; r < OC; r++) widen_row(wide.data() + (size_t)r * IC, Wr, r, IC);
    for (const SimdLevel level : levels()) {
      SCOPED_TRACE(::testing::Message() << "level " << simd_name(level) << " dtype " << dtype_name(Wr.dtype));
      std::vector<float> got((size_t)n * OC), want(got.size()), scratch;
      gemm_nt_at(level, got.data(), OC, x.data(), IC, Wr, IC, n, IC, OC, 1.0f, false, scratch);
      reference(want.data(), OC, x.data(), IC, wide.data(), IC, n, IC, OC, 1.0f, false);
      ASSERT_EQ(0, std::memcmp(got.data(), want.data(), sizeof(float) * got.size()));
    }
  }
}
