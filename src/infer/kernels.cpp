// Inference kernels; see kernels.h.  Each SIMD level is compiled with a target attribute (whatever
// the build's -march) and chosen at run time.  Per row: two accumulators over the columns in steps of
// 2 vectors (in the lane order described below), then one vector, then a scalar tail, then one
// fixed-order horizontal sum -- the same
// operations whether the row is computed alone or in a block of two (blocks share the loads of x),
// so a row's result depends only on its values.  Weight rows are prefetched kPrefetch values ahead:
// a matrix-vector product streams the weights once, and the hardware prefetchers alone left a core
// at ~60% of its read bandwidth here.  Measured on the 0.49B model, one thread, bf16 (2-core
// Sapphire-Rapids-class VM): 4-row blocks, 512 ahead 33.4 tokens/s; 2-row, 1024 ahead 34.5; 2-row,
// 2048 ahead 39.5; 4096 ahead the same; 4-row, 2048 ahead 34.6 (AVX2: 4-row 33.0, 2-row 36.9); and
// see kPrefetch for an AMD EPYC.
#include "infer/kernels.h"

// GCC 12 reports the "undefined" pass-through operand inside its own AVX-512 intrinsics
// (_mm512_slli_epi32, _mm512_reduce_add_ps) as uninitialised when they are used under a target
// attribute: a known false positive of the headers, silenced for this file only.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <cstring>
#include <string>

#include "core/error.h"
#include "core/line_vector.h"
#include "infer/gemm.h"

