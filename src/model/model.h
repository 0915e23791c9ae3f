// The model: every supported family (Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE, Mistral, Llama, Qwen3)
// as one layer body -- forward and backward as flat, mirror-image lists of block calls over one
// parameter table -- written ONCE over a Backend (backend/backend.h) -- the CPU backend (fp32), the
// bf16-rounding CPU backend, the CUDA backend (bf16 storage, fp32 accumulation) -- which owns the
// memory and supplies the kernels.
//   h = x + Attn(RMSNorm(x)); out = h + FFN(RMSNorm(h)); final RMSNorm; lm_head (or, with
//   tie_word_embeddings, the embedding matrix: one stage must then hold both ends).
// The blocks (model/block.h): the attention block (model/attention_block.h), the MoE block (router ->
// dispatch plan -> token dispatcher -> experts -> combine, plus the shared expert: model/moe_block.h),
// the dense FFN (model/dense_ffn.h), and the linear layer, the one place a LoRA adapter is applied
// (model/linear.h).  A family is its config, its tensor names, and which blocks with which options
// each layer uses -- never a second body.
// Dimensions: B batch, T sequence, N = B*T tokens, C hidden, NH heads, NKV kv heads, HD head dim,
// Q = NH*HD, KV = NKV*HD, E experts (1 for dense), K experts per token (1 for dense),
// M = N*K routed rows, I FFN width, L layers, V vocab.
//
// Precision: parameters, gradients, the residual stream, norm statistics, router tensors and
// logits are f32 on every backend; activations that feed GEMMs and the GEMM weights are in the
// backend's act store (f32 on the CPU, bf16 on CUDA; the bf16 GEMM weights are a copy of the fp32
// masters, refreshed at the first forward after the parameters change).  The router runs in f32
// end to end (an f32 copy of its normalised input on backends whose act store is bf16).
// Host work written once for every backend: batch preparation (model/batch.h), routing plans and
// the capacity limit (model/token_dispatch.h), loss assembly (model/losses.h).
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
// (ep rank r) and its token dispatch is the all-to-all one (model/token_dispatch.h).  Every rank of
// the group must call forward/backward the same number of times (they are collective over ep).
// Expert gradients then hold the contributions of every token of the ep group; the caller sums them
// over the ranks holding the same experts (edp).  Composes with tp: the ep group is made of ranks
// with the same tp rank, whose expert slices match.
// The tp and ep groups are Comms over the BACKEND's memory (dist/staged_comm.h for a device backend
// over MPI); their host() groups carry counts.
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
#include <span>
#include <vector>

#include "backend/backend.h"
#include "core/profile.h"
#include "io/hf_config.h"
#include "model/attention_block.h"
#include "model/batch.h"
#include "model/block.h"
#include "model/dense_ffn.h"
#include "model/expert_ffn.h"
#include "model/linear.h"
#include "model/lora.h"
#include "model/losses.h"
#include "model/moe_block.h"
#include "model/params.h"
#include "model/recompute.h"
#include "model/token_dispatch.h"
#include "model/weight_provider.h"
#include "ops/moe_dispatch.h"
#include "ops/router.h"

