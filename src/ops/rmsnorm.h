// RMSNorm as in HF MixtralRMSNorm: out = weight * x / sqrt(mean(x^2) + eps).  N rows, C features.
// Parameter gradients accumulate (+=); activation gradients assign (=).
#pragma once

namespace moetron::ops {

// out[N,C], rstd[N] (saved: 1/sqrt(mean(x^2)+eps)), inp[N,C], weight[C]
void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, long N, int C,
                     float eps);

// dinp[N,C] = ... (assign), dweight[C] += ... (accumulate; deterministic reduction over rows)
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, long N, int C);

}  // namespace moetron::ops