namespace moetron::infer {

namespace {

// Values ahead of the position being read: 8 KiB of bf16 (4 KiB was as fast on the Xeon; on a 2-core
// AVX-512 AMD EPYC VM the 0.49B model decoded 65.6 tokens/s with 4 KiB, 72 with 8, 63 with 16).
constexpr int kPrefetch = 4096;
// On AMD (amd_cpu()) the AVX-512 one-input kernels issue no prefetches, and a task's matrix is read in
// pieces of about kPieceBytes (piece_rows_for): its row pairs then form two runs of a MiB each, which
// the hardware prefetchers follow at more than the software prefetches reached.  2-core Zen 4 EPYC VM,
// weights from memory, one input, medians of alternating runs in one process, GB/s: bf16 32000 x
// 1024, one thread 25.1 -> 26.6, two 32.3 -> 34.3; 2048 x 1024, 23.6 -> 26.6 and 30.9 -> 33.3; 1024 x
// 2048, 25.3 -> 27.0 (one thread).  With 64-row pieces, dropping the prefetches alone was a loss (rows
// of 2 KiB: runs of 64 KiB).  Q8_0 rows paired apart (1 KiB or more) likewise: 0.49B model decoding
// in Q8_0, alternating runs, tokens/s: one thread 109.2 -> 114.3, two 152.2 -> 157.0.  Intel keeps
// the setting measured on the Xeon.

// Rows shorter than kRowsApartBytes (Q8_0: kQ8RowsApartBytes) are read as neighbour pairs (RowPairs):
// on AMD those still prefetch, 4 KiB of bf16 ahead into L2 (Q8_0: kQ8PrefetchVnniL2).  prefetcht1 4
// KiB ahead had beaten prefetcht0 8 KiB (one thread, 0.49B model: 53-60 -> 67-78 tokens/s); without
// prefetches the small model (rows of 256 values) decoded 769 -> 539 tokens/s, in Q8_0 1589 -> 1301.
constexpr int kPrefetchL2 = 2048;
enum class Prefetch { none, l1, l2 };  // a one-input kernel's: none, kPrefetch into L1, kPrefetchL2 into L2

// Whether this is an AMD CPU (the prefetch settings above).  Read once.
bool amd_cpu() {
#if defined(__x86_64__)
  static const bool v = __builtin_cpu_is("amd");
  return v;
#else
  return false;
#endif
}

// A one-input kernel's prefetch for rows of row_bytes, which are paired apart from apart_bytes on
// (RowPairs): on AMD none for rows paired apart and `near` for neighbours; elsewhere into L1.
Prefetch one_input_prefetch(size_t row_bytes, size_t apart_bytes, Prefetch near) {
  if (!amd_cpu()) return Prefetch::l1;
  return row_bytes >= apart_bytes ? Prefetch::none : near;
}

// The products of several inputs read one pass's g inputs (g * IC floats) from L1 again for every row
// pair; once they take half of a 32 KiB L1, prefetching the rows into L1 evicts them.  On AMD such a
// pass prefetches into L2 instead.  2-core Zen 4 EPYC VM, bf16 from memory, alternating in one process,
// L2 / L1 GB/s ratios, one and two threads: AVX-512, 2048 x 1024 with 4 inputs 1.51 / 1.41, 6 inputs
// 1.23 / 1.14; 1024 x 2048 with 3 inputs 1.19 / 1.11, 4 inputs 1.35 / 1.24; AVX2 (passes of 2 inputs),
// 1024 x 2048 with 2 inputs 1.60 / 1.14, 3 inputs 1.12 / 1.15.  Below the bound L2 lost: 2048 x 1024
// with 2 inputs 0.93 / 0.91, AVX2 with 3 inputs (passes of 2 and 1) 0.78 / 0.77.  32000 x 1024 with 8
// inputs (compute-bound) is the same either way.  Intel keeps L1, as measured on the Xeon.
constexpr int kMultiL2Floats = 4096;
Prefetch multi_prefetch(int g, int IC) {
  return amd_cpu() && (long)g * IC >= kMultiL2Floats ? Prefetch::l2 : Prefetch::l1;
}

// With n inputs in passes of g, each pass over the rows reads its own inputs: when all of them
// (n * IC floats) overflow L1 beside the rows, every pair's passes read them from L2 again.  On AMD
// the AVX-512 passes then run over blocks of kMultiBlockPairs row pairs (pass 0 over the block, pass
// 1, ...), the rows read again from L1 or L2, each pass prefetching as many rows ahead.  2-core Zen 4
// EPYC VM, bf16 from memory, alternating in one process, GB/s ratios to pair by pair, one / two
// threads: 8 inputs (two passes of 4), 32000 x 1024 1.12 / 1.10, 2048 x 1024 1.11 / 1.10, 1024 x
// 2048 1.13 / 1.12; 7 inputs, 1024 x 1024 1.09 / 1.07 (blocks of 4: 1.03-1.10; blocks of 8
// prefetching one row ahead, as pair by pair does: 0.85-0.90).  Rows of 256 (8 inputs fit in L1) lost
// 10% blocked and stay pair by pair; the AVX2 kernels (compute-bound on that CPU) gained nothing.
constexpr long kMultiBlockFloats = 6144;
constexpr int kMultiBlockPairs = 8;
int multi_block_pairs(int n, int g, int IC) {
  return n > g && amd_cpu() && (long)n * IC >= kMultiBlockFloats ? kMultiBlockPairs : 1;
}
// The AVX-512 products of several inputs: 2 KiB of bf16.  They compute longer per byte, so a nearer
// prefetch is still in time, and it keeps fewer lines in flight beside the rows being read: 8
// sequences decoded together (0.49B bf16, 2-core Xeon VM, 4 alternating rounds, tokens/s): 8 KiB
// ahead 216, 4 KiB 221, 2 KiB 224, 1 KiB 215; 16 KiB was slower than 8.
constexpr int kMultiPrefetch = 1024;
// Q8_0: bytes ahead, per kernel, each measured on the CPU it is chosen for (0.49B model, one thread).
// AVX-512 VNNI (64 bytes a step), on the AVX-512 AMD EPYC VM: 2 KiB 88 tokens/s, 4 KiB 109, 8 KiB 115,
// 16 KiB 110.  AVX2 (32 bytes a step), on a 2-core AVX2-only AMD EPYC VM, medians of 3, two sweeps:
// 1 KiB 50, 2 KiB 57, 4 KiB 50, 8 KiB 49, 16 KiB 53 (2 threads: 2 KiB 89, 8 KiB 85).
constexpr int kQ8PrefetchVnni = 8192;
// On AMD (amd_cpu()) 4 KiB ahead into L2: 2-core Zen 4 EPYC VM, 32000 x 1024 from memory, G
// multiply-adds/s, one thread 14.8 -> 20.2 (8 KiB into L2: 18.7), two 24.6 -> 31.5.
constexpr int kQ8PrefetchVnniL2 = 4096;
constexpr int kQ8PrefetchAvx2 = 2048;

// How far ahead of a row's start pass P of NP over the same rows (the inputs in groups, each group a
// pass: the later passes read the rows from L1) prefetches, at value c of the row: this plus c / NP.
// One pass reads `dist` values ahead.  Several share a row's worth of values at least kMultiPrefetch
// ahead and past this row, pass P asking for its P-th 1/NP (a line every NP steps): the passes after
// the first issue no new reads otherwise, so with every pass prefetching the same lines memory idled
// while they computed.  8 inputs, bf16 32000 x 1024 and 2048 x 1024 from memory, 2 threads, 2-core Xeon
// VM, alternating: 76-80 -> 81-87 G multiply-adds/s; AVX2 kernels 47-53 -> 56-57 (with their own 4096
// values ahead 48-53; two rows ahead was no better).  Rows shorter than kMultiPrefetch (the small
// model's 256) need the floor: prefetching just the next row, 32000 x 256, 8 inputs: 59 -> 46-49.
// Passes over blocks of B row pairs (multi_block_pairs) look B rows ahead.
template <int P, int NP, int B = 1>
inline size_t prefetch_ahead(int IC, int dist) {
  if constexpr (NP == 1)
    return (size_t)dist;
  else
    return (size_t)B * std::max(IC, kMultiPrefetch) + (size_t)P * IC / NP;
}

inline float load_scalar(const uint16_t* p, int c, DType dt) {
  uint16_t h;
  std::memcpy(&h, p + c, sizeof h);
  return dt == DType::BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

// ---- portable -------------------------------------------------------------------------------------

// Element i of W as fp32.
template <DType DT>
float wscalar(const void* W, size_t i) {
  if constexpr (DT == DType::F32) {
    float v;
    std::memcpy(&v, static_cast<const float*>(W) + i, sizeof v);
    return v;
  } else {
    return load_scalar(static_cast<const uint16_t*>(W) + i, 0, DT);
  }
}

template <DType DT>
void rows_generic(float* y, const void* W, const float* x, const float* /*xp*/, int r0, int r1, int IC, bool acc) {
  for (int r = r0; r < r1; r++) {
    const size_t base = (size_t)r * IC;
    float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    int c = 0;
    for (; c + 4 <= IC; c += 4) {
      s0 += wscalar<DT>(W, base + c) * x[c];
      s1 += wscalar<DT>(W, base + c + 1) * x[c + 1];
      s2 += wscalar<DT>(W, base + c + 2) * x[c + 2];
      s3 += wscalar<DT>(W, base + c + 3) * x[c + 3];
    }
    float s = (s0 + s1) + (s2 + s3);
    for (; c < IC; c++) s += wscalar<DT>(W, base + c) * x[c];
    y[r] = acc ? y[r] + s : s;
  }
}

// ---- the lane order of the main loop --------------------------------------------------------------
//
// bf16 widens to fp32 by interleaving zero halves below it (unpacklo/hi_epi16 with zero): one load
// and two shuffles per 2 vectors instead of 2 loads, 2 zero-extensions and 2 shifts -- enough to keep
// a core at its read bandwidth.  Interleaving works within 128-bit lanes, so each block of 2V
// columns (V = 8 for AVX2, 16 for AVX-512) lands in the accumulators in the order
//   lo = {c0..3, c8..11, c16..19, ...},  hi = {c4..7, c12..15, ...}   (per 8 columns: 4 in lo, 4 in hi)
// x is permuted the same way once per call (permute_x), and fp32 and f16 weights are permuted into
// the same lanes (so all three dtypes do the same arithmetic on the same values: bitwise equal).

// xp[0, 2V*blocks) = x in the lane order above, for blocks of 2V columns.
void permute_x(float* xp, const float* x, int blocks, int V) {
  for (int b = 0; b < blocks; b++) {
    const float* xb = x + (size_t)b * 2 * V;
    float* lo = xp + (size_t)b * 2 * V;
    float* hi = lo + V;
    for (int q = 0; q < V / 4; q++)
      for (int j = 0; j < 4; j++) {
        lo[4 * q + j] = xb[8 * q + j];
        hi[4 * q + j] = xb[8 * q + 4 + j];
      }
  }
}

// ---- row pairs --------------------------------------------------------------------------------------
//
// The SIMD kernels read two weight rows at a time (sharing the loads of the inputs).  Rows of 2 KiB or
// more are paired half a block apart -- (r0 + i, r0 + h + i), h = (r1 - r0) / 2 -- so that the two
// streams lie in different 4 KiB pages: two neighbouring rows share a page, and the hardware
// prefetcher, which follows streams within a page, then fetched them slower.  Measured with weights
// streamed from memory, 2-core Xeon VM, bf16 rows of 1024 and 2048 values: one input 3-7% faster, 2
// to 6 inputs 5-35%, 8 inputs 5-28%.  Shorter rows stay paired with their neighbour: a pair fills a
// fraction of a page and the two read as one stream (the small model's 512-byte rows decoded 4-12%
// slower apart).  Either way a row's arithmetic is the same: only the order of the rows changes.
constexpr size_t kRowsApartBytes = 2048;

// Bytes a weight value takes as stored (F32, BF16, F16).
constexpr size_t vbytes_of(DType dt) { return dt == DType::F32 ? 4 : 2; }

// Q8_0 rows (a byte a value) are paired apart from 1 KiB: on a 2-core AVX-512 AMD EPYC (Zen 4) VM,
// neighbouring rows of 1024 values read from memory at half the speed of rows apart (32000 x 1024, one
// input, medians of alternating runs, G multiply-adds/s: one thread 10.4 -> 17.2, two 17.2 -> 26.2;
// 2048 x 1024, two threads, 18.8 -> 28.9; 1024 x 2048 20.4 -> 26.9), while the small model's rows of
// 256 stayed faster together (one thread 20.4 together, 14.3 apart).
constexpr size_t kQ8RowsApartBytes = 1024;

// Rows [r0, r1) of row_bytes each as pairs (first(i), first(i) + stride), i < pairs, and the odd row
// r1 - 1 alone when there is one; rows of apart_bytes or more are paired half a block apart.
struct RowPairs {
  int r0, pairs, stride;
  bool odd;
  RowPairs(int r0_, int r1, size_t row_bytes, size_t apart_bytes = kRowsApartBytes)
      : r0(r0_), pairs((r1 - r0_) / 2), stride(row_bytes >= apart_bytes ? (r1 - r0_) / 2 : 1),
        odd((r1 - r0_) % 2 != 0) {}
  int first(int i) const { return stride == 1 ? r0 + 2 * i : r0 + i; }  // one pair apart is r0 either way
  // count consecutive pairs from pair i, as a Run; the odd row as a Run of one (R = 1).
  struct Run {
    int r, step, count, stride;  // rows r + q * step and r + q * step + stride, q < count
  };
  Run run(int i, int count) const { return {first(i), stride == 1 ? 2 : 1, count, stride}; }
  static Run odd_row(int r1) { return {r1 - 1, 1, 1, 0}; }
};

// ---- AVX2 + FMA (+ F16C) ----------------------------------------------------------------------------

#define MOETRON_AVX2 __attribute__((target("avx2,fma,f16c")))

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

MOETRON_AVX2 inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
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

// ---- AVX-512 ----------------------------------------------------------------------------------------

#define MOETRON_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))

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

// R rows r + k * stride against N inputs (see multi_block_avx2): block_avx512<DT, 1, Prefetch::l1>'s operations per
// row and input.
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

// Rows [r0, r1) of W against n <= kMaxGemvInputs inputs, each weight row read once.
using MultiFn = void (*)(float*, int, const void*, const float*, int, const float*, int, int, int, bool);

#define MOETRON_MULTI_TABLE(NAME, FN)                                                                          \
  template <DType DT>                                                                                          \
  MultiFn NAME(int n) {                                                                                        \
    static constexpr MultiFn t[kMaxGemvInputs] = {FN<DT, 1>, FN<DT, 2>, FN<DT, 3>, FN<DT, 4>,                \
                                                  FN<DT, 5>, FN<DT, 6>, FN<DT, 7>, FN<DT, 8>};               \
    return t[n - 1];                                                                                           \
  }
MOETRON_MULTI_TABLE(multi_fn_avx2, multi_avx2)
MOETRON_MULTI_TABLE(multi_fn_avx512, multi_avx512)
#undef MOETRON_MULTI_TABLE

template <DType DT>
void mrows_generic(float* out, int ld_out, const void* W, const float* x, int ld_x, int n, int r0, int r1, int IC,
                   bool acc) {
  for (int r = r0; r < r1; r++)
    for (int j = 0; j < n; j++) {
      float* o = out + (size_t)j * ld_out;
      rows_generic<DT>(o, W, x + (size_t)j * ld_x, nullptr, r, r + 1, IC, acc);
    }
}

template <DType DT>
void mrows_simd(SimdLevel level, float* out, int ld_out, const void* W, const float* x, int ld_x, const float* xp, int n,
                int r0, int r1, int IC, bool acc) {
  const MultiFn f = level == SimdLevel::avx512 ? multi_fn_avx512<DT>(n) : multi_fn_avx2<DT>(n);
  f(out, ld_out, W, x, ld_x, xp, r0, r1, IC, acc);
}

// ---- Q8_0 ---------------------------------------------------------------------------------------------
//
// A row's product with an input, both in Q8_0: per block b, eight exact int32 lane sums s_b (lane k:
// the block's values 4k..4k+3), added to the fp32 lanes of accumulator E (even b) or O (odd b) as
// fma(dw_b * dx_b, s_b, acc); the result is E + O lane by lane, then summed in hsum8's order.  The
// portable, AVX2 and AVX-512 code do exactly these operations (the integer sums are exact however
// they are formed), so results are bitwise equal across levels.  Integer sums: AVX2 multiplies |x|
// (u8) by the weights carrying x's signs (maddubs, as llama.cpp); AVX-512 VNNI 64 values at a time
// (two blocks: E in the low half, O in the high) as -128 * sum(x) plus (w + 128) (u8) times x.

// One product's inputs in Q8_0: input j's values at q + j * IC (int8) and a + j * IC (|q|, uint8), its
// block scales at d + j * IC / kQ8Block (fp32), and -128 times its 4-value sums at neg_off + j * IC / 4.
struct Q8Inputs {
  const int8_t* q;
  const uint8_t* a;
  const float* d;
  const int32_t* neg_off;  // per 4 values: -128 times their sum (VNNI's accumulator start)
};

// Bytes q8_quantize_inputs needs for n inputs of IC values (IC a multiple of kQ8Block).
size_t q8_input_bytes(int n, int IC) {
  return (size_t)n * IC * 2 + (size_t)n * (IC / kQ8Block) * sizeof(float) + (size_t)n * (IC / 4) * sizeof(int32_t);
}

Q8Inputs q8_view(const uint8_t* buf, int n, int IC) {
  const size_t at_d = (size_t)n * IC * 2, at_off = at_d + (size_t)n * (IC / kQ8Block) * sizeof(float);
  return {reinterpret_cast<const int8_t*>(buf), buf + (size_t)n * IC, reinterpret_cast<const float*>(buf + at_d),
          reinterpret_cast<const int32_t*>(buf + at_off)};
}

// The n inputs x + j * ld_x in Q8_0 into buf (q8_input_bytes(n, IC)).
void q8_quantize_inputs(const float* x, int ld_x, int n, int IC, uint8_t* buf) {
  const int nb = IC / kQ8Block;
  const Q8Inputs v = q8_view(buf, n, IC);
  int8_t* q = const_cast<int8_t*>(v.q);
  uint8_t* a = const_cast<uint8_t*>(v.a);
  float* d = const_cast<float*>(v.d);
  int32_t* neg_off = const_cast<int32_t*>(v.neg_off);
  for (int j = 0; j < n; j++)
    for (int b = 0; b < nb; b++) {
      const size_t at = (size_t)j * IC + (size_t)b * kQ8Block;
      quantize_q8_0_block(x + (size_t)j * ld_x + (size_t)b * kQ8Block, q + at, d[(size_t)j * nb + b]);
      for (int i = 0; i < kQ8Block; i++) a[at + i] = (uint8_t)std::abs((int)q[at + i]);
      for (int k = 0; k < kQ8Block / 4; k++)
        neg_off[at / 4 + k] =
            -128 * ((int32_t)q[at + 4 * k] + q[at + 4 * k + 1] + q[at + 4 * k + 2] + q[at + 4 * k + 3]);
    }
}

inline float f16_at(const uint16_t* s, size_t i) {
  uint16_t h;
  std::memcpy(&h, s + i, sizeof h);
  return f16_to_f32(h);
}

// Row r of W against input j of x (see the section comment).
float q8_dot_generic(const int8_t* W, const uint16_t* S, const Q8Inputs& x, int j, int r, int IC) {
  const int nb = IC / kQ8Block;
  const int8_t* w = W + (size_t)r * IC;
  const int8_t* q = x.q + (size_t)j * IC;
  float a[2][8] = {};  // E, O
  for (int b = 0; b < nb; b++) {
    const float d = f16_at(S, (size_t)r * nb + b) * x.d[(size_t)j * nb + b];
    for (int k = 0; k < 8; k++) {
      int32_t s = 0;
      for (int t = 0; t < 4; t++) {
        const int i = b * kQ8Block + 4 * k + t;
        s += (int32_t)w[i] * (int32_t)q[i];
      }
      a[b & 1][k] = std::fma(d, (float)s, a[b & 1][k]);
    }
  }
  float t[8];
  for (int k = 0; k < 8; k++) t[k] = a[0][k] + a[1][k];
  return ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
}

void q8_rows_generic(float* out, int ld_out, const int8_t* W, const uint16_t* S, const Q8Inputs& x, int n, int r0,
                     int r1, int IC, bool acc) {
  for (int r = r0; r < r1; r++)
    for (int j = 0; j < n; j++) {
      const float s = q8_dot_generic(W, S, x, j, r, IC);
      float& o = out[(size_t)j * ld_out + r];
      o = acc ? o + s : s;
    }
}

MOETRON_AVX2 inline float f16_at_avx2(const uint16_t* s, size_t i) {
  uint16_t h;
  std::memcpy(&h, s + i, sizeof h);
  return _cvtsh_ss(h);  // exact, as f16_to_f32
}

// The eight int32 lane sums of one block: |x| (u8) times the weights carrying x's signs.
MOETRON_AVX2 inline __m256i q8_lanes(__m256i xa, __m256i xq, __m256i w) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(xa, _mm256_sign_epi8(w, xq)), _mm256_set1_epi16(1));
}

// R rows r + k * stride against input 0 (the x loads shared).
template <int R>
MOETRON_AVX2 void q8_block_avx2(float* y, const int8_t* W, const uint16_t* S, const Q8Inputs& x, int r, int stride,
                                int IC, bool acc) {
  const int nb = IC / kQ8Block;
  __m256 a[R][2];  // E, O
  for (int k = 0; k < R; k++) a[k][0] = a[k][1] = _mm256_setzero_ps();
  for (int b = 0; b < nb; b++) {
    const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + (size_t)b * kQ8Block));
    const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.a + (size_t)b * kQ8Block));
    const float dx = x.d[b];
    for (int k = 0; k < R; k++) {
      const size_t i = (size_t)(r + k * stride) * IC + (size_t)b * kQ8Block;
      _mm_prefetch(reinterpret_cast<const char*>(W + i + kQ8PrefetchAvx2), _MM_HINT_T0);
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(W + i));
      const float d = f16_at_avx2(S, (size_t)(r + k * stride) * nb + b) * dx;
      a[k][b & 1] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(q8_lanes(xa, xq, w)), a[k][b & 1]);
    }
  }
  for (int k = 0; k < R; k++) {
    const float s = hsum8(_mm256_add_ps(a[k][0], a[k][1]));
    y[r + k * stride] = acc ? y[r + k * stride] + s : s;
  }
}