namespace moetron {

namespace dist {
class Comm;
}

// The decoder layers a pipeline stage holds: [begin, end); end -1: to the last layer.
struct LayerRange {
  int begin = 0, end = -1;
};

// What a stage's forward starts from, besides the batch (its token ids, masks, positions and labels
// are every stage's: each stage reads the same micro-batches).
struct StageInput {
  const float* hidden = nullptr;                  // [N,C] in backend memory: the previous stage's output
                                                  // (every stage but the first)
  const ops::RouterLayerStats* pooled = nullptr;  // router statistics of the earlier stages' layers (null: none)
};

// What a stage's backward starts from (every stage but the last).
struct StageGrad {
  const float* hidden = nullptr;     // [N,C] in backend memory: d loss / d stage_output()
  const double* aux_grad = nullptr;  // [E] host: the next stage's input_aux_grad() (MoE, hf_pooled aux loss)
};

class Model {
 public:
  // The model on its own CPU backend (fp32).  tp: the tensor-parallel group (null or size 1: the
  // whole model); ep: the expert-parallel group (null or size 1: every expert); both must outlive
  // the model.  Collective over tp (splits the group of ranks sharing a replicated kv head).
  // layers: the pipeline stage's decoder layers (default: all).
  // lora: adapters on a frozen base (model/lora.h; rank 0: none, the whole model trains).
  explicit Model(const ModelConfig& cfg, dist::Comm* tp = nullptr, dist::Comm* ep = nullptr, LayerRange layers = {},
                 const LoraSpec& lora = {});
  // The model on `backend`, which must outlive it; tp / ep are groups over the backend's memory.
  Model(Backend& backend, const ModelConfig& cfg, dist::Comm* tp = nullptr, dist::Comm* ep = nullptr,
        LayerRange layers = {}, const LoraSpec& lora = {});
  // A whole model over weights it does not hold (inference over a checkpoint used in place; the
  // provider -- infer/model.h InferenceModel -- must outlive the model): no parameters, gradients or
  // GEMM copies of its own; infer() and forward() read the provider's tensors, whose stores the
  // backend must take (Store::stored: a CPU inference backend).  The parameter accessors are Errors.
  Model(Backend& backend, const WeightProvider& weights);
  ~Model();
  Model(Model&&) = delete;

  const ModelConfig& config() const { return cfg_; }
  const ParamTable& table() const { return table_; }
  Backend& backend() { return be_; }

  // LoRA (model/lora.h): the base (table(), params()) is frozen -- it has no gradients (grad_tensor()
  // is empty) -- and the adapters are what trains: the train_* accessors name the adapter table and
  // its arrays with LoRA, the base's otherwise, so an optimizer over train_table() serves both.
  bool lora_on() const { return lora_.on(); }
  // The frozen base is kept in bf16 (LoraSpec::base_bf16): params() is unavailable (use
  // get_params / set_params, which round to bf16).
  bool base_in_bf16() const { return base16_; }
  const LoraSpec& lora_spec() const { return lora_; }
  const ParamTable& train_table() const { return lora_table_ ? *lora_table_ : table_; }
  Tensor train_param_tensor();  // marks them changed
  Tensor train_param_view() const { return lora_table_ ? lparams_t_ : params_t_; }
  Tensor train_grad_tensor() { return lora_table_ ? lgrads_t_ : grads_t_; }
  void get_train_params(float* host) const;
  void set_train_params(const float* host);
  // The adapters' PEFT initialisation (lora.h init_lora_parameters) in the backend's memory.
  void init_lora(uint64_t seed);

  // Parameters and gradients: table().total() f32 each, in the backend's memory.  param_tensor()
  // marks the parameters changed (the GEMM weight copy is refreshed at the next forward).
  Tensor param_tensor();
  Tensor grad_tensor() { return grads_t_; }
  // The parameters for reading only (the GEMM weight copy stays valid).
  Tensor param_view() const { return params_t_; }
  // Host copies, on any backend.
  void get_params(float* host) const;
  void set_params(const float* host);
  // One HF tensor of table() from host values (t.numel floats; rounded to bf16 for a bf16 base): a
  // base loads tensor by tensor without a whole-model host copy.
  void set_param_tensor(const HfTensorRef& t, const float* host);
  void get_grads(float* host) const;
  // moetron::init_parameters (params.h) in the backend's memory: the same counter RNG, so any
  // backend and any shard hold the same values (a device evaluates the fp64 maths itself).
  void init_parameters(uint64_t seed);
  // Host-memory backends only (an Error otherwise): the arrays themselves.  The non-const
  // params() marks the parameters changed.
  std::vector<float>& params();
  const std::vector<float>& params() const;
  std::vector<float>& grads();
  const std::vector<float>& grads() const;
  // Zeros the trained gradients (train_grad_tensor()).
  void zero_grads();
  // For inference only (infer()): frees the gradients' memory; backward() is then an Error.
  void release_gradients();

