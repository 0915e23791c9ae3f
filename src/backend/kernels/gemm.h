// The fp32 GEMM of inference's prefill: activations [n, IC] against a weight-layout matrix [OC, IC]
// (HF nn.Linear), written here so that inference needs no BLAS library (OpenBLAS's image, its
// Fortran runtime and its buffers are ~2.7 MiB resident: more than a small model's 15% budget).
//
// Contract: out[t, r] (row stride ld_out) = alpha * s, or out[t, r] + alpha * s when accumulate, where
// s = fma(x[t, IC-1], W[r, IC-1], ... fma(x[t, 1], W[r, 1], fma(x[t, 0], W[r, 0], 0))) -- one fma chain
// in column order -- so every result is bitwise the same at every SIMD level and thread count.
//
// Kernels: x is packed once per call into tiles of T rows ([IC][T], zero-padded: T = 48 with AVX-512,
// 16 with AVX2), then each tile meets a few weight rows at a time.  AVX-512: 8 rows, up to 24
// accumulators (per column up to 3 vector loads of x and 8 broadcasts of W for 24 FMAs), the tile's
// columns covered in steps of 8 (16-wide vectors plus an 8-wide one: a prompt's expert holds a few
// dozen rows, one tile), x packed and the results written back through transposes in registers.
// AVX2: 6 rows, 12 accumulators.  bf16 weights meet the AVX-512 tiles as they lie (each broadcast
// value shifted into fp32 in its register); other stored types are widened a group of rows at a time.
// Threads split the weight rows.
#pragma once

#include <vector>

#include "backend/kernels/simd.h"
#include "backend/weights.h"

namespace moetron::kernels {

// See above.  W: fp32 rows at stride ld_w, or bf16 / f16 / Q8_0 rows stored contiguously (ld_w == IC),
// which the thread that uses them widens to fp32 a few rows at a time (bf16 with AVX-512: in registers;
// the matrix is never copied: the scratch holds x packed plus a group's widened rows per thread).
// scratch: resized as needed; one per thread when called from several threads.  OpenMP threads (the
// caller's omp_get_max_threads()) split W's rows when the product is large enough; inside a parallel
// region it runs on the calling thread.
void gemm_nt(float* out, int ld_out, const float* x, int ld_x, WeightRef W, int ld_w, int n, int IC, int OC,
             float alpha, bool accumulate, std::vector<float>& scratch);

// The same with the kernels of `level` (at most simd_level()), for tests and benchmarks.
void gemm_nt_at(SimdLevel level, float* out, int ld_out, const float* x, int ld_x, WeightRef W, int ld_w, int n,
                int IC, int OC, float alpha, bool accumulate, std::vector<float>& scratch);

}  // namespace moetron::kernels
