// Causal grouped-query attention, CPU reference (eager attention as in HF transformers):
//   scores = (q k^T) * (1/sqrt(HD)), masked entries -inf, softmax in fp32, out = P v.
//   B batch, T sequence, NH query heads, NKV kv heads, G = NH/NKV query heads per kv head,
//   HD head dim.  q/out [B,T,NH,HD], k/v [B,T,NKV,HD], probs [B,NH,T,T].
// Activation gradients assign (=).
//
// Parallelism: OpenMP over independent work items with small register-tiled kernels inside (no
// BLAS inside parallel regions).  Forward and dq: one item per (b, h, block of RB query rows),
// restricted to the key columns that some row of the block can see (causality, the sliding
// window and packed segments shrink it).  dk/dv: one item per (b, kv head, block of KB keys),
// summing over its G query heads and the query rows in a fixed order.  Every output element is
// produced by exactly one item with a sequence of operations fixed by the shapes alone, so the
// results are bitwise independent of the thread count.
#include "ops/attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"

namespace moetron::ops {

namespace {

constexpr int RB = 16;                  // query rows per forward / dq work item
constexpr int KB = 16;                  // keys per dk/dv work item; also the key padding of transposed k/v
constexpr long kParallelMin = 1 << 18;  // below this many multiply-adds, stay serial

// ---- register-tiled kernels (GCC vector extension; fixed operation order) ----

typedef float v8f __attribute__((vector_size(32)));
// By reference, never by value: a vector-typed argument or return changes the ABI without AVX.
inline void ld(v8f& r, const float* p) { std::memcpy(&r, p, sizeof(r)); }
inline void st(float* p, const v8f& r) { std::memcpy(p, &r, sizeof(r)); }

// C[MR x 16] = A[MR x K] * BT[K x 16].  A(r, d) = A[r*lda + d]; BT(d, j) = BT[d*ldb + j].
template <int MR>
void tile_nt(float* C, long ldc, const float* A, long lda, const float* BT, long ldb, int K) {
  v8f acc[MR][2] = {};
  for (int d = 0; d < K; d++) {
    v8f b0, b1;
    ld(b0, BT + d * ldb);
    ld(b1, BT + d * ldb + 8);
    for (int r = 0; r < MR; r++) {
      const float a = A[r * lda + d];
      acc[r][0] += a * b0;
      acc[r][1] += a * b1;
    }
  }
  for (int r = 0; r < MR; r++) {
    st(C + r * ldc, acc[r][0]);
    st(C + r * ldc + 8, acc[r][1]);
  }
}

// C[M x N] = A[M x K] * BT[K x N] with N a multiple of 16.
void gemm_nt(float* C, long ldc, const float* A, long lda, const float* BT, long ldb, int M, int N, int K) {
  for (int j = 0; j < N; j += 16) {
    int r = 0;
    for (; r + 4 <= M; r += 4) tile_nt<4>(C + r * ldc + j, ldc, A + r * lda, lda, BT + j, ldb, K);
    for (; r < M; r++) tile_nt<1>(C + r * ldc + j, ldc, A + r * lda, lda, BT + j, ldb, K);
  }
}

// C[MR x 8*NV] (=, or += when ACC) A[MR x K] * B[K x 8*NV].
//   A(r, k) = A[r*ars + k*aks]; B(k, c) = B[k*ldb + c].
template <int MR, int NV, bool ACC>
void tile_nn(float* C, long ldc, const float* A, long ars, long aks, const float* B, long ldb, int K) {
  v8f acc[MR][NV] = {};
  if (ACC)
    for (int r = 0; r < MR; r++)
      for (int v = 0; v < NV; v++) ld(acc[r][v], C + r * ldc + 8 * v);
  for (int k = 0; k < K; k++) {
    v8f b[NV];
    for (int v = 0; v < NV; v++) ld(b[v], B + k * ldb + 8 * v);
    for (int r = 0; r < MR; r++) {
      const float a = A[r * ars + k * aks];
      for (int v = 0; v < NV; v++) acc[r][v] += a * b[v];
    }
  }
  for (int r = 0; r < MR; r++)
    for (int v = 0; v < NV; v++) st(C + r * ldc + 8 * v, acc[r][v]);
}

template <int MR, bool ACC>
void row_tile_nn(float* C, long ldc, const float* A, long ars, long aks, const float* B, long ldb, int N, int K) {
  int c = 0;
  for (; c + 16 <= N; c += 16) tile_nn<MR, 2, ACC>(C + c, ldc, A, ars, aks, B + c, ldb, K);
  for (; c + 8 <= N; c += 8) tile_nn<MR, 1, ACC>(C + c, ldc, A, ars, aks, B + c, ldb, K);
  for (; c < N; c++)  // columns past a multiple of 8
    for (int r = 0; r < MR; r++) {
      float s = ACC ? C[r * ldc + c] : 0.0f;
      for (int k = 0; k < K; k++) s += A[r * ars + k * aks] * B[k * ldb + c];
      C[r * ldc + c] = s;
    }
}

// C[M x N] (=, or +=) A[M x K] * B[K x N], any N.
template <bool ACC>
void gemm_nn(float* C, long ldc, const float* A, long ars, long aks, const float* B, long ldb, int M, int N, int K) {
  int r = 0;
  for (; r + 4 <= M; r += 4) row_tile_nn<4, ACC>(C + r * ldc, ldc, A + r * ars, ars, aks, B, ldb, N, K);
  for (; r < M; r++) row_tile_nn<1, ACC>(C + r * ldc, ldc, A + r * ars, ars, aks, B, ldb, N, K);
}

// sum_j a[j] * b[j] over n elements: 8 lanes, then a fixed combination order.
float dot(const float* a, const float* b, int n) {
  v8f acc = {};
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    v8f x, y;
    ld(x, a + j);
    ld(y, b + j);
    acc += x * y;
  }
  float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; j < n; j++) s += a[j] * b[j];
  return s;
}

