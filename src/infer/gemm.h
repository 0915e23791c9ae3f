// The fp32 GEMM of inference's prefill: activations [n, IC] against a weight-layout matrix [OC, IC]
// (HF nn.Linear), written here so that inference needs no BLAS library (OpenBLAS's image, its
// Fortran runtime and its buffers are ~2.7 MiB resident: more than a small model's 15% budget).
//
// Contract: out[t, r] (row stride ld_out) = alpha * s, or out[t, r] + alpha * s when accumulate, where
// s = fma(x[t, IC-1], W[r, IC-1], ... fma(x[t, 1], W[r, 1], fma(x[t, 0], W[r, 0], 0))) -- one fma chain
// in column order -- so every result is bitwise the same at every SIMD level and thread count.
//
// Kernels: x is packed once per call into tiles of T rows ([IC][T], zero-padded: T = 32 with AVX-512,
// 16 with AVX2), then each tile meets 6 weight rows at a time (12 vector accumulators; per column 2
// vector loads of x and 6 broadcasts of W for 12 FMAs).  Threads split the weight rows.
#pragma once

#include <cstddef>

#include "infer/kernels.h"

namespace moetron::infer {

// Floats of scratch gemm_nt needs for n rows of IC values (at any level).
size_t gemm_pack_floats(int n, int IC);

// See above.  x and W are read only; pack: gemm_pack_floats(n, IC) floats of scratch (one per thread
// when called from several threads).  OpenMP threads (the caller's omp_get_max_threads()) split W's
// rows when the product is large enough; inside a parallel region it runs on the calling thread.
void gemm_nt(float* out, int ld_out, const float* x, int ld_x, const float* W, int ld_w, int n, int IC, int OC,
             float alpha, bool accumulate, float* pack);

// The same with the kernels of `level` (at most simd_level()), for tests and benchmarks.
void gemm_nt_at(SimdLevel level, float* out, int ld_out, const float* x, int ld_x, const float* W, int ld_w, int n,
                int IC, int OC, float alpha, bool accumulate, float* pack);

}  // namespace moetron::infer
