// CudaMixtralModel: the forward and backward of src/model/mixtral.cpp as flat lists of CUDA op
// calls (src/cuda/ops.h).  Host code only: it compiles in every build; built without CUDA the
// constructor fails with "built without CUDA" (the Context cannot be created).
// Parameter gradients accumulate (+=) into the gradient array; activation gradients flow through
// scratch buffers; the residual-stream gradient (dres, fp32) accumulates the branches.
#include "cuda/model.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include "core/error.h"
#include "core/rng.h"
#include "model/batch_io.h"
#include "ops/cross_entropy.h"

namespace moetron::gpu {

namespace {

// A profile section that measures device time: synchronises before and after (only when on).
class DeviceTimer {
 public:
  DeviceTimer(Profile* profile, Context& ctx, const char* section) : ctx_(ctx), on_(profile != nullptr) {
    if (on_) ctx.synchronize(section);
    timer_.emplace(profile, section);
  }
  ~DeviceTimer() {
    if (on_) ctx_.try_synchronize();  // before timer_ records the time; errors surface at the next call
  }
  DeviceTimer(const DeviceTimer&) = delete;
  DeviceTimer& operator=(const DeviceTimer&) = delete;

 private:
  Context& ctx_;
  bool on_;
  std::optional<ScopedTimer> timer_;
};

}  // namespace

CudaMixtralModel::CudaMixtralModel(const ModelConfig& cfg) : cfg_(cfg), table_(cfg) {
  ctx_ = std::make_unique<Context>();
  const Dims d = dims();
  if (d.moe) {
    MOETRON_OP_CHECK(d.E <= 64, "CudaMixtralModel", "the CUDA router supports at most 64 experts, got {}", d.E);
  }
  MOETRON_OP_CHECK(d.HD <= 128 && d.HD % 2 == 0, "CudaMixtralModel", "the CUDA attention supports even head dims up to 128, got {}",
                   d.HD);
  const size_t total = table_.total();
  const size_t bytes = DeviceArena::rounded(total * 4) * 2 + DeviceArena::rounded(total * 2) +
                       DeviceArena::rounded(grad_norm_scratch_doubles(total) * 8);
  state_ = DeviceArena(bytes, "model state");
  master_ = state_.take_n<float>(total);
  weights_bf16_ = state_.take_n<Bf16>(total);
  grads_ = state_.take_n<float>(total);
  norm_scratch_ = state_.take_n<double>(grad_norm_scratch_doubles(total));
  // Padding between tensors stays zero in every array.
  fill_zero(*ctx_, master_, total * 4);
  fill_zero(*ctx_, weights_bf16_, total * 2);
  fill_zero(*ctx_, grads_, total * 4);
  ctx_->synchronize("CudaMixtralModel");
}

CudaMixtralModel::~CudaMixtralModel() {
  if (ctx_) ctx_->try_synchronize();
}

CudaMixtralModel::Dims CudaMixtralModel::dims() const {
  const bool moe = cfg_.is_moe();
  const int Q = cfg_.num_attention_heads * cfg_.head_dim, KVd = cfg_.num_key_value_heads * cfg_.head_dim;
  return Dims{cfg_.hidden_size,
              cfg_.vocab_size,
              cfg_.intermediate_size,
              cfg_.num_attention_heads,
              cfg_.num_key_value_heads,
              cfg_.head_dim,
              Q,
              KVd,
              Q + 2 * KVd,
              moe ? cfg_.num_local_experts : 1,
              moe ? cfg_.num_experts_per_tok : 1,
              moe};
}

void CudaMixtralModel::set_params(const float* host) {
  copy_to_device(*ctx_, master_, host, table_.total() * 4);
  convert_to_bf16(*ctx_, weights_bf16_, master_, table_.total());
  ctx_->synchronize("set_params");
}

void CudaMixtralModel::get_params(float* host) { copy_to_host(*ctx_, host, master_, table_.total() * 4); }

void CudaMixtralModel::get_grads(float* host) { copy_to_host(*ctx_, host, grads_, table_.total() * 4); }

void CudaMixtralModel::zero_grads() { fill_zero(*ctx_, grads_, table_.total() * 4); }

void CudaMixtralModel::init_parameters(uint64_t seed) {
  for (const HfTensorRef& t : table_.hf_tensors()) {
    if (table_.spec_of(t).is_norm())
      init_normal(*ctx_, master_ + t.offset, t.numel, seed, 0, 0.0, 1.0f);
    else
      init_normal(*ctx_, master_ + t.offset, t.numel, seed, hash_name(t.name), cfg_.initializer_range, 0.0f);
  }
  convert_to_bf16(*ctx_, weights_bf16_, master_, table_.total());
  ctx_->synchronize("init_parameters");
}

double CudaMixtralModel::grad_norm() { return global_grad_norm(*ctx_, norm_scratch_, grads_, table_.total()); }

void CudaMixtralModel::get_logits(float* host) {
  if (!forward_done_) fail("[CudaMixtralModel::get_logits] no forward pass since the last backward");
  copy_to_host(*ctx_, host, logits_, sizeof(float) * (size_t)B_ * T_ * cfg_.vocab_size);
}

void CudaMixtralModel::allocate(int B, int T) {
  if (B == B_ && T == T_ && !layers_.empty()) return;
  const long N = (long)B * T;
  const auto [C, V, I, NH, NKV, HD, Q, KVd, S, E, K, moe] = dims();
  const long M = N * K;
  const int L = cfg_.num_hidden_layers;
  acts_ = DeviceArena();  // free the old shape's memory first
  layers_.assign(L, LayerActs{});
  B_ = T_ = 0;

  // Two passes: the first measures, the second hands out pointers.
  size_t used = 0;
  DeviceArena* arena = nullptr;
  auto take = [&](size_t bytes) -> void* {
    used += DeviceArena::rounded(bytes);
    return arena ? arena->take(bytes) : nullptr;
  };
  auto f32 = [&](long n) { return static_cast<float*>(take(sizeof(float) * (size_t)n)); };
  auto b16 = [&](long n) { return static_cast<Bf16*>(take(sizeof(Bf16) * (size_t)n)); };
  auto i32 = [&](long n) { return static_cast<int32_t*>(take(sizeof(int32_t) * (size_t)n)); };
  for (int pass = 0; pass < 2; pass++) {
    used = 0;
    for (int l = 0; l < L; l++) {
      LayerActs& a = layers_[l];
      a.x = f32(N * C);
      a.rstd1 = f32(N);
      a.ln1 = b16(N * C);
      a.qkv = b16(N * S);
      a.att = b16(N * Q);
      a.lse = f32((long)B * NH * T);
      a.h = f32(N * C);
      a.rstd2 = f32(N);
      a.ln2 = b16(N * C);
      if (moe) {
        a.rlogits = f32(N * E);
        a.rprobs = f32(N * E);
        a.topk_w = f32(N * K);
        a.topk_idx = i32(N * K);
        a.row_token = i32(M);
        a.row_of = i32(M);
        a.yperm = b16(M * C);
      }
      a.h13 = b16(M * 2 * I);
      a.act = b16(M * I);
    }
    x_final_ = f32(N * C);
    rstdf_ = f32(N);
    lnf_ = b16(N * C);
    logits_ = f32(N * V);
    ce_lse_ = f32(N);
    row_loss_ = f32(N);
    tokens_d_ = i32(N);
    positions_d_ = i32(N);
    targets_d_ = i32(N);
    amask_d_ = i32(N);
    seg_d_ = i32(N);
    token_mask_d_ = static_cast<uint8_t*>(take((size_t)N));
    ln2_f32_ = moe ? f32(N * C) : nullptr;
    xperm_ = moe ? b16(M * C) : nullptr;
    dres_ = f32(N * C);
    dln_ = f32(N * C);
    dres_bf_ = b16(N * C);
    datt_ = b16(N * Q);
    dqkv_ = b16(N * S);
    attn_scratch_ = f32((long)attention_backward_scratch_floats(B, T, NH, HD));
    drlogits_ = moe ? f32(N * E) : nullptr;
    dtopk_ = moe ? f32(N * K) : nullptr;
    dyperm_ = moe ? b16(M * C) : nullptr;
    ffn_scratch_ = b16(3 * M * I);
    plan_scratch_ = static_cast<int64_t*>(take(sizeof(int64_t) * (E + 1)));
    stats_d_ = static_cast<double*>(take(sizeof(double) * (size_t)L * (2 * E + 2)));
    if (pass == 0) {
      acts_ = DeviceArena(used, "activations");
      arena = &acts_;
    }
  }
  B_ = B;
  T_ = T;
}

bool CudaMixtralModel::qkv_contiguous(int layer) const {
  const Dims d = dims();
  const ParamSpec &q = table_.at(ParamKind::q_proj, layer), &k = table_.at(ParamKind::k_proj, layer),
                  &v = table_.at(ParamKind::v_proj, layer);
  return k.offset == q.offset + (size_t)d.Q * d.C && v.offset == k.offset + (size_t)d.KVd * d.C;
}

// qkv[N,S] = ln1 @ [Wq; Wk; Wv]^T: one GEMM when the three weights are adjacent (they are whenever
// their sizes are multiples of 16 floats), otherwise one per projection into the column blocks.
void CudaMixtralModel::qkv_forward(LayerActs& a, int l) {
  const Dims d = dims();
  const long N = (long)B_ * T_;
  if (qkv_contiguous(l)) {
    gemm(*ctx_, false, true, (int)N, d.S, d.C, 1.0f, a.ln1, d.C, Wb(ParamKind::q_proj, l), d.C, 0.0f, a.qkv, d.S,
         DType::BF16, DType::BF16);
    return;
  }
  const ParamKind kinds[3] = {ParamKind::q_proj, ParamKind::k_proj, ParamKind::v_proj};
  const int widths[3] = {d.Q, d.KVd, d.KVd}, cols[3] = {0, d.Q, d.Q + d.KVd};
  for (int p = 0; p < 3; p++)
    gemm(*ctx_, false, true, (int)N, widths[p], d.C, 1.0f, a.ln1, d.C, Wb(kinds[p], l), d.C, 0.0f, a.qkv + cols[p],
         d.S, DType::BF16, DType::BF16);
}

// dln[N,C] = dqkv @ [Wq; Wk; Wv] (fp32, assign);  d[Wq; Wk; Wv] += dqkv^T @ ln1.
void CudaMixtralModel::qkv_backward(LayerActs& a, int l) {
  const Dims d = dims();
  const long N = (long)B_ * T_;
  if (qkv_contiguous(l)) {
    gemm(*ctx_, false, false, (int)N, d.C, d.S, 1.0f, dqkv_, d.S, Wb(ParamKind::q_proj, l), d.C, 0.0f, dln_, d.C,
         DType::BF16, DType::F32);
    gemm(*ctx_, true, false, d.S, d.C, (int)N, 1.0f, dqkv_, d.S, a.ln1, d.C, 1.0f, G(ParamKind::q_proj, l), d.C,
         DType::BF16, DType::F32);
    return;
  }
  const ParamKind kinds[3] = {ParamKind::q_proj, ParamKind::k_proj, ParamKind::v_proj};
  const int widths[3] = {d.Q, d.KVd, d.KVd}, cols[3] = {0, d.Q, d.Q + d.KVd};
  for (int p = 0; p < 3; p++) {
    gemm(*ctx_, false, false, (int)N, d.C, widths[p], 1.0f, dqkv_ + cols[p], d.S, Wb(kinds[p], l), d.C,
         p == 0 ? 0.0f : 1.0f, dln_, d.C, DType::BF16, DType::F32);
    gemm(*ctx_, true, false, widths[p], d.C, (int)N, 1.0f, dqkv_ + cols[p], d.S, a.ln1, d.C, 1.0f, G(kinds[p], l),
         d.C, DType::BF16, DType::F32);
  }
}

Losses CudaMixtralModel::forward(const Batch& batch, const LossWeights& weights) {
  validate_batch(batch, cfg_.vocab_size);
  allocate(batch.B, batch.T);
  Context& ctx = *ctx_;
  const int B = batch.B, T = batch.T;
  const long N = (long)B * T;
  const auto [C, V, I, NH, NKV, HD, Q, KVd, S, E, K, moe] = dims();
  const float eps = (float)cfg_.rms_norm_eps, theta = (float)cfg_.rope_theta;
  const int L = cfg_.num_hidden_layers;
  forward_done_ = false;
  weights_ = weights;

  // Host-side inputs exactly as MixtralModel::forward derives them.
  std::vector<int32_t> positions(N), targets(N, ops::IGNORE_INDEX);
  for (int b = 0; b < B; b++)
    for (int t = 0; t < T; t++) {
      const long i = (long)b * T + t;
      if (!batch.position_ids.empty())
        positions[i] = batch.position_ids[i];
      else if (!batch.segment_ids.empty() && t > 0 && batch.segment_ids[i] == batch.segment_ids[i - 1])
        positions[i] = positions[i - 1] + 1;
      else if (!batch.segment_ids.empty())
        positions[i] = 0;
      else
        positions[i] = t;
    }
  has_labels_ = !batch.labels.empty();
  if (has_labels_)
    for (int b = 0; b < B; b++)
      for (int t = 0; t + 1 < T; t++) {
        const long i = (long)b * T + t;
        if (!batch.segment_ids.empty() && batch.segment_ids[i] != batch.segment_ids[i + 1]) continue;
        targets[i] = batch.labels[i + 1];
      }
  has_token_mask_ = !batch.attention_mask.empty();
  has_amask_ = has_token_mask_;
  has_seg_ = !batch.segment_ids.empty();
  std::vector<uint8_t> token_mask(N, 1);
  real_tokens_ = N;
  if (has_token_mask_) {
    real_tokens_ = 0;
    for (long i = 0; i < N; i++) {
      token_mask[i] = batch.attention_mask[i] != 0;
      real_tokens_ += token_mask[i];
    }
  }
  copy_to_device(ctx, tokens_d_, batch.input_ids.data(), sizeof(int32_t) * N);
  copy_to_device(ctx, positions_d_, positions.data(), sizeof(int32_t) * N);
  copy_to_device(ctx, targets_d_, targets.data(), sizeof(int32_t) * N);
  copy_to_device(ctx, token_mask_d_, token_mask.data(), N);
  if (has_amask_) copy_to_device(ctx, amask_d_, batch.attention_mask.data(), sizeof(int32_t) * N);
  if (has_seg_) copy_to_device(ctx, seg_d_, batch.segment_ids.data(), sizeof(int32_t) * N);
  const uint8_t* tmask = has_token_mask_ ? token_mask_d_ : nullptr;
  AttentionMask amask;
  amask.attention_mask = has_amask_ ? amask_d_ : nullptr;
  amask.segment_ids = has_seg_ ? seg_d_ : nullptr;
  amask.sliding_window = cfg_.sliding_window;

  {
    DeviceTimer t(profile_, ctx, "fwd.embedding");
    embedding_forward(ctx, layers_[0].x, tokens_d_, W(ParamKind::embedding), N, C, V);
  }
  for (int l = 0; l < L; l++) {
    LayerActs& a = layers_[l];
    float* x_next = l + 1 < L ? layers_[l + 1].x : x_final_;
    // Attention block: h = x + o_proj(attn(rope(q), rope(k), v)).
    {
      DeviceTimer t(profile_, ctx, "fwd.norms");
      rmsnorm_forward(ctx, a.ln1, nullptr, a.rstd1, a.x, W(ParamKind::input_norm, l), N, C, eps);
    }
    {
      DeviceTimer t(profile_, ctx, "fwd.attn_proj");
      qkv_forward(a, l);
    }
    {
      DeviceTimer t(profile_, ctx, "fwd.rope");
      rope_forward(ctx, a.qkv, a.qkv, S, positions_d_, N, NH, HD, theta);
      rope_forward(ctx, a.qkv + Q, a.qkv + Q, S, positions_d_, N, NKV, HD, theta);
    }
    {
      DeviceTimer t(profile_, ctx, "fwd.attention");
      attention_forward(ctx, a.att, a.lse, a.qkv, a.qkv + Q, a.qkv + Q + KVd, amask, B, T, NH, NKV, HD, S, S);
    }
    {
      DeviceTimer t(profile_, ctx, "fwd.attn_proj");
      copy_device(ctx, a.h, a.x, sizeof(float) * N * C);
      matmul_forward_f32(ctx, a.h, a.att, Wb(ParamKind::o_proj, l), (int)N, Q, C, true);
    }
    // FFN block: x_next = h + ffn(rmsnorm(h)).
    {
      DeviceTimer t(profile_, ctx, "fwd.norms");
      rmsnorm_forward(ctx, a.ln2, moe ? ln2_f32_ : nullptr, a.rstd2, a.h, W(ParamKind::post_norm, l), N, C, eps);
    }
    if (moe) {
      {
        DeviceTimer t(profile_, ctx, "fwd.router");
        gemm(ctx, false, true, (int)N, E, C, 1.0f, ln2_f32_, C, W(ParamKind::router, l), C, 0.0f, a.rlogits, E,
             DType::F32, DType::F32);
        router_forward(ctx, a.rprobs, a.topk_idx, a.topk_w, a.rlogits, N, E, K);
        router_layer_stats(ctx, stats_d_ + (size_t)l * (2 * E + 2), a.rlogits, a.rprobs, a.topk_idx, tmask, N, E, K);
        moe_plan_build(ctx, a.plan, a.row_token, a.row_of, plan_scratch_, a.topk_idx, N, E, K);
      }
      {
        DeviceTimer t(profile_, ctx, "fwd.moe_permute");
        moe_permute_forward(ctx, xperm_, a.ln2, a.plan, C);
      }
      {
        DeviceTimer t(profile_, ctx, "fwd.experts");
        moe_experts_forward(ctx, a.yperm, a.h13, a.act, xperm_, Wb(ParamKind::ffn_w13, l), Wb(ParamKind::ffn_w2, l),
                            a.plan, C, I);
      }
      {
        DeviceTimer t(profile_, ctx, "fwd.moe_permute");
        moe_combine_forward(ctx, x_next, a.h, a.yperm, a.topk_w, a.plan, C);  // includes the residual
      }
    } else {
      DeviceTimer t(profile_, ctx, "fwd.experts");
      matmul_forward(ctx, a.h13, a.ln2, Wb(ParamKind::ffn_w13, l), (int)N, C, 2 * I);
      swiglu_forward(ctx, a.act, a.h13, N, I);
      copy_device(ctx, x_next, a.h, sizeof(float) * N * C);
      matmul_forward_f32(ctx, x_next, a.act, Wb(ParamKind::ffn_w2, l), (int)N, I, C, true);
    }
  }
  {
    DeviceTimer t(profile_, ctx, "fwd.head");
    rmsnorm_forward(ctx, lnf_, nullptr, rstdf_, x_final_, W(ParamKind::final_norm), N, C, eps);
    matmul_forward_f32(ctx, logits_, lnf_, Wb(ParamKind::lm_head), (int)N, C, V, false);
  }

  Losses out;
  router_stats_.assign(moe ? L : 0, ops::RouterLayerStats{});
  aux_dprobs_.assign(moe ? L : 0, std::vector<double>(E, 0.0));
  if (moe) {
    std::vector<double> st((size_t)L * (2 * E + 2));
    copy_to_host(ctx, st.data(), stats_d_, sizeof(double) * st.size());
    for (int l = 0; l < L; l++) {
      const double* s = st.data() + (size_t)l * (2 * E + 2);
      ops::RouterLayerStats& r = router_stats_[l];
      r.assigned.assign(s, s + E);
      r.prob_sum.assign(s + E, s + 2 * E);
      r.tokens = s[2 * E];
      r.z_sum = s[2 * E + 1];
    }
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
    DeviceTimer t(profile_, ctx, "fwd.cross_entropy");
    out.ce_sum = cross_entropy_forward(ctx, ce_lse_, row_loss_, logits_, targets_d_, N, V, 1.0f);
    out.loss_tokens = 0;
    for (long i = 0; i < N; i++) out.loss_tokens += targets[i] != ops::IGNORE_INDEX;
    out.ce_loss = weights.ce_scale * out.ce_sum;
    out.loss = out.ce_loss + weights.aux_coef * out.aux_loss + weights.z_coef * out.z_loss;
  }
  forward_done_ = true;
  return out;
}

void CudaMixtralModel::backward() {
  if (!forward_done_ || !has_labels_)
    fail("[CudaMixtralModel::backward] needs a forward pass with labels first");
  forward_done_ = false;
  Context& ctx = *ctx_;
  const int B = B_, T = T_;
  const long N = (long)B * T;
  const auto [C, V, I, NH, NKV, HD, Q, KVd, S, E, K, moe] = dims();
  const float eps = (float)cfg_.rms_norm_eps, theta = (float)cfg_.rope_theta;
  const int L = cfg_.num_hidden_layers;
  const uint8_t* tmask = has_token_mask_ ? token_mask_d_ : nullptr;
  AttentionMask amask;
  amask.attention_mask = has_amask_ ? amask_d_ : nullptr;
  amask.segment_ids = has_seg_ ? seg_d_ : nullptr;
  amask.sliding_window = cfg_.sliding_window;

  // Head and final norm.  dlogits (bf16) is written in place over the fp32 logits: row n's bf16
  // values occupy the first half of its fp32 row, so the bf16 matrix has row stride 2V.
  Bf16* dlogits = reinterpret_cast<Bf16*>(logits_);
  const long ldd = 2L * V;
  {
    DeviceTimer t(profile_, ctx, "bwd.cross_entropy");
    cross_entropy_backward(ctx, dlogits, ldd, logits_, ce_lse_, targets_d_, N, V, (float)weights_.ce_scale);
  }
  {
    DeviceTimer t(profile_, ctx, "bwd.head");
    gemm(ctx, false, false, (int)N, C, V, 1.0f, dlogits, ldd, Wb(ParamKind::lm_head), C, 0.0f, dln_, C, DType::BF16,
         DType::F32);
    gemm(ctx, true, false, V, C, (int)N, 1.0f, dlogits, ldd, lnf_, C, 1.0f, G(ParamKind::lm_head), C, DType::BF16,
         DType::F32);
    rmsnorm_backward(ctx, dres_, G(ParamKind::final_norm), dln_, x_final_, W(ParamKind::final_norm), rstdf_, N, C,
                     false);
  }

  for (int l = L - 1; l >= 0; l--) {
    LayerActs& a = layers_[l];
    // FFN block: dres is d(x_next); it reaches h unchanged plus through the FFN.
    if (moe) {
      {
        DeviceTimer t(profile_, ctx, "bwd.moe_permute");
        moe_combine_backward(ctx, dyperm_, dtopk_, dres_, a.yperm, a.topk_w, a.plan, C);
        moe_permute_forward(ctx, xperm_, a.ln2, a.plan, C);  // recompute the expert inputs
      }
      {
        DeviceTimer t(profile_, ctx, "bwd.experts");
        // dxperm overwrites dyperm expert by expert (moe_experts_backward allows the alias).
        moe_experts_backward(ctx, dyperm_, G(ParamKind::ffn_w13, l), G(ParamKind::ffn_w2, l), ffn_scratch_, dyperm_,
                             a.h13, a.act, xperm_, Wb(ParamKind::ffn_w13, l), Wb(ParamKind::ffn_w2, l), a.plan, C,
                             I);
      }
      {
        DeviceTimer t(profile_, ctx, "bwd.moe_permute");
        moe_permute_backward(ctx, dln_, dyperm_, a.plan, C, false);
      }
      DeviceTimer t(profile_, ctx, "bwd.router");
      router_backward(ctx, drlogits_, dtopk_, aux_dprobs_[l].data(), tmask, a.rprobs, a.topk_idx, a.topk_w, N, E, K);
      if (weights_.z_coef != 0.0)
        router_z_loss_backward(ctx, drlogits_, a.rlogits, a.rprobs, tmask, N, E, (float)weights_.z_coef,
                               real_tokens_);
      // The router's fp32 input, recomputed; dln += drlogits @ Wr; dWr += drlogits^T @ ln2.
      rmsnorm_forward(ctx, nullptr, ln2_f32_, nullptr, a.h, W(ParamKind::post_norm, l), N, C, eps);
      gemm(ctx, false, false, (int)N, C, E, 1.0f, drlogits_, E, W(ParamKind::router, l), C, 1.0f, dln_, C,
           DType::F32, DType::F32);
      gemm(ctx, true, false, E, C, (int)N, 1.0f, drlogits_, E, ln2_f32_, C, 1.0f, G(ParamKind::router, l), C,
           DType::F32, DType::F32);
    } else {
      DeviceTimer t(profile_, ctx, "bwd.experts");
      Bf16* dact = ffn_scratch_;          // [N, I]
      Bf16* dh13 = ffn_scratch_ + N * I;  // [N, 2I]
      convert_to_bf16(ctx, dres_bf_, dres_, (size_t)N * C);
      matmul_backward(ctx, dact, G(ParamKind::ffn_w2, l), dres_bf_, a.act, Wb(ParamKind::ffn_w2, l), (int)N, I, C);
      swiglu_backward(ctx, dh13, dact, a.h13, N, I);
      gemm(ctx, false, false, (int)N, C, 2 * I, 1.0f, dh13, 2 * I, Wb(ParamKind::ffn_w13, l), C, 0.0f, dln_, C,
           DType::BF16, DType::F32);
      gemm(ctx, true, false, 2 * I, C, (int)N, 1.0f, dh13, 2 * I, a.ln2, C, 1.0f, G(ParamKind::ffn_w13, l), C,
           DType::BF16, DType::F32);
    }
    {
      DeviceTimer t(profile_, ctx, "bwd.norms");
      rmsnorm_backward(ctx, dres_, G(ParamKind::post_norm, l), dln_, a.h, W(ParamKind::post_norm, l), a.rstd2, N, C,
                       true);
    }  // dres is now d(h)
    {
      DeviceTimer t(profile_, ctx, "bwd.attn_proj");
      // Attention block: h = x + o_proj(att).
      convert_to_bf16(ctx, dres_bf_, dres_, (size_t)N * C);
      matmul_backward(ctx, datt_, G(ParamKind::o_proj, l), dres_bf_, a.att, Wb(ParamKind::o_proj, l), (int)N, Q, C);
    }
    {
      DeviceTimer t(profile_, ctx, "bwd.attention");
      attention_backward(ctx, dqkv_, dqkv_ + Q, dqkv_ + Q + KVd, attn_scratch_, datt_, a.att, a.lse, a.qkv,
                         a.qkv + Q, a.qkv + Q + KVd, amask, B, T, NH, NKV, HD, S, S);
    }
    {
      DeviceTimer t(profile_, ctx, "bwd.rope");
      rope_backward(ctx, dqkv_, dqkv_, S, positions_d_, N, NH, HD, theta);
      rope_backward(ctx, dqkv_ + Q, dqkv_ + Q, S, positions_d_, N, NKV, HD, theta);
    }
    {
      DeviceTimer t(profile_, ctx, "bwd.attn_proj");
      qkv_backward(a, l);
    }
    {
      DeviceTimer t(profile_, ctx, "bwd.norms");
      rmsnorm_backward(ctx, dres_, G(ParamKind::input_norm, l), dln_, a.x, W(ParamKind::input_norm, l), a.rstd1, N,
                       C, true);
    }  // dres is now d(x) of this layer
  }
  DeviceTimer t(profile_, ctx, "bwd.embedding");
  embedding_backward(ctx, G(ParamKind::embedding), dres_, tokens_d_, N, C, V);
}

CudaAdamW::CudaAdamW(CudaMixtralModel& model, const AdamWConfig& cfg) : model_(model), cfg_(cfg) {
  const size_t total = model.table().total();
  arena_ = DeviceArena(DeviceArena::rounded(total * 4) * 2, "AdamW moments");
  m_ = arena_.take_n<float>(total);
  v_ = arena_.take_n<float>(total);
  fill_zero(model.context(), m_, total * 4);
  fill_zero(model.context(), v_, total * 4);
}

void CudaAdamW::get_state(float* exp_avg, float* exp_avg_sq) {
  const size_t total = model_.table().total();
  copy_to_host(model_.context(), exp_avg, m_, total * 4);
  copy_to_host(model_.context(), exp_avg_sq, v_, total * 4);
}

void CudaAdamW::set_state(const float* exp_avg, const float* exp_avg_sq) {
  const size_t total = model_.table().total();
  copy_to_device(model_.context(), m_, exp_avg, total * 4);
  copy_to_device(model_.context(), v_, exp_avg_sq, total * 4);
}

void CudaAdamW::step(double lr, float grad_scale) {
  step_++;
  Context& ctx = model_.context();
  for (const ParamSpec& s : model_.table().specs()) {
    const double wd = s.weight_decay ? cfg_.weight_decay : 0.0;
    adamw_update(ctx, model_.device_params() + s.offset, model_.device_params_bf16() + s.offset, m_ + s.offset,
                 v_ + s.offset, model_.device_grads() + s.offset, s.numel, grad_scale, lr, cfg_.beta1, cfg_.beta2,
                 cfg_.eps, wd, step_);
  }
}

}  // namespace moetron::gpu
