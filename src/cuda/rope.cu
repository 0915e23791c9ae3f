// Rotary position embedding on the device, HF rotate-half; see ops.h and src/ops/rope.cpp.
// The angle is exactly the CPU's: inv_freq[j] = 1 / powf(theta, 2j/HD) computed on the host in
// fp32, angle = (float)pos * inv_freq[j] in fp32, cos/sin of that fp32 angle evaluated in fp64.
// Activation gradients assign (=); the backward is the inverse rotation.
#include <cmath>

#include "cuda/common.cuh"
#include "cuda/ops.h"

namespace moetron::gpu {

namespace {

constexpr int kMaxHalf = 128;  // HD <= 256

struct InvFreq {
  float v[kMaxHalf];
};

// One block per token: the block computes the token's cos/sin once, then rotates every head.
__global__ void rope_kernel(bf16* out, const bf16* inp, long stride, const int32_t* pos, long N, int H, int HD,
                            int R, InvFreq inv, float sign) {
  __shared__ float cs[kMaxHalf], sn[kMaxHalf];
  const int half = R / 2;
  for (long n = blockIdx.x; n < N; n += gridDim.x) {
    __syncthreads();  // the previous token's cs/sn are no longer read
    const float p = (float)pos[n];
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
      const float angle = p * inv.v[j];
      double s, c;
      sincos((double)angle, &s, &c);
      cs[j] = (float)c;
      sn[j] = sign * (float)s;
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < H * half; idx += blockDim.x) {
      const int h = idx / half, j = idx - h * half;
      const long base = n * stride + (long)h * HD;
      const float x1 = __bfloat162float(inp[base + j]), x2 = __bfloat162float(inp[base + j + half]);
      out[base + j] = __float2bfloat16_rn(x1 * cs[j] + (-x2) * sn[j]);
      out[base + j + half] = __float2bfloat16_rn(x2 * cs[j] + x1 * sn[j]);
    }
    if (out != inp && R < HD)  // partial RoPE: the unrotated dims copied
      for (int idx = threadIdx.x; idx < H * (HD - R); idx += blockDim.x) {
        const long at = n * stride + (long)(idx / (HD - R)) * HD + R + idx % (HD - R);
        out[at] = inp[at];
      }
  }
}

void rope_apply(Context& ctx, const char* op, Bf16* out, const Bf16* inp, long stride, const int32_t* pos, long N,
                int H, int HD, float theta, float sign, int R) {
  MOETRON_OP_CHECK(N >= 0 && H > 0 && HD > 0 && HD % 2 == 0, op, "bad dimensions N={} H={} HD={} (HD must be even)",
                   N, H, HD);
  if (R == 0) R = HD;
  MOETRON_OP_CHECK(R > 0 && R <= HD && R % 2 == 0 && R / 2 <= kMaxHalf, op,
                   "rotated dims R={} must be even, at most HD={} and at most {}", R, HD, 2 * kMaxHalf);
  MOETRON_OP_CHECK(theta > 0.0f, op, "rope theta must be positive, got {}", theta);
  if (stride == 0) stride = (long)H * HD;
  MOETRON_OP_CHECK(stride >= (long)H * HD, op, "row stride {} is smaller than H*HD = {}", stride, (long)H * HD);
  if (N == 0) return;
  InvFreq inv{};
  for (int j = 0; j < R / 2; j++) inv.v[j] = 1.0f / std::pow(theta, (float)(2 * j) / (float)R);
  const unsigned blocks = (unsigned)(N < (1 << 20) ? N : (1 << 20));
  rope_kernel<<<blocks, 256, 0, stream_of(ctx)>>>(as_bf(out), as_bf(inp), stride, pos, N, H, HD, R, inv, sign);
  CUDA_LAUNCHED(op);
}

}  // namespace

void rope_forward(Context& ctx, Bf16* out, const Bf16* inp, long stride, const int32_t* pos, long N, int H, int HD,
                  float theta, int R) {
  rope_apply(ctx, "rope_forward", out, inp, stride, pos, N, H, HD, theta, 1.0f, R);
}

void rope_backward(Context& ctx, Bf16* dinp, const Bf16* dout, long stride, const int32_t* pos, long N, int H,
                   int HD, float theta, int R) {
  rope_apply(ctx, "rope_backward", dinp, dout, stride, pos, N, H, HD, theta, -1.0f, R);
}

}  // namespace moetron::gpu
