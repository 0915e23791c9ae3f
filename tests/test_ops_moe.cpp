// Tests for the dropless MoE block on CPU (src/ops/moe_dispatch.h with src/ops/router.h):
// router_forward -> moe_plan_build -> permute -> grouped expert SwiGLU FFN -> combine, checked
// against a naive double-precision reference (HF MixtralSparseMoeBlock semantics), by finite
// differences w.r.t. x, the gate and w1/w3/w2 (the top-K selection held fixed), on edge cases
// (empty experts, all tokens on one expert, K = E, K = 1, odd sizes), and for thread-count
// determinism.
//   N tokens, C hidden, E experts, K experts per token, I expert FFN width, M = N*K rows.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "gradcheck.h"
#include "ops/matmul.h"
#include "ops/moe_dispatch.h"
#include "ops/router.h"

namespace moetron {
namespace {

using testing::expect_gradient_close;
using testing::finite_difference;
using testing::random_vector;

constexpr float kFdStep = 1e-2f;  // the harness's default central-difference step

struct Block {
  long N;
  int C, E, K, I;
  std::vector<float> x;     // [N,C]
  std::vector<float> gate;  // [E,C]
  std::vector<float> w1;    // [E,I,C]
  std::vector<float> w3;    // [E,I,C]
  std::vector<float> w2;    // [E,C,I]
  long M() const { return N * K; }
  // The ops take gate and up stacked per expert: w13[E,2I,C] = [w1[e]; w3[e]].
  std::vector<float> w13() const {
    const size_t IC = (size_t)I * C;
    std::vector<float> out(2 * IC * E);
    for (int e = 0; e < E; e++) {
      std::copy(w1.begin() + IC * e, w1.begin() + IC * (e + 1), out.begin() + 2 * IC * e);
      std::copy(w3.begin() + IC * e, w3.begin() + IC * (e + 1), out.begin() + 2 * IC * e + IC);
    }
    return out;
  }
};

struct Acts {
  std::vector<float> logits, probs;  // [N,E]
  std::vector<int32_t> idx;          // [N,K]
  std::vector<float> weight;         // [N,K]
  ops::MoePlan plan;
  std::vector<float> xperm, y;       // [M,C]
  std::vector<float> h13;            // [M,2I]
  std::vector<float> act;            // [M,I]
  std::vector<float> out;            // [N,C]
};

struct Grads {
  std::vector<float> x, gate, w1, w3, w2;
};

void forward(Acts& a, const Block& b) {
  const long N = b.N, M = b.M();
  a.logits.resize(N * b.E);
  a.probs.resize(N * b.E);
  a.idx.resize(N * b.K);
  a.weight.resize(N * b.K);
  a.xperm.resize(M * b.C);
  a.y.resize(M * b.C);
  a.h13.resize(2 * M * b.I);
  a.act.resize(M * b.I);
  a.out.resize(N * b.C);
  ops::matmul_forward(a.logits.data(), b.x.data(), b.gate.data(), (int)N, b.C, b.E);
  ops::router_forward(a.probs.data(), a.idx.data(), a.weight.data(), a.logits.data(), N, b.E, b.K);
  ops::moe_plan_build(a.plan, a.idx.data(), N, b.E, b.K);
  ops::moe_permute_forward(a.xperm.data(), b.x.data(), a.plan, b.C);
  const std::vector<float> w13 = b.w13();
  ops::moe_experts_forward(a.y.data(), a.h13.data(), a.act.data(), a.xperm.data(), w13.data(),
                           b.w2.data(), a.plan, b.C, b.I);
  ops::moe_combine_forward(a.out.data(), a.y.data(), a.weight.data(), a.plan, b.C);
}

// Gradients of L = sum dout * out.  Parameter gradients start at zero (the ops accumulate).
Grads backward(const Acts& a, const Block& b, const std::vector<float>& dout) {
  const long N = b.N, M = b.M();
  Grads g;
  g.x.assign(N * b.C, 0.0f);
  g.gate.assign(b.E * b.C, 0.0f);
  g.w1.assign(b.w1.size(), 0.0f);
  g.w3.assign(b.w3.size(), 0.0f);
  g.w2.assign(b.w2.size(), 0.0f);
  std::vector<float> dy(M * b.C), dw(N * b.K), dxperm(M * b.C), scratch(3 * M * b.I);
  std::vector<float> dlogits(N * b.E), dx_router(N * b.C);
  ops::moe_combine_backward(dy.data(), dw.data(), dout.data(), a.y.data(), a.weight.data(), a.plan, b.C);
  const std::vector<float> w13 = b.w13();
  std::vector<float> dw13(w13.size(), 0.0f);
  ops::moe_experts_backward(dxperm.data(), dw13.data(), g.w2.data(), scratch.data(), dy.data(),
                            a.h13.data(), a.act.data(), a.xperm.data(), w13.data(), b.w2.data(),
                            a.plan, b.C, b.I);
  const size_t IC = (size_t)b.I * b.C;
  for (int e = 0; e < b.E; e++) {
    std::copy(dw13.begin() + 2 * IC * e, dw13.begin() + 2 * IC * e + IC, g.w1.begin() + IC * e);
    std::copy(dw13.begin() + 2 * IC * e + IC, dw13.begin() + 2 * IC * (e + 1), g.w3.begin() + IC * e);
  }
  ops::moe_permute_backward(g.x.data(), dxperm.data(), a.plan, b.C);
  ops::router_backward(dlogits.data(), dw.data(), nullptr, nullptr, a.probs.data(), a.idx.data(),
                       a.weight.data(), N, b.E, b.K);
  ops::matmul_backward(dx_router.data(), g.gate.data(), dlogits.data(), b.x.data(), b.gate.data(),
                       (int)N, b.C, b.E);
  for (long i = 0; i < N * b.C; i++) g.x[i] += dx_router[i];
  return g;
}

// Naive double reference: loop over tokens and their K experts (HF MixtralSparseMoeBlock).
// Also returns each token's chosen expert set (sorted) in `sets`.
std::vector<double> reference(const Block& b, std::vector<std::vector<int>>* sets) {
  const int C = b.C, E = b.E, K = b.K, I = b.I;
  std::vector<double> out(b.N * C, 0.0);
  if (sets) sets->assign(b.N, {});
  for (long n = 0; n < b.N; n++) {
    const float* xn = &b.x[n * C];
    std::vector<double> p(E);
    double mx = -INFINITY, s = 0.0;
    for (int e = 0; e < E; e++) {
      double l = 0.0;
      for (int c = 0; c < C; c++) l += (double)xn[c] * b.gate[e * C + c];
      p[e] = l;
      mx = std::max(mx, l);
    }
    for (int e = 0; e < E; e++) s += (p[e] = std::exp(p[e] - mx));
    for (auto& v : p) v /= s;
    std::vector<int> order(E);
    for (int e = 0; e < E; e++) order[e] = e;
    std::stable_sort(order.begin(), order.end(), [&](int i, int j) { return p[i] > p[j]; });
    double psum = 0.0;
    for (int k = 0; k < K; k++) psum += p[order[k]];
    for (int k = 0; k < K; k++) {
      const int e = order[k];
      if (sets) (*sets)[n].push_back(e);
      std::vector<double> act(I);
      for (int i = 0; i < I; i++) {
        double g = 0.0, u = 0.0;
        for (int c = 0; c < C; c++) {
          g += (double)b.w1[((long)e * I + i) * C + c] * xn[c];
          u += (double)b.w3[((long)e * I + i) * C + c] * xn[c];
        }
        act[i] = g / (1.0 + std::exp(-g)) * u;
      }
      for (int c = 0; c < C; c++) {
        double y = 0.0;
        for (int i = 0; i < I; i++) y += (double)b.w2[((long)e * C + c) * I + i] * act[i];
        out[n * C + c] += p[e] / psum * y;
      }
    }
    if (sets) std::sort((*sets)[n].begin(), (*sets)[n].end());
  }
  return out;
}

std::vector<std::vector<int>> chosen_sets(const Acts& a, long N, int K) {
  std::vector<std::vector<int>> s(N);
  for (long n = 0; n < N; n++) {
    s[n].assign(a.idx.begin() + n * K, a.idx.begin() + (n + 1) * K);
    std::sort(s[n].begin(), s[n].end());
  }
  return s;
}

// Smallest gap, over tokens, between the K-th and (K+1)-th largest router logit (infinite if K=E).
double min_selection_gap(const Block& b) {
  Acts a;
  forward(a, b);
  double gap = INFINITY;
  if (b.K == b.E) return gap;
  for (long n = 0; n < b.N; n++) {
    std::vector<float> l(a.logits.begin() + n * b.E, a.logits.begin() + (n + 1) * b.E);
    std::sort(l.begin(), l.end(), std::greater<float>());
    gap = std::min(gap, (double)l[b.K - 1] - l[b.K]);
  }
  return gap;
}

double max_abs(const std::vector<float>& v) {
  double m = 0.0;
  for (float f : v) m = std::max(m, (double)std::fabs(f));
  return m;
}

std::vector<int64_t> expert_rows(const Block& b) {
  Acts a;
  forward(a, b);
  std::vector<int64_t> rows(b.E);
  for (int e = 0; e < b.E; e++) rows[e] = a.plan.expert_offsets[e + 1] - a.plan.expert_offsets[e];
  return rows;
}

// Adds bias[e] * 2.5 to every token's logit e: x[:,0] is set to 2.5 and gate[:,0] to bias.
std::function<void(Block&)> route_bias(std::vector<float> bias) {
  return [bias](Block& b) {
    for (long n = 0; n < b.N; n++) b.x[n * b.C] = 2.5f;
    for (int e = 0; e < b.E; e++) b.gate[e * b.C] = bias[e];
  };
}

// Random block (x ~ N(0,1), gate ~ N(0, 0.6), w1/w3 ~ N(0, 1/sqrt(C)), w2 ~ N(0, 1/sqrt(I)); the
// `shape` hook may then force a routing pattern, which `accept` confirms.  Seeds are tried in order
// until the pattern holds and the routing margin is safe for finite differences: one step h on x[n,c] moves a logit difference by at most
// 2h*max|gate|, on gate[e,c] by at most h*max|x|, so a gap above 2h*max(max|gate|, max|x|) (with a
// factor 2 to spare) cannot change the selection.  FD also asserts that it did not.
Block make_block(long N, int C, int E, int K, int I, uint32_t seed,
                 const std::function<void(Block&)>& shape = nullptr,
                 const std::function<bool(const Block&)>& accept = nullptr) {
  for (uint32_t s = seed; s < seed + 200; s++) {
    Block b{N, C, E, K, I, random_vector(N * C, s), random_vector((long)E * C, s + 1000, 0.6f),
            random_vector((long)E * I * C, s + 2000, 1.0f / std::sqrt((float)C)),
            random_vector((long)E * I * C, s + 3000, 1.0f / std::sqrt((float)C)),
            random_vector((long)E * C * I, s + 4000, 1.0f / std::sqrt((float)I))};
    if (shape) shape(b);
    const double need = 4.0 * kFdStep * std::max(max_abs(b.gate), max_abs(b.x));
    if (min_selection_gap(b) > need && (!accept || accept(b))) return b;
  }
  ADD_FAILURE() << "no seed gave a safe routing margin";
  return {};
}

// Forward against the double reference, then finite differences for every input and weight.
void check_block(const Block& b0, const std::string& name) {
  SCOPED_TRACE(name);
  ASSERT_FALSE(b0.x.empty());
  Block b = b0;
  Acts a;
  forward(a, b);
  std::vector<std::vector<int>> ref_sets;
  const auto ref = reference(b, &ref_sets);
  ASSERT_EQ(chosen_sets(a, b.N, b.K), ref_sets) << "top-K selection differs from the reference";
  double ref_max = 0.0, err = 0.0;
  for (size_t i = 0; i < ref.size(); i++) {
    ref_max = std::max(ref_max, std::fabs(ref[i]));
    err = std::max(err, std::fabs(ref[i] - (double)a.out[i]));
  }
  // fp32 dot products of length <= 64 over O(1) values: each output carries a few 1e-7 relative
  // rounding errors per stage (gate, softmax, three GEMMs, combine); 1e-5 of the largest output is
  // ~30x that, while any indexing or weighting bug is O(1).
  EXPECT_GT(ref_max, 0.1);
  EXPECT_LE(err, 1e-5 * ref_max) << "forward vs double reference";

  const auto r = random_vector(b.N * b.C, 77);
  const Grads g = backward(a, b, r);
  const auto sets0 = chosen_sets(a, b.N, b.K);
  bool selection_changed = false;
  auto loss = [&]() {
    Acts t;
    forward(t, b);
    if (chosen_sets(t, b.N, b.K) != sets0) selection_changed = true;
    return testing::weighted_sum(t.out, r);
  };
  expect_gradient_close(finite_difference(b.x, g.x, loss, kFdStep), "dx");
  expect_gradient_close(finite_difference(b.gate, g.gate, loss, kFdStep), "dgate");
  expect_gradient_close(finite_difference(b.w1, g.w1, loss, kFdStep), "dw1");
  expect_gradient_close(finite_difference(b.w3, g.w3, loss, kFdStep), "dw3");
  expect_gradient_close(finite_difference(b.w2, g.w2, loss, kFdStep), "dw2");
  EXPECT_FALSE(selection_changed) << "a finite-difference step changed the top-K selection";
}

TEST(MoePlan, CountingSortOrder) {
  // N=3, K=2, E=4: expert 3 gets nothing.
  const std::vector<int32_t> idx = {2, 0, 0, 1, 2, 1};
  ops::MoePlan p;
  ops::moe_plan_build(p, idx.data(), 3, 4, 2);
  EXPECT_EQ(p.expert_offsets, (std::vector<int64_t>{0, 2, 4, 6, 6}));
  EXPECT_EQ(p.row_token, (std::vector<int32_t>{0, 1, 1, 2, 0, 2}));
  EXPECT_EQ(p.row_of, (std::vector<int32_t>{4, 0, 1, 2, 5, 3}));
  const std::vector<int32_t> bad = {0, 4};
  EXPECT_THROW(ops::moe_plan_build(p, bad.data(), 1, 4, 2), Error);
}

TEST(MoeBlock, ForwardAndGradients) { check_block(make_block(8, 16, 4, 2, 20, 1), "N8 C16 E4 K2 I20"); }

TEST(MoeBlock, EmptyExpert) {
  const Block b = make_block(8, 16, 4, 2, 20, 11, route_bias({0.0f, 0.0f, 0.0f, -4.0f}),
                             [](const Block& b) {
                               const auto rows = expert_rows(b);
                               return rows[3] == 0 && rows[0] > 0 && rows[1] > 0 && rows[2] > 0;
                             });
  ASSERT_EQ(expert_rows(b)[3], 0);
  check_block(b, "expert 3 empty");
}

TEST(MoeBlock, AllTokensOnOneExpert) {
  auto on_two = [](const Block& b) { return expert_rows(b)[2] == b.N; };
  const Block b = make_block(8, 16, 4, 1, 20, 21, route_bias({-4.0f, -4.0f, 4.0f, -4.0f}), on_two);
  EXPECT_EQ(expert_rows(b), (std::vector<int64_t>{0, 0, 8, 0}));
  check_block(b, "all tokens on expert 2, K=1");
  // K=2 with expert 2 in every token's top-2
  const Block b2 = make_block(8, 16, 4, 2, 20, 31, route_bias({0.0f, 0.0f, 4.0f, 0.0f}), on_two);
  EXPECT_EQ(expert_rows(b2)[2], 8);
  check_block(b2, "expert 2 in every top-2");
}

TEST(MoeBlock, KEqualsE) {
  const Block b = make_block(6, 16, 3, 3, 20, 41);
  EXPECT_EQ(expert_rows(b), (std::vector<int64_t>{6, 6, 6}));
  check_block(b, "K=E=3");
}

TEST(MoeBlock, KEqualsOne) { check_block(make_block(10, 16, 4, 1, 20, 51), "K=1"); }

TEST(MoeBlock, OddSizes) { check_block(make_block(7, 24, 3, 2, 40, 61), "E3 C24 I40"); }

TEST(MoeBlock, ParameterGradientsAccumulate) {
  const Block b = make_block(5, 8, 3, 2, 12, 71);
  Acts a;
  forward(a, b);
  const long M = b.M();
  const auto dy = random_vector(M * b.C, 5);
  std::vector<float> dx(M * b.C), scratch(3 * M * b.I);
  const std::vector<float> w13 = b.w13();
  std::vector<float> dw13(w13.size(), 0.0f), dw2(b.w2.size(), 0.0f);
  auto run = [&]() {
    ops::moe_experts_backward(dx.data(), dw13.data(), dw2.data(), scratch.data(), dy.data(), a.h13.data(),
                              a.act.data(), a.xperm.data(), w13.data(), b.w2.data(), a.plan, b.C, b.I);
  };
  run();
  const auto once13 = dw13, once2 = dw2, dx1 = dx;
  run();
  // x + x is exact in binary floating point, so "accumulate" means exactly twice
  for (size_t i = 0; i < dw13.size(); i++) ASSERT_EQ(dw13[i], 2.0f * once13[i]);
  for (size_t i = 0; i < dw2.size(); i++) ASSERT_EQ(dw2[i], 2.0f * once2[i]);
  EXPECT_EQ(dx, dx1);  // activation gradient assigns
}

// Results must be bitwise identical for 1 and 2 OpenMP threads (the BLAS thread count is left
// alone: OpenBLAS here is the pthread build and does not follow omp_set_num_threads).
TEST(MoeBlock, DeterministicAcrossThreadCounts) {
  const Block b = make_block(64, 32, 4, 2, 48, 81);
  const auto r = random_vector(b.N * b.C, 9);
  const int saved = omp_get_max_threads();
  auto run = [&](int threads, Acts& a) {
    omp_set_num_threads(threads);
    forward(a, b);
    return backward(a, b, r);
  };
  Acts a1, a2;
  const Grads g1 = run(1, a1);
  const Grads g2 = run(2, a2);
  omp_set_num_threads(saved);
  auto same = [](const std::vector<float>& u, const std::vector<float>& v) {
    return u.size() == v.size() && std::memcmp(u.data(), v.data(), u.size() * sizeof(float)) == 0;
  };
  EXPECT_TRUE(same(a1.out, a2.out));
  EXPECT_TRUE(same(a1.probs, a2.probs));
  EXPECT_EQ(a1.idx, a2.idx);
  EXPECT_TRUE(same(g1.x, g2.x));
  EXPECT_TRUE(same(g1.gate, g2.gate));
  EXPECT_TRUE(same(g1.w1, g2.w1));
  EXPECT_TRUE(same(g1.w3, g2.w3));
  EXPECT_TRUE(same(g1.w2, g2.w2));
}

}  // namespace
}  // namespace moetron
