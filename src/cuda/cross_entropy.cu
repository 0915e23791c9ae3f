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
                                                               int V, float scale) {
  for (long n = blockIdx.x; n < N; n += gridDim.x) {
    const float* x = logits + n * V;
    bf16* d = dlogits + n * ld;
    const int32_t t = targets[n];
    const bool ignored = t == kIgnore;
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
                            const int32_t* targets, long N, int V, float scale) {
  MOETRON_OP_CHECK(N >= 0 && V > 0 && ld >= V, "cross_entropy_backward", "bad dimensions N={} V={} ld={}", N, V, ld);
  if (N == 0) return;
  ce_backward_kernel<<<row_blocks(N), kThreads, 0, stream_of(ctx)>>>(as_bf(dlogits), ld, logits, lse, targets, N, V,
                                                                     scale);
  CUDA_LAUNCHED("cross_entropy_backward");
}

}  // namespace moetron::gpu
