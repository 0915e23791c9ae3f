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
//
// Pipeline parallel (DESIGN §6): built with a layer range (a stage), the model holds those decoder
// layers, the embedding only when the range starts at layer 0, the final norm and head only when it
// ends at the last layer.  A later stage's forward starts from the previous stage's hidden states
// (StageInput) instead of the embedding; an earlier stage's forward ends with its hidden states
// (stage_output) instead of logits and loss, and its backward starts from their gradient
// (StageGrad); every stage but the first leaves the gradient of its input (input_grad) for the
// previous one.  The HF pooled load-balancing loss pools router statistics over ALL layers: each
// stage adds its layers' statistics to those it received (pooled_stats travels forward with the
// hidden states), the last stage computes the loss and its gradient per expert (input_aux_grad),
// which travels back with the hidden-state gradient so each stage applies it to its own routers.
// The per-layer aux loss and the z-loss are local to each layer's stage.
//
// Micro-batches in flight (the 1F1B schedule): forward_queued keeps the activations of earlier
// forwards that await their backward, one activation set each, and backward always runs the oldest;
// forward drops any pending ones first (evaluation, single micro-batches).
#pragma once

#include <cstdint>
#include <deque>
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

// The decoder layers a pipeline stage holds: [begin, end); end -1: to the last layer.
struct LayerRange {
  int begin = 0, end = -1;
};

// What a stage's forward starts from, besides the batch (its token ids, masks, positions and labels
// are every stage's: each stage reads the same micro-batches).
struct StageInput {
  const float* hidden = nullptr;                  // [N,C] the previous stage's output (every stage but the first)
  const ops::RouterLayerStats* pooled = nullptr;  // router statistics of the earlier stages' layers (null: none)
};

// What a stage's backward starts from (every stage but the last).
struct StageGrad {
  const float* hidden = nullptr;     // [N,C] d loss / d stage_output()
  const double* aux_grad = nullptr;  // [E] the next stage's input_aux_grad() (MoE, hf_pooled aux loss)
};

class MixtralModel {
 public:
  // tp: the tensor-parallel group (null or size 1: the whole model); it must outlive the model.
  // Collective over tp (splits the group of ranks sharing a replicated kv head).
  // ep: the expert-parallel group (null or size 1: every expert); it must outlive the model.
  // layers: the pipeline stage's decoder layers (default: all).
  explicit MixtralModel(const ModelConfig& cfg, dist::Comm* tp = nullptr, dist::Comm* ep = nullptr,
                        LayerRange layers = {});
  ~MixtralModel();
  MixtralModel(MixtralModel&&) = delete;

  const ModelConfig& config() const { return cfg_; }
  const ParamTable& table() const { return table_; }
  std::vector<float>& params() { return params_; }
  const std::vector<float>& params() const { return params_; }
  std::vector<float>& grads() { return grads_; }
  const std::vector<float>& grads() const { return grads_; }
  void zero_grads();

  int layer_begin() const { return layer_begin_; }
  int layer_end() const { return layer_end_; }
  bool first_stage() const { return layer_begin_ == 0; }
  bool last_stage() const { return layer_end_ == cfg_.num_hidden_layers; }

  // Forward pass; losses are computed when the batch has labels (on the last stage; earlier stages
  // report their layers' router losses only).  Validates the batch.  Drops pending micro-batches.
  Losses forward(const Batch& batch, const LossWeights& weights, const StageInput& in = {});
  // The same, keeping the activations of pending micro-batches (this one joins them).
  Losses forward_queued(const Batch& batch, const LossWeights& weights, const StageInput& in = {});
  // Drops the activations of every pending micro-batch (a schedule starts from none).
  void discard_pending() { pending_.clear(); }
  // d loss / d params of the OLDEST pending micro-batch accumulated into grads(); it needs a forward
  // with labels.  Overwrites its logits in place.
  void backward(const StageGrad& grad = {});

