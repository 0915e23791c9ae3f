// cuBLASLt, loaded at the first CUDA context (see cublaslt.cuh for why).
#include <dlfcn.h>

#include <string>
#include <type_traits>

#include "core/error.h"
#include "cuda/cublaslt.cuh"

namespace moetron::gpu {

namespace {

// The library's soname for the toolkit this was compiled with (libcublasLt.so.13 for CUDA 13), tried
// first from the toolkit's own directory, then wherever the dynamic loader finds it.
CublasLt load_cublaslt() {
  const std::string soname = "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR);
  std::string tried;
  void* h = nullptr;
  for (const std::string& path : {std::string(MOETRON_CUDA_LIBRARY_DIR) + "/" + soname, soname}) {
    h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h) break;
    const char* why = dlerror();
    tried += fmt::format("\n  {}: {}", path, why ? why : "not found");
  }
  if (!h) fail("[cuda context] cannot load cuBLASLt ({}); install the CUDA {} libraries:{}", soname, CUBLAS_VER_MAJOR, tried);
  CublasLt t;
  auto get = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
    if (!fn) fail("[cuda context] {} has no symbol {} (a different cuBLASLt version?)", soname, name);
  };
  get(t.Create, "cublasLtCreate");
  get(t.Destroy, "cublasLtDestroy");
  get(t.GetStatusName, "cublasLtGetStatusName");
  get(t.GetStatusString, "cublasLtGetStatusString");
  get(t.Matmul, "cublasLtMatmul");
  get(t.MatmulAlgoGetHeuristic, "cublasLtMatmulAlgoGetHeuristic");
  get(t.MatmulDescCreate, "cublasLtMatmulDescCreate");
  get(t.MatmulDescDestroy, "cublasLtMatmulDescDestroy");
  get(t.MatmulDescSetAttribute, "cublasLtMatmulDescSetAttribute");
  get(t.MatmulPreferenceCreate, "cublasLtMatmulPreferenceCreate");
  get(t.MatmulPreferenceDestroy, "cublasLtMatmulPreferenceDestroy");
  get(t.MatmulPreferenceSetAttribute, "cublasLtMatmulPreferenceSetAttribute");
  get(t.MatrixLayoutCreate, "cublasLtMatrixLayoutCreate");
  get(t.MatrixLayoutDestroy, "cublasLtMatrixLayoutDestroy");
  return t;  // the handle stays open for the life of the process
}

}  // namespace

const CublasLt& cublaslt() {
  static const CublasLt t = load_cublaslt();  // loaded once, thread-safe; read-only afterwards
  return t;
}

}  // namespace moetron::gpu