  // Aux-loss-free balancing (DeepSeek-V3's, sigmoid routers): MoE layer l's selection bias
  // (e_score_correction_bias, a buffer of the table) moves by rate * sign(mean load - load[e]), with
  // load[e] the tokens routed to expert e, summed over every rank that routed tokens (so every rank
  // moves it alike).  The arithmetic is f32 on the host: bitwise the same on every backend.
  void update_selection_bias(int l, const std::vector<double>& load, double rate);
  // Layer l's selection bias (host copy).
  std::vector<float> selection_bias(int l) const;

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

  // The newest forward's output hidden states [N,C] in backend memory (every stage but the last),
  // and the router statistics pooled over the layers of this and the earlier stages (MoE models).
  const float* stage_output() const;
  const ops::RouterLayerStats& pooled_stats() const;
  // After a backward on a stage other than the first: d loss / d (its StageInput hidden) [N,C] in
  // backend memory, valid until the next forward or backward; and the [E] d (aux_coef * aux) / d
  // probs of any real token of any layer that backward used (computed on the last stage, received
  // on the others; the hf_pooled aux loss of an MoE model, zeros otherwise), to pass on to the
  // previous stage.
  const float* input_grad() const;
  const std::vector<double>& input_aux_grad() const { return last_aux_grad_; }
  // Micro-batches whose activations are kept (pending a backward), now and at most since
  // construction, and the bytes of activations they held at most.
  size_t pending() const { return pending_.size(); }
  size_t peak_pending() const { return peak_pending_; }
  size_t peak_activation_bytes() const { return peak_activation_bytes_; }
  // The activation bytes one micro-batch of the newest forward's shape keeps.
  size_t activation_bytes_per_micro_batch() const;
  // Backend memory the model holds: parameters, gradients and the GEMM weight copy; activations
  // and scratch (every set allocated).
  size_t state_bytes() const;
  size_t activation_bytes() const;

  // Sums the gradients of replicated kv heads (NKV < tp) over the tp ranks sharing each head, and
  // the per-head q/k norm weights' (each tp rank's covers its own heads) over the tp group; call
  // once per optimizer step, after the backward passes.  A no-op otherwise.
  void reduce_replicated_grads();
  // Bytes this model's own groups sent (the replicated-kv group; the tp group is the caller's).
  uint64_t comm_bytes() const;

  // [B,T,V] logits of the last forward (until backward); [B,T,V/tp] (this rank's vocabulary
  // columns) under tensor parallelism.  Last stage only.  logits(): host-memory backends;
  // download_logits: any.
  const float* logits() const;
  void download_logits(float* host) const;
  // Time the forward/backward sections into `profile` (null: off; device backends synchronise
  // around each section).  The caller owns it.
  void set_profile(Profile* profile);

  // ---- inference over KV caches: the same layer body -------------------------------------------
  // One sequence's part of an inference pass: its `rows` consecutive rows are its positions pos0 ..
  // pos0+rows-1; k[l] / v[l]: its cache's tensors of layer l ([capacity, NKV*HD] in the act store,
  // capacity >= pos0 + rows), whose first pos0 rows hold the earlier positions.
  struct InferSequence {
    int pos0 = 0, rows = 0;
    const Tensor* k = nullptr;
    const Tensor* v = nullptr;
  };
  // One pass over tokens [n] (host): the rows of `seqs` in order (their rows sum to n), every row's
  // key and value written into its sequence's cache.  logits [logit_rows.size(), V] (host, f32): the
  // rows listed (ascending).  The embedding, each layer's attention over the caches, FFN and the head
  // are the blocks training runs (no labels, no statistics, nothing kept).  A whole model only (no
  // tp, pp or ep).  Error for a token outside the vocabulary (nothing written).
  void infer(std::span<const InferSequence> seqs, std::span<const int32_t> tokens, std::span<const int> logit_rows,
             float* logits);

  // Routing statistics per layer of this stage (layer_begin() + index) of the last forward (empty
  // for dense models; zeros for the dense layers of an MoE model).
  const std::vector<ops::RouterLayerStats>& router_stats() const { return router_stats_; }

