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

// ---- the norm over rows split across ranks (OLMoE q/k norms under tp) ---------------------------

namespace {

__global__ void row_dot_kernel(float* out, const float* a, const float* b, const float* w, long N, int C) {
  const long row = (long)blockIdx.x * kRowsPerBlock + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= N) return;
  float s = 0.0f;
  for (int c = lane; c < C; c += 32) s += (w ? w[c] : 1.0f) * a[row * C + c] * b[row * C + c];
  s = warp_sum(s);
  if (lane == 0) out[row] = s;
}

__global__ void rmsnorm_forward_stats_kernel(bf16* out, float* out_f32, float* rstd, const float* inp,
                                             const float* weight, const float* ss, long N, int C, int width,
                                             float ss_scale, float eps) {
  const long row = (long)blockIdx.x * kRowsPerBlock + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= N) return;
  const float r = 1.0f / sqrtf(ss[row] * ss_scale / (float)width + eps);
  if (lane == 0) rstd[row] = r;
  for (int c = lane; c < C; c += 32) {
    const float y = weight[c] * (inp[row * C + c] * r);
    if (out) out[row * C + c] = __float2bfloat16_rn(y);
    if (out_f32) out_f32[row * C + c] = y;
  }
}

__global__ void rmsnorm_backward_stats_kernel(float* dinp, const float* dout, const float* inp, const float* weight,
                                              const float* rstd, const float* dot, long N, int C, int width,
                                              float dot_scale) {
  const long row = (long)blockIdx.x * kRowsPerBlock + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= N) return;
  const float r = rstd[row];
  const float coef = r * r * r * dot[row] * dot_scale / (float)width;
  for (int c = lane; c < C; c += 32) dinp[row * C + c] = r * weight[c] * dout[row * C + c] - coef * inp[row * C + c];
}

}  // namespace

void row_dot(Context& ctx, float* out, const float* a, const float* b, const float* w, long N, int C) {
  MOETRON_OP_CHECK(N >= 0 && C > 0, "row_dot", "bad dimensions N={} C={}", N, C);
  if (N == 0) return;
  const unsigned blocks = (unsigned)((N + kRowsPerBlock - 1) / kRowsPerBlock);
  row_dot_kernel<<<blocks, 32 * kRowsPerBlock, 0, stream_of(ctx)>>>(out, a, b, w, N, C);
  CUDA_LAUNCHED("row_dot");
}

void rmsnorm_forward_stats(Context& ctx, void* out, DType out_dtype, float* rstd, const float* inp, const float* weight,
                           const float* ss, long N, int C, int width, float ss_scale, float eps) {
  MOETRON_OP_CHECK(N >= 0 && C > 0 && width >= C, "rmsnorm_forward_stats", "bad dimensions N={} C={} width={}", N, C,
                   width);
  if (N == 0) return;
  const unsigned blocks = (unsigned)((N + kRowsPerBlock - 1) / kRowsPerBlock);
  bf16* o16 = out_dtype == DType::BF16 ? static_cast<bf16*>(out) : nullptr;
  float* o32 = out_dtype == DType::F32 ? static_cast<float*>(out) : nullptr;
  rmsnorm_forward_stats_kernel<<<blocks, 32 * kRowsPerBlock, 0, stream_of(ctx)>>>(o16, o32, rstd, inp, weight, ss, N,
                                                                                  C, width, ss_scale, eps);
  CUDA_LAUNCHED("rmsnorm_forward_stats");
}

void rmsnorm_backward_stats(Context& ctx, float* dinp, float* dweight, const float* dout, const float* inp,
                            const float* weight, const float* rstd, const float* dot, long N, int C, int width,
                            float dot_scale) {
  MOETRON_OP_CHECK(N >= 0 && C > 0 && width >= C, "rmsnorm_backward_stats", "bad dimensions N={} C={} width={}", N,
                   C, width);
  if (N == 0) return;
  const unsigned blocks = (unsigned)((N + kRowsPerBlock - 1) / kRowsPerBlock);
  rmsnorm_backward_stats_kernel<<<blocks, 32 * kRowsPerBlock, 0, stream_of(ctx)>>>(dinp, dout, inp, weight, rstd, dot,
                                                                                   N, C, width, dot_scale);
  CUDA_LAUNCHED("rmsnorm_backward_stats");
  if (dweight == nullptr) return;  // a frozen weight
  const long rows_per_chunk = N / 128 > 64 ? (N + 127) / 128 : 64;
  const dim3 grid(blocks_for(C, 256), (unsigned)((N + rows_per_chunk - 1) / rows_per_chunk));
  rmsnorm_dweight_kernel<<<grid, 256, 0, stream_of(ctx)>>>(dweight, dout, inp, rstd, N, C, rows_per_chunk);
  CUDA_LAUNCHED("rmsnorm_backward_stats");
}

}  // namespace moetron::gpu
