// The parameter table: one row per model tensor, laid out in one contiguous fp32 allocation.
// Parameters, gradients and optimizer state are each one allocation of `total` floats with the same
// offsets, so an optimizer or a reduction walks them as flat arrays.
//
// Expert weights are stored stacked so a grouped GEMM can run over them: w13 [E, 2I, C] holds per
// expert the gate rows (w1) then the up rows (w3) -- transformers-5's gate_up_proj layout, so one
// GEMM computes gate and up -- and w2 [E, C, I].  On disk (Hugging Face names) they are separate
// tensors `model.layers.N.block_sparse_moe.experts.e.{w1,w3,w2}.weight`.  A dense model's FFN
// (`mlp.{gate,up,down}_proj`) is stored exactly like one expert: [1, 2I, C] / [1, C, I], in a dense
// model and in the dense layers of an MoE model (Qwen3-MoE's mlp_only_layers / decoder_sparse_step),
// whose I is then intermediate_size while the experts' is moe_intermediate_size.  Qwen3-MoE's Hub
// names are `mlp.gate.weight` and `mlp.experts.e.{gate,up,down}_proj.weight`.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "io/hf_config.h"

namespace moetron {

enum class ParamKind {
  embedding,   // [V, C]
  input_norm,  // [C]
  q_proj,      // [NH*HD, C]
  k_proj,      // [NKV*HD, C]
  v_proj,      // [NKV*HD, C]
  o_proj,      // [C, NH*HD]
  q_norm,      // [HD] RMSNorm weight over each query head (qk_norm models; OLMoE: [NH*HD] over all of q)
  k_norm,      // [HD] ... and each key head (OLMoE: [NKV*HD])
  q_bias,      // [NH*HD] (qkv_bias models)
  k_bias,      // [NKV*HD]
  v_bias,      // [NKV*HD]
  post_norm,   // [C]
  router,      // [E, C]
  ffn_w13,     // [E, 2I, C] gate rows then up rows per expert (dense: E = 1)
  ffn_w2,      // [E, C, I] down
  shared_w13,  // [1, 2Is, C] the shared expert's gate and up rows (Qwen2-MoE MoE layers)
  shared_w2,   // [1, C, Is] its down projection
  shared_gate, // [1, C] its per-token gate: sigmoid(x . w)
  router_bias, // [E] f32 selection bias (DeepSeek-V3 / GLM-4.5 e_score_correction_bias): no gradient, no
               //     optimizer step; moved by aux-loss-free balancing only
  // Latent attention (DeepSeek-V3; hf_config.h): q_a / q_b (or q_proj when q_lora_rank is 0), the
  // kv down-projection with the shared RoPE key, its norm, and the up-projection to every head.
  q_a_proj,    // [qr, C]
  q_a_norm,    // [qr]
  q_b_proj,    // [NH*HD, qr]  HD = qk_nope + qk_rope
  kv_a_proj,   // [kvr + dr, C]  the latent, then the shared RoPE key
  kv_a_norm,   // [kvr]
  kv_b_proj,   // [NH*(dn + dv), kvr]  per head: k_nope rows, then v rows
  final_norm,  // [C]
  lm_head,     // [V, C]; absent when tie_word_embeddings (the head reads `embedding`)
  lora_a,      // adapter tables only (model/lora.h): [r, in], experts [E, r, in]
  lora_b,      //   [out, r], experts [E, out, r]
};

struct LoraSpec;

// Which part of the model a table holds (DESIGN §6); the default is the whole model.  Tensor
// parallel (Megatron): q/k/v, w1/w3 split by rows (heads / FFN width), o and w2 by columns,
// embedding and head by vocabulary rows (the larger parts first when tp does not divide V), kv
// heads replicated when NKV < tp (rank r holds kv head r / (tp / NKV)), norms and router whole.
// Pipeline (layer range) and expert (expert range) parallelism select layers and experts; the
// first stage holds the embedding, the last the final norm and the head.
struct ParamShard {
  int layer_begin = 0, layer_end = -1;    // decoder layers [begin, end); -1: to the last
  int expert_begin = 0, expert_end = -1;  // experts [begin, end) of every MoE layer; -1: to the last
  int tp_rank = 0, tp_size = 1;
};

// The model's rules for tensor parallelism over `tp` ranks (Error naming parallel.tp and the numbers):
// tp divides num_attention_heads; num_key_value_heads and tp, one divides the other (kv heads are
// split, or replicated when NKV < tp); tp divides shared_expert_intermediate_size and the FFN width
// (intermediate_size, or an MoE layer's moe_intermediate_size) of layers [layer_begin, layer_end)
// (-1: to the last).
void check_tp_split(const ModelConfig& cfg, int tp, int layer_begin = 0, int layer_end = -1);
// The model's rules for expert parallelism over `ep` ranks (Error naming parallel.ep): ep 1 for a
// dense model, else ep divides num_local_experts.
void check_ep_split(const ModelConfig& cfg, int ep);

// The shard of the rank holding layers [layer_begin, layer_end) (-1: to the last), tensor-parallel
// rank tp_rank of tp_size and expert-parallel rank ep_rank of ep_size (experts
// [ep_rank E/ep, (ep_rank+1) E/ep)).  Error as check_ep_split when ep_size does not fit the model.
ParamShard make_param_shard(const ModelConfig& cfg, int layer_begin, int layer_end, int tp_rank, int tp_size,
                            int ep_rank, int ep_size);

// How a tensor is split over the tensor-parallel ranks.
enum class TpSplit {
  none,  // whole on every tp rank (replicated)
  rows,  // dim 0 of the HF tensor
  cols,  // the last dim of the HF tensor
};

struct ParamSpec {
  std::string name;            // moetron name; equals the HF name for non-stacked tensors
  ParamKind kind;
  int layer = -1;              // decoder layer, -1 for embedding / final norm / head
  std::vector<int64_t> shape;  // storage shape (stacked for experts; this shard's part)
  size_t offset = 0;           // in floats, into the flat allocation
  size_t numel = 0;
  bool weight_decay = true;    // false for RMSNorm weights
  int n_stacked = 0;           // FFN tensors: experts stacked along dim 0 (1 for a dense FFN); 0 otherwise
  bool expert = false;         // a routed expert tensor of an MoE layer (lives on its ep rank)
  TpSplit tp_split = TpSplit::none;
  ParamKind target = ParamKind::embedding;  // lora_a / lora_b: the base tensor adapted (q_proj .. ffn_w2)
  // False when another tp rank holds an identical copy that counts instead (replicated tensors on
  // tp ranks > 0; replicated kv heads on all but the first rank sharing the head): sums over the
  // model (gradient norms) and checkpoint assembly use primary copies only.
  bool tp_primary = true;
  bool is_norm() const {
    return kind == ParamKind::input_norm || kind == ParamKind::post_norm || kind == ParamKind::q_norm ||
           kind == ParamKind::k_norm || kind == ParamKind::final_norm || kind == ParamKind::q_a_norm ||
           kind == ParamKind::kv_a_norm;
  }
  // Not trained by the optimizer (no gradient): the routing selection bias.
  bool is_buffer() const { return kind == ParamKind::router_bias; }
  bool is_bias() const { return kind == ParamKind::q_bias || kind == ParamKind::k_bias || kind == ParamKind::v_bias; }
};

// One HF tensor: a name and where its values live inside the flat allocation.  In a sharded table
// the values are the slice [slice_begin, slice_end) of dimension slice_dim of the whole tensor
// (slice_dim -1: the whole tensor), of shape `shape`; `full_shape` is the whole tensor's.
struct HfTensorRef {
  std::string name;
  std::vector<int64_t> shape;
  size_t offset = 0;
  size_t numel = 0;
  size_t spec_index = 0;  // into ParamTable::specs()
  int stacked_index = -1;  // expert index for stacked tensors (0 for a dense FFN), global in the model
  std::vector<int64_t> full_shape;
  int slice_dim = -1;
  int64_t slice_begin = 0, slice_end = 0;
};

class ParamTable {
 public:
  // The whole model, or the part `shard` holds (Error naming the numbers when it does not fit: ranges
  // outside the model, check_tp_split).
  explicit ParamTable(const ModelConfig& cfg, const ParamShard& shard = {});
  // The LoRA adapters of `lora`'s targets (model/lora.h), the part `shard` holds.
  ParamTable(const ModelConfig& cfg, const LoraSpec& lora, const ParamShard& shard = {});

