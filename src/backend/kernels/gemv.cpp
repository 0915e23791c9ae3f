// The matrix-vector products (gemv.h): a batch's tasks grouped by matrix and cut in pieces of rows for
// the OpenMP threads, each product's inputs permuted (or quantized) once, and each piece sent to the
// kernels of the CPU's level (gemv_generic.cpp, gemv_avx2.cpp, gemv_avx512.cpp; Q8_0: q8.cpp); weights
// widened to fp32; matmul, which gives more rows to the prefill GEMM (gemm.h).
#include "backend/kernels/gemv.h"

#include <omp.h>

#include <algorithm>
#include <cstring>

#include "backend/kernels/gemm.h"
#include "backend/kernels/gemv_impl.h"
#include "backend/kernels/q8_impl.h"
#include "core/error.h"
#include "core/line_vector.h"

namespace moetron::kernels {

namespace {

// xp[0, 2V*blocks) = x in the lane order (gemv_impl.h), for blocks of 2V columns.
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
      fail("[kernels] weights of dtype {} are not supported (F32, BF16, F16)", dtype_name(dt));
  }
}

template <DType DT>
void mrows_simd(SimdLevel level, float* out, int ld_out, const void* W, const float* x, int ld_x, const float* xp, int n,
                int r0, int r1, int IC, bool acc) {
  const MultiFn f = level == SimdLevel::avx512 ? multi_fn_avx512<DT>(n) : multi_fn_avx2<DT>(n);
  f(out, ld_out, W, x, ld_x, xp, r0, r1, IC, acc);
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
      fail("[kernels] weights of dtype {} are not supported (F32, BF16, F16)", dtype_name(W.dtype));
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

void gemv(float* y, WeightRef W, const float* x, int OC, int IC, bool accumulate) {
  const GemvTask t{y, W, x, OC, accumulate};
  gemv_batch(&t, 1, IC);
}

void gemv_at(SimdLevel level, float* y, WeightRef W, const float* x, int OC, int IC) {
  check_simd_level(level);
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
      fail("[kernels] weights of dtype {} are not supported (F32, BF16, F16)", dtype_name(W.dtype));
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

}  // namespace moetron::kernels
