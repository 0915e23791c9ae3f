// The loss terms of the model (DESIGN §4), assembled on the host once for every backend: the
// cross-entropy is a sum from the backend; the router terms come from per-layer statistics.
//   loss = ce_scale * CE_sum + aux_coef * aux + z_coef * z
#pragma once

#include <vector>

#include "ops/router.h"

namespace moetron {

enum class AuxLossKind { hf_pooled, per_layer, sequence };

// How the loss terms are weighted.  For one batch ce_scale = 1 / (loss tokens in the batch); under
// gradient accumulation the trainer passes 1 / (loss tokens in the global batch) and divides the
// aux/z coefficients by the number of micro-batches.
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

// The router terms of one forward over a pipeline stage's MoE layers (all layers without pipeline
// parallelism).  The HF pooled aux loss pools statistics over ALL layers: `pooled` adds this
// stage's layers to those of the earlier stages (pooled_in, null for none), and only the last stage
// computes the loss and its gradient (aux_grad, the same for every layer; earlier stages receive it
// at backward).  The per-layer aux loss and the z-loss are each layer's own.
struct RouterLossTerms {
  double aux_loss = 0, z_loss = 0;
  ops::RouterLayerStats pooled;                 // over this and the earlier stages' layers
  std::vector<double> aux_grad;                 // [E] hf_pooled: d(aux_coef * aux)/d probs
  std::vector<std::vector<double>> aux_dprobs;  // [stage layer][E] d(aux_coef * aux)/d probs
  // sequence: [stage layer][B*E] aux_coef * d aux / d s' of the real tokens of each row (ops/router.h).
  std::vector<std::vector<float>> seq_row_grad;
};
RouterLossTerms router_loss_terms(const std::vector<ops::RouterLayerStats>& layers,
                                  const ops::RouterLayerStats* pooled_in, const LossWeights& w, int E, int K,
                                  bool last_stage);

}  // namespace moetron
