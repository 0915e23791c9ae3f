// Dropless MoE dispatch / combine and the grouped expert FFN on the device; see ops.h and
// src/ops/moe_dispatch.h.  N tokens, C hidden, E experts, K experts per token, I FFN width,
// M = N*K routed rows.  Parameter gradients accumulate (+=); activation gradients assign (=)
// unless `accumulate` is passed.
//
// The plan is the CPU's counting sort: expert-contiguous rows, within an expert ordered by
// (token, slot).  One block counts the experts' rows; then one block per expert scans the
// assignments in order (ballot + warp-prefix scan) and writes its rows, so the permutation is
// deterministic and identical to ops::moe_plan_build.
#include "cuda/common.cuh"
#include "cuda/grouped_gemm.h"
#include "cuda/ops.h"

namespace moetron::gpu {

namespace {

constexpr int kMaxE = 256;  // as the router's

// offsets[E+1] (exclusive prefix sum of the row counts), one block of 1024 threads.
__global__ void plan_count_kernel(int64_t* offsets, const int32_t* topk_idx, long M, int E) {
  __shared__ unsigned long long count[kMaxE];
  for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
  __syncthreads();
  for (long i = threadIdx.x; i < M; i += blockDim.x) {
    const int e = topk_idx[i];
    if (e >= 0 && e < E) atomicAdd(&count[e], 1ull);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t acc = 0;
    offsets[0] = 0;
    for (int e = 0; e < E; e++) {
      acc += (int64_t)count[e];
      offsets[e + 1] = acc;
    }
  }
}

// Block e writes the rows of expert e: row_token[row] = i / K, row_of[i] = row, in order of i.
__global__ void plan_scatter_kernel(int32_t* row_token, int32_t* row_of, const int64_t* offsets,
                                    const int32_t* topk_idx, long M, int K) {
  __shared__ int warp_total[32];
  const int e = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  long next = offsets[e];
  for (long start = 0; start < M; start += blockDim.x) {
    const long i = start + threadIdx.x;
    const bool flag = i < M && topk_idx[i] == e;
    const unsigned ballot = __ballot_sync(0xffffffffu, flag);
    const int in_warp = __popc(ballot & ((1u << lane) - 1u));
    if (lane == 0) warp_total[warp] = __popc(ballot);
    __syncthreads();
    if (warp == 0) {
      int v = lane < nwarps ? warp_total[lane] : 0;
      for (int o = 1; o < 32; o <<= 1) {
        const int up = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += up;
      }
      if (lane < nwarps) warp_total[lane] = v;  // inclusive prefix over warps
    }
    __syncthreads();
    const int warp_base = warp == 0 ? 0 : warp_total[warp - 1];
    const int chunk_total = warp_total[nwarps - 1];
    if (flag) {
      const long row = next + warp_base + in_warp;
      row_token[row] = (int32_t)(i / K);
      row_of[i] = (int32_t)row;
    }
    next += chunk_total;
    __syncthreads();  // warp_total is rewritten by the next chunk
  }
}

__global__ void permute_forward_kernel(bf16* xperm, const bf16* x, const int32_t* row_token, long M, int C,
                                       bool vec) {
  for (long m = blockIdx.x; m < M; m += gridDim.x) {
    const bf16* src = x + (long)row_token[m] * C;
    bf16* dst = xperm + m * C;
    if (vec) {  // 16-byte copies: C % 8 == 0 and both bases 16-byte aligned
      for (int c = threadIdx.x * 8; c < C; c += blockDim.x * 8)
        *reinterpret_cast<uint4*>(dst + c) = *reinterpret_cast<const uint4*>(src + c);
    } else {
      for (int c = threadIdx.x; c < C; c += blockDim.x) dst[c] = src[c];
    }
  }
}

__global__ void permute_backward_kernel(float* dx, const bf16* dxperm, const int32_t* row_of, long N, int K, int C,
                                        bool accumulate) {
  for (long n = blockIdx.x; n < N; n += gridDim.x) {
    float* d = dx + n * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      float s = 0.0f;
      for (int k = 0; k < K; k++) s += __bfloat162float(dxperm[(long)row_of[n * K + k] * C + c]);
      d[c] = accumulate ? d[c] + s : s;
    }
  }
}

__global__ void combine_forward_kernel(float* out, const bf16* yperm, const float* topk_weight,
                                       const int32_t* row_of, long N, int K, int C) {
  for (long n = blockIdx.x; n < N; n += gridDim.x) {
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      float s = 0.0f;
      for (int k = 0; k < K; k++)
        s += topk_weight[n * K + k] * __bfloat162float(yperm[(long)row_of[n * K + k] * C + c]);
      out[n * C + c] = s;
    }
  }
}

