// The dense FFN block of the layer body (Mistral, Llama, Qwen3, and the dense layers of an MoE
// model): out = down(silu(gate(ln)) * up(ln)), with LoRA on its projections (PEFT's gate_proj,
// up_proj and down_proj: model/linear.h).  It runs as one expert that every token visits with
// weight 1 (the identity plan: model/expert_ffn.h), so the fused expert op serves it.  Under tensor
// parallelism the width is split: the output (and d(ln)) is all-reduced over tp.
// Dimensions: N tokens, C hidden, I this rank's FFN width.
#pragma once

#include <vector>

#include "backend/backend.h"
#include "model/block.h"
#include "model/expert_ffn.h"
#include "ops/moe_dispatch.h"

namespace moetron {

// What the forward keeps for the backward (one micro-batch, one layer).
struct DenseFfnSaved {
  Tensor row_token, row_of;  // i32 [N]: the identity plan in backend memory
  ops::MoePlan plan;
  PlanView pv;
  ExpertFfnSaved ffn;  // h13 [N,2I], act [N,I], LoRA's u13 / u2
  std::vector<int32_t> experts;  // the plan's expert of every row (all 0)
  // Lays the tensors out (TensorCarver's two passes); then build_plan makes the identity plan.
  // training false: an inference pass's (no hidden activations on a backend that holds them itself,
  // unless adapters need them: Backend::experts_without_saved).
  void carve(TensorCarver& c, const BlockEnv& env, const ExpertFfnWeights& w, long N, int I, bool training = true);
  void build_plan(Backend& be, long N);
};

class DenseFfnBlock {
 public:
  // out[N,C] (f32, assign; all-reduced under tp).  ln [N,C] act store.
  void forward(const BlockEnv& env, Tensor out, DenseFfnSaved& s, Tensor ln, const ExpertFfnWeights& w, int I);
  // dln[N,C] (f32, assign; all-reduced under tp) from dout_act[N,C] (act store).
  void backward(const BlockEnv& env, Tensor dln, Tensor dout_act, DenseFfnSaved& s, Tensor ln,
                const ExpertFfnWeights& w, int I);

 private:
  ExpertFfn ffn_;  // backward scratch (pieces)
};

}  // namespace moetron
