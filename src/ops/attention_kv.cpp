// Attention over a KV cache, CPU reference; see attention_kv.h.  One work item per (row, head): scores
// in key order, the softmax (ops/softmax.h), then the weighted sum of the values in key order -- a
// fixed order per item, so the result does not depend on the thread count.
#include "ops/attention_kv.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "ops/softmax.h"

namespace moetron::ops {

void attention_kv_forward(float* out, const float* q, const float* k, const float* v, int n, int pos0,
                          int sliding_window, int NH, int NKV, int HD) {
  MOETRON_OP_CHECK(n >= 0 && pos0 >= 0 && NH > 0 && NKV > 0 && HD > 0 && NH % NKV == 0, "attention_kv_forward",
                   "bad dimensions n={} pos0={} NH={} NKV={} HD={}", n, pos0, NH, NKV, HD);
  const int G = NH / NKV, KV = NKV * HD;
  const float scale = 1.0f / std::sqrt((float)HD);
  const long work = (long)n * NH * (pos0 + n) * HD;
#pragma omp parallel if (work >= (1L << 18))
  {
    std::vector<float> s(pos0 + n);
#pragma omp for schedule(static)
    for (long item = 0; item < (long)n * NH; item++) {
      const int i = (int)(item / NH), h = (int)(item % NH), p = pos0 + i;
      const int lo = sliding_window > 0 ? std::max(0, p - sliding_window + 1) : 0, cnt = p - lo + 1;
      const float* qh = q + ((size_t)i * NH + h) * HD;
      const float* kh = k + (size_t)lo * KV + (size_t)(h / G) * HD;
      const float* vh = v + (size_t)lo * KV + (size_t)(h / G) * HD;
      for (int j = 0; j < cnt; j++) {
        float d = 0.0f;
        for (int c = 0; c < HD; c++) d += qh[c] * kh[(size_t)j * KV + c];
        s[j] = d * scale;
      }
      softmax_inplace(s.data(), cnt);
      float* o = out + ((size_t)i * NH + h) * HD;
      std::fill(o, o + HD, 0.0f);
      for (int j = 0; j < cnt; j++)
        for (int c = 0; c < HD; c++) o[c] += s[j] * vh[(size_t)j * KV + c];
    }
  }
}

}  // namespace moetron::ops
