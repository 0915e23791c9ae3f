// The AVX-512 matrix-vector kernels over fp32, bf16 and f16 rows: one input (rows_avx512) and the
// products of up to kMaxGemvInputs inputs (multi_fn_avx512), in gemv_impl.h's lane order and row pairs.

// GCC 12 reports the "undefined" pass-through operand inside its own AVX-512 intrinsics
// (_mm512_slli_epi32, _mm512_reduce_add_ps) as uninitialised when they are used under a target
// attribute: a known false positive of the headers, silenced for this file only.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include "backend/kernels/gemv_impl.h"

namespace moetron::kernels {

namespace {

// 16 contiguous values as fp32.
template <DType DT>
MOETRON_AVX512 inline __m512 w16(const void* W, size_t i) {
  if constexpr (DT == DType::F32) {
    return _mm512_loadu_ps(static_cast<const float*>(W) + i);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(W) + i));
    if constexpr (DT == DType::BF16)
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    else
      return _mm512_cvtph_ps(h);
  }
}

// 32 values from i in the lane order: lo = {0..3, 8..11, 16..19, 24..27}, hi = {4..7, 12..15, ...}.
template <DType DT>
MOETRON_AVX512 inline void w32_lanes(const void* W, size_t i, __m512& lo, __m512& hi) {
  if constexpr (DT == DType::BF16) {
    const __m512i w = _mm512_loadu_si512(static_cast<const uint16_t*>(W) + i);
    const __m512i z = _mm512_setzero_si512();
    lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, w));
    hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, w));
  } else {
    const __m512 a = w16<DT>(W, i), b = w16<DT>(W, i + 16);
    const __m512i ilo = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    const __m512i ihi = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    lo = _mm512_permutex2var_ps(a, ilo, b);
    hi = _mm512_permutex2var_ps(a, ihi, b);
  }
}

// PF: the rows' prefetches (see amd_cpu()).
template <DType DT, int R, Prefetch PF>
MOETRON_AVX512 void block_avx512(float* y, const void* W, const float* x, const float* xp, int r, int stride, int IC,
                                 bool acc) {
  constexpr size_t vbytes = vbytes_of(DT);
  __m512 a[R][2];
  for (int k = 0; k < R; k++) a[k][0] = a[k][1] = _mm512_setzero_ps();
  int c = 0;
  for (; c + 32 <= IC; c += 32) {
    const __m512 x0 = _mm512_loadu_ps(xp + c), x1 = _mm512_loadu_ps(xp + c + 16);
    for (int k = 0; k < R; k++) {
      const size_t i = (size_t)(r + k * stride) * IC + c;
      if constexpr (PF == Prefetch::l1) {
        const char* p = static_cast<const char*>(W) + (i + kPrefetch) * vbytes;
        _mm_prefetch(p, _MM_HINT_T0);
        if constexpr (vbytes == 4) _mm_prefetch(p + 64, _MM_HINT_T0);
      } else if constexpr (PF == Prefetch::l2) {
        const char* p = static_cast<const char*>(W) + (i + kPrefetchL2) * vbytes;
        _mm_prefetch(p, _MM_HINT_T1);
        if constexpr (vbytes == 4) _mm_prefetch(p + 64, _MM_HINT_T1);
      }
      __m512 lo, hi;
      w32_lanes<DT>(W, i, lo, hi);
      a[k][0] = _mm512_fmadd_ps(lo, x0, a[k][0]);
      a[k][1] = _mm512_fmadd_ps(hi, x1, a[k][1]);
    }
  }
  for (; c + 16 <= IC; c += 16) {
    const __m512 x0 = _mm512_loadu_ps(x + c);
    for (int k = 0; k < R; k++) a[k][0] = _mm512_fmadd_ps(w16<DT>(W, (size_t)(r + k * stride) * IC + c), x0, a[k][0]);
  }
  for (int k = 0; k < R; k++) {
    const int rk = r + k * stride;
    float s = _mm512_reduce_add_ps(_mm512_add_ps(a[k][0], a[k][1]));
    for (int t = c; t < IC; t++) s += wscalar<DT>(W, (size_t)rk * IC + t) * x[t];
    y[rk] = acc ? y[rk] + s : s;
  }
}

