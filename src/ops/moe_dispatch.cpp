// Dropless MoE dispatch / combine and the grouped expert FFN; see moe_dispatch.h.
//   N tokens, C hidden, E experts, K experts per token, I expert FFN width, M = N*K routed rows.
// Parameter gradients accumulate (+=); activation gradients assign (=).
// Threading: permute and combine run OpenMP loops over tokens (or rows) in which each iteration
// writes only its own outputs and sums over k in slot order, so results do not depend on the
// thread count.  The expert GEMMs are issued from a serial loop over experts, never from inside
// an OpenMP region: OpenBLAS (pthread build) parallelises each GEMM itself.
#include "ops/moe_dispatch.h"

#include <climits>
#include <cstring>

#include "core/error.h"
#include "ops/matmul.h"
#include "ops/swiglu.h"

namespace moetron::ops {

namespace {

// Below this many elements (rows x C elements) a parallel region costs more than it saves.
constexpr long kParallelMin = 1 << 15;

void check_plan(const MoePlan& plan, const char* op) {
  MOETRON_OP_CHECK(plan.E >= 1 && plan.K >= 1 && plan.N >= 0, op,
                   "plan is not built (N={}, E={}, K={})", plan.N, plan.E, plan.K);
  const size_t M = (size_t)plan.N * (size_t)plan.K;
  MOETRON_OP_CHECK(plan.expert_offsets.size() == (size_t)plan.E + 1 && plan.row_token.size() == M &&
                       plan.row_of.size() == M,
                   op, "plan arrays have inconsistent sizes for N={}, E={}, K={}", plan.N, plan.E,
                   plan.K);
}

}  // namespace

void moe_plan_build(MoePlan& plan, const int32_t* topk_idx, long N, int E, int K) {
  MOETRON_OP_CHECK(N >= 0 && N <= INT32_MAX, "moe_plan_build", "token count N={} out of range", N);
  MOETRON_OP_CHECK(E >= 1 && K >= 1 && K <= E, "moe_plan_build", "need 1 <= K <= E, got E={} K={}",
                   E, K);
  const long M = N * K;
  MOETRON_OP_CHECK(M <= INT32_MAX, "moe_plan_build", "N*K = {} routed rows exceed int32", M);
  plan.N = N;
  plan.E = E;
  plan.K = K;
  plan.expert_offsets.assign(E + 1, 0);
  plan.row_token.resize(M);
  plan.row_of.resize(M);
  // counting sort: histogram, exclusive prefix sum, then a stable scatter in (token, slot) order
  for (long i = 0; i < M; i++) {
    const int32_t e = topk_idx[i];
    MOETRON_OP_CHECK(e >= 0 && e < E, "moe_plan_build", "topk_idx[{},{}] = {} is outside [0, E={})",
                     i / K, i % K, e, E);
    plan.expert_offsets[e + 1]++;
  }
  for (int e = 0; e < E; e++) plan.expert_offsets[e + 1] += plan.expert_offsets[e];
  std::vector<int64_t> cursor(plan.expert_offsets.begin(), plan.expert_offsets.end() - 1);
  for (long i = 0; i < M; i++) {
    const int64_t row = cursor[topk_idx[i]]++;
    plan.row_token[row] = (int32_t)(i / K);
    plan.row_of[i] = (int32_t)row;
  }
}

void moe_permute_forward(float* xperm, const float* x, const MoePlan& plan, int C) {
  check_plan(plan, "moe_permute_forward");
  const long M = plan.N * plan.K;
#pragma omp parallel for schedule(static) if (M * C >= kParallelMin)
  for (long m = 0; m < M; m++)
    std::memcpy(xperm + m * C, x + (long)plan.row_token[m] * C, sizeof(float) * C);
}

void moe_permute_backward(float* dx, const float* dxperm, const MoePlan& plan, int C) {
  check_plan(plan, "moe_permute_backward");
  const int K = plan.K;
#pragma omp parallel for schedule(static) if (plan.N * K * (long)C >= kParallelMin)
  for (long n = 0; n < plan.N; n++) {
    float* d = dx + n * C;
    std::memcpy(d, dxperm + (long)plan.row_of[n * K] * C, sizeof(float) * C);
    for (int k = 1; k < K; k++) {
      const float* src = dxperm + (long)plan.row_of[n * K + k] * C;
      for (int c = 0; c < C; c++) d[c] += src[c];
    }
  }
}

void moe_combine_forward(float* out, const float* yperm, const float* topk_weight,
                         const MoePlan& plan, int C) {
  check_plan(plan, "moe_combine_forward");
  const int K = plan.K;
#pragma omp parallel for schedule(static) if (plan.N * K * (long)C >= kParallelMin)
  for (long n = 0; n < plan.N; n++) {
    float* o = out + n * C;
    for (int k = 0; k < K; k++) {
      const float w = topk_weight[n * K + k];
      const float* y = yperm + (long)plan.row_of[n * K + k] * C;
      if (k == 0)
        for (int c = 0; c < C; c++) o[c] = w * y[c];
      else
        for (int c = 0; c < C; c++) o[c] += w * y[c];
    }
  }
}

void moe_combine_backward(float* dyperm, float* dtopk_weight, const float* dout, const float* yperm,
                          const float* topk_weight, const MoePlan& plan, int C) {
  check_plan(plan, "moe_combine_backward");
  const int K = plan.K;
#pragma omp parallel for schedule(static) if (plan.N * K * (long)C >= kParallelMin)
  for (long n = 0; n < plan.N; n++) {
    const float* g = dout + n * C;
    for (int k = 0; k < K; k++) {
      const long row = plan.row_of[n * K + k];
      const float w = topk_weight[n * K + k];
      const float* y = yperm + row * C;
      float* dy = dyperm + row * C;
      double dot = 0.0;
      for (int c = 0; c < C; c++) {
        dy[c] = w * g[c];
        dot += (double)g[c] * (double)y[c];
      }
      dtopk_weight[n * K + k] = (float)dot;
    }
  }
}

void moe_experts_forward(float* y, float* h13, float* act, const float* xperm, const float* w13,
                         const float* w2, const MoePlan& plan, int C, int I) {
  check_plan(plan, "moe_experts_forward");
  const long IC = (long)I * C;
  for (int e = 0; e < plan.E - plan.overflow; e++) {
    const long off = plan.expert_offsets[e];
    const long rows = plan.expert_offsets[e + 1] - off;
    if (rows == 0) continue;
    float* h13e = h13 + off * 2 * I;
    float* acte = act + off * I;
    matmul_forward(h13e, xperm + off * C, w13 + e * 2 * IC, (int)rows, C, 2 * I);  // [rows,2I]
    swiglu_forward(acte, h13e, rows, I);                                              // [rows,I]
    matmul_forward(y + off * C, acte, w2 + e * IC, (int)rows, I, C);                 // [rows,C]
  }
}

void moe_experts_backward(float* dxperm, float* dw13, float* dw2, float* scratch, const float* dy,
                          const float* h13, const float* act, const float* xperm, const float* w13,
                          const float* w2, const MoePlan& plan, int C, int I) {
  check_plan(plan, "moe_experts_backward");
  const long IC = (long)I * C;
  const long M = plan.N * plan.K;
  float* dact_all = scratch;          // [M,I]
  float* dh13_all = scratch + M * I;  // [M,2I]
  for (int e = 0; e < plan.E - plan.overflow; e++) {
    const long off = plan.expert_offsets[e];
    const long rows = plan.expert_offsets[e + 1] - off;
    if (rows == 0) continue;
    const int r = (int)rows;
    float* dact = dact_all + off * I;
    float* dh13 = dh13_all + off * 2 * I;
    // y = act @ w2^T: dact = dy @ w2, dw2 += dy^T @ act
    matmul_backward(dact, dw2 + e * IC, dy + off * C, act + off * I, w2 + e * IC, r, I, C);
    // act = silu(gate) * up
    swiglu_backward(dh13, dact, h13 + off * 2 * I, rows, I);
    // h13 = x @ w13^T: dx = dh13 @ w13, dw13 += dh13^T @ x
    matmul_backward(dxperm + off * C, dw13 + e * 2 * IC, dh13, xperm + off * C, w13 + e * 2 * IC, r, C, 2 * I);
  }
}

}  // namespace moetron::ops
