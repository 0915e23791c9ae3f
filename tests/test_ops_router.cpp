// Tests for the MoE router (src/ops/router.h): softmax + top-K + renormalisation against a double
// reference, the backward by finite differences, and the auxiliary losses (HF pooled, Switch /
// Megatron per-layer, z-loss) by value and by finite differences w.r.t. every layer's logits.
//   N tokens, E experts, K experts per token, L layers.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "gradcheck.h"
#include "ops/router.h"

namespace moetron {
namespace {

using ops::RouterLayerStats;
using testing::expect_gradient_close;
using testing::finite_difference;
using testing::random_vector;

// Double-precision reference of the router for one token.
struct RefRoute {
  std::vector<double> probs;
  std::vector<int> idx;  // descending prob, ties to the lower index
  std::vector<double> weight;
};

RefRoute ref_route(const float* logits, int E, int K) {
  RefRoute r;
  double mx = logits[0];
  for (int e = 1; e < E; e++) mx = std::max(mx, (double)logits[e]);
  double s = 0.0;
  r.probs.resize(E);
  for (int e = 0; e < E; e++) s += (r.probs[e] = std::exp((double)logits[e] - mx));
  for (auto& p : r.probs) p /= s;
  std::vector<int> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return r.probs[a] > r.probs[b]; });
  r.idx.assign(order.begin(), order.begin() + K);
  double sum = 0.0;
  for (int e : r.idx) sum += r.probs[e];
  for (int e : r.idx) r.weight.push_back(r.probs[e] / sum);
  return r;
}

// Logits whose sorted values are at least `gap` apart in every row: a random permutation of
// {0, gap, 2*gap, ...} plus noise of at most 0.1*gap.  A finite-difference step h < 0.4*gap on one
// logit can then never change the top-K selection.
std::vector<float> separated_logits(long N, int E, float gap, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> noise(-0.1f * gap, 0.1f * gap);
  std::vector<float> l(N * E);
  for (long n = 0; n < N; n++) {
    std::vector<int> perm(E);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), gen);
    for (int e = 0; e < E; e++) l[n * E + e] = gap * (float)perm[e] - 0.5f * gap * E + noise(gen);
  }
  return l;
}

// Forward of L layers of routers; keeps everything the losses and the backward need.
struct Layers {
  long N;
  int E, K, L;
  bool renormalize = true;
  std::vector<float> probs;     // [L,N,E]
  std::vector<int32_t> idx;     // [L,N,K]
  std::vector<float> weight;    // [L,N,K]
  std::vector<RouterLayerStats> stats;
  void forward(const std::vector<float>& logits, const uint8_t* mask) {
    probs.resize((size_t)L * N * E);
    idx.resize((size_t)L * N * K);
    weight.resize((size_t)L * N * K);
    stats.resize(L);
    for (int l = 0; l < L; l++) {
      ops::router_forward(&probs[l * N * E], &idx[l * N * K], &weight[l * N * K], &logits[l * N * E],
                          N, E, K, renormalize);
      ops::router_layer_stats(stats[l], &logits[l * N * E], &probs[l * N * E], &idx[l * N * K], mask,
                              N, E, K);
    }
  }
};

TEST(RouterForward, MatchesDoubleReference) {
  const long N = 32;
  const int E = 8, K = 2;
  auto logits = random_vector(N * E, 11, 2.0f);
  std::vector<float> probs(N * E), w(N * K);
  std::vector<int32_t> idx(N * K);
  ops::router_forward(probs.data(), idx.data(), w.data(), logits.data(), N, E, K);
  for (long n = 0; n < N; n++) {
    RefRoute r = ref_route(&logits[n * E], E, K);
    // fp32 exp and division: relative error a few ulp (~1e-7) of values <= 1.
    for (int e = 0; e < E; e++) EXPECT_NEAR(probs[n * E + e], r.probs[e], 1e-6) << n << "," << e;
    for (int k = 0; k < K; k++) {
      EXPECT_EQ(idx[n * K + k], r.idx[k]) << "token " << n << " slot " << k;
      EXPECT_NEAR(w[n * K + k], r.weight[k], 1e-6) << "token " << n << " slot " << k;
    }
  }
}