template <DType DT, Prefetch PF>
MOETRON_AVX512 void pairs_avx512(float* y, const void* W, const float* x, const float* xp, int r0, int r1, int IC,
                                 bool acc) {
  const RowPairs p(r0, r1, (size_t)IC * vbytes_of(DT));
  for (int i = 0; i < p.pairs; i++) block_avx512<DT, 2, PF>(y, W, x, xp, p.first(i), p.stride, IC, acc);
  if (p.odd) block_avx512<DT, 1, PF>(y, W, x, xp, r1 - 1, 0, IC, acc);
}

}  // namespace

// On AMD rows paired apart go without prefetches, neighbours prefetch into L2; elsewhere into L1
// (one_input_prefetch).
template <DType DT>
MOETRON_AVX512 void rows_avx512(float* y, const void* W, const float* x, const float* xp, int r0, int r1, int IC,
                                bool acc) {
  switch (one_input_prefetch((size_t)IC * vbytes_of(DT), kRowsApartBytes, Prefetch::l2)) {
    case Prefetch::none:
      return pairs_avx512<DT, Prefetch::none>(y, W, x, xp, r0, r1, IC, acc);
    case Prefetch::l2:
      return pairs_avx512<DT, Prefetch::l2>(y, W, x, xp, r0, r1, IC, acc);
    default:
      return pairs_avx512<DT, Prefetch::l1>(y, W, x, xp, r0, r1, IC, acc);
  }
}

namespace {

// R rows r + k * stride against N inputs (see multi_block_avx2, gemv_avx2.cpp): block_avx512<DT, 1,
// Prefetch::l1>'s operations per row and input.
template <DType DT, int N, int R, Prefetch PF, int P = 0, int NP = 1, int B = 1>
MOETRON_AVX512 void multi_block_avx512(float* out, int ld_out, const void* W, const float* x, int ld_x, const float* xp,
                                       int r, int stride, int IC, bool acc) {
  constexpr size_t vbytes = vbytes_of(DT);
  __m512 a[R][N][2];
  for (int k = 0; k < R; k++)
    for (int j = 0; j < N; j++) a[k][j][0] = a[k][j][1] = _mm512_setzero_ps();
  int c = 0;
  const size_t ahead = prefetch_ahead<P, NP, B>(IC, kMultiPrefetch);
  for (; c + 32 <= IC; c += 32) {
    __m512 lo[R], hi[R];
    for (int k = 0; k < R; k++) {
      const size_t row = (size_t)(r + k * stride) * IC, i = row + c;
      const char* p = static_cast<const char*>(W) + (row + ahead + c / NP) * vbytes;
      constexpr _mm_hint hint = PF == Prefetch::l2 ? _MM_HINT_T1 : _MM_HINT_T0;
      _mm_prefetch(p, hint);
      if constexpr (vbytes == 4) _mm_prefetch(p + 64, hint);
      w32_lanes<DT>(W, i, lo[k], hi[k]);
    }
    for (int j = 0; j < N; j++) {
      __m512 x0 = _mm512_loadu_ps(xp + (size_t)j * IC + c), x1 = _mm512_loadu_ps(xp + (size_t)j * IC + c + 16);
      if constexpr (R > 1 && N >= 4) {
        // Both rows' FMAs take x0 and x1 from these registers.  Left to itself GCC folds the load
        // into each FMA as a memory operand (a load per use: 16 of them a step, not 8, beside the
        // weights' 4), and a core that issues one 512-bit load a cycle (Zen 4) then waits on loads,
        // not FMAs.  2-core AVX-512 AMD EPYC (Zen 4) VM, bf16 rows of 1024, medians of alternating
        // runs, G multiply-adds/s: 4096 rows in L3, one thread, 4 inputs 30.5 -> 44.2, 6 inputs 33.3
        // -> 45.8, 8 inputs 31.3 -> 38.0; 32000 rows from memory, 2 threads, 8 inputs 55.5 -> 65.8.
        // With fewer inputs (memory-bound) the folded loads were as fast or faster (2 inputs, rows
        // of 1024 from memory, one thread: 20.3 folded, 17.4 in registers).
        asm("" : "+v"(x0), "+v"(x1));
      }
      for (int k = 0; k < R; k++) {
        a[k][j][0] = _mm512_fmadd_ps(lo[k], x0, a[k][j][0]);
        a[k][j][1] = _mm512_fmadd_ps(hi[k], x1, a[k][j][1]);
      }
    }
  }
  for (; c + 16 <= IC; c += 16)
    for (int k = 0; k < R; k++) {
      const __m512 w = w16<DT>(W, (size_t)(r + k * stride) * IC + c);
      for (int j = 0; j < N; j++) a[k][j][0] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + (size_t)j * ld_x + c), a[k][j][0]);
    }
  for (int k = 0; k < R; k++) {
    const int rk = r + k * stride;
    for (int j = 0; j < N; j++) {
      const float* xj = x + (size_t)j * ld_x;
      float s = _mm512_reduce_add_ps(_mm512_add_ps(a[k][j][0], a[k][j][1]));
      for (int t = c; t < IC; t++) s += wscalar<DT>(W, (size_t)rk * IC + t) * xj[t];
      float& o = out[(size_t)j * ld_out + rk];
      o = acc ? o + s : s;
    }
  }
}

