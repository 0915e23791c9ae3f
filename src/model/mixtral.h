// The Mixtral decoder (and dense Mistral/Llama through the same code) on CPU: forward and backward
// as flat, mirror-image lists of op calls over one parameter table.
//   h = x + Attn(RMSNorm(x)); out = h + FFN(RMSNorm(h)); final RMSNorm; untied lm_head.
// Dimensions: B batch, T sequence, N = B*T tokens, C hidden, NH heads, NKV kv heads, HD head dim,
// Q = NH*HD, KV = NKV*HD, E experts (1 for dense), K experts per token (1 for dense),
// M = N*K routed rows, I FFN width, L layers, V vocab.
#pragma once

#include <cstdint>
#include <vector>

#include "core/profile.h"
#include "io/hf_config.h"
#include "model/params.h"
#include "ops/moe_dispatch.h"
#include "ops/router.h"

namespace moetron {

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
  explicit MixtralModel(const ModelConfig& cfg);

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

  // [B,T,V] logits of the last forward (until backward).
  const float* logits() const { return logits_; }
  // Time the forward/backward sections into `profile` (null: off).  The caller owns it.
  void set_profile(Profile* profile) { profile_ = profile; }

  // Routing statistics per MoE layer of the last forward (empty for dense models).
  const std::vector<ops::RouterLayerStats>& router_stats() const { return router_stats_; }

 private:
  struct LayerActs {
    float *x, *ln1, *rstd1, *q, *k, *v, *probs, *att, *h, *ln2, *rstd2;
    float *rlogits, *rprobs, *topk_w;
    int32_t* topk_idx;
    float *xperm, *h13, *act, *yperm;
    ops::MoePlan plan;
  };
  // The dimension letters of this model (E = K = 1 for a dense FFN).
  struct Dims {
    int C, V, I, NH, NKV, HD, Q, KVd, E, K;
    bool moe;
  };
  Dims dims() const;
  void validate_batch(const Batch& b) const;
  void allocate(int B, int T);

  ModelConfig cfg_;
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