TEST(RouterForward, TiesGoToLowerIndexAndKEqualsE) {
  const int E = 4;
  // row 0: all equal -> 0,1,2,3; row 1: experts 1 and 2 tie for the top -> 1,2,...
  std::vector<float> logits = {0.5f, 0.5f, 0.5f, 0.5f, 1.0f, 3.0f, 3.0f, 0.0f};
  std::vector<float> probs(2 * E), w(2 * E);
  std::vector<int32_t> idx(2 * E);
  ops::router_forward(probs.data(), idx.data(), w.data(), logits.data(), 2, E, E);
  EXPECT_EQ(idx, (std::vector<int32_t>{0, 1, 2, 3, 1, 2, 0, 3}));
  for (int k = 0; k < E; k++) EXPECT_NEAR(w[k], 0.25f, 1e-7);
  ops::router_forward(probs.data(), idx.data(), w.data(), logits.data(), 2, E, 1);
  EXPECT_EQ(idx[0], 0);
  EXPECT_EQ(idx[1], 1);
  EXPECT_EQ(w[0], 1.0f);  // K = 1: p / p is exactly 1
}

TEST(RouterForward, RejectsBadK) {
  std::vector<float> logits(4), probs(4), w(8);
  std::vector<int32_t> idx(8);
  EXPECT_THROW(ops::router_forward(probs.data(), idx.data(), w.data(), logits.data(), 1, 4, 5), Error);
  EXPECT_THROW(ops::router_forward(probs.data(), idx.data(), w.data(), logits.data(), 1, 4, 0), Error);
}

// L = sum r[n,k] * topk_weight[n,k] + sum_{real n, e} a[e] * probs[n,e]: exercises both inputs of
// router_backward (the renormalisation chain and the per-expert aux-loss gradient under a mask).
// renormalize false (Qwen3-MoE's norm_topk_prob false): the top-K weights are the probabilities
// themselves, and the gradient reaches them without the renormalisation chain.
TEST(RouterBackward, FiniteDifferences) {
 for (bool renorm : {true, false})
  for (int K : {1, 2, 3, 5}) {
    SCOPED_TRACE(renorm ? "renormalised" : "not renormalised");
    const long N = 7;
    const int E = 5;
    auto logits = separated_logits(N, E, 0.2f, 100 + K);
    const auto r = random_vector(N * K, 200 + K);
    const std::vector<double> a = {0.3, -0.7, 1.1, 0.05, -0.4};
    const std::vector<uint8_t> mask = {1, 0, 1, 1, 0, 1, 1};
    Layers f{N, E, K, 1, renorm, {}, {}, {}, {}};
    f.forward(logits, mask.data());
    if (!renorm) {
      for (long n = 0; n < N; n++)
        for (int k = 0; k < K; k++)
          ASSERT_EQ(f.weight[n * K + k], f.probs[n * E + f.idx[n * K + k]]) << "the weight is the probability";
    }
    const auto idx0 = f.idx;
    std::vector<float> dlogits(N * E);
    ops::router_backward(dlogits.data(), r.data(), a.data(), mask.data(), f.probs.data(), f.idx.data(),
                         f.weight.data(), N, E, K, renorm);
    bool selection_changed = false;
    auto loss = [&]() {
      f.forward(logits, mask.data());
      if (f.idx != idx0) selection_changed = true;
      double s = testing::weighted_sum(f.weight, r);
      for (long n = 0; n < N; n++)
        if (mask[n])
          for (int e = 0; e < E; e++) s += a[e] * f.probs[n * E + e];
      return s;
    };
    // h = 1e-2 < 0.4 * gap (0.2): the selection cannot change (asserted below).
    auto res = finite_difference(logits, dlogits, loss, 1e-2f);
    ASSERT_FALSE(selection_changed) << "K=" << K;
    expect_gradient_close(res, ("router dlogits, K=" + std::to_string(K)).c_str());
  }
}

