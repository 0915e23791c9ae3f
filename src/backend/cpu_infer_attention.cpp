// Attention over the KV caches on the CPU (CpuInferenceBackend::attention_kv_forward; see cpu_infer.h):
// a decode pass's rows each over their own sequence's cache, a prompt's rows of one sequence together.
// Query row at position p sees keys [first_key(p), p]: causal, with the sliding window W
// (p - W < j <= p).  Every (row, head) pair of a decode pass, and of a short prompt, is computed by
// attend_heads in one fixed order, so a row's result does not depend on which pass, batch or thread
// computes it.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu_infer.h"
#include "backend/cpu_infer_threads.h"
#include "backend/kernels/attention_rows.h"
#include "backend/kernels/gemm.h"
#include "ops/softmax.h"

namespace moetron {

namespace {

int first_key(int p, int window) { return window > 0 ? std::max(0, p - window + 1) : 0; }

// Row o[NH*HD] for query q at position p, its query heads of kv heads [g0, g1), over the keys and values
// [lo, p] (rows of KVd values from `keys` / `values`: a layer of a cache); s: (g1 - g0) G (p - lo + 1)
// floats of scratch.  Per head: scores by dot_rows, softmax, then the weighted sum by axpy_rows in key
// order -- bitwise the same in any blocks of keys.  The keys, then the values, are read kBlock cache
// rows at a time for all the heads, in order, the next block prefetched: a row's kv heads lie side by
// side, so the cache streams from memory instead of each head reading its slice of every row (8
// sequences at ~230 positions on the 0.49B model: 3.78 -> 3.37 ms a step; 2-core Xeon VM).
void attend_heads(float* o, const float* q, const float* layer_keys, const float* layer_values, int lo, int p, int g0,
                  int g1, float* s, int NH, int NKV, int HD) {
  constexpr int kBlock = 16;  // e.g. 8 kv heads of 64 fp32 values: 32 KiB of keys, in L1
  const int G = NH / NKV, KVd = NKV * HD, cnt = p - lo + 1, h0 = g0 * G, h1 = g1 * G;
  const float scale = 1.0f / std::sqrt((float)HD);
  const float* keys = layer_keys + (size_t)lo * KVd;
  const float* values = layer_values + (size_t)lo * KVd;
  const int width = (g1 - g0) * HD;  // a cache row's values for these heads
  for (int j = 0; j < cnt; j += kBlock) {
    const int m = std::min(kBlock, cnt - j);
    if (j + kBlock < cnt)
      kernels::prefetch_rows(keys + (size_t)(j + kBlock) * KVd + (size_t)g0 * HD, KVd,
                             std::min(kBlock, cnt - j - kBlock), width);
    else
      kernels::prefetch_rows(values + (size_t)g0 * HD, KVd, std::min(kBlock, cnt), width);
    for (int h = h0; h < h1; h++)
      kernels::dot_rows(s + (size_t)(h - h0) * cnt + j, q + (size_t)h * HD,
                        keys + (size_t)j * KVd + (size_t)(h / G) * HD, KVd, m, HD, scale);
  }
  ops::softmax_rows(s, h1 - h0, cnt, cnt);
  std::fill(o + (size_t)h0 * HD, o + (size_t)h1 * HD, 0.0f);
  for (int j = 0; j < cnt; j += kBlock) {
    const int m = std::min(kBlock, cnt - j);
    if (j + kBlock < cnt)
      kernels::prefetch_rows(values + (size_t)(j + kBlock) * KVd + (size_t)g0 * HD, KVd,
                             std::min(kBlock, cnt - j - kBlock), width);
    for (int h = h0; h < h1;) {
      const float* v = values + (size_t)j * KVd + (size_t)(h / G) * HD;
      const float* w = s + (size_t)(h - h0) * cnt + j;
      if (h + 1 < h1 && (h + 1) / G == h / G) {  // two heads of one kv head: each value row read once for both
        kernels::axpy_rows2(o + (size_t)h * HD, o + (size_t)(h + 1) * HD, w, w + cnt, v, KVd, m, HD);
        h += 2;
      } else {
        kernels::axpy_rows(o + (size_t)h * HD, w, v, KVd, m, HD);
        h++;
      }
    }
  }
}

}  // namespace

void CpuInferenceBackend::attention_kv_forward(Tensor out, Tensor q, std::span<const KvSeq> seqs, int sliding_window,
                                               int NH, int NKV, int HD) {
  if (decode_ || seqs.size() != 1) return attention_decode(out.f32(), q.f32(), seqs, sliding_window, NH, NKV, HD);
  const KvSeq& s = seqs[0];
  attention_prompt(out.f32() + (size_t)s.row0 * NH * HD, q.f32() + (size_t)s.row0 * NH * HD, s.k.f32(), s.v.f32(),
                   s.pos0, s.rows, sliding_window, NH, NKV, HD);
}

// Decode rows, each over its own sequence's cache (which holds the row's key already).  A piece of work
// is a row and a range of its kv heads (attend_heads: the cache rows read in order); a row is split
// into as few ranges as give every thread four pieces (one sequence: each kv head a piece).  The pieces
// run in parallel from 1/8 of the products' threshold (gemv_min_: a decode batch's, or what the tuner
// chose for one sequence), as a multiply-add here costs more (the keys and values come from memory, the
// softmax).
void CpuInferenceBackend::attention_decode(float* out, const float* q, std::span<const KvSeq> seqs, int window, int NH,
                                           int NKV, int HD) {
  const int G = NH / NKV, Q = NH * HD;
  row_keys_.clear();
  row_values_.clear();
  row_pos_.clear();
  long work = 0;
  int longest = 0;
  for (const KvSeq& s : seqs)
    for (int r = 0; r < s.rows; r++) {
      const int p = s.pos0 + r, cnt = p - first_key(p, window) + 1;
      row_keys_.push_back(s.k.f32());
      row_values_.push_back(s.v.f32());
      row_pos_.push_back(p);
      work += 2L * NH * cnt * HD;
      longest = std::max(longest, cnt);
    }
  const int n = (int)row_pos_.size();
  const bool parallel = work >= gemv_min_ / 8;
  const int threads = parallel ? omp_get_max_threads() : 1;
  // kv heads split into `ranges` equal ranges, a divisor of NKV, for the threads to share; one thread
  // takes a row's heads in one range, reading each cached row whole, in order (0.49B bf16, one thread,
  // 2-core Zen 4 EPYC VM: 4 ranges of 2 kv heads, each reading 512 bytes of every 2 KiB row, took 0.605
  // ms a step, one range 0.567).
  int ranges = 1;
  while (threads > 1 && ranges < NKV && (long)n * ranges < 4L * threads) {
    ranges++;
    while (NKV % ranges) ranges++;
  }
  const int per = NKV / ranges;
#pragma omp parallel if (parallel)
  {
    std::vector<float> s((size_t)per * G * longest);
#pragma omp for schedule(dynamic, 1)
    for (int ir = 0; ir < n * ranges; ir++) {
      const int i = ir / ranges, g0 = ir % ranges * per, p = row_pos_[i];
      attend_heads(out + (size_t)i * Q, q + (size_t)i * Q, row_keys_[i], row_values_[i], first_key(p, window), p, g0,
                   g0 + per, s.data(), NH, NKV, HD);
    }
  }
}

// A prompt's n rows at positions pos0 .. pos0+n-1 of one sequence over its cache [0, pos0 + n).  Up to
// row_pairs_ (query, key) pairs per head: per (row, kv head) with attend_heads, all in one parallel
// region.  Beyond: per head S = scale * q_h k_g^T over the keys any row can see, masked row softmax,
// out_h = S v_g (v_g transposed once per kv head, to the weight layout gemm_nt takes) -- 2 NH GEMMs,
// faster for long prompts on an idle machine, but each a fork/join, slow when the cores are shared.
void CpuInferenceBackend::attention_prompt(float* out, const float* q, const float* keys, const float* values, int pos0,
                                           int n, int window, int NH, int NKV, int HD) {
  const int G = NH / NKV, Q = NH * HD, KVd = NKV * HD;
  const float scale = 1.0f / std::sqrt((float)HD);
  if ((long)n * (pos0 + n) <= row_pairs_) {
    const long work = (long)n * NH * (pos0 + n) * HD;
#pragma omp parallel if (work >= kThreadLimitMin)
    {
      std::vector<float> s((size_t)G * (pos0 + n));
#pragma omp for schedule(static, 1)  // interleaved: causal rows grow in length
      for (int ig = 0; ig < n * NKV; ig++) {
        const int i = ig / NKV, g = ig % NKV, p = pos0 + i;
        attend_heads(out + (size_t)i * Q, q + (size_t)i * Q, keys, values, first_key(p, window), p, g, g + 1, s.data(),
                     NH, NKV, HD);
      }
    }
    return;
  }
  const int lo_all = first_key(pos0, window), cols = pos0 + n - lo_all;
  ThreadLimit lim((long)n * cols * HD);
  scores_.resize((size_t)n * cols);
  values_t_.resize((size_t)HD * cols);
  float* S = scores_.data();
  float* vt = values_t_.data();
  for (int h = 0; h < NH; h++) {
    const int g = h / G;
    if (h % G == 0)
      for (int c = 0; c < cols; c++)
        for (int d = 0; d < HD; d++) vt[(size_t)d * cols + c] = values[(size_t)(lo_all + c) * KVd + (size_t)g * HD + d];
    kernels::gemm_nt(S, cols, q + (size_t)h * HD, Q, {keys + (size_t)lo_all * KVd + (size_t)g * HD}, KVd, n, HD, cols,
                     scale, false, widen_);
#pragma omp parallel for schedule(static) if ((long)n * cols >= kThreadLimitMin)
    for (int i = 0; i < n; i++) {
      const int p = pos0 + i, lo = first_key(p, window) - lo_all, hi = p - lo_all;  // visible columns [lo, hi]
      float* row = S + (size_t)i * cols;
      std::fill(row, row + lo, 0.0f);
      ops::softmax_inplace(row + lo, hi - lo + 1);
      std::fill(row + hi + 1, row + cols, 0.0f);
    }
    kernels::gemm_nt(out + (size_t)h * HD, Q, S, cols, {vt}, cols, n, cols, HD, 1.0f, false, widen_);
  }
}

}  // namespace moetron
