#include "ops/blas.h"

#include <dlfcn.h>

#include <cstdlib>

#include "core/error.h"

namespace moetron::ops {

namespace {

// CBLAS ABI constants (cblas.h: CblasRowMajor = 101, CblasNoTrans = 111, CblasTrans = 112).
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

using SgemmFn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*,
                         int);
using SetThreadsFn = void (*)(int);
using CoreNameFn = char* (*)();

struct Loaded {
  BlasLibrary info;
  SgemmFn sgemm = nullptr;
  SetThreadsFn set_threads = nullptr;
};

const char* coretype_for_this_cpu() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
    return "SkylakeX";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "Haswell";
  return nullptr;  // let OpenBLAS decide
}

Loaded load() {
  Loaded l;
  if (std::getenv("OPENBLAS_CORETYPE")) {
    l.info.coretype_source = "environment";
  } else if (const char* core = coretype_for_this_cpu()) {
    // Before dlopen: OpenBLAS reads it in its load-time constructor.
    setenv("OPENBLAS_CORETYPE", core, 0);
    l.info.coretype_source = "cpu features";
  } else {
    l.info.coretype_source = "openblas default";
  }
  static const char* candidates[] = {
      "/usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.so.0",
      "/usr/lib/aarch64-linux-gnu/openblas-openmp/libopenblas.so.0",
      "libopenblas.so.0",
      "libopenblas.so",
      "libblas.so.3",  // any CBLAS (the reference one: the GPU check's bundle, scripts/gpu-bundle.sh)
  };
  void* handle = nullptr;
  std::string errors;
  for (const char* c : candidates) {
    handle = dlopen(c, RTLD_NOW | RTLD_LOCAL);
    if (handle) {
      l.info.path = c;
      break;
    }
    errors += std::string("\n  ") + dlerror();
  }
  if (!handle) fail("[blas] cannot load OpenBLAS or a CBLAS (run scripts/setup.sh to install libopenblas0):{}", errors);
  l.sgemm = reinterpret_cast<SgemmFn>(dlsym(handle, "cblas_sgemm"));
  l.set_threads = reinterpret_cast<SetThreadsFn>(dlsym(handle, "openblas_set_num_threads"));
  auto core_name = reinterpret_cast<CoreNameFn>(dlsym(handle, "openblas_get_corename"));
  if (!l.sgemm) fail("[blas] {} has no cblas_sgemm", l.info.path);
  l.info.core_name = core_name ? core_name() : "unknown";
  return l;
}

const Loaded& loaded() {
  static const Loaded l = load();  // initialised once, thread-safely; immutable afterwards
  return l;
}

}  // namespace

const BlasLibrary& blas_library() { return loaded().info; }

void blas_sgemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
                const float* B, int ldb, float beta, float* C, int ldc) {
  loaded().sgemm(kRowMajor, trans_a ? kTrans : kNoTrans, trans_b ? kTrans : kNoTrans, M, N, K, alpha, A, lda, B,
                 ldb, beta, C, ldc);
}

void blas_set_num_threads(int n) {
  if (loaded().set_threads) loaded().set_threads(n);
}

}  // namespace moetron::ops
