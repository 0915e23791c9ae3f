// MoE router (softmax, top-K, renormalisation) and its auxiliary losses; see router.h for the maths.
//   N tokens, E experts, K experts per token.
// Activation gradients assign (=): router_backward overwrites dlogits.  router_z_loss_backward is
// the one exception and accumulates (+=) into dlogits, as its header states.
// Determinism: every per-token loop writes only its own token's outputs, and every reduction over
// tokens runs serially in token order, so results do not depend on the number of threads.
#include "ops/router.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "ops/softmax.h"

namespace moetron::ops {

namespace {

// Below this many elements (N x E logits) a parallel region costs more than it saves.
constexpr long kParallelMin = 1 << 15;

bool is_real(const uint8_t* token_mask, long n) { return token_mask == nullptr || token_mask[n] != 0; }

// logsumexp of one row of logits, in double.
double row_logsumexp(const float* row, int E) {
  double mx = row[0];
  for (int e = 1; e < E; e++) mx = std::fmax(mx, (double)row[e]);
  double s = 0.0;
  for (int e = 0; e < E; e++) s += std::exp((double)row[e] - mx);
  return mx + std::log(s);
}

void check_dims(const char* op, long N, int E, int K) {
  MOETRON_OP_CHECK(N >= 0, op, "token count N must be >= 0, got {}", N);
  MOETRON_OP_CHECK(E >= 1, op, "expert count E must be >= 1, got {}", E);
  MOETRON_OP_CHECK(K >= 1 && K <= E, op, "experts per token K must be in [1, E={}], got {}", E, K);
}

}  // namespace

void check_router_spec(const char* op, const RouterSpec& spec, int E, int K) {
  if (!spec.sigmoid) return;
  MOETRON_OP_CHECK(spec.n_group >= 1 && E % spec.n_group == 0 && E / spec.n_group >= 2, op,
                   "n_group {} must divide E={} into groups of at least 2 experts", spec.n_group, E);
  MOETRON_OP_CHECK(spec.topk_group >= 1 && spec.topk_group <= spec.n_group, op,
                   "topk_group {} must be in [1, n_group={}]", spec.topk_group, spec.n_group);
  MOETRON_OP_CHECK(K <= spec.topk_group * (E / spec.n_group), op, "K={} exceeds the {} experts searched", K,
                   spec.topk_group * (E / spec.n_group));
  MOETRON_OP_CHECK(std::isfinite(spec.scale) && spec.scale > 0, op, "scale must be finite and > 0, got {}",
                   spec.scale);
}

namespace {

// The sigmoid rule for one token (router.h).  Selections use strict '>' over the candidates in index
// order, so ties go to the lower index and a NaN still yields valid distinct indices.
void route_token_sigmoid(float* p, int32_t* idx, float* w, const float* l, const float* bias, int E, int K,
                         const RouterSpec& spec) {
  for (int e = 0; e < E; e++) p[e] = 1.0f / (1.0f + std::exp(-l[e]));
  const auto choice = [&](int e) { return bias ? p[e] + bias[e] : p[e]; };
  const int G = spec.n_group, gsz = E / G;
  // Groups searched: a bit per group (G <= E <= the router's limit; a vector keeps it general).
  std::vector<char> allowed(G, 1);
  if (spec.topk_group < G) {
    std::vector<float> gscore(G);
    for (int g = 0; g < G; g++) {
      int b1 = -1, b2 = -1;
      for (int e = g * gsz; e < (g + 1) * gsz; e++) {
        if (b1 < 0 || choice(e) > choice(b1)) {
          b2 = b1;
          b1 = e;
        } else if (b2 < 0 || choice(e) > choice(b2)) {
          b2 = e;
        }
      }
      gscore[g] = choice(b1) + choice(b2);
    }
    std::fill(allowed.begin(), allowed.end(), 0);
    for (int t = 0; t < spec.topk_group; t++) {
      int best = -1;
      for (int g = 0; g < G; g++)
        if (!allowed[g] && (best < 0 || gscore[g] > gscore[best])) best = g;
      allowed[best] = 1;
    }
  }
  float sum = 0.0f;
  for (int k = 0; k < K; k++) {
    int best = -1;
    for (int e = 0; e < E; e++) {
      if (!allowed[e / gsz]) continue;
      bool taken = false;
      for (int j = 0; j < k; j++) taken |= idx[j] == e;
      if (taken) continue;
      if (best < 0 || choice(e) > choice(best)) best = e;
    }
    idx[k] = best;
    w[k] = p[best];
    sum += p[best];
  }
  const float den = spec.renormalize ? sum + 1e-20f : 1.0f;
  for (int k = 0; k < K; k++) w[k] = w[k] / den * spec.scale;
}

}  // namespace

void route_token(float* p, int32_t* idx, float* w, const float* l, const float* bias, int E, int K,
                 const RouterSpec& spec) {
  if (spec.sigmoid)
    route_token_sigmoid(p, idx, w, l, bias, E, K, spec);
  else
    route_token(p, idx, w, l, E, K, spec.renormalize);
}

void route_token(float* p, int32_t* idx, float* w, const float* l, int E, int K, bool renormalize) {
  std::copy(l, l + E, p);
  softmax_inplace(p, E);
  // top-K: K passes of argmax over the experts not yet chosen (idx[0..k)); strict '>' keeps the lower
  // index on ties, and a NaN row still yields K distinct valid indices (the NaN then propagates).
  float sum = 0.0f;
  for (int k = 0; k < K; k++) {
    int best = -1;
    for (int e = 0; e < E; e++) {
      bool taken = false;
      for (int j = 0; j < k; j++) taken |= idx[j] == e;
      if (taken) continue;
      if (best < 0 || p[e] > p[best]) best = e;
    }
    idx[k] = best;
    w[k] = p[best];
    sum += p[best];  // fp32, in descending order, as torch sums the top-K values
  }
  if (renormalize)
    for (int k = 0; k < K; k++) w[k] /= sum;
}

void router_forward(float* probs, int32_t* topk_idx, float* topk_weight, const float* logits, long N,
                    int E, int K, bool renormalize) {
  check_dims("router_forward", N, E, K);
#pragma omp parallel for schedule(static) if (N * E >= kParallelMin)
  for (long n = 0; n < N; n++)
    route_token(probs + n * E, topk_idx + n * K, topk_weight + n * K, logits + n * E, E, K, renormalize);
}

void router_forward(float* probs, int32_t* topk_idx, float* topk_weight, const float* logits, const float* bias,
                    long N, int E, int K, const RouterSpec& spec) {
  check_dims("router_forward", N, E, K);
  check_router_spec("router_forward", spec, E, K);
  if (!spec.sigmoid) {
    router_forward(probs, topk_idx, topk_weight, logits, N, E, K, spec.renormalize);
    return;
  }
#pragma omp parallel for schedule(static) if (N * E >= kParallelMin)
  for (long n = 0; n < N; n++)
    route_token_sigmoid(probs + n * E, topk_idx + n * K, topk_weight + n * K, logits + n * E, bias, E, K, spec);
}

void router_backward(float* dlogits, const float* dtopk_weight, const double* dprobs_per_expert,
                     const uint8_t* token_mask, const float* probs, const int32_t* topk_idx,
                     const float* topk_weight, long N, int E, int K, const RouterSpec& spec) {
  check_dims("router_backward", N, E, K);
  check_router_spec("router_backward", spec, E, K);
  if (!spec.sigmoid) {
    router_backward(dlogits, dtopk_weight, dprobs_per_expert, token_mask, probs, topk_idx, topk_weight, N, E, K,
                    spec.renormalize);
    return;
  }
#pragma omp parallel
  {
    std::vector<double> dp(E);
#pragma omp for schedule(static)
    for (long n = 0; n < N; n++) {
      const float* p = probs + n * E;
      const int32_t* idx = topk_idx + n * K;
      std::fill(dp.begin(), dp.end(), 0.0);
      if (dtopk_weight != nullptr) {
        const float* w = topk_weight + n * K;
        const float* dw = dtopk_weight + n * K;
        if (spec.renormalize) {
          // w_k = c p_k / (S + eps): dp_j = (c dw_j - sum_k dw_k w_k) / (S + eps)
          float S = 0.0f;  // as the forward summed it
          double dot = 0.0;
          for (int k = 0; k < K; k++) {
            S += p[idx[k]];
            dot += (double)dw[k] * (double)w[k];
          }
          const double den = (double)(S + 1e-20f);
          for (int k = 0; k < K; k++) dp[idx[k]] += ((double)spec.scale * dw[k] - dot) / den;
        } else {
          for (int k = 0; k < K; k++) dp[idx[k]] += (double)spec.scale * dw[k];  // w_k = c p_k
        }
      }
      if (dprobs_per_expert != nullptr && is_real(token_mask, n))
        for (int e = 0; e < E; e++) dp[e] += dprobs_per_expert[e];
      float* dl = dlogits + n * E;
      for (int e = 0; e < E; e++) dl[e] = (float)(dp[e] * (double)p[e] * (1.0 - (double)p[e]));
    }
  }
}

void router_backward(float* dlogits, const float* dtopk_weight, const double* dprobs_per_expert,
                     const uint8_t* token_mask, const float* probs, const int32_t* topk_idx,
                     const float* topk_weight, long N, int E, int K, bool renormalize) {
  check_dims("router_backward", N, E, K);
#pragma omp parallel
  {
    std::vector<double> dp(E);
#pragma omp for schedule(static)
    for (long n = 0; n < N; n++) {
      const float* p = probs + n * E;
      std::fill(dp.begin(), dp.end(), 0.0);
      if (dtopk_weight != nullptr && !renormalize) {
        // w_k = p_k
        const int32_t* idx = topk_idx + n * K;
        const float* dw = dtopk_weight + n * K;
        for (int k = 0; k < K; k++) dp[idx[k]] += (double)dw[k];
      } else if (dtopk_weight != nullptr) {
        // w_k = p_k / S, S = sum_j p_j over the chosen: dp_k = (dw_k - sum_j dw_j w_j) / S
        const int32_t* idx = topk_idx + n * K;
        const float* w = topk_weight + n * K;
        const float* dw = dtopk_weight + n * K;
        double S = 0.0, dot = 0.0;
        for (int k = 0; k < K; k++) {
          S += p[idx[k]];
          dot += (double)dw[k] * (double)w[k];
        }
        for (int k = 0; k < K; k++) dp[idx[k]] += ((double)dw[k] - dot) / S;
      }
      if (dprobs_per_expert != nullptr && is_real(token_mask, n))
        for (int e = 0; e < E; e++) dp[e] += dprobs_per_expert[e];
      // softmax backward: dlogit_e = p_e * (dp_e - sum_j p_j dp_j)
      double pdp = 0.0;
      for (int e = 0; e < E; e++) pdp += (double)p[e] * dp[e];
      float* dl = dlogits + n * E;
      for (int e = 0; e < E; e++) dl[e] = (float)((double)p[e] * (dp[e] - pdp));
    }
  }
}

void router_layer_stats(RouterLayerStats& st, const float* logits, const float* probs,
                        const int32_t* topk_idx, const uint8_t* token_mask, long N, int E, int K) {
  check_dims("router_layer_stats", N, E, K);
  st.assigned.assign(E, 0.0);
  st.prob_sum.assign(E, 0.0);
  st.tokens = 0.0;
  st.z_sum = 0.0;
  for (long n = 0; n < N; n++) {
    if (!is_real(token_mask, n)) continue;
    st.tokens += 1.0;
    for (int e = 0; e < E; e++) st.prob_sum[e] += probs[n * E + e];
    for (int k = 0; k < K; k++) {
      const int32_t e = topk_idx[n * K + k];
      MOETRON_OP_CHECK(e >= 0 && e < E, "router_layer_stats",
                       "topk_idx[{},{}] = {} is outside [0, E={})", n, k, e, E);
      st.assigned[e] += 1.0;
    }
    const double lse = row_logsumexp(logits + n * E, E);
    st.z_sum += lse * lse;
  }
}

double load_balancing_loss_pooled(const std::vector<RouterLayerStats>& layers, int E, int K,
                                  std::vector<double>* dprobs_per_expert) {
  MOETRON_OP_CHECK(E >= 1 && K >= 1 && K <= E, "load_balancing_loss_pooled",
                   "need 1 <= K <= E, got E={} K={}", E, K);
  std::vector<double> assigned(E, 0.0), prob_sum(E, 0.0);
  double tokens = 0.0;
  for (size_t l = 0; l < layers.size(); l++) {
    const RouterLayerStats& st = layers[l];
    MOETRON_OP_CHECK((int)st.assigned.size() == E && (int)st.prob_sum.size() == E,
                     "load_balancing_loss_pooled", "layer {} has statistics for {} experts, expected {}",
                     l, st.assigned.size(), E);
    for (int e = 0; e < E; e++) {
      assigned[e] += st.assigned[e];
      prob_sum[e] += st.prob_sum[e];
    }
    tokens += st.tokens;
  }
  if (dprobs_per_expert) dprobs_per_expert->assign(E, 0.0);
  if (tokens <= 0.0) return 0.0;
  const double inv2 = 1.0 / (tokens * tokens);
  double aux = 0.0;
  for (int e = 0; e < E; e++) aux += assigned[e] * prob_sum[e];
  aux *= (double)E * inv2;
  if (dprobs_per_expert)
    for (int e = 0; e < E; e++) (*dprobs_per_expert)[e] = (double)E * assigned[e] * inv2;
  return aux;
}

double load_balancing_loss_layer(const RouterLayerStats& st, int E, int K,
                                 std::vector<double>* dprobs_per_expert) {
  MOETRON_OP_CHECK(E >= 1 && K >= 1 && K <= E, "load_balancing_loss_layer",
                   "need 1 <= K <= E, got E={} K={}", E, K);
  MOETRON_OP_CHECK((int)st.assigned.size() == E && (int)st.prob_sum.size() == E,
                   "load_balancing_loss_layer", "statistics for {} experts, expected {}",
                   st.assigned.size(), E);
  if (dprobs_per_expert) dprobs_per_expert->assign(E, 0.0);
  if (st.tokens <= 0.0) return 0.0;
  const double scale = (double)E / (st.tokens * st.tokens * (double)K);
  double aux = 0.0;
  for (int e = 0; e < E; e++) aux += st.prob_sum[e] * st.assigned[e];
  if (dprobs_per_expert)
    for (int e = 0; e < E; e++) (*dprobs_per_expert)[e] = scale * st.assigned[e];
  return scale * aux;
}

double router_z_loss_layer(const RouterLayerStats& st) {
  return st.tokens > 0.0 ? st.z_sum / st.tokens : 0.0;
}

void router_z_loss_backward(float* dlogits, const float* logits, const float* probs,
                            const uint8_t* token_mask, long N, int E, float scale) {
  MOETRON_OP_CHECK(N >= 0 && E >= 1, "router_z_loss_backward", "need N >= 0 and E >= 1, got N={} E={}",
                   N, E);
  long real = 0;
  for (long n = 0; n < N; n++) real += is_real(token_mask, n) ? 1 : 0;
  if (real == 0) return;
  const double c = 2.0 * (double)scale / (double)real;
#pragma omp parallel for schedule(static)
  for (long n = 0; n < N; n++) {
    if (!is_real(token_mask, n)) continue;
    const double g = c * row_logsumexp(logits + n * E, E);
    for (int e = 0; e < E; e++) dlogits[n * E + e] += (float)(g * (double)probs[n * E + e]);
  }
}

}  // namespace moetron::ops

