#include "ops/swiglu.h"

#include <cmath>

#include "ops/exp.h"

namespace moetron::ops {

namespace {

template <float (*Exp)(float)>
void swiglu_rows(float* out, const float* gate_up, long N, int I) {
#pragma omp parallel for schedule(static) if (N * I >= 32768)
  for (long n = 0; n < N; n++) {
    const float* gate = gate_up + n * 2 * I;
    const float* up = gate + I;
    float* o = out + n * I;
    for (int i = 0; i < I; i++) {
      const float g = gate[i];
      o[i] = g / (1.0f + Exp(-g)) * up[i];
    }
  }
}

float libm_exp(float x) { return std::exp(x); }

}  // namespace

void swiglu_forward(float* out, const float* gate_up, long N, int I) { swiglu_rows<libm_exp>(out, gate_up, N, I); }

void swiglu_forward_exp_f32(float* out, const float* gate_up, long N, int I) {
  swiglu_rows<exp_f32>(out, gate_up, N, I);
}

void swiglu_backward(float* dgate_up, const float* dout, const float* gate_up, long N, int I) {
#pragma omp parallel for schedule(static) if (N * I >= 32768)
  for (long n = 0; n < N; n++) {
    const float* gate = gate_up + n * 2 * I;
    const float* up = gate + I;
    const float* d = dout + n * I;
    float* dgate = dgate_up + n * 2 * I;
    float* dup = dgate + I;
    for (int i = 0; i < I; i++) {
      const float g = gate[i];
      const float sig = 1.0f / (1.0f + std::exp(-g));
      // d silu / dg = sig * (1 + g * (1 - sig))
      dgate[i] = d[i] * up[i] * sig * (1.0f + g * (1.0f - sig));
      dup[i] = d[i] * g * sig;
    }
  }
}

}  // namespace moetron::ops
