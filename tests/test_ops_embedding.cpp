// Tests for ops/embedding: lookup forward, deterministic scatter-add backward.
#include <gtest/gtest.h>
#include <omp.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "gradcheck.h"
#include "ops/embedding.h"

namespace moetron {
namespace {

using testing::random_vector;

std::vector<int32_t> random_ids(long n, int V, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int32_t> dist(0, V - 1);
  std::vector<int32_t> ids(n);
  for (auto& t : ids) t = dist(gen);
  return ids;
}

TEST(OpsEmbedding, ForwardCopiesRows) {
  const long N = 7;
  const int C = 5, V = 4;
  const std::vector<int32_t> ids = {3, 0, 0, 2, 1, 3, 3};
  const auto wte = random_vector((size_t)V * C, 1);
  std::vector<float> out(N * C, -1.0f);
  ops::embedding_forward(out.data(), ids.data(), wte.data(), N, C, V);
  for (long n = 0; n < N; n++)
    for (int c = 0; c < C; c++) EXPECT_EQ(out[n * C + c], wte[ids[n] * C + c]);  // a copy: exact
}

TEST(OpsEmbedding, OutOfRangeIdIsAnErrorNamingPositionAndId) {
  const int C = 2, V = 4;
  const auto wte = random_vector((size_t)V * C, 2);
  std::vector<float> out(3 * C), dwte(V * C);
  for (int32_t bad : {4, -1, 1000}) {
    const std::vector<int32_t> ids = {0, bad, 1};
    try {
      ops::embedding_forward(out.data(), ids.data(), wte.data(), 3, C, V);
      ADD_FAILURE() << "no error for id " << bad;
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("embedding_forward"), std::string::npos) << msg;
      EXPECT_NE(msg.find("position 1"), std::string::npos) << msg;
      EXPECT_NE(msg.find(std::to_string(bad)), std::string::npos) << msg;
      EXPECT_NE(msg.find("[0, 4)"), std::string::npos) << msg;
    }
    EXPECT_THROW(ops::embedding_backward(dwte.data(), out.data(), ids.data(), 3, C, V), Error);
  }
}

TEST(OpsEmbedding, BackwardAccumulatesScatter) {
  const long N = 50;
  const int C = 70, V = 6;  // C > 64: more than one column chunk; repeated ids
  const auto ids = random_ids(N, V, 3);
  const auto dout = random_vector(N * C, 4);
  const auto init = random_vector((size_t)V * C, 5);
  auto dwte = init;
  ops::embedding_backward(dwte.data(), dout.data(), ids.data(), N, C, V);
  std::vector<double> ref(init.begin(), init.end());
  for (long n = 0; n < N; n++)
    for (int c = 0; c < C; c++) ref[ids[n] * C + c] += dout[n * C + c];
  // fp32 sums of <= 50 O(1) terms: error ~ 50 * 6e-8 * |sum|.
  for (size_t i = 0; i < ref.size(); i++) EXPECT_NEAR(dwte[i], ref[i], 1e-5) << "element " << i;
}

TEST(OpsEmbedding, GradientMatchesFiniteDifference) {
  const long N = 9;
  const int C = 4, V = 5;
  const std::vector<int32_t> ids = {1, 4, 1, 0, 1, 3, 4, 4, 1};  // id 2 unused: zero gradient
  auto wte = random_vector((size_t)V * C, 6);
  const auto r = random_vector(N * C, 7);
  std::vector<float> out(N * C), dwte(V * C, 0.0f);
  ops::embedding_backward(dwte.data(), r.data(), ids.data(), N, C, V);
  auto loss = [&] {
    ops::embedding_forward(out.data(), ids.data(), wte.data(), N, C, V);
    return testing::weighted_sum(out, r);
  };
  testing::expect_gradient_close(testing::finite_difference(wte, dwte, loss), "embedding dwte");
}

TEST(OpsEmbedding, BackwardIsDeterministicAcrossThreadCounts) {
  // Large enough to run in parallel, few ids so every row receives many contributions.
  const long N = 4096;
  const int C = 256, V = 17;
  const auto ids = random_ids(N, V, 8);
  const auto dout = random_vector(N * C, 9);
  auto run = [&](int threads) {
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    std::vector<float> dwte(V * C, 0.0f);
    ops::embedding_backward(dwte.data(), dout.data(), ids.data(), N, C, V);
    omp_set_num_threads(saved);
    return dwte;
  };
  const auto a = run(2), b = run(2), c = run(1), d = run(3);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a, c);
  EXPECT_EQ(a, d);
}

}  // namespace
}  // namespace moetron
