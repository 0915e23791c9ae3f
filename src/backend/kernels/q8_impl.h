// The Q8_0 products' internals (q8.cpp, q8_avx2.cpp, q8_vnni.cpp; internal to backend/kernels): the
// arithmetic every level does, a product's inputs in Q8_0, each level's kernels, and q8_rows, which
// gives rows to the kernels of a level.  Rows are read as gemv_impl.h says (pairs, prefetches).
#pragma once

#include <cstddef>
#include <cstdint>

#include "backend/kernels/gemv_impl.h"
#include "backend/kernels/q8.h"

namespace moetron::kernels {

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
inline size_t q8_input_bytes(int n, int IC) {
  return (size_t)n * IC * 2 + (size_t)n * (IC / kQ8Block) * sizeof(float) + (size_t)n * (IC / 4) * sizeof(int32_t);
}

inline Q8Inputs q8_view(const uint8_t* buf, int n, int IC) {
  const size_t at_d = (size_t)n * IC * 2, at_off = at_d + (size_t)n * (IC / kQ8Block) * sizeof(float);
  return {reinterpret_cast<const int8_t*>(buf), buf + (size_t)n * IC, reinterpret_cast<const float*>(buf + at_d),
          reinterpret_cast<const int32_t*>(buf + at_off)};
}

// The n inputs x + j * ld_x in Q8_0 into buf (q8_input_bytes(n, IC)).
void q8_quantize_inputs(const float* x, int ld_x, int n, int IC, uint8_t* buf);

// Each level's kernels: R rows r + k * stride against input 0 (q8_block_*), and one row r against N
// inputs (a Q8MultiFn, from q8_multi_fn_*(N)).
using Q8BlockKernel = void(float*, const int8_t*, const uint16_t*, const Q8Inputs&, int, int, int, bool);
using Q8MultiFn = void (*)(float*, int, const int8_t*, const uint16_t*, const Q8Inputs&, int, int, bool);
// The portable code (q8.cpp): rows [r0, r1) against n inputs.
void q8_rows_generic(float* out, int ld_out, const int8_t* W, const uint16_t* S, const Q8Inputs& x, int n, int r0,
                     int r1, int IC, bool acc);
// AVX2 (q8_avx2.cpp).
template <int R>
MOETRON_AVX2 void q8_block_avx2(float* y, const int8_t* W, const uint16_t* S, const Q8Inputs& x, int r, int stride,
                                int IC, bool acc);
Q8MultiFn q8_multi_fn_avx2(int n);
// AVX-512 VNNI (q8_vnni.cpp); PF: the rows' prefetch (one_input_prefetch).
template <int R, Prefetch PF>
MOETRON_VNNI void q8_block_vnni(float* y, const int8_t* W, const uint16_t* S, const Q8Inputs& x, int r, int stride,
                                int IC, bool acc);
Q8MultiFn q8_multi_fn_vnni(int n);

// Rows [r0, r1) of a Q8_0 matrix against n inputs (q8_quantize_inputs), out_j = out + j * ld_out.
// Inline, so that gemv_batch's piece loop holds it, as when they shared a file: it calls a kernel per
// row pair, and out of line (gemv.cpp calling into q8.cpp) its loop kept more on the stack -- the small
// model's Q8_0 head (32000 rows of 256) took 7.6% longer a decode step, its experts 4.9% (bench
// generate --profile, one thread, 2-core Zen 5 EPYC VM, 8 alternating rounds; inline: 0.9%, 1.2%).
inline void q8_rows(SimdLevel level, float* out, int ld_out, WeightRef Wr, const Q8Inputs& x, int n, int r0, int r1,
                    int IC, bool acc) {
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

}  // namespace moetron::kernels
