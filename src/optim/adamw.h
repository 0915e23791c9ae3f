// AdamW with decoupled weight decay, exactly as torch.optim.AdamW (non-amsgrad, non-foreach
// semantics):  p *= 1 - lr*wd;  m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g^2;
//              p -= (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
// (the arithmetic of ops/adamw.h, which the CUDA kernel shares) and global-norm gradient clipping as
// torch.nn.utils.clip_grad_norm_.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "model/params.h"

namespace moetron {

struct AdamWConfig {
  double lr = 1e-5;  // peak learning rate (the schedule scales it)
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;  // not applied to RMSNorm weights
};

// Updates n parameters in place with gradient g * grad_scale.  step is 1-based.
void adamw_update(float* param, float* m, float* v, const float* grad, size_t n, float grad_scale, double lr,
                  double beta1, double beta2, double eps, double weight_decay, long step);

// Global L2 norm of a flat gradient array (accumulated in double, deterministic).
double global_grad_norm(const float* grad, size_t n);

// torch's clip coefficient: min(1, max_norm / (norm + 1e-6)); max_norm <= 0 disables clipping.
double clip_coefficient(double grad_norm, double max_norm);

// Optimizer state over a ParamTable: first and second moments, one allocation each.
class AdamW {
 public:
  AdamW(const ParamTable& table, const AdamWConfig& cfg);
  // One step over all parameters at learning rate lr; weight decay skips norm weights.
  void step(float* params, const float* grads, double lr, float grad_scale);
  long steps_taken() const { return step_; }
  std::vector<float>& exp_avg() { return m_; }
  std::vector<float>& exp_avg_sq() { return v_; }
  void set_steps_taken(long s) { step_ = s; }

 private:
  const ParamTable& table_;
  AdamWConfig cfg_;
  std::vector<float> m_, v_;
  long step_ = 0;
};

}  // namespace moetron