// One row r against N inputs (the weight loads shared): q8_block_avx2<1>'s operations per input.
template <int N>
MOETRON_AVX2 void q8_multi_avx2(float* out, int ld_out, const int8_t* W, const uint16_t* S, const Q8Inputs& x, int r,
                                int IC, bool acc) {
  const int nb = IC / kQ8Block;
  __m256 a[N][2];
  for (int j = 0; j < N; j++) a[j][0] = a[j][1] = _mm256_setzero_ps();
  for (int b = 0; b < nb; b++) {
    const size_t i = (size_t)r * IC + (size_t)b * kQ8Block;
    _mm_prefetch(reinterpret_cast<const char*>(W + i + kQ8PrefetchAvx2), _MM_HINT_T0);
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(W + i));
    const float dw = f16_at_avx2(S, (size_t)r * nb + b);
    for (int j = 0; j < N; j++) {
      const size_t at = (size_t)j * IC + (size_t)b * kQ8Block;
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + at));
      const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.a + at));
      const float d = dw * x.d[(size_t)j * nb + b];
      a[j][b & 1] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(q8_lanes(xa, xq, w)), a[j][b & 1]);
    }
  }
  for (int j = 0; j < N; j++) {
    const float s = hsum8(_mm256_add_ps(a[j][0], a[j][1]));
    float& o = out[(size_t)j * ld_out + r];
    o = acc ? o + s : s;
  }
}

