// Softmax cross-entropy with ignore index on the device; see ops.h and src/ops/cross_entropy.h.
//   N rows, V vocab.  One block per row sweeps the vocabulary in chunks of blockDim values with an
//   online logsumexp (running max and rescaled sum per thread, merged across the block), so no
//   temporary of the row's size exists.  Activation gradients assign (=).
#include <cmath>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/ops.h"

namespace moetron::gpu {

namespace {

constexpr int kThreads = 256;
constexpr int32_t kIgnore = -100;  // ops::IGNORE_INDEX

// (m, s) with s = sum exp(x - m); merging two partial sums.
__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
  const float M = fmaxf(m, m2);
  if (M == -INFINITY) return;  // both empty
  s = (m == -INFINITY ? 0.0f : s * expf(m - M)) + (m2 == -INFINITY ? 0.0f : s2 * expf(m2 - M));
  m = M;
}

__global__ void __launch_bounds__(kThreads) ce_forward_kernel(float* lse, float* row_loss, const float* logits,
                                                              const int32_t* targets, long N, int V) {
  __shared__ float sm[32], ss[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (long n = blockIdx.x; n < N; n += gridDim.x) {
    const float* x = logits + n * V;
    float m = -INFINITY, s = 0.0f;
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
      const float xv = x[v];
      if (xv > m) {
        s = s * expf(m - xv) + 1.0f;
        m = xv;
      } else {
        s += expf(xv - m);  // a NaN logit makes s NaN, and the loss with it
      }
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
      lse_merge(m, s, m2, s2);
    }
    __syncthreads();  // sm/ss of the previous row are no longer read
    if (lane == 0) {
      sm[warp] = m;
      ss[warp] = s;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float M = sm[0], S = ss[0];
      for (int w = 1; w < (int)(blockDim.x >> 5); w++) lse_merge(M, S, sm[w], ss[w]);
      const float l = M + logf(S);
      lse[n] = l;
      const int32_t t = targets[n];
      row_loss[n] = (t == kIgnore || t < 0 || t >= V) ? (t == kIgnore ? 0.0f : NAN) : l - x[t];
    }
  }
}

// In place is safe: each chunk is read by the whole block before any of it is written, and the bf16
// writes of chunk c land in fp32 elements of chunks <= c (see ops.h).
__global__ void __launch_bounds__(kThreads) ce_backward_kernel(bf16* dlogits, long ld, const float* logits,
                                                               const float* lse, const int32_t* targets, long N,
                                                               int V, int64_t V0, float scale) {
  for (long n = blockIdx.x; n < N; n += gridDim.x) {
    const float* x = logits + n * V;
    bf16* d = dlogits + n * ld;
    const bool ignored = targets[n] == kIgnore;
    const int64_t t = ignored ? -1 : (int64_t)targets[n] - V0;  // outside [0, V): not one of these columns
    const float l = lse[n];
    for (int base = 0; base < V; base += blockDim.x) {
      const int v = base + threadIdx.x;
      float val = 0.0f;
      if (v < V && !ignored) val = scale * (expf(x[v] - l) - (v == t ? 1.0f : 0.0f));
      __syncthreads();
      if (v < V) d[v] = __float2bfloat16_rn(val);
    }
    __syncthreads();  // the next row's reads start after this row's writes (rows do not overlap)
  }
}

unsigned row_blocks(long N) { return (unsigned)(N < (1 << 20) ? (N > 0 ? N : 1) : (1 << 20)); }

}  // namespace

double cross_entropy_forward(Context& ctx, float* lse, float* row_loss, const float* logits,
                             const int32_t* targets, long N, int V, float scale) {
  MOETRON_OP_CHECK(N >= 0 && V > 0, "cross_entropy_forward", "bad dimensions N={} V={}", N, V);
  if (N == 0) return 0.0;
  ce_forward_kernel<<<row_blocks(N), kThreads, 0, stream_of(ctx)>>>(lse, row_loss, logits, targets, N, V);
  CUDA_LAUNCHED("cross_entropy_forward");
  std::vector<float> host(N);
  copy_to_host(ctx, host.data(), row_loss, sizeof(float) * N);
  double total = 0.0;  // in row order: independent of the launch configuration
  for (long n = 0; n < N; n++) total += host[n];
  return total * (double)scale;
}