// The N inputs in groups of G, each group a pass over the run's row pairs (B of them, or one; see
// multi_block_pairs): the later passes read the rows again from L1 or L2.
template <DType DT, int N, int G, int R, Prefetch PF, int B, int P = 0, int NP = (N + G - 1) / G>
MOETRON_AVX512 void multi_groups_avx512(float* out, int ld_out, const void* W, const float* x, int ld_x,
                                        const float* xp, RowPairs::Run run, int IC, bool acc) {
  const int count = B == 1 ? 1 : run.count;
  for (int q = 0; q < count; q++)
    multi_block_avx512<DT, (N < G ? N : G), R, PF, P, NP, B>(out, ld_out, W, x, ld_x, xp, run.r + q * run.step,
                                                             run.stride, IC, acc);
  if constexpr (N > G)
    multi_groups_avx512<DT, N - G, G, R, PF, B, P + 1, NP>(out + (size_t)G * ld_out, ld_out, W, x + (size_t)G * ld_x,
                                                           ld_x, xp + (size_t)G * IC, run, IC, acc);
}

// Rows [r0, r1) against N inputs: row pairs as rows_avx512; up to 6 inputs at once (2 rows x 6 inputs x
// 2 lanes = 24 accumulators of the 32 registers), 7 and 8 as 4 and the rest.
template <DType DT, int N, Prefetch PF>
MOETRON_AVX512 void multi_pairs_avx512(float* out, int ld_out, const void* W, const float* x, int ld_x, const float* xp,
                                       int r0, int r1, int IC, bool acc) {
  constexpr int G = N <= 6 ? N : 4;
  const RowPairs p(r0, r1, (size_t)IC * vbytes_of(DT));
  if constexpr (N > G) {
    if (multi_block_pairs(N, G, IC) > 1) {
      constexpr int B = kMultiBlockPairs;
      for (int i = 0; i < p.pairs; i += B)
        multi_groups_avx512<DT, N, G, 2, PF, B>(out, ld_out, W, x, ld_x, xp, p.run(i, std::min(B, p.pairs - i)), IC,
                                                acc);
      if (p.odd) multi_groups_avx512<DT, N, G, 1, PF, 1>(out, ld_out, W, x, ld_x, xp, RowPairs::odd_row(r1), IC, acc);
      return;
    }
  }
  for (int i = 0; i < p.pairs; i++)
    multi_groups_avx512<DT, N, G, 2, PF, 1>(out, ld_out, W, x, ld_x, xp, p.run(i, 1), IC, acc);
  if (p.odd) multi_groups_avx512<DT, N, G, 1, PF, 1>(out, ld_out, W, x, ld_x, xp, RowPairs::odd_row(r1), IC, acc);
}

template <DType DT, int N>
MOETRON_AVX512 void multi_avx512(float* out, int ld_out, const void* W, const float* x, int ld_x, const float* xp,
                                 int r0, int r1, int IC, bool acc) {
  if (multi_prefetch(N <= 6 ? N : 4, IC) == Prefetch::l2)
    multi_pairs_avx512<DT, N, Prefetch::l2>(out, ld_out, W, x, ld_x, xp, r0, r1, IC, acc);
  else
    multi_pairs_avx512<DT, N, Prefetch::l1>(out, ld_out, W, x, ld_x, xp, r0, r1, IC, acc);
}

}  // namespace

MOETRON_MULTI_TABLE(multi_fn_avx512, multi_avx512)

// The stored types the kernels read.
template RowsKernel rows_avx512<DType::F32>;
template RowsKernel rows_avx512<DType::BF16>;
template RowsKernel rows_avx512<DType::F16>;
template MultiFn multi_fn_avx512<DType::F32>(int);
template MultiFn multi_fn_avx512<DType::BF16>(int);
template MultiFn multi_fn_avx512<DType::F16>(int);

}  // namespace moetron::kernels