// The tiny hand case: N=4, E=3, K=2, two layers, token 2 is padding (mask 0).
//   layer 0 real tokens choose {0,1} {0,2} {1,0}; layer 1 choose {2,0} {0,1} {1,2}.
const std::vector<float> kTinyLogits = {
    2.0f,  1.0f,  0.0f, 1.5f,  0.0f, 0.5f,  -4.0f, 3.0f, 4.0f, 0.3f, 1.2f, -0.7f,   // layer 0
    0.5f, -1.0f,  1.5f, 3.0f,  0.0f, -2.0f, -3.0f, 2.0f, 2.5f, 0.2f, 1.0f, 0.25f};  // layer 1
const std::vector<uint8_t> kTinyMask = {1, 1, 0, 1};

TEST(RouterAuxLoss, TinyCaseValues) {
  const long N = 4;
  const int E = 3, K = 2, L = 2;
  Layers f{N, E, K, L, true, {}, {}, {}, {}};
  f.forward(kTinyLogits, kTinyMask.data());
  // Independent double computation straight from the formulas in router.h.
  std::vector<double> assigned(E, 0.0), psum(E, 0.0);
  double tokens = 0.0, per_layer = 0.0, z = 0.0;
  for (int l = 0; l < L; l++) {
    std::vector<double> as_l(E, 0.0), ps_l(E, 0.0);
    double n_l = 0.0, z_l = 0.0;
    for (long n = 0; n < N; n++) {
      if (!kTinyMask[n]) continue;
      const float* row = &kTinyLogits[(l * N + n) * E];
      RefRoute r = ref_route(row, E, K);
      for (int e : r.idx) as_l[e] += 1.0;
      for (int e = 0; e < E; e++) ps_l[e] += r.probs[e];
      double lse = 0.0;
      for (int e = 0; e < E; e++) lse += std::exp((double)row[e]);
      z_l += std::log(lse) * std::log(lse);
      n_l += 1.0;
    }
    double dot = 0.0;
    for (int e = 0; e < E; e++) {
      dot += as_l[e] * ps_l[e];
      assigned[e] += as_l[e];
      psum[e] += ps_l[e];
    }
    per_layer += E / (n_l * n_l * K) * dot;
    z += z_l / n_l;
    tokens += n_l;
  }
  double pooled = 0.0;
  for (int e = 0; e < E; e++) pooled += (assigned[e] / tokens) * (psum[e] / tokens);
  pooled *= E;

  std::vector<double> g;
  const double got_pooled = ops::load_balancing_loss_pooled(f.stats, E, K, &g);
  double got_per_layer = 0.0, got_z = 0.0;
  for (int l = 0; l < L; l++) {
    got_per_layer += ops::load_balancing_loss_layer(f.stats[l], E, K, nullptr);
    got_z += ops::router_z_loss_layer(f.stats[l]);
  }
  // Our statistics are sums of fp32 probabilities (rel. error ~1e-7); the reference is double.
  EXPECT_NEAR(got_pooled, pooled, 1e-6);
  EXPECT_NEAR(got_per_layer, per_layer, 1e-6);
  EXPECT_NEAR(got_z, z, 1e-6);
  // Values printed by transformers 5.24 load_balancing_loss_func((L0, L1), 3, 2, mask) (it works
  // in fp32, hence 1e-6) and by torch for the Megatron formulas, on the same logits:
  EXPECT_NEAR(got_pooled, 2.1358208656311, 1e-6);
  EXPECT_NEAR(got_per_layer, 2.18961188186014, 1e-6);
  EXPECT_NEAR(got_z, 9.3069484692061, 1e-6);
  // The mask matters: without it HF gives 1.98267924785614.
  Layers u{N, E, K, L, true, {}, {}, {}, {}};
  u.forward(kTinyLogits, nullptr);
  EXPECT_NEAR(ops::load_balancing_loss_pooled(u.stats, E, K, nullptr), 1.98267924785614, 1e-6);
  // Pooled gradient on probs: E * assigned[e] / tokens^2, assigned = 5, 4, 3 over 6 real rows.
  ASSERT_EQ(g.size(), 3u);
  EXPECT_NEAR(g[0], 3.0 * 5 / 36, 1e-12);
  EXPECT_NEAR(g[1], 3.0 * 4 / 36, 1e-12);
  EXPECT_NEAR(g[2], 3.0 * 3 / 36, 1e-12);
}

