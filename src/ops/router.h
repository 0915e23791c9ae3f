// MoE router and its auxiliary losses.
//   N tokens, E experts, K experts per token (K <= E).
// Router (HF Mixtral): probs = softmax(logits) in fp32 over ALL experts; the K largest probs are
// chosen (descending; ties go to the lower expert index); their weights are renormalised to sum
// to 1 -- or, with renormalize false (Qwen3-MoE's norm_topk_prob false), are the probs themselves.
// Activation gradients assign (=) unless stated.
//
// Sigmoid routing (DeepSeek-V3, GLM-4.5; RouterSpec::sigmoid): probs = sigmoid(logits) per expert;
// the choice score is probs + bias (the selection bias, [E], or none); with n_group groups of E/n_group
// experts, a group scores the sum of its two best choice scores and only the topk_group best groups
// are searched (ties: the lower group); the K best choice scores among them are chosen (descending,
// ties to the lower expert); their weights are the unbiased probs, divided by (their sum + 1e-20) when
// renormalize, times `scale` (routed_scaling_factor).  The selection is not differentiated; the
// backward runs through the weights and the sigmoid only.
//
// Auxiliary losses, all computed over "real" tokens only (token_mask[n] != 0, or all tokens when
// token_mask is null):
//  - hf_pooled (HF load_balancing_loss_func, the default): statistics are pooled over ALL layers:
//      aux = E * sum_e (assigned[e] / tokens) * (prob_sum[e] / tokens)
//    where, summed over layers and real tokens, assigned[e] counts tokens whose top-K contains e,
//    prob_sum[e] sums probs[., e], tokens counts (layer, token) pairs.
//    Gradient: d aux / d probs[l,n,e] = E * assigned[e] / tokens^2 for every real token of every layer.
//  - per_layer (Switch / Megatron): aux_l = E / (N_l^2 * K) * sum_e prob_sum_l[e] * assigned_l[e],
//    and the total is the SUM over layers (Megatron applies the coefficient per layer).
//    Gradient: d aux_l / d probs[n,e] = E * assigned_l[e] / (N_l^2 * K).
//  - sequence (DeepSeek-V3's complementary sequence-wise balance loss): per row b of the batch (a
//    sequence, or a packed block of them) with T_b real tokens,
//      s'_{t,e} = s_{t,e} / sum_j s_{t,j}  (the sigmoid scores normalised; softmax probs as they are),
//      f_{b,e} = E / (K T_b) * #{t in b: e in top-K of t},   P_{b,e} = (1/T_b) sum_{t in b} s'_{t,e},
//      aux_l = mean over rows with real tokens of sum_e f_{b,e} P_{b,e};  the total is the SUM over layers.
//    Gradient: d aux_l / d s'_{t,e} = f_{b,e} / (T_b * rows) for every real token t of row b (the
//    top-K counts are not differentiated).
//  - router z-loss (ST-MoE): z_l = mean over real tokens of logsumexp(logits[n])^2; total = SUM
//    over layers.  Gradient: d z_l / d logits[n,e] = 2 * lse[n] * probs[n,e] / N_l.
#pragma once

#include <cstdint>
#include <vector>