// ---- helpers ----

struct Range {
  int lo = 0, hi = 0;  // key columns [lo, hi); empty when hi <= lo
};

Range block_range(const Range* rows, int n) {
  Range r{1 << 30, -1};
  for (int i = 0; i < n; i++) {
    if (rows[i].hi <= rows[i].lo) continue;
    r.lo = std::min(r.lo, rows[i].lo);
    r.hi = std::max(r.hi, rows[i].hi);
  }
  return r.hi > r.lo ? r : Range{0, 0};
}

void check_dims(const char* op, int B, int T, int NH, int NKV, int HD) {
  MOETRON_OP_CHECK(B >= 0 && T >= 0 && NH > 0 && NKV > 0 && HD > 0, op, "bad dimensions B={} T={} NH={} NKV={} HD={}",
                   B, T, NH, NKV, HD);
  MOETRON_OP_CHECK(NH % NKV == 0, op, "NH={} is not a multiple of NKV={}", NH, NKV);
}

// xt[B,NKV,HD,Tp] = x[B,T,NKV,HD] transposed per (b, kv head), columns T..Tp zero.
std::vector<float> transpose_kv(const float* x, int B, int T, int NKV, int HD, int Tp, bool parallel) {
  std::vector<float> xt((size_t)B * NKV * HD * Tp);
  const long ks = (long)NKV * HD;
#pragma omp parallel for schedule(static) if (parallel)
  for (long bh = 0; bh < (long)B * NKV; bh++) {
    const long b = bh / NKV, h = bh % NKV;
    float* dst = xt.data() + bh * HD * Tp;
    for (int d = 0; d < HD; d++) {
      float* row = dst + (long)d * Tp;
      for (int j = 0; j < T; j++) row[j] = x[(b * T + j) * ks + h * HD + d];
      for (int j = T; j < Tp; j++) row[j] = 0.0f;
    }
  }
  return xt;
}

}  // namespace

