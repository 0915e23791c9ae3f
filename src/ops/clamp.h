// OLMoE's clip_qkv: q, k and v clamped to [-c, c] after the q/k norms.  The backward passes the
// gradient where the value was inside the interval (torch's clamp: inclusive bounds) and zero where
// it was clipped; the forward records which in a mask.
#pragma once

#include <cstdint>

namespace moetron::ops {

// x[i] = min(max(x[i], -c), c) in place; mask[i] = 1 where -c <= x[i] <= c (kept), else 0.
void clamp_forward(float* x, uint8_t* mask, float c, long n);
// dx[i] = mask[i] ? dx[i] : 0, in place.
void clamp_backward(float* dx, const uint8_t* mask, long n);

}  // namespace moetron::ops
