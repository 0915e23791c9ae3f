// Tests for ops/attention: causal GQA with sliding window, right padding and packed segments.
//   B batch, T sequence, NH query heads, NKV kv heads, HD head dim.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/error.h"
#include "gradcheck.h"
#include "ops/attention.h"
#include "ops/attention_kv.h"
#include "ops/rope.h"

namespace moetron {
namespace {

using testing::random_vector;

struct Case {
  Case(int B_, int T_, int NH_, int NKV_, int HD_) : B(B_), T(T_), NH(NH_), NKV(NKV_), HD(HD_) {}
  int B, T, NH, NKV, HD;
  int sliding_window = 0;
  std::vector<int32_t> attention_mask;  // [B,T] or empty
  std::vector<int32_t> segment_ids;     // [B,T] or empty
};

ops::AttentionMask mask_of(const Case& c) {
  ops::AttentionMask m;
  m.attention_mask = c.attention_mask.empty() ? nullptr : c.attention_mask.data();
  m.segment_ids = c.segment_ids.empty() ? nullptr : c.segment_ids.data();
  m.sliding_window = c.sliding_window;
  return m;
}

// The visibility rule of attention.h, written out independently.
bool visible(const Case& c, int b, int i, int j) {
  if (j > i) return false;
  if (c.sliding_window > 0 && i - j >= c.sliding_window) return false;
  if (!c.attention_mask.empty() && c.attention_mask[b * c.T + j] == 0) return false;
  if (!c.segment_ids.empty() && c.segment_ids[b * c.T + j] != c.segment_ids[b * c.T + i]) return false;
  return true;
}

// Naive double-precision eager attention.
void reference(const Case& c, const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
               std::vector<double>& out, std::vector<double>& probs) {
  const int G = c.NH / c.NKV;
  out.assign((size_t)c.B * c.T * c.NH * c.HD, 0.0);
  probs.assign((size_t)c.B * c.NH * c.T * c.T, 0.0);
  for (int b = 0; b < c.B; b++)
    for (int h = 0; h < c.NH; h++)
      for (int i = 0; i < c.T; i++) {
        std::vector<double> s(c.T, -INFINITY);
        double m = -INFINITY;
        for (int j = 0; j < c.T; j++) {
          if (!visible(c, b, i, j)) continue;
          double d = 0.0;
          for (int e = 0; e < c.HD; e++)
            d += (double)q[(((size_t)b * c.T + i) * c.NH + h) * c.HD + e] *
                 k[(((size_t)b * c.T + j) * c.NKV + h / G) * c.HD + e];
          s[j] = d / std::sqrt((double)c.HD);
          m = std::max(m, s[j]);
        }
        if (m == -INFINITY) continue;  // no visible key: zeros
        double z = 0.0;
        for (int j = 0; j < c.T; j++) z += std::exp(s[j] - m);
        for (int j = 0; j < c.T; j++) {
          const double p = std::exp(s[j] - m) / z;
          probs[(((size_t)b * c.NH + h) * c.T + i) * c.T + j] = p;
          for (int e = 0; e < c.HD; e++)
            out[(((size_t)b * c.T + i) * c.NH + h) * c.HD + e] +=
                p * v[(((size_t)b * c.T + j) * c.NKV + h / G) * c.HD + e];
        }
      }
}

struct Tensors {
  std::vector<float> q, k, v;
};

Tensors random_qkv(const Case& c, uint32_t seed) {
  return {random_vector((size_t)c.B * c.T * c.NH * c.HD, seed),
          random_vector((size_t)c.B * c.T * c.NKV * c.HD, seed + 1),
          random_vector((size_t)c.B * c.T * c.NKV * c.HD, seed + 2)};
}

void check_forward(const Case& c, uint32_t seed) {
  const auto t = random_qkv(c, seed);
  std::vector<float> out(t.q.size(), 7.0f), probs((size_t)c.B * c.NH * c.T * c.T, 7.0f);
  ops::attention_forward(out.data(), probs.data(), t.q.data(), t.k.data(), t.v.data(), mask_of(c), c.B, c.T, c.NH,
                         c.NKV, c.HD);
  std::vector<double> ref_out, ref_probs;
  reference(c, t.q, t.k, t.v, ref_out, ref_probs);
  // fp32 dot products of HD unit-variance terms and softmax sums over <= T terms, against a
  // double reference: errors of a few 1e-7; 1e-5 leaves room yet catches any masking mistake
  // (which moves values by O(0.1)).
  for (size_t i = 0; i < out.size(); i++) ASSERT_NEAR(out[i], ref_out[i], 1e-5) << "out " << i;
  for (size_t i = 0; i < probs.size(); i++) {
    ASSERT_NEAR(probs[i], ref_probs[i], 1e-6) << "probs " << i;
    if (ref_probs[i] == 0.0) {
      ASSERT_EQ(probs[i], 0.0f) << "masked probs " << i;  // exact zeros
    }
  }
}

void check_gradients(const Case& c, uint32_t seed) {
  auto t = random_qkv(c, seed);
  const auto r = random_vector(t.q.size(), seed + 10);
  const auto m = mask_of(c);
  std::vector<float> out(t.q.size()), probs((size_t)c.B * c.NH * c.T * c.T);
  std::vector<float> dq(t.q.size(), 9.0f), dk(t.k.size(), 9.0f), dv(t.v.size(), 9.0f);
  ops::attention_forward(out.data(), probs.data(), t.q.data(), t.k.data(), t.v.data(), m, c.B, c.T, c.NH, c.NKV, c.HD);
  ops::attention_backward(dq.data(), dk.data(), dv.data(), r.data(), probs.data(), t.q.data(), t.k.data(), t.v.data(),
                          c.B, c.T, c.NH, c.NKV, c.HD);
  auto loss = [&] {
    ops::attention_forward(out.data(), probs.data(), t.q.data(), t.k.data(), t.v.data(), m, c.B, c.T, c.NH, c.NKV,
                           c.HD);
    return testing::weighted_sum(out, r);
  };
  testing::expect_gradient_close(testing::finite_difference(t.q, dq, loss), "attention dq");
  testing::expect_gradient_close(testing::finite_difference(t.k, dk, loss), "attention dk");
  testing::expect_gradient_close(testing::finite_difference(t.v, dv, loss), "attention dv");
}

Case gqa_causal() { return Case(2, 9, 4, 2, 8); }
Case mha_causal() { return Case(1, 7, 3, 3, 12); }  // HD = 12 exercises the non-multiple-of-8 tail
Case mqa_causal() { return Case(1, 6, 4, 1, 8); }
Case sliding() {
  Case c{2, 10, 4, 2, 8};
  c.sliding_window = 3;
  return c;
}
Case padded() {
  Case c{2, 8, 4, 2, 8};
  c.attention_mask = {1, 1, 1, 1, 1, 1, 1, 1,  //
                      1, 1, 1, 1, 1, 0, 0, 0};
  return c;
}
Case segments() {
  Case c{2, 9, 4, 2, 8};
  c.segment_ids = {0, 0, 0, 0, 1, 1, 1, 1, 1,  //
                   5, 5, 7, 7, 7, 7, 7, 9, 9};
  return c;
}
Case everything() {
  Case c{2, 12, 4, 2, 8};
  c.sliding_window = 4;
  c.attention_mask = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0,  //
                      1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  c.segment_ids = {0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1,  //
                   0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2};
  return c;
}
// Row 0: query positions 2.. see no real key (padding starts a new segment); row 1 fully padded.
Case no_visible_key() {
  Case c{2, 5, 2, 1, 8};
  c.attention_mask = {1, 1, 0, 0, 0,  //
                      0, 0, 0, 0, 0};
  c.segment_ids = {0, 0, 1, 1, 1,  //
                   0, 0, 0, 0, 0};
  return c;
}

TEST(OpsAttention, ForwardGqaCausal) { check_forward(gqa_causal(), 1); }
TEST(OpsAttention, ForwardMhaCausal) { check_forward(mha_causal(), 2); }
TEST(OpsAttention, ForwardMqaCausal) { check_forward(mqa_causal(), 3); }
TEST(OpsAttention, ForwardSlidingWindow) { check_forward(sliding(), 4); }
TEST(OpsAttention, ForwardRightPadded) { check_forward(padded(), 5); }
TEST(OpsAttention, ForwardSegments) { check_forward(segments(), 6); }
TEST(OpsAttention, ForwardAllMasks) { check_forward(everything(), 7); }
// Longer rows span several internal row/key blocks (16); head dims cover the 16-, 8- and
// scalar-wide column paths of the kernels.
TEST(OpsAttention, ForwardLonger) { check_forward(Case(1, 70, 2, 1, 64), 8); }
Case long_masked() {
  Case c{2, 37, 4, 2, 20};
  c.sliding_window = 19;
  c.attention_mask.assign(2 * 37, 1);
  for (int i = 30; i < 37; i++) c.attention_mask[37 + i] = 0;
  c.segment_ids.assign(2 * 37, 0);
  for (int i = 0; i < 37; i++) c.segment_ids[i] = i < 18 ? 0 : 1;
  for (int i = 0; i < 37; i++) c.segment_ids[37 + i] = i < 5 ? 0 : (i < 23 ? 1 : 2);
  return c;
}
TEST(OpsAttention, ForwardLongerMasked) { check_forward(long_masked(), 9); }
TEST(OpsAttention, ForwardHeadDim24) { check_forward(Case(1, 33, 2, 2, 24), 10); }

TEST(OpsAttention, GradientsGqaCausal) { check_gradients(gqa_causal(), 11); }
TEST(OpsAttention, GradientsMhaCausal) { check_gradients(mha_causal(), 12); }
TEST(OpsAttention, GradientsMqaCausal) { check_gradients(mqa_causal(), 13); }
TEST(OpsAttention, GradientsSlidingWindow) { check_gradients(sliding(), 14); }
TEST(OpsAttention, GradientsRightPadded) { check_gradients(padded(), 15); }
TEST(OpsAttention, GradientsSegments) { check_gradients(segments(), 16); }
TEST(OpsAttention, GradientsAllMasks) { check_gradients(everything(), 17); }
TEST(OpsAttention, GradientsNoVisibleKey) { check_gradients(no_visible_key(), 18); }
TEST(OpsAttention, GradientsLongerMasked) { check_gradients(long_masked(), 19); }
TEST(OpsAttention, GradientsTwoBlocksHeadDim20) { check_gradients(Case(1, 21, 2, 1, 20), 20); }

TEST(OpsAttention, QueryWithNoVisibleKeyOutputsZerosAndPassesNoGradient) {
  const Case c = no_visible_key();
  const auto t = random_qkv(c, 20);
  const auto m = mask_of(c);
  std::vector<float> out(t.q.size()), probs((size_t)c.B * c.NH * c.T * c.T);
  ops::attention_forward(out.data(), probs.data(), t.q.data(), t.k.data(), t.v.data(), m, c.B, c.T, c.NH, c.NKV, c.HD);
  auto empty_row = [&](int b, int i) { return b == 1 || i >= 2; };
  for (int b = 0; b < c.B; b++)
    for (int i = 0; i < c.T; i++)
      for (int h = 0; h < c.NH; h++) {
        const bool empty = empty_row(b, i);
        float mx = 0.0f;
        for (int e = 0; e < c.HD; e++) mx = std::max(mx, std::fabs(out[(((size_t)b * c.T + i) * c.NH + h) * c.HD + e]));
        if (empty)
          EXPECT_EQ(mx, 0.0f) << "b " << b << " i " << i;
        else
          EXPECT_GT(mx, 0.0f) << "b " << b << " i " << i;
        for (int j = 0; j < c.T && empty; j++) EXPECT_EQ(probs[(((size_t)b * c.NH + h) * c.T + i) * c.T + j], 0.0f);
      }
  // Gradients: dq of empty queries is zero, and their dout does not reach dk/dv.
  auto dout1 = random_vector(t.q.size(), 21);
  auto dout2 = dout1;
  for (int b = 0; b < c.B; b++)
    for (int i = 0; i < c.T; i++)
      if (empty_row(b, i))
        for (int x = 0; x < c.NH * c.HD; x++) dout2[((size_t)b * c.T + i) * c.NH * c.HD + x] = 1e3f;
  auto grads = [&](const std::vector<float>& dout) {
    std::vector<float> dq(t.q.size(), 5.0f), dk(t.k.size(), 5.0f), dv(t.v.size(), 5.0f);
    ops::attention_backward(dq.data(), dk.data(), dv.data(), dout.data(), probs.data(), t.q.data(), t.k.data(),
                            t.v.data(), c.B, c.T, c.NH, c.NKV, c.HD);
    return std::vector<std::vector<float>>{dq, dk, dv};
  };
  const auto g1 = grads(dout1), g2 = grads(dout2);
  EXPECT_EQ(g1, g2);
  for (int b = 0; b < c.B; b++)
    for (int i = 0; i < c.T; i++)
      for (int x = 0; x < c.NH * c.HD && empty_row(b, i); x++)
        EXPECT_EQ(g1[0][((size_t)b * c.T + i) * c.NH * c.HD + x], 0.0f);
  // The fully padded row's keys receive nothing either.
  for (size_t x = (size_t)c.T * c.NKV * c.HD; x < t.k.size(); x++) {
    EXPECT_EQ(g1[1][x], 0.0f);
    EXPECT_EQ(g1[2][x], 0.0f);
  }
}

// Two documents packed in one row with positions restarting at the second: the second document's
// outputs and gradients must equal running it alone (RoPE applied as the model does).
TEST(OpsAttention, PackedDocumentEqualsRunningItAlone) {
  const int L1 = 5, L2 = 7, T = L1 + L2, NH = 4, NKV = 2, HD = 8;
  const float theta = 10000.0f;
  Case packed{1, T, NH, NKV, HD};
  packed.segment_ids.assign(T, 0);
  std::vector<int32_t> pos(T);
  for (int i = 0; i < T; i++) {
    packed.segment_ids[i] = i < L1 ? 3 : 4;
    pos[i] = i < L1 ? i : i - L1;
  }
  const auto raw = random_qkv(packed, 30);
  const auto dout = random_vector(raw.q.size(), 31);

  // Runs rope + attention forward and backward on tokens [t0, t0+n) of the packed row.
  struct Result {
    std::vector<float> out, dq, dk, dv;
  };
  auto run = [&](int t0, int n, const ops::AttentionMask& m) {
    const size_t qs = (size_t)NH * HD, ks = (size_t)NKV * HD;
    std::vector<float> q(raw.q.begin() + t0 * qs, raw.q.begin() + (t0 + n) * qs);
    std::vector<float> k(raw.k.begin() + t0 * ks, raw.k.begin() + (t0 + n) * ks);
    std::vector<float> v(raw.v.begin() + t0 * ks, raw.v.begin() + (t0 + n) * ks);
    std::vector<float> d(dout.begin() + t0 * qs, dout.begin() + (t0 + n) * qs);
    ops::rope_forward(q.data(), q.data(), pos.data() + t0, n, NH, HD, theta);
    ops::rope_forward(k.data(), k.data(), pos.data() + t0, n, NKV, HD, theta);
    Result r{std::vector<float>(q.size()), std::vector<float>(q.size()), std::vector<float>(k.size()),
             std::vector<float>(k.size())};
    std::vector<float> probs((size_t)NH * n * n);
    ops::attention_forward(r.out.data(), probs.data(), q.data(), k.data(), v.data(), m, 1, n, NH, NKV, HD);
    ops::attention_backward(r.dq.data(), r.dk.data(), r.dv.data(), d.data(), probs.data(), q.data(), k.data(), v.data(),
                            1, n, NH, NKV, HD);
    ops::rope_backward(r.dq.data(), r.dq.data(), pos.data() + t0, n, NH, HD, theta);
    ops::rope_backward(r.dk.data(), r.dk.data(), pos.data() + t0, n, NKV, HD, theta);
    return r;
  };
  const Result whole = run(0, T, mask_of(packed));
  const Result doc1 = run(0, L1, ops::AttentionMask{});
  const Result doc2 = run(L1, L2, ops::AttentionMask{});
  // Same arithmetic on the same visible keys, up to summation order: 1e-6 on O(1) values.
  auto expect_part = [](const std::vector<float>& all, const std::vector<float>& part, size_t offset,
                        const char* what) {
    for (size_t x = 0; x < part.size(); x++) ASSERT_NEAR(all[offset + x], part[x], 1e-6) << what << " element " << x;
  };
  expect_part(whole.out, doc1.out, 0, "doc 1 out");
  expect_part(whole.dq, doc1.dq, 0, "doc 1 dq");
  expect_part(whole.dk, doc1.dk, 0, "doc 1 dk");
  expect_part(whole.dv, doc1.dv, 0, "doc 1 dv");
  expect_part(whole.out, doc2.out, (size_t)L1 * NH * HD, "doc 2 out");
  expect_part(whole.dq, doc2.dq, (size_t)L1 * NH * HD, "doc 2 dq");
  expect_part(whole.dk, doc2.dk, (size_t)L1 * NKV * HD, "doc 2 dk");
  expect_part(whole.dv, doc2.dv, (size_t)L1 * NKV * HD, "doc 2 dv");
}

TEST(OpsAttention, DeterministicAcrossThreadCounts) {
  Case c{2, 48, 4, 2, 32};  // large enough to run in parallel
  c.sliding_window = 20;
  const auto t = random_qkv(c, 40);
  const auto dout = random_vector(t.q.size(), 41);
  auto run = [&](int threads) {
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    std::vector<float> out(t.q.size()), probs((size_t)c.B * c.NH * c.T * c.T);
    std::vector<float> dq(t.q.size()), dk(t.k.size()), dv(t.v.size());
    ops::attention_forward(out.data(), probs.data(), t.q.data(), t.k.data(), t.v.data(), mask_of(c), c.B, c.T, c.NH,
                           c.NKV, c.HD);
    ops::attention_backward(dq.data(), dk.data(), dv.data(), dout.data(), probs.data(), t.q.data(), t.k.data(),
                            t.v.data(), c.B, c.T, c.NH, c.NKV, c.HD);
    omp_set_num_threads(saved);
    return std::vector<std::vector<float>>{out, probs, dq, dk, dv};
  };
  const auto a = run(1), b = run(2), d = run(3);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a, d);
}

// Attention over a KV cache (inference): the last n rows of a sequence of T against the double
// reference of the whole sequence's attention, which sees the same keys -- a decode step (n = 1), a
// prompt chunk after cached rows, a chunk from position 0, each under a sliding window too, and MQA
// / MHA.  Tolerance as check_forward's.  The result does not depend on the thread count.
TEST(OpsAttention, KvCacheRowsAreTheFullSequencesLastRows) {
  struct KvCase {
    int T, n, NH, NKV, HD, window;
  };
  for (const KvCase& k : {KvCase{17, 1, 4, 2, 8, 0}, KvCase{17, 1, 4, 2, 8, 5}, KvCase{30, 7, 4, 1, 16, 0},
                          KvCase{30, 7, 4, 1, 16, 6}, KvCase{12, 12, 2, 2, 8, 0}, KvCase{12, 12, 2, 2, 8, 4}}) {
    SCOPED_TRACE(::testing::Message() << "T " << k.T << " n " << k.n << " window " << k.window);
    Case c(1, k.T, k.NH, k.NKV, k.HD);
    c.sliding_window = k.window;
    const auto t = random_qkv(c, 50 + k.T + k.n);
    std::vector<double> ref_out, ref_probs;
    reference(c, t.q, t.k, t.v, ref_out, ref_probs);
    const int pos0 = k.T - k.n;
    const size_t row = (size_t)k.NH * k.HD;
    const std::vector<float> q(t.q.begin() + pos0 * row, t.q.end());
    std::vector<float> out(q.size(), 7.0f);
    ops::attention_kv_forward(out.data(), q.data(), t.k.data(), t.v.data(), k.n, pos0, k.window, k.NH, k.NKV, k.HD);
    for (size_t i = 0; i < out.size(); i++) ASSERT_NEAR(out[i], ref_out[pos0 * row + i], 1e-5) << "out " << i;
    const int saved = omp_get_max_threads();
    std::vector<float> one(out.size());
    omp_set_num_threads(1);
    ops::attention_kv_forward(one.data(), q.data(), t.k.data(), t.v.data(), k.n, pos0, k.window, k.NH, k.NKV, k.HD);
    omp_set_num_threads(saved);
    EXPECT_EQ(one, out);
  }
  std::vector<float> buf(64);
  EXPECT_THROW(ops::attention_kv_forward(buf.data(), buf.data(), buf.data(), buf.data(), 1, 0, 0, 3, 2, 4), Error);
}

TEST(OpsAttention, BadHeadCountsAreErrors) {
  std::vector<float> buf(1024);
  EXPECT_THROW(ops::attention_forward(buf.data(), buf.data(), buf.data(), buf.data(), buf.data(), {}, 1, 2, 3, 2, 4),
               Error);
  EXPECT_THROW(ops::attention_backward(buf.data(), buf.data(), buf.data(), buf.data(), buf.data(), buf.data(),
                                       buf.data(), buf.data(), 1, 2, 4, 0, 4),
               Error);
}

}  // namespace
}  // namespace moetron