void attention_forward(float* out, float* probs, const float* q, const float* k, const float* v,
                       const AttentionMask& mask, int B, int T, int NH, int NKV, int HD) {
  check_dims("attention_forward", B, T, NH, NKV, HD);
  MOETRON_OP_CHECK(mask.sliding_window >= 0, "attention_forward", "sliding_window must be >= 0, got {}",
                   mask.sliding_window);
  if (B == 0 || T == 0) return;
  const int G = NH / NKV;
  const float scale = (float)(1.0 / std::sqrt((double)HD));
  const long qs = (long)NH * HD, ks = (long)NKV * HD;  // row strides of q/out and k/v
  const int Tp = (T + KB - 1) / KB * KB;
  const int W = mask.sliding_window;
  const bool parallel = (long)B * NH * T * T * HD >= kParallelMin;
  const int* am = mask.attention_mask;
  const int* seg = mask.segment_ids;
  auto visible = [&](long b, int i, int j) {
    return (!am || am[b * T + j] != 0) && (!seg || seg[b * T + j] == seg[b * T + i]);
  };
  // Per (b, query row): the first and one past the last visible key.
  std::vector<Range> rows((size_t)B * T);
  for (long b = 0; b < B; b++)
    for (int i = 0; i < T; i++) {
      int lo = W > 0 ? std::max(0, i - W + 1) : 0, hi = i + 1;
      while (lo < hi && !visible(b, i, lo)) lo++;
      while (hi > lo && !visible(b, i, hi - 1)) hi--;
      rows[b * T + i] = Range{lo, hi};
    }
  const std::vector<float> kt = transpose_kv(k, B, T, NKV, HD, Tp, parallel);
  const int nblk = (T + RB - 1) / RB;
  const long items = (long)B * NH * nblk;
#pragma omp parallel if (parallel)
  {
    std::vector<float> S((size_t)RB * Tp);
#pragma omp for schedule(dynamic, 1)
    for (long item = 0; item < items; item++) {
      const long bh = item / nblk;  // b * NH + h
      const int i0 = (int)(item % nblk) * RB, m = std::min(T, i0 + RB) - i0;
      const long b = bh / NH;
      const int h = (int)(bh % NH), kvh = h / G;
      const Range* rr = rows.data() + b * T + i0;
      const Range r = block_range(rr, m);
      float* ob = out + (b * T + i0) * qs + (long)h * HD;
      float* P = probs + (bh * T + i0) * T;
      std::fill(P, P + (long)m * T, 0.0f);
      if (r.hi <= r.lo) {
        for (int i = 0; i < m; i++) std::fill(ob + i * qs, ob + i * qs + HD, 0.0f);
        continue;
      }
      // S[:, c0:c1] = q_rows k^T over the block's key columns, aligned to KB.
      const int c0 = r.lo / KB * KB, c1 = (r.hi + KB - 1) / KB * KB;
      const float* ktb = kt.data() + (b * NKV + kvh) * HD * Tp;
      gemm_nt(S.data() + c0, Tp, q + (b * T + i0) * qs + (long)h * HD, qs, ktb + c0, Tp, m, c1 - c0, HD);
      // Softmax of each row over its visible keys; S keeps P on [r.lo, r.hi), 0 where masked.
      for (int i = 0; i < m; i++) {
        float* s = S.data() + (long)i * Tp;
        const Range ri = rr[i];
        const int qi = i0 + i;
        float mx = -INFINITY;
        for (int j = ri.lo; j < ri.hi; j++) {
          s[j] *= scale;
          if (visible(b, qi, j)) mx = std::max(mx, s[j]);
        }
        double sum = 0.0;
        for (int j = ri.lo; j < ri.hi; j++) {
          s[j] = visible(b, qi, j) ? std::exp(s[j] - mx) : 0.0f;
          sum += s[j];
        }
        const float fsum = (float)sum;
        for (int j = r.lo; j < r.hi; j++) {
          s[j] = (j >= ri.lo && j < ri.hi) ? s[j] / fsum : 0.0f;
          P[(long)i * T + j] = s[j];
        }
      }
      // out_rows = P v over the block's key range.
      gemm_nn<false>(ob, qs, S.data() + r.lo, Tp, 1, v + (b * T + r.lo) * ks + (long)kvh * HD, ks, m, HD, r.hi - r.lo);
    }
  }
}

