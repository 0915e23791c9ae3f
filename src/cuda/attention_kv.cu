// Attention of new query rows over a KV cache on the device (inference); see ops.h and
// src/ops/attention_kv.cpp.  One warp per (query row, head): the lanes hold the head's dimensions
// (d = lane + 32 t), each key's score is a warp-wide dot product, and an online softmax in fp32
// (running max and sum) rescales the output accumulator as the keys are read in order.  Decode steps
// have few rows, so the work is spread over rows and heads, and the keys stream once per head.
#include <cmath>

#include "cuda/common.cuh"
#include "cuda/ops.h"

namespace moetron::gpu {

namespace {

constexpr int kMaxPerLane = 8;  // HD <= 256
constexpr int kWarpsPerBlock = 4;

__device__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__global__ void attention_kv_kernel(bf16* out, const bf16* q, const bf16* k, const bf16* v, int n, int pos0, int window,
                                    int NH, int NKV, int HD, float scale) {
  const long item = (long)blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (item >= (long)n * NH) return;
  const int i = (int)(item / NH), h = (int)(item % NH), g = h / (NH / NKV), p = pos0 + i;
  const int lo = window > 0 ? max(0, p - window + 1) : 0;
  const long KV = (long)NKV * HD;
  const bf16* qh = q + ((long)i * NH + h) * HD;
  float qr[kMaxPerLane], acc[kMaxPerLane];
  for (int t = 0; t < kMaxPerLane; t++) {
    const int d = lane + 32 * t;
    qr[t] = d < HD ? __bfloat162float(qh[d]) : 0.0f;
    acc[t] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  for (int j = lo; j <= p; j++) {
    const bf16* kj = k + (long)j * KV + (long)g * HD;
    float s = 0.0f;
    for (int t = 0; t < kMaxPerLane; t++) {
      const int d = lane + 32 * t;
      if (d < HD) s += qr[t] * __bfloat162float(kj[d]);
    }
    s = warp_sum(s) * scale;
    const float m_new = fmaxf(m, s);
    const float corr = expf(m - m_new), pj = expf(s - m_new);
    l = l * corr + pj;
    const bf16* vj = v + (long)j * KV + (long)g * HD;
    for (int t = 0; t < kMaxPerLane; t++) {
      const int d = lane + 32 * t;
      if (d < HD) acc[t] = acc[t] * corr + pj * __bfloat162float(vj[d]);
    }
    m = m_new;
  }
  bf16* o = out + ((long)i * NH + h) * HD;
  for (int t = 0; t < kMaxPerLane; t++) {
    const int d = lane + 32 * t;
    if (d < HD) o[d] = __float2bfloat16_rn(acc[t] / l);
  }
}

}  // namespace

void attention_kv_forward(Context& ctx, Bf16* out, const Bf16* q, const Bf16* k, const Bf16* v, int n, int pos0,
                          int sliding_window, int NH, int NKV, int HD) {
  const char* op = "attention_kv_forward";
  MOETRON_OP_CHECK(n >= 0 && pos0 >= 0 && NH > 0 && NKV > 0 && NH % NKV == 0 && HD > 0 && HD <= 32 * kMaxPerLane, op,
                   "bad dimensions n={} pos0={} NH={} NKV={} HD={} (HD at most {})", n, pos0, NH, NKV, HD,
                   32 * kMaxPerLane);
  if (n == 0) return;
  const long warps = (long)n * NH;
  const unsigned blocks = (unsigned)((warps + kWarpsPerBlock - 1) / kWarpsPerBlock);
  attention_kv_kernel<<<blocks, 32 * kWarpsPerBlock, 0, stream_of(ctx)>>>(
      as_bf(out), as_bf(q), as_bf(k), as_bf(v), n, pos0, sliding_window, NH, NKV, HD, 1.0f / std::sqrt((float)HD));
  CUDA_LAUNCHED(op);
}

}  // namespace moetron::gpu