TEST(RouterAuxLoss, AllPaddingGivesZero) {
  const long N = 3;
  const int E = 4, K = 2;
  Layers f{N, E, K, 1, true, {}, {}, {}, {}};
  const std::vector<uint8_t> mask(N, 0);
  f.forward(random_vector(N * E, 5), mask.data());
  std::vector<double> g;
  EXPECT_EQ(ops::load_balancing_loss_pooled(f.stats, E, K, &g), 0.0);
  EXPECT_EQ(g, std::vector<double>(E, 0.0));
  EXPECT_EQ(ops::load_balancing_loss_layer(f.stats[0], E, K, &g), 0.0);
  EXPECT_EQ(ops::router_z_loss_layer(f.stats[0]), 0.0);
  std::vector<float> dl(N * E, 1.5f);
  ops::router_z_loss_backward(dl.data(), random_vector(N * E, 5).data(), f.probs.data(), mask.data(),
                              N, E, 1.0f);
  EXPECT_EQ(dl, std::vector<float>(N * E, 1.5f));
}

enum class Aux { kPooled, kPerLayer, kZ };

// Finite differences of an aux loss w.r.t. the logits of EVERY layer, the selection held fixed.
void check_aux_gradient(Aux kind, int K) {
  const long N = 6;
  const int E = 4, L = 3;
  const float zscale = 0.7f;
  const std::vector<uint8_t> mask = {1, 1, 0, 1, 0, 1};
  auto logits = separated_logits((long)L * N, E, 0.25f, 300 + K);
  Layers f{N, E, K, L, true, {}, {}, {}, {}};
  auto value = [&]() {
    switch (kind) {
      case Aux::kPooled: return ops::load_balancing_loss_pooled(f.stats, E, K, nullptr);
      case Aux::kPerLayer: {
        double s = 0.0;
        for (int l = 0; l < L; l++) s += ops::load_balancing_loss_layer(f.stats[l], E, K, nullptr);
        return s;
      }
      case Aux::kZ: {
        double s = 0.0;
        for (int l = 0; l < L; l++) s += ops::router_z_loss_layer(f.stats[l]);
        return zscale * s;
      }
    }
    return 0.0;
  };
  f.forward(logits, mask.data());
  const auto idx0 = f.idx;
  std::vector<double> gp;
  if (kind == Aux::kPooled) ops::load_balancing_loss_pooled(f.stats, E, K, &gp);
  std::vector<float> dlogits(L * N * E);
  for (int l = 0; l < L; l++) {
    const double* g = nullptr;
    std::vector<double> gl;
    if (kind == Aux::kPooled) g = gp.data();
    if (kind == Aux::kPerLayer) {
      ops::load_balancing_loss_layer(f.stats[l], E, K, &gl);
      g = gl.data();
    }
    float* dl = &dlogits[l * N * E];
    ops::router_backward(dl, nullptr, g, mask.data(), &f.probs[l * N * E], &f.idx[l * N * K],
                         &f.weight[l * N * K], N, E, K);
    if (kind == Aux::kZ)
      ops::router_z_loss_backward(dl, &logits[l * N * E], &f.probs[l * N * E], mask.data(), N, E, zscale);
  }
  bool selection_changed = false;
  auto loss = [&]() {
    f.forward(logits, mask.data());
    if (f.idx != idx0) selection_changed = true;
    return value();
  };
  // h = 1e-2 < 0.4 * gap (0.25): no selection change (asserted).
  auto res = finite_difference(logits, dlogits, loss, 1e-2f);
  ASSERT_FALSE(selection_changed);
  // padding tokens must get exactly zero gradient
  for (int l = 0; l < L; l++)
    for (long n = 0; n < N; n++)
      if (!mask[n]) {
        for (int e = 0; e < E; e++) EXPECT_EQ(dlogits[(l * N + n) * E + e], 0.0f);
      }
  // The gradient is not trivially zero (so the check can fail).
  EXPECT_GT(res.max_ref, 1e-3);
  expect_gradient_close(res, "aux loss dlogits");
}

