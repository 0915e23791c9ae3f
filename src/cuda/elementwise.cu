// Element-wise kernels and data movement of the CUDA backend; see ops.h.
#include "cuda/common.cuh"
#include "cuda/ops.h"

namespace moetron::gpu {

namespace {

unsigned grid_for(size_t n) {
  const unsigned b = blocks_for(n, 256);
  return b < 65536u ? b : 65536u;
}

__global__ void add_kernel(float* y, const float* x, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    y[i] += x[i];
}

__global__ void add_bias_rows_kernel(float* x, const float* bias, size_t n, int E) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    x[i] += bias[i % E];
}

// One block per row; 16-byte words when the row allows it.
__global__ void gather_rows_kernel(char* out, const char* in, const int32_t* index, long rows, size_t row_bytes) {
  for (long m = blockIdx.x; m < rows; m += gridDim.x) {
    const char* src = in + (size_t)index[m] * row_bytes;
    char* dst = out + (size_t)m * row_bytes;
    if (row_bytes % 16 == 0 && ((uintptr_t)src & 15u) == 0 && ((uintptr_t)dst & 15u) == 0) {
      const int4* s = reinterpret_cast<const int4*>(src);
      int4* d = reinterpret_cast<int4*>(dst);
      for (size_t i = threadIdx.x; i < row_bytes / 16; i += blockDim.x) d[i] = s[i];
    } else {
      for (size_t i = threadIdx.x; i < row_bytes; i += blockDim.x) dst[i] = src[i];
    }
  }
}

// One block per segment: a fixed tree (per-thread strided sums, then the block reduction), so the
// result does not change from run to run.
__global__ void sum_squares_kernel(double* partial, const float* values, const int64_t* begin, const int64_t* end,
                                   size_t segments) {
  __shared__ double red[32];
  for (size_t s = blockIdx.x; s < segments; s += gridDim.x) {
    double acc = 0.0;
    for (int64_t i = begin[s] + threadIdx.x; i < end[s]; i += blockDim.x) acc += (double)values[i] * values[i];
    acc = block_sum_d(acc, red);
    if (threadIdx.x == 0) partial[s] = acc;
  }
}

}  // namespace

void add_f32(Context& ctx, float* y, const float* x, size_t n) {
  if (n == 0) return;
  add_kernel<<<grid_for(n), 256, 0, stream_of(ctx)>>>(y, x, n);
  CUDA_LAUNCHED("add_f32");
}

void add_bias_rows(Context& ctx, float* x, const float* bias, long N, int E) {
  MOETRON_OP_CHECK(N >= 0 && E > 0, "add_bias_rows", "bad dimensions N={} E={}", N, E);
  const size_t n = (size_t)N * E;
  if (n == 0) return;
  add_bias_rows_kernel<<<grid_for(n), 256, 0, stream_of(ctx)>>>(x, bias, n, E);
  CUDA_LAUNCHED("add_bias_rows");
}

void gather_rows(Context& ctx, void* out, const void* in, const int32_t* index, long rows, size_t row_bytes) {
  MOETRON_OP_CHECK(rows >= 0, "gather_rows", "bad row count {}", rows);
  if (rows == 0 || row_bytes == 0) return;
  const unsigned blocks = (unsigned)(rows < (1 << 20) ? rows : (1 << 20));
  gather_rows_kernel<<<blocks, 128, 0, stream_of(ctx)>>>(static_cast<char*>(out), static_cast<const char*>(in), index,
                                                         rows, row_bytes);
  CUDA_LAUNCHED("gather_rows");
}

void sum_squares_segments(Context& ctx, double* partial, const float* values, const int64_t* begin,
                          const int64_t* end, size_t segments) {
  if (segments == 0) return;
  const unsigned blocks = (unsigned)(segments < (1u << 20) ? segments : (1u << 20));
  sum_squares_kernel<<<blocks, 256, 0, stream_of(ctx)>>>(partial, values, begin, end, segments);
  CUDA_LAUNCHED("sum_squares_segments");
}

}  // namespace moetron::gpu