  const std::vector<ParamSpec>& specs() const { return specs_; }
  size_t total() const { return total_; }
  bool is_moe() const { return moe_; }  // the model has MoE layers (not every layer need be one)
  const ParamShard& shard() const { return shard_; }
  // True for the whole model (every table built without a shard).
  bool is_whole() const { return whole_; }
  // The vocabulary rows [vocab_begin, vocab_end) this shard's embedding and head hold.
  int64_t vocab_begin() const { return vocab_begin_; }
  int64_t vocab_end() const { return vocab_end_; }
  int num_layers() const { return num_layers_; }
  // DeepSeek-V3 / GLM-4.5: the multi-token-prediction layers a checkpoint may hold past the last
  // layer (config num_nextn_predict_layers), which the model does not have.
  int mtp_layers() const { return mtp_layers_; }
  bool has(ParamKind kind, int layer = -1) const;
  // The head's weight: lm_head, or the embedding when the model ties them.
  ParamKind head_kind() const { return tied_ ? ParamKind::embedding : ParamKind::lm_head; }
  const ParamSpec& at(ParamKind kind, int layer = -1) const;
  // Adapter tables: the A (b = false) or B factor adapting base tensor `target` of `layer`, or null.
  const ParamSpec* find_lora(ParamKind target, int layer, bool b) const;
  bool is_lora() const { return lora_; }
  // The tensors as Hugging Face names them (experts expanded, dense FFN under mlp.* names).
  const std::vector<HfTensorRef>& hf_tensors() const { return hf_tensors_; }
  const HfTensorRef* find_hf(const std::string& name) const;
  const ParamSpec& spec_of(const HfTensorRef& t) const { return specs_[t.spec_index]; }

