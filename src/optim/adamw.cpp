#include "optim/adamw.h"

#include <cmath>

#include "ops/adamw.h"

namespace moetron {

void adamw_update(float* param, float* m, float* v, const float* grad, size_t n, float grad_scale, double lr,
                  double beta1, double beta2, double eps, double weight_decay, long step) {
  const ops::AdamWStep s = ops::adamw_step(lr, beta1, beta2, eps, weight_decay, step);
  // firstprivate: each thread keeps the factors in registers (stores to m and v cannot alias them).
#pragma omp parallel for schedule(static) firstprivate(s)
  for (size_t i = 0; i < n; i++) param[i] = ops::adamw_element(param[i], grad[i] * grad_scale, m[i], v[i], s);
}

double global_grad_norm(const float* grad, size_t n) {
  // Fixed-size chunks summed in order: the result does not depend on the thread count.
  constexpr size_t chunk = 1 << 14;
  const size_t nchunks = (n + chunk - 1) / chunk;
  std::vector<double> partial(nchunks, 0.0);
#pragma omp parallel for schedule(static)
  for (size_t c = 0; c < nchunks; c++) {
    double s = 0.0;
    const size_t end = std::min(n, (c + 1) * chunk);
    for (size_t i = c * chunk; i < end; i++) s += (double)grad[i] * grad[i];
    partial[c] = s;
  }
  double total = 0.0;
  for (double s : partial) total += s;
  return std::sqrt(total);
}

double clip_coefficient(double grad_norm, double max_norm) {
  if (max_norm <= 0.0) return 1.0;
  const double coef = max_norm / (grad_norm + 1e-6);
  return coef < 1.0 ? coef : 1.0;
}

AdamW::AdamW(const ParamTable& table, const AdamWConfig& cfg)
    : table_(table), cfg_(cfg), m_(table.total(), 0.0f), v_(table.total(), 0.0f) {}

void AdamW::step(float* params, const float* grads, double lr, float grad_scale) {
  step_++;
  for (const ParamSpec& s : table_.specs()) {
    const double wd = s.weight_decay ? cfg_.weight_decay : 0.0;
    adamw_update(params + s.offset, m_.data() + s.offset, v_.data() + s.offset, grads + s.offset, s.numel,
                 grad_scale, lr, cfg_.beta1, cfg_.beta2, cfg_.eps, wd, step_);
  }
}

}  // namespace moetron
