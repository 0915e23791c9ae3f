// Token embedding on the device; see ops.h.  N tokens, C hidden, this table's vocabulary rows
// [V0, V0 + Vr).
// Parameter gradients accumulate (+=) with fp32 atomics (summation order may vary between runs).
#include "cuda/common.cuh"
#include "cuda/ops.h"

namespace moetron::gpu {

namespace {

__global__ void embedding_forward_kernel(float* out, const int32_t* tokens, const float* wte, long N, int C,
                                         int64_t V0, int64_t Vr) {
  for (long n = blockIdx.x; n < N; n += gridDim.x) {
    const int64_t t = (int64_t)tokens[n] - V0;
    const bool ok = t >= 0 && t < Vr;
    const float* src = wte + (long)(ok ? t : 0) * C;
    float* dst = out + n * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) dst[c] = ok ? src[c] : 0.0f;
  }
}

__global__ void embedding_backward_kernel(float* dwte, const float* dout, const int32_t* tokens, long N, int C,
                                          int64_t V0, int64_t Vr) {
  for (long n = blockIdx.x; n < N; n += gridDim.x) {
    const int64_t t = (int64_t)tokens[n] - V0;
    if (t < 0 || t >= Vr) continue;
    float* dst = dwte + (long)t * C;
    const float* src = dout + n * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) atomicAdd(dst + c, src[c]);
  }
}

unsigned row_blocks(long N) { return (unsigned)(N < (1 << 20) ? (N > 0 ? N : 1) : (1 << 20)); }

}  // namespace

void embedding_forward(Context& ctx, float* out, const int32_t* tokens, const float* wte, long N, int C, int64_t V0,
                       int64_t Vr) {
  MOETRON_OP_CHECK(N >= 0 && C > 0 && Vr > 0 && V0 >= 0, "embedding_forward", "bad dimensions N={} C={} V0={} Vr={}",
                   N, C, V0, Vr);
  if (N == 0) return;
  embedding_forward_kernel<<<row_blocks(N), 256, 0, stream_of(ctx)>>>(out, tokens, wte, N, C, V0, Vr);
  CUDA_LAUNCHED("embedding_forward");
}

void embedding_backward(Context& ctx, float* dwte, const float* dout, const int32_t* tokens, long N, int C,
                        int64_t V0, int64_t Vr) {
  MOETRON_OP_CHECK(N >= 0 && C > 0 && Vr > 0 && V0 >= 0, "embedding_backward",
                   "bad dimensions N={} C={} V0={} Vr={}", N, C, V0, Vr);
  if (N == 0) return;
  embedding_backward_kernel<<<row_blocks(N), 256, 0, stream_of(ctx)>>>(dwte, dout, tokens, N, C, V0, Vr);
  CUDA_LAUNCHED("embedding_backward");
}

}  // namespace moetron::gpu
