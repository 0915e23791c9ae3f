// The Mixtral decoder (and dense Mistral/Llama through the same code) on CPU: forward and backward
// as flat, mirror-image lists of op calls over one parameter table.
//   h = x + Attn(RMSNorm(x)); out = h + FFN(RMSNorm(h)); final RMSNorm; untied lm_head.
// Dimensions: B batch, T sequence, N = B*T tokens, C hidden, NH heads, NKV kv heads, HD head dim,
// Q = NH*HD, KV = NKV*HD, E experts (1 for dense), K experts per token (1 for dense),
// M = N*K routed rows, I FFN width, L layers, V vocab.
//
// Tensor parallel (Megatron, DESIGN §6): built with a tp group of size > 1, the model holds its
// rank's part of the parameter table (ParamShard, params.h) -- query heads, kv heads (or one
// replicated kv head when NKV < tp), FFN rows I/tp, vocabulary rows -- and communicates over the
// group: the embedding output, the attention and FFN block outputs (row-parallel o / w2) and the
// head's input gradient are all-reduced; the cross-entropy is vocabulary-parallel; the router and
// the norms run replicated on identical inputs, so their gradients agree on every tp rank without
// communication.  With no group (or a group of one) the code path is exactly the single-process one.
//
// Expert parallel (DESIGN §6): built with an ep group of size > 1 (the ranks of one expert-parallel
// group, each with its own tokens), the model holds experts [r*E/ep, (r+1)*E/ep) of every MoE layer
// (ep rank r).  Each MoE layer routes locally (the router is replicated), exchanges per-expert row
// counts over the group, sends each routed row to the rank owning its expert (all_to_all_v), runs
// the local experts on the rows received (grouped by local expert, then source rank), and returns
// the outputs with the reverse all_to_all_v; the combine (weighted by the router) happens on the
// token's home rank.  The backward mirrors it: output gradients travel to the expert owners and
// input gradients come back.  Dropless; zero rows to or from any rank are fine.  Every rank of the
// group must call forward/backward the same number of times (they are collective over ep).  Expert
// gradients then hold the contributions of every token of the ep group; the caller sums them over
// the ranks holding the same experts (edp).  Composes with tp: the ep group is made of ranks with the
// same tp rank, whose expert slices match.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/profile.h"
#include "io/hf_config.h"
#include "model/params.h"
#include "ops/moe_dispatch.h"
#include "ops/router.h"

namespace moetron {

namespace dist {
class Comm;
}

// One micro-batch.  All tensors are [B,T] row-major; optional ones are empty when absent.
struct Batch {
  int B = 0, T = 0;
  std::vector<int32_t> input_ids;
  std::vector<int32_t> labels;          // HF-aligned: the model shifts; -100 = ignored
  std::vector<int32_t> attention_mask;  // 1 = real token (right padding)
  std::vector<int32_t> position_ids;    // default: 0..T-1, restarting per segment when segment_ids given
  std::vector<int32_t> segment_ids;     // packed documents: attention stays within a segment, and
                                        // the last token of a segment has no target
};

enum class AuxLossKind { hf_pooled, per_layer };

// How the loss terms are weighted.  loss = ce_scale * CE_sum + aux_coef * aux + z_coef * z.
// For one batch ce_scale = 1 / (loss tokens in the batch); under gradient accumulation the trainer
// passes 1 / (loss tokens in the global batch) and divides the aux/z coefficients by the number of
// micro-batches.
struct LossWeights {
  double ce_scale = 1.0;
  double aux_coef = 0.0;
  double z_coef = 0.0;
  AuxLossKind aux_kind = AuxLossKind::hf_pooled;
};

struct Losses {
  double ce_sum = 0;     // sum of token cross-entropies
  long loss_tokens = 0;  // tokens with a target
  double ce_loss = 0;    // ce_scale * ce_sum
  double aux_loss = 0;   // unweighted load-balancing loss (0 for dense models)
  double z_loss = 0;     // unweighted router z-loss
  double loss = 0;       // the objective: ce_loss + aux_coef * aux_loss + z_coef * z_loss
};

// Number of positions whose target (the next token's label in the same segment) is not ignored.
long count_loss_tokens(const Batch& batch);

class MixtralModel {
 public:
  // tp: the tensor-parallel group (null or size 1: the whole model); it must outlive the model.
  // Collective over tp (splits the group of ranks sharing a replicated kv head).
  // ep: the expert-parallel group (null or size 1: every expert); it must outlive the model.
  explicit MixtralModel(const ModelConfig& cfg, dist::Comm* tp = nullptr, dist::Comm* ep = nullptr);
  ~MixtralModel();
  MixtralModel(MixtralModel&&) = delete;

  const ModelConfig& config() const { return cfg_; }
  const ParamTable& table() const { return table_; }
  std::vector<float>& params() { return params_; }
  const std::vector<float>& params() const { return params_; }
  std::vector<float>& grads() { return grads_; }
  const std::vector<float>& grads() const { return grads_; }
  void zero_grads();

  // Forward pass; losses are computed when the batch has labels.  Validates the batch.
  Losses forward(const Batch& batch, const LossWeights& weights);
  // d loss / d params accumulated into grads(); requires a forward with labels just before.
  // Overwrites the logits in place.
  void backward();

  // Sums the gradients of replicated kv heads (NKV < tp) over the tp ranks sharing each head; call
  // once per optimizer step, after the backward passes.  A no-op otherwise.
  void reduce_replicated_grads();
  // Bytes this model's own groups sent (the replicated-kv group; the tp group is the caller's).
  uint64_t comm_bytes() const;

