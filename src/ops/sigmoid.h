// The logistic sigmoid, Qwen2-MoE's shared-expert gate: out = shared_expert(x) * sigmoid(x . w_gate).
// Elementwise over n values; activation gradients assign (=).
#pragma once

namespace moetron::ops {

// s[i] = 1 / (1 + exp(-x[i]))
void sigmoid_forward(float* s, const float* x, long n);
// dx[i] = ds[i] * s[i] * (1 - s[i]), from the forward's output s.
void sigmoid_backward(float* dx, const float* ds, const float* s, long n);

}  // namespace moetron::ops
