// SwiGLU, the expert / dense FFN activation of Mixtral and Mistral: out = silu(gate) * up.
// gate and up come packed in one row-major [N, 2I] buffer, gate in columns [0, I) and up in
// [I, 2I): the product x @ w13^T with w13 = [w1; w3] (transformers-5's gate_up_proj layout), so
// one GEMM computes both.  N rows, I features.  Activation gradients assign (=).
#pragma once

namespace moetron::ops {

// out[N,I] = silu(gate_up[:, :I]) * gate_up[:, I:]
void swiglu_forward(float* out, const float* gate_up, long N, int I);

// dgate_up[N,2I] (assign) from dout[N,I].
void swiglu_backward(float* dgate_up, const float* dout, const float* gate_up, long N, int I);

}  // namespace moetron::ops