TEST(RouterAuxLoss, PooledGradientAllLayers) {
  check_aux_gradient(Aux::kPooled, 2);
  check_aux_gradient(Aux::kPooled, 1);
}
TEST(RouterAuxLoss, PerLayerGradientAllLayers) {
  check_aux_gradient(Aux::kPerLayer, 2);
  check_aux_gradient(Aux::kPerLayer, 3);
}
TEST(RouterAuxLoss, ZLossGradientAllLayers) { check_aux_gradient(Aux::kZ, 2); }

// DeepSeek-V3's sequence-wise balance loss (ops/router.h), for the sigmoid and the softmax router: its
// value against this test's own reading of the paper's formula, and its gradient through the
// normalised scores against finite differences (2 rows of 4 tokens, one a padding token).
void check_sequence_loss(bool sigmoid) {
  const long N = 8;
  const int E = 4, K = 2, row = 4;
  const std::vector<uint8_t> mask = {1, 1, 1, 1, 1, 0, 1, 1};
  auto logits = separated_logits(N, E, 0.25f, sigmoid ? 71 : 72);
  ops::RouterSpec spec = ops::RouterSpec::softmax(true);
  spec.sigmoid = sigmoid;
  std::vector<float> probs(N * E), w(N * K);
  std::vector<int32_t> idx(N * K);
  auto run = [&](std::vector<double>* grad) {
    ops::router_forward(probs.data(), idx.data(), w.data(), logits.data(), nullptr, N, E, K, spec);
    ops::RouterLayerStats st;
    ops::router_row_stats(st, probs.data(), idx.data(), mask.data(), N, E, K, row, sigmoid);
    return ops::sequence_balance_loss(st, E, K, grad);
  };
  std::vector<double> g;
  const double value = run(&g);
  const auto idx0 = idx;
  // The formula: per row, f_e = E / (K T) #{t: e in top-K}, P_e = mean of s'_e; the mean over rows.
  double want = 0;
  for (int b = 0; b < 2; b++) {
    double T = 0, f[4] = {0, 0, 0, 0}, P[4] = {0, 0, 0, 0};
    for (int t = 0; t < row; t++) {
      const long n = b * row + t;
      if (!mask[n]) continue;
      T += 1;
      double S = 0;
      for (int e = 0; e < E; e++) S += probs[n * E + e];
      for (int e = 0; e < E; e++) P[e] += probs[n * E + e] / (sigmoid ? S : 1.0);
      for (int k = 0; k < K; k++) f[idx[n * K + k]] += 1;
    }
    for (int e = 0; e < E; e++) want += ((double)E / (K * T) * f[e]) * (P[e] / T) / 2;
  }
  EXPECT_NEAR(value, want, 1e-12);
  std::vector<float> row_grad(g.begin(), g.end()), dlogits(N * E, 0.0f);
  ops::router_sequence_backward(dlogits.data(), row_grad.data(), mask.data(), probs.data(), N, E, row, sigmoid, 1.0f);
  bool selection_changed = false;
  auto loss = [&]() {
    const double v = run(nullptr);
    if (idx != idx0) selection_changed = true;
    return v;
  };
  auto res = finite_difference(logits, dlogits, loss, 1e-2f);
  ASSERT_FALSE(selection_changed);
  for (int e = 0; e < E; e++) EXPECT_EQ(dlogits[5 * E + e], 0.0f);  // the padding token
  EXPECT_GT(res.max_ref, 1e-4);
  expect_gradient_close(res, sigmoid ? "sequence loss dlogits (sigmoid)" : "sequence loss dlogits (softmax)");
}