  // Activation recompute (model/recompute.h; train.recompute): what each micro-batch keeps for its
  // backward.  Losses and gradients are the same bit for bit in every mode.  Drops the activation sets
  // (an Error while micro-batches are pending).
  void set_recompute(Recompute r);
  Recompute recompute() const { return recompute_; }

  // Test hook: bias[E] added to the router logits of every MoE layer (skews the routing; the
  // gradient is unchanged: the bias is a constant).  Empty: none.
  void set_router_bias(std::vector<float> bias);

  // Capacity (DESIGN §4; build_dispatch_plan): with factor f > 0, each expert of a layer takes at
  // most ceil(f * real tokens * K / E) assignments of a micro-batch (per rank, before any
  // expert-parallel exchange); the overflow is dropped, padding first, then the lowest router
  // probability (ties: the later token).  A dropped assignment contributes nothing to the token's
  // output (the other weights are not renormalised).  0: dropless (the default).
  void set_capacity_factor(double f) {
    if (moe_) moe_->set_capacity_factor(f);
  }
  // Per layer of this stage of the last forward (0 for dense layers): assignments of real tokens
  // dropped by the capacity limit.
  const std::vector<long>& dropped() const { return dropped_; }

 private:
  struct LayerActs {
    bool moe = false;                           // a routed MoE block (else a dense FFN)
    Tensor x, ln1, rstd1, h, ln2, ln2f, rstd2;  // ln2f: the router's f32 input (ln2 when act is f32)
    AttentionSaved attn;
    MoeSaved moe_saved;   // MoE layers
    DenseFfnSaved dense;  // dense layers
  };
  // The dimension letters of this model (E = K = 1 for a dense FFN), per tensor-parallel rank:
  // V, I, NH, NKV, Q, KVd are this rank's parts (the whole model when tp = 1).  I is the experts'
  // width; moe: the model has MoE layers.  Per layer: layer_moe(l), ffn_width(l) (this rank's part).
  struct Dims {
    int C, V, I, NH, NKV, HD, Q, KVd, E, K;
    bool moe;
  };
  bool layer_moe(int l) const { return cfg_.is_moe_layer(l); }
  int ffn_width(int l) const { return cfg_.ffn_size(l) / tp_size_; }
  // One micro-batch's activations and per-forward inputs, kept until its backward: one allocation
  // sized for its (B, T), re-laid when the shape changes.
  struct Activations {
    int B = 0, T = 0;
    std::unique_ptr<Allocation> arena;
    std::vector<LayerActs> layers;  // this stage's layers
    Tensor x_final, lnf, rstdf, logits, lse;
    Tensor tokens, targets, positions, token_mask, attention_mask, segment_ids;  // backend copies
    // The identity plan (every token one row, weight 1): the shared expert's and LoRA's on the
    // attention projections and the router (a grouped linear of one group).
    ops::MoePlan ident_plan;
    PlanView ident_pv;
    Tensor ident_rt, ident_ro;
    AttnMask amask;
    PreparedBatch prep;
    LossWeights weights;
    RouterLossTerms router;  // pooled statistics and the aux-loss gradients of this forward
    size_t bytes() const;    // the activations kept (the arena, expert-parallel rows)
  };
  void init(dist::Comm* tp, dist::Comm* ep, LayerRange layers, const LoraSpec& lora);
  Dims dims() const;
  BlockEnv env() const {
    return BlockEnv{be_, cfg_, tp_, tp_size_, profile_, false, recompute_ == Recompute::selective};
  }
  void allocate(Activations& a, int B, int T);
  // Lays out layer lg's tensors of a (B, T) micro-batch (its input x only: input_only).
  void carve_layer(TensorCarver& c, LayerActs& a, int lg, int B, int T, bool input_only);
  void allocate_scratch(int B, int T);
  Activations& acquire();
  Losses run_forward(Activations& s, const Batch& batch, const LossWeights& weights, const StageInput& in);
  // recomputing: the forward run again before the layer's backward (full recompute): nothing recorded
  // (statistics, dropped counts), no profile sections of its own.
  void layer_forward(Activations& s, int l, Tensor x_next, bool recomputing = false);
  void layer_backward(Activations& s, int l);
  // Layer l's tensors of micro-batch s as the blocks read them: its own set, with the shared buffers
  // of selective recompute attached, or (full recompute) the work set of its kind with its kept input.
  LayerActs& layer_acts(Activations& s, int l);
  // The recompute mode's buffers for a micro-batch shape: full, one layer's work set per kind of
  // layer (MoE, or dense of a width) and the output of a recomputed layer; selective, the shared
  // attention state and SwiGLU outputs.  Re-laid when the shape changes.
  void allocate_recompute(int B, int T);
  bool tp_on() const { return tp_size_ > 1; }
  void tp_all_reduce(Tensor x);
  bool ep_on() const { return ep_size_ > 1; }
  // The parameters as f32 masters, and as the GEMMs read them (the act-store copy).
  Tensor W(ParamKind kind, int layer = -1) const;
  Tensor Wg(ParamKind kind, int layer = -1);
  Tensor G(ParamKind kind, int layer = -1) const;
  // src (f32) in the act store: src itself when that is f32, else converted into `scratch`.
  Tensor as_act(Tensor src, Tensor scratch);
  void refresh_gemm_weights();
  // LoRA factor b (false: A) of base tensor `target` in layer l: as the GEMMs read it (act store) and
  // its gradient; empty when not adapted.
  Tensor LW(ParamKind target, int l, bool b) const;
  Tensor LG(ParamKind target, int l, bool b) const;
  // The f32 master of a LoRA factor (the router's adapters run in f32, as the router does).
  Tensor LW32(ParamKind target, int l, bool b) const;
  // Layer l's weights as the blocks read them.  base false: only the adapters (to lay out the
  // activations; the base's tensors are left empty, so a frozen bf16 base is not widened).
  LoraFactors lora_factors(ParamKind target, int l, bool f32 = false) const;
  LinearWeights linear_weights(ParamKind kind, int l, bool base = true);
  AttentionWeights attention_weights(int l, bool base = true);
  MoeWeights moe_weights(int l, bool base = true);
  // The FFN weights of layer l (routed experts, or the dense FFN) or of its shared expert.
  ExpertFfnWeights ffn_weights(int l, bool shared, bool base = true);

