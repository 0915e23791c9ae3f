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

// Hands out pieces of one float arena, each rounded up to 16 floats: a measuring pass (base null,
// the pieces are null) sizes the arena, a second pass with base set hands out the real pointers.
struct ArenaCarver {
  float* base = nullptr;
  size_t used = 0;
  float* take(long n) {
    float* p = base ? base + used : nullptr;
    used += (size_t)(n + 15) / 16 * 16;
    return p;
  }
};

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

ParamShard model_shard(const ModelConfig& cfg, dist::Comm* tp, dist::Comm* ep, LayerRange layers) {
  ParamShard s;
  s.layer_begin = layers.begin;
  s.layer_end = layers.end;
  if (tp != nullptr) {
    s.tp_rank = tp->rank();
    s.tp_size = tp->size();
  }
  if (ep != nullptr && ep->size() > 1) {
    const int E = cfg.is_moe() ? cfg.num_local_experts : 1;
    if (!cfg.is_moe()) fail("parallel.ep: ep {} needs an MoE model (num_local_experts is 0)", ep->size());
    if (E % ep->size() != 0) fail("parallel.ep: ep {} does not divide num_local_experts {}", ep->size(), E);
    const int El = E / ep->size();
    s.expert_begin = ep->rank() * El;
    s.expert_end = (ep->rank() + 1) * El;
  }
  return s;
}

}  // namespace

MixtralModel::MixtralModel(const ModelConfig& cfg, dist::Comm* tp, dist::Comm* ep, LayerRange layers)
    : cfg_(cfg),
      tp_(tp),
      tp_size_(tp ? tp->size() : 1),
      ep_(ep),
      ep_size_(ep ? ep->size() : 1),
      layer_begin_(layers.begin),
      layer_end_(layers.end < 0 ? cfg.num_hidden_layers : layers.end),
      table_(cfg, model_shard(cfg, tp, ep, layers)) {
  const int NKV = cfg_.num_key_value_heads;
  if (tp_on() && NKV < tp_size_) kv_comm_ = tp_->split(tp_->rank() / (tp_size_ / NKV), tp_->rank(), "tp-kv");
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
  for (int l = layer_begin_; l < layer_end_; l++)
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
  for (int64_t m = 0; m < Mr; m++) std::memcpy(out_local + ep.perm[m] * C, ep_buf_.data() + m * C, sizeof(float) * C);
}

void MixtralModel::ep_return(float* out, const float* y_local, const EpLayer& ep, int C) {
  ScopedTimer t(profile_, "ep.all_to_all");
  const int P = ep_size_;
  const int64_t Mr = (int64_t)ep.perm.size();
  ep_buf_.resize((size_t)Mr * C);
#pragma omp parallel for schedule(static)
  for (int64_t m = 0; m < Mr; m++) std::memcpy(ep_buf_.data() + m * C, y_local + ep.perm[m] * C, sizeof(float) * C);
  std::vector<size_t> sc(P), rc(P);
  for (int p = 0; p < P; p++) {
    sc[p] = ep.recv_rows[p] * C;
    rc[p] = ep.send_rows[p] * C;
  }
  ep_->all_to_all_v(out, rc, ep_buf_.data(), sc, dist::CommDType::f32);
}

void MixtralModel::zero_grads() { std::fill(grads_.begin(), grads_.end(), 0.0f); }

