// Causal grouped-query attention (GQA), CPU reference.
//   B batch, T sequence, NH query heads, NKV key/value heads (NH % NKV == 0), HD head dim.
//   q[B,T,NH,HD], k[B,T,NKV,HD], v[B,T,NKV,HD], out[B,T,NH,HD]; query head h uses kv head
//   h / (NH/NKV).  Scores are scaled by 1/sqrt(HD).
// Key j is visible from query i (same row b) when all of:
//   j <= i (causal); i - j < sliding_window when sliding_window > 0;
//   attention_mask[b,j] != 0 when attention_mask is given (1 = real token, right padding);
//   segment_ids[b,j] == segment_ids[b,i] when segment_ids is given (packed documents).
// A query with no visible key outputs zeros.
// Activation gradients assign (=).
#pragma once

#include <cstdint>

namespace moetron::ops {

struct AttentionMask {
  const int32_t* attention_mask = nullptr;  // [B,T] or null
  const int32_t* segment_ids = nullptr;     // [B,T] or null
  int sliding_window = 0;                   // 0: none
};

// probs[B,NH,T,T] is saved for the backward (softmax weights, 0 where masked; every element is
// written).  Uses internal scratch the size of k.
void attention_forward(float* out, float* probs, const float* q, const float* k, const float* v,
                       const AttentionMask& mask, int B, int T, int NH, int NKV, int HD);

// dq[B,T,NH,HD], dk[B,T,NKV,HD], dv[B,T,NKV,HD] (assign).  Needs no mask: entries with
// probs == 0 contribute nothing, and probs must be 0 above the diagonal (causal), as the forward
// writes it.  Uses internal scratch the size of v.
void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* probs,
                        const float* q, const float* k, const float* v, int B, int T, int NH,
                        int NKV, int HD);

}  // namespace moetron::ops
