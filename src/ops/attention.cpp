// Causal grouped-query attention, CPU reference (eager attention as in HF transformers):
//   scores = (q k^T) * (1/sqrt(HD)), masked entries -inf, softmax in fp32, out = P v.
//   B batch, T sequence, NH query heads, NKV kv heads, G = NH/NKV query heads per kv head,
//   HD head dim.  q/out [B,T,NH,HD], k/v [B,T,NKV,HD], probs [B,NH,T,T].
// Activation gradients assign (=).
//
// Parallelism: every output element is produced by exactly one work item (a query row in the
// forward and for dq; a block of key rows, summing over its G query heads and all queries in a
// fixed order, for dk/dv), so the results are bitwise independent of the thread count.  The dot
// products use a fixed 8-lane accumulation pattern (GCC vector extension), so their rounding
// does not depend on the compiler's vectorisation choices or on pointer alignment.
#include "ops/attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"

namespace moetron::ops {

namespace {

// Below this many multiply-adds (B*NH*T*T*HD) a parallel region costs more than it saves.
constexpr long kParallelMin = 1 << 18;

typedef float v8f __attribute__((vector_size(32)));

// (By reference, not by value: a vector-typed return would change the ABI without AVX.)
inline void load8(v8f& r, const float* p) { std::memcpy(&r, p, sizeof(r)); }

inline float hsum8(const v8f& a) {
  return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

// out[c] = dot(a, base + idx[c] * stride) over HD elements, for c < cnt.  Four rows at a time for
// instruction-level parallelism; each dot uses the same arithmetic whatever its group.
void dots(float* out, const float* a, const float* base, long stride, const int* idx, int cnt,
          int HD) {
  const int HD8 = HD - HD % 8;
  int c = 0;
  for (; c + 4 <= cnt; c += 4) {
    const float* b0 = base + idx[c] * stride;
    const float* b1 = base + idx[c + 1] * stride;
    const float* b2 = base + idx[c + 2] * stride;
    const float* b3 = base + idx[c + 3] * stride;
    v8f s0 = {}, s1 = {}, s2 = {}, s3 = {};
    for (int d = 0; d < HD8; d += 8) {
      v8f x, y0, y1, y2, y3;
      load8(x, a + d);
      load8(y0, b0 + d);
      load8(y1, b1 + d);
      load8(y2, b2 + d);
      load8(y3, b3 + d);
      s0 += x * y0;
      s1 += x * y1;
      s2 += x * y2;
      s3 += x * y3;
    }
    float r0 = hsum8(s0), r1 = hsum8(s1), r2 = hsum8(s2), r3 = hsum8(s3);
    for (int d = HD8; d < HD; d++) {
      r0 += a[d] * b0[d];
      r1 += a[d] * b1[d];
      r2 += a[d] * b2[d];
      r3 += a[d] * b3[d];
    }
    out[c] = r0;
    out[c + 1] = r1;
    out[c + 2] = r2;
    out[c + 3] = r3;
  }
  for (; c < cnt; c++) {
    const float* b0 = base + idx[c] * stride;
    v8f s0 = {};
    for (int d = 0; d < HD8; d += 8) {
      v8f x, y0;
      load8(x, a + d);
      load8(y0, b0 + d);
      s0 += x * y0;
    }
    float r0 = hsum8(s0);
    for (int d = HD8; d < HD; d++) r0 += a[d] * b0[d];
    out[c] = r0;
  }
}

// acc[HD] += w * x[HD]
inline void axpy(float* __restrict acc, float w, const float* __restrict x, int HD) {
  for (int d = 0; d < HD; d++) acc[d] += w * x[d];
}

void check_dims(const char* op, int B, int T, int NH, int NKV, int HD) {
  MOETRON_OP_CHECK(B >= 0 && T >= 0 && NH > 0 && NKV > 0 && HD > 0, op,
                   "bad dimensions B={} T={} NH={} NKV={} HD={}", B, T, NH, NKV, HD);
  MOETRON_OP_CHECK(NH % NKV == 0, op, "NH={} is not a multiple of NKV={}", NH, NKV);
}

}  // namespace

void attention_forward(float* out, float* probs, const float* q, const float* k, const float* v,
                       const AttentionMask& mask, int B, int T, int NH, int NKV, int HD) {
  check_dims("attention_forward", B, T, NH, NKV, HD);
  MOETRON_OP_CHECK(mask.sliding_window >= 0, "attention_forward",
                   "sliding_window must be >= 0, got {}", mask.sliding_window);
  const int G = NH / NKV;
  const float scale = (float)(1.0 / std::sqrt((double)HD));
  const long qstride = (long)NH * HD, kvstride = (long)NKV * HD;
  const int* am = mask.attention_mask;
  const int* seg = mask.segment_ids;
  const int W = mask.sliding_window;
  const long rows = (long)B * NH * T;
  const long work = rows * T * HD;
#pragma omp parallel if (work >= kParallelMin)
  {
    std::vector<int> idx(T);
    std::vector<float> s(T);
    std::vector<float> acc(HD);
#pragma omp for schedule(dynamic, 8)
    for (long row = 0; row < rows; row++) {
      // row = (b*NH + h)*T + i
      const int i = (int)(row % T);
      const int h = (int)((row / T) % NH);
      const int b = (int)(row / ((long)T * NH));
      const int kvh = h / G;
      const float* qi = q + ((long)b * T + i) * qstride + (long)h * HD;
      const float* kb = k + (long)b * T * kvstride + (long)kvh * HD;
      const float* vb = v + (long)b * T * kvstride + (long)kvh * HD;
      float* prow = probs + row * T;
      float* oi = out + ((long)b * T + i) * qstride + (long)h * HD;

      const int lo = W > 0 ? std::max(0, i - W + 1) : 0;
      int cnt = 0;
      for (int j = lo; j <= i; j++) {
        if (am && am[(long)b * T + j] == 0) continue;
        if (seg && seg[(long)b * T + j] != seg[(long)b * T + i]) continue;
        idx[cnt++] = j;
      }
      std::fill(prow, prow + T, 0.0f);
      if (cnt == 0) {
        std::fill(oi, oi + HD, 0.0f);
        continue;
      }
      dots(s.data(), qi, kb, kvstride, idx.data(), cnt, HD);
      float m = -INFINITY;
      for (int c = 0; c < cnt; c++) {
        s[c] *= scale;
        m = std::max(m, s[c]);
      }
      double sum = 0.0;
      for (int c = 0; c < cnt; c++) {
        s[c] = std::exp(s[c] - m);
        sum += s[c];
      }
      const float fsum = (float)sum;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int c = 0; c < cnt; c++) {
        const float p = s[c] / fsum;
        prow[idx[c]] = p;
        axpy(acc.data(), p, vb + idx[c] * kvstride, HD);
      }
      std::copy(acc.begin(), acc.end(), oi);
    }
  }
}

void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* probs,
                        const float* q, const float* k, const float* v, int B, int T, int NH,
                        int NKV, int HD) {
  check_dims("attention_backward", B, T, NH, NKV, HD);
  // With P = softmax(S), S = scale * q k^T, dP = dout v^T:
  //   dS_ij = P_ij (dP_ij - D_i),  D_i = sum_j P_ij dP_ij
  //   dq_i = scale * sum_j dS_ij k_j,  dk_j = scale * sum_{h in group, i} dS_ij q_i,
  //   dv_j = sum_{h in group, i} P_ij dout_i.
  // Entries with P_ij == 0 (masked, or underflowed) contribute exactly nothing and are skipped.
  const int G = NH / NKV;
  const float scale = (float)(1.0 / std::sqrt((double)HD));
  const long qstride = (long)NH * HD, kvstride = (long)NKV * HD;
  const long rows = (long)B * NH * T;
  const long work = rows * T * HD;
  std::vector<float> Dbuf(rows);  // [B,NH,T]

  // Pass 1: one work item per query row: D_i and dq_i.
#pragma omp parallel if (work >= kParallelMin)
  {
    std::vector<int> idx(T);
    std::vector<float> dp(T);
    std::vector<float> acc(HD);
#pragma omp for schedule(dynamic, 8)
    for (long row = 0; row < rows; row++) {
      const int i = (int)(row % T);
      const int h = (int)((row / T) % NH);
      const int b = (int)(row / ((long)T * NH));
      const int kvh = h / G;
      const float* prow = probs + row * T;
      const float* doi = dout + ((long)b * T + i) * qstride + (long)h * HD;
      const float* kb = k + (long)b * T * kvstride + (long)kvh * HD;
      const float* vb = v + (long)b * T * kvstride + (long)kvh * HD;
      float* dqi = dq + ((long)b * T + i) * qstride + (long)h * HD;
      int cnt = 0;
      for (int j = 0; j < T; j++)
        if (prow[j] != 0.0f) idx[cnt++] = j;
      dots(dp.data(), doi, vb, kvstride, idx.data(), cnt, HD);
      double D = 0.0;
      for (int c = 0; c < cnt; c++) D += (double)prow[idx[c]] * (double)dp[c];
      const float fD = (float)D;
      Dbuf[row] = fD;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int c = 0; c < cnt; c++) {
        const float ds = prow[idx[c]] * (dp[c] - fD);
        axpy(acc.data(), ds, kb + idx[c] * kvstride, HD);
      }
      for (int d = 0; d < HD; d++) dqi[d] = scale * acc[d];
    }
  }

  // Pass 2: one work item per block of JB key rows of one (b, kv head): dk and dv, summed over
  // the G query heads and all query rows in a fixed order.
  constexpr int JB = 16;
  const int nblk = (T + JB - 1) / JB;
  const long items = (long)B * NKV * nblk;
