// RMSNorm on the device; see ops.h.  N rows, C features.  One warp per row; fp32 throughout.
//   forward: rstd = 1/sqrt(mean(x^2) + eps), out = weight * (x * rstd)   (as ops::rmsnorm)
//   backward: dx = r w dy - (r^3 / C) x sum_j w_j dy_j x_j;  dweight_c += sum_n dy[n,c] x[n,c] r[n]
// Parameter gradients accumulate (+=, fp32 atomics over row chunks); the activation gradient
// assigns (=) or, for the residual stream, accumulates when asked.
#include "cuda/common.cuh"
#include "cuda/ops.h"

namespace moetron::gpu {

namespace {

constexpr int kRowsPerBlock = 8;  // warps per block

__global__ void rmsnorm_forward_kernel(bf16* out, float* out_f32, float* rstd, const float* inp, const float* weight,
                                       long N, int C, float eps) {
  const long row = (long)blockIdx.x * kRowsPerBlock + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= N) return;
  const float* x = inp + row * C;
  float ss = 0.0f;
  for (int c = lane; c < C; c += 32) ss += x[c] * x[c];
  ss = warp_sum(ss);
  const float r = 1.0f / sqrtf(ss / (float)C + eps);
  if (rstd && lane == 0) rstd[row] = r;
  for (int c = lane; c < C; c += 32) {
    const float y = weight[c] * (x[c] * r);
    if (out) out[row * C + c] = __float2bfloat16_rn(y);
    if (out_f32) out_f32[row * C + c] = y;
  }
}

__global__ void rmsnorm_backward_kernel(float* dinp, const float* dout, const float* inp, const float* weight,
                                        const float* rstd, long N, int C, bool accumulate) {
  const long row = (long)blockIdx.x * kRowsPerBlock + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= N) return;
  const float* x = inp + row * C;
  const float* dy = dout + row * C;
  float* dx = dinp + row * C;
  const float r = rstd[row];
  float dot = 0.0f;
  for (int c = lane; c < C; c += 32) dot += weight[c] * dy[c] * x[c];
  dot = warp_sum(dot);
  const float coef = r * r * r * dot / (float)C;
  for (int c = lane; c < C; c += 32) {
    const float g = r * weight[c] * dy[c] - coef * x[c];
    dx[c] = accumulate ? dx[c] + g : g;
  }
}

// Thread = column; block y = a chunk of rows.  Coalesced over columns.
__global__ void rmsnorm_dweight_kernel(float* dweight, const float* dout, const float* inp, const float* rstd, long N,
                                       int C, long rows_per_chunk) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const long r0 = (long)blockIdx.y * rows_per_chunk;
  const long r1 = r0 + rows_per_chunk < N ? r0 + rows_per_chunk : N;
  float acc = 0.0f;
  for (long n = r0; n < r1; n++) acc += dout[n * C + c] * (inp[n * C + c] * rstd[n]);
  atomicAdd(dweight + c, acc);
}

}  // namespace

void rmsnorm_forward(Context& ctx, void* out, DType out_dtype, float* rstd, const float* inp, const float* weight,
                     long N, int C, float eps) {
  MOETRON_OP_CHECK(N >= 0 && C > 0, "rmsnorm_forward", "bad dimensions N={} C={}", N, C);
  MOETRON_OP_CHECK(out_dtype == DType::BF16 || out_dtype == DType::F32, "rmsnorm_forward", "output dtype must be BF16 or F32 (got {})",
                   (int)out_dtype);
  if (N == 0) return;
  const unsigned blocks = (unsigned)((N + kRowsPerBlock - 1) / kRowsPerBlock);
  bf16* o16 = out_dtype == DType::BF16 ? static_cast<bf16*>(out) : nullptr;
  float* o32 = out_dtype == DType::F32 ? static_cast<float*>(out) : nullptr;
  rmsnorm_forward_kernel<<<blocks, 32 * kRowsPerBlock, 0, stream_of(ctx)>>>(o16, o32, rstd, inp, weight, N, C, eps);
  CUDA_LAUNCHED("rmsnorm_forward");
}

void rmsnorm_backward(Context& ctx, float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, long N, int C, bool accumulate) {
  MOETRON_OP_CHECK(N >= 0 && C > 0, "rmsnorm_backward", "bad dimensions N={} C={}", N, C);
  if (N == 0) return;
  const unsigned blocks = (unsigned)((N + kRowsPerBlock - 1) / kRowsPerBlock);
  rmsnorm_backward_kernel<<<blocks, 32 * kRowsPerBlock, 0, stream_of(ctx)>>>(dinp, dout, inp, weight, rstd, N, C,
                                                                             accumulate);
  CUDA_LAUNCHED("rmsnorm_backward");
  if (dweight) {
    const long rows_per_chunk = N / 128 > 64 ? (N + 127) / 128 : 64;
    const dim3 grid(blocks_for(C, 256), (unsigned)((N + rows_per_chunk - 1) / rows_per_chunk));
    rmsnorm_dweight_kernel<<<grid, 256, 0, stream_of(ctx)>>>(dweight, dout, inp, rstd, N, C, rows_per_chunk);
    CUDA_LAUNCHED("rmsnorm_backward");
  }
}

}  // namespace moetron::gpu