__global__ void combine_backward_kernel(bf16* dyperm, float* dtopk_weight, const float* dout, const bf16* yperm,
                                        const float* topk_weight, const int32_t* row_of, long N, int K, int C) {
  __shared__ float red[32];
  for (long n = blockIdx.x; n < N; n += gridDim.x) {
    const float* g = dout + n * C;
    for (int k = 0; k < K; k++) {
      const long row = row_of[n * K + k];
      const float w = topk_weight[n * K + k];
      const bf16* y = yperm + row * C;
      bf16* dy = dyperm + row * C;
      float dot = 0.0f;
      for (int c = threadIdx.x; c < C; c += blockDim.x) {
        dy[c] = __float2bfloat16_rn(w * g[c]);
        dot += g[c] * __bfloat162float(y[c]);
      }
      dot = block_sum(dot, red);
      if (threadIdx.x == 0) dtopk_weight[n * K + k] = dot;
    }
  }
}

unsigned row_blocks(long rows) { return (unsigned)(rows < (1 << 20) ? (rows > 0 ? rows : 1) : (1 << 20)); }

void check_plan(const MoePlanDevice& plan, const char* op) {
  MOETRON_OP_CHECK(plan.E >= 1 && plan.K >= 1 && plan.N >= 0 && plan.row_token && plan.row_of &&
                       plan.expert_offsets.size() == (size_t)plan.E + 1 && (plan.overflow == 0 || plan.overflow == 1),
                   op, "plan is not built (N={}, E={}, K={})", plan.N, plan.E, plan.K);
}

}  // namespace

void moe_plan_build(Context& ctx, MoePlanDevice& plan, int32_t* row_token, int32_t* row_of, int64_t* scratch,
                    const int32_t* topk_idx, long N, int E, int K) {
  const char* op = "moe_plan_build";
  MOETRON_OP_CHECK(N >= 0 && N <= INT32_MAX, op, "token count N={} out of range", N);
  MOETRON_OP_CHECK(E >= 1 && E <= kMaxE && K >= 1 && K <= E, op, "need 1 <= K <= E <= {}, got E={} K={}", kMaxE, E,
                   K);
  const long M = N * K;
  MOETRON_OP_CHECK(M <= INT32_MAX, op, "N*K = {} routed rows exceed int32", M);
  plan.N = N;
  plan.E = E;
  plan.K = K;
  plan.overflow = 0;
  plan.row_token = row_token;
  plan.row_of = row_of;
  plan.expert_offsets.assign(E + 1, 0);
  if (M == 0) return;
  plan_count_kernel<<<1, 1024, 0, stream_of(ctx)>>>(scratch, topk_idx, M, E);
  CUDA_LAUNCHED(op);
  plan_scatter_kernel<<<E, 1024, 0, stream_of(ctx)>>>(row_token, row_of, scratch, topk_idx, M, K);
  CUDA_LAUNCHED(op);
  copy_to_host(ctx, plan.expert_offsets.data(), scratch, sizeof(int64_t) * (E + 1));
  MOETRON_OP_CHECK(plan.expert_offsets[E] == M, op, "top-k indices outside [0, E={}): {} of {} rows placed", E,
                   plan.expert_offsets[E], M);
}

void moe_permute_forward(Context& ctx, Bf16* xperm, const Bf16* x, const MoePlanDevice& plan, int C) {
  check_plan(plan, "moe_permute_forward");
  const long M = plan.N * plan.K;
  if (M == 0) return;
  const bool vec = C % 8 == 0 && (reinterpret_cast<uintptr_t>(xperm) & 15u) == 0 &&
                   (reinterpret_cast<uintptr_t>(x) & 15u) == 0;
  permute_forward_kernel<<<row_blocks(M), 128, 0, stream_of(ctx)>>>(as_bf(xperm), as_bf(x), plan.row_token, M, C,
                                                                    vec);
  CUDA_LAUNCHED("moe_permute_forward");
}

