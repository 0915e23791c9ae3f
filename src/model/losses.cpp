#include "model/losses.h"

#include <cstddef>

namespace moetron {

RouterLossTerms router_loss_terms(const std::vector<ops::RouterLayerStats>& layers,
                                  const ops::RouterLayerStats* pooled_in, const LossWeights& w, int E, int K,
                                  bool last_stage) {
  const int L = (int)layers.size();
  RouterLossTerms r;
  r.aux_dprobs.assign(L, std::vector<double>(E, 0.0));
  r.aux_grad.assign(E, 0.0);
  // The statistics pooled over the layers so far, in layer order (the single-process sums).
  if (pooled_in != nullptr) {
    r.pooled = *pooled_in;
  } else {
    r.pooled.assigned.assign(E, 0.0);
    r.pooled.prob_sum.assign(E, 0.0);
  }
  for (int l = 0; l < L; l++) {
    for (int e = 0; e < E; e++) {
      r.pooled.assigned[e] += layers[l].assigned[e];
      r.pooled.prob_sum[e] += layers[l].prob_sum[e];
    }
    r.pooled.tokens += layers[l].tokens;
  }
  if (w.aux_kind == AuxLossKind::hf_pooled) {
    if (last_stage) {
      std::vector<double> d;
      r.aux_loss = ops::load_balancing_loss_pooled({r.pooled}, E, K, &d);
      for (int e = 0; e < E; e++) r.aux_grad[e] = w.aux_coef * d[e];
      for (int l = 0; l < L; l++) r.aux_dprobs[l] = r.aux_grad;
    }
  } else if (w.aux_kind == AuxLossKind::sequence) {  // each layer's own, per row (no per-expert term)
    r.seq_row_grad.resize(L);
    for (int l = 0; l < L; l++) {
      std::vector<double> g;
      r.aux_loss += ops::sequence_balance_loss(layers[l], E, K, &g);
      r.seq_row_grad[l].resize(g.size());
      for (std::size_t i = 0; i < g.size(); i++) r.seq_row_grad[l][i] = (float)(w.aux_coef * g[i]);
    }
  } else {
    for (int l = 0; l < L; l++) {
      std::vector<double> d;
      r.aux_loss += ops::load_balancing_loss_layer(layers[l], E, K, &d);
      for (int e = 0; e < E; e++) r.aux_dprobs[l][e] = w.aux_coef * d[e];
    }
  }
  for (int l = 0; l < L; l++) r.z_loss += ops::router_z_loss_layer(layers[l]);
  return r;
}

}  // namespace moetron
