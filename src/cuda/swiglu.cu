// SwiGLU on the device; see ops.h and src/ops/swiglu.cpp.  gate_up [N,2I] (gate columns, then up),
// out [N,I].  bf16 storage, fp32 maths.  Activation gradients assign (=).
#include "cuda/common.cuh"
#include "cuda/ops.h"

namespace moetron::gpu {

namespace {

__global__ void swiglu_forward_kernel(bf16* out, const bf16* gate_up, long N, int I) {
  const long total = N * I;
  for (long idx = blockIdx.x * (long)blockDim.x + threadIdx.x; idx < total; idx += (long)gridDim.x * blockDim.x) {
    const long n = idx / I, i = idx - n * I;
    const float g = __bfloat162float(gate_up[n * 2 * I + i]);
    const float u = __bfloat162float(gate_up[n * 2 * I + I + i]);
    out[idx] = __float2bfloat16_rn(g / (1.0f + expf(-g)) * u);
  }
}

__global__ void swiglu_backward_kernel(bf16* dgate_up, const bf16* dout, const bf16* gate_up, long N, int I) {
  const long total = N * I;
  for (long idx = blockIdx.x * (long)blockDim.x + threadIdx.x; idx < total; idx += (long)gridDim.x * blockDim.x) {
    const long n = idx / I, i = idx - n * I;
    const float g = __bfloat162float(gate_up[n * 2 * I + i]);
    const float u = __bfloat162float(gate_up[n * 2 * I + I + i]);
    const float d = __bfloat162float(dout[idx]);
    const float sig = 1.0f / (1.0f + expf(-g));
    // d silu / dg = sig * (1 + g * (1 - sig))
    dgate_up[n * 2 * I + i] = __float2bfloat16_rn(d * u * sig * (1.0f + g * (1.0f - sig)));
    dgate_up[n * 2 * I + I + i] = __float2bfloat16_rn(d * g * sig);
  }
}

unsigned elementwise_blocks(long n) {
  const unsigned b = blocks_for((size_t)n, 256);
  return b < (1u << 20) ? b : (1u << 20);
}

}  // namespace

void swiglu_forward(Context& ctx, Bf16* out, const Bf16* gate_up, long N, int I) {
  MOETRON_OP_CHECK(N >= 0 && I > 0, "swiglu_forward", "bad dimensions N={} I={}", N, I);
  if (N == 0) return;
  swiglu_forward_kernel<<<elementwise_blocks(N * I), 256, 0, stream_of(ctx)>>>(as_bf(out), as_bf(gate_up), N, I);
  CUDA_LAUNCHED("swiglu_forward");
}

void swiglu_backward(Context& ctx, Bf16* dgate_up, const Bf16* dout, const Bf16* gate_up, long N, int I) {
  MOETRON_OP_CHECK(N >= 0 && I > 0, "swiglu_backward", "bad dimensions N={} I={}", N, I);
  if (N == 0) return;
  swiglu_backward_kernel<<<elementwise_blocks(N * I), 256, 0, stream_of(ctx)>>>(as_bf(dgate_up), as_bf(dout),
                                                                               as_bf(gate_up), N, I);
  CUDA_LAUNCHED("swiglu_backward");
}

}  // namespace moetron::gpu
