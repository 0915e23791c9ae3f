// The grouped linear: each expert's contiguous rows of a MoE plan times that expert's weight, in
// the HF nn.Linear convention (weight[E, OC, IC], row = output).  The building block of LoRA on
// experts (model/lora.h) and of an expert FFN that is not fused into moe_experts_forward; a dense
// projection is the one-expert identity plan.  Rows of the plan's overflow expert (capacity drops)
// are not touched.  alpha scales the product (BLAS's alpha: the LoRA scaling rides on it).
// Parameter gradients accumulate (+=); activation gradients assign (=) unless `accumulate`.
#pragma once

#include "ops/moe_dispatch.h"

namespace moetron::ops {

// Row strides: ld_in for inp / dinp (IC when 0), ld_out for out / dout (OC when 0) -- so a column
// block of a wider matrix (the gate or the up half of h13) is an operand.
// out[m, :OC] (= or += when accumulate) alpha * inp[m, :IC] @ weight[e]^T for the rows m of expert e.
void grouped_matmul_forward(float* out, const float* inp, const float* weight, const MoePlan& plan, int IC, int OC,
                            float alpha, bool accumulate, int ld_in = 0, int ld_out = 0);

// dinp[m, :IC] (= or += when accumulate) alpha * dout[m] @ weight[e] (skipped when dinp is null);
// dweight[e] += alpha * dout[rows of e]^T @ inp[rows of e] (skipped when dweight is null).
void grouped_matmul_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                             const MoePlan& plan, int IC, int OC, float alpha, bool accumulate, int ld_in = 0,
                             int ld_out = 0);

}  // namespace moetron::ops
