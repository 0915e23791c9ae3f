// Dropless MoE dispatch and combine, and the grouped expert FFN.
//   N tokens, C hidden, E experts, K experts per token, I expert FFN width, M = N*K routed rows.
// Tokens are permuted into expert-contiguous order (within an expert, by token index, then slot),
// each expert runs its GEMMs over its contiguous rows, and outputs are scattered back weighted by
// the router's renormalised top-K weights.  An expert with zero rows is skipped.
// Parameter gradients accumulate (+=); activation gradients assign (=).
// Experts are stored stacked: w13[E,2I,C] (per expert the gate rows w1 then the up rows w3, as
// transformers-5's gate_up_proj) and w2[E,C,I] (down), HF row-major.
#pragma once

#include <cstdint>
#include <vector>

namespace moetron::ops {

struct MoePlan {
  long N = 0;
  int E = 0, K = 0;
  std::vector<int64_t> expert_offsets;  // [E+1] row ranges of each expert in the permuted order
  std::vector<int32_t> row_token;       // [M] source token of each permuted row
  std::vector<int32_t> row_of;          // [N*K] permuted row of assignment (n, k)
  // 1: the last expert is not a real one but collects the assignments a capacity limit dropped;
  // the expert functions never compute it (its rows' outputs and input gradients are left as they
  // are).  Set by the caller after moe_plan_build (which leaves it alone); 0 by default.
  int overflow = 0;
};

// Builds the permutation from topk_idx[N,K] (counting sort; deterministic).
void moe_plan_build(MoePlan& plan, const int32_t* topk_idx, long N, int E, int K);

// xperm[M,C] = x[row_token[m], :]
void moe_permute_forward(float* xperm, const float* x, const MoePlan& plan, int C);
// dx[N,C] = sum_k dxperm[row_of[n,k], :]  (assign)
void moe_permute_backward(float* dx, const float* dxperm, const MoePlan& plan, int C);

// out[N,C] = sum_k topk_weight[n,k] * yperm[row_of[n,k], :]  (assign)
void moe_combine_forward(float* out, const float* yperm, const float* topk_weight,
                         const MoePlan& plan, int C);
// dyperm[M,C] = topk_weight[n,k] * dout[n,:];  dtopk_weight[N,K] = <dout[n,:], yperm[row_of[n,k],:]>
void moe_combine_backward(float* dyperm, float* dtopk_weight, const float* dout, const float* yperm,
                          const float* topk_weight, const MoePlan& plan, int C);

// For each expert e over its rows: h13 = x @ w13[e]^T ([rows, 2I]: gate columns then up columns,
// saved), act = silu(h13[:, :I]) * h13[:, I:] ([rows, I], saved), y[M,C] = act @ w2[e]^T.
void moe_experts_forward(float* y, float* h13, float* act, const float* xperm, const float* w13,
                         const float* w2, const MoePlan& plan, int C, int I);

// dxperm[M,C] (assign); dw13 [E,2I,C] and dw2 [E,C,I] (accumulate).  scratch: 3*M*I floats.
void moe_experts_backward(float* dxperm, float* dw13, float* dw2, float* scratch, const float* dy,
                          const float* h13, const float* act, const float* xperm, const float* w13,
                          const float* w2, const MoePlan& plan, int C, int I);

}  // namespace moetron::ops