namespace moetron::ops {

namespace {

// s'_{t,.} of one token: the scores normalised (sigmoid) or as they are (softmax); returns sum_i s_i.
double normalised_scores(double* out, const float* p, int E, bool sigmoid) {
  double S = 0.0;
  for (int e = 0; e < E; e++) S += p[e];
  const double inv = sigmoid ? 1.0 / S : 1.0;
  for (int e = 0; e < E; e++) out[e] = p[e] * inv;
  return S;
}

}  // namespace

void router_row_stats(RouterLayerStats& st, const float* probs, const int32_t* topk_idx, const uint8_t* token_mask,
                      long N, int E, int K, int row_len, bool sigmoid) {
  check_dims("router_row_stats", N, E, K);
  MOETRON_OP_CHECK(row_len > 0 && N % row_len == 0, "router_row_stats", "N={} is not whole rows of {}", N, row_len);
  const long B = N / row_len;
  st.row_assigned.assign(B * E, 0.0);
  st.row_score_sum.assign(B * E, 0.0);
  st.row_tokens.assign(B, 0.0);
  std::vector<double> sn(E);
  for (long n = 0; n < N; n++) {  // serially, in token order: deterministic sums
    if (!is_real(token_mask, n)) continue;
    const long b = n / row_len;
    st.row_tokens[b] += 1.0;
    normalised_scores(sn.data(), probs + n * E, E, sigmoid);
    for (int e = 0; e < E; e++) st.row_score_sum[b * E + e] += sn[e];
    for (int k = 0; k < K; k++) {
      const int e = topk_idx[n * K + k];
      if (e >= 0 && e < E) st.row_assigned[b * E + e] += 1.0;
    }
  }
}

double sequence_balance_loss(const RouterLayerStats& st, int E, int K, std::vector<double>* row_grad) {
  const long B = (long)st.row_tokens.size();
  if (row_grad) row_grad->assign(B * E, 0.0);
  long rows = 0;
  for (long b = 0; b < B; b++) rows += st.row_tokens[b] > 0;
  if (rows == 0) return 0.0;
  double loss = 0.0;
  for (long b = 0; b < B; b++) {
    const double T = st.row_tokens[b];
    if (T <= 0) continue;
    for (int e = 0; e < E; e++) {
      const double f = (double)E / ((double)K * T) * st.row_assigned[b * E + e];
      loss += f * st.row_score_sum[b * E + e] / T;
      if (row_grad) (*row_grad)[b * E + e] = f / (T * (double)rows);
    }
  }
  return loss / (double)rows;
}

void router_sequence_backward(float* dlogits, const float* row_grad, const uint8_t* token_mask, const float* probs,
                              long N, int E, int row_len, bool sigmoid, float scale) {
  MOETRON_OP_CHECK(N >= 0 && E >= 1 && row_len > 0 && N % row_len == 0, "router_sequence_backward",
                   "bad dimensions N={} E={} row_len={}", N, E, row_len);
#pragma omp parallel
  {
    std::vector<double> sn(E);
#pragma omp for schedule(static)
    for (long n = 0; n < N; n++) {
      if (!is_real(token_mask, n)) continue;
      const float* p = probs + n * E;
      const float* g = row_grad + (n / row_len) * E;
      const double S = normalised_scores(sn.data(), p, E, sigmoid);
      double dot = 0.0;  // sum_i g_i s'_i
      for (int e = 0; e < E; e++) dot += (double)g[e] * sn[e];
      float* dl = dlogits + n * E;
      for (int e = 0; e < E; e++) {
        const double d = sigmoid ? ((double)g[e] - dot) / S * (double)p[e] * (1.0 - (double)p[e])
                                 : (double)p[e] * ((double)g[e] - dot);
        dl[e] += (float)((double)scale * d);
      }
    }
  }
}

}  // namespace moetron::ops
