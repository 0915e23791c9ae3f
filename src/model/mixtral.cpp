// Mixtral forward and backward, the one layer body of every backend.  The backward is the forward's
// call list in reverse; parameter gradients accumulate (+=) into grads(), activation gradients flow
// through scratch tensors; the residual-stream gradient dres (f32) accumulates the branches.
#include "model/mixtral.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#include "backend/cpu.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/rng.h"
#include "dist/comm.h"
#include "model/batch_io.h"
#include "ops/cross_entropy.h"

namespace moetron {

namespace {

ParamShard model_shard(const ModelConfig& cfg, dist::Comm* tp, dist::Comm* ep, LayerRange layers) {
  return make_param_shard(cfg, layers.begin, layers.end, tp ? tp->rank() : 0, tp ? tp->size() : 1,
                          ep ? ep->rank() : 0, ep ? ep->size() : 1);
}

// A profile section; on a device backend it synchronises before and after (only when on), so the
// time is the device's.
class Section {
 public:
  Section(Backend& be, Profile* profile, const char* name) : be_(be), on_(profile != nullptr) {
    if (on_) be.synchronize(name);
    timer_.emplace(profile, name);
  }
  ~Section() {
    if (on_) {
      try {
        be_.synchronize("profile section");
      } catch (...) {  // surfaces at the next call
      }
    }
  }
  Section(const Section&) = delete;
  Section& operator=(const Section&) = delete;

 private:
  Backend& be_;
  bool on_;
  std::optional<ScopedTimer> timer_;
};

}  // namespace

MixtralModel::MixtralModel(const ModelConfig& cfg, dist::Comm* tp, dist::Comm* ep, LayerRange layers,
                           const LoraSpec& lora)
    : own_backend_(make_cpu_backend()),
      be_(*own_backend_),
      cfg_(cfg),
      table_(cfg, model_shard(cfg, tp, ep, layers)) {
  init(tp, ep, layers, lora);
}

MixtralModel::MixtralModel(Backend& backend, const ModelConfig& cfg, dist::Comm* tp, dist::Comm* ep,
                           LayerRange layers, const LoraSpec& lora)
    : be_(backend), cfg_(cfg), table_(cfg, model_shard(cfg, tp, ep, layers)) {
  init(tp, ep, layers, lora);
}

void MixtralModel::init(dist::Comm* tp, dist::Comm* ep, LayerRange layers, const LoraSpec& lora) {
  lora_ = lora;
  tp_ = tp;
  tp_size_ = tp ? tp->size() : 1;
  ep_ = ep;
  ep_size_ = ep ? ep->size() : 1;
  layer_begin_ = layers.begin;
  layer_end_ = layers.end < 0 ? cfg_.num_hidden_layers : layers.end;
  const int NKV = cfg_.num_key_value_heads;
  if (tp_on() && NKV < tp_size_) kv_comm_ = tp_->split(tp_->rank() / (tp_size_ / NKV), tp_->rank(), "tp-kv");
  const Dims d = dims();
  be_.check_model(cfg_.head_dim, cfg_.is_moe() ? cfg_.num_local_experts : 0);
  dispatch_ = ep_on() ? make_all_to_all_dispatch(be_, *ep_, d.C, d.I, d.E) : make_local_dispatch(be_, d.C, d.I);
  for (int l = layer_begin_; l < layer_end_; l++)
    if (layer_moe(l) && ffn_width(l) != d.I) fail("[MixtralModel] layer {}: expert width {} != {}", l, ffn_width(l), d.I);
  // A table's parameters and gradients (none for a frozen base) and its GEMM copy.
  const auto place = [&](size_t total, bool with_grads, std::vector<float>& hp, std::vector<float>& hg,
                         std::unique_ptr<Allocation>& ap, std::unique_ptr<Allocation>& ag,
                         std::unique_ptr<Allocation>& agemm, Tensor& tparam, Tensor& tg, Tensor& tgemm, const char* what) {
    if (be_.host_memory()) {
      hp.assign(total, 0.0f);
      tparam = be_.view(hp.data(), Store::f32, total);
      if (with_grads) {
        hg.assign(total, 0.0f);
        tg = be_.view(hg.data(), Store::f32, total);
      }
    } else {
      ap = be_.allocate(total * 4, std::string(what) + " parameters");
      tparam = be_.view(ap->data(), Store::f32, total);
      if (with_grads) {
        ag = be_.allocate(total * 4, std::string(what) + " gradients");
        tg = be_.view(ag->data(), Store::f32, total);
      }
    }
    if (be_.act_store() == Store::f32) {
      tgemm = tparam;
    } else {
      agemm = be_.allocate(total * be_.element_bytes(be_.act_store()), std::string(what) + " GEMM weights");
      tgemm = be_.view(agemm->data(), be_.act_store(), total);
    }
  };
  base16_ = lora_.on() && lora_.base_bf16;
  if (!base16_) {
    place(table_.total(), !lora_.on(), params_, grads_, params_alloc_, grads_alloc_, gemm_alloc_, params_t_, grads_t_,
          gemm_t_, "model");
  } else {
    // Segments: the tensors before the first layer, each layer, the tensors after the last (tensors
    // are laid out layer by layer between the first stage's embedding and the last stage's head).
    const size_t total = table_.total();
    const int L = layer_end_ - layer_begin_;
    std::vector<size_t> layer_first(L, total);
    size_t suffix = total;
    for (const ParamSpec& sp : table_.specs()) {
      if (sp.layer >= 0)
        layer_first[sp.layer - layer_begin_] = std::min(layer_first[sp.layer - layer_begin_], sp.offset);
      else if (sp.kind != ParamKind::embedding)
        suffix = std::min(suffix, sp.offset);
    }
    seg_begin_.clear();
    if (layer_first[0] > 0) seg_begin_.push_back(0);
    for (size_t b : layer_first) seg_begin_.push_back(b);
    if (suffix < total) seg_begin_.push_back(suffix);
    seg_begin_.push_back(total);
    size_t window = 0;
    for (size_t i = 0; i + 1 < seg_begin_.size(); i++) window = std::max(window, seg_begin_[i + 1] - seg_begin_[i]);
    window_alloc_ = be_.allocate(window * 4, "frozen base: one segment widened to fp32");
    window_t_ = be_.view(window_alloc_->data(), Store::f32, window);
    if (be_.host_memory()) {
      base16_host_.assign(total, 0);
    } else {
      base16_alloc_ = be_.allocate(total * be_.element_bytes(Store::bf16), "frozen base (bf16)");
      base16_t_ = be_.view(base16_alloc_->data(), Store::bf16, total);
    }
  }
  if (lora_.on()) {
    lora_table_ = std::make_unique<ParamTable>(cfg_, lora_, table_.shard());
    place(lora_table_->total(), true, lparams_, lgrads_, lparams_alloc_, lgrads_alloc_, lgemm_alloc_, lparams_t_,
          lgrads_t_, lgemm_t_, "LoRA");
  }
  gemm_stale_ = lgemm_stale_ = true;
}

Tensor MixtralModel::train_param_tensor() {
  if (!lora_table_) return param_tensor();
  lgemm_stale_ = true;
  return lparams_t_;
}
void MixtralModel::get_train_params(float* host) const { be_.download(host, train_param_view()); }
void MixtralModel::set_train_params(const float* host) {
  be_.upload(train_param_tensor(), host);
}
void MixtralModel::init_lora(uint64_t seed) {
  if (!lora_table_) fail("[MixtralModel::init_lora] the model has no LoRA adapters");
  std::vector<float> host(lora_table_->total(), 0.0f);
  init_lora_parameters(*lora_table_, seed, host.data());
  set_train_params(host.data());
}

Tensor MixtralModel::LW(ParamKind target, int l, bool b) const {
  const ParamSpec* s = lora_table_ ? lora_table_->find_lora(target, l, b) : nullptr;
  return s ? lgemm_t_.part(s->offset, s->numel) : Tensor{};
}
Tensor MixtralModel::LW32(ParamKind target, int l, bool b) const {
  const ParamSpec* s = lora_table_ ? lora_table_->find_lora(target, l, b) : nullptr;
  return s ? lparams_t_.part(s->offset, s->numel) : Tensor{};
}
Tensor MixtralModel::LG(ParamKind target, int l, bool b) const {
  const ParamSpec* s = lora_table_ ? lora_table_->find_lora(target, l, b) : nullptr;
  return s ? lgrads_t_.part(s->offset, s->numel) : Tensor{};
}

void MixtralModel::lora_forward(Tensor out, Tensor u, Tensor x, ParamKind target, int l, const PlanView& pv, int IC,
                                int OC) {
  if (u.empty()) return;
  const int r = lora_.rank;
  be_.grouped_matmul_forward(u, x, LW(target, l, false), pv, IC, r, 1.0f, false);
  be_.grouped_matmul_forward(out, u, LW(target, l, true), pv, r, OC, lora_.scale(), true);
}

void MixtralModel::lora_backward(Tensor dx, Tensor dout, Tensor x, Tensor u, ParamKind target, int l,
                                 const PlanView& pv, int IC, int OC) {
  if (u.empty()) return;
  const int r = lora_.rank;
  const Tensor du = du_.part(0, u.numel);
  // out += s u B^T: du = s dout B, dB += s dout^T u;  u = x A^T: dx += du A, dA += du^T x.
  be_.grouped_matmul_backward(du, LG(target, l, true), dout, u, LW(target, l, true), pv, r, OC, lora_.scale(), false);
  be_.grouped_matmul_backward(dx, LG(target, l, false), du, x, LW(target, l, false), pv, IC, r, 1.0f, true);
}

ExpertFfnWeights MixtralModel::ffn_weights(int l, bool shared) {
  ExpertFfnWeights w;
  const ParamKind k13 = shared ? ParamKind::shared_w13 : ParamKind::ffn_w13;
  const ParamKind k2 = shared ? ParamKind::shared_w2 : ParamKind::ffn_w2;
  w.w13 = Wg(k13, l);
  w.w2 = Wg(k2, l);
  w.dw13 = G(k13, l);
  w.dw2 = G(k2, l);
  if (!lora_table_) return w;
  w.split13 = shared || !layer_moe(l);  // a dense FFN's gate and up adapters are PEFT's separate ones
  w.a13 = LW(k13, l, false);
  w.b13 = LW(k13, l, true);
  w.a2 = LW(k2, l, false);
  w.b2 = LW(k2, l, true);
  w.da13 = LG(k13, l, false);
  w.db13 = LG(k13, l, true);
  w.da2 = LG(k2, l, false);
  w.db2 = LG(k2, l, true);
  w.r = lora_.rank;
  w.scale = lora_.scale();
  return w;
}

MixtralModel::~MixtralModel() {
  try {
    be_.synchronize("~MixtralModel");
  } catch (...) {  // a destructor must not throw; the error was the last call's
  }
}

Tensor MixtralModel::param_tensor() {
  gemm_stale_ = true;
  return params_t_;
}

// Widens n bf16 values (host) into fp32.
static void widen_bf16(float* out, const uint16_t* in, size_t n) {
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; i++) out[i] = bf16_to_f32(in[i]);
}

