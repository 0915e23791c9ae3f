// The expert FFN, fused or in pieces; see expert_ffn.h.
#include "model/expert_ffn.h"

#include <algorithm>

namespace moetron {

void ExpertFfn::forward(Backend& be, Tensor y, const ExpertFfnSaved& s, Tensor x, const PlanView& plan,
                        const ExpertFfnWeights& w, int C, int I) {
  if (!w.lora()) return be.moe_experts_forward(y, s.h13, s.act, x, w.w13.w, w.w2.w, plan, C, I);
  const ops::MoePlan& p = *plan.plan;
  const long M = p.expert_offsets[p.E - p.overflow];  // the computed rows come first
  grouped_linear_forward(be, s.h13, s.u13, x, w.w13, plan, C, 2 * I);
  be.swiglu_forward(s.act, s.h13, M, I);
  grouped_linear_forward(be, y, s.u2, s.act, w.w2, plan, I, C);
}

void ExpertFfn::backward(Backend& be, Tensor dx, Tensor dy, const ExpertFfnSaved& s, Tensor x, const PlanView& plan,
                         const ExpertFfnWeights& w, int C, int I) {
  // Selective recompute: act = SwiGLU(h13) over the computed rows, as the forward wrote it.
  if (s.recompute_act) {
    const ops::MoePlan& p = *plan.plan;
    be.swiglu_forward(s.act, s.h13, p.expert_offsets[p.E - p.overflow], I);
  }
  if (!w.lora() && !w.w13.dw.empty())
    return be.moe_experts_backward(dx, w.w13.dw, w.w2.dw, dy, s.h13, s.act, x, w.w13.w, w.w2.w, plan, C, I);
  const ops::MoePlan& p = *plan.plan;
  const long M = p.N * p.K, Mc = p.expert_offsets[p.E - p.overflow];
  const Store act = be.act_store();
  const Tensor dact = dact_.get(be, act, (size_t)M * I, "expert FFN d(act)");
  const Tensor dh13 = dh13_.get(be, act, (size_t)M * 2 * I, "expert FFN d(h13)");
  const int u_width = std::max(w.w13.lora.on() ? w.w13.lora.u_width() : 0, w.w2.lora.on() ? w.w2.lora.r : 0);
  const Tensor du = w.lora() ? du_.get(be, act, (size_t)M * u_width, "LoRA d(u)") : Tensor{};
  grouped_linear_backward(be, dact, du, dy, s.act, s.u2, w.w2, plan, I, C);
  be.swiglu_backward(dh13, dact, s.h13, Mc, I);
  grouped_linear_backward(be, dx, du, dh13, x, s.u13, w.w13, plan, C, 2 * I);
}

}  // namespace moetron
