// Shared by the .cu files of the CUDA backend: error checks that name the op and the call, the
// Context's internals, bf16 pointer casts and small device helpers.
#pragma once

#include "cuda/cublaslt.cuh"
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <unordered_map>

#include "core/error.h"
#include "cuda/runtime.h"

namespace moetron::gpu {

[[noreturn]] void fail_cuda(const char* op, const char* call, cudaError_t err);
[[noreturn]] void fail_cublas(const char* op, const char* call, cublasStatus_t status);

}  // namespace moetron::gpu

// Every CUDA runtime call goes through this: "[op] cudaMemcpyAsync(...) failed: <name>: <text>".
#define CUDA_CALL(op, call)                                                   \
  do {                                                                        \
    const cudaError_t err_ = (call);                                          \
    if (err_ != cudaSuccess) ::moetron::gpu::fail_cuda(op, #call, err_);      \
  } while (0)

#define CUBLAS_CALL(op, call)                                                     \
  do {                                                                            \
    const cublasStatus_t st_ = (call);                                            \
    if (st_ != CUBLAS_STATUS_SUCCESS) ::moetron::gpu::fail_cublas(op, #call, st_); \
  } while (0)

// After every kernel launch: a bad launch configuration surfaces here, named with the op.
#define CUDA_LAUNCHED(op) CUDA_CALL(op, cudaGetLastError())

namespace moetron::gpu {

using bf16 = __nv_bfloat16;
static_assert(sizeof(Bf16) == sizeof(bf16) && alignof(Bf16) <= alignof(bf16), "Bf16 must mirror __nv_bfloat16");

inline bf16* as_bf(Bf16* p) { return reinterpret_cast<bf16*>(p); }
inline const bf16* as_bf(const Bf16* p) { return reinterpret_cast<const bf16*>(p); }

// The GEMM descriptors and algorithm chosen for one shape, kept for reuse.
struct GemmKey {
  int ta, tb, m, n, k;
  long lda, ldb, ldc;
  int ab, c, align, beta_nonzero;
  bool operator==(const GemmKey& o) const {
    return ta == o.ta && tb == o.tb && m == o.m && n == o.n && k == o.k && lda == o.lda && ldb == o.ldb &&
           ldc == o.ldc && ab == o.ab && c == o.c && align == o.align && beta_nonzero == o.beta_nonzero;
  }
};
struct GemmKeyHash {
  size_t operator()(const GemmKey& g) const {
    size_t h = 1469598103934665603ull;
    const long v[] = {g.ta, g.tb, g.m, g.n, g.k, g.lda, g.ldb, g.ldc, g.ab, g.c, g.align, g.beta_nonzero};
    for (long x : v) h = (h ^ (size_t)x) * 1099511628211ull;
    return h;
  }
};
struct GemmPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

struct Context::Impl {
  int device = 0;
  cudaStream_t stream = nullptr;
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;  // cuBLASLt workspace (one cudaMalloc)
  size_t workspace_bytes = 0;
  std::unordered_map<GemmKey, GemmPlan, GemmKeyHash> gemm_plans;
  void clear_gemm_plans();
};

inline cudaStream_t stream_of(Context& ctx) { return ctx.impl().stream; }

inline unsigned blocks_for(size_t n, unsigned threads) {
  size_t b = (n + threads - 1) / threads;
  return (unsigned)(b > 0x7fffffffu ? 0x7fffffffu : (b == 0 ? 1 : b));
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ double warp_sum_d(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over a block of blockDim.x threads (a multiple of 32, at most 1024); every thread gets it.
// `red` is __shared__ float[32].
__device__ __forceinline__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // red may still be read from a previous call
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < nwarps ? red[lane] : 0.0f;
  return warp_sum(v);
}
__device__ __forceinline__ double block_sum_d(double v, double* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_sum_d(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < nwarps ? red[lane] : 0.0;
  return warp_sum_d(v);
}

}  // namespace moetron::gpu