void MixtralModel::allocate(Activations& s, int B, int T) {
  if (B == s.B && T == s.T && !s.layers.empty()) return;
  s.B = B;
  s.T = T;
  const long N = (long)B * T;
  const auto [C, V, I, NH, NKV, HD, Q, KVd, E, K, moe] = dims();
  const long M = N * K;
  const int L = layer_end_ - layer_begin_;
  const bool head = last_stage();

  // Two passes: the first measures, the second hands out pointers.
  ArenaCarver arena;
  auto take = [&](long n) { return arena.take(n); };
  s.layers.assign(L, LayerActs{});
  for (int pass = 0; pass < 2; pass++) {
    arena.used = 0;
    for (int l = 0; l < L; l++) {
      LayerActs& a = s.layers[l];
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
    s.x_final = take(N * C);
    s.lnf = head ? take(N * C) : nullptr;
    s.rstdf = head ? take(N) : nullptr;
    s.logits = head ? take(N * V) : nullptr;
    s.lse = head ? take(N) : nullptr;
    if (pass == 0) {
      s.arena.assign(arena.used, 0.0f);
      arena.base = s.arena.data();
    }
  }
  s.topk_arena.assign(moe ? (size_t)L * M : 0, 0);
  for (int l = 0; l < L; l++) s.layers[l].topk_idx = moe ? s.topk_arena.data() + (size_t)l * M : nullptr;
  if (!moe) {
    // A dense FFN is one expert that every token visits with weight 1: the identity plan.
    std::vector<int32_t> zeros(N, 0);
    for (LayerActs& a : s.layers) ops::moe_plan_build(a.plan, zeros.data(), N, 1, 1);
  }
}

void MixtralModel::allocate_scratch(int B, int T) {
  if (B == scratch_B_ && T == scratch_T_ && !scratch_.empty()) return;
  scratch_B_ = B;
  scratch_T_ = T;
  const long N = (long)B * T;
  const auto [C, V, I, NH, NKV, HD, Q, KVd, E, K, moe] = dims();
  const long M = N * K;
  ArenaCarver arena;
  auto take = [&](long n) { return arena.take(n); };
  for (int pass = 0; pass < 2; pass++) {
    arena.used = 0;
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
      scratch_.assign(arena.used, 0.0f);
      arena.base = scratch_.data();
    }
  }
}

MixtralModel::Activations& MixtralModel::acquire() {
  for (const auto& a : pool_)
    if (std::find(pending_.begin(), pending_.end(), a.get()) == pending_.end()) return *a;
  pool_.push_back(std::make_unique<Activations>());
  return *pool_.back();
}

size_t MixtralModel::Activations::bytes() const {
  size_t b = arena.size() * sizeof(float) + topk_arena.size() * sizeof(int32_t);
  for (const LayerActs& a : layers)
    b += (a.ep.x.size() + a.ep.h13.size() + a.ep.act.size() + a.combine_w.size()) * sizeof(float);
  return b;
}

size_t MixtralModel::activation_bytes_per_micro_batch() const { return last_ ? last_->bytes() : 0; }

const float* MixtralModel::logits() const { return last_ ? last_->logits : nullptr; }

const float* MixtralModel::stage_output() const {
  if (last_ == nullptr) fail("[MixtralModel::stage_output] no forward pass yet");
  return last_->x_final;
}

const ops::RouterLayerStats& MixtralModel::pooled_stats() const {
  if (last_ == nullptr) fail("[MixtralModel::pooled_stats] no forward pass yet");
  return last_->pooled;
}

