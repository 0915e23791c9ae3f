// Token embedding lookup.  N tokens, C hidden, V vocab.
// Parameter gradients accumulate (+=).
#pragma once

#include <cstdint>

namespace moetron::ops {

// out[N,C] = wte[tokens[n], :].  A token id outside [0, V) is an Error naming the position.
void embedding_forward(float* out, const int32_t* tokens, const float* wte, long N, int C, int V);

// dwte[V,C] += scatter of dout[N,C] by tokens (deterministic: independent of thread count).
void embedding_backward(float* dwte, const float* dout, const int32_t* tokens, long N, int C, int V);

}  // namespace moetron::ops