Tensor MixtralModel::window_view(const ParamSpec& sp) const {
  const int seg = (int)(std::upper_bound(seg_begin_.begin(), seg_begin_.end(), sp.offset) - seg_begin_.begin()) - 1;
  const size_t b = seg_begin_[seg];
  if (window_seg_ != seg) {
    // Widen the whole segment (ops before this one finished reading the window: host calls return
    // when done; device work is in stream order).
    const size_t n = seg_begin_[seg + 1] - b;
    if (be_.host_memory())
      widen_bf16(window_t_.f32(), base16_host_.data() + b, n);
    else
      be_.convert(window_t_.part(0, n), base16_t_.part(b, n));
    window_seg_ = seg;
  }
  return window_t_.part(sp.offset - b, sp.numel);
}

std::vector<float>& MixtralModel::params() {
  if (base16_) fail("[MixtralModel::params] the frozen base is kept in bf16; use get_params / set_params");
  if (!be_.host_memory()) fail("[MixtralModel::params] the parameters live in {} memory; use get_params", be_.name());
  gemm_stale_ = true;
  return params_;
}
const std::vector<float>& MixtralModel::params() const {
  if (base16_) fail("[MixtralModel::params] the frozen base is kept in bf16; use get_params / set_params");
  if (!be_.host_memory()) fail("[MixtralModel::params] the parameters live in {} memory; use get_params", be_.name());
  return params_;
}
std::vector<float>& MixtralModel::grads() {
  if (!be_.host_memory()) fail("[MixtralModel::grads] the gradients live in {} memory; use get_grads", be_.name());
  return grads_;
}
const std::vector<float>& MixtralModel::grads() const {
  if (!be_.host_memory()) fail("[MixtralModel::grads] the gradients live in {} memory; use get_grads", be_.name());
  return grads_;
}

void MixtralModel::get_params(float* host) const {
  if (!base16_) return be_.download(host, params_t_);
  if (be_.host_memory()) return widen_bf16(host, base16_host_.data(), base16_host_.size());
  std::vector<uint16_t> b(table_.total());
  be_.download(b.data(), base16_t_);
  widen_bf16(host, b.data(), b.size());
}
void MixtralModel::set_params(const float* host) {
  gemm_stale_ = true;
  if (!base16_) return be_.upload(params_t_, host);
  // Rounded to bf16 (nearest even): the frozen base is model.dtype.
  const size_t total = table_.total();
  std::vector<uint16_t> tmp;
  uint16_t* dst = base16_host_.data();
  if (!be_.host_memory()) {
    tmp.resize(total);
    dst = tmp.data();
  }
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < total; i++) dst[i] = f32_to_bf16(host[i]);
  if (!be_.host_memory()) be_.upload(base16_t_, tmp.data());
  window_seg_ = -1;
}
void MixtralModel::get_grads(float* host) const { be_.download(host, grads_t_); }
void MixtralModel::set_param_tensor(const HfTensorRef& t, const float* host) {
  gemm_stale_ = true;
  if (!base16_) return be_.upload(params_t_.part(t.offset, t.numel), host);
  if (be_.host_memory()) {
    uint16_t* dst = base16_host_.data() + t.offset;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < t.numel; i++) dst[i] = f32_to_bf16(host[i]);
  } else {
    std::vector<uint16_t> tmp(t.numel);
    for (size_t i = 0; i < t.numel; i++) tmp[i] = f32_to_bf16(host[i]);
    be_.upload(base16_t_.part(t.offset, t.numel), tmp.data());
  }
  window_seg_ = -1;
}

