// The prefill GEMM (gemm.h): the tiling loop of the level asked for (gemm_impl.h; gemm_generic.cpp,
// gemm_avx2.cpp, gemm_avx512.cpp), on the caller's threads when the product is large enough.
#include "backend/kernels/gemm.h"

#include <omp.h>

#include "backend/kernels/gemm_impl.h"
#include "core/error.h"

namespace moetron::kernels {

namespace {

// Multiply-adds from which the weight rows are split across threads: 2M, the decoder's own threshold
// (a fork/join may cost a scheduler time slice when the cores are shared; at 256K the prefill router's
// product forked every layer, and test_infer_q8 at two SIMD levels side by side took 45 s instead of 20).
constexpr long kParallelMin = 1L << 21;

}  // namespace

void gemm_nt_at(SimdLevel level, float* out, int ld_out, const float* x, int ld_x, WeightRef W, int ld_w, int n,
                int IC, int OC, float alpha, bool accumulate, std::vector<float>& scratch) {
  if (n <= 0 || OC <= 0) return;
  MOETRON_ASSERT((W.dtype == DType::F32 && !W.q8()) || ld_w == IC);
  const bool parallel = !omp_in_parallel() && omp_get_max_threads() > 1 && (long)n * IC * OC >= kParallelMin;
  switch (level) {
    case SimdLevel::avx512:
      return gemm_run_avx512(out, ld_out, x, ld_x, W, ld_w, n, IC, OC, alpha, accumulate, scratch, parallel);
    case SimdLevel::avx2:
      return gemm_run_avx2(out, ld_out, x, ld_x, W, ld_w, n, IC, OC, alpha, accumulate, scratch, parallel);
    case SimdLevel::generic:
      break;
  }
  gemm_run_generic(out, ld_out, x, ld_x, W, ld_w, n, IC, OC, alpha, accumulate, scratch, parallel);
}

void gemm_nt(float* out, int ld_out, const float* x, int ld_x, WeightRef W, int ld_w, int n, int IC, int OC,
             float alpha, bool accumulate, std::vector<float>& scratch) {
  gemm_nt_at(simd_level(), out, ld_out, x, ld_x, W, ld_w, n, IC, OC, alpha, accumulate, scratch);
}

}  // namespace moetron::kernels