namespace moetron::ops {

// How a router scores and weighs its experts (above); the default is Mixtral's.
struct RouterSpec {
  bool sigmoid = false;
  bool renormalize = true;
  int n_group = 1, topk_group = 1;  // sigmoid only
  float scale = 1.0f;               // sigmoid only
  static RouterSpec softmax(bool renormalize) {
    RouterSpec s;
    s.renormalize = renormalize;
    return s;
  }
};

// The sigmoid rule's checks (Error naming `op`): groups divide E, each holds >= 2 experts, topk_group
// in [1, n_group], K fits the searched groups, scale finite and > 0.
void check_router_spec(const char* op, const RouterSpec& spec, int E, int K);

// One token: probs[E], topk_idx[K], topk_weight[K] from logits[E] (router_forward's per-token body;
// no parallel region and no allocation, for the decoder's decode steps).
void route_token(float* probs, int32_t* topk_idx, float* topk_weight, const float* logits, int E, int K,
                 bool renormalize = true);
// The same under any RouterSpec; bias: the selection bias [E] (null: none).
void route_token(float* probs, int32_t* topk_idx, float* topk_weight, const float* logits, const float* bias, int E,
                 int K, const RouterSpec& spec);

// probs[N,E], topk_idx[N,K], topk_weight[N,K] from logits[N,E] (route_token per token, in parallel).
void router_forward(float* probs, int32_t* topk_idx, float* topk_weight, const float* logits, long N,
                    int E, int K, bool renormalize = true);
void router_forward(float* probs, int32_t* topk_idx, float* topk_weight, const float* logits, const float* bias,
                    long N, int E, int K, const RouterSpec& spec);

// dlogits[N,E] (assign) = softmax backward of the total gradient on probs, which is
//   the chain through the top-K weights (dtopk_weight[N,K]; renormalised or not, as the forward)
//   + dprobs_per_expert[e] for real tokens (the aux-loss gradient; null: none).
void router_backward(float* dlogits, const float* dtopk_weight, const double* dprobs_per_expert,
                     const uint8_t* token_mask, const float* probs, const int32_t* topk_idx,
                     const float* topk_weight, long N, int E, int K, bool renormalize = true);
// Under any RouterSpec (sigmoid: dlogits is zero outside the chosen experts unless dprobs_per_expert
// is given, whose term runs through every expert's sigmoid).
void router_backward(float* dlogits, const float* dtopk_weight, const double* dprobs_per_expert,
                     const uint8_t* token_mask, const float* probs, const int32_t* topk_idx,
                     const float* topk_weight, long N, int E, int K, const RouterSpec& spec);

// One layer's routing statistics over its real tokens.
struct RouterLayerStats {
  std::vector<double> assigned;  // [E] tokens whose top-K contains e
  std::vector<double> prob_sum;  // [E] sum of probs[., e]
  double tokens = 0;             // real tokens
  double z_sum = 0;              // sum of logsumexp(logits[n])^2
  // Per row (the sequence loss; empty unless router_row_stats ran): [B*E] top-K counts, [B*E] sums of
  // the normalised scores s', [B] real tokens.
  std::vector<double> row_assigned, row_score_sum, row_tokens;
};

// Fills st's per-row statistics over rows of row_len tokens (N a multiple of row_len); sigmoid: probs
// are sigmoid scores, normalised per token (else softmax probs, used as they are).
void router_row_stats(RouterLayerStats& st, const float* probs, const int32_t* topk_idx, const uint8_t* token_mask,
                      long N, int E, int K, int row_len, bool sigmoid);

// The sequence-wise balance loss of one layer from its row statistics; row_grad (if not null)
// receives [B*E]: d aux / d s'_{t,e} for the real tokens t of row b.
double sequence_balance_loss(const RouterLayerStats& st, int E, int K, std::vector<double>* row_grad);

// dlogits[N,E] += scale * d aux / d logits through s' (accumulate): for a real token t of row b with
// g = row_grad[b], sigmoid: ds_j = (g_j - sum_i g_i s'_i) / sum_i s_i, dlogit_j = ds_j s_j (1 - s_j);
// softmax: dlogit_j = p_j (g_j - sum_i p_i g_i).
void router_sequence_backward(float* dlogits, const float* row_grad, const uint8_t* token_mask, const float* probs,
                              long N, int E, int row_len, bool sigmoid, float scale);

// Overwrites st with the statistics of one layer.
void router_layer_stats(RouterLayerStats& st, const float* logits, const float* probs,
                        const int32_t* topk_idx, const uint8_t* token_mask, long N, int E, int K);

// HF pooled load-balancing loss over all layers.  When dprobs_per_expert is not null it receives
// [E] values: d aux / d probs[l,n,e] for any real token of any layer.
double load_balancing_loss_pooled(const std::vector<RouterLayerStats>& layers, int E, int K,
                                  std::vector<double>* dprobs_per_expert);

// Switch/Megatron per-layer loss aux_l for one layer, and its [E] gradient on probs.
double load_balancing_loss_layer(const RouterLayerStats& st, int E, int K,
                                 std::vector<double>* dprobs_per_expert);

// z_l for one layer (0 when the layer has no real tokens).
double router_z_loss_layer(const RouterLayerStats& st);

// dlogits[N,E] += scale * d z_l / d logits  (accumulate; the caller passes scale = z coefficient).
void router_z_loss_backward(float* dlogits, const float* logits, const float* probs,
                            const uint8_t* token_mask, long N, int E, float scale);

}  // namespace moetron::ops