void moe_permute_backward(Context& ctx, float* dx, const Bf16* dxperm, const MoePlanDevice& plan, int C,
                          bool accumulate) {
  check_plan(plan, "moe_permute_backward");
  if (plan.N == 0) return;
  permute_backward_kernel<<<row_blocks(plan.N), 256, 0, stream_of(ctx)>>>(dx, as_bf(dxperm), plan.row_of, plan.N,
                                                                          plan.K, C, accumulate);
  CUDA_LAUNCHED("moe_permute_backward");
}

void moe_combine_forward(Context& ctx, float* out, const Bf16* yperm, const float* topk_weight,
                         const MoePlanDevice& plan, int C) {
  check_plan(plan, "moe_combine_forward");
  if (plan.N == 0) return;
  combine_forward_kernel<<<row_blocks(plan.N), 256, 0, stream_of(ctx)>>>(out, as_bf(yperm), topk_weight, plan.row_of,
                                                                         plan.N, plan.K, C);
  CUDA_LAUNCHED("moe_combine_forward");
}

void moe_combine_backward(Context& ctx, Bf16* dyperm, float* dtopk_weight, const float* dout, const Bf16* yperm,
                          const float* topk_weight, const MoePlanDevice& plan, int C) {
  check_plan(plan, "moe_combine_backward");
  if (plan.N == 0) return;
  combine_backward_kernel<<<row_blocks(plan.N), 256, 0, stream_of(ctx)>>>(
      as_bf(dyperm), dtopk_weight, dout, as_bf(yperm), topk_weight, plan.row_of, plan.N, plan.K, C);
  CUDA_LAUNCHED("moe_combine_backward");
}

void moe_experts_forward(Context& ctx, void* y, DType y_dtype, Bf16* h13, Bf16* act, const Bf16* xperm,
                         const Bf16* w13, const Bf16* w2, const MoePlanDevice& plan, int C, int I) {
  check_plan(plan, "moe_experts_forward");
  MOETRON_OP_CHECK(y_dtype == DType::BF16 || y_dtype == DType::F32, "moe_experts_forward", "output dtype must be BF16 or F32 (got {})",
                   (int)y_dtype);
  const int E = plan.E - plan.overflow;  // the overflow expert is never computed
  const long M = plan.expert_offsets[E];  // the computed rows come first
  const long IC = (long)I * C;
  const size_t ys = y_dtype == DType::BF16 ? 2 : 4;
  const bf16* x = as_bf(xperm);
  const bf16* W13 = as_bf(w13);
  const bf16* W2 = as_bf(w2);
  bf16* H13 = as_bf(h13);
  bf16* ACT = as_bf(act);
  char* Y = static_cast<char*>(y);
  // Each projection of every expert in one launch where the grouped GEMM serves it (grouped_gemm.h).
  const bool grouped13 = grouped_gemm_bf16(ctx, true, H13, x, W13, plan.expert_offsets, E, 2 * I, C, C, 2 * I, 1.0f, 0.0f);
  for (int e = 0; e < E && !grouped13; e++) {
    const long off = plan.expert_offsets[e], rows = plan.expert_offsets[e + 1] - off;
    if (rows == 0) continue;
    // h13[rows, 2I] = x[rows, C] @ w13[e]^T
    gemm(ctx, false, true, (int)rows, 2 * I, C, 1.0f, x + off * C, C, W13 + e * 2 * IC, C, 0.0f, H13 + off * 2 * I,
         2 * I, DType::BF16, DType::BF16);
  }
  if (M > 0) swiglu_forward(ctx, act, h13, M, I);
  if (y_dtype == DType::BF16 && grouped_gemm_bf16(ctx, true, y, ACT, W2, plan.expert_offsets, E, C, I, I, C, 1.0f, 0.0f))
    return;
  for (int e = 0; e < E; e++) {
    const long off = plan.expert_offsets[e], rows = plan.expert_offsets[e + 1] - off;
    if (rows == 0) continue;
    // y[rows, C] = act[rows, I] @ w2[e]^T
    gemm(ctx, false, true, (int)rows, C, I, 1.0f, ACT + off * I, I, W2 + e * IC, I, 0.0f, Y + off * C * ys, C,
         DType::BF16, y_dtype);
  }
}

