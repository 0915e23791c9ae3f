// SwiGLU, the expert / dense FFN activation of Mixtral and Mistral: out = silu(gate) * up,
// where gate = x @ w1^T and up = x @ w3^T.  N rows, I features.
// Activation gradients assign (=).
#pragma once

namespace moetron::ops {

// out[N,I] = silu(gate[N,I]) * up[N,I]
void swiglu_forward(float* out, const float* gate, const float* up, long N, int I);

// dgate[N,I], dup[N,I] from dout[N,I] (assign).  dup may alias dout (elementwise: dout[i] is read
// before dup[i] is written); moe_experts_backward relies on this to save a buffer.
void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate,
                     const float* up, long N, int I);

}  // namespace moetron::ops
