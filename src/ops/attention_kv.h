// Attention of new query rows over a key/value cache (KV-cache inference), CPU reference.
//   n query rows at positions pos0 .. pos0+n-1 of one sequence; NH query heads, NKV kv heads
//   (NH % NKV == 0), HD head dim.  q/out [n,NH,HD]; k/v [pos0+n, NKV, HD]: the cache's rows 0 ..
//   pos0+n-1, the query rows' own keys and values among them.  Query head h uses kv head h / (NH/NKV).
// Key j is visible from the row at position p when j <= p (causal) and p - j < sliding_window when
// sliding_window > 0 -- ops/attention.h's rule for one unpadded sequence, so the rows' outputs are
// what a full-sequence attention gives them.  Scores are scaled by 1/sqrt(HD), softmax in fp32.
#pragma once

namespace moetron::ops {

// out (assign).
void attention_kv_forward(float* out, const float* q, const float* k, const float* v, int n, int pos0,
                          int sliding_window, int NH, int NKV, int HD);

}  // namespace moetron::ops