void MixtralModel::init_parameters(uint64_t seed) {
  gemm_stale_ = true;
  if (base16_) {  // tensor by tensor: never a whole fp32 copy of the base
    std::vector<float> tmp;
    for (const HfTensorRef& t : table_.hf_tensors()) {
      tmp.resize(t.numel);
      init_hf_tensor(table_, cfg_, seed, t, tmp.data());
      set_param_tensor(t, tmp.data());
    }
    return;
  }
  if (be_.host_memory()) return moetron::init_parameters(table_, cfg_, seed, params_.data());
  if (!table_.is_whole()) {  // slices of tensors: drawn on the host at their whole-tensor indices
    std::vector<float> host(table_.total(), 0.0f);
    moetron::init_parameters(table_, cfg_, seed, host.data());
    return set_params(host.data());
  }
  for (const HfTensorRef& t : table_.hf_tensors()) {
    const Tensor p = params_t_.part(t.offset, t.numel);
    if (table_.spec_of(t).is_norm() || table_.spec_of(t).is_bias())
      be_.init_normal(p, seed, 0, 0.0, table_.spec_of(t).is_norm() ? 1.0f : 0.0f);
    else
      be_.init_normal(p, seed, hash_name(t.name), cfg_.initializer_range, 0.0f);
  }
}

void MixtralModel::zero_grads() {
  const Tensor g = train_grad_tensor();
  if (!g.empty()) be_.fill_zero(g);
}

void MixtralModel::refresh_gemm_weights() {
  if (gemm_stale_ && gemm_t_.data != params_t_.data) be_.convert(gemm_t_, params_t_);
  gemm_stale_ = false;
  if (lgemm_stale_ && lora_table_ && lgemm_t_.data != lparams_t_.data) be_.convert(lgemm_t_, lparams_t_);
  lgemm_stale_ = false;
}

Tensor MixtralModel::W(ParamKind kind, int layer) const {
  const ParamSpec& s = table_.at(kind, layer);
  if (base16_) return window_view(s);
  return params_t_.part(s.offset, s.numel);
}
Tensor MixtralModel::Wg(ParamKind kind, int layer) {
  const ParamSpec& s = table_.at(kind, layer);
  if (base16_) {
    if (!be_.host_memory()) return base16_t_.part(s.offset, s.numel);  // the device's act store is bf16
    // Host backends: the widened fp32 values, which are bf16 values (what a bf16 act store holds).
    Tensor t = window_view(s);
    t.store = be_.act_store();
    return t;
  }
  return gemm_t_.part(s.offset, s.numel);
}
Tensor MixtralModel::G(ParamKind kind, int layer) const {
  if (grads_t_.empty()) return Tensor{};  // a frozen base (LoRA)
  const ParamSpec& s = table_.at(kind, layer);
  return grads_t_.part(s.offset, s.numel);
}

void MixtralModel::zero_dropped_rows(Tensor rows, const ops::MoePlan& plan, int C) {
  const size_t kept = (size_t)plan.expert_offsets[plan.E - plan.overflow], all = (size_t)plan.N * plan.K;
  if (kept < all) be_.fill_zero(rows.part(kept * C, (all - kept) * C));
}

Tensor MixtralModel::as_act(Tensor src, Tensor scratch) {
  if (be_.act_store() == src.store) return src;
  be_.convert(scratch, src);
  return scratch;
}

Tensor MixtralModel::as_f32(Tensor src, Tensor scratch) {
  if (src.store == Store::f32) return src;
  be_.convert(scratch, src);
  return scratch;
}


void MixtralModel::set_profile(Profile* profile) {
  profile_ = profile;
  dispatch_->set_profile(profile);
}

void MixtralModel::tp_all_reduce(Tensor x) {
  Section t(be_, profile_, "tp.all_reduce");
  tp_->all_reduce(x.data, x.numel, dist::CommDType::f32, dist::ReduceOp::sum);
}

uint64_t MixtralModel::comm_bytes() const { return kv_comm_ ? kv_comm_->stats().bytes_sent : 0; }

void MixtralModel::reduce_replicated_grads() {
  if (lora_table_) {
    // A factor whole on every tp rank beside a split base has a partial gradient on each (lora.h); a
    // B factor of a replicated kv head sums over the ranks sharing the head, as k_proj does.
    for (const ParamSpec& ls : lora_table_->specs()) {
      const Tensor g = lgrads_t_.part(ls.offset, ls.numel);
      if (ls.target == ParamKind::router) continue;  // replicated input and weights: identical gradients
      if (tp_on() && ls.tp_split == TpSplit::none)
        tp_->all_reduce(g.data, g.numel, dist::CommDType::f32, dist::ReduceOp::sum);
      else if (kv_comm_ && kv_comm_->size() > 1 && ls.kind == ParamKind::lora_b &&
               (ls.target == ParamKind::k_proj || ls.target == ParamKind::v_proj))
        kv_comm_->all_reduce(g.data, g.numel, dist::CommDType::f32, dist::ReduceOp::sum);
    }
    return;  // the base is frozen
  }
  if (tp_on() && cfg_.qk_norm && !cfg_.qk_norm_full)
    for (int l = layer_begin_; l < layer_end_; l++)
      for (ParamKind k : {ParamKind::q_norm, ParamKind::k_norm}) {
        const Tensor g = G(k, l);
        tp_->all_reduce(g.data, g.numel, dist::CommDType::f32, dist::ReduceOp::sum);
      }
  if (!kv_comm_ || kv_comm_->size() == 1) return;
  for (int l = layer_begin_; l < layer_end_; l++)
    for (ParamKind k : {ParamKind::k_proj, ParamKind::v_proj, ParamKind::k_bias, ParamKind::v_bias, ParamKind::k_norm}) {
      if (!table_.has(k, l) || (k == ParamKind::k_norm && !cfg_.qk_norm_full)) continue;
      const Tensor g = G(k, l);
      kv_comm_->all_reduce(g.data, g.numel, dist::CommDType::f32, dist::ReduceOp::sum);
    }
}

void MixtralModel::set_router_bias(std::vector<float> bias) {
  if (!bias.empty() && (!cfg_.is_moe() || (int)bias.size() != cfg_.num_local_experts))
    fail("router bias: {} values for a model of {} experts", bias.size(), cfg_.is_moe() ? cfg_.num_local_experts : 0);
  router_bias_ = Tensor{};
  bias_alloc_.reset();
  if (bias.empty()) return;
  bias_alloc_ = be_.allocate(bias.size() * 4, "router bias");
  router_bias_ = be_.view(bias_alloc_->data(), Store::f32, bias.size());
  be_.upload(router_bias_, bias.data());
}