void cross_entropy_backward(Context& ctx, Bf16* dlogits, long ld, const float* logits, const float* lse,
                            const int32_t* targets, long N, int V, int64_t V0, float scale) {
  MOETRON_OP_CHECK(N >= 0 && V > 0 && ld >= V && V0 >= 0, "cross_entropy_backward",
                   "bad dimensions N={} V={} ld={} V0={}", N, V, ld, V0);
  if (N == 0) return;
  ce_backward_kernel<<<row_blocks(N), kThreads, 0, stream_of(ctx)>>>(as_bf(dlogits), ld, logits, lse, targets, N, V,
                                                                     V0, scale);
  CUDA_LAUNCHED("cross_entropy_backward");
}

namespace {

__global__ void __launch_bounds__(kThreads) ce_row_max_kernel(float* row_max, const float* logits, long N, int V) {
  __shared__ float red[32];
  for (long n = blockIdx.x; n < N; n += gridDim.x) {
    const float* x = logits + n * V;
    float m = -INFINITY;
    for (int v = threadIdx.x; v < V; v += blockDim.x) m = x[v] > m ? x[v] : m;  // a NaN logit makes the loss NaN
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
      float M = red[0];
      for (int w = 1; w < (int)(blockDim.x >> 5); w++) M = fmaxf(M, red[w]);
      row_max[n] = M;
    }
  }
}

__global__ void __launch_bounds__(kThreads) ce_row_sums_kernel(double* sums, const float* logits, const float* row_max,
                                                               const int32_t* targets, long N, int V, int64_t V0) {
  __shared__ double red[32];
  for (long n = blockIdx.x; n < N; n += gridDim.x) {
    const float* x = logits + n * V;
    const float m = row_max[n];
    double s = 0.0;
    for (int v = threadIdx.x; v < V; v += blockDim.x) s += (double)expf(x[v] - m);
    __syncthreads();
    s = block_sum_d(s, red);
    if (threadIdx.x == 0) {
      sums[n] = s;
      const int64_t t = (int64_t)targets[n] - V0;
      sums[N + n] = targets[n] != kIgnore && t >= 0 && t < V ? (double)x[t] : 0.0;
    }
  }
}

__global__ void ce_finish_kernel(float* lse, float* row_loss, const float* row_max, const double* sums,
                                 const int32_t* targets, long N) {
  for (long n = blockIdx.x * (long)blockDim.x + threadIdx.x; n < N; n += (long)gridDim.x * blockDim.x) {
    const double l = (double)row_max[n] + log(sums[n]);
    lse[n] = (float)l;
    row_loss[n] = targets[n] == kIgnore ? 0.0f : (float)(l - sums[N + n]);
  }
}

}  // namespace

void cross_entropy_row_max(Context& ctx, float* row_max, const float* logits, long N, int V) {
  MOETRON_OP_CHECK(N >= 0 && V >= 0, "cross_entropy_row_max", "bad dimensions N={} V={}", N, V);
  if (N == 0) return;
  ce_row_max_kernel<<<row_blocks(N), kThreads, 0, stream_of(ctx)>>>(row_max, logits, N, V);
  CUDA_LAUNCHED("cross_entropy_row_max");
}

void cross_entropy_row_sums(Context& ctx, double* sums, const float* logits, const float* row_max,
                            const int32_t* targets, long N, int V, int64_t V0) {
  MOETRON_OP_CHECK(N >= 0 && V >= 0 && V0 >= 0, "cross_entropy_row_sums", "bad dimensions N={} V={}", N, V);
  if (N == 0) return;
  ce_row_sums_kernel<<<row_blocks(N), kThreads, 0, stream_of(ctx)>>>(sums, logits, row_max, targets, N, V, V0);
  CUDA_LAUNCHED("cross_entropy_row_sums");
}

double cross_entropy_finish(Context& ctx, float* lse, float* row_loss, const float* row_max, const double* sums,
                            const int32_t* targets, long N, float scale) {
  if (N == 0) return 0.0;
  ce_finish_kernel<<<blocks_for((size_t)N, 256), 256, 0, stream_of(ctx)>>>(lse, row_loss, row_max, sums, targets, N);
  CUDA_LAUNCHED("cross_entropy_finish");
  std::vector<float> host(N);
  copy_to_host(ctx, host.data(), row_loss, sizeof(float) * N);
  double total = 0.0;  // in row order: independent of the launch configuration
  for (long n = 0; n < N; n++) total += host[n];
  return total * (double)scale;
}

}  // namespace moetron::gpu
