// SwiGLU, the expert / dense FFN activation of Mixtral and Mistral: out = silu(gate) * up.
// gate and up come packed in one row-major [N, 2I] buffer, gate in columns [0, I) and up in
// [I, 2I): the product x @ w13^T with w13 = [w1; w3] (transformers-5's gate_up_proj layout), so
// one GEMM computes both.  N rows, I features.  Activation gradients assign (=).
#pragma once

namespace moetron::ops {

// out[N,I] = silu(gate_up[:, :I]) * gate_up[:, I:], silu(g) = g / (1 + e^-g) with libm's expf.
void swiglu_forward(float* out, const float* gate_up, long N, int I);

// The same with e^-g by exp_f32 (ops/exp.h: within 2^-23 of e^x, explicit fma steps) instead of libm's
// expf, a call per value that keeps the loop scalar: this one vectorises, its tail giving the same bits.
// Inference's SwiGLU (its products already differ from training's in rounding).  Training keeps
// expf: its multi-process tests compare layouts after Adam steps, which amplify a change of rounding
// -- with exp_f32, DistTrain.ExpertParallelWithCapacityFactorMatchesOneProcess's tp2ep2 weights
// differed by 1.12e-4 of their largest (its bound 1e-4; with expf 0.66e-4).
void swiglu_forward_exp_f32(float* out, const float* gate_up, long N, int I);

// dgate_up[N,2I] (assign) from dout[N,I].
void swiglu_backward(float* dgate_up, const float* dout, const float* gate_up, long N, int I);

}  // namespace moetron::ops
