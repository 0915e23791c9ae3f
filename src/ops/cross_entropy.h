// Softmax cross-entropy over the vocabulary with an ignore index (HF: -100).
//   N rows (positions), V vocab.  targets[n] is the label for row n (already shifted by the
//   caller), or IGNORE_INDEX.  A target outside [0, V) that is not IGNORE_INDEX is an Error.
// The loss is a SUM over non-ignored rows, scaled by `scale` (the caller passes 1/num_loss_tokens
// of the whole global batch).  Activation gradients assign (=).
#pragma once

#include <cstdint>

namespace moetron::ops {

constexpr int32_t IGNORE_INDEX = -100;

// Returns scale * sum_n -log softmax(logits[n])[targets[n]] (accumulated in double).
// lse[N] saves logsumexp per row for the backward.
double cross_entropy_forward(float* lse, const float* logits, const int32_t* targets, long N, int V,
                             float scale);

// dlogits[N,V] = scale * (softmax - onehot) for counted rows, 0 for ignored rows (assign).
// dlogits may alias logits (in-place backward saves V*N floats).
void cross_entropy_backward(float* dlogits, const float* logits, const float* lse,
                            const int32_t* targets, long N, int V, float scale);

}  // namespace moetron::ops
