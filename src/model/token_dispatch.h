// Token dispatch (torchtitan's dispatcher / experts split): how one MoE layer's routed rows reach
// their experts and come back, written once for every backend.
//   1. build_dispatch_plan (host): the router's top-K choices become an expert-contiguous plan,
//      dropless, or with a capacity limit that drops the overflow (same rule on every device);
//   2. the model permutes the normalised tokens into xperm[M,C] in plan order;
//   3. a TokenDispatcher runs the experts on those rows: LocalDispatch when this rank holds every
//      expert, AllToAllDispatch under expert parallelism (per-expert counts exchanged, rows sent
//      to the ranks owning their experts by all_to_all_v, the outputs returned the same way);
//   4. the model combines yperm[M,C] on the token's own rank, weighted by the router.
// The backward mirrors it.  Dimension letters as in model/model.h; M = N*K routed rows, Mr rows
// received by this rank.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "core/profile.h"
#include "model/expert_ffn.h"
#include "ops/moe_dispatch.h"

namespace moetron {

namespace dist {
class Comm;
}

// The plan of one layer from host copies of the router's choices: topk_idx[N,K], topk_w[N,K],
// probs[N,E] (read only with a capacity limit), token_mask[N] (null: every token is real).
// capacity_factor f > 0: each expert takes at most ceil(f * real tokens * K / E) assignments; the
// overflow (padding first, then the lowest router probability, ties: the later assignment) goes
// to an overflow expert (plan.overflow = 1) that is never computed, and combine_w receives topk_w
// with 0 for the dropped assignments.  f = 0: dropless (combine_w is left empty).
// Returns the dropped assignments of real tokens.
long build_dispatch_plan(ops::MoePlan& plan, std::vector<float>& combine_w, const int32_t* topk_idx,
                         const float* topk_w, const float* probs, const uint8_t* token_mask, long N, int E, int K,
                         double capacity_factor);

// What one layer's dispatch keeps from its forward for its backward (one per micro-batch).
struct DispatchSaved {
  Tensor h13, act;  // local: [M,2I], [M,I] in plan order (set by the model)
  Tensor u13, u2;   // local, LoRA on experts: [M,r] each (set by the model)
  bool recompute_act = false;  // local, selective recompute: act is a shared buffer the backward refills
  // Expert parallel: rows per peer, the received rows in expert-major order with their FFN
  // activations, the local plan (K = 1) over them, and the reorderings of the exchange.
  std::vector<size_t> send_rows, recv_rows;
  ops::MoePlan local;
  std::vector<int32_t> to_expert_major, to_source_major;  // [Mr] gather indices each way
  GrowableBuffer rows_buf, h13_buf, act_buf, index_buf, u13_buf, u2_buf;
  Tensor rows, ep_h13, ep_act;                            // [Mr,C], [Mr,2I], [Mr,I]
  Tensor ep_u13, ep_u2;                                   // LoRA: [Mr,r] each
  Tensor expert_major_idx, source_major_idx, local_rows;  // i32 [Mr] each; local_rows [2*Mr]
  PlanView local_view;
  // The bytes this micro-batch's exchange keeps (received rows, their activations, the indices).
  size_t bytes() const {
    return rows.nbytes() + ep_h13.nbytes() + ep_act.nbytes() + ep_u13.nbytes() + ep_u2.nbytes() +
           expert_major_idx.nbytes() + source_major_idx.nbytes() + local_rows.nbytes();
  }
};

class TokenDispatcher {
 public:
  virtual ~TokenDispatcher() = default;
  // yperm[M,C] (act store) = experts(xperm[M,C]) for the plan's computed rows (the overflow rows
  // are left as they are); w: this rank's experts (model/expert_ffn.h).  Collective over the
  // expert-parallel group.
  // profile: where the dispatcher times its sections (null: nowhere).
  virtual void forward(DispatchSaved& s, Tensor yperm, Tensor xperm, const PlanView& plan, const ExpertFfnWeights& w,
                       Profile* profile) = 0;
  // dxperm[M,C] (assign, computed rows) from dyperm[M,C]; the weight gradients of w accumulate every
  // row this rank's experts saw (all the ep group's tokens under expert parallelism).
  virtual void backward(Tensor dxperm, Tensor dyperm, DispatchSaved& s, Tensor xperm, const PlanView& plan,
                        const ExpertFfnWeights& w, Profile* profile) = 0;
};

// Every expert on this rank.
std::unique_ptr<TokenDispatcher> make_local_dispatch(Backend& be, int C, int I);
// Experts [r E/ep, (r+1) E/ep) on ep rank r of `ep` (a group on the backend's memory; its host()
// group carries the counts).  `ep` must outlive the dispatcher.
std::unique_ptr<TokenDispatcher> make_all_to_all_dispatch(Backend& be, dist::Comm& ep, int C, int I, int E);

}  // namespace moetron
