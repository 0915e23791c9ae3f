// Finite-difference gradient checking for the CPU ops.
//
// Each op test builds a scalar objective L = sum_i r_i * out_i with fixed random r (so every
// output element matters), computes the analytic gradient with the op's backward (dout = r),
// and compares it with central differences (L(x+h) - L(x-h)) / 2h evaluated in double.
//
// Tolerance and why: the ops compute in fp32, so L carries a relative rounding error of about
// 1e-7 * sqrt(n); divided by 2h (h = 1e-2 by default) this gives absolute errors near 1e-5 in
// the difference quotient, while the truncation error of central differences is O(h^2 * f''')
// ~ 1e-4 for the smooth ops here.  We therefore require |analytic - numeric| <= 2e-3 * max|numeric|
// + 1e-4 per element; a wrong backward (a missing term, a transposed index) misses by O(1).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include <gtest/gtest.h>

namespace moetron::testing {

inline std::vector<float> random_vector(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

// sum_i r_i * out_i in double
inline double weighted_sum(const std::vector<float>& out, const std::vector<float>& r) {
  double s = 0.0;
  for (size_t i = 0; i < out.size(); i++) s += (double)out[i] * (double)r[i];
  return s;
}

struct GradCheckResult {
  double max_abs_err = 0.0;
  double max_ref = 0.0;
  size_t worst_index = 0;
  size_t checked = 0;
};

// Perturbs x in place (restoring it) and compares analytic[i] with the central difference of
// loss() for up to max_elems elements spread evenly over x.
inline GradCheckResult finite_difference(std::vector<float>& x, const std::vector<float>& analytic,
                                         const std::function<double()>& loss, float h = 1e-2f,
                                         size_t max_elems = 256) {
  GradCheckResult res;
  const size_t n = x.size();
  const size_t stride = std::max<size_t>(1, n / max_elems);
  std::vector<std::pair<size_t, double>> numeric;
  for (size_t i = 0; i < n; i += stride) {
    const float orig = x[i];
    x[i] = orig + h;
    const double lp = loss();
    x[i] = orig - h;
    const double lm = loss();
    x[i] = orig;
    const double num = (lp - lm) / (2.0 * (double)h);
    numeric.emplace_back(i, num);
    res.max_ref = std::max(res.max_ref, std::fabs(num));
  }
  for (auto [i, num] : numeric) {
    const double err = std::fabs((double)analytic[i] - num);
    if (err > res.max_abs_err) {
      res.max_abs_err = err;
      res.worst_index = i;
    }
    res.checked++;
  }
  return res;
}

inline void expect_gradient_close(const GradCheckResult& r, const char* what, double rel = 2e-3,
                                  double abs = 1e-4) {
  EXPECT_GT(r.checked, 0u) << what;
  EXPECT_LE(r.max_abs_err, rel * r.max_ref + abs)
      << what << ": worst element " << r.worst_index << " error " << r.max_abs_err
      << " (max |grad| " << r.max_ref << ")";
}

}  // namespace moetron::testing
