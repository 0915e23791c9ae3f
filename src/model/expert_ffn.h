// The expert FFN over a MoE plan's rows, written once for every dispatch (local, all-to-all), the
// dense FFN layers and the shared expert: the fused backend op when nothing gets in its way, else
// in pieces (grouped linears and SwiGLU) with LoRA on the gate_up and down projections
// (model/lora.h) and a frozen base (no base weight gradients).
//   h13 = x W13^T (+ s (x A13^T) B13^T),  act = swiglu(h13),  y = act W2^T (+ s (act A2^T) B2^T)
// per expert over its rows.  M rows, C hidden, I width, r LoRA rank.
#pragma once

#include "backend/backend.h"

namespace moetron {

struct ExpertFfnWeights {
  Tensor w13, w2;    // [E,2I,C], [E,C,I] in the act store
  Tensor dw13, dw2;  // f32, +=; empty: the base is frozen
  // LoRA factors (act store) and their gradients (f32, +=); empty when not adapted.
  Tensor a13, b13, a2, b2;      // [E,r,C], [E,2I,r], [E,r,I], [E,C,r]
  Tensor da13, db13, da2, db2;
  int r = 0;
  float scale = 0.0f;
  // PEFT's separate gate_proj and up_proj adapters of a dense FFN / shared expert (E = 1): a13 [1, 2r, C]
  // holds the gate factor then the up factor, b13 [1, 2I, r] the gate rows then the up rows; the gate
  // rows read u13[:, :r], the up rows u13[:, r:] (u13 [M, 2r]).
  bool split13 = false;
  bool lora() const { return !a13.empty() || !a2.empty(); }
};

// What the forward keeps for the backward: h13 [M,2I], act [M,I] and, with LoRA, u13 = x A13^T
// ([M,r], or [M,2r] split) and u2 = act A2^T [M,r] (act store).
struct ExpertFfnSaved {
  Tensor h13, act, u13, u2;
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