#pragma omp parallel if (work >= kParallelMin)
  {
    std::vector<float> dkacc((size_t)JB * HD), dvacc((size_t)JB * HD);
    std::vector<int> idx(JB);
    std::vector<float> dp(JB);
#pragma omp for schedule(dynamic, 1)
    for (long item = 0; item < items; item++) {
      const int blk = (int)(item % nblk);
      const int kvh = (int)((item / nblk) % NKV);
      const int b = (int)(item / ((long)nblk * NKV));
      const int j0 = blk * JB;
      const int w = std::min(T, j0 + JB) - j0;
      const float* vb = v + (long)b * T * kvstride + (long)kvh * HD;
      std::fill(dkacc.begin(), dkacc.end(), 0.0f);
      std::fill(dvacc.begin(), dvacc.end(), 0.0f);
      for (int g = 0; g < G; g++) {
        const int h = kvh * G + g;
        for (int i = 0; i < T; i++) {
          const long row = ((long)b * NH + h) * T + i;
          const float* pseg = probs + row * T + j0;
          int cnt = 0;
          for (int jj = 0; jj < w; jj++)
            if (pseg[jj] != 0.0f) idx[cnt++] = j0 + jj;
          if (cnt == 0) continue;
          const float* doi = dout + ((long)b * T + i) * qstride + (long)h * HD;
          const float* qi = q + ((long)b * T + i) * qstride + (long)h * HD;
          const float D = Dbuf[row];
          dots(dp.data(), doi, vb, kvstride, idx.data(), cnt, HD);
          for (int c = 0; c < cnt; c++) {
            const int jj = idx[c] - j0;
            const float p = pseg[jj];
            const float ds = p * (dp[c] - D);
            axpy(dkacc.data() + (long)jj * HD, ds, qi, HD);
            axpy(dvacc.data() + (long)jj * HD, p, doi, HD);
          }
        }
      }
      for (int jj = 0; jj < w; jj++) {
        const long off = ((long)b * T + j0 + jj) * kvstride + (long)kvh * HD;
        for (int d = 0; d < HD; d++) {
          dk[off + d] = scale * dkacc[(long)jj * HD + d];
          dv[off + d] = dvacc[(long)jj * HD + d];
        }
      }
    }
  }
}

}  // namespace moetron::ops
