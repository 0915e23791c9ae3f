// The MoE block of the layer body (DESIGN §4): from the normalised input ln [N,C] to
//   out = sum_k w[n,k] expert_{idx[n,k]}(ln[n]) (+ sigmoid(ln . g) shared_expert(ln), Qwen2-MoE;
//                                                 + shared_experts(ln), DeepSeek-V3 / GLM-4.5)
// as router -> dispatch plan -> token dispatcher -> experts -> combine:
//   1. the router: logits = ln W_r^T (f32, + its LoRA), softmax over the experts, top-K, the K
//      weights renormalised (norm_topk_prob) or not -- or DeepSeek's sigmoid rule with the layer's
//      selection bias (ops/router.h, router_spec below); per-layer statistics for the losses;
//   2. the plan (model/token_dispatch.h build_dispatch_plan, host): expert-contiguous rows, dropless or
//      capacity-limited; the rows permuted into plan order;
//   3. the dispatcher runs the experts (local, or all-to-all under expert parallelism);
//   4. the rows combined on the token's rank, weighted by the router.
// Under tensor parallelism the experts are split by their width: the block's output (and d(ln) in the
// backward) is all-reduced over tp; the router runs replicated.
// Dimensions: N tokens, C hidden, E experts, K per token, M = N*K routed rows, I expert width (this
// tp rank's), Is the shared expert's.
#pragma once

#include <memory>
#include <vector>

#include "backend/backend.h"
#include "model/block.h"
#include "model/expert_ffn.h"
#include "model/linear.h"
#include "model/token_dispatch.h"
#include "ops/moe_dispatch.h"
#include "ops/router.h"

namespace moetron {

// One MoE layer's parameters as the block reads them: the router (f32, and its f32 adapter), the
// selection bias [E] f32 (sigmoid routing; no gradient), the routed experts (this rank's;
// model/expert_ffn.h), and the shared expert(s) with -- Qwen2-MoE -- its gate [1,C] (f32).
struct MoeWeights {
  LinearWeights router;
  Tensor selection_bias;
  ExpertFfnWeights experts;
  ExpertFfnWeights shared;
  LinearWeights shared_gate;
};

// The routing rule of a config (hf_config.h): softmax with norm_topk_prob, or DeepSeek's sigmoid.
ops::RouterSpec router_spec(const ModelConfig& cfg);

// What the forward keeps for the backward (one micro-batch, one layer).
struct MoeSaved {
  Tensor rlogits, rprobs;              // [N,E] f32
  Tensor topk_w, topk_idx, combine_w;  // [N,K]: f32, i32, f32 (the capacity-limited weights)
  Tensor xperm, yperm;                 // [M,C] act store, plan order
  Tensor row_token, row_of;            // i32 [M]: the plan in backend memory
  Tensor ur;                           // LoRA on the router: ln A^T [N,r] (f32)
  Tensor sh13, shact, shy, sgl, sg;    // shared expert: [N,2Is], [N,Is], [N,C] act store; gate logit, sigmoid [N] f32
  Tensor shu13, shu2;                  // LoRA on the shared expert
  bool shact_recompute = false;        // selective recompute: shact is a shared buffer the backward refills
  ops::MoePlan plan;
  PlanView pv;
  DispatchSaved dispatch;
  // Lays the tensors out (TensorCarver's two passes); local_experts: the experts' activations live
  // here (else the all-to-all dispatcher keeps them); training false: an inference pass's, whose
  // fused experts keep no hidden activations on a backend that holds them itself
  // (experts_without_saved).  Selective recompute (env.selective): the SwiGLU outputs (dispatch.act,
  // shact) are not carved; the model points them at its shared buffers.
  void carve(TensorCarver& c, const BlockEnv& env, const MoeWeights& w, long N, bool local_experts,
             bool training = true);
};

// Work buffers shared by every layer.
struct MoeScratch {
  Tensor drlogits, dtopk;       // [N,E], [N,K] f32
  Tensor dxperm, dyperm;        // [M,C] act store
  Tensor dshy, dsg, dsgl, dxs;  // shared expert: d(its output) act, d(gate), d(gate logit), d(its input) f32
  Tensor dur;                   // the router's LoRA backward [N,r] f32
  Tensor tmp;                   // [N,C] f32 (the body's: set by the model)
  void carve(TensorCarver& c, const BlockEnv& env, int router_lora_rank, long N);
};

class MoeBlock {
 public:
  // The dispatcher: all-to-all over `ep` (a group over the backend's memory, which must outlive the
  // block) when given with more than one rank, else local.
  MoeBlock(Backend& be, const ModelConfig& cfg, dist::Comm* ep, int tp_size);

  // Capacity (model/token_dispatch.h): each expert takes at most ceil(f * real tokens * K / E)
  // assignments; 0: dropless.
  void set_capacity_factor(double f) { capacity_factor_ = f; }
  // Test hook: bias[E] (f32, backend memory; empty: none) added to the router logits.
  void set_router_bias(Tensor bias) { router_bias_ = bias; }
  // The sequence-wise balance loss (moe.aux_loss sequence) over rows of row_len tokens: forward then
  // fills the statistics' per-row part (0: off).
  void set_sequence_rows(int row_len) { seq_row_len_ = row_len; }

  // out[N,C] (f32, assign; all-reduced under tp) = the block's output.  ln [N,C] act store, lnf the
  // same in f32 (ln itself when the act store is f32); token_mask u8 [N] (empty: every token real)
  // and host_mask (its host copy, or null).  stats: the layer's router statistics (real tokens; null:
  // not wanted, as in inference); returns the assignments of real tokens dropped by the capacity limit.
  long forward(const BlockEnv& env, Tensor out, MoeSaved& s, MoeScratch& sc, Tensor ln, Tensor lnf, Tensor token_mask,
               const uint8_t* host_mask, const MoeWeights& w, const PlanView& ident, ops::RouterLayerStats* stats);
  // dln[N,C] (f32, assign; all-reduced under tp) from dout[N,C] (f32).  aux_dprobs: host [E] d(aux
  // loss)/d probs of any real token (or null); z_coef and real_tokens: the router z-loss's.
  // seq_row_grad: host [B*E] (or null): the sequence loss's coefficient-weighted gradient on the
  // normalised scores of each row (losses.h RouterLossTerms), rows of set_sequence_rows' length.
  void backward(const BlockEnv& env, Tensor dln, Tensor dout, MoeSaved& s, MoeScratch& sc, Tensor ln, Tensor lnf,
                Tensor token_mask, const double* aux_dprobs, double z_coef, long real_tokens, const MoeWeights& w,
                const PlanView& ident, const std::vector<float>* seq_row_grad = nullptr);

 private:
  // Zeros the rows [M] of plan order past the computed ones (the overflow expert's: capacity drops).
  void zero_dropped_rows(Backend& be, Tensor rows, const ops::MoePlan& plan, int C);

  std::unique_ptr<TokenDispatcher> dispatch_;
  ExpertFfn shared_ffn_;  // the shared expert's backward scratch
  double capacity_factor_ = 0.0;
  Tensor router_bias_;
  int seq_row_len_ = 0;
  std::unique_ptr<Allocation> row_grad_;  // the sequence loss's [B*E] gradient in backend memory
  // Host copies of one layer's routing (device backends) and its capacity-limited weights.
  std::vector<int32_t> topk_idx_host_;
  std::vector<float> topk_w_host_, probs_host_, combine_host_;
};

}  // namespace moetron