#define MOETRON_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))

// The 16 int32 lane sums of blocks b, b+1 (64 weights) with input j: -128 sum(x) + (w + 128) x, the
// dot product accumulated onto the offset (exact int32: the same sums as subtracting it after, with
// neither a zeroed accumulator nor the subtraction).
MOETRON_VNNI inline __m512i q8_pair_lanes(const int8_t* w, const Q8Inputs& x, size_t at) {
  const __m512i wu = _mm512_xor_si512(_mm512_loadu_si512(w), _mm512_set1_epi8((char)0x80));
  return _mm512_dpbusd_epi32(_mm512_loadu_si512(x.neg_off + at / 4), wu, _mm512_loadu_si512(x.q + at));
}

// The same for one block, 8 lanes.
MOETRON_VNNI inline __m256i q8_one_lanes(const int8_t* w, const Q8Inputs& x, size_t at) {
  const __m256i wu = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)),
                                      _mm256_set1_epi8((char)0x80));
  return _mm256_dpbusd_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.neg_off + at / 4)), wu,
                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + at)));
}

// acc (E low, O high) += d_b, d_b+1 times the lane sums; dv holds 16 blocks' scales from g, p the pair.
MOETRON_VNNI inline __m512 q8_pair_fma(__m512 acc, __m512 dv, int p, __m512i s) {
  const __m512i idx = _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                       _mm512_set1_epi32(2 * p));
  return _mm512_fmadd_ps(_mm512_permutexvar_ps(idx, dv), _mm512_cvtepi32_ps(s), acc);
}

// An odd last block (an even index: E, the low half).
MOETRON_VNNI inline __m512 q8_tail_fma(__m512 acc, __m512 dv, int p, __m256i s) {
  const __m256 d = _mm512_castps512_ps256(_mm512_permutexvar_ps(_mm512_set1_epi32(2 * p), dv));
  const __m256 lo = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s), _mm512_castps512_ps256(acc));
  return _mm512_insertf32x8(acc, lo, 0);
}

MOETRON_VNNI inline float q8_finish(__m512 acc) {
  return hsum8(_mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1)));
}

// 16 block scales from block g of row r (fewer at the row's end: mask m) times the input's.
MOETRON_VNNI inline __m512 q8_scales(const uint16_t* S, size_t at, __mmask16 m, const float* dx) {
  return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, S + at)), _mm512_maskz_loadu_ps(m, dx));
}

template <int R, Prefetch PF>
MOETRON_VNNI void q8_block_vnni(float* y, const int8_t* W, const uint16_t* S, const Q8Inputs& x, int r, int stride,
                                int IC, bool acc) {
  const int nb = IC / kQ8Block;
  __m512 a[R];
  for (int k = 0; k < R; k++) a[k] = _mm512_setzero_ps();
  for (int g = 0; g < nb; g += 16) {
    const int gn = std::min(16, nb - g);
    const __mmask16 m = (__mmask16)((1u << gn) - 1);
    __m512 dv[R];
    for (int k = 0; k < R; k++) dv[k] = q8_scales(S, (size_t)(r + k * stride) * nb + g, m, x.d + g);
    int p = 0;
    for (; 2 * p + 1 < gn; p++) {
      const size_t at = (size_t)(g + 2 * p) * kQ8Block;
      for (int k = 0; k < R; k++) {
        const int8_t* w = W + (size_t)(r + k * stride) * IC + at;
        if constexpr (PF == Prefetch::l2)
          _mm_prefetch(reinterpret_cast<const char*>(w + kQ8PrefetchVnniL2), _MM_HINT_T1);
        else if constexpr (PF == Prefetch::l1)
          _mm_prefetch(reinterpret_cast<const char*>(w + kQ8PrefetchVnni), _MM_HINT_T0);
        a[k] = q8_pair_fma(a[k], dv[k], p, q8_pair_lanes(w, x, at));
      }
    }
    if (2 * p < gn) {
      const size_t at = (size_t)(g + 2 * p) * kQ8Block;
      for (int k = 0; k < R; k++)
        a[k] = q8_tail_fma(a[k], dv[k], p, q8_one_lanes(W + (size_t)(r + k * stride) * IC + at, x, at));
    }
  }
  for (int k = 0; k < R; k++) {
    const float s = q8_finish(a[k]);
    y[r + k * stride] = acc ? y[r + k * stride] + s : s;
  }
}

// PF: the row's prefetch, kQ8PrefetchVnni ahead into L1 or L2 (see q8_multi_fn_vnni).
template <int N, Prefetch PF>
MOETRON_VNNI void q8_multi_vnni(float* out, int ld_out, const int8_t* W, const uint16_t* S, const Q8Inputs& x, int r,
                                int IC, bool acc) {
  const int nb = IC / kQ8Block;
  __m512 a[N];
  for (int j = 0; j < N; j++) a[j] = _mm512_setzero_ps();
  const int8_t* row = W + (size_t)r * IC;
  for (int g = 0; g < nb; g += 16) {
    const int gn = std::min(16, nb - g);
    const __mmask16 m = (__mmask16)((1u << gn) - 1);
    __m512 dv[N];
    for (int j = 0; j < N; j++) dv[j] = q8_scales(S, (size_t)r * nb + g, m, x.d + (size_t)j * nb + g);
    int p = 0;
    for (; 2 * p + 1 < gn; p++) {
      const size_t at = (size_t)(g + 2 * p) * kQ8Block;
      _mm_prefetch(reinterpret_cast<const char*>(row + at + kQ8PrefetchVnni),
                   PF == Prefetch::l2 ? _MM_HINT_T1 : _MM_HINT_T0);
      for (int j = 0; j < N; j++) a[j] = q8_pair_fma(a[j], dv[j], p, q8_pair_lanes(row + at, x, (size_t)j * IC + at));
    }
    if (2 * p < gn) {
      const size_t at = (size_t)(g + 2 * p) * kQ8Block;
      for (int j = 0; j < N; j++) a[j] = q8_tail_fma(a[j], dv[j], p, q8_one_lanes(row + at, x, (size_t)j * IC + at));
    }
  }
  for (int j = 0; j < N; j++) {
    const float s = q8_finish(a[j]);
    float& o = out[(size_t)j * ld_out + r];
    o = acc ? o + s : s;
  }
}

using Q8MultiFn = void (*)(float*, int, const int8_t*, const uint16_t*, const Q8Inputs&, int, int, bool);

Q8MultiFn q8_multi_fn_avx2(int n) {
  static constexpr Q8MultiFn t[kMaxGemvInputs] = {q8_multi_avx2<1>, q8_multi_avx2<2>, q8_multi_avx2<3>,
                                                  q8_multi_avx2<4>, q8_multi_avx2<5>, q8_multi_avx2<6>,
                                                  q8_multi_avx2<7>, q8_multi_avx2<8>};
  return t[n - 1];
}

