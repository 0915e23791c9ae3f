// Projection biases' gradient and the sigmoid gate (Qwen2-MoE), and OLMoE's clip_qkv clamp, on the
// CUDA backend; see ops.h and src/ops/bias.h, sigmoid.h, clamp.h for the CPU reference.
#include "cuda/common.cuh"
#include "cuda/ops.h"

namespace moetron::gpu {

namespace {

// One thread per column, summing its rows in row order in fp64 (the CPU's order: deterministic).
// Columns are contiguous across a warp, so each row's loads coalesce.
__global__ void bias_backward_kernel(float* dbias, const float* dout, long N, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  double s = 0.0;
  for (long n = 0; n < N; n++) s += (double)dout[n * C + c];
  dbias[c] += (float)s;
}

__global__ void sigmoid_forward_kernel(float* s, const float* x, long n) {
  const long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (i < n) s[i] = (float)(1.0 / (1.0 + exp(-(double)x[i])));
}

__global__ void sigmoid_backward_kernel(float* dx, const float* ds, const float* s, long n) {
  const long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (i < n) dx[i] = (float)((double)ds[i] * (double)s[i] * (1.0 - (double)s[i]));
}

}  // namespace

void bias_backward(Context& ctx, float* dbias, const float* dout, long N, int C) {
  MOETRON_OP_CHECK(N >= 0 && C > 0, "bias_backward", "bad dimensions N={} C={}", N, C);
  if (N == 0) return;
  bias_backward_kernel<<<blocks_for(C, 128), 128, 0, stream_of(ctx)>>>(dbias, dout, N, C);
  CUDA_LAUNCHED("bias_backward");
}

void sigmoid_forward(Context& ctx, float* s, const float* x, long n) {
  MOETRON_OP_CHECK(n >= 0, "sigmoid_forward", "bad count {}", n);
  if (n == 0) return;
  sigmoid_forward_kernel<<<blocks_for(n, 256), 256, 0, stream_of(ctx)>>>(s, x, n);
  CUDA_LAUNCHED("sigmoid_forward");
}

void sigmoid_backward(Context& ctx, float* dx, const float* ds, const float* s, long n) {
  MOETRON_OP_CHECK(n >= 0, "sigmoid_backward", "bad count {}", n);
  if (n == 0) return;
  sigmoid_backward_kernel<<<blocks_for(n, 256), 256, 0, stream_of(ctx)>>>(dx, ds, s, n);
  CUDA_LAUNCHED("sigmoid_backward");
}

}  // namespace moetron::gpu

// ---- clamp (OLMoE clip_qkv) on the act store (bf16) or f32 --------------------------------------
namespace moetron::gpu {

namespace {

template <typename T>
__device__ float load_f(const T* p, long i);
template <>
__device__ float load_f<float>(const float* p, long i) { return p[i]; }
template <>
__device__ float load_f<bf16>(const bf16* p, long i) { return __bfloat162float(p[i]); }
template <typename T>
__device__ void store_f(T* p, long i, float v);
template <>
__device__ void store_f<float>(float* p, long i, float v) { p[i] = v; }
template <>
__device__ void store_f<bf16>(bf16* p, long i, float v) { p[i] = __float2bfloat16_rn(v); }

template <typename T>
__global__ void clamp_forward_kernel(T* x, uint8_t* mask, float c, long n) {
  const long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float v = load_f(x, i);
  const bool keep = v >= -c && v <= c;
  mask[i] = keep ? 1 : 0;
  if (v > c) store_f(x, i, c);
  else if (v < -c) store_f(x, i, -c);
}

template <typename T>
__global__ void clamp_backward_kernel(T* dx, const uint8_t* mask, long n) {
  const long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (i < n && !mask[i]) store_f(dx, i, 0.0f);
}

}  // namespace

void clamp_forward(Context& ctx, void* x, DType dtype, uint8_t* mask, float c, long n) {
  MOETRON_OP_CHECK(n >= 0 && c >= 0.0f, "clamp_forward", "bad count {} or bound {}", n, c);
  if (n == 0) return;
  if (dtype == DType::BF16)
    clamp_forward_kernel<<<blocks_for(n, 256), 256, 0, stream_of(ctx)>>>(static_cast<bf16*>(x), mask, c, n);
  else
    clamp_forward_kernel<<<blocks_for(n, 256), 256, 0, stream_of(ctx)>>>(static_cast<float*>(x), mask, c, n);
  CUDA_LAUNCHED("clamp_forward");
}

void clamp_backward(Context& ctx, void* dx, DType dtype, const uint8_t* mask, long n) {
  MOETRON_OP_CHECK(n >= 0, "clamp_backward", "bad count {}", n);
  if (n == 0) return;
  if (dtype == DType::BF16)
    clamp_backward_kernel<<<blocks_for(n, 256), 256, 0, stream_of(ctx)>>>(static_cast<bf16*>(dx), mask, n);
  else
    clamp_backward_kernel<<<blocks_for(n, 256), 256, 0, stream_of(ctx)>>>(static_cast<float*>(dx), mask, n);
  CUDA_LAUNCHED("clamp_backward");
}

}  // namespace moetron::gpu
