// The AVX2 + FMA (+ F16C) matrix-vector kernels over fp32, bf16 and f16 rows: one input (rows_avx2)
// and the products of up to kMaxGemvInputs inputs (multi_fn_avx2), in gemv_impl.h's lane order and row
// pairs.
#include "backend/kernels/gemv_impl.h"

namespace moetron::kernels {

namespace {

// 8 contiguous values as fp32.
template <DType DT>
MOETRON_AVX2 inline __m256 w8(const void* W, size_t i) {
  if constexpr (DT == DType::F32) {
    return _mm256_loadu_ps(static_cast<const float*>(W) + i);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(W) + i));
    if constexpr (DT == DType::BF16)
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    else
      return _mm256_cvtph_ps(h);
  }
}

// 16 values from i in the lane order: lo = {0..3, 8..11}, hi = {4..7, 12..15}.
template <DType DT>
MOETRON_AVX2 inline void w16_lanes(const void* W, size_t i, __m256& lo, __m256& hi) {
  if constexpr (DT == DType::BF16) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(W) + i));
    const __m256i z = _mm256_setzero_si256();
    lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, w));
    hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, w));
  } else {
    const __m256 a = w8<DT>(W, i), b = w8<DT>(W, i + 8);
    lo = _mm256_permute2f128_ps(a, b, 0x20);
    hi = _mm256_permute2f128_ps(a, b, 0x31);
  }
}

// R rows r + k * stride against one input.
// PF: none, or kPrefetch values ahead into L1 (one_input_prefetch).
template <DType DT, int R, Prefetch PF = Prefetch::l1>
MOETRON_AVX2 void block_avx2(float* y, const void* W, const float* x, const float* xp, int r, int stride, int IC,
                             bool acc) {
  constexpr size_t vbytes = vbytes_of(DT);
  __m256 a[R][2];
  for (int k = 0; k < R; k++) a[k][0] = a[k][1] = _mm256_setzero_ps();
  int c = 0;
  for (; c + 16 <= IC; c += 16) {
    const __m256 x0 = _mm256_loadu_ps(xp + c), x1 = _mm256_loadu_ps(xp + c + 8);
    for (int k = 0; k < R; k++) {
      const size_t i = (size_t)(r + k * stride) * IC + c;
      if constexpr (PF == Prefetch::l1)
        _mm_prefetch(static_cast<const char*>(W) + (i + kPrefetch) * vbytes, _MM_HINT_T0);
      __m256 lo, hi;
      w16_lanes<DT>(W, i, lo, hi);
      a[k][0] = _mm256_fmadd_ps(lo, x0, a[k][0]);
      a[k][1] = _mm256_fmadd_ps(hi, x1, a[k][1]);
    }
  }
  for (; c + 8 <= IC; c += 8) {
    const __m256 x0 = _mm256_loadu_ps(x + c);
    for (int k = 0; k < R; k++) a[k][0] = _mm256_fmadd_ps(w8<DT>(W, (size_t)(r + k * stride) * IC + c), x0, a[k][0]);
  }
  for (int k = 0; k < R; k++) {
    const int rk = r + k * stride;
    float s = hsum8(_mm256_add_ps(a[k][0], a[k][1]));
    for (int t = c; t < IC; t++) s += wscalar<DT>(W, (size_t)rk * IC + t) * x[t];
    y[rk] = acc ? y[rk] + s : s;
  }
}

template <DType DT, Prefetch PF>
MOETRON_AVX2 void pairs_avx2(float* y, const void* W, const float* x, const float* xp, int r0, int r1, int IC,
                             bool acc) {
  const RowPairs p(r0, r1, (size_t)IC * vbytes_of(DT));
  for (int i = 0; i < p.pairs; i++) block_avx2<DT, 2, PF>(y, W, x, xp, p.first(i), p.stride, IC, acc);
  if (p.odd) block_avx2<DT, 1, PF>(y, W, x, xp, r1 - 1, 0, IC, acc);
}

}  // namespace

// On AMD rows paired apart go without prefetches (one_input_prefetch; measured with these kernels on
// the Zen 4 VM, MOETRON_SIMD=avx2, one thread, GB/s: bf16 32000 x 1024 24.0 -> 27.0, 1024 x 2048 23.2
// -> 28.1; rows of 256 values 11.1 -> 9.7, so neighbours keep them, into L1).
template <DType DT>
MOETRON_AVX2 void rows_avx2(float* y, const void* W, const float* x, const float* xp, int r0, int r1, int IC,
                            bool acc) {
  if (one_input_prefetch((size_t)IC * vbytes_of(DT), kRowsApartBytes, Prefetch::l1) == Prefetch::none)
    pairs_avx2<DT, Prefetch::none>(y, W, x, xp, r0, r1, IC, acc);
  else
    pairs_avx2<DT, Prefetch::l1>(y, W, x, xp, r0, r1, IC, acc);
}

