// Mixtral forward and backward.  The backward is the forward's call list in reverse; parameter
// gradients accumulate (+=) into grads(), activation gradients flow through scratch buffers.
#include "model/mixtral.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>

#include "core/error.h"
#include "dist/comm.h"
#include "dist/tp_ops.h"
#include "model/batch_io.h"
#include "ops/attention.h"
#include "ops/cross_entropy.h"
#include "ops/embedding.h"
#include "ops/matmul.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"

namespace moetron {

namespace {

// y[n] += x[n] for n floats
void add_inplace(float* y, const float* x, long n) {
#pragma omp parallel for schedule(static)
  for (long i = 0; i < n; i++) y[i] += x[i];
}

}  // namespace

long count_loss_tokens(const Batch& b) {
  if (b.labels.empty()) return 0;
  long count = 0;
  for (int r = 0; r < b.B; r++)
    for (int t = 0; t + 1 < b.T; t++) {
      const long i = (long)r * b.T + t;
      if (!b.segment_ids.empty() && b.segment_ids[i] != b.segment_ids[i + 1]) continue;
      if (b.labels[i + 1] != ops::IGNORE_INDEX) count++;
    }
  return count;
}

namespace {

ParamShard model_shard(const ModelConfig& cfg, dist::Comm* tp, dist::Comm* ep) {
  ParamShard s;
  if (tp != nullptr) {
    s.tp_rank = tp->rank();
    s.tp_size = tp->size();
  }
  if (ep != nullptr && ep->size() > 1) {
    const int E = cfg.is_moe() ? cfg.num_local_experts : 1;
    if (!cfg.is_moe()) fail("parallel.ep: ep {} needs an MoE model (num_local_experts is 0)", ep->size());
    if (E % ep->size() != 0)
      fail("parallel.ep: ep {} does not divide num_local_experts {}", ep->size(), E);
    const int El = E / ep->size();
    s.expert_begin = ep->rank() * El;
    s.expert_end = (ep->rank() + 1) * El;
  }
  return s;
}

}  // namespace

MixtralModel::MixtralModel(const ModelConfig& cfg, dist::Comm* tp, dist::Comm* ep)
    : cfg_(cfg),
      tp_(tp),
      tp_size_(tp ? tp->size() : 1),
      ep_(ep),
      ep_size_(ep ? ep->size() : 1),
      table_(cfg, model_shard(cfg, tp, ep)) {
  const int NKV = cfg_.num_key_value_heads;
  if (tp_on() && NKV < tp_size_)
    kv_comm_ = tp_->split(tp_->rank() / (tp_size_ / NKV), tp_->rank(), "tp-kv");
  params_.assign(table_.total(), 0.0f);
  grads_.assign(table_.total(), 0.0f);
}

MixtralModel::~MixtralModel() = default;

void MixtralModel::tp_all_reduce(float* x, long n) {
  ScopedTimer t(profile_, "tp.all_reduce");
  tp_->all_reduce(x, (size_t)n);
}

uint64_t MixtralModel::comm_bytes() const { return kv_comm_ ? kv_comm_->stats().bytes_sent : 0; }

void MixtralModel::reduce_replicated_grads() {
  if (!kv_comm_ || kv_comm_->size() == 1) return;
  for (int l = 0; l < cfg_.num_hidden_layers; l++)
    for (ParamKind k : {ParamKind::k_proj, ParamKind::v_proj}) {
      const ParamSpec& s = table_.at(k, l);
      kv_comm_->all_reduce(grads_.data() + s.offset, s.numel);
    }
}

void MixtralModel::set_router_bias(std::vector<float> bias) {
  if (!bias.empty() && (!cfg_.is_moe() || (int)bias.size() != cfg_.num_local_experts))
    fail("router bias: {} values for a model of {} experts", bias.size(), cfg_.is_moe() ? cfg_.num_local_experts : 0);
  router_bias_ = std::move(bias);
}

long MixtralModel::apply_capacity(LayerActs& a, const uint8_t* token_mask, long N, int E, int K) {
  long real = 0;
  for (long n = 0; n < N; n++) real += token_mask == nullptr || token_mask[n];
  const long cap = (long)std::ceil(capacity_factor_ * (double)real * K / E);
  // Assignments per expert, best first: real tokens, then higher probability, then earlier.
  std::vector<std::vector<int64_t>> by_expert(E);
  for (long i = 0; i < N * K; i++) by_expert[a.topk_idx[i]].push_back(i);
  std::vector<int32_t> idx(a.topk_idx, a.topk_idx + N * K);
  a.combine_w.assign(a.topk_w, a.topk_w + N * K);
  long dropped = 0;
  for (int e = 0; e < E; e++) {
    std::vector<int64_t>& v = by_expert[e];
    if ((long)v.size() <= cap) continue;
    auto key = [&](int64_t i) {
      const long n = i / K;
      return std::tuple<int, float, int64_t>(token_mask == nullptr || token_mask[n] ? 0 : 1, -a.rprobs[n * E + e], i);
    };
    std::stable_sort(v.begin(), v.end(), [&](int64_t x, int64_t y) { return key(x) < key(y); });
    for (size_t j = (size_t)cap; j < v.size(); j++) {
      idx[v[j]] = E;  // the overflow expert
      a.combine_w[v[j]] = 0.0f;
      dropped += token_mask == nullptr || token_mask[v[j] / K];
    }
  }
  ops::moe_plan_build(a.plan, idx.data(), N, E + 1, K);
  a.plan.overflow = 1;
  return dropped;
}

void MixtralModel::ep_dispatch(LayerActs& a, int C, int El) {
  ScopedTimer t(profile_, "ep.all_to_all");
  const int P = ep_size_;
  EpLayer& ep = a.ep;
  // Rows per (owner rank, local expert), exchanged: recv[s * El + j] rows arrive from rank s for
  // local expert j.
  std::vector<int64_t> send(P * El), recv(P * El);
  for (int e = 0; e < P * El; e++) send[e] = a.plan.expert_offsets[e + 1] - a.plan.expert_offsets[e];
  const std::vector<size_t> per_peer(P, (size_t)El);
  ep_->all_to_all_v(recv.data(), per_peer, send.data(), per_peer, dist::CommDType::i64);
  ep.send_rows.assign(P, 0);
  ep.recv_rows.assign(P, 0);
  std::vector<int64_t> expert_rows(El, 0);
  for (int p = 0; p < P; p++)
    for (int j = 0; j < El; j++) {
      ep.send_rows[p] += (size_t)send[p * El + j];
      ep.recv_rows[p] += (size_t)recv[p * El + j];
      expert_rows[j] += recv[p * El + j];
    }
  int64_t Mr = 0;
  for (int j = 0; j < El; j++) Mr += expert_rows[j];
  // The local plan: experts in order, each over its rows from every source in rank order.
  ops::MoePlan& lp = ep.plan;
  lp.N = Mr;
  lp.E = El;
  lp.K = 1;
  lp.expert_offsets.assign(El + 1, 0);
  for (int j = 0; j < El; j++) lp.expert_offsets[j + 1] = lp.expert_offsets[j] + expert_rows[j];
  lp.row_token.resize(Mr);
  lp.row_of.resize(Mr);
  for (int64_t m = 0; m < Mr; m++) lp.row_token[m] = lp.row_of[m] = (int32_t)m;
  ep.perm.resize(Mr);
  std::vector<int64_t> cursor(lp.expert_offsets.begin(), lp.expert_offsets.end() - 1);
  int64_t i = 0;
  for (int s = 0; s < P; s++)
    for (int j = 0; j < El; j++)
      for (int64_t r = 0; r < recv[s * El + j]; r++) ep.perm[i++] = cursor[j]++;
  ep.x.resize((size_t)Mr * C);
  ep_send(ep.x.data(), a.xperm, ep, C);
}

void MixtralModel::ep_send(float* out_local, const float* in, const EpLayer& ep, int C) {
  const int P = ep_size_;
  const int64_t Mr = (int64_t)ep.perm.size();
  std::vector<size_t> sc(P), rc(P);
  for (int p = 0; p < P; p++) {
    sc[p] = ep.send_rows[p] * C;
    rc[p] = ep.recv_rows[p] * C;
  }
  ep_buf_.resize((size_t)Mr * C);
  ep_->all_to_all_v(ep_buf_.data(), rc, in, sc, dist::CommDType::f32);
#pragma omp parallel for schedule(static)
  for (int64_t m = 0; m < Mr; m++)
    std::memcpy(out_local + ep.perm[m] * C, ep_buf_.data() + m * C, sizeof(float) * C);
}

void MixtralModel::ep_return(float* out, const float* y_local, const EpLayer& ep, int C) {
  ScopedTimer t(profile_, "ep.all_to_all");
  const int P = ep_size_;
  const int64_t Mr = (int64_t)ep.perm.size();
  ep_buf_.resize((size_t)Mr * C);
#pragma omp parallel for schedule(static)
  for (int64_t m = 0; m < Mr; m++)
    std::memcpy(ep_buf_.data() + m * C, y_local + ep.perm[m] * C, sizeof(float) * C);
  std::vector<size_t> sc(P), rc(P);
  for (int p = 0; p < P; p++) {
    sc[p] = ep.recv_rows[p] * C;
    rc[p] = ep.send_rows[p] * C;
  }
  ep_->all_to_all_v(out, rc, ep_buf_.data(), sc, dist::CommDType::f32);
}

void MixtralModel::zero_grads() { std::fill(grads_.begin(), grads_.end(), 0.0f); }

void MixtralModel::allocate(int B, int T) {
  if (B == B_ && T == T_ && !layers_.empty()) return;
  B_ = B;
  T_ = T;
  const long N = (long)B * T;
  const auto [C, V, I, NH, NKV, HD, Q, KVd, E, K, moe] = dims();
  const long M = N * K;
  const int L = cfg_.num_hidden_layers;

  // Two passes: the first measures, the second hands out pointers.
  size_t used = 0;
  float* base = nullptr;
  auto take = [&](long n) -> float* {
    float* p = base ? base + used : nullptr;
    used += (size_t)(n + 15) / 16 * 16;
    return p;
  };
  layers_.assign(L, LayerActs{});
  for (int pass = 0; pass < 2; pass++) {
    used = 0;
    for (int l = 0; l < L; l++) {
      LayerActs& a = layers_[l];
      a.x = take(N * C);
      a.ln1 = take(N * C);
      a.rstd1 = take(N);
      a.q = take(N * Q);
      a.k = take(N * KVd);
      a.v = take(N * KVd);
      a.probs = take((long)B * NH * T * T);
      a.att = take(N * Q);
      a.h = take(N * C);
      a.ln2 = take(N * C);
      a.rstd2 = take(N);
      a.rlogits = moe ? take(N * E) : nullptr;
      a.rprobs = moe ? take(N * E) : nullptr;
      a.topk_w = moe ? take(N * K) : nullptr;
      a.xperm = moe ? take(M * C) : nullptr;
      a.h13 = take(2 * M * I);
      a.act = take(M * I);
      a.yperm = moe ? take(M * C) : nullptr;
    }
    x_final_ = take(N * C);
    lnf_ = take(N * C);
    rstdf_ = take(N);
    logits_ = take(N * V);
    lse_ = take(N);
    dres_ = take(N * C);
    dln_ = take(N * C);
    tmp_ = take(N * C);
    datt_ = take(N * Q);
    dq_ = take(N * Q);
    dk_ = take(N * KVd);
    dv_ = take(N * KVd);
    drlogits_ = moe ? take(N * E) : nullptr;
    dtopk_ = moe ? take(N * K) : nullptr;
    dxperm_ = moe ? take(M * C) : nullptr;
    dyperm_ = moe ? take(M * C) : nullptr;
    ffn_scratch_ = take(3 * M * I);
    if (pass == 0) {
      arena_.assign(used, 0.0f);
      base = arena_.data();
    }
  }
  topk_arena_.assign(moe ? (size_t)L * M : 0, 0);
  for (int l = 0; l < L; l++) layers_[l].topk_idx = moe ? topk_arena_.data() + (size_t)l * M : nullptr;
  if (!moe) {
    // A dense FFN is one expert that every token visits with weight 1: the identity plan.
    std::vector<int32_t> zeros(N, 0);
    for (LayerActs& a : layers_) ops::moe_plan_build(a.plan, zeros.data(), N, 1, 1);
  }
}

MixtralModel::Dims MixtralModel::dims() const {
  const bool moe = cfg_.is_moe();
  const int tp = tp_size_;
  const int NH = cfg_.num_attention_heads / tp;
  const int NKV = cfg_.num_key_value_heads >= tp ? cfg_.num_key_value_heads / tp : 1;
  return Dims{cfg_.hidden_size,
              (int)(table_.vocab_end() - table_.vocab_begin()),
              cfg_.intermediate_size / tp,
              NH,
              NKV,
              cfg_.head_dim,
              NH * cfg_.head_dim,
              NKV * cfg_.head_dim,
              moe ? cfg_.num_local_experts : 1,
              moe ? cfg_.num_experts_per_tok : 1,
              moe};
}

Losses MixtralModel::forward(const Batch& batch, const LossWeights& weights) {
  validate_batch(batch, cfg_.vocab_size);
  allocate(batch.B, batch.T);
  const int B = batch.B, T = batch.T;
  const long N = (long)B * T;
  const auto [C, V, I, NH, NKV, HD, Q, KVd, E, K, moe] = dims();
  const float eps = (float)cfg_.rms_norm_eps, theta = (float)cfg_.rope_theta;
  const float* P = params_.data();
  auto W = [&](ParamKind kind, int layer = -1) { return P + table_.at(kind, layer).offset; };

  weights_ = weights;
  tokens_ = batch.input_ids;
  // Positions: given, or 0..T-1 restarting at each segment start.
  positions_.resize(N);
  for (int b = 0; b < B; b++)
    for (int t = 0; t < T; t++) {
      const long i = (long)b * T + t;
      if (!batch.position_ids.empty())
        positions_[i] = batch.position_ids[i];
      else if (!batch.segment_ids.empty() && t > 0 && batch.segment_ids[i] == batch.segment_ids[i - 1])
        positions_[i] = positions_[i - 1] + 1;
      else if (!batch.segment_ids.empty())
        positions_[i] = 0;
      else
        positions_[i] = t;
    }
  // Targets: the next token's label within the same segment.
  has_labels_ = !batch.labels.empty();
  targets_.assign(N, ops::IGNORE_INDEX);
  if (has_labels_)
    for (int b = 0; b < B; b++)
      for (int t = 0; t + 1 < T; t++) {
        const long i = (long)b * T + t;
        if (!batch.segment_ids.empty() && batch.segment_ids[i] != batch.segment_ids[i + 1]) continue;
        targets_[i] = batch.labels[i + 1];
      }
  has_token_mask_ = !batch.attention_mask.empty();
  token_mask_.assign(N, 1);
  if (has_token_mask_)
    for (long i = 0; i < N; i++) token_mask_[i] = batch.attention_mask[i] != 0;
  const uint8_t* tmask = has_token_mask_ ? token_mask_.data() : nullptr;

  ops::AttentionMask amask;
  amask.attention_mask = batch.attention_mask.empty() ? nullptr : batch.attention_mask.data();
  amask.segment_ids = batch.segment_ids.empty() ? nullptr : batch.segment_ids.data();
  amask.sliding_window = cfg_.sliding_window;

  const int L = cfg_.num_hidden_layers;
  router_stats_.assign(moe ? L : 0, ops::RouterLayerStats{});
  dropped_.assign(moe ? L : 0, 0);

  {
    ScopedTimer t(profile_, "fwd.embedding");
    if (!tp_on()) {
      ops::embedding_forward(layers_[0].x, tokens_.data(), W(ParamKind::embedding), N, C, V);
    } else {
      dist::embedding_forward_vocab_parallel(layers_[0].x, tokens_.data(), W(ParamKind::embedding), N, C,
                                             table_.vocab_begin(), V);
      tp_all_reduce(layers_[0].x, N * C);
    }
  }
  for (int l = 0; l < L; l++) {
    LayerActs& a = layers_[l];
    float* x_next = l + 1 < L ? layers_[l + 1].x : x_final_;
    // Attention block: h = x + o_proj(attn(rope(q), rope(k), v)).
    {
      ScopedTimer t(profile_, "fwd.norms");
      ops::rmsnorm_forward(a.ln1, a.rstd1, a.x, W(ParamKind::input_norm, l), N, C, eps);
    }
    {
      ScopedTimer t(profile_, "fwd.attn_proj");
      ops::matmul_forward(a.q, a.ln1, W(ParamKind::q_proj, l), N, C, Q);
      ops::matmul_forward(a.k, a.ln1, W(ParamKind::k_proj, l), N, C, KVd);
      ops::matmul_forward(a.v, a.ln1, W(ParamKind::v_proj, l), N, C, KVd);
    }
    {
      ScopedTimer t(profile_, "fwd.rope");
      ops::rope_forward(a.q, a.q, positions_.data(), N, NH, HD, theta);
      ops::rope_forward(a.k, a.k, positions_.data(), N, NKV, HD, theta);
    }
    {
      ScopedTimer t(profile_, "fwd.attention");
      ops::attention_forward(a.att, a.probs, a.q, a.k, a.v, amask, B, T, NH, NKV, HD);
    }
    {
      ScopedTimer t(profile_, "fwd.attn_proj");
      if (!tp_on()) {
        std::memcpy(a.h, a.x, sizeof(float) * N * C);
        ops::matmul_forward_accumulate(a.h, a.att, W(ParamKind::o_proj, l), N, Q, C);
      } else {
        // Row-parallel o_proj: each rank's heads give a partial sum of the output.
        ops::matmul_forward(tmp_, a.att, W(ParamKind::o_proj, l), N, Q, C);
        tp_all_reduce(tmp_, N * C);
        std::memcpy(a.h, a.x, sizeof(float) * N * C);
        add_inplace(a.h, tmp_, N * C);
      }
    }
    {
      ScopedTimer t(profile_, "fwd.norms");
      // FFN block: x_next = h + ffn(rmsnorm(h)).
      ops::rmsnorm_forward(a.ln2, a.rstd2, a.h, W(ParamKind::post_norm, l), N, C, eps);
    }
    const float* w13 = W(ParamKind::ffn_w13, l);
    const float* w2 = W(ParamKind::ffn_w2, l);
    if (moe) {
      {
        ScopedTimer t(profile_, "fwd.router");
        ops::matmul_forward(a.rlogits, a.ln2, W(ParamKind::router, l), N, C, E);
        if (!router_bias_.empty())
          for (long n = 0; n < N; n++)
            for (int e = 0; e < E; e++) a.rlogits[n * E + e] += router_bias_[e];
        ops::router_forward(a.rprobs, a.topk_idx, a.topk_w, a.rlogits, N, E, K);
        ops::router_layer_stats(router_stats_[l], a.rlogits, a.rprobs, a.topk_idx, tmask, N, E, K);
        if (capacity_factor_ > 0) {
          dropped_[l] = apply_capacity(a, tmask, N, E, K);
        } else {
          ops::moe_plan_build(a.plan, a.topk_idx, N, E, K);
          a.plan.overflow = 0;
        }
      }
      {
        ScopedTimer t(profile_, "fwd.moe_permute");
        ops::moe_permute_forward(a.xperm, a.ln2, a.plan, C);
      }
      if (!ep_on()) {
        ScopedTimer t(profile_, "fwd.experts");
        ops::moe_experts_forward(a.yperm, a.h13, a.act, a.xperm, w13, w2, a.plan, C, I);
      } else {
        const int El = E / ep_size_;
        ep_dispatch(a, C, El);
        const size_t Mr = a.ep.perm.size();
        a.ep.h13.resize(Mr * 2 * I);
        a.ep.act.resize(Mr * I);
        ep_dy_.resize(Mr * C);  // the local outputs, before they travel back
        {
          ScopedTimer t(profile_, "fwd.experts");
          ops::moe_experts_forward(ep_dy_.data(), a.ep.h13.data(), a.ep.act.data(), a.ep.x.data(), w13, w2,
                                   a.ep.plan, C, I);
        }
        ep_return(a.yperm, ep_dy_.data(), a.ep, C);
      }
      // Dropped rows (capacity) computed nothing: their outputs are zeros.
      const long kept = a.plan.expert_offsets[E];
      std::fill(a.yperm + kept * C, a.yperm + N * K * C, 0.0f);
      {
        ScopedTimer t(profile_, "fwd.moe_permute");
        ops::moe_combine_forward(x_next, a.yperm, a.plan.overflow ? a.combine_w.data() : a.topk_w, a.plan, C);
      }
    } else {
      ScopedTimer t(profile_, "fwd.experts");
      ops::moe_experts_forward(x_next, a.h13, a.act, a.ln2, w13, w2, a.plan, C, I);
    }
    // Row-parallel w2: the FFN output is a partial sum on each tp rank.
    if (tp_on()) tp_all_reduce(x_next, N * C);
    {
      ScopedTimer t(profile_, "fwd.residual");
      add_inplace(x_next, a.h, N * C);
    }
  }
  {
    ScopedTimer t(profile_, "fwd.head");
    ops::rmsnorm_forward(lnf_, rstdf_, x_final_, W(ParamKind::final_norm), N, C, eps);
    ops::matmul_forward(logits_, lnf_, W(ParamKind::lm_head), N, C, V);
  }

  Losses out;
  aux_dprobs_.assign(moe ? L : 0, std::vector<double>(E, 0.0));
  if (moe) {
    if (weights.aux_kind == AuxLossKind::hf_pooled) {
      std::vector<double> d;
      out.aux_loss = ops::load_balancing_loss_pooled(router_stats_, E, K, &d);
      for (int l = 0; l < L; l++)
        for (int e = 0; e < E; e++) aux_dprobs_[l][e] = weights.aux_coef * d[e];
    } else {
      for (int l = 0; l < L; l++) {
        std::vector<double> d;
        out.aux_loss += ops::load_balancing_loss_layer(router_stats_[l], E, K, &d);
        for (int e = 0; e < E; e++) aux_dprobs_[l][e] = weights.aux_coef * d[e];
      }
    }
    for (int l = 0; l < L; l++) out.z_loss += ops::router_z_loss_layer(router_stats_[l]);
  }
  if (has_labels_) {
    ScopedTimer t(profile_, "fwd.cross_entropy");
    if (!tp_on())
      out.ce_sum = ops::cross_entropy_forward(lse_, logits_, targets_.data(), N, V, 1.0f);
    else
      out.ce_sum = dist::cross_entropy_forward_vocab_parallel(lse_, logits_, targets_.data(), N, V,
                                                              table_.vocab_begin(), 1.0f, *tp_);
    out.loss_tokens = 0;
    for (long i = 0; i < N; i++) out.loss_tokens += targets_[i] != ops::IGNORE_INDEX;
    out.ce_loss = weights.ce_scale * out.ce_sum;
    out.loss = out.ce_loss + weights.aux_coef * out.aux_loss + weights.z_coef * out.z_loss;
  }
  forward_done_ = true;
  return out;
}

void MixtralModel::backward() {
  if (!forward_done_ || !has_labels_) fail("[MixtralModel::backward] needs a forward pass with labels first");
  forward_done_ = false;
  const int B = B_, T = T_;
  const long N = (long)B * T;
  const auto [C, V, I, NH, NKV, HD, Q, KVd, E, K, moe] = dims();
  const float theta = (float)cfg_.rope_theta;
  const float* P = params_.data();
  float* G = grads_.data();
  auto W = [&](ParamKind kind, int layer = -1) { return P + table_.at(kind, layer).offset; };
  auto D = [&](ParamKind kind, int layer = -1) { return G + table_.at(kind, layer).offset; };
  const uint8_t* tmask = has_token_mask_ ? token_mask_.data() : nullptr;
  const int L = cfg_.num_hidden_layers;

  // Head and final norm.  The logits buffer becomes dlogits in place.
  {
    ScopedTimer t(profile_, "bwd.cross_entropy");
    if (!tp_on())
      ops::cross_entropy_backward(logits_, logits_, lse_, targets_.data(), N, V, (float)weights_.ce_scale);
    else
      dist::cross_entropy_backward_vocab_parallel(logits_, logits_, lse_, targets_.data(), N, V, table_.vocab_begin(),
                                                  (float)weights_.ce_scale);
  }
  {
    ScopedTimer t(profile_, "bwd.head");
    ops::matmul_backward(dln_, D(ParamKind::lm_head), logits_, lnf_, W(ParamKind::lm_head), N, C, V);
    if (tp_on()) tp_all_reduce(dln_, N * C);
    ops::rmsnorm_backward(dres_, D(ParamKind::final_norm), dln_, x_final_, W(ParamKind::final_norm), rstdf_, N, C);
  }

  for (int l = L - 1; l >= 0; l--) {
    LayerActs& a = layers_[l];
    // FFN block: dres is d(x_next); it flows to h unchanged plus through the FFN.
    const float* w13 = W(ParamKind::ffn_w13, l);
    const float* w2 = W(ParamKind::ffn_w2, l);
    float* dw13 = D(ParamKind::ffn_w13, l);
    float* dw2 = D(ParamKind::ffn_w2, l);
    if (moe) {
      {
        ScopedTimer t(profile_, "bwd.moe_permute");
        ops::moe_combine_backward(dyperm_, dtopk_, dres_, a.yperm, a.plan.overflow ? a.combine_w.data() : a.topk_w,
                                  a.plan, C);
      }
      // yperm is this rank's partial expert output, so the routing-weight gradient is partial too.
      if (tp_on()) tp_all_reduce(dtopk_, N * K);
      if (!ep_on()) {
        ScopedTimer t(profile_, "bwd.experts");
        ops::moe_experts_backward(dxperm_, dw13, dw2, ffn_scratch_, dyperm_, a.h13, a.act, a.xperm, w13, w2, a.plan, C,
                                  I);
      } else {
        const size_t Mr = a.ep.perm.size();
        ep_dy_.resize(Mr * C);
        ep_dx_.resize(Mr * C);
        ep_scratch_.resize(3 * Mr * I);
        {
          ScopedTimer t(profile_, "ep.all_to_all");
          ep_send(ep_dy_.data(), dyperm_, a.ep, C);
        }
        {
          ScopedTimer t(profile_, "bwd.experts");
          ops::moe_experts_backward(ep_dx_.data(), dw13, dw2, ep_scratch_.data(), ep_dy_.data(), a.ep.h13.data(),
                                    a.ep.act.data(), a.ep.x.data(), w13, w2, a.ep.plan, C, I);
        }
        ep_return(dxperm_, ep_dx_.data(), a.ep, C);
      }
      {
        const long kept = a.plan.expert_offsets[E];  // dropped rows pass no gradient to the input
        std::fill(dxperm_ + kept * C, dxperm_ + N * K * C, 0.0f);
      }
      {
        ScopedTimer t(profile_, "bwd.moe_permute");
        ops::moe_permute_backward(dln_, dxperm_, a.plan, C);
      }
      if (tp_on()) tp_all_reduce(dln_, N * C);  // column-parallel w1/w3: partial input gradient
      ScopedTimer t(profile_, "bwd.router");
      ops::router_backward(drlogits_, dtopk_, aux_dprobs_[l].data(), tmask, a.rprobs, a.topk_idx, a.topk_w, N, E, K);
      if (weights_.z_coef != 0.0)
        ops::router_z_loss_backward(drlogits_, a.rlogits, a.rprobs, tmask, N, E, (float)weights_.z_coef);
      ops::matmul_backward(tmp_, D(ParamKind::router, l), drlogits_, a.ln2, W(ParamKind::router, l), N, C, E);
      add_inplace(dln_, tmp_, N * C);
    } else {
      ScopedTimer t(profile_, "bwd.experts");
      ops::moe_experts_backward(dln_, dw13, dw2, ffn_scratch_, dres_, a.h13, a.act, a.ln2, w13, w2, a.plan, C, I);
      if (tp_on()) tp_all_reduce(dln_, N * C);
    }
    {
      ScopedTimer t(profile_, "bwd.norms");
      ops::rmsnorm_backward(tmp_, D(ParamKind::post_norm, l), dln_, a.h, W(ParamKind::post_norm, l), a.rstd2, N, C);
      add_inplace(dres_, tmp_, N * C);
    }  // dres is now d(h)
    {
      ScopedTimer t(profile_, "bwd.attn_proj");

      // Attention block: h = x + o_proj(att).
      ops::matmul_backward(datt_, D(ParamKind::o_proj, l), dres_, a.att, W(ParamKind::o_proj, l), N, Q, C);
    }
    {
      ScopedTimer t(profile_, "bwd.attention");
      ops::attention_backward(dq_, dk_, dv_, datt_, a.probs, a.q, a.k, a.v, B, T, NH, NKV, HD);
    }
    {
      ScopedTimer t(profile_, "bwd.rope");
      ops::rope_backward(dq_, dq_, positions_.data(), N, NH, HD, theta);
      ops::rope_backward(dk_, dk_, positions_.data(), N, NKV, HD, theta);
    }
    {
      ScopedTimer t(profile_, "bwd.attn_proj");
      ops::matmul_backward(dln_, D(ParamKind::q_proj, l), dq_, a.ln1, W(ParamKind::q_proj, l), N, C, Q);
      ops::matmul_backward(tmp_, D(ParamKind::k_proj, l), dk_, a.ln1, W(ParamKind::k_proj, l), N, C, KVd);
      add_inplace(dln_, tmp_, N * C);
      ops::matmul_backward(tmp_, D(ParamKind::v_proj, l), dv_, a.ln1, W(ParamKind::v_proj, l), N, C, KVd);
      add_inplace(dln_, tmp_, N * C);
      if (tp_on()) tp_all_reduce(dln_, N * C);  // column-parallel q/k/v: partial input gradient
    }
    {
      ScopedTimer t(profile_, "bwd.norms");
      ops::rmsnorm_backward(tmp_, D(ParamKind::input_norm, l), dln_, a.x, W(ParamKind::input_norm, l), a.rstd1, N, C);
      add_inplace(dres_, tmp_, N * C);
    }  // dres is now d(x) of this layer
  }
  ScopedTimer t(profile_, "bwd.embedding");
  if (!tp_on())
    ops::embedding_backward(D(ParamKind::embedding), dres_, tokens_.data(), N, C, V);
  else
    dist::embedding_backward_vocab_parallel(D(ParamKind::embedding), dres_, tokens_.data(), N, C,
                                            table_.vocab_begin(), V);
}

}  // namespace moetron
