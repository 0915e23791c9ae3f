// Rotary position embedding, HF "rotate half" convention:
//   inv_freq[j] = 1 / theta^(2j/HD), angle = pos * inv_freq[j] (computed in fp32 as HF does),
//   out[..., j]        = x[j] * cos - x[j + HD/2] * sin
//   out[..., j + HD/2] = x[j + HD/2] * cos + x[j] * sin        for j < HD/2.
// N tokens, H heads, HD head dim (even).  Activation gradients assign (=).
#pragma once

#include <cstdint>

namespace moetron::ops {

// out[N,H,HD] from inp[N,H,HD] with positions pos[N].  out may alias inp.
void rope_forward(float* out, const float* inp, const int32_t* pos, long N, int H, int HD,
                  float theta);

// dinp[N,H,HD] from dout[N,H,HD] (the inverse rotation).  dinp may alias dout.
void rope_backward(float* dinp, const float* dout, const int32_t* pos, long N, int H, int HD,
                   float theta);

}  // namespace moetron::ops
