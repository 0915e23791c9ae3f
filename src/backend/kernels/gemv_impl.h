// What the matrix-vector kernels share across their files (internal to backend/kernels: gemv*.cpp,
// q8*.cpp): how weight rows are read -- in pairs, with prefetches whose distances and AMD/Intel rules
// were measured per kernel -- the lane order of the SIMD main loops, stored values read one at a time,
// and each instruction set's entry points.
//
// Each SIMD level is compiled with a target attribute (targets.h: whatever the build's -march) and
// chosen at run time.  Per row: two accumulators over the columns in steps of 2 vectors (in the lane
// order described below), then one vector, then a scalar tail, then one fixed-order horizontal sum --
// the same operations whether the row is computed alone or in a block of two (blocks share the loads of
// x), so a row's result depends only on its values.  Weight rows are prefetched kPrefetch values ahead:
// a matrix-vector product streams the weights once, and the hardware prefetchers alone left a core at
// ~60% of its read bandwidth here.  Measured on the 0.49B model, one thread, bf16 (2-core
// Sapphire-Rapids-class VM): 4-row blocks, 512 ahead 33.4 tokens/s; 2-row, 1024 ahead 34.5; 2-row, 2048
// ahead 39.5; 4096 ahead the same; 4-row, 2048 ahead 34.6 (AVX2: 4-row 33.0, 2-row 36.9); and see
// kPrefetch for an AMD EPYC.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "backend/kernels/gemv.h"
#include "backend/kernels/simd.h"
#include "backend/kernels/targets.h"
#include "core/dtype.h"

namespace moetron::kernels {

// ---- prefetches -----------------------------------------------------------------------------------

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

// A one-input kernel's prefetch for rows of row_bytes, which are paired apart from apart_bytes on
// (RowPairs): on AMD none for rows paired apart and `near` for neighbours; elsewhere into L1.
inline Prefetch one_input_prefetch(size_t row_bytes, size_t apart_bytes, Prefetch near) {
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
inline Prefetch multi_prefetch(int g, int IC) {
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
inline int multi_block_pairs(int n, int g, int IC) {
  return n > g && amd_cpu() && (long)n * IC >= kMultiBlockFloats ? kMultiBlockPairs : 1;
}
// The AVX-512 products of several inputs: 2 KiB of bf16.  They compute longer per byte, so a nearer
// prefetch is still in time, and it keeps fewer lines in flight beside the rows being read: 8
// sequences decoded together (0.49B bf16, 2-core Xeon VM, 4 alternating rounds, tokens/s): 8 KiB
// ahead 216, 4 KiB 221, 2 KiB 224, 1 KiB 215; 16 KiB was slower than 8.
constexpr int kMultiPrefetch = 1024;

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

// ---- stored values one at a time ------------------------------------------------------------------

inline float load_scalar(const uint16_t* p, int c, DType dt) {
  uint16_t h;
  std::memcpy(&h, p + c, sizeof h);
  return dt == DType::BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

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

// Element i of a Q8_0 matrix's scales (f16) as fp32.
inline float f16_at(const uint16_t* s, size_t i) {
  uint16_t h;
  std::memcpy(&h, s + i, sizeof h);
  return f16_to_f32(h);
}

// ---- the lane order of the main loop --------------------------------------------------------------
//
// bf16 widens to fp32 by interleaving zero halves below it (unpacklo/hi_epi16 with zero): one load
// and two shuffles per 2 vectors instead of 2 loads, 2 zero-extensions and 2 shifts -- enough to keep
// a core at its read bandwidth.  Interleaving works within 128-bit lanes, so each block of 2V
// columns (V = 8 for AVX2, 16 for AVX-512) lands in the accumulators in the order
//   lo = {c0..3, c8..11, c16..19, ...},  hi = {c4..7, c12..15, ...}   (per 8 columns: 4 in lo, 4 in hi)
// x is permuted the same way once per call (permute_x, gemv.cpp), and fp32 and f16 weights are
// permuted into the same lanes (so all three dtypes do the same arithmetic on the same values:
// bitwise equal).

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

// ---- each level's kernels -------------------------------------------------------------------------

// Rows [r0, r1) of W (stored as DT) against one input x; xp: x in the level's lane order (unused by
// the portable kernels).
using RowsKernel = void(float*, const void*, const float*, const float*, int, int, int, bool);
using RowsFn = RowsKernel*;
// Rows [r0, r1) of W against n <= kMaxGemvInputs inputs, each weight row read once.
using MultiFn = void (*)(float*, int, const void*, const float*, int, const float*, int, int, int, bool);

// The portable kernels (gemv_generic.cpp): y[r] and, for n inputs, out_j[r] = out[j * ld_out + r].
template <DType DT>
void rows_generic(float* y, const void* W, const float* x, const float* xp, int r0, int r1, int IC, bool acc);
template <DType DT>
void mrows_generic(float* out, int ld_out, const void* W, const float* x, int ld_x, int n, int r0, int r1, int IC,
                   bool acc);
// AVX2 (gemv_avx2.cpp) and AVX-512 (gemv_avx512.cpp): one input, and the products of n inputs.
template <DType DT>
MOETRON_AVX2 void rows_avx2(float* y, const void* W, const float* x, const float* xp, int r0, int r1, int IC,
                            bool acc);
template <DType DT>
MultiFn multi_fn_avx2(int n);
template <DType DT>
MOETRON_AVX512 void rows_avx512(float* y, const void* W, const float* x, const float* xp, int r0, int r1, int IC,
                                bool acc);
template <DType DT>
MultiFn multi_fn_avx512(int n);

// A level's multi_fn: the products of n = 1..kMaxGemvInputs inputs, FN<DT, n>.
#define MOETRON_MULTI_TABLE(NAME, FN)                                                                          \
  template <DType DT>                                                                                          \
  MultiFn NAME(int n) {                                                                                        \
    static constexpr MultiFn t[kMaxGemvInputs] = {FN<DT, 1>, FN<DT, 2>, FN<DT, 3>, FN<DT, 4>,                \
                                                  FN<DT, 5>, FN<DT, 6>, FN<DT, 7>, FN<DT, 8>};               \
    return t[n - 1];                                                                                           \
  }

}  // namespace moetron::kernels