namespace {

// R weight rows r + k * stride against N inputs x_j (row stride ld_x; xp: their permuted copies,
// stride IC): the operations of block_avx2<DT, 1> for each row and input, with the weights loaded once.
// PF: the rows' prefetch, into L1 or L2 (multi_prefetch).
template <DType DT, int N, int R, Prefetch PF, int P = 0, int NP = 1>
MOETRON_AVX2 void multi_block_avx2(float* out, int ld_out, const void* W, const float* x, int ld_x, const float* xp,
                                   int r, int stride, int IC, bool acc) {
  constexpr size_t vbytes = vbytes_of(DT);
  __m256 a[R][N][2];
  for (int k = 0; k < R; k++)
    for (int j = 0; j < N; j++) a[k][j][0] = a[k][j][1] = _mm256_setzero_ps();
  int c = 0;
  const size_t ahead = prefetch_ahead<P, NP>(IC, kPrefetch);
  for (; c + 16 <= IC; c += 16) {
    __m256 lo[R], hi[R];
    for (int k = 0; k < R; k++) {
      const size_t row = (size_t)(r + k * stride) * IC, i = row + c;
      _mm_prefetch(static_cast<const char*>(W) + (row + ahead + c / NP) * vbytes,
                   PF == Prefetch::l2 ? _MM_HINT_T1 : _MM_HINT_T0);
      w16_lanes<DT>(W, i, lo[k], hi[k]);
    }
    for (int j = 0; j < N; j++) {
      const __m256 x0 = _mm256_loadu_ps(xp + (size_t)j * IC + c), x1 = _mm256_loadu_ps(xp + (size_t)j * IC + c + 8);
      for (int k = 0; k < R; k++) {
        a[k][j][0] = _mm256_fmadd_ps(lo[k], x0, a[k][j][0]);
        a[k][j][1] = _mm256_fmadd_ps(hi[k], x1, a[k][j][1]);
      }
    }
  }
  for (; c + 8 <= IC; c += 8)
    for (int k = 0; k < R; k++) {
      const __m256 w = w8<DT>(W, (size_t)(r + k * stride) * IC + c);
      for (int j = 0; j < N; j++) a[k][j][0] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + (size_t)j * ld_x + c), a[k][j][0]);
    }
  for (int k = 0; k < R; k++) {
    const int rk = r + k * stride;
    for (int j = 0; j < N; j++) {
      const float* xj = x + (size_t)j * ld_x;
      float s = hsum8(_mm256_add_ps(a[k][j][0], a[k][j][1]));
      for (int t = c; t < IC; t++) s += wscalar<DT>(W, (size_t)rk * IC + t) * xj[t];
      float& o = out[(size_t)j * ld_out + rk];
      o = acc ? o + s : s;
    }
  }
}

// The N inputs in groups of G (the last may be smaller), each group a multi_block_avx2 over the same
// R rows (pass P of NP): the later groups read the rows again from L1.
template <DType DT, int N, int G, int R, Prefetch PF, int P = 0, int NP = (N + G - 1) / G>
MOETRON_AVX2 void multi_groups_avx2(float* out, int ld_out, const void* W, const float* x, int ld_x, const float* xp,
                                    int r, int stride, int IC, bool acc) {
  multi_block_avx2<DT, (N < G ? N : G), R, PF, P, NP>(out, ld_out, W, x, ld_x, xp, r, stride, IC, acc);
  if constexpr (N > G)
    multi_groups_avx2<DT, N - G, G, R, PF, P + 1, NP>(out + (size_t)G * ld_out, ld_out, W, x + (size_t)G * ld_x, ld_x,
                                                      xp + (size_t)G * IC, r, stride, IC, acc);
}

// Rows [r0, r1) against N inputs: row pairs as rows_avx2, the inputs two at a time (2 rows x 2 inputs x
// 2 lanes = 8 accumulators of the 16 registers).
template <DType DT, int N, Prefetch PF>
MOETRON_AVX2 void multi_pairs_avx2(float* out, int ld_out, const void* W, const float* x, int ld_x, const float* xp,
                                   int r0, int r1, int IC, bool acc) {
  const RowPairs p(r0, r1, (size_t)IC * vbytes_of(DT));
  for (int i = 0; i < p.pairs; i++)  // pair by pair: blocks of pairs (multi_block_pairs) gained nothing here
    multi_groups_avx2<DT, N, 2, 2, PF>(out, ld_out, W, x, ld_x, xp, p.first(i), p.stride, IC, acc);
  if (p.odd) multi_groups_avx2<DT, N, 2, 1, PF>(out, ld_out, W, x, ld_x, xp, r1 - 1, 0, IC, acc);
}

template <DType DT, int N>
MOETRON_AVX2 void multi_avx2(float* out, int ld_out, const void* W, const float* x, int ld_x, const float* xp, int r0,
                             int r1, int IC, bool acc) {
  if (multi_prefetch(N < 2 ? N : 2, IC) == Prefetch::l2)
    multi_pairs_avx2<DT, N, Prefetch::l2>(out, ld_out, W, x, ld_x, xp, r0, r1, IC, acc);
  else
    multi_pairs_avx2<DT, N, Prefetch::l1>(out, ld_out, W, x, ld_x, xp, r0, r1, IC, acc);
}

}  // namespace

MOETRON_MULTI_TABLE(multi_fn_avx2, multi_avx2)

// The stored types the kernels read.
template RowsKernel rows_avx2<DType::F32>;
template RowsKernel rows_avx2<DType::BF16>;
template RowsKernel rows_avx2<DType::F16>;
template MultiFn multi_fn_avx2<DType::F32>(int);
template MultiFn multi_fn_avx2<DType::BF16>(int);
template MultiFn multi_fn_avx2<DType::F16>(int);

}  // namespace moetron::kernels
