// Naive bf16 attention: PyTorch's eager attention in bf16 as transformers runs it, the attention of
// Bf16CpuBackend and the "naive implementation" of the FlashAttention tolerance rule (DESIGN §5).
//   q[B,T,NH,HD], k/v[B,T,NKV,HD] packed, all values already bf16 (held in fp32).  Forward:
//   S = bf16(bf16(q k^T) * scale), masked; P = bf16(softmax_fp32(S)); out = bf16(P v).
//   Backward (autograd of the same graph): dP = bf16(dO v^T); dV_h = bf16(P^T dO);
//   dS = bf16(P32 * (dP - sum P32 dP)); dS' = bf16(dS * scale); dQ = bf16(dS' K);
//   dK_h = bf16(dS'^T Q); GQA sums the G heads' dK_h/dV_h and rounds (repeat_kv's backward).
// Dot products accumulate in fp64, so the only errors are the bf16 roundings.  round = false runs
// the same computation without rounding (which must then agree with ops::attention).
// Visibility as ops/attention.h; a query with no visible key outputs zeros.
#pragma once

#include <cstdint>

#include "ops/attention.h"

namespace moetron {

// probs32 / probs16 [B,NH,T,T] are saved for the backward (0 where masked).
void attention_bf16_forward(float* out, float* probs32, float* probs16, const float* q, const float* k,
                            const float* v, const ops::AttentionMask& mask, int B, int T, int NH, int NKV, int HD,
                            bool round);
// dq[B,T,NH,HD], dk/dv[B,T,NKV,HD] (assign).
void attention_bf16_backward(float* dq, float* dk, float* dv, const float* dout, const float* probs32,
                             const float* probs16, const float* q, const float* k, const float* v, int B, int T,
                             int NH, int NKV, int HD, bool round);

}  // namespace moetron
