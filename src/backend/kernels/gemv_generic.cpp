// The portable matrix-vector kernels (any CPU, and MOETRON_SIMD=generic): per row four fp32 sums over
// the columns in turn, then the tail, in a fixed order (gemv_impl.h's entry points).
#include "backend/kernels/gemv_impl.h"

namespace moetron::kernels {

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

template <DType DT>
void mrows_generic(float* out, int ld_out, const void* W, const float* x, int ld_x, int n, int r0, int r1, int IC,
                   bool acc) {
  for (int r = r0; r < r1; r++)
    for (int j = 0; j < n; j++) {
      float* o = out + (size_t)j * ld_out;
      rows_generic<DT>(o, W, x + (size_t)j * ld_x, nullptr, r, r + 1, IC, acc);
    }
}

// The stored types the kernels read.
template RowsKernel rows_generic<DType::F32>;
template RowsKernel rows_generic<DType::BF16>;
template RowsKernel rows_generic<DType::F16>;
template void mrows_generic<DType::F32>(float*, int, const void*, const float*, int, int, int, int, int, bool);
template void mrows_generic<DType::BF16>(float*, int, const void*, const float*, int, int, int, int, int, bool);
template void mrows_generic<DType::F16>(float*, int, const void*, const float*, int, int, int, int, int, bool);

}  // namespace moetron::kernels
