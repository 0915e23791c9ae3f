// cuBLASLt's entry points, loaded with dlopen when the first CUDA context is made.
//
// Why loaded rather than linked: merely loading libcublasLt (CUDA 13) costs a process ~210 MB of
// resident memory before main() runs (its static initialisers), and every moetron command would pay
// it -- `moetron generate` on a 60 MB model included.  Loaded on first use, only runs that make a
// CUDA context pay.  Types and signatures come from <cublasLt.h>; the table holds pointers of exactly
// those types.  Throws Error naming the library and the loader's reason when it cannot be loaded.
#pragma once

#include <cublasLt.h>

namespace moetron::gpu {

struct CublasLt {
  decltype(&cublasLtCreate) Create = nullptr;
  decltype(&cublasLtDestroy) Destroy = nullptr;
  decltype(&cublasLtGetStatusName) GetStatusName = nullptr;
  decltype(&cublasLtGetStatusString) GetStatusString = nullptr;
  decltype(&cublasLtMatmul) Matmul = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) MatmulAlgoGetHeuristic = nullptr;
  decltype(&cublasLtMatmulDescCreate) MatmulDescCreate = nullptr;
  decltype(&cublasLtMatmulDescDestroy) MatmulDescDestroy = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) MatmulDescSetAttribute = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) MatmulPreferenceCreate = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) MatmulPreferenceDestroy = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) MatmulPreferenceSetAttribute = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) MatrixLayoutCreate = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) MatrixLayoutDestroy = nullptr;
};

// The loaded table (loads on the first call).
const CublasLt& cublaslt();

}  // namespace moetron::gpu