TEST(RouterAuxLoss, SequenceLossValueAndGradient) {
  check_sequence_loss(true);
  check_sequence_loss(false);
}

// DeepSeek-V3's selection (ops/router.h) on hand-made scores: the best single expert sits in a group
// whose two best sum less than another group's, so the group limit moves the choice; the selection
// bias moves it again without changing the weights, which are the unbiased sigmoid scores.
TEST(RouterSigmoid, GroupsAndSelectionBiasChooseWeightsDoNot) {
  const auto logit = [](double p) { return (float)std::log(p / (1.0 - p)); };
  // Experts 0..3 in groups {0,1} and {2,3}: scores 0.9, 0.1 | 0.6, 0.55.
  const std::vector<float> l = {logit(0.9), logit(0.1), logit(0.6), logit(0.55)};
  ops::RouterSpec spec;
  spec.sigmoid = true;
  spec.renormalize = false;
  spec.scale = 2.0f;
  std::vector<float> p(4), w(1);
  std::vector<int32_t> idx(1);
  spec.n_group = 1;  // one group: the best score wins
  ops::route_token(p.data(), idx.data(), w.data(), l.data(), nullptr, 4, 1, spec);
  EXPECT_EQ(idx[0], 0);
  EXPECT_NEAR(w[0], 2.0 * 0.9, 1e-6);
  spec.n_group = 2;  // group {2,3} scores 1.15 > 1.0: expert 0 is not searched
  spec.topk_group = 1;
  ops::route_token(p.data(), idx.data(), w.data(), l.data(), nullptr, 4, 1, spec);
  EXPECT_EQ(idx[0], 2);
  EXPECT_NEAR(w[0], 2.0 * 0.6, 1e-6);
  // A bias of +0.1 on expert 3 makes it the group's best; the weight stays its own score.
  const std::vector<float> bias = {0.0f, 0.0f, 0.0f, 0.1f};
  ops::route_token(p.data(), idx.data(), w.data(), l.data(), bias.data(), 4, 1, spec);
  EXPECT_EQ(idx[0], 3);
  EXPECT_NEAR(w[0], 2.0 * 0.55, 1e-6);
  // A bias of +0.3 on expert 1 lifts group {0,1} to 1.3 > 1.25: expert 0 (0.9) is chosen again.
  const std::vector<float> bias1 = {0.0f, 0.3f, 0.0f, 0.1f};
  ops::route_token(p.data(), idx.data(), w.data(), l.data(), bias1.data(), 4, 1, spec);
  EXPECT_EQ(idx[0], 0);
  // K = 2, renormalised: the two weights are p / (p0 + p1) x scale.
  spec.renormalize = true;
  std::vector<float> w2(2);
  std::vector<int32_t> idx2(2);
  ops::route_token(p.data(), idx2.data(), w2.data(), l.data(), nullptr, 4, 2, spec);
  EXPECT_EQ(idx2, (std::vector<int32_t>{2, 3}));
  EXPECT_NEAR(w2[0], 2.0 * 0.6 / 1.15, 1e-6);
  EXPECT_NEAR(w2[1], 2.0 * 0.55 / 1.15, 1e-6);
  // Bad specs are refused naming the op.
  spec.n_group = 3;
  EXPECT_THROW(ops::router_forward(p.data(), idx.data(), w.data(), l.data(), nullptr, 1, 4, 1, spec), Error);
}

}  // namespace
}  // namespace moetron