// On AMD into L2: the inputs stay in L1.  2-core Zen 4 EPYC VM, Q8_0 from memory, alternating in one
// process, L2 / L1 GB/s ratios, one and two threads: 2048 x 1024 with 2 inputs 1.15 / 1.04, 4 inputs
// 1.25 / 1.05; 1024 x 2048 with 2 inputs 1.32 / 1.05, 4 inputs 1.31 / 1.24; 32000 x 1024 with 8 and
// rows of 256 the same (1.00-1.02).  4 KiB ahead into L2 (the neighbours' one-input distance) gained
// less (1.00-1.28).  The AVX2 products (compute-bound on it) were the same either way.
template <Prefetch PF>
Q8MultiFn q8_multi_fn_vnni_pf(int n) {
  static constexpr Q8MultiFn t[kMaxGemvInputs] = {q8_multi_vnni<1, PF>, q8_multi_vnni<2, PF>, q8_multi_vnni<3, PF>,
                                                  q8_multi_vnni<4, PF>, q8_multi_vnni<5, PF>, q8_multi_vnni<6, PF>,
                                                  q8_multi_vnni<7, PF>, q8_multi_vnni<8, PF>};
  return t[n - 1];
}
Q8MultiFn q8_multi_fn_vnni(int n) {
  return amd_cpu() ? q8_multi_fn_vnni_pf<Prefetch::l2>(n) : q8_multi_fn_vnni_pf<Prefetch::l1>(n);
}

// Whether the AVX-512 level has VNNI for the int8 products (else it runs the AVX2 ones: same results).
bool has_avx512_vnni() {
#if defined(__x86_64__)
  static const bool v = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512dq");
  return v;
#else
  return false;
#endif
}

// Rows [r0, r1) of a Q8_0 matrix against n inputs (q8_quantize_inputs), out_j = out + j * ld_out.
void q8_rows(SimdLevel level, float* out, int ld_out, WeightRef Wr, const Q8Inputs& x, int n, int r0, int r1, int IC,
             bool acc) {
  const int8_t* W = static_cast<const int8_t*>(Wr.data);
  if (level == SimdLevel::generic) return q8_rows_generic(out, ld_out, W, Wr.scales, x, n, r0, r1, IC, acc);
  const bool vnni = level == SimdLevel::avx512 && has_avx512_vnni();
  if (n == 1) {
    using BlockFn = void (*)(float*, const int8_t*, const uint16_t*, const Q8Inputs&, int, int, int, bool);
    const Prefetch pf = one_input_prefetch((size_t)IC, kQ8RowsApartBytes, Prefetch::l2);
    const BlockFn two = !vnni                  ? q8_block_avx2<2>
                        : pf == Prefetch::none ? q8_block_vnni<2, Prefetch::none>
                        : pf == Prefetch::l2   ? q8_block_vnni<2, Prefetch::l2>
                                               : q8_block_vnni<2, Prefetch::l1>;
    const BlockFn one = !vnni                  ? q8_block_avx2<1>
                        : pf == Prefetch::none ? q8_block_vnni<1, Prefetch::none>
                        : pf == Prefetch::l2   ? q8_block_vnni<1, Prefetch::l2>
                                               : q8_block_vnni<1, Prefetch::l1>;
    const RowPairs p(r0, r1, (size_t)IC, kQ8RowsApartBytes);
    for (int i = 0; i < p.pairs; i++) two(out, W, Wr.scales, x, p.first(i), p.stride, IC, acc);
    if (p.odd) one(out, W, Wr.scales, x, r1 - 1, 0, IC, acc);
    return;
  }
  const Q8MultiFn f = vnni ? q8_multi_fn_vnni(n) : q8_multi_fn_avx2(n);
  for (int r = r0; r < r1; r++) f(out, ld_out, W, Wr.scales, x, r, IC, acc);
}

// core/dtype.h's quantize_q8_0_block, 8 values a step, with the same operations: max |x| (exact in
// any order), d = amax / 127, x * (1 / d), truncation and the half step away from zero -- so the same
// bytes (Q8Kernels.QuantizationIsLlamaCppsRule checks it against roundf).  Loading a model quantizes
// every weight: 0.49B values in 2.1 s on 2 threads with the scalar rule.  A non-finite value goes to
// the scalar rule (d NaN).
MOETRON_AVX2 void q8_quantize_block_avx2(const float* x, int8_t* q, float& d) {
  const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  __m256 v[4], m = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  for (int k = 0; k < 4; k++) {
    v[k] = _mm256_loadu_ps(x + 8 * k);
    const __m256 a = _mm256_andnot_ps(sign, v[k]);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));  // inf or NaN
    m = _mm256_max_ps(m, a);
  }
  if (_mm256_movemask_ps(bad)) return quantize_q8_0_block(x, q, d);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);
  d = amax / 127.0f;
  const __m256 id = _mm256_set1_ps(d != 0 ? 1.0f / d : 0.0f), half = _mm256_set1_ps(0.5f),
               mhalf = _mm256_set1_ps(-0.5f);
  __m256i r[4];
  for (int k = 0; k < 4; k++) {
    const __m256 s = _mm256_mul_ps(v[k], id);
    const __m256i t = _mm256_cvttps_epi32(s);
    const __m256 frac = _mm256_sub_ps(s, _mm256_cvtepi32_ps(t));
    const __m256i up = _mm256_castps_si256(_mm256_cmp_ps(frac, half, _CMP_GE_OQ));      // -1 where rounding up
    const __m256i down = _mm256_castps_si256(_mm256_cmp_ps(frac, mhalf, _CMP_LE_OQ));  // -1 where rounding down
    r[k] = _mm256_add_epi32(_mm256_sub_epi32(t, up), down);
  }
  // int32 -> int8 (within [-127, 127]); the packs interleave 128-bit lanes, the permute restores order.
  const __m256i p16a = _mm256_packs_epi32(r[0], r[1]), p16b = _mm256_packs_epi32(r[2], r[3]);
  const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// ---- dispatch ---------------------------------------------------------------------------------------

SimdLevel detect_simd() {
  SimdLevel best = SimdLevel::generic;
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    best = SimdLevel::avx2;
  if (best == SimdLevel::avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    best = SimdLevel::avx512;
#endif
  if (const char* env = std::getenv("MOETRON_SIMD")) {
    const std::string want = env;
    SimdLevel asked = best;
    if (want == "generic") asked = SimdLevel::generic;
    else if (want == "avx2") asked = SimdLevel::avx2;
    else if (want == "avx512") asked = SimdLevel::avx512;
    else fail("MOETRON_SIMD={}: expected generic, avx2 or avx512", want);
    if ((int)asked > (int)best) fail("MOETRON_SIMD={}: this CPU has at most {}", want, simd_name(best));
    best = asked;
  }
  return best;
}

using RowsFn = void (*)(float*, const void*, const float*, const float*, int, int, int, bool);

template <DType DT>
RowsFn rows_for(SimdLevel s) {
  switch (s) {
    case SimdLevel::avx512:
      return rows_avx512<DT>;
    case SimdLevel::avx2:
      return rows_avx2<DT>;
    default:
      return rows_generic<DT>;
  }
}

RowsFn rows_fn(DType dt, SimdLevel s = simd_level()) {
  switch (dt) {
    case DType::F32:
      return rows_for<DType::F32>(s);
    case DType::BF16:
      return rows_for<DType::BF16>(s);
    case DType::F16:
      return rows_for<DType::F16>(s);
    default:
      fail("[infer kernels] weights of dtype {} are not supported (F32, BF16, F16)", dtype_name(dt));
  }
}

// xp: the n inputs permuted (permute_inputs), n * IC floats.
void mrows(float* out, int ld_out, WeightRef W, const float* x, int ld_x, const float* xp, int n, int r0, int r1,
           int IC, bool acc) {
  const SimdLevel level = simd_level();
  switch (W.dtype) {
    case DType::F32:
      return level == SimdLevel::generic
                 ? mrows_generic<DType::F32>(out, ld_out, W.data, x, ld_x, n, r0, r1, IC, acc)
                 : mrows_simd<DType::F32>(level, out, ld_out, W.data, x, ld_x, xp, n, r0, r1, IC, acc);
    case DType::BF16:
      return level == SimdLevel::generic
                 ? mrows_generic<DType::BF16>(out, ld_out, W.data, x, ld_x, n, r0, r1, IC, acc)
                 : mrows_simd<DType::BF16>(level, out, ld_out, W.data, x, ld_x, xp, n, r0, r1, IC, acc);
    case DType::F16:
      return level == SimdLevel::generic
                 ? mrows_generic<DType::F16>(out, ld_out, W.data, x, ld_x, n, r0, r1, IC, acc)
                 : mrows_simd<DType::F16>(level, out, ld_out, W.data, x, ld_x, xp, n, r0, r1, IC, acc);
    default:
      fail("[infer kernels] weights of dtype {} are not supported (F32, BF16, F16)", dtype_name(W.dtype));
  }
}

// The n inputs x + j * ld_x in the lane order of `level` (nothing for the portable kernels), into
// out[n * IC]: once per product, not per block of rows.
void permute_inputs(SimdLevel level, const float* x, int ld_x, int n, int IC, float* out) {
  if (level == SimdLevel::generic) return;
  const int V = level == SimdLevel::avx512 ? 16 : 8;
  for (int j = 0; j < n; j++) permute_x(out + (size_t)j * IC, x + (size_t)j * ld_x, IC / (2 * V), V);
}

}  // namespace