const float* MixtralModel::input_grad() const {
  if (first_stage()) fail("[MixtralModel::input_grad] the first stage has no input hidden states (layers from 0)");
  return dres_;
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

Losses MixtralModel::forward(const Batch& batch, const LossWeights& weights, const StageInput& in) {
  pending_.clear();
  return forward_queued(batch, weights, in);
}

Losses MixtralModel::forward_queued(const Batch& batch, const LossWeights& weights, const StageInput& in) {
  validate_batch(batch, cfg_.vocab_size);
  if (!first_stage() && in.hidden == nullptr)
    fail("[MixtralModel::forward] the stage of layers [{}, {}) needs the previous stage's hidden states", layer_begin_,
         layer_end_);
  const int E = cfg_.is_moe() ? cfg_.num_local_experts : 0;
  if (in.pooled != nullptr && ((int)in.pooled->assigned.size() != E || (int)in.pooled->prob_sum.size() != E))
    fail("[MixtralModel::forward] pooled router statistics for {} experts, the model has {}",
         in.pooled->assigned.size(), E);
  Activations& s = acquire();
  const Losses out = run_forward(s, batch, weights, in);
  pending_.push_back(&s);
  last_ = &s;
  peak_pending_ = std::max(peak_pending_, pending_.size());
  size_t bytes = 0;
  for (const Activations* a : pending_) bytes += a->bytes();
  peak_activation_bytes_ = std::max(peak_activation_bytes_, bytes);
  return out;
}

Losses MixtralModel::run_forward(Activations& s, const Batch& batch, const LossWeights& weights, const StageInput& in) {
  allocate(s, batch.B, batch.T);
  allocate_scratch(batch.B, batch.T);
  const int B = batch.B, T = batch.T;
  const long N = (long)B * T;
  const auto [C, V, I, NH, NKV, HD, Q, KVd, E, K, moe] = dims();
  const float eps = (float)cfg_.rms_norm_eps, theta = (float)cfg_.rope_theta;
  const float* P = params_.data();
  auto W = [&](ParamKind kind, int layer = -1) { return P + table_.at(kind, layer).offset; };

  s.weights = weights;
  s.tokens = batch.input_ids;
  // Positions: given, or 0..T-1 restarting at each segment start.
  s.positions.resize(N);
  for (int b = 0; b < B; b++)
    for (int t = 0; t < T; t++) {
      const long i = (long)b * T + t;
      if (!batch.position_ids.empty())
        s.positions[i] = batch.position_ids[i];
      else if (!batch.segment_ids.empty() && t > 0 && batch.segment_ids[i] == batch.segment_ids[i - 1])
        s.positions[i] = s.positions[i - 1] + 1;
      else if (!batch.segment_ids.empty())
        s.positions[i] = 0;
      else
        s.positions[i] = t;
    }
  // Targets: the next token's label within the same segment.
  s.has_labels = !batch.labels.empty();
  s.targets.assign(N, ops::IGNORE_INDEX);
  if (s.has_labels)
    for (int b = 0; b < B; b++)
      for (int t = 0; t + 1 < T; t++) {
        const long i = (long)b * T + t;
        if (!batch.segment_ids.empty() && batch.segment_ids[i] != batch.segment_ids[i + 1]) continue;
        s.targets[i] = batch.labels[i + 1];
      }
  s.has_token_mask = !batch.attention_mask.empty();
  s.token_mask.assign(N, 1);
  if (s.has_token_mask)
    for (long i = 0; i < N; i++) s.token_mask[i] = batch.attention_mask[i] != 0;
  const uint8_t* tmask = s.has_token_mask ? s.token_mask.data() : nullptr;

  ops::AttentionMask amask;
  amask.attention_mask = batch.attention_mask.empty() ? nullptr : batch.attention_mask.data();
  amask.segment_ids = batch.segment_ids.empty() ? nullptr : batch.segment_ids.data();
  amask.sliding_window = cfg_.sliding_window;

  const int lb = layer_begin_, le = layer_end_, L = le - lb;
  router_stats_.assign(moe ? L : 0, ops::RouterLayerStats{});
  dropped_.assign(moe ? L : 0, 0);

  if (!first_stage()) {
    std::memcpy(s.layers[0].x, in.hidden, sizeof(float) * N * C);
  } else {
    ScopedTimer t(profile_, "fwd.embedding");
    if (!tp_on()) {
      ops::embedding_forward(s.layers[0].x, s.tokens.data(), W(ParamKind::embedding), N, C, V);
    } else {
      dist::embedding_forward_vocab_parallel(s.layers[0].x, s.tokens.data(), W(ParamKind::embedding), N, C,
                                             table_.vocab_begin(), V);
      tp_all_reduce(s.layers[0].x, N * C);
    }
  }
  for (int l = lb; l < le; l++) {
    LayerActs& a = s.layers[l - lb];
    float* x_next = l + 1 < le ? s.layers[l - lb + 1].x : s.x_final;
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
      ops::rope_forward(a.q, a.q, s.positions.data(), N, NH, HD, theta);
      ops::rope_forward(a.k, a.k, s.positions.data(), N, NKV, HD, theta);
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
        ops::router_layer_stats(router_stats_[l - lb], a.rlogits, a.rprobs, a.topk_idx, tmask, N, E, K);
        if (capacity_factor_ > 0) {
          dropped_[l - lb] = apply_capacity(a, tmask, N, E, K);
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
          ops::moe_experts_forward(ep_dy_.data(), a.ep.h13.data(), a.ep.act.data(), a.ep.x.data(), w13, w2, a.ep.plan,
                                   C, I);
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
  if (last_stage()) {
    ScopedTimer t(profile_, "fwd.head");
    ops::rmsnorm_forward(s.lnf, s.rstdf, s.x_final, W(ParamKind::final_norm), N, C, eps);
    ops::matmul_forward(s.logits, s.lnf, W(ParamKind::lm_head), N, C, V);
  }

  Losses out;
  s.aux_dprobs.assign(moe ? L : 0, std::vector<double>(E, 0.0));
  s.aux_grad.assign(moe ? E : 0, 0.0);
  if (moe) {
    // The statistics pooled over the layers so far, in layer order (the single-process sums).
    if (in.pooled != nullptr) {
      s.pooled = *in.pooled;
    } else {
      s.pooled = ops::RouterLayerStats{};
      s.pooled.assigned.assign(E, 0.0);
      s.pooled.prob_sum.assign(E, 0.0);
    }
    for (int l = 0; l < L; l++) {
      for (int e = 0; e < E; e++) {
        s.pooled.assigned[e] += router_stats_[l].assigned[e];
        s.pooled.prob_sum[e] += router_stats_[l].prob_sum[e];
      }
      s.pooled.tokens += router_stats_[l].tokens;
    }
    if (weights.aux_kind == AuxLossKind::hf_pooled) {
      // The last stage holds every layer's statistics; earlier stages get the gradient at backward.
      if (last_stage()) {
        std::vector<double> d;
        out.aux_loss = ops::load_balancing_loss_pooled({s.pooled}, E, K, &d);
        for (int e = 0; e < E; e++) s.aux_grad[e] = weights.aux_coef * d[e];
        for (int l = 0; l < L; l++) s.aux_dprobs[l] = s.aux_grad;
      }
    } else {
      for (int l = 0; l < L; l++) {
        std::vector<double> d;
        out.aux_loss += ops::load_balancing_loss_layer(router_stats_[l], E, K, &d);
        for (int e = 0; e < E; e++) s.aux_dprobs[l][e] = weights.aux_coef * d[e];
      }
    }
    for (int l = 0; l < L; l++) out.z_loss += ops::router_z_loss_layer(router_stats_[l]);
  }
  if (s.has_labels) {
    if (last_stage()) {
      ScopedTimer t(profile_, "fwd.cross_entropy");
      if (!tp_on())
        out.ce_sum = ops::cross_entropy_forward(s.lse, s.logits, s.targets.data(), N, V, 1.0f);
      else
        out.ce_sum = dist::cross_entropy_forward_vocab_parallel(s.lse, s.logits, s.targets.data(), N, V,
                                                                table_.vocab_begin(), 1.0f, *tp_);
      out.loss_tokens = 0;
      for (long i = 0; i < N; i++) out.loss_tokens += s.targets[i] != ops::IGNORE_INDEX;
      out.ce_loss = weights.ce_scale * out.ce_sum;
    }
    out.loss = out.ce_loss + weights.aux_coef * out.aux_loss + weights.z_coef * out.z_loss;
  }
  return out;
}

void MixtralModel::backward(const StageGrad& grad) {
  if (pending_.empty()) fail("[MixtralModel::backward] needs a forward pass with labels first (none is pending)");
  Activations& s = *pending_.front();
  if (!s.has_labels) fail("[MixtralModel::backward] needs a forward pass with labels first");
  if (!last_stage() && grad.hidden == nullptr)
    fail("[MixtralModel::backward] the stage of layers [{}, {}) needs the gradient of its output hidden states",
         layer_begin_, layer_end_);
  const bool pooled_aux = cfg_.is_moe() && s.weights.aux_kind == AuxLossKind::hf_pooled;
  if (pooled_aux && !last_stage() && grad.aux_grad == nullptr)
    fail("[MixtralModel::backward] the stage of layers [{}, {}) needs the last stage's aux-loss gradient", layer_begin_,
         layer_end_);
  pending_.pop_front();
  const int B = s.B, T = s.T;
  allocate_scratch(B, T);
  const long N = (long)B * T;
  const auto [C, V, I, NH, NKV, HD, Q, KVd, E, K, moe] = dims();
  const float theta = (float)cfg_.rope_theta;
  const float* P = params_.data();
  float* G = grads_.data();
  auto W = [&](ParamKind kind, int layer = -1) { return P + table_.at(kind, layer).offset; };
  auto D = [&](ParamKind kind, int layer = -1) { return G + table_.at(kind, layer).offset; };
  const uint8_t* tmask = s.has_token_mask ? s.token_mask.data() : nullptr;
  const int lb = layer_begin_, le = layer_end_;
  if (pooled_aux && !last_stage()) {
    // The pooled aux loss's gradient per expert, from the last stage (the same for every layer).
    s.aux_grad.assign(grad.aux_grad, grad.aux_grad + E);
    for (auto& d : s.aux_dprobs) d = s.aux_grad;
  }
  last_aux_grad_ = s.aux_grad;

  if (!last_stage()) {
    std::memcpy(dres_, grad.hidden, sizeof(float) * N * C);
  } else {
    // Head and final norm.  The logits buffer becomes dlogits in place.
    {
      ScopedTimer t(profile_, "bwd.cross_entropy");
      if (!tp_on())
        ops::cross_entropy_backward(s.logits, s.logits, s.lse, s.targets.data(), N, V, (float)s.weights.ce_scale);
      else
        dist::cross_entropy_backward_vocab_parallel(s.logits, s.logits, s.lse, s.targets.data(), N, V,
                                                    table_.vocab_begin(), (float)s.weights.ce_scale);
    }
    ScopedTimer t(profile_, "bwd.head");
    ops::matmul_backward(dln_, D(ParamKind::lm_head), s.logits, s.lnf, W(ParamKind::lm_head), N, C, V);
    if (tp_on()) tp_all_reduce(dln_, N * C);
    ops::rmsnorm_backward(dres_, D(ParamKind::final_norm), dln_, s.x_final, W(ParamKind::final_norm), s.rstdf, N, C);
  }

  for (int l = le - 1; l >= lb; l--) {
    LayerActs& a = s.layers[l - lb];
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
      ops::router_backward(drlogits_, dtopk_, s.aux_dprobs[l - lb].data(), tmask, a.rprobs, a.topk_idx, a.topk_w, N, E,
                           K);
      if (s.weights.z_coef != 0.0)
        ops::router_z_loss_backward(drlogits_, a.rlogits, a.rprobs, tmask, N, E, (float)s.weights.z_coef);
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
      ops::rope_backward(dq_, dq_, s.positions.data(), N, NH, HD, theta);
      ops::rope_backward(dk_, dk_, s.positions.data(), N, NKV, HD, theta);
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
  if (!first_stage()) return;  // dres is the gradient of the stage's input: input_grad()
  ScopedTimer t(profile_, "bwd.embedding");
  if (!tp_on())
    ops::embedding_backward(D(ParamKind::embedding), dres_, s.tokens.data(), N, C, V);
  else
    dist::embedding_backward_vocab_parallel(D(ParamKind::embedding), dres_, s.tokens.data(), N, C, table_.vocab_begin(),
                                            V);
}

}  // namespace moetron
