// The expert FFN over a MoE plan's rows, written once for every dispatch (local, all-to-all), the
// dense FFN layers and the shared expert: the fused backend op when nothing gets in its way, else
// in pieces (grouped linears and SwiGLU) with LoRA on the gate_up and down projections
// (model/lora.h) and a frozen base (no base weight gradients).
//   h13 = x W13^T (+ s (x A13^T) B13^T),  act = swiglu(h13),  y = act W2^T (+ s (act A2^T) B2^T)
// per expert over its rows.  M rows, C hidden, I width, r LoRA rank.
#pragma once

#include "backend/backend.h"
#include "model/linear.h"

namespace moetron {

struct ExpertFfnWeights {
  // w13 [E,2I,C] (gate rows then up rows per expert), w2 [E,C,I]: the weights in the act store, their
  // gradients (f32, +=; empty: the base is frozen) and LoRA factors (A13 [E,r,C], B13 [E,2I,r], A2
  // [E,r,I], B2 [E,C,r]; a dense FFN's separate gate / up adapters: w13.lora.split).
  LinearWeights w13, w2;
  bool lora() const { return w13.lora.on() || w2.lora.on(); }
};

// What the forward keeps for the backward: h13 [M,2I], act [M,I] and, with LoRA, u13 = x A13^T
// ([M,r], or [M,2r] split) and u2 = act A2^T [M,r] (act store).
struct ExpertFfnSaved {
  Tensor h13, act, u13, u2;
  bool recompute_act = false;  // selective recompute: the backward first computes act from h13 again
};

class ExpertFfn {
 public:
  // y[M,C] (act store or f32, assign) for the plan's computed rows.
  void forward(Backend& be, Tensor y, const ExpertFfnSaved& s, Tensor x, const PlanView& plan,
               const ExpertFfnWeights& w, int C, int I);
  // dx[M,C] (act store or f32, assign) from dy[M,C] (act store); weight gradients +=.  dx must not
  // alias dy.
  void backward(Backend& be, Tensor dx, Tensor dy, const ExpertFfnSaved& s, Tensor x, const PlanView& plan,
                const ExpertFfnWeights& w, int C, int I);

 private:
  GrowableBuffer dact_, dh13_, du_;  // backward scratch (pieces)
};

}  // namespace moetron