void gemv_rows(float* out, int ld_out, const float* x, int ld_x, WeightRef W, int n, int IC, int OC, bool accumulate,
               long parallel_min_macs) {
  MOETRON_ASSERT(n >= 1 && n <= kMaxGemvInputs);
  GemvTask t{out, W, x, OC, accumulate, n, ld_x, ld_out};
  gemv_batch(&t, 1, IC, parallel_min_macs);
}

SimdLevel simd_level() {
  static const SimdLevel s = detect_simd();  // read-only after the first call
  return s;
}

const char* simd_name(SimdLevel level) {
  switch (level) {
    case SimdLevel::avx512:
      return "avx512";
    case SimdLevel::avx2:
      return "avx2";
    default:
      return "generic";
  }
}

namespace {

// ---- attention over a cache: dot products and weighted sums of short rows ---------------------------
//
// dot's arithmetic: lane k (k < 8) accumulates a[i] b[i] for i = k mod 8 by fma in i order, the lanes
// are summed as ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)), then the tail is added by fma in
// order.  axpy's: y[i] = fma(alpha, x[i], y[i]).  fma rounds once, so the portable code (std::fma)
// and the AVX2 code give the same bits; the AVX2 code runs several keys at once, as a head's 64-value
// rows are too short for one dot product to fill the FMA units.

float dot_generic(const float* a, const float* b, int n) {
  float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; k++) l[k] = std::fma(a[i + k], b[i + k], l[k]);
  float s = ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]));
  for (; i < n; i++) s = std::fma(a[i], b[i], s);
  return s;
}

MOETRON_AVX2 inline float dot_finish(__m256 acc, const float* a, const float* b, int i, int n) {
  const __m128 t = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));  // l0+l4, l1+l5, ...
  const __m128 u = _mm_hadd_ps(t, t);  // (l0+l4)+(l1+l5), (l2+l6)+(l3+l7)
  float s = _mm_cvtss_f32(u) + _mm_cvtss_f32(_mm_shuffle_ps(u, u, 1));
  for (; i < n; i++) s = std::fma(a[i], b[i], s);
  return s;
}

// dot_finish for eight keys' accumulators at once, when n is a multiple of 8 (no tail): the same
// additions, lane-parallel -- t = lo + hi per key (permute2f128 pairs the keys' halves), u = hadd(t),
// s = u0 + u1 (the second hadd) -- then the keys put back in order and scaled, as dot_finish * scale.
MOETRON_AVX2 inline __m256 finish8(const __m256* a, float scale) {
  __m256 t[4];
  for (int p = 0; p < 4; p++)
    t[p] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x20),
                         _mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x31));  // t(a_2p) | t(a_2p+1)
  const __m256 h0 = _mm256_hadd_ps(t[0], t[1]);  // u(a0), u(a2) | u(a1), u(a3)
  const __m256 h1 = _mm256_hadd_ps(t[2], t[3]);  // u(a4), u(a6) | u(a5), u(a7)
  const __m256 s = _mm256_hadd_ps(h0, h1);       // s(a0), s(a2), s(a4), s(a6) | s(a1), s(a3), s(a5), s(a7)
  return _mm256_mul_ps(_mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)), _mm256_set1_ps(scale));
}

// s[j] = scale * dot(q, k + j * ld) for j < count: eight keys at a time where n has no tail (a head's
// 64 or 128 values: the horizontal sums, one per key, were most of the work), then four, then one.
MOETRON_AVX2 void dot_rows_avx2(float* s, const float* q, const float* k, size_t ld, int count, int n, float scale) {
  const int n8 = n & ~7;
  int j = 0;
  if (n8 == n)
    for (; j + 8 <= count; j += 8) {
      const float* k0 = k + (size_t)j * ld;
      __m256 a[8];
      for (int t = 0; t < 8; t++) a[t] = _mm256_setzero_ps();
      for (int i = 0; i < n8; i += 8) {
        const __m256 x = _mm256_loadu_ps(q + i);
        for (int t = 0; t < 8; t++) a[t] = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + (size_t)t * ld + i), a[t]);
      }
      _mm256_storeu_ps(s + j, finish8(a, scale));
    }
  for (; j + 4 <= count; j += 4) {
    const float* k0 = k + (size_t)j * ld;
    const float *k1 = k0 + ld, *k2 = k1 + ld, *k3 = k2 + ld;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int i = 0; i < n8; i += 8) {
      const __m256 x = _mm256_loadu_ps(q + i);
      a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + i), a0);
      a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k1 + i), a1);
      a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k2 + i), a2);
      a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k3 + i), a3);
    }
    s[j] = dot_finish(a0, q, k0, n8, n) * scale;
    s[j + 1] = dot_finish(a1, q, k1, n8, n) * scale;
    s[j + 2] = dot_finish(a2, q, k2, n8, n) * scale;
    s[j + 3] = dot_finish(a3, q, k3, n8, n) * scale;
  }
  for (; j < count; j++) {
    const float* kj = k + (size_t)j * ld;
    __m256 a0 = _mm256_setzero_ps();
    for (int i = 0; i < n8; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(kj + i), a0);
    s[j] = dot_finish(a0, q, kj, n8, n) * scale;
  }
}

// o[c, c + 8M) += sum_j w[j] (v + j * ld)[c, c + 8M), j in order, o held in M registers: M independent
// fma chains per key, so the keys go at the FMA units' rate rather than one chain's latency.
template <int M>
MOETRON_AVX2 inline void axpy_block_avx2(float* o, const float* w, const float* v, size_t ld, int count) {
  __m256 r[M];
  for (int t = 0; t < M; t++) r[t] = _mm256_loadu_ps(o + 8 * t);
  for (int j = 0; j < count; j++) {
    const __m256 wj = _mm256_set1_ps(w[j]);
    const float* vj = v + (size_t)j * ld;
    for (int t = 0; t < M; t++) r[t] = _mm256_fmadd_ps(wj, _mm256_loadu_ps(vj + 8 * t), r[t]);
  }
  for (int t = 0; t < M; t++) _mm256_storeu_ps(o + 8 * t, r[t]);
}

// o[n] += sum_j w[j] (v + j * ld), j in order: 64 values at a time, then the rest of the multiples of 8
// in one pass (a head of 32 values: 4 chains, not 4 passes of one; prefill attention of the small
// model, one thread, 2-core Zen 4 EPYC VM: 1.45 -> 1.28 ms a prefill of 128 tokens), then a scalar tail.
MOETRON_AVX2 void axpy_rows_avx2(float* o, const float* w, const float* v, size_t ld, int count, int n) {
  using Block = void (*)(float*, const float*, const float*, size_t, int);
  static constexpr Block kBlocks[8] = {nullptr,           axpy_block_avx2<1>, axpy_block_avx2<2>, axpy_block_avx2<3>,
                                       axpy_block_avx2<4>, axpy_block_avx2<5>, axpy_block_avx2<6>, axpy_block_avx2<7>};
  int c = 0;
  for (; c + 64 <= n; c += 64) axpy_block_avx2<8>(o + c, w, v + c, ld, count);
  if ((n - c) / 8 > 0) kBlocks[(n - c) / 8](o + c, w, v + c, ld, count);
  c += (n - c) / 8 * 8;
  for (; c < n; c++)
    for (int j = 0; j < count; j++) o[c] = std::fma(w[j], v[(size_t)j * ld + c], o[c]);
}

