// AdamW over fp32 master weights, the global gradient norm and parameter initialisation on the
// device; see ops.h and src/optim/adamw.h (torch.optim.AdamW semantics, the arithmetic of ops/adamw.h).
#include <cmath>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/ops.h"
#include "ops/adamw.h"

namespace moetron::gpu {

namespace {

constexpr size_t kNormChunk = 1 << 16;  // gradients per block of the norm's first pass

__global__ void adamw_kernel(float* param, bf16* param_bf16, float* m, float* v, const float* grad, size_t n,
                             float grad_scale, ops::AdamWStep s) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const float p = ops::adamw_element(param[i], grad[i] * grad_scale, m[i], v[i], s);
    param[i] = p;
    if (param_bf16) param_bf16[i] = __float2bfloat16_rn(p);
  }
}

__global__ void sumsq_kernel(double* partial, const float* grad, size_t n) {
  __shared__ double red[32];
  const size_t begin = blockIdx.x * kNormChunk;
  const size_t end = begin + kNormChunk < n ? begin + kNormChunk : n;
  double s = 0.0;
  for (size_t i = begin + threadIdx.x; i < end; i += blockDim.x) s += (double)grad[i] * grad[i];
  s = block_sum_d(s, red);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

__global__ void sum_partials_kernel(double* out, const double* partial, size_t count) {
  __shared__ double red[32];
  double s = 0.0;
  for (size_t i = threadIdx.x; i < count; i += blockDim.x) s += partial[i];
  s = block_sum_d(s, red);
  if (threadIdx.x == 0) *out = s;
}

// core/rng.h on the device (same integer mixing, fp64 Box-Muller).
__device__ __forceinline__ uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}
__device__ __forceinline__ double uniform_at(uint64_t seed, uint64_t key, uint64_t index, uint64_t lane) {
  const uint64_t r = mix64(mix64(seed ^ key) + mix64(index * 2 + lane));
  return ((double)(r >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

__global__ void init_normal_kernel(float* p, size_t n, uint64_t seed, uint64_t key, double std, float fill) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    if (std == 0.0) {
      p[i] = fill;
      continue;
    }
    const double u1 = uniform_at(seed, key, i, 0), u2 = uniform_at(seed, key, i, 1);
    p[i] = (float)(std * (sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2)));
  }
}

unsigned grid_for(size_t n) {
  const unsigned b = blocks_for(n, 256);
  return b < 65536u ? b : 65536u;
}

}  // namespace

void adamw_update(Context& ctx, float* param, Bf16* param_bf16, float* m, float* v, const float* grad, size_t n,
                  float grad_scale, double lr, double beta1, double beta2, double eps, double weight_decay,
                  long step) {
  MOETRON_OP_CHECK(step >= 1, "adamw_update", "step must be >= 1, got {}", step);
  if (n == 0) return;
  adamw_kernel<<<grid_for(n), 256, 0, stream_of(ctx)>>>(param, as_bf(param_bf16), m, v, grad, n, grad_scale,
                                                        ops::adamw_step(lr, beta1, beta2, eps, weight_decay, step));
  CUDA_LAUNCHED("adamw_update");
}

size_t grad_norm_scratch_doubles(size_t n) { return (n + kNormChunk - 1) / kNormChunk + 1; }

double global_grad_norm(Context& ctx, double* scratch, const float* grad, size_t n) {
  if (n == 0) return 0.0;
  const size_t chunks = (n + kNormChunk - 1) / kNormChunk;
  MOETRON_OP_CHECK(chunks < (1u << 31), "global_grad_norm", "{} gradients are too many", n);
  sumsq_kernel<<<(unsigned)chunks, 256, 0, stream_of(ctx)>>>(scratch, grad, n);
  CUDA_LAUNCHED("global_grad_norm");
  sum_partials_kernel<<<1, 1024, 0, stream_of(ctx)>>>(scratch + chunks, scratch, chunks);
  CUDA_LAUNCHED("global_grad_norm");
  double total = 0.0;
  copy_to_host(ctx, &total, scratch + chunks, sizeof(double));
  return std::sqrt(total);
}

void init_normal(Context& ctx, float* p, size_t n, uint64_t seed, uint64_t key, double std, float fill) {
  if (n == 0) return;
  init_normal_kernel<<<grid_for(n), 256, 0, stream_of(ctx)>>>(p, n, seed, key, std, fill);
  CUDA_LAUNCHED("init_normal");
}

}  // namespace moetron::gpu
