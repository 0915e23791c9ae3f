// The grouped linear on the CPU: one sgemm per expert over its rows; see grouped_matmul.h.
#include "ops/grouped_matmul.h"

#include "core/error.h"
#include "ops/matmul.h"

namespace moetron::ops {

namespace {

void check(const MoePlan& plan, int IC, int OC, const char* op) {
  MOETRON_OP_CHECK(plan.E >= 1 && plan.expert_offsets.size() == (size_t)plan.E + 1 && IC > 0 && OC > 0, op,
                   "plan not built or bad dimensions (E={}, IC={}, OC={})", plan.E, IC, OC);
}

}  // namespace

void grouped_matmul_forward(float* out, const float* inp, const float* weight, const MoePlan& plan, int IC, int OC,
                            float alpha, bool accumulate, int ld_in, int ld_out) {
  check(plan, IC, OC, "grouped_matmul_forward");
  const long W = (long)OC * IC;
  if (ld_in == 0) ld_in = IC;
  if (ld_out == 0) ld_out = OC;
  for (int e = 0; e < plan.E - plan.overflow; e++) {
    const long off = plan.expert_offsets[e], rows = plan.expert_offsets[e + 1] - off;
    if (rows == 0) continue;
    sgemm(false, true, (int)rows, OC, IC, alpha, inp + off * ld_in, ld_in, weight + e * W, IC, accumulate ? 1.0f : 0.0f,
          out + off * ld_out, ld_out);
  }
}

void grouped_matmul_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                             const MoePlan& plan, int IC, int OC, float alpha, bool accumulate, int ld_in, int ld_out) {
  check(plan, IC, OC, "grouped_matmul_backward");
  const long W = (long)OC * IC;
  if (ld_in == 0) ld_in = IC;
  if (ld_out == 0) ld_out = OC;
  for (int e = 0; e < plan.E - plan.overflow; e++) {
    const long off = plan.expert_offsets[e], rows = plan.expert_offsets[e + 1] - off;
    if (rows == 0) continue;
    if (dweight)  // [OC, IC] += alpha * dout^T [OC, rows] @ inp [rows, IC]
      sgemm(true, false, OC, IC, (int)rows, alpha, dout + off * ld_out, ld_out, inp + off * ld_in, ld_in, 1.0f,
            dweight + e * W, IC);
    if (dinp)  // [rows, IC] = alpha * dout [rows, OC] @ weight [OC, IC]
      sgemm(false, false, (int)rows, IC, OC, alpha, dout + off * ld_out, ld_out, weight + e * W, IC,
            accumulate ? 1.0f : 0.0f, dinp + off * ld_in, ld_in);
  }
}

}  // namespace moetron::ops