// axpy_rows for two outputs over the same rows v (two heads of one kv head): o0 += sum_j w0[j] v_j and
// o1 += sum_j w1[j] v_j, each value's fmas in key order, bitwise the two calls; each v_j load serves
// both, and the chains of the two run side by side, 32 values (8 chains) at a time.
template <int M>
MOETRON_AVX2 inline void axpy2_block_avx2(float* o0, float* o1, const float* w0, const float* w1, const float* v,
                                          size_t ld, int count) {
  __m256 r0[M], r1[M];
  for (int t = 0; t < M; t++) {
    r0[t] = _mm256_loadu_ps(o0 + 8 * t);
    r1[t] = _mm256_loadu_ps(o1 + 8 * t);
  }
  for (int j = 0; j < count; j++) {
    const __m256 a = _mm256_set1_ps(w0[j]), b = _mm256_set1_ps(w1[j]);
    const float* vj = v + (size_t)j * ld;
    for (int t = 0; t < M; t++) {
      const __m256 x = _mm256_loadu_ps(vj + 8 * t);
      r0[t] = _mm256_fmadd_ps(a, x, r0[t]);
      r1[t] = _mm256_fmadd_ps(b, x, r1[t]);
    }
  }
  for (int t = 0; t < M; t++) {
    _mm256_storeu_ps(o0 + 8 * t, r0[t]);
    _mm256_storeu_ps(o1 + 8 * t, r1[t]);
  }
}

MOETRON_AVX2 void axpy_rows2_avx2(float* o0, float* o1, const float* w0, const float* w1, const float* v, size_t ld,
                                  int count, int n) {
  using Block = void (*)(float*, float*, const float*, const float*, const float*, size_t, int);
  static constexpr Block kBlocks[4] = {nullptr, axpy2_block_avx2<1>, axpy2_block_avx2<2>, axpy2_block_avx2<3>};
  int c = 0;
  for (; c + 32 <= n; c += 32) axpy2_block_avx2<4>(o0 + c, o1 + c, w0, w1, v + c, ld, count);
  if ((n - c) / 8 > 0) kBlocks[(n - c) / 8](o0 + c, o1 + c, w0, w1, v + c, ld, count);
  c += (n - c) / 8 * 8;
  for (; c < n; c++)
    for (int j = 0; j < count; j++) {
      o0[c] = std::fma(w0[j], v[(size_t)j * ld + c], o0[c]);
      o1[c] = std::fma(w1[j], v[(size_t)j * ld + c], o1[c]);
    }
}

// ---- argmax ------------------------------------------------------------------------------------------
//
// Two passes over x: the largest value m (and whether any value is NaN), then the first index holding
// a value equal to m.  Equal is ==, so -0 and +0 are one value, as for std::max_element's <.

// The largest of x[0, n) and whether x holds a NaN; lane-wise maxima, so the order of the values
// does not matter (max of finite floats is exact).
MOETRON_AVX2 float max_avx2(const float* x, int n, bool& nan) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 bad = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    m = _mm256_max_ps(m, v);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, m);
  float best = lanes[0];
  for (int k = 1; k < 8; k++) best = std::max(best, lanes[k]);
  nan = _mm256_movemask_ps(bad) != 0;
  for (; i < n; i++) {
    nan = nan || std::isnan(x[i]);
    best = std::max(best, x[i]);
  }
  return best;
}

MOETRON_AVX2 int first_equal_avx2(const float* x, int n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  int i = 0;
  for (; i + 8 <= n; i += 8)
    if (const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), mv, _CMP_EQ_OQ)))
      return i + __builtin_ctz((unsigned)hit);
  for (; i < n; i++)
    if (x[i] == m) return i;
  return n;  // not reached: m is one of the values
}

}  // namespace

float dot(const float* a, const float* b, int n) {
  if (simd_level() == SimdLevel::generic) return dot_generic(a, b, n);
  float s;
  dot_rows_avx2(&s, a, b, 0, 1, n, 1.0f);
  return s;
}

void axpy(float* y, float alpha, const float* x, int n) {
  if (simd_level() == SimdLevel::generic) {
    for (int i = 0; i < n; i++) y[i] = std::fma(alpha, x[i], y[i]);
    return;
  }
  axpy_rows_avx2(y, &alpha, x, 0, 1, n);
}

// Into L2 (prefetcht1): attention's blocks of 16 cached rows are up to 32 KiB, an L1's worth (0.49B
// bf16 decode, one thread, 2-core Zen 4 EPYC VM, 3 alternating runs: attention 0.569 -> 0.524 ms a
// step; 8 sequences together 250.5 and 248.5 tokens/s).
void prefetch_rows(const float* p, size_t ld, int count, int n) {
  for (int j = 0; j < count; j++) {
    const char* r = reinterpret_cast<const char*>(p + (size_t)j * ld);
    for (size_t b = 0; b < sizeof(float) * (size_t)n; b += 64) _mm_prefetch(r + b, _MM_HINT_T1);
  }
}

int argmax_at(SimdLevel level, const float* x, int n) {
  MOETRON_ASSERT(n >= 1);
  if ((int)level > (int)simd_level())
    fail("[infer kernels] {} kernels asked for; this CPU (or MOETRON_SIMD) allows {}", simd_name(level),
         simd_name(simd_level()));
  if (level != SimdLevel::generic) {
    bool nan = false;
    const float m = max_avx2(x, n, nan);
    if (!nan) return first_equal_avx2(x, n, m);
  }
  return (int)(std::max_element(x, x + n) - x);  // NaNs: its order of comparisons decides
}

int argmax(const float* x, int n) { return argmax_at(simd_level(), x, n); }

void dot_rows(float* s, const float* q, const float* k, size_t ld, int count, int n, float scale) {
  if (simd_level() != SimdLevel::generic) return dot_rows_avx2(s, q, k, ld, count, n, scale);
  for (int j = 0; j < count; j++) s[j] = dot_generic(q, k + (size_t)j * ld, n) * scale;
}

void axpy_rows(float* o, const float* w, const float* v, size_t ld, int count, int n) {
  if (simd_level() != SimdLevel::generic) return axpy_rows_avx2(o, w, v, ld, count, n);
  for (int j = 0; j < count; j++) axpy(o, w[j], v + (size_t)j * ld, n);
}

void axpy_rows2(float* o0, float* o1, const float* w0, const float* w1, const float* v, size_t ld, int count, int n) {
  if (simd_level() != SimdLevel::generic) return axpy_rows2_avx2(o0, o1, w0, w1, v, ld, count, n);
  axpy_rows(o0, w0, v, ld, count, n);
  axpy_rows(o1, w1, v, ld, count, n);
}

void gemv(float* y, WeightRef W, const float* x, int OC, int IC, bool accumulate) {
  const GemvTask t{y, W, x, OC, accumulate};
  gemv_batch(&t, 1, IC);
}

void gemv_at(SimdLevel level, float* y, WeightRef W, const float* x, int OC, int IC) {
  if ((int)level > (int)simd_level())
    fail("[infer kernels] {} kernels asked for; this CPU (or MOETRON_SIMD) allows {}", simd_name(level),
         simd_name(simd_level()));
  if (W.q8()) {
    MOETRON_ASSERT(IC % kQ8Block == 0);
    std::vector<uint8_t> xq(q8_input_bytes(1, IC));
    q8_quantize_inputs(x, IC, 1, IC, xq.data());
    q8_rows(level, y, 0, W, q8_view(xq.data(), 1, IC), 1, 0, OC, IC, false);
    return;
  }
  std::vector<float> xp((size_t)IC);
  permute_inputs(level, x, 0, 1, IC, xp.data());
  rows_fn(W.dtype, level)(y, W.data, x, xp.data(), 0, OC, IC, false);
}

namespace {

// Rows in a piece of a matrix that one task reads alone: about kPieceBytes of weights (Q8_0: with
// its scales), with several threads at most a quarter of the matrix (each thread gets pieces), in
// multiples of 64 rows.  A piece's row pairs lie half the piece apart (RowPairs): two long runs.  A
// block that several tasks of one matrix run on while it is in cache is 64 rows.  Each row's
// arithmetic is the same in any piece.
constexpr size_t kPieceBytes = 2u << 20;

int piece_rows_for(int OC, size_t row_bytes, bool parallel) {
  int rows = (int)std::min<size_t>((size_t)OC, std::max<size_t>(64, kPieceBytes / std::max<size_t>(1, row_bytes)));
  if (parallel) rows = std::min(rows, (OC + 3) / 4);
  return std::max(64, (rows + 63) / 64 * 64);
}

}  // namespace

