// Rotary position embedding on the device; see ops.h and src/ops/rope.h (which dims rotate, the
// pair layout, YaRN).  The angle is exactly the CPU's: inv_freq from ops::rope_inv_freq on the host
// (fp32), angle = (float)pos * inv_freq[j] in fp32, cos/sin of that fp32 angle evaluated in fp64,
// times the attention factor.
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
                            int R, int offset, bool interleaved, float af, InvFreq inv, float sign) {
  __shared__ float cs[kMaxHalf], sn[kMaxHalf];
  const int half = R / 2;
  for (long n = blockIdx.x; n < N; n += gridDim.x) {
    __syncthreads();  // the previous token's cs/sn are no longer read
    const float p = (float)pos[n];
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
      const float angle = p * inv.v[j];
      double s, c;
      sincos((double)angle, &s, &c);
      cs[j] = (float)c * af;
      sn[j] = sign * ((float)s * af);
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < H * half; idx += blockDim.x) {
      const int h = idx / half, j = idx - h * half;
      const long base = n * stride + (long)h * HD + offset;
      const int a = interleaved ? 2 * j : j, b = interleaved ? a + 1 : j + half;
      const float x1 = __bfloat162float(inp[base + a]), x2 = __bfloat162float(inp[base + b]);
      out[base + a] = __float2bfloat16_rn(x1 * cs[j] + (-x2) * sn[j]);
      out[base + b] = __float2bfloat16_rn(x2 * cs[j] + x1 * sn[j]);
    }
    if (out != inp && R < HD)  // partial RoPE: the unrotated dims copied
      for (int idx = threadIdx.x; idx < H * HD; idx += blockDim.x) {
        const int d = idx % HD;
        if (d >= offset && d < offset + R) continue;
        const long at = n * stride + (long)(idx / HD) * HD + d;
        out[at] = inp[at];
      }
  }
}

void rope_apply(Context& ctx, const char* op, Bf16* out, const Bf16* inp, long stride, const int32_t* pos, long N,
                int H, int HD, const ops::RopeSpec& spec, float sign) {
  const int R = spec.rotated(HD);
  MOETRON_OP_CHECK(N >= 0 && H > 0 && HD > 0, op, "bad dimensions N={} H={} HD={}", N, H, HD);
  MOETRON_OP_CHECK(spec.offset >= 0 && R > 0 && R % 2 == 0 && spec.offset + R <= HD && R / 2 <= kMaxHalf, op,
                   "rotated dims [{}, {}) must be an even, non-empty range inside HD={} of at most {}", spec.offset,
                   spec.offset + R, HD, 2 * kMaxHalf);
  MOETRON_OP_CHECK(spec.theta > 0.0f, op, "rope theta must be positive, got {}", spec.theta);
  if (stride == 0) stride = (long)H * HD;
  MOETRON_OP_CHECK(stride >= (long)H * HD, op, "row stride {} is smaller than H*HD = {}", stride, (long)H * HD);
  if (N == 0) return;
  InvFreq inv{};
  const std::vector<float> freqs = ops::rope_inv_freq(spec, R);
  for (int j = 0; j < R / 2; j++) inv.v[j] = freqs[j];
  const unsigned blocks = (unsigned)(N < (1 << 20) ? N : (1 << 20));
  rope_kernel<<<blocks, 256, 0, stream_of(ctx)>>>(as_bf(out), as_bf(inp), stride, pos, N, H, HD, R, spec.offset, spec.interleaved,
                                                   spec.attention_factor, inv, sign);
  CUDA_LAUNCHED(op);
}

}  // namespace

void rope_forward(Context& ctx, Bf16* out, const Bf16* inp, long stride, const int32_t* pos, long N, int H, int HD,
                  const ops::RopeSpec& spec) {
  rope_apply(ctx, "rope_forward", out, inp, stride, pos, N, H, HD, spec, 1.0f);
}

void rope_backward(Context& ctx, Bf16* dinp, const Bf16* dout, long stride, const int32_t* pos, long N, int H,
                   int HD, const ops::RopeSpec& spec) {
  rope_apply(ctx, "rope_backward", dinp, dout, stride, pos, N, H, HD, spec, -1.0f);
}

}  // namespace moetron::gpu
