// The BLAS behind ops::sgemm: OpenBLAS, loaded at first use.
//
// Why loaded rather than linked: Debian 12's OpenBLAS (0.3.21, DYNAMIC_ARCH) picks its kernels from
// the CPU model number and falls back to the 2004-era "Prescott" SSE3 kernels on processors newer
// than it knows (measured here on a Sapphire-Rapids-class Xeon: 22 GFLOP/s per core instead of
// 125 with its own SkylakeX kernels).  OpenBLAS reads OPENBLAS_CORETYPE once, when the library is
// loaded, so we choose the kernel family from the CPU's feature flags (AVX-512 F/BW/DQ/VL ->
// SkylakeX, AVX2+FMA -> Haswell) and only then load the library.  A value the user (or the
// machine) already set in OPENBLAS_CORETYPE is always respected.  The OpenMP build of OpenBLAS is
// preferred so BLAS threads and moetron's OpenMP threads are one pool.
#pragma once

#include <string>

namespace moetron::ops {

struct BlasLibrary {
  std::string path;       // the shared object that was loaded
  std::string core_name;  // OpenBLAS's kernel family, e.g. "SkylakeX"
  std::string coretype_source;  // "environment" (respected as set) or "cpu features" (chosen here)
};

// Loads the library on first call (thread-safe); throws Error if no OpenBLAS can be loaded.
const BlasLibrary& blas_library();

// C[M,N] = alpha * op(A) @ op(B) + beta * C, row-major.
void blas_sgemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
                const float* B, int ldb, float beta, float* C, int ldc);

void blas_set_num_threads(int n);

}  // namespace moetron::ops