  // The newest forward's output hidden states [N,C] (every stage but the last), and the router
  // statistics pooled over the layers of this and the earlier stages (MoE models).
  const float* stage_output() const;
  const ops::RouterLayerStats& pooled_stats() const;
  // After a backward on a stage other than the first: d loss / d (its StageInput hidden) [N,C],
  // valid until the next forward or backward; and the [E] d (aux_coef * aux) / d probs of any real
  // token of any layer that backward used (computed on the last stage, received on the others; the
  // hf_pooled aux loss of an MoE model, zeros otherwise), to pass on to the previous stage.
  const float* input_grad() const;
  const std::vector<double>& input_aux_grad() const { return last_aux_grad_; }
  // Micro-batches whose activations are kept (pending a backward), now and at most since
  // construction, and the bytes of activations they held at most.
  size_t pending() const { return pending_.size(); }
  size_t peak_pending() const { return peak_pending_; }
  size_t peak_activation_bytes() const { return peak_activation_bytes_; }
  // The activation bytes one micro-batch of the newest forward's shape keeps.
  size_t activation_bytes_per_micro_batch() const;

  // Sums the gradients of replicated kv heads (NKV < tp) over the tp ranks sharing each head; call
  // once per optimizer step, after the backward passes.  A no-op otherwise.
  void reduce_replicated_grads();
  // Bytes this model's own groups sent (the replicated-kv group; the tp group is the caller's).
  uint64_t comm_bytes() const;

  // [B,T,V] logits of the last forward (until backward); [B,T,V/tp] (this rank's vocabulary
  // columns) under tensor parallelism.  Last stage only.
  const float* logits() const;
  // Time the forward/backward sections into `profile` (null: off).  The caller owns it.
  void set_profile(Profile* profile) { profile_ = profile; }

  // Routing statistics per MoE layer of this stage (layer_begin() + index) of the last forward
  // (empty for dense models).
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
  // Per MoE layer of this stage of the last forward: assignments of real tokens dropped by the
  // capacity limit.
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
  // One micro-batch's activations and per-forward inputs, kept until its backward: one arena sized
  // for its (B, T), re-laid when the shape changes.
  struct Activations {
    int B = 0, T = 0;
    std::vector<float> arena;
    std::vector<int32_t> topk_arena;
    std::vector<LayerActs> layers;  // this stage's layers
    float *x_final = nullptr, *lnf = nullptr, *rstdf = nullptr, *logits = nullptr, *lse = nullptr;
    std::vector<int32_t> tokens, targets, positions;
    std::vector<uint8_t> token_mask;
    bool has_token_mask = false, has_labels = false;
    LossWeights weights;
    ops::RouterLayerStats pooled;                 // hf_pooled: over this and the earlier stages' layers
    std::vector<double> aux_grad;                 // [E] hf_pooled d(aux_coef*aux)/d probs (all layers)
    std::vector<std::vector<double>> aux_dprobs;  // [local layer][E] d(aux_coef*aux)/d probs
    size_t bytes() const;                         // the activations kept (arenas, expert-parallel rows)
  };
  Dims dims() const;
  void allocate(Activations& a, int B, int T);
  void allocate_scratch(int B, int T);
  Activations& acquire();
  Losses run_forward(Activations& s, const Batch& batch, const LossWeights& weights, const StageInput& in);
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
  int layer_begin_ = 0, layer_end_ = 0;
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

  // Activation sets: every one allocated, the pending ones (oldest first), the newest forward's.
  std::vector<std::unique_ptr<Activations>> pool_;
  std::deque<Activations*> pending_;
  Activations* last_ = nullptr;
  size_t peak_pending_ = 0, peak_activation_bytes_ = 0;
  std::vector<double> last_aux_grad_;  // of the last backward
  // Backward scratch (and the forward's tensor-parallel partial sums), shared by every micro-batch.
  int scratch_B_ = 0, scratch_T_ = 0;
  std::vector<float> scratch_;
  float *dres_ = nullptr, *dln_ = nullptr, *tmp_ = nullptr, *datt_ = nullptr, *dq_ = nullptr, *dk_ = nullptr,
        *dv_ = nullptr, *drlogits_ = nullptr, *dtopk_ = nullptr, *dxperm_ = nullptr, *dyperm_ = nullptr,
        *ffn_scratch_ = nullptr;

  std::vector<ops::RouterLayerStats> router_stats_;  // of the last forward
  Profile* profile_ = nullptr;
};

}  // namespace moetron