void moe_experts_backward(Context& ctx, void* dxperm, DType dx_dtype, float* dw13, float* dw2, Bf16* scratch,
                          const Bf16* dy, const Bf16* h13, const Bf16* act, const Bf16* xperm, const Bf16* w13,
                          const Bf16* w2, const MoePlanDevice& plan, int C, int I) {
  check_plan(plan, "moe_experts_backward");
  MOETRON_OP_CHECK(dx_dtype == DType::BF16 || dx_dtype == DType::F32, "moe_experts_backward", "output dtype must be BF16 or F32 (got {})",
                   (int)dx_dtype);
  const int E = plan.E - plan.overflow;
  const long M = plan.expert_offsets[E];
  const long Mall = plan.N * plan.K;
  const long IC = (long)I * C;
  const size_t xs = dx_dtype == DType::BF16 ? 2 : 4;
  bf16* dact = as_bf(scratch);                 // [M, I]
  bf16* dh13 = as_bf(scratch) + Mall * I;      // [M, 2I]
  const bf16* DY = as_bf(dy);
  const bf16* ACT = as_bf(act);
  const bf16* X = as_bf(xperm);
  const bf16* W13 = as_bf(w13);
  const bf16* W2 = as_bf(w2);
  char* DX = static_cast<char*>(dxperm);
  // Every expert's dy is consumed here, before dxperm (which may alias dy) is written below.
  const bool grouped_dact = grouped_gemm_bf16(ctx, false, dact, DY, W2, plan.expert_offsets, E, I, C, C, I, 1.0f, 0.0f);
  for (int e = 0; e < E; e++) {
    const long off = plan.expert_offsets[e], rows = plan.expert_offsets[e + 1] - off;
    if (rows == 0) continue;
    // y = act @ w2^T:  dact[rows, I] = dy[rows, C] @ w2[e][C, I];  dw2[e] += dy^T @ act
    if (!grouped_dact)
      gemm(ctx, false, false, (int)rows, I, C, 1.0f, DY + off * C, C, W2 + e * IC, I, 0.0f, dact + off * I, I,
           DType::BF16, DType::BF16);
    gemm(ctx, true, false, C, I, (int)rows, 1.0f, DY + off * C, C, ACT + off * I, I, 1.0f, dw2 + e * IC, I,
         DType::BF16, DType::F32);
  }
  if (M > 0) swiglu_backward(ctx, reinterpret_cast<Bf16*>(dh13), reinterpret_cast<Bf16*>(dact), h13, M, I);
  // dw13[e] += dh13^T @ x per expert (a whole [2I, C] product each), then d x of every expert (one
  // grouped launch where it serves: grouped_gemm.h); neither reads what the other writes.
  for (int e = 0; e < E; e++) {
    const long off = plan.expert_offsets[e], rows = plan.expert_offsets[e + 1] - off;
    if (rows == 0) continue;
    gemm(ctx, true, false, 2 * I, C, (int)rows, 1.0f, dh13 + off * 2 * I, 2 * I, X + off * C, C, 1.0f,
         dw13 + e * 2 * IC, C, DType::BF16, DType::F32);
  }
  if (dx_dtype == DType::BF16 &&
      grouped_gemm_bf16(ctx, false, DX, dh13, W13, plan.expert_offsets, E, C, 2 * I, 2 * I, C, 1.0f, 0.0f))
    return;
  for (int e = 0; e < E; e++) {
    const long off = plan.expert_offsets[e], rows = plan.expert_offsets[e + 1] - off;
    if (rows == 0) continue;
    // h13 = x @ w13^T:  dx[rows, C] = dh13[rows, 2I] @ w13[e][2I, C];  dw13[e] += dh13^T @ x
    gemm(ctx, false, false, (int)rows, C, 2 * I, 1.0f, dh13 + off * 2 * I, 2 * I, W13 + e * 2 * IC, C, 0.0f,
         DX + off * C * xs, C, DType::BF16, dx_dtype);
  }
}

}  // namespace moetron::gpu