void MixtralModel::allocate(Activations& s, int B, int T) {
  if (B == s.B && T == s.T && !s.layers.empty()) return;
  s.B = B;
  s.T = T;
  const long N = (long)B * T;
  const auto [C, V, I, NH, NKV, HD, Q, KVd, E, K, moe] = dims();
  (void)I;
  const int L = layer_end_ - layer_begin_;
  const bool head = last_stage();
  const bool qkn = cfg_.qk_norm;
  const Store act = be_.act_store(), f32 = Store::f32, i32 = Store::i32;
  const bool shared = cfg_.has_shared_expert();
  const long Is = shared ? cfg_.shared_expert_intermediate_size / tp_size_ : 0;
  const bool router_copy = act != f32;  // the router's input in f32 beside the act-store one
  const bool local_experts = !ep_on();  // the expert activations live in the arena
  // The identity plan (every token one row of one expert): the shared expert's, and LoRA's on the
  // attention projections (a grouped linear of one group).
  const bool ident = shared || lora_.on();

  s.arena.reset();
  s.layers.clear();
  s.layers.resize(L);
  // Two passes: the first measures, the second hands out views.
  void* base = nullptr;
  for (int pass = 0; pass < 2; pass++) {
    TensorCarver c(be_, base);
    for (int l = 0; l < L; l++) {
      LayerActs& a = s.layers[l];
      const bool moe_l = layer_moe(layer_begin_ + l);
      const long M = moe_l ? N * K : N, Il = ffn_width(layer_begin_ + l);
      a.moe = moe_l;
      a.x = c.take(f32, N * C);
      a.ln1 = c.take(act, N * C);
      a.rstd1 = c.take(f32, N);
      a.q = c.take(act, N * Q);
      a.k = c.take(act, N * KVd);
      a.v = c.take(act, N * KVd);
      a.qraw = qkn ? c.take(f32, N * Q) : Tensor{};
      a.kraw = qkn ? c.take(f32, N * KVd) : Tensor{};
      a.rstdq = qkn ? c.take(f32, N * NH) : Tensor{};  // per head, or (full) N of them
      a.rstdk = qkn ? c.take(f32, N * NKV) : Tensor{};
      const bool clip = cfg_.clip_qkv > 0;
      a.clipq = clip ? c.take(Store::u8, N * Q) : Tensor{};
      a.clipk = clip ? c.take(Store::u8, N * KVd) : Tensor{};
      a.clipv = clip ? c.take(Store::u8, N * KVd) : Tensor{};
      a.attn_saved = c.take(f32, be_.attention_saved_numel(B, T, NH));
      a.att = c.take(act, N * Q);
      a.h = c.take(f32, N * C);
      a.ln2 = c.take(act, N * C);
      a.ln2f = moe_l && router_copy ? c.take(f32, N * C) : a.ln2;
      a.rstd2 = c.take(f32, N);
      if (moe_l) {
        a.rlogits = c.take(f32, N * E);
        a.rprobs = c.take(f32, N * E);
        a.topk_w = c.take(f32, N * K);
        a.topk_idx = c.take(i32, N * K);
        a.combine_w = c.take(f32, N * K);
        a.xperm = c.take(act, M * C);
        a.yperm = c.take(act, M * C);
      }
      a.row_token = c.take(i32, M);
      a.row_of = c.take(i32, M);
      a.dispatch.h13 = local_experts || !moe_l ? c.take(act, 2 * M * Il) : Tensor{};
      a.dispatch.act = local_experts || !moe_l ? c.take(act, M * Il) : Tensor{};
      // LoRA: each adapted projection keeps u = x A^T [rows, r] (2r for a dense FFN's split gate / up
      // factors: the A factor's rows).
      const auto lu = [&](ParamKind k, long rows) {
        const ParamSpec* sp = lora_table_ ? lora_table_->find_lora(k, layer_begin_ + l, false) : nullptr;
        return sp ? c.take(act, rows * sp->shape[sp->shape.size() - 2]) : Tensor{};
      };
      a.uq = lu(ParamKind::q_proj, N);
      a.uk = lu(ParamKind::k_proj, N);
      a.uv = lu(ParamKind::v_proj, N);
      a.uo = lu(ParamKind::o_proj, N);
      a.dispatch.u13 = local_experts || !moe_l ? lu(ParamKind::ffn_w13, M) : Tensor{};
      a.dispatch.u2 = local_experts || !moe_l ? lu(ParamKind::ffn_w2, M) : Tensor{};
      const ParamSpec* ra = moe_l && lora_table_ ? lora_table_->find_lora(ParamKind::router, layer_begin_ + l, false) : nullptr;
      a.ur = ra ? c.take(f32, N * (long)ra->shape[0]) : Tensor{};
      a.shu13 = moe_l && shared ? lu(ParamKind::shared_w13, N) : Tensor{};
      a.shu2 = moe_l && shared ? lu(ParamKind::shared_w2, N) : Tensor{};
      const bool sh = moe_l && shared;
      a.sh13 = sh ? c.take(act, N * 2 * Is) : Tensor{};
      a.shact = sh ? c.take(act, N * Is) : Tensor{};
      a.shy = sh ? c.take(act, N * C) : Tensor{};
      a.sgl = sh ? c.take(f32, N) : Tensor{};
      a.sg = sh ? c.take(f32, N) : Tensor{};
    }
    s.x_final = c.take(f32, N * C);
    s.lnf = head ? c.take(act, N * C) : Tensor{};
    s.rstdf = head ? c.take(f32, N) : Tensor{};
    s.logits = head ? c.take(f32, N * V) : Tensor{};
    s.lse = head ? c.take(f32, N) : Tensor{};
    s.tokens = c.take(i32, N);
    s.targets = c.take(i32, N);
    s.positions = c.take(i32, N);
    s.attention_mask = c.take(i32, N);
    s.segment_ids = c.take(i32, N);
    s.token_mask = c.take(Store::u8, N);
    s.ident_rt = ident ? c.take(i32, N) : Tensor{};
    s.ident_ro = ident ? c.take(i32, N) : Tensor{};
    if (pass == 0) {
      s.arena = be_.allocate(c.used(), "activations");
      base = s.arena->data();
    }
  }
  // A dense FFN is one expert that every token visits with weight 1: the identity plan.
  std::vector<int32_t> zeros(N, 0);
  for (LayerActs& a : s.layers) {
    if (a.moe) continue;
    ops::moe_plan_build(a.plan, zeros.data(), N, 1, 1);
    a.pv = be_.upload_plan(a.plan, a.row_token, a.row_of);
  }
  if (ident) {
    ops::moe_plan_build(s.ident_plan, zeros.data(), N, 1, 1);
    s.ident_pv = be_.upload_plan(s.ident_plan, s.ident_rt, s.ident_ro);
  }
}