void gemv_batch(const GemvTask* tasks, int n_tasks, int IC, long parallel_min_macs) {
  MOETRON_ASSERT(n_tasks >= 0 && n_tasks <= kMaxGemvTasks);
  // Consecutive tasks of the same matrix (more than kMaxGemvInputs rows, split by the caller) form a
  // group, and a piece of a group's rows is one piece of work (piece_rows_for): a group of several
  // tasks runs them all on a block of 64 rows while it is in cache, so the matrix is read from memory
  // once, not once per task (a pass of 16 sequences, or a prefill of 120 prompt rows, has 2 or 15
  // tasks per matrix).  Each row's arithmetic is the same whoever runs it.
  int group_first[kMaxGemvTasks + 1];  // group g: tasks [group_first[g], group_first[g + 1])
  int first_block[kMaxGemvTasks + 1];  // pieces of rows, numbered across the groups
  int piece_rows[kMaxGemvTasks];       // group g's pieces: piece_rows[g] rows each (the last may be shorter)
  RowsFn fn[kMaxGemvTasks];
  size_t xp_at[kMaxGemvTasks + 1];  // each task's permuted inputs in xp (fp32, bf16, f16 weights)
  size_t xq_at[kMaxGemvTasks + 1];  // each task's quantized inputs in xq (Q8_0 weights)
  long macs = 0;
  int groups = 0;
  first_block[0] = 0;
  xp_at[0] = xq_at[0] = 0;
  const SimdLevel level = simd_level();
  for (int t = 0; t < n_tasks; t++) {
    const GemvTask& k = tasks[t];
    MOETRON_ASSERT(k.n >= 1 && k.n <= kMaxGemvInputs);
    MOETRON_ASSERT(!k.W.q8() || IC % kQ8Block == 0);
    const bool joins = t > 0 && k.W.data == tasks[t - 1].W.data && k.W.dtype == tasks[t - 1].W.dtype &&
                       k.W.scales == tasks[t - 1].W.scales && k.OC == tasks[t - 1].OC;
    if (!joins) group_first[groups++] = t;
    macs += (long)k.OC * IC * k.n;
    fn[t] = k.W.q8() ? nullptr : rows_fn(k.W.dtype);
    xp_at[t + 1] = xp_at[t] + (k.W.q8() || level == SimdLevel::generic ? 0 : (size_t)k.n * IC);
    xq_at[t + 1] = xq_at[t] + (k.W.q8() ? q8_input_bytes(k.n, IC) : 0);
  }
  group_first[groups] = n_tasks;
  const bool parallel = macs >= parallel_min_macs && omp_get_max_threads() > 1;
  bool small_pieces = true;
  for (int g = 0; g < groups; g++) {
    const GemvTask& k = tasks[group_first[g]];
    const bool shared = group_first[g + 1] - group_first[g] > 1;
    const size_t row_bytes =
        k.W.q8() ? (size_t)IC + IC / kQ8Block * sizeof(uint16_t) : (size_t)IC * vbytes_of(k.W.dtype);
    piece_rows[g] = shared ? 64 : piece_rows_for(k.OC, row_bytes, parallel);
    first_block[g + 1] = first_block[g] + (k.OC + piece_rows[g] - 1) / piece_rows[g];
    small_pieces = small_pieces && piece_rows[g] == 64;
  }
  LineVector<float> xp(xp_at[n_tasks]);
  LineVector<uint8_t> xq(xq_at[n_tasks]);  // offsets are multiples of 64 bytes (IC % 32 == 0): lines aligned
  for (int t = 0; t < n_tasks; t++) {
    const GemvTask& k = tasks[t];
    if (k.W.q8())
      q8_quantize_inputs(k.x, k.n == 1 ? IC : k.ld_x, k.n, IC, xq.data() + xq_at[t]);
    else if (xp_at[t + 1] > xp_at[t])
      permute_inputs(level, k.x, k.ld_x, k.n, IC, xp.data() + xp_at[t]);
  }
  // 64-row pieces of one task each run two at a time (fewer scheduling points); others one at a time.
  const int chunk = groups == n_tasks && small_pieces ? 2 : 1;
#pragma omp parallel for schedule(dynamic, chunk) if (parallel)
  for (int b = 0; b < first_block[groups]; b++) {
    int g = 0;
    while (b >= first_block[g + 1]) g++;
    for (int t = group_first[g]; t < group_first[g + 1]; t++) {
      const GemvTask& k = tasks[t];
      const int r0 = (b - first_block[g]) * piece_rows[g], r1 = std::min(r0 + piece_rows[g], k.OC);
      if (k.W.q8()) {
        q8_rows(level, k.y, k.ld_y, k.W, q8_view(xq.data() + xq_at[t], k.n, IC), k.n, r0, r1, IC, k.accumulate);
        continue;
      }
      const float* kxp = xp_at[t + 1] > xp_at[t] ? xp.data() + xp_at[t] : nullptr;
      if (k.n == 1)
        fn[t](k.y, k.W.data, k.x, kxp, r0, r1, IC, k.accumulate);
      else
        mrows(k.y, k.ld_y, k.W, k.x, k.ld_x, kxp, k.n, r0, r1, IC, k.accumulate);
    }
  }
}

bool quantize_q8_0(WeightRef W, size_t rows, int IC, int8_t* q, uint16_t* d) {
  MOETRON_ASSERT(IC % kQ8Block == 0 && !W.q8());
  const int nb = IC / kQ8Block;
  const bool simd = simd_level() != SimdLevel::generic;
  bool ok = true;
#pragma omp parallel reduction(&& : ok)
  {
    std::vector<float> row((size_t)IC);
#pragma omp for schedule(static)
    for (size_t r = 0; r < rows; r++) {
      widen_row(row.data(), W, r, IC);
      for (int b = 0; b < nb; b++) {
        float s;
        const float* x = row.data() + (size_t)b * kQ8Block;
        int8_t* qb = q + r * IC + (size_t)b * kQ8Block;
        if (simd)
          q8_quantize_block_avx2(x, qb, s);
        else
          quantize_q8_0_block(x, qb, s);
        ok = ok && s <= 65504.0f;  // NaN (non-finite weights) fails too
        d[r * nb + b] = f32_to_f16(s);
      }
    }
  }
  return ok;
}

void widen_rows(float* out, const WeightRef& W, size_t row, int rows, int n) {
  const size_t base = row * (size_t)n, count = (size_t)rows * n;  // the rows lie contiguously
  if (W.q8()) {  // rows are whole blocks
    const int8_t* q = static_cast<const int8_t*>(W.data) + base;
    const uint16_t* d = W.scales + base / kQ8Block;
    for (size_t b = 0; b < count / kQ8Block; b++) {
      const float s = f16_at(d, b);
      for (int i = 0; i < kQ8Block; i++) out[b * kQ8Block + i] = (float)q[b * kQ8Block + i] * s;
    }
    return;
  }
  switch (W.dtype) {
    case DType::F32:
      std::memcpy(out, static_cast<const float*>(W.data) + base, sizeof(float) * count);
      return;
    case DType::BF16: {  // a plain shift per value, which the compiler vectorises
      const uint8_t* p = static_cast<const uint8_t*>(W.data) + base * 2;
      for (size_t i = 0; i < count; i++) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out[i] = bf16_to_f32(h);
      }
      return;
    }
    case DType::F16: {
      const uint16_t* p = static_cast<const uint16_t*>(W.data) + base;
      for (size_t i = 0; i < count; i++) out[i] = load_scalar(p + i, 0, W.dtype);
      return;
    }
    default:
      fail("[infer kernels] weights of dtype {} are not supported (F32, BF16, F16)", dtype_name(W.dtype));
  }
}

void widen_row(float* out, WeightRef W, size_t row, int n) { widen_rows(out, W, row, 1, n); }

void matmul(float* out, int ld_out, const float* x, int ld_x, WeightRef W, int n, int IC, int OC, bool accumulate,
            std::vector<float>& scratch) {
  // Up to kMaxGemvInputs rows: the matrix-vector kernels, W streamed once for all of them (beats
  // widening W for a GEMM of so few rows).
  if (n <= kMaxGemvInputs) {
    gemv_rows(out, ld_out, x, ld_x, W, n, IC, OC, accumulate, omp_get_max_threads() > 1 ? kGemvSplitMin : kGemvParallelMin);
    return;
  }
  // More: one GEMM (gemm.h), which widens a few weight rows at a time per thread; fp32 weights are
  // used where they lie, with the same sums.
  gemm_nt(out, ld_out, x, ld_x, W, IC, n, IC, OC, 1.0f, accumulate, scratch);
}

}  // namespace moetron::infer
