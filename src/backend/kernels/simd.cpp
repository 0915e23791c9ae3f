// Which instruction set the kernels use (simd.h): the CPU's features, lowered by MOETRON_SIMD.
#include "backend/kernels/simd.h"

#include <cstdlib>
#include <string>

#include "core/error.h"

namespace moetron::kernels {

namespace {

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

}  // namespace

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

void check_simd_level(SimdLevel level) {
  if ((int)level > (int)simd_level())
    fail("[kernels] {} kernels asked for; this CPU (or MOETRON_SIMD) allows {}", simd_name(level),
         simd_name(simd_level()));
}

}  // namespace moetron::kernels
