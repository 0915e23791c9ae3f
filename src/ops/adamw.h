// AdamW's arithmetic (torch.optim.AdamW, non-amsgrad), shared by the CPU update (optim/adamw.cpp) and
// the CUDA kernel (cuda/adamw.cu).  Per step, in double and rounded to float once:
//   step_size = lr / (1 - beta1^t),  bc2_sqrt = sqrt(1 - beta2^t),  decay = 1 - lr * weight_decay;
// per element, in float:
//   p *= decay;  m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g^2;  p -= step_size * m / (sqrt(v) / bc2_sqrt + eps).
// The types and the order of the operations are part of the contract: CPU runs are compared bitwise
// (determinism, resume).
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define MOETRON_HOST_DEVICE __host__ __device__
#else
#define MOETRON_HOST_DEVICE
#endif

namespace moetron::ops {

// The per-step factors of one update (step t is 1-based).
struct AdamWStep {
  float step_size, bc2_sqrt, decay, b1, b2, eps;
};

inline AdamWStep adamw_step(double lr, double beta1, double beta2, double eps, double weight_decay, long step) {
  const double bc1 = 1.0 - std::pow(beta1, (double)step);
  const double bc2 = 1.0 - std::pow(beta2, (double)step);
  AdamWStep s;
  s.step_size = (float)(lr / bc1);
  s.bc2_sqrt = (float)std::sqrt(bc2);
  s.decay = (float)(1.0 - lr * weight_decay);
  s.b1 = (float)beta1;
  s.b2 = (float)beta2;
  s.eps = (float)eps;
  return s;
}

// One parameter: updates its moments m and v from the (scaled) gradient g, returns the new value.
MOETRON_HOST_DEVICE inline float adamw_element(float param, float g, float& m, float& v, const AdamWStep& s) {
  float p = param * s.decay;
  const float mi = s.b1 * m + (1.0f - s.b1) * g;
  const float vi = s.b2 * v + (1.0f - s.b2) * g * g;
  m = mi;
  v = vi;
  p -= s.step_size * mi / (sqrtf(vi) / s.bc2_sqrt + s.eps);
  return p;
}

}  // namespace moetron::ops