  std::unique_ptr<Backend> own_backend_;  // the CPU backend of the first constructor
  Backend& be_;
  ModelConfig cfg_;
  dist::Comm* tp_ = nullptr;
  int tp_size_ = 1;
  dist::Comm* ep_ = nullptr;
  int ep_size_ = 1;
  int layer_begin_ = 0, layer_end_ = 0;
  std::unique_ptr<Allocation> bias_alloc_;  // the router bias (test hook)
  std::vector<long> dropped_;
  std::unique_ptr<dist::Comm> kv_comm_;  // ranks sharing a replicated kv head (NKV < tp)
  ParamTable table_;
  const WeightProvider* borrowed_ = nullptr;  // the weights of a model that holds none
  // Parameters and gradients: host vectors on host-memory backends (params()), else allocations.
  std::vector<float> params_, grads_;
  std::unique_ptr<Allocation> params_alloc_, grads_alloc_, gemm_alloc_;
  Tensor params_t_, grads_t_, gemm_t_;  // gemm_t_: the GEMM weights (params_t_ when act is f32)
  bool gemm_stale_ = true;

  // Activation sets: every one allocated, the pending ones (oldest first), the newest forward's.
  std::vector<std::unique_ptr<Activations>> pool_;
  std::deque<Activations*> pending_;
  Activations* last_ = nullptr;
  size_t peak_pending_ = 0, peak_activation_bytes_ = 0;
  std::vector<double> last_aux_grad_;  // of the last backward
  // Backward scratch (and the forward's tensor-parallel partial sums), shared by every micro-batch:
  // the body's (d of the residual stream, d of a norm's output, an [N,C] f32 temporary, the
  // residual gradient in the act store) and the blocks'.
  int scratch_B_ = 0, scratch_T_ = 0;
  std::unique_ptr<Allocation> scratch_alloc_;
  Tensor dres_, dln_, tmp_, dres_act_;
  AttentionScratch attn_sc_;
  MoeScratch moe_sc_;
  // Replicas of each kv head across the tp ranks (1 unless NKV < tp).
  int kv_replicas() const { return env().kv_replicas(); }
  std::unique_ptr<MoeBlock> moe_;  // MoE models: the block's dispatcher and host state
  DenseFfnBlock dense_;

