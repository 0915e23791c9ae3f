// The expert FFN, fused or in pieces; see expert_ffn.h.
#include "model/expert_ffn.h"

namespace moetron {

void ExpertFfn::forward(Backend& be, Tensor y, const ExpertFfnSaved& s, Tensor x, const PlanView& plan,
                        const ExpertFfnWeights& w, int C, int I) {
  if (!w.lora()) return be.moe_experts_forward(y, s.h13, s.act, x, w.w13, w.w2, plan, C, I);
  const ops::MoePlan& p = *plan.plan;
  const long M = p.expert_offsets[p.E - p.overflow];  // the computed rows come first
  be.grouped_matmul_forward(s.h13, x, w.w13, plan, C, 2 * I, 1.0f, false);
  if (!w.a13.empty() && w.split13) {  // gate rows from u13[:, :r], up rows from u13[:, r:]
    const int r = w.r;
    const size_t Ir = (size_t)I * r;
    be.grouped_matmul_forward(s.u13, x, w.a13, plan, C, 2 * r, 1.0f, false);
    be.grouped_matmul_forward(s.h13, s.u13, w.b13.part(0, Ir), plan, r, I, w.scale, true, 2 * r, 2 * I);
    be.grouped_matmul_forward(s.h13.part(I, s.h13.numel - I), s.u13.part(r, s.u13.numel - r), w.b13.part(Ir, Ir), plan,
                              r, I, w.scale, true, 2 * r, 2 * I);
  } else if (!w.a13.empty()) {
    be.grouped_matmul_forward(s.u13, x, w.a13, plan, C, w.r, 1.0f, false);
    be.grouped_matmul_forward(s.h13, s.u13, w.b13, plan, w.r, 2 * I, w.scale, true);
  }
  be.swiglu_forward(s.act, s.h13, M, I);
  be.grouped_matmul_forward(y, s.act, w.w2, plan, I, C, 1.0f, false);
  if (!w.a2.empty()) {
    be.grouped_matmul_forward(s.u2, s.act, w.a2, plan, I, w.r, 1.0f, false);
    be.grouped_matmul_forward(y, s.u2, w.b2, plan, w.r, C, w.scale, true);
  }
}

void ExpertFfn::backward(Backend& be, Tensor dx, Tensor dy, const ExpertFfnSaved& s, Tensor x, const PlanView& plan,
                         const ExpertFfnWeights& w, int C, int I) {
  if (!w.lora() && !w.dw13.empty())
    return be.moe_experts_backward(dx, w.dw13, w.dw2, dy, s.h13, s.act, x, w.w13, w.w2, plan, C, I);
  const ops::MoePlan& p = *plan.plan;
  const long M = p.N * p.K, Mc = p.expert_offsets[p.E - p.overflow];
  const Store act = be.act_store();
  const Tensor dact = dact_.get(be, act, (size_t)M * I, "expert FFN d(act)");
  const Tensor dh13 = dh13_.get(be, act, (size_t)M * 2 * I, "expert FFN d(h13)");
  const Tensor du = w.lora() ? du_.get(be, act, (size_t)M * w.r * (w.split13 ? 2 : 1), "LoRA d(u)") : Tensor{};
  // y = act W2^T + s u2 B2^T, u2 = act A2^T
  be.grouped_matmul_backward(dact, w.dw2, dy, s.act, w.w2, plan, I, C, 1.0f, false);
  if (!w.a2.empty()) {
    be.grouped_matmul_backward(du, w.db2, dy, s.u2, w.b2, plan, w.r, C, w.scale, false);
    be.grouped_matmul_backward(dact, w.da2, du, s.act, w.a2, plan, I, w.r, 1.0f, true);
  }
  be.swiglu_backward(dh13, dact, s.h13, Mc, I);
  // h13 = x W13^T + s u13 B13^T, u13 = x A13^T
  be.grouped_matmul_backward(dx, w.dw13, dh13, x, w.w13, plan, C, 2 * I, 1.0f, false);
  if (!w.a13.empty() && w.split13) {
    const int r = w.r;
    const size_t Ir = (size_t)I * r, n = du.numel;
    be.grouped_matmul_backward(du, w.db13.part(0, Ir), dh13, s.u13, w.b13.part(0, Ir), plan, r, I, w.scale, false,
                               2 * r, 2 * I);
    be.grouped_matmul_backward(du.part(r, n - r), w.db13.part(Ir, Ir), dh13.part(I, dh13.numel - I),
                               s.u13.part(r, s.u13.numel - r), w.b13.part(Ir, Ir), plan, r, I, w.scale, false, 2 * r,
                               2 * I);
    be.grouped_matmul_backward(dx, w.da13, du, x, w.a13, plan, C, 2 * r, 1.0f, true);
  } else if (!w.a13.empty()) {
    be.grouped_matmul_backward(du, w.db13, dh13, s.u13, w.b13, plan, w.r, 2 * I, w.scale, false);
    be.grouped_matmul_backward(dx, w.da13, du, x, w.a13, plan, C, w.r, 1.0f, true);
  }
}

}  // namespace moetron
