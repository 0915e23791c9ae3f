// Tensor-parallel (Megatron) pieces of the model that are not plain ops: the vocabulary-parallel
// embedding and cross-entropy.  Each tp rank holds vocabulary rows [V0, V0 + Vr) of the embedding
// and of the head.  N tokens, C hidden, Vr local vocabulary rows.
// Parameter gradients accumulate (+=); activation gradients assign (=).
#pragma once

#include <cstdint>

#include "dist/comm.h"

namespace moetron::dist {

// out[N,C] = wte_local[tokens[n] - V0] for tokens this rank holds, 0 for the others (the tp
// all-reduce of out then gives the whole lookup).  Tokens must be in [0, V) (checked by the model).
void embedding_forward_vocab_parallel(float* out, const int32_t* tokens, const float* wte_local, long N, int C,
                                      int64_t V0, int64_t Vr);

// dwte_local[Vr,C] += dout[n] for tokens this rank holds (token order per element: deterministic).
void embedding_backward_vocab_parallel(float* dwte_local, const float* dout, const int32_t* tokens, long N, int C,
                                       int64_t V0, int64_t Vr);

// Cross-entropy over logits split by vocabulary: logits_local[N,Vr] holds columns [V0, V0 + Vr).
// Three reductions over `tp` (the row max, then the exp sums and the target logits together);
// returns scale * sum over rows with a target of (logsumexp - target logit), identical on every
// tp rank, and lse[N] (the global logsumexp, saved for the backward).
double cross_entropy_forward_vocab_parallel(float* lse, const float* logits_local, const int32_t* targets, long N,
                                            int64_t Vr, int64_t V0, float scale, Comm& tp);

// dlogits_local[N,Vr] = scale * (softmax - onehot) on this rank's columns, 0 for ignored rows
// (assign; may alias logits_local).  No communication: lse is global.
void cross_entropy_backward_vocab_parallel(float* dlogits_local, const float* logits_local, const float* lse,
                                           const int32_t* targets, long N, int64_t Vr, int64_t V0, float scale);

}  // namespace moetron::dist
