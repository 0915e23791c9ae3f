// The instruction sets of the CPU inference kernels (backend/kernels/), and the one this CPU runs: each
// kernel is compiled for its set with a target attribute (whatever the build's -march), and the set
// is chosen at run time from the CPU's features.
#pragma once

namespace moetron::kernels {

enum class SimdLevel { generic, avx2, avx512 };
// The level used (the best this CPU has; MOETRON_SIMD=generic|avx2|avx512 lowers it, for tests and
// benchmarks).  Read once.
SimdLevel simd_level();
const char* simd_name(SimdLevel level);
// Fails unless `level` is at most simd_level(): the kernels of a level asked for by name (gemv_at,
// argmax_at).
void check_simd_level(SimdLevel level);

// Whether this is an AMD CPU (the matrix-vector kernels' prefetch rules: gemv_impl.h).  Read once.
inline bool amd_cpu() {
#if defined(__x86_64__)
  static const bool v = __builtin_cpu_is("amd");
  return v;
#else
  return false;
#endif
}

// Whether the AVX-512 level has VNNI for the int8 products (else it runs the AVX2 ones: same results).
inline bool has_avx512_vnni() {
#if defined(__x86_64__)
  static const bool v = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512dq");
  return v;
#else
  return false;
#endif
}

}  // namespace moetron::kernels