void MixtralModel::allocate_scratch(int B, int T) {
  if (B == scratch_B_ && T == scratch_T_ && scratch_alloc_) return;
  scratch_B_ = B;
  scratch_T_ = T;
  const long N = (long)B * T;
  const auto [C, V, I, NH, NKV, HD, Q, KVd, E, K, moe] = dims();
  const long M = N * K;
  const Store act = be_.act_store(), f32 = Store::f32;
  scratch_alloc_.reset();
  void* base = nullptr;
  for (int pass = 0; pass < 2; pass++) {
    TensorCarver c(be_, base);
    dres_ = c.take(f32, N * C);
    dln_ = c.take(f32, N * C);
    tmp_ = c.take(f32, N * C);
    datt_ = c.take(act, N * Q);
    dq_ = c.take(act, N * Q);
    dk_ = c.take(act, N * KVd);
    dv_ = c.take(act, N * KVd);
    drlogits_ = moe ? c.take(f32, N * E) : Tensor{};
    dtopk_ = moe ? c.take(f32, N * K) : Tensor{};
    dxperm_ = moe ? c.take(act, M * C) : Tensor{};
    dyperm_ = moe ? c.take(act, M * C) : Tensor{};
    dres_act_ = act != f32 ? c.take(act, N * C) : Tensor{};
    const bool qkn = cfg_.qk_norm, bias = cfg_.qkv_bias, shared = cfg_.has_shared_expert();
    dq32_ = (qkn || bias) && act != f32 ? c.take(f32, N * Q) : dq_;
    dk32_ = (qkn || bias) && act != f32 ? c.take(f32, N * KVd) : dk_;
    dv32_ = bias && act != f32 ? c.take(f32, N * KVd) : dv_;
    // The forward's f32 staging of a projection that a bias or a clip follows (act store not f32).
    stage32_ = (bias || cfg_.clip_qkv > 0) && act != f32 ? c.take(f32, N * std::max(Q, KVd)) : Tensor{};
    // OLMoE's norms under tp: the row sums of squares (forward) and dots (backward) of all ranks.
    row_stat_ = cfg_.qk_norm_full && tp_on() ? c.take(f32, N) : Tensor{};
    dshy_ = shared ? c.take(act, N * C) : Tensor{};
    dsg_ = shared ? c.take(f32, N) : Tensor{};
    dsgl_ = shared ? c.take(f32, N) : Tensor{};
    dxs_ = shared ? c.take(f32, N * C) : Tensor{};
    du_ = lora_.on() ? c.take(act, N * (long)lora_.rank) : Tensor{};
    dur_ = lora_.has(LoraTarget::router) ? c.take(f32, N * (long)lora_.rank) : Tensor{};
    dqraw_ = qkn ? c.take(f32, N * Q) : Tensor{};
    dkraw_ = qkn ? c.take(f32, N * KVd) : Tensor{};
    if (pass == 0) {
      scratch_alloc_ = be_.allocate(c.used(), "scratch");
      base = scratch_alloc_->data();
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
  size_t b = arena ? arena->bytes() : 0;
  for (const LayerActs& a : layers) b += a.dispatch.bytes();
  return b;
}

size_t MixtralModel::activation_bytes_per_micro_batch() const { return last_ ? last_->bytes() : 0; }

size_t MixtralModel::state_bytes() const {
  size_t b = 0;
  for (const auto* a : {&params_alloc_, &grads_alloc_, &gemm_alloc_, &lparams_alloc_, &lgrads_alloc_, &lgemm_alloc_,
                        &base16_alloc_, &window_alloc_})
    if (*a) b += (*a)->bytes();
  b += base16_host_.size() * sizeof(uint16_t);
  if (be_.host_memory()) b += (params_.size() + grads_.size() + lparams_.size() + lgrads_.size()) * sizeof(float);
  return b;
}

size_t MixtralModel::activation_bytes() const {
  size_t b = scratch_alloc_ ? scratch_alloc_->bytes() : 0;
  for (const auto& a : pool_) b += a->bytes();
  return b;
}

const float* MixtralModel::logits() const {
  if (last_ == nullptr) return nullptr;
  if (!be_.host_memory())
    fail("[MixtralModel::logits] the logits live in {} memory; use download_logits", be_.name());
  return last_->logits.empty() ? nullptr : last_->logits.f32();
}

void MixtralModel::download_logits(float* host) const {
  if (last_ == nullptr || last_->logits.empty()) fail("[MixtralModel::download_logits] no logits (no forward pass on the last stage)");
  be_.download(host, last_->logits);
}

const float* MixtralModel::stage_output() const {
  if (last_ == nullptr) fail("[MixtralModel::stage_output] no forward pass yet");
  return static_cast<const float*>(last_->x_final.data);
}

const ops::RouterLayerStats& MixtralModel::pooled_stats() const {
  if (last_ == nullptr) fail("[MixtralModel::pooled_stats] no forward pass yet");
  return last_->router.pooled;
}

const float* MixtralModel::input_grad() const {
  if (first_stage()) fail("[MixtralModel::input_grad] the first stage has no input hidden states (layers from 0)");
  return static_cast<const float*>(dres_.data);
}

MixtralModel::Dims MixtralModel::dims() const {
  const bool moe = cfg_.is_moe();
  const int tp = tp_size_;
  const int NH = cfg_.num_attention_heads / tp;
  const int NKV = cfg_.num_key_value_heads >= tp ? cfg_.num_key_value_heads / tp : 1;
  return Dims{cfg_.hidden_size,
              (int)(table_.vocab_end() - table_.vocab_begin()),
              cfg_.expert_intermediate_size() / tp,
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
  refresh_gemm_weights();
  allocate(s, batch.B, batch.T);
  allocate_scratch(batch.B, batch.T);
  const long N = (long)batch.B * batch.T;
  const Dims d = dims();
  const int C = d.C, V = d.V, E = d.E, K = d.K;
  const bool moe = d.moe;

  s.weights = weights;
  s.prep = prepare_batch(batch);
  be_.upload(s.tokens, batch.input_ids.data());
  be_.upload(s.positions, s.prep.positions.data());
  be_.upload(s.targets, s.prep.targets.data());
  be_.upload(s.token_mask, s.prep.token_mask.data());
  s.amask = AttnMask{};
  s.amask.sliding_window = cfg_.sliding_window;
  if (!batch.attention_mask.empty()) {
    be_.upload(s.attention_mask, batch.attention_mask.data());
    s.amask.attention_mask = s.attention_mask;
  }
  if (!batch.segment_ids.empty()) {
    be_.upload(s.segment_ids, batch.segment_ids.data());
    s.amask.segment_ids = s.segment_ids;
  }

  const int lb = layer_begin_, le = layer_end_, L = le - lb;
  // Dense layers of an MoE model keep zero statistics (they add nothing to the pooled loss).
  ops::RouterLayerStats none;
  none.assigned.assign(E, 0.0);
  none.prob_sum.assign(E, 0.0);
  router_stats_.assign(moe ? L : 0, none);
  dropped_.assign(moe ? L : 0, 0);

  if (!first_stage()) {
    be_.copy(s.layers[0].x, be_.view(const_cast<float*>(in.hidden), Store::f32, (size_t)N * C));
  } else {
    Section t(be_, profile_, "fwd.embedding");
    be_.embedding_forward(s.layers[0].x, s.tokens, W(ParamKind::embedding), N, C, table_.vocab_begin(), V, !tp_on());
    if (tp_on()) tp_all_reduce(s.layers[0].x);
  }
  for (int l = lb; l < le; l++) layer_forward(s, l, l + 1 < le ? s.layers[l - lb + 1].x : s.x_final);
  if (last_stage()) {
    Section t(be_, profile_, "fwd.head");
    be_.rmsnorm_forward(s.lnf, s.rstdf, s.x_final, W(ParamKind::final_norm), N, C, (float)cfg_.rms_norm_eps);
    be_.matmul_forward(s.logits, s.lnf, Wg(table_.head_kind()), (int)N, C, V, false);
  }

  Losses out;
  s.router = RouterLossTerms{};
  if (moe) {
    s.router = router_loss_terms(router_stats_, in.pooled, weights, E, K, last_stage());
    out.aux_loss = s.router.aux_loss;
    out.z_loss = s.router.z_loss;
  }
  if (s.prep.has_labels) {
    if (last_stage()) {
      Section t(be_, profile_, "fwd.cross_entropy");
      out.ce_sum = be_.cross_entropy_forward(s.lse, s.logits, s.targets, N, V, table_.vocab_begin(), 1.0f,
                                             tp_on() ? tp_ : nullptr);
      out.loss_tokens = s.prep.loss_tokens;
      out.ce_loss = weights.ce_scale * out.ce_sum;
    }
    out.loss = out.ce_loss + weights.aux_coef * out.aux_loss + weights.z_coef * out.z_loss;
  }
  return out;
}

// One decoder layer l: x_next = h + FFN(RMSNorm(h)), h = x + Attn(RMSNorm(x)).
void MixtralModel::layer_forward(Activations& s, int l, Tensor x_next) {
  const long N = (long)s.B * s.T;
  const auto [C, V, I, NH, NKV, HD, Q, KVd, E, K, moe_model] = dims();
  (void)V;
  (void)moe_model;
  const float eps = (float)cfg_.rms_norm_eps, theta = (float)cfg_.rope_theta;
  const int li = l - layer_begin_;
  LayerActs& a = s.layers[li];
  const bool moe = a.moe;
  const int Il = ffn_width(l);
  const Tensor tmask = s.prep.has_token_mask ? s.token_mask : Tensor{};
  // Attention block: h = x + o_proj(attn(rope(q), rope(k), v)).
  {
    Section t(be_, profile_, "fwd.norms");
    be_.rmsnorm_forward(a.ln1, a.rstd1, a.x, W(ParamKind::input_norm, l), N, C, eps);
  }
  {
    Section t(be_, profile_, "fwd.attn_proj");
    const bool bias = cfg_.qkv_bias, clip = cfg_.clip_qkv > 0, f32_act = be_.act_store() == Store::f32;
    const float c = (float)cfg_.clip_qkv;
    // What follows a projection (bias, norm, OLMoE's clip) runs in f32: in place when the act store is
    // f32, else on the f32 staging buffer, rounded into the act store once at the end -- so which
    // values are clipped is decided on f32 values, as the fp32 model decides (deciding on rounded
    // values would flip the gradient of values near +-c).  The backward needs only d(q), d(k), d(v).
    const auto finish = [&](Tensor out, Tensor t, Tensor mask, long n) {
      if (clip) be_.clamp_forward(t, mask, c, n);
      if (t.data != out.data) be_.convert(out, t);
    };
    // Each projection: x W^T (+ its LoRA), then bias, clip or norm.
    const auto linear = [&](Tensor t, ParamKind w, Tensor u, int OC) {
      be_.matmul_forward(t, a.ln1, Wg(w, l), (int)N, C, OC, false);
      lora_forward(t, u, a.ln1, w, l, s.ident_pv, C, OC);
    };
    const auto project = [&](Tensor out, ParamKind w, ParamKind b, Tensor u, int OC, Tensor mask) {
      const Tensor t = !f32_act && (bias || clip) ? stage32_.part(0, (size_t)N * OC) : out;
      linear(t, w, u, OC);
      if (bias) be_.add_bias_rows(t, W(b, l), N, OC);
      finish(out, t, mask, (long)N * OC);
    };
    if (cfg_.qk_norm) {  // f32 projections (+ bias), then the q/k norms (before RoPE)
      linear(a.qraw, ParamKind::q_proj, a.uq, Q);
      linear(a.kraw, ParamKind::k_proj, a.uk, KVd);
      if (bias) {
        be_.add_bias_rows(a.qraw, W(ParamKind::q_bias, l), N, Q);
        be_.add_bias_rows(a.kraw, W(ParamKind::k_bias, l), N, KVd);
      }
      const Tensor tq = !f32_act && clip ? stage32_.part(0, (size_t)N * Q) : a.q;
      qk_norm_forward(tq, a.rstdq, a.qraw, ParamKind::q_norm, l, N, NH);
      finish(a.q, tq, a.clipq, (long)N * Q);
      const Tensor tk = !f32_act && clip ? stage32_.part(0, (size_t)N * KVd) : a.k;
      qk_norm_forward(tk, a.rstdk, a.kraw, ParamKind::k_norm, l, N, NKV);
      finish(a.k, tk, a.clipk, (long)N * KVd);
    } else {
      project(a.q, ParamKind::q_proj, ParamKind::q_bias, a.uq, Q, a.clipq);
      project(a.k, ParamKind::k_proj, ParamKind::k_bias, a.uk, KVd, a.clipk);
    }
    project(a.v, ParamKind::v_proj, ParamKind::v_bias, a.uv, KVd, a.clipv);
  }
  {
    Section t(be_, profile_, "fwd.rope");
    be_.rope_forward(a.q, s.positions, N, NH, HD, theta);
    be_.rope_forward(a.k, s.positions, N, NKV, HD, theta);
  }
  {
    Section t(be_, profile_, "fwd.attention");
    be_.attention_forward(a.att, a.attn_saved, a.q, a.k, a.v, s.amask, s.B, s.T, NH, NKV, HD);
  }
  {
    Section t(be_, profile_, "fwd.attn_proj");
    if (!tp_on()) {
      be_.copy(a.h, a.x);
      be_.matmul_forward(a.h, a.att, Wg(ParamKind::o_proj, l), (int)N, Q, C, true);
      lora_forward(a.h, a.uo, a.att, ParamKind::o_proj, l, s.ident_pv, Q, C);
    } else {
      // Row-parallel o_proj: each rank's heads give a partial sum of the output (its LoRA's too: u
      // is partial, B whole).
      be_.matmul_forward(tmp_, a.att, Wg(ParamKind::o_proj, l), (int)N, Q, C, false);
      lora_forward(tmp_, a.uo, a.att, ParamKind::o_proj, l, s.ident_pv, Q, C);
      tp_all_reduce(tmp_);
      be_.copy(a.h, a.x);
      be_.add(a.h, tmp_);
    }
  }
  {
    Section t(be_, profile_, "fwd.norms");
    // FFN block: x_next = h + ffn(rmsnorm(h)).  The router reads the f32 normalised input.
    if (a.ln2f.data != a.ln2.data) {
      be_.rmsnorm_forward(a.ln2f, a.rstd2, a.h, W(ParamKind::post_norm, l), N, C, eps);
      be_.convert(a.ln2, a.ln2f);
    } else {
      be_.rmsnorm_forward(a.ln2, a.rstd2, a.h, W(ParamKind::post_norm, l), N, C, eps);
    }
  }
  const ExpertFfnWeights fw = ffn_weights(l, false);
  if (moe) {
    {
      Section t(be_, profile_, "fwd.router");
      be_.matmul_forward(a.rlogits, a.ln2f, W(ParamKind::router, l), (int)N, C, E, false);
      if (!a.ur.empty()) {  // LoRA on the router, in f32 with the f32 masters
        be_.grouped_matmul_forward(a.ur, a.ln2f, LW32(ParamKind::router, l, false), s.ident_pv, C, lora_.rank, 1.0f, false);
        be_.grouped_matmul_forward(a.rlogits, a.ur, LW32(ParamKind::router, l, true), s.ident_pv, lora_.rank, E,
                                   lora_.scale(), true);
      }
      if (!router_bias_.empty()) be_.add_bias_rows(a.rlogits, router_bias_, N, E);
      be_.router_forward(a.rprobs, a.topk_idx, a.topk_w, a.rlogits, N, E, K, cfg_.norm_topk_prob);
      be_.router_layer_stats(router_stats_[li], a.rlogits, a.rprobs, a.topk_idx, tmask, N, E, K);
      // The plan is built on the host from the router's choices (copies on a device backend).
      const int32_t* idx = nullptr;
      const float *w = nullptr, *probs = nullptr;
      if (be_.host_memory()) {
        idx = a.topk_idx.i32();
        w = a.topk_w.f32();
        probs = a.rprobs.f32();
      } else {
        topk_idx_host_.resize(a.topk_idx.numel);
        be_.download(topk_idx_host_.data(), a.topk_idx);
        idx = topk_idx_host_.data();
        if (capacity_factor_ > 0) {
          topk_w_host_.resize(a.topk_w.numel);
          probs_host_.resize(a.rprobs.numel);
          be_.download(topk_w_host_.data(), a.topk_w);
          be_.download(probs_host_.data(), a.rprobs);
          w = topk_w_host_.data();
          probs = probs_host_.data();
        }
      }
      const uint8_t* hmask = s.prep.has_token_mask ? s.prep.token_mask.data() : nullptr;
      dropped_[li] = build_dispatch_plan(a.plan, combine_host_, idx, w, probs, hmask, N, E, K, capacity_factor_);
      if (a.plan.overflow) be_.upload(a.combine_w, combine_host_.data());
      a.pv = be_.upload_plan(a.plan, a.row_token, a.row_of);
    }
    {
      Section t(be_, profile_, "fwd.moe_permute");
      be_.moe_permute_forward(a.xperm, a.ln2, a.pv, C);
    }
    dispatch_->forward(a.dispatch, a.yperm, a.xperm, a.pv, fw);
    zero_dropped_rows(a.yperm, a.plan, C);  // dropped rows (capacity) computed nothing: zeros
    {
      Section t(be_, profile_, "fwd.moe_permute");
      be_.moe_combine_forward(x_next, a.yperm, a.plan.overflow ? a.combine_w : a.topk_w, a.pv, C);
    }
    if (!a.shy.empty()) {
      // The shared expert (Qwen2-MoE): x_next += sigmoid(ln2 . w_gate) * FFN_shared(ln2), every token.
      Section t(be_, profile_, "fwd.shared_expert");
      const int Is = cfg_.shared_expert_intermediate_size / tp_size_;
      ffn_.forward(be_, a.shy, ExpertFfnSaved{a.sh13, a.shact, a.shu13, a.shu2}, a.ln2, s.ident_pv, ffn_weights(l, true), C,
                   Is);
      be_.matmul_forward(a.sgl, a.ln2f, W(ParamKind::shared_gate, l), (int)N, C, 1, false);
      be_.sigmoid_forward(a.sg, a.sgl, N);
      be_.moe_combine_forward(tmp_, a.shy, a.sg, s.ident_pv, C);
      be_.add(x_next, tmp_);  // under tp both parts are partial sums, all-reduced together below
    }
  } else {
    Section t(be_, profile_, "fwd.experts");
    ffn_.forward(be_, x_next, ExpertFfnSaved{a.dispatch.h13, a.dispatch.act, a.dispatch.u13, a.dispatch.u2}, a.ln2, a.pv,
                 fw, C, Il);
  }
  // Row-parallel w2: the FFN output is a partial sum on each tp rank.
  if (tp_on()) tp_all_reduce(x_next);
  {
    Section t(be_, profile_, "fwd.residual");
    be_.add(x_next, a.h);
  }
}

void MixtralModel::backward(const StageGrad& grad) {
  if (pending_.empty()) fail("[MixtralModel::backward] needs a forward pass with labels first (none is pending)");
  Activations& s = *pending_.front();
  if (!s.prep.has_labels) fail("[MixtralModel::backward] needs a forward pass with labels first");
  if (!last_stage() && grad.hidden == nullptr)
    fail("[MixtralModel::backward] the stage of layers [{}, {}) needs the gradient of its output hidden states",
         layer_begin_, layer_end_);
  const bool pooled_aux = cfg_.is_moe() && s.weights.aux_kind == AuxLossKind::hf_pooled;
  if (pooled_aux && !last_stage() && grad.aux_grad == nullptr)
    fail("[MixtralModel::backward] the stage of layers [{}, {}) needs the last stage's aux-loss gradient", layer_begin_,
         layer_end_);
  pending_.pop_front();
  allocate_scratch(s.B, s.T);
  const long N = (long)s.B * s.T;
  const Dims d = dims();
  const int C = d.C, V = d.V, E = d.E;
  if (pooled_aux && !last_stage()) {
    // The pooled aux loss's gradient per expert, from the last stage (the same for every layer).
    s.router.aux_grad.assign(grad.aux_grad, grad.aux_grad + E);
    for (auto& d : s.router.aux_dprobs) d = s.router.aux_grad;
  }
  last_aux_grad_ = s.router.aux_grad;

  if (!last_stage()) {
    be_.copy(dres_, be_.view(const_cast<float*>(grad.hidden), Store::f32, (size_t)N * C));
  } else {
    // Head and final norm.  The logits become their gradient in place.
    {
      Section t(be_, profile_, "bwd.head");
      // Tied: the head's gradient accumulates into the embedding's, which the embedding adds to below.
      const ParamKind hk = table_.head_kind();
      be_.head_backward(dln_, G(hk), s.logits, s.lse, s.targets, s.lnf, Wg(hk), N, C,
                        V, table_.vocab_begin(), (float)s.weights.ce_scale, !tp_on());
      if (tp_on()) tp_all_reduce(dln_);
      be_.rmsnorm_backward(dres_, G(ParamKind::final_norm), dln_, s.x_final, W(ParamKind::final_norm), s.rstdf, N, C,
                           false);
    }
  }
  for (int l = layer_end_ - 1; l >= layer_begin_; l--) layer_backward(s, l);
  if (!first_stage() || grads_t_.empty()) return;  // dres: input_grad(); a frozen embedding has no gradient
  Section t(be_, profile_, "bwd.embedding");
  be_.embedding_backward(G(ParamKind::embedding), dres_, s.tokens, N, C, table_.vocab_begin(), V, !tp_on());
}

void MixtralModel::qk_norm_forward(Tensor out, Tensor rstd, Tensor raw, ParamKind w, int l, long N, int heads) {
  const int HD = cfg_.head_dim, width = heads * HD;  // this rank's part
  const float eps = (float)cfg_.rms_norm_eps;
  if (!cfg_.qk_norm_full) return be_.rmsnorm_forward(out, rstd, raw, W(w, l), N * heads, HD, eps);
  if (!tp_on()) return be_.rmsnorm_forward(out, rstd, raw, W(w, l), N, width, eps);
  // The sum of squares over every rank's heads; a kv head replicated on rep ranks is counted rep times.
  const bool k = w == ParamKind::k_norm;
  const int full = (k ? cfg_.num_key_value_heads : cfg_.num_attention_heads) * HD;
  be_.row_dot(row_stat_, raw, raw, Tensor{}, N, width);
  tp_all_reduce(row_stat_);
  be_.rmsnorm_forward_stats(out, rstd, raw, W(w, l), row_stat_, N, width, full, k ? 1.0f / (float)kv_replicas() : 1.0f,
                            eps);
}

void MixtralModel::qk_norm_backward(Tensor draw, Tensor dout, Tensor raw, Tensor rstd, ParamKind w, int l, long N,
                                    int heads) {
  const int HD = cfg_.head_dim, width = heads * HD;
  if (!cfg_.qk_norm_full)
    return be_.rmsnorm_backward(draw, G(w, l), dout, raw, W(w, l), rstd, N * heads, HD, false);
  if (!tp_on()) return be_.rmsnorm_backward(draw, G(w, l), dout, raw, W(w, l), rstd, N, width, false);
  // sum_j w_j dy_j x_j over every rank's part.  A replicated kv head's d(out) is partial on each of its
  // rep ranks (their own query heads' share): the all-rank sum is the true dot once, and each replica
  // takes 1/rep of the term, so that summing d(raw) over the replicas (as the k_proj gradient and the
  // layer input's are) gives the whole.
  const bool k = w == ParamKind::k_norm;
  const int full = (k ? cfg_.num_key_value_heads : cfg_.num_attention_heads) * HD;
  be_.row_dot(row_stat_, dout, raw, W(w, l), N, width);
  tp_all_reduce(row_stat_);
  be_.rmsnorm_backward_stats(draw, G(w, l), dout, raw, W(w, l), rstd, row_stat_, N, width, full,
                             k ? 1.0f / (float)kv_replicas() : 1.0f);
}

// Layer l in reverse; dres is d(x_next) on entry and d(x) of the layer on exit.
void MixtralModel::layer_backward(Activations& s, int l) {
  const long N = (long)s.B * s.T;
  const auto [C, V, I, NH, NKV, HD, Q, KVd, E, K, moe_model] = dims();
  (void)V;
  (void)I;
  (void)moe_model;
  const float theta = (float)cfg_.rope_theta;
  const int li = l - layer_begin_;
  LayerActs& a = s.layers[li];
  const bool moe = a.moe;
  const int Il = ffn_width(l);
  const Tensor tmask = s.prep.has_token_mask ? s.token_mask : Tensor{};
  // FFN block: dres is d(x_next); it flows to h unchanged plus through the FFN.
  const ExpertFfnWeights fw = ffn_weights(l, false);
  if (moe) {
    {
      Section t(be_, profile_, "bwd.moe_permute");
      be_.moe_combine_backward(dyperm_, dtopk_, dres_, a.yperm, a.plan.overflow ? a.combine_w : a.topk_w, a.pv, C);
    }
    // yperm is this rank's partial expert output, so the routing-weight gradient is partial too.
    if (tp_on()) tp_all_reduce(dtopk_);
    dispatch_->backward(dxperm_, dyperm_, a.dispatch, a.xperm, a.pv, fw);
    zero_dropped_rows(dxperm_, a.plan, C);  // dropped rows pass no gradient to the input
    {
      Section t(be_, profile_, "bwd.moe_permute");
      be_.moe_permute_backward(dln_, dxperm_, a.pv, C);
    }
    if (tp_on()) tp_all_reduce(dln_);  // column-parallel w1/w3: partial input gradient
    Section t(be_, profile_, "bwd.router");
    be_.router_backward(drlogits_, dtopk_, s.router.aux_dprobs[li].data(), tmask, a.rprobs, a.topk_idx, a.topk_w, N,
                        E, K, cfg_.norm_topk_prob);
    if (s.weights.z_coef != 0.0)
      be_.router_z_loss_backward(drlogits_, a.rlogits, a.rprobs, tmask, N, E, (float)s.weights.z_coef,
                                 s.prep.real_tokens);
    be_.matmul_backward(dln_, G(ParamKind::router, l), drlogits_, a.ln2f, W(ParamKind::router, l), (int)N, C, E,
                        true);
    if (!a.ur.empty()) {
      const int r = lora_.rank;
      be_.grouped_matmul_backward(dur_, LG(ParamKind::router, l, true), drlogits_, a.ur, LW32(ParamKind::router, l, true),
                                  s.ident_pv, r, E, lora_.scale(), false);
      be_.grouped_matmul_backward(dln_, LG(ParamKind::router, l, false), dur_, a.ln2f,
                                  LW32(ParamKind::router, l, false), s.ident_pv, C, r, 1.0f, true);
    }
    if (!a.shy.empty()) {
      // The shared expert in reverse: d(shy) = sg * dres, d(sg) = <dres, shy> (a partial sum under tp,
      // like shy), through the sigmoid into the gate; the FFN's input gradient is partial too.
      Section ts(be_, profile_, "bwd.shared_expert");
      const int Is = cfg_.shared_expert_intermediate_size / tp_size_;
      be_.moe_combine_backward(dshy_, dsg_, dres_, a.shy, a.sg, s.ident_pv, C);
      if (tp_on()) tp_all_reduce(dsg_);
      be_.sigmoid_backward(dsgl_, dsg_, a.sg, N);
      be_.matmul_backward(dln_, G(ParamKind::shared_gate, l), dsgl_, a.ln2f, W(ParamKind::shared_gate, l), (int)N, C,
                          1, true);
      ffn_.backward(be_, dxs_, dshy_, ExpertFfnSaved{a.sh13, a.shact, a.shu13, a.shu2}, a.ln2, s.ident_pv,
                    ffn_weights(l, true), C, Is);
      if (tp_on()) tp_all_reduce(dxs_);
      be_.add(dln_, dxs_);
    }
  } else {
    Section t(be_, profile_, "bwd.experts");
    ffn_.backward(be_, dln_, as_act(dres_, dres_act_),
                  ExpertFfnSaved{a.dispatch.h13, a.dispatch.act, a.dispatch.u13, a.dispatch.u2}, a.ln2, a.pv, fw, C, Il);
    if (tp_on()) tp_all_reduce(dln_);
  }
  {
    Section t(be_, profile_, "bwd.norms");
    be_.rmsnorm_backward(dres_, G(ParamKind::post_norm, l), dln_, a.h, W(ParamKind::post_norm, l), a.rstd2, N, C,
                         true);
  }  // dres is now d(h)
  {
    Section t(be_, profile_, "bwd.attn_proj");
    // Attention block: h = x + o_proj(att) (+ its LoRA).
    const Tensor dh = as_act(dres_, dres_act_);
    be_.matmul_backward(datt_, G(ParamKind::o_proj, l), dh, a.att, Wg(ParamKind::o_proj, l), (int)N, Q, C, false);
    lora_backward(datt_, dh, a.att, a.uo, ParamKind::o_proj, l, s.ident_pv, Q, C);
  }
  {
    Section t(be_, profile_, "bwd.attention");
    be_.attention_backward(dq_, dk_, dv_, datt_, a.att, a.attn_saved, a.q, a.k, a.v, s.amask, s.B, s.T, NH, NKV, HD);
  }
  {
    Section t(be_, profile_, "bwd.rope");
    be_.rope_backward(dq_, s.positions, N, NH, HD, theta);
    be_.rope_backward(dk_, s.positions, N, NKV, HD, theta);
  }
  Tensor dq = dq_, dk = dk_;  // d(the projections' outputs), in the act store
  if (cfg_.clip_qkv > 0) {  // clipped values pass no gradient
    be_.clamp_backward(dq_, a.clipq, N * Q);
    be_.clamp_backward(dk_, a.clipk, N * KVd);
    be_.clamp_backward(dv_, a.clipv, N * KVd);
  }
  if (cfg_.qk_norm) {
    Section t(be_, profile_, "bwd.norms");
    if (dq32_.data != dq_.data) {
      be_.convert(dq32_, dq_);
      be_.convert(dk32_, dk_);
    }
    qk_norm_backward(dqraw_, dq32_, a.qraw, a.rstdq, ParamKind::q_norm, l, N, NH);
    qk_norm_backward(dkraw_, dk32_, a.kraw, a.rstdk, ParamKind::k_norm, l, N, NKV);
    dq = as_act(dqraw_, dq_);
    dk = as_act(dkraw_, dk_);
  }
  if (cfg_.qkv_bias && !grads_t_.empty()) {
    // d(bias) = column sums of d(the biased projection): after the norm's backward when there is one.
    Section t(be_, profile_, "bwd.bias");
    const Tensor gq = cfg_.qk_norm ? dqraw_ : as_f32(dq_, dq32_), gk = cfg_.qk_norm ? dkraw_ : as_f32(dk_, dk32_);
    be_.bias_backward(G(ParamKind::q_bias, l), gq, N, Q);
    be_.bias_backward(G(ParamKind::k_bias, l), gk, N, KVd);
    be_.bias_backward(G(ParamKind::v_bias, l), as_f32(dv_, dv32_), N, KVd);
  }
  {
    Section t(be_, profile_, "bwd.attn_proj");
    be_.matmul_backward(dln_, G(ParamKind::q_proj, l), dq, a.ln1, Wg(ParamKind::q_proj, l), (int)N, C, Q, false);
    be_.matmul_backward(dln_, G(ParamKind::k_proj, l), dk, a.ln1, Wg(ParamKind::k_proj, l), (int)N, C, KVd, true);
    be_.matmul_backward(dln_, G(ParamKind::v_proj, l), dv_, a.ln1, Wg(ParamKind::v_proj, l), (int)N, C, KVd, true);
    lora_backward(dln_, dq, a.ln1, a.uq, ParamKind::q_proj, l, s.ident_pv, C, Q);
    lora_backward(dln_, dk, a.ln1, a.uk, ParamKind::k_proj, l, s.ident_pv, C, KVd);
    lora_backward(dln_, dv_, a.ln1, a.uv, ParamKind::v_proj, l, s.ident_pv, C, KVd);
    if (tp_on()) tp_all_reduce(dln_);  // column-parallel q/k/v: partial input gradient
  }
  {
    Section t(be_, profile_, "bwd.norms");
    be_.rmsnorm_backward(dres_, G(ParamKind::input_norm, l), dln_, a.x, W(ParamKind::input_norm, l), a.rstd1, N, C,
                         true);
  }  // dres is now d(x) of this layer
}

}  // namespace moetron
