// Projection biases' gradient and the sigmoid gate (Qwen2-MoE) on the CUDA backend; see ops.h and
// src/ops/bias.h, src/ops/sigmoid.h for the CPU reference.
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