  // [B,T,V] logits of the last forward (until backward); [B,T,V/tp] (this rank's vocabulary
  // columns) under tensor parallelism.
  const float* logits() const { return logits_; }
  // Time the forward/backward sections into `profile` (null: off).  The caller owns it.
  void set_profile(Profile* profile) { profile_ = profile; }

  // Routing statistics per MoE layer of the last forward (empty for dense models).
  const std::vector<ops::RouterLayerStats>& router_stats() const { return router_stats_; }

  // Test hook: bias[E] added to the router logits of every MoE layer (skews the routing; the
  // gradient is unchanged: the bias is a constant).  Empty: none.
  void set_router_bias(std::vector<float> bias);

  // Capacity (DESIGN §4): with factor f > 0, each expert of a layer takes at most
  // ceil(f * real tokens * K / E) assignments of a micro-batch (per rank, before any expert-parallel
  // exchange); the overflow is dropped, padding first, then the lowest router probability (ties:
  // the later token).  A dropped assignment contributes nothing to the token's output (the other
  // weights are not renormalised).  0: dropless (the default).
  void set_capacity_factor(double f) { capacity_factor_ = f; }
  // Per MoE layer of the last forward: assignments of real tokens dropped by the capacity limit.
  const std::vector<long>& dropped() const { return dropped_; }

 private:
  // The expert-parallel exchange of one MoE layer (ep > 1).  Rows received are kept twice over:
  // in source-major order (as they arrive: source rank, then local expert) and in expert-major
  // order (local expert, then source rank) for the grouped GEMMs; perm maps the first to the second.
  struct EpLayer {
    std::vector<size_t> send_rows, recv_rows;  // [ep] rows to / from each rank
    std::vector<int64_t> perm;                 // [Mr] expert-major row of each received row
    ops::MoePlan plan;                         // local experts over the Mr received rows (K = 1)
    std::vector<float> x, h13, act;            // [Mr,C], [Mr,2I], [Mr,I] expert-major, saved
  };
  struct LayerActs {
    float *x, *ln1, *rstd1, *q, *k, *v, *probs, *att, *h, *ln2, *rstd2;
    float *rlogits, *rprobs, *topk_w;
    int32_t* topk_idx;
    float *xperm, *h13, *act, *yperm;
    ops::MoePlan plan;
    EpLayer ep;
    std::vector<float> combine_w;  // [N,K] topk_w with 0 for dropped assignments (capacity only)
  };
  // The dimension letters of this model (E = K = 1 for a dense FFN), per tensor-parallel rank:
  // V, I, NH, NKV, Q, KVd are this rank's parts (the whole model when tp = 1).
  struct Dims {
    int C, V, I, NH, NKV, HD, Q, KVd, E, K;
    bool moe;
  };
  Dims dims() const;
  void allocate(int B, int T);
  bool tp_on() const { return tp_size_ > 1; }
  void tp_all_reduce(float* x, long n);
  bool ep_on() const { return ep_size_ > 1; }
  // Sends the rows of xperm (global plan order) to their experts' owners: fills a.ep (counts,
  // permutation, local plan) and a.ep.x.
  void ep_dispatch(LayerActs& a, int C, int El);
  // Rows in expert-major order (y_local[Mr, C]) back to their home ranks, into out[M, C] (global
  // plan order).
  void ep_return(float* out, const float* y_local, const EpLayer& ep, int C);
  // Rows in global plan order (in[M, C]) to the expert owners, into out_local[Mr, C] expert-major.
  void ep_send(float* out_local, const float* in, const EpLayer& ep, int C);

  ModelConfig cfg_;
  dist::Comm* tp_ = nullptr;
  int tp_size_ = 1;
  dist::Comm* ep_ = nullptr;
  int ep_size_ = 1;
  std::vector<float> router_bias_;
  double capacity_factor_ = 0.0;
  std::vector<long> dropped_;
  // Drops the overflow of layer a (capacity_factor_ > 0): builds a.plan with an overflow expert
  // and a.combine_w; returns the dropped assignments of real tokens.
  long apply_capacity(LayerActs& a, const uint8_t* token_mask, long N, int E, int K);
  // Expert-parallel scratch: one message in source-major order, and expert-major gradients.
  std::vector<float> ep_buf_, ep_dy_, ep_dx_, ep_scratch_;
  std::unique_ptr<dist::Comm> kv_comm_;  // ranks sharing a replicated kv head (NKV < tp)
  ParamTable table_;
  std::vector<float> params_, grads_;

  // Activations: one arena sized for the current (B, T), re-laid when the shape changes.
  int B_ = 0, T_ = 0;
  std::vector<float> arena_;
  std::vector<int32_t> topk_arena_;
  std::vector<LayerActs> layers_;
  float *x_final_ = nullptr, *lnf_ = nullptr, *rstdf_ = nullptr, *logits_ = nullptr, *lse_ = nullptr;
  // Backward scratch, inside the same arena.
  float *dres_ = nullptr, *dln_ = nullptr, *tmp_ = nullptr, *datt_ = nullptr, *dq_ = nullptr,
        *dk_ = nullptr, *dv_ = nullptr, *drlogits_ = nullptr, *dtopk_ = nullptr, *dxperm_ = nullptr,
        *dyperm_ = nullptr, *ffn_scratch_ = nullptr;

  // Per-forward inputs kept for the backward.
  std::vector<int32_t> tokens_, targets_, positions_;
  std::vector<uint8_t> token_mask_;
  bool has_token_mask_ = false;
  bool has_labels_ = false;
  LossWeights weights_;
  std::vector<ops::RouterLayerStats> router_stats_;
  std::vector<std::vector<double>> aux_dprobs_;  // [L][E] d(aux_coef*aux)/d probs
  bool forward_done_ = false;
  Profile* profile_ = nullptr;
};

}  // namespace moetron
