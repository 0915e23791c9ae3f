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

// The same norm over rows split across ranks (OLMoE's q/k norms under tensor parallelism): each rank
// holds C of the row's `width` features, and the two row sums the norm needs arrive from outside
// (a rank's partial sums, all-reduced by the caller).
//   row_dot:  out[n] = sum_c a[n,c] b[n,c] (w[c] when w is not null)  (assign): the sum of squares
//             (a = b = x) of the forward, sum_c w dy x of the backward.
//   forward:  rstd = 1/sqrt(ss * ss_scale / width + eps), out = weight * (x * rstd).
//   backward: dx = r w dy - (r^3 / width) x (dot * dot_scale); dweight += sum_n dy x r.
// (ss_scale, dot_scale: 1, or 1/rep for a head replicated on rep ranks whose partial sums count it rep
// times in ss and not at all in the replicas' share of dot -- see Model.)
void row_dot(float* out, const float* a, const float* b, const float* w, long N, int C);
void rmsnorm_forward_stats(float* out, float* rstd, const float* inp, const float* weight, const float* ss, long N,
                           int C, int width, float ss_scale, float eps);
void rmsnorm_backward_stats(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                            const float* rstd, const float* dot, long N, int C, int width, float dot_scale);

}  // namespace moetron::ops