void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* probs, const float* q,
                        const float* k, const float* v, int B, int T, int NH, int NKV, int HD) {
  check_dims("attention_backward", B, T, NH, NKV, HD);
  // With P = softmax(S), S = scale * q k^T, dP = dout v^T:
  //   dS_ij = P_ij (dP_ij - D_i),  D_i = sum_j P_ij dP_ij
  //   dq_i = scale * sum_j dS_ij k_j,  dk_j = scale * sum_{h in group, i} dS_ij q_i,
  //   dv_j = sum_{h in group, i} P_ij dout_i.
  // Entries with P_ij == 0 (masked, or underflowed) contribute nothing, so no mask is needed;
  // P_ij is 0 for j > i (causal), which bounds the column and row scans.
  if (B == 0 || T == 0) return;
  const int G = NH / NKV;
  const float scale = (float)(1.0 / std::sqrt((double)HD));
  const long qs = (long)NH * HD, ks = (long)NKV * HD;
  const int Tp = (T + KB - 1) / KB * KB;
  const bool parallel = (long)B * NH * T * T * HD >= kParallelMin;
  const std::vector<float> vt = transpose_kv(v, B, T, NKV, HD, Tp, parallel);
  std::vector<float> Dbuf((size_t)B * NH * T);  // [B,NH,T]

  // Pass 1: one item per (b, h, block of RB query rows): D_i and dq.
  const int nblk = (T + RB - 1) / RB;
  const long items1 = (long)B * NH * nblk;
#pragma omp parallel if (parallel)
  {
    std::vector<float> dS((size_t)RB * Tp);
    Range rr[RB];
#pragma omp for schedule(dynamic, 1)
    for (long item = 0; item < items1; item++) {
      const long bh = item / nblk;
      const int i0 = (int)(item % nblk) * RB, m = std::min(T, i0 + RB) - i0;
      const long b = bh / NH;
      const int h = (int)(bh % NH), kvh = h / G;
      const float* P = probs + (bh * T + i0) * T;
      float* dqb = dq + (b * T + i0) * qs + (long)h * HD;
      for (int i = 0; i < m; i++) {
        const float* p = P + (long)i * T;
        int lo = 0, hi = i0 + i + 1;
        while (lo < hi && p[lo] == 0.0f) lo++;
        while (hi > lo && p[hi - 1] == 0.0f) hi--;
        rr[i] = Range{lo, hi};
      }
      const Range r = block_range(rr, m);
      if (r.hi <= r.lo) {
        for (int i = 0; i < m; i++) {
          std::fill(dqb + i * qs, dqb + i * qs + HD, 0.0f);
          Dbuf[bh * T + i0 + i] = 0.0f;
        }
        continue;
      }
      // dP = dout_rows v^T over the block's key columns, then dS (scaled) in place.
      const int c0 = r.lo / KB * KB, c1 = (r.hi + KB - 1) / KB * KB;
      const float* dob = dout + (b * T + i0) * qs + (long)h * HD;
      gemm_nt(dS.data() + c0, Tp, dob, qs, vt.data() + (b * NKV + kvh) * HD * Tp + c0, Tp, m, c1 - c0, HD);
      for (int i = 0; i < m; i++) {
        const float* p = P + (long)i * T;
        float* ds = dS.data() + (long)i * Tp;
        const float fD = dot(p + rr[i].lo, ds + rr[i].lo, rr[i].hi - rr[i].lo);
        Dbuf[bh * T + i0 + i] = fD;
        for (int j = r.lo; j < r.hi; j++) ds[j] = scale * (p[j] * (ds[j] - fD));
      }
      // dq_rows = dS k over the block's key range.
      gemm_nn<false>(dqb, qs, dS.data() + r.lo, Tp, 1, k + (b * T + r.lo) * ks + (long)kvh * HD, ks, m, HD,
                     r.hi - r.lo);
    }
  }

  // Pass 2: one item per (b, kv head, block of KB keys): dk and dv, over the G query heads and
  // the query rows (in blocks of RB) in a fixed order.
  const int nkb = Tp / KB;
  const long items2 = (long)B * NKV * nkb;
#pragma omp parallel if (parallel)
  {
    std::vector<float> dkacc((size_t)KB * HD), dvacc((size_t)KB * HD);
    float dP[RB * KB], Pt[RB * KB];
#pragma omp for schedule(dynamic, 1)
    for (long item = 0; item < items2; item++) {
      const long bkv = item / nkb;  // b * NKV + kvh
      const int j0 = (int)(item % nkb) * KB, w = std::min(T, j0 + KB) - j0;
      const long b = bkv / NKV;
      const int kvh = (int)(bkv % NKV);
      std::fill(dkacc.begin(), dkacc.end(), 0.0f);
      std::fill(dvacc.begin(), dvacc.end(), 0.0f);
      const float* vtb = vt.data() + bkv * HD * Tp + j0;
      for (int g = 0; g < G; g++) {
        const long bh = b * NH + (long)kvh * G + g;
        const long hoff = (long)(kvh * G + g) * HD;
        for (int i0 = j0 / RB * RB; i0 < T; i0 += RB) {  // rows i < j0 have P = 0 here
          const int m = std::min(T, i0 + RB) - i0;
          const float* P = probs + (bh * T + i0) * T + j0;
          bool any = false;
          for (int i = 0; i < m && !any; i++)
            for (int jj = 0; jj < w; jj++) any |= P[(long)i * T + jj] != 0.0f;
          if (!any) continue;
          const float* dob = dout + (b * T + i0) * qs + hoff;
          const float* qb = q + (b * T + i0) * qs + hoff;
          gemm_nt(dP, KB, dob, qs, vtb, Tp, m, KB, HD);
          for (int i = 0; i < m; i++) {
            const float D = Dbuf[bh * T + i0 + i];
            for (int jj = 0; jj < KB; jj++) {
              const float p = jj < w ? P[(long)i * T + jj] : 0.0f;
              Pt[i * KB + jj] = p;
              dP[i * KB + jj] = scale * (p * (dP[i * KB + jj] - D));
            }
          }
          // dk[j0:j1] += dS^T q_rows;  dv[j0:j1] += P^T dout_rows  (reduction over the m rows)
          gemm_nn<true>(dkacc.data(), HD, dP, 1, KB, qb, qs, KB, HD, m);
          gemm_nn<true>(dvacc.data(), HD, Pt, 1, KB, dob, qs, KB, HD, m);
        }
      }
      for (int jj = 0; jj < w; jj++) {
        const long off = (b * T + j0 + jj) * ks + (long)kvh * HD;
        std::copy(dkacc.begin() + (long)jj * HD, dkacc.begin() + (long)(jj + 1) * HD, dk + off);
        std::copy(dvacc.begin() + (long)jj * HD, dvacc.begin() + (long)(jj + 1) * HD, dv + off);
      }
    }
  }
}

}  // namespace moetron::ops