 private:
  ParamSpec& add(const ModelConfig& cfg, ParamKind kind, int layer, std::vector<int64_t> shape, bool decay);
  std::vector<ParamSpec> specs_;
  std::vector<HfTensorRef> hf_tensors_;
  size_t total_ = 0;
  int num_layers_ = 0;
  int mtp_layers_ = 0;
  bool moe_ = false;
  ParamShard shard_;
  bool whole_ = true;
  bool tied_ = false;
  bool lora_ = false;
  int64_t vocab_begin_ = 0, vocab_end_ = 0;
};

// Copies between a sharded table's flat array and the whole model's (`whole` must be a whole
// table of the same model): each HF tensor of `shard` from (to) its slice of the tensor of the same
// name in `whole`.  Padding is not touched.
void copy_from_whole(const ParamTable& whole, const float* whole_values, const ParamTable& shard, float* shard_values);
void copy_to_whole(const ParamTable& shard, const float* shard_values, const ParamTable& whole, float* whole_values);
// The same, restricted to the elements whose index in the shard's flat array lies in one of the
// sorted, disjoint ranges `only` ([begin, end)): the parts of a ZeRO-1 sharded state a rank holds.
void copy_to_whole(const ParamTable& shard, const float* shard_values, const ParamTable& whole, float* whole_values,
                   const std::vector<std::pair<size_t, size_t>>& only);

// The contiguous part [first, second) of n items that part `part` of `parts` holds: sizes differ
// by at most one, the larger parts first (the vocabulary split of ParamShard).
std::pair<int64_t, int64_t> shard_range(int64_t n, int parts, int part);

// Fills params (table.total() floats) from the counter-based RNG: normal(0, initializer_range)
// for matrices, 1 for norm weights, 0 for biases (transformers' init).  Each HF tensor draws from its own stream keyed by its HF name,
// element index = position within the WHOLE tensor, so any slice (a sharded table) is initialised
// to exactly the values the whole model holds there.
void init_parameters(const ParamTable& table, const ModelConfig& cfg, uint64_t seed, float* params);
// The same for one HF tensor of the table: p[t.numel] (p points at the tensor's values).
void init_hf_tensor(const ParamTable& table, const ModelConfig& cfg, uint64_t seed, const HfTensorRef& t, float* p);

}  // namespace moetron
