// The strided block copy on the device; see src/ops/copy_block.h (the CPU reference and the contract).
// One thread per (a, c); it walks b in order, so a destination shared by every b (dst_b 0, accumulate)
// sums its terms in the CPU's order.  Values are read and written as bf16 or f32 on either side.
#include "cuda/common.cuh"
#include "cuda/ops.h"

namespace moetron::gpu {

namespace {

__device__ __forceinline__ float load(const void* p, bool bf, long i) {
  return bf ? __bfloat162float(static_cast<const bf16*>(p)[i]) : static_cast<const float*>(p)[i];
}
__device__ __forceinline__ void store(void* p, bool bf, long i, float v) {
  if (bf)
    static_cast<bf16*>(p)[i] = __float2bfloat16_rn(v);
  else
    static_cast<float*>(p)[i] = v;
}

__global__ void copy_block_kernel(void* dst, bool dst_bf, const void* src, bool src_bf, ops::BlockCopy g, float alpha,
                                  bool accumulate) {
  const long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (i >= g.A * (long)g.Cn) return;
  const long a = i / g.Cn, c = i % g.Cn;
  for (int b = 0; b < g.B; b++) {
    const long d = a * g.dst_a + b * g.dst_b + g.dst_off + c, s = a * g.src_a + b * g.src_b + g.src_off + c;
    const float v = alpha * load(src, src_bf, s);
    store(dst, dst_bf, d, accumulate ? load(dst, dst_bf, d) + v : v);
  }
}

}  // namespace

void copy_block(Context& ctx, void* dst, bool dst_bf16, const void* src, bool src_bf16, const ops::BlockCopy& g,
                float alpha, bool accumulate) {
  const long n = g.A * (long)g.Cn;
  if (n == 0) return;
  copy_block_kernel<<<blocks_for(n, 256), 256, 0, stream_of(ctx)>>>(dst, dst_bf16, src, src_bf16, g, alpha,
                                                                    accumulate);
  CUDA_LAUNCHED("copy_block");
}

}  // namespace moetron::gpu
