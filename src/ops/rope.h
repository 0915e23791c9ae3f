// Rotary position embedding, HF "rotate half" convention:
//   inv_freq[j] = 1 / theta^(2j/HD), angle = pos * inv_freq[j] (computed in fp32 as HF does),
//   out[..., j]        = x[j] * cos - x[j + HD/2] * sin
//   out[..., j + HD/2] = x[j + HD/2] * cos + x[j] * sin        for j < HD/2.
// N tokens, H heads, HD head dim (even).  Activation gradients assign (=).
// Partial RoPE (GLM's partial_rotary_factor): only the first R dims of each head rotate, with the
// frequencies of an R-dim head (inv_freq[j] = 1 / theta^(2j/R), pairs j, j + R/2); the other HD - R
// pass unchanged.  R = 0 means HD.
#pragma once

#include <cstdint>

namespace moetron::ops {

// out[N,H,HD] from inp[N,H,HD] with positions pos[N].  out may alias inp.
void rope_forward(float* out, const float* inp, const int32_t* pos, long N, int H, int HD,
                  float theta, int R = 0);

// The cos and sin of positions pos[N]'s angles, as rope_forward computes them: cs[N, HD/2], sn[N, HD/2] (=).
// Inference computes them once per pass and rotates q and k of every layer with them.
// (For partial RoPE pass R as HD: the angles of an R-dim head.)
void rope_angles(float* cs, float* sn, const int32_t* pos, long N, int HD, float theta);

// rope_forward with the angles given by rope_angles: bitwise rope_forward's result.  out may alias inp.
void rope_forward_angles(float* out, const float* inp, const float* cs, const float* sn, long N, int H, int HD,
                         int R = 0);

// dinp[N,H,HD] from dout[N,H,HD] (the inverse rotation).  dinp may alias dout.
void rope_backward(float* dinp, const float* dout, const int32_t* pos, long N, int H, int HD,
                   float theta, int R = 0);

}  // namespace moetron::ops