  // Activation recompute: the mode and its buffers (allocate_recompute), laid out for (rc_B_, rc_T_).
  Recompute recompute_ = Recompute::none;
  int rc_B_ = 0, rc_T_ = 0;
  std::unique_ptr<Allocation> rc_alloc_;
  std::vector<LayerActs> work_;   // full: one layer's set per kind of layer
  std::vector<int> work_of_;      // full: the work set of each layer of this stage
  Tensor rc_out_;                 // full: [N,C] f32, the output of a recomputed layer (not read)
  Tensor rc_attn_, rc_act_, rc_shact_, rc_dense_act_;  // selective: shared by every layer

  // LoRA: the spec, the adapter table and its parameters, gradients and GEMM copy (as the base's).
  LoraSpec lora_;
  std::unique_ptr<ParamTable> lora_table_;
  std::vector<float> lparams_, lgrads_;
  std::unique_ptr<Allocation> lparams_alloc_, lgrads_alloc_, lgemm_alloc_;
  Tensor lparams_t_, lgrads_t_, lgemm_t_;
  bool lgemm_stale_ = true;
  // A frozen bf16 base: the parameters in bf16 (host: base16_host_; device: base16_t_) and one fp32
  // window, from which W() (and, on host backends, Wg()) read.  The flat array is cut into segments
  // -- the tensors before the first layer (embedding), each layer, the tensors after the last (final
  // norm, head) -- and the window holds one of them, widened on first use (a layer's, while the layer
  // runs; the head's, at the head; ...).  seg_begin_[i] is segment i's first flat offset.
  bool base16_ = false;
  std::vector<uint16_t> base16_host_;
  std::unique_ptr<Allocation> base16_alloc_, window_alloc_;
  Tensor base16_t_, window_t_;
  std::vector<size_t> seg_begin_;  // segments + 1 entries (the last: table total)
  mutable int window_seg_ = -1;    // the segment widened in the window (-1: none)
  // The window's view of a base tensor, widening its segment first when another one is there.
  Tensor window_view(const ParamSpec& s) const;

  // An inference pass's buffers (one layer's worth: nothing is kept), views of the pass's rows in an
  // arena grown to the largest pass.
  struct InferActs {
    std::unique_ptr<Allocation> arena;
    long laid_rows = -1;  // the rows the views below are laid out for
    Tensor x, h, ln1, rstd1, ln2, ln2f, rstd2;
    Tensor tokens, positions, logit_index, xf, lnf, rstdf;
    GrowableBuffer logits;  // [rows, V] on backends whose memory the host does not read
    AttentionSaved attn;
    AttentionScratch attn_sc;
    MoeSaved moe;
    MoeScratch moe_sc;
    DenseFfnSaved dense;
    ops::MoePlan ident_plan;
    PlanView ident_pv;
    Tensor ident_rt, ident_ro;
    std::vector<int32_t> host_positions, zeros;  // a pass's host-side rows
    std::vector<KvRows> kv;                      // a layer's view of the pass's caches
  };
  InferActs infer_;
  // Each layer's weights as the blocks read them, resolved at the first inference pass.
  struct InferLayer {
    Tensor input_norm, post_norm;
    AttentionWeights attn;
    MoeWeights moe;
    ExpertFfnWeights ffn;
  };
  std::vector<InferLayer> infer_w_;
  void allocate_infer(long n);
  std::unique_ptr<Allocation> mla_expand_;  // latent attention's per-pass cache expansion (infer)

  std::vector<ops::RouterLayerStats> router_stats_;  // of the last forward
  Profile* profile_ = nullptr;
};

}  // namespace moetron
