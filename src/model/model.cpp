// The layer body of every family and backend: forward and backward as block calls (model.h).  The
// backward is the forward's call list in reverse; parameter gradients accumulate (+=) into grads(),
// activation gradients flow through scratch tensors; the residual-stream gradient dres (f32)
// accumulates the branches.
#include "model/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#include "backend/cpu.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/rng.h"
#include "model/latent_attention.h"
#include "dist/comm.h"
#include "model/batch_io.h"
#include "ops/cross_entropy.h"

namespace moetron {

namespace {

ParamShard model_shard(const ModelConfig& cfg, dist::Comm* tp, dist::Comm* ep, LayerRange layers) {
  return make_param_shard(cfg, layers.begin, layers.end, tp ? tp->rank() : 0, tp ? tp->size() : 1, ep ? ep->rank() : 0,
                          ep ? ep->size() : 1);
}

// What the layer body does not run yet: latent attention with LoRA.
void check_body_supports(const ModelConfig& cfg, bool inference, bool lora) {
  (void)inference;
  if (cfg.is_mla() && lora)
    fail("[Model] {}: LoRA on a model with multi-head latent attention is not implemented yet", cfg.architecture);
}

}  // namespace

Model::Model(const ModelConfig& cfg, dist::Comm* tp, dist::Comm* ep, LayerRange layers, const LoraSpec& lora)
    : own_backend_(make_cpu_backend()), be_(*own_backend_), cfg_(cfg), table_(cfg, model_shard(cfg, tp, ep, layers)) {
  init(tp, ep, layers, lora);
}

Model::Model(Backend& backend, const ModelConfig& cfg, dist::Comm* tp, dist::Comm* ep, LayerRange layers,
             const LoraSpec& lora)
    : be_(backend), cfg_(cfg), table_(cfg, model_shard(cfg, tp, ep, layers)) {
  init(tp, ep, layers, lora);
}

Model::Model(Backend& backend, const WeightProvider& weights)
    : be_(backend), cfg_(weights.config()), table_(cfg_), borrowed_(&weights) {
  lora_ = weights.lora_spec() ? *weights.lora_spec() : LoraSpec{};
  layer_end_ = cfg_.num_hidden_layers;
  check_body_supports(cfg_, true, lora_.on());
  be_.check_model(cfg_.head_dim, cfg_.is_moe() ? cfg_.num_local_experts : 0);
  if (cfg_.is_moe()) moe_ = std::make_unique<MoeBlock>(be_, cfg_, nullptr, 1);
  gemm_stale_ = lgemm_stale_ = false;  // nothing of its own to refresh
}

void Model::init(dist::Comm* tp, dist::Comm* ep, LayerRange layers, const LoraSpec& lora) {
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
  check_body_supports(cfg_, false, lora.on());
  be_.check_model(cfg_.head_dim, cfg_.is_moe() ? cfg_.num_local_experts : 0);
  if (cfg_.is_moe()) moe_ = std::make_unique<MoeBlock>(be_, cfg_, ep_, tp_size_);
  for (int l = layer_begin_; l < layer_end_; l++)
    if (layer_moe(l) && ffn_width(l) != d.I) fail("[Model] layer {}: expert width {} != {}", l, ffn_width(l), d.I);
  // A table's parameters and gradients (none for a frozen base) and its GEMM copy.
  const auto place = [&](size_t total, bool with_grads, std::vector<float>& hp, std::vector<float>& hg,
                         std::unique_ptr<Allocation>& ap, std::unique_ptr<Allocation>& ag,
                         std::unique_ptr<Allocation>& agemm, Tensor& tparam, Tensor& tg, Tensor& tgemm,
                         const char* what) {
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

Tensor Model::train_param_tensor() {
  if (!lora_table_) return param_tensor();
  lgemm_stale_ = true;
  return lparams_t_;
}
void Model::get_train_params(float* host) const { be_.download(host, train_param_view()); }
void Model::set_train_params(const float* host) { be_.upload(train_param_tensor(), host); }
void Model::init_lora(uint64_t seed) {
  if (!lora_table_) fail("[Model::init_lora] the model has no LoRA adapters");
  std::vector<float> host(lora_table_->total(), 0.0f);
  init_lora_parameters(*lora_table_, seed, host.data());
  set_train_params(host.data());
}

Tensor Model::LW(ParamKind target, int l, bool b) const {
  if (borrowed_) return borrowed_->adapter_factor(target, l, b);
  const ParamSpec* s = lora_table_ ? lora_table_->find_lora(target, l, b) : nullptr;
  return s ? lgemm_t_.part(s->offset, s->numel) : Tensor{};
}
Tensor Model::LW32(ParamKind target, int l, bool b) const {
  if (borrowed_) return borrowed_->adapter_factor(target, l, b);
  const ParamSpec* s = lora_table_ ? lora_table_->find_lora(target, l, b) : nullptr;
  return s ? lparams_t_.part(s->offset, s->numel) : Tensor{};
}
Tensor Model::LG(ParamKind target, int l, bool b) const {
  const ParamSpec* s = lora_table_ ? lora_table_->find_lora(target, l, b) : nullptr;
  return s && !lgrads_t_.empty() ? lgrads_t_.part(s->offset, s->numel) : Tensor{};  // none once released
}

LoraFactors Model::lora_factors(ParamKind target, int l, bool f32) const {
  LoraFactors f;
  if (borrowed_ ? borrowed_->adapter_factor(target, l, false).empty()
                : !lora_table_ || !lora_table_->find_lora(target, l, false))
    return f;
  f.a = f32 ? LW32(target, l, false) : LW(target, l, false);
  f.b = f32 ? LW32(target, l, true) : LW(target, l, true);
  f.da = LG(target, l, false);
  f.db = LG(target, l, true);
  f.r = lora_.rank;
  f.scale = lora_.scale();
  return f;
}

LinearWeights Model::linear_weights(ParamKind kind, int l, bool base) {
  LinearWeights w;
  w.lora = lora_factors(kind, l);
  if (base) {
    w.w = Wg(kind, l);
    w.dw = G(kind, l);
  }
  return w;
}

AttentionWeights Model::attention_weights(int l, bool base) {
  AttentionWeights w;
  if (cfg_.is_mla()) {  // latent attention (model/latent_attention.h): no adapters yet
    if (!base) return w;
    if (cfg_.q_lora_rank > 0) {
      w.q_a = linear_weights(ParamKind::q_a_proj, l, base);
      w.q_b = linear_weights(ParamKind::q_b_proj, l, base);
      w.q_a_norm = W(ParamKind::q_a_norm, l);
      w.dq_a_norm = G(ParamKind::q_a_norm, l);
    } else {
      w.q = linear_weights(ParamKind::q_proj, l, base);
    }
    w.kv_a = linear_weights(ParamKind::kv_a_proj, l, base);
    w.kv_b = linear_weights(ParamKind::kv_b_proj, l, base);
    w.o = linear_weights(ParamKind::o_proj, l, base);
    w.kv_a_norm = W(ParamKind::kv_a_norm, l);
    w.dkv_a_norm = G(ParamKind::kv_a_norm, l);
    return w;
  }
  w.q = linear_weights(ParamKind::q_proj, l, base);
  w.k = linear_weights(ParamKind::k_proj, l, base);
  w.v = linear_weights(ParamKind::v_proj, l, base);
  w.o = linear_weights(ParamKind::o_proj, l, base);
  if (!base) return w;
  if (cfg_.qkv_bias) {
    w.q_bias = W(ParamKind::q_bias, l);
    w.k_bias = W(ParamKind::k_bias, l);
    w.v_bias = W(ParamKind::v_bias, l);
    w.dq_bias = G(ParamKind::q_bias, l);
    w.dk_bias = G(ParamKind::k_bias, l);
    w.dv_bias = G(ParamKind::v_bias, l);
  }
  if (cfg_.qk_norm) {
    w.q_norm = W(ParamKind::q_norm, l);
    w.k_norm = W(ParamKind::k_norm, l);
    w.dq_norm = G(ParamKind::q_norm, l);
    w.dk_norm = G(ParamKind::k_norm, l);
  }
  return w;
}

ExpertFfnWeights Model::ffn_weights(int l, bool shared, bool base) {
  const ParamKind k13 = shared ? ParamKind::shared_w13 : ParamKind::ffn_w13;
  const ParamKind k2 = shared ? ParamKind::shared_w2 : ParamKind::ffn_w2;
  ExpertFfnWeights w;
  w.w13 = linear_weights(k13, l, base);
  w.w2 = linear_weights(k2, l, base);
  w.w13.lora.split = shared || !layer_moe(l);  // a dense FFN's gate and up adapters are PEFT's separate ones
  return w;
}

MoeWeights Model::moe_weights(int l, bool base) {
  MoeWeights w;
  // The router runs in f32 with the f32 masters, its adapter too.
  w.router.lora = lora_factors(ParamKind::router, l, /*f32=*/true);
  w.experts = ffn_weights(l, false, base);
  if (cfg_.has_shared_expert()) w.shared = ffn_weights(l, true, base);
  if (!base) return w;
  w.router.w = W(ParamKind::router, l);
  w.router.dw = G(ParamKind::router, l);
  if (cfg_.has_selection_bias()) w.selection_bias = W(ParamKind::router_bias, l);
  if (cfg_.shared_expert_gated()) {
    w.shared_gate.w = W(ParamKind::shared_gate, l);
    w.shared_gate.dw = G(ParamKind::shared_gate, l);
  }
  return w;
}

Model::~Model() {
  try {
    be_.synchronize("~Model");
  } catch (...) {  // a destructor must not throw; the error was the last call's
  }
}

Tensor Model::param_tensor() {
  if (borrowed_) fail("[Model] the parameters are the weight provider's (a model over borrowed weights)");
  gemm_stale_ = true;
  return params_t_;
}

// Widens n bf16 values (host) into fp32.
static void widen_bf16(float* out, const uint16_t* in, size_t n) {
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; i++) out[i] = bf16_to_f32(in[i]);
}

Tensor Model::window_view(const ParamSpec& sp) const {
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

std::vector<float>& Model::params() {
  if (borrowed_) fail("[Model::params] the parameters are the weight provider's (a model over borrowed weights)");
  if (base16_) fail("[Model::params] the frozen base is kept in bf16; use get_params / set_params");
  if (!be_.host_memory()) fail("[Model::params] the parameters live in {} memory; use get_params", be_.name());
  gemm_stale_ = true;
  return params_;
}
const std::vector<float>& Model::params() const {
  if (borrowed_) fail("[Model::params] the parameters are the weight provider's (a model over borrowed weights)");
  if (base16_) fail("[Model::params] the frozen base is kept in bf16; use get_params / set_params");
  if (!be_.host_memory()) fail("[Model::params] the parameters live in {} memory; use get_params", be_.name());
  return params_;
}
std::vector<float>& Model::grads() {
  if (!be_.host_memory()) fail("[Model::grads] the gradients live in {} memory; use get_grads", be_.name());
  return grads_;
}
const std::vector<float>& Model::grads() const {
  if (!be_.host_memory()) fail("[Model::grads] the gradients live in {} memory; use get_grads", be_.name());
  return grads_;
}

void Model::get_params(float* host) const {
  if (borrowed_) fail("[Model] the parameters are the weight provider's (a model over borrowed weights)");
  if (!base16_) return be_.download(host, params_t_);
  if (be_.host_memory()) return widen_bf16(host, base16_host_.data(), base16_host_.size());
  std::vector<uint16_t> b(table_.total());
  be_.download(b.data(), base16_t_);
  widen_bf16(host, b.data(), b.size());
}
void Model::set_params(const float* host) {
  if (borrowed_) fail("[Model] the parameters are the weight provider's (a model over borrowed weights)");
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
void Model::get_grads(float* host) const { be_.download(host, grads_t_); }
void Model::set_param_tensor(const HfTensorRef& t, const float* host) {
  if (borrowed_) fail("[Model] the parameters are the weight provider's (a model over borrowed weights)");
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

void Model::init_parameters(uint64_t seed) {
  if (borrowed_) fail("[Model] the parameters are the weight provider's (a model over borrowed weights)");
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
    if (table_.spec_of(t).is_norm() || table_.spec_of(t).is_bias() || table_.spec_of(t).is_buffer())
      be_.init_normal(p, seed, 0, 0.0, table_.spec_of(t).is_norm() ? 1.0f : 0.0f);
    else
      be_.init_normal(p, seed, hash_name(t.name), cfg_.initializer_range, 0.0f);
  }
}

void Model::release_gradients() {
  grads_alloc_.reset();
  lgrads_alloc_.reset();
  std::vector<float>().swap(grads_);
  std::vector<float>().swap(lgrads_);
  grads_t_ = lgrads_t_ = Tensor{};
}

void Model::zero_grads() {
  const Tensor g = train_grad_tensor();
  if (!g.empty()) be_.fill_zero(g);
}

void Model::refresh_gemm_weights() {
  if (gemm_stale_ && gemm_t_.data != params_t_.data) be_.convert(gemm_t_, params_t_);
  gemm_stale_ = false;
  if (lgemm_stale_ && lora_table_ && lgemm_t_.data != lparams_t_.data) be_.convert(lgemm_t_, lparams_t_);
  lgemm_stale_ = false;
}

void Model::update_selection_bias(int l, const std::vector<double>& load, double rate) {
  if (lora_on() || borrowed_)
    fail("[Model] the selection bias moves on a model that trains its own parameters (not a LoRA base)");
  const int E = cfg_.num_local_experts;
  if ((int)load.size() != E) fail("[Model] update_selection_bias: {} loads for {} experts", load.size(), E);
  const Tensor b = params_t_.part(table_.at(ParamKind::router_bias, l).offset, (size_t)E);
  std::vector<float> bias(E);
  be_.download(bias.data(), b);
  double mean = 0;
  for (double x : load) mean += x;
  mean /= E;
  for (int e = 0; e < E; e++) {
    const double d = mean - load[e];  // underloaded experts rise, overloaded fall
    bias[e] += (float)rate * (float)((d > 0) - (d < 0));
  }
  be_.upload(b, bias.data());
}

std::vector<float> Model::selection_bias(int l) const {
  const int E = cfg_.num_local_experts;
  std::vector<float> bias(E);
  be_.download(bias.data(), W(ParamKind::router_bias, l));
  return bias;
}

Tensor Model::W(ParamKind kind, int layer) const {
  if (borrowed_) return borrowed_->weight(kind, layer);
  const ParamSpec& s = table_.at(kind, layer);
  if (base16_) return window_view(s);
  return params_t_.part(s.offset, s.numel);
}
Tensor Model::Wg(ParamKind kind, int layer) {
  if (borrowed_) return borrowed_->weight(kind, layer);
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
Tensor Model::G(ParamKind kind, int layer) const {
  if (grads_t_.empty()) return Tensor{};  // a frozen base (LoRA)
  const ParamSpec& s = table_.at(kind, layer);
  return grads_t_.part(s.offset, s.numel);
}

Tensor Model::as_act(Tensor src, Tensor scratch) {
  if (be_.act_store() == src.store) return src;
  be_.convert(scratch, src);
  return scratch;
}

void Model::set_profile(Profile* profile) {
  profile_ = profile;
}

void BlockEnv::tp_all_reduce(Tensor x) const {
  Section t(be, profile, "tp.all_reduce");
  tp->all_reduce(x.data, x.numel, dist::CommDType::f32, dist::ReduceOp::sum);
}

void Model::tp_all_reduce(Tensor x) { env().tp_all_reduce(x); }

uint64_t Model::comm_bytes() const { return kv_comm_ ? kv_comm_->stats().bytes_sent : 0; }

void Model::reduce_replicated_grads() {
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
    for (ParamKind k :
         {ParamKind::k_proj, ParamKind::v_proj, ParamKind::k_bias, ParamKind::v_bias, ParamKind::k_norm}) {
      if (!table_.has(k, l) || (k == ParamKind::k_norm && !cfg_.qk_norm_full)) continue;
      const Tensor g = G(k, l);
      kv_comm_->all_reduce(g.data, g.numel, dist::CommDType::f32, dist::ReduceOp::sum);
    }
}

void Model::set_router_bias(std::vector<float> bias) {
  if (!bias.empty() && (!cfg_.is_moe() || (int)bias.size() != cfg_.num_local_experts))
    fail("router bias: {} values for a model of {} experts", bias.size(), cfg_.is_moe() ? cfg_.num_local_experts : 0);
  bias_alloc_.reset();
  if (!moe_) return;
  moe_->set_router_bias(Tensor{});
  if (bias.empty()) return;
  bias_alloc_ = be_.allocate(bias.size() * 4, "router bias");
  const Tensor t = be_.view(bias_alloc_->data(), Store::f32, bias.size());
  be_.upload(t, bias.data());
  moe_->set_router_bias(t);
}

void Model::allocate(Activations& s, int B, int T) {
  if (B == s.B && T == s.T && !s.layers.empty()) return;
  s.B = B;
  s.T = T;
  const long N = (long)B * T;
  const Dims d = dims();
  const int C = d.C, V = d.V;
  const int L = layer_end_ - layer_begin_;
  const bool head = last_stage();
  const Store act = be_.act_store(), f32 = Store::f32, i32 = Store::i32;
  // The identity plan (every token one row of one expert): the shared expert's, and LoRA's on the
  // attention projections and the router (a grouped linear of one group).
  const bool ident = cfg_.has_shared_expert() || lora_.on();

  s.arena.reset();
  s.layers.clear();
  s.layers.resize(L);
  // Two passes: the first measures, the second hands out views.  Full recompute keeps each layer's
  // input only (the rest is recomputed into a work set: allocate_recompute).
  const bool input_only = recompute_ == Recompute::full;
  void* base = nullptr;
  for (int pass = 0; pass < 2; pass++) {
    TensorCarver c(be_, base);
    for (int l = 0; l < L; l++) carve_layer(c, s.layers[l], layer_begin_ + l, B, T, input_only);
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
  for (LayerActs& a : s.layers)
    if (!a.moe && !input_only) a.dense.build_plan(be_, N);
  if (ident) {
    std::vector<int32_t> zeros(N, 0);
    ops::moe_plan_build(s.ident_plan, zeros.data(), N, 1, 1);
    s.ident_pv = be_.upload_plan(s.ident_plan, s.ident_rt, s.ident_ro);
  }
}

void Model::carve_layer(TensorCarver& c, LayerActs& a, int lg, int B, int T, bool input_only) {
  const long N = (long)B * T;
  const int C = cfg_.hidden_size;
  const Store act = be_.act_store(), f32 = Store::f32;
  const BlockEnv ev = env();
  a.moe = layer_moe(lg);
  a.x = c.take(f32, N * C);
  if (input_only) return;
  a.ln1 = c.take(act, N * C);
  a.rstd1 = c.take(f32, N);
  a.attn.carve(c, ev, attention_weights(lg, false), B, T);
  a.h = c.take(f32, N * C);
  a.ln2 = c.take(act, N * C);
  a.ln2f = a.moe && act != f32 ? c.take(f32, N * C) : a.ln2;  // the router's input in f32
  a.rstd2 = c.take(f32, N);
  if (a.moe)
    a.moe_saved.carve(c, ev, moe_weights(lg, false), N, /*local_experts=*/!ep_on());
  else
    a.dense.carve(c, ev, ffn_weights(lg, false, false), N, ffn_width(lg));
}

void Model::set_recompute(Recompute r) {
  if (!pending_.empty())
    fail("[Model::set_recompute] {} micro-batches await their backward; change the recompute mode between steps",
         pending_.size());
  recompute_ = r;
  pool_.clear();
  last_ = nullptr;
  rc_alloc_.reset();
  work_.clear();
  rc_B_ = rc_T_ = 0;
}

void Model::allocate_recompute(int B, int T) {
  if (recompute_ == Recompute::none || (B == rc_B_ && T == rc_T_ && rc_alloc_)) return;
  rc_B_ = B;
  rc_T_ = T;
  const long N = (long)B * T;
  const Dims d = dims();
  const int L = layer_end_ - layer_begin_;
  const Store act = be_.act_store(), f32 = Store::f32;
  const bool full = recompute_ == Recompute::full;
  rc_alloc_.reset();
  // Full: a work set per kind of layer (MoE: -1; dense: its width), laid out for its first layer.
  std::vector<int> kinds, first;
  work_of_.assign(L, -1);
  int dense_width = 0;
  for (int l = 0; l < L; l++) {
    const int lg = layer_begin_ + l, kind = layer_moe(lg) ? -1 : ffn_width(lg);
    if (kind >= 0) dense_width = std::max(dense_width, kind);
    const auto it = std::find(kinds.begin(), kinds.end(), kind);
    work_of_[l] = (int)(it - kinds.begin());
    if (it == kinds.end()) {
      kinds.push_back(kind);
      first.push_back(lg);
    }
  }
  work_.clear();
  work_.resize(full ? kinds.size() : 0);
  void* base = nullptr;
  for (int pass = 0; pass < 2; pass++) {
    TensorCarver c(be_, base);
    if (full) {
      for (size_t i = 0; i < work_.size(); i++) {
        carve_layer(c, work_[i], first[i], B, T, false);
        work_[i].x = Tensor{};  // each layer's kept input, attached by layer_acts
      }
      rc_out_ = c.take(f32, N * d.C);
    } else {
      // What the selective carve leaves out (AttentionSaved, MoeSaved, DenseFfnSaved::carve).
      const size_t state = be_.attention_saved_numel(B, T, d.NH);
      const bool shared = cfg_.has_shared_expert();
      rc_attn_ = state > (size_t)N * d.NH ? c.take(f32, state) : Tensor{};
      rc_act_ = d.moe && !ep_on() ? c.take(act, N * d.K * d.I) : Tensor{};
      rc_shact_ = shared ? c.take(act, N * (cfg_.shared_expert_intermediate_size / tp_size_)) : Tensor{};
      rc_dense_act_ = dense_width > 0 ? c.take(act, N * dense_width) : Tensor{};
    }
    if (pass == 0) {
      rc_alloc_ = be_.allocate(std::max<size_t>(c.used(), 1), "recompute buffers");
      base = rc_alloc_->data();
    }
  }
  for (LayerActs& a : work_)
    if (!a.moe) a.dense.build_plan(be_, N);
}

Model::LayerActs& Model::layer_acts(Activations& s, int l) {
  LayerActs& a = s.layers[l - layer_begin_];
  if (recompute_ == Recompute::full) {
    LayerActs& w = work_[work_of_[l - layer_begin_]];
    w.x = a.x;
    return w;
  }
  if (recompute_ == Recompute::selective) {
    if (a.attn.recompute_state) a.attn.attn_saved = rc_attn_;
    if (a.moe_saved.dispatch.recompute_act) a.moe_saved.dispatch.act = rc_act_;
    if (a.moe_saved.shact_recompute) a.moe_saved.shact = rc_shact_;
    if (a.dense.ffn.recompute_act) a.dense.ffn.act = rc_dense_act_.part(0, (size_t)s.B * s.T * ffn_width(l));
  }
  return a;
}

void Model::allocate_scratch(int B, int T) {
  if (B == scratch_B_ && T == scratch_T_ && scratch_alloc_) return;
  scratch_B_ = B;
  scratch_T_ = T;
  const long N = (long)B * T;
  const int C = cfg_.hidden_size;
  const Store act = be_.act_store(), f32 = Store::f32;
  const BlockEnv ev = env();
  scratch_alloc_.reset();
  void* base = nullptr;
  for (int pass = 0; pass < 2; pass++) {
    TensorCarver c(be_, base);
    dres_ = c.take(f32, N * C);
    dln_ = c.take(f32, N * C);
    tmp_ = c.take(f32, N * C);
    dres_act_ = act != f32 ? c.take(act, N * C) : Tensor{};
    attn_sc_.carve(c, ev, lora_.on() ? lora_.rank : 0, N);
    if (cfg_.is_moe()) moe_sc_.carve(c, ev, lora_.has(LoraTarget::router) ? lora_.rank : 0, N);
    if (pass == 0) {
      scratch_alloc_ = be_.allocate(c.used(), "scratch");
      base = scratch_alloc_->data();
    }
  }
  attn_sc_.tmp = tmp_;
  moe_sc_.tmp = tmp_;
}

Model::Activations& Model::acquire() {
  for (const auto& a : pool_)
    if (std::find(pending_.begin(), pending_.end(), a.get()) == pending_.end()) return *a;
  pool_.push_back(std::make_unique<Activations>());
  return *pool_.back();
}

size_t Model::Activations::bytes() const {
  size_t b = arena ? arena->bytes() : 0;
  for (const LayerActs& a : layers) b += a.moe_saved.dispatch.bytes();
  return b;
}

size_t Model::activation_bytes_per_micro_batch() const { return last_ ? last_->bytes() : 0; }

size_t Model::state_bytes() const {
  size_t b = 0;
  for (const auto* a : {&params_alloc_, &grads_alloc_, &gemm_alloc_, &lparams_alloc_, &lgrads_alloc_, &lgemm_alloc_,
                        &base16_alloc_, &window_alloc_})
    if (*a) b += (*a)->bytes();
  b += base16_host_.size() * sizeof(uint16_t);
  if (be_.host_memory()) b += (params_.size() + grads_.size() + lparams_.size() + lgrads_.size()) * sizeof(float);
  return b;
}

size_t Model::activation_bytes() const {
  size_t b = scratch_alloc_ ? scratch_alloc_->bytes() : 0;
  if (rc_alloc_) b += rc_alloc_->bytes();
  for (const LayerActs& w : work_) b += w.moe_saved.dispatch.bytes();
  for (const auto& a : pool_) b += a->bytes();
  return b;
}

const float* Model::logits() const {
  if (last_ == nullptr) return nullptr;
  if (!be_.host_memory()) fail("[Model::logits] the logits live in {} memory; use download_logits", be_.name());
  return last_->logits.empty() ? nullptr : last_->logits.f32();
}

void Model::download_logits(float* host) const {
  if (last_ == nullptr || last_->logits.empty())
    fail("[Model::download_logits] no logits (no forward pass on the last stage)");
  be_.download(host, last_->logits);
}

const float* Model::stage_output() const {
  if (last_ == nullptr) fail("[Model::stage_output] no forward pass yet");
  return static_cast<const float*>(last_->x_final.data);
}

const ops::RouterLayerStats& Model::pooled_stats() const {
  if (last_ == nullptr) fail("[Model::pooled_stats] no forward pass yet");
  return last_->router.pooled;
}

const float* Model::input_grad() const {
  if (first_stage()) fail("[Model::input_grad] the first stage has no input hidden states (layers from 0)");
  return static_cast<const float*>(dres_.data);
}

Model::Dims Model::dims() const {
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

Losses Model::forward(const Batch& batch, const LossWeights& weights, const StageInput& in) {
  pending_.clear();
  return forward_queued(batch, weights, in);
}

Losses Model::forward_queued(const Batch& batch, const LossWeights& weights, const StageInput& in) {
  validate_batch(batch, cfg_.vocab_size);
  if (!first_stage() && in.hidden == nullptr)
    fail("[Model::forward] the stage of layers [{}, {}) needs the previous stage's hidden states", layer_begin_,
         layer_end_);
  const int E = cfg_.is_moe() ? cfg_.num_local_experts : 0;
  if (in.pooled != nullptr && ((int)in.pooled->assigned.size() != E || (int)in.pooled->prob_sum.size() != E))
    fail("[Model::forward] pooled router statistics for {} experts, the model has {}", in.pooled->assigned.size(), E);
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

Losses Model::run_forward(Activations& s, const Batch& batch, const LossWeights& weights, const StageInput& in) {
  refresh_gemm_weights();
  allocate(s, batch.B, batch.T);
  allocate_scratch(batch.B, batch.T);
  allocate_recompute(batch.B, batch.T);
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
void Model::layer_forward(Activations& s, int l, Tensor x_next, bool recomputing) {
  const long N = (long)s.B * s.T;
  const int C = cfg_.hidden_size;
  const float eps = (float)cfg_.rms_norm_eps;
  BlockEnv ev = env();
  if (recomputing) ev.profile = nullptr;  // timed as a whole (bwd.recompute)
  LayerActs& a = layer_acts(s, l);
  {
    Section t(ev, "fwd.norms");
    be_.rmsnorm_forward(a.ln1, a.rstd1, a.x, W(ParamKind::input_norm, l), N, C, eps);
  }
  be_.copy(a.h, a.x);
  AttentionBlock::forward(ev, a.h, a.attn, attn_sc_, a.ln1, s.positions, s.amask, attention_weights(l), s.ident_pv, s.B,
                          s.T);
  {
    Section t(ev, "fwd.norms");
    // The router reads the f32 normalised input.
    if (a.ln2f.data != a.ln2.data) {
      be_.rmsnorm_forward(a.ln2f, a.rstd2, a.h, W(ParamKind::post_norm, l), N, C, eps);
      be_.convert(a.ln2, a.ln2f);
    } else {
      be_.rmsnorm_forward(a.ln2, a.rstd2, a.h, W(ParamKind::post_norm, l), N, C, eps);
    }
  }
  if (a.moe) {
    const Tensor tmask = s.prep.has_token_mask ? s.token_mask : Tensor{};
    const uint8_t* hmask = s.prep.has_token_mask ? s.prep.token_mask.data() : nullptr;
    const int li = l - layer_begin_;
    moe_->set_sequence_rows(s.weights.aux_kind == AuxLossKind::sequence ? s.T : 0);
    const long dropped = moe_->forward(ev, x_next, a.moe_saved, moe_sc_, a.ln2, a.ln2f, tmask, hmask, moe_weights(l),
                                       s.ident_pv, recomputing ? nullptr : &router_stats_[li]);
    if (!recomputing) dropped_[li] = dropped;
  } else {
    dense_.forward(ev, x_next, a.dense, a.ln2, ffn_weights(l, false), ffn_width(l));
  }
  Section t(ev, "fwd.residual");
  be_.add(x_next, a.h);
}

void Model::backward(const StageGrad& grad) {
  if (pending_.empty()) fail("[Model::backward] needs a forward pass with labels first (none is pending)");
  if (train_grad_tensor().empty()) fail("[Model::backward] the model keeps no gradients (release_gradients)");
  Activations& s = *pending_.front();
  if (!s.prep.has_labels) fail("[Model::backward] needs a forward pass with labels first");
  if (!last_stage() && grad.hidden == nullptr)
    fail("[Model::backward] the stage of layers [{}, {}) needs the gradient of its output hidden states", layer_begin_,
         layer_end_);
  const bool pooled_aux = cfg_.is_moe() && s.weights.aux_kind == AuxLossKind::hf_pooled;
  if (pooled_aux && !last_stage() && grad.aux_grad == nullptr)
    fail("[Model::backward] the stage of layers [{}, {}) needs the last stage's aux-loss gradient", layer_begin_,
         layer_end_);
  pending_.pop_front();
  allocate_scratch(s.B, s.T);
  allocate_recompute(s.B, s.T);
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
      be_.head_backward(dln_, G(hk), s.logits, s.lse, s.targets, s.lnf, Wg(hk), N, C, V, table_.vocab_begin(),
                        (float)s.weights.ce_scale, !tp_on());
      if (tp_on()) tp_all_reduce(dln_);
      be_.rmsnorm_backward(dres_, G(ParamKind::final_norm), dln_, s.x_final, W(ParamKind::final_norm), s.rstdf, N, C,
                           false);
    }
  }
  for (int l = layer_end_ - 1; l >= layer_begin_; l--) {
    if (recompute_ == Recompute::full) {
      // The layer's forward again from its kept input, into its work set (the output is not read).
      Section t(be_, profile_, "bwd.recompute");
      layer_forward(s, l, rc_out_, /*recomputing=*/true);
    }
    layer_backward(s, l);
  }
  if (!first_stage() || grads_t_.empty()) return;  // dres: input_grad(); a frozen embedding has no gradient
  Section t(be_, profile_, "bwd.embedding");
  be_.embedding_backward(G(ParamKind::embedding), dres_, s.tokens, N, C, table_.vocab_begin(), V, !tp_on());
}

void Model::allocate_infer(long n) {
  InferActs& a = infer_;
  if (a.arena && a.laid_rows == n) return;  // the views of the last pass fit (decode steps)
  const int C = cfg_.hidden_size;
  const Store act = be_.act_store(), f32 = Store::f32, i32 = Store::i32;
  const BlockEnv ev = env();
  // Layouts by the first layer of each kind (every layer has the same adapters), the dense FFN's for
  // the widest dense layer.
  int first_moe = -1, first_dense = -1, dense_width = 0;
  for (int l = 0; l < cfg_.num_hidden_layers; l++) {
    if (layer_moe(l)) {
      if (first_moe < 0) first_moe = l;
    } else {
      if (first_dense < 0) first_dense = l;
      dense_width = std::max(dense_width, ffn_width(l));
    }
  }
  // Views of exactly n rows, laid out in an arena that grows to the largest pass (every piece grows
  // with n, so a smaller pass fits a larger pass's arena).
  for (int pass = 0; pass < 2; pass++) {
    TensorCarver c(be_, pass == 0 ? nullptr : a.arena->data());
    a.x = c.take(f32, n * C);
    a.h = c.take(f32, n * C);
    a.ln1 = c.take(act, n * C);
    a.rstd1 = c.take(f32, n);
    a.ln2 = c.take(act, n * C);
    a.ln2f = first_moe >= 0 && act != f32 ? c.take(f32, n * C) : a.ln2;
    a.rstd2 = c.take(f32, n);
    a.attn.carve(c, ev, attention_weights(0, false), 1, (int)n, /*training=*/false);
    a.attn_sc.carve(c, ev, lora_.on() ? lora_.rank : 0, n, /*training=*/false);
    a.attn_sc.tmp = c.take(f32, n * C);
    if (first_moe >= 0) {
      a.moe.carve(c, ev, moe_weights(first_moe, false), n, /*local_experts=*/true, /*training=*/false);
      a.moe_sc.tmp = a.attn_sc.tmp;  // the forward's only buffer of the MoE scratch
    }
    if (first_dense >= 0)
      a.dense.carve(c, ev, ffn_weights(first_dense, false, false), n, dense_width, /*training=*/false);
    a.tokens = c.take(i32, n);
    a.positions = c.take(i32, n);
    a.logit_index = c.take(i32, n);
    a.xf = c.take(f32, n * C);
    a.lnf = c.take(act, n * C);
    a.rstdf = c.take(f32, n);
    a.ident_rt = c.take(i32, n);
    a.ident_ro = c.take(i32, n);
    if (pass == 0 && (!a.arena || a.arena->bytes() < c.used())) {
      a.arena.reset();
      a.arena = be_.allocate(c.used(), "inference activations");
    }
  }
  a.laid_rows = n;
}

void Model::infer(std::span<const InferSequence> seqs, std::span<const int32_t> tokens, std::span<const int> logit_rows,
                  float* logits) {
  if (tp_on() || ep_on() || !first_stage() || !last_stage() || lora_.base_bf16)
    fail("[Model::infer] runs a whole model on one process (no tp, pp or ep; an fp32 LoRA base)");
  const long n = (long)tokens.size();
  const int C = cfg_.hidden_size, V = cfg_.vocab_size, L = cfg_.num_hidden_layers;
  if (n == 0) fail("[Model::infer] no tokens to feed");
  long covered = 0;
  for (const InferSequence& q : seqs) {
    if (q.rows <= 0 || q.pos0 < 0 || q.k == nullptr || q.v == nullptr)
      fail("[Model::infer] a sequence of {} rows at position {} (rows must be positive, with its cache)", q.rows,
           q.pos0);
    covered += q.rows;
  }
  if (covered != n) fail("[Model::infer] the sequences cover {} rows, the pass has {} tokens", covered, n);
  for (long i = 0; i < n; i++)
    if (tokens[i] < 0 || tokens[i] >= V)
      fail("[Model::infer] token id {} at row {} is outside the vocabulary [0, {})", tokens[i], i, V);
  for (size_t r = 0; r < logit_rows.size(); r++)
    if (logit_rows[r] < 0 || logit_rows[r] >= n || (r > 0 && logit_rows[r] <= logit_rows[r - 1]))
      fail("[Model::infer] logit rows must be ascending rows of the pass, got {} at {}", logit_rows[r], r);
  refresh_gemm_weights();
  allocate_infer(n);
  InferActs& a = infer_;
  if (infer_w_.empty()) {  // resolved once: the tensors are views that do not move
    for (int l = 0; l < L; l++) {
      InferLayer w;
      w.input_norm = W(ParamKind::input_norm, l);
      w.post_norm = W(ParamKind::post_norm, l);
      w.attn = attention_weights(l);
      if (layer_moe(l))
        w.moe = moe_weights(l);
      else
        w.ffn = ffn_weights(l, false);
      infer_w_.push_back(std::move(w));
    }
  }
  BlockEnv ev = env();
  ev.inference = true;
  // Rows of several sequences, or one token: each row must get what it gets alone.
  be_.begin_inference_pass(/*decode=*/n == 1 || seqs.size() > 1, n);
  const float eps = (float)cfg_.rms_norm_eps;
  const Tensor x = a.x, h = a.h, ln1 = a.ln1, ln2 = a.ln2, ln2f = a.ln2f;
  std::vector<int32_t>& pos = a.host_positions;
  pos.clear();
  for (const InferSequence& q : seqs)
    for (int r = 0; r < q.rows; r++) pos.push_back(q.pos0 + r);
  be_.upload(a.tokens, tokens.data());
  be_.upload(a.positions, pos.data());
  // The identity plan of the n rows (LoRA's grouped products, the shared expert, the dense FFN).
  if (lora_.on() || cfg_.has_shared_expert()) {
    a.zeros.assign(n, 0);
    ops::moe_plan_build(a.ident_plan, a.zeros.data(), n, 1, 1);
    a.ident_pv = be_.upload_plan(a.ident_plan, a.ident_rt, a.ident_ro);
  }
  if (!a.dense.row_token.empty()) a.dense.build_plan(be_, n);
  if (cfg_.is_mla()) {  // room to expand the longest sequence's cached latents (model/latent_attention.h)
    long longest = 0;
    for (const InferSequence& q : seqs) longest = std::max(longest, (long)q.pos0 + q.rows);
    const long wkvb = LatentAttention::expand_width_kvb(cfg_), wkv = LatentAttention::expand_width_kv(cfg_);
    const size_t elem = be_.element_bytes(be_.act_store()), need = (size_t)longest * (wkvb + 2 * wkv) * elem;
    if (!mla_expand_ || mla_expand_->bytes() < need)
      mla_expand_ = be_.allocate(std::max(need, mla_expand_ ? 2 * mla_expand_->bytes() : need), "latent expansion");
    char* p = static_cast<char*>(mla_expand_->data());
    a.attn_sc.xkvb = be_.view(p, be_.act_store(), (size_t)longest * wkvb);
    a.attn_sc.xk = be_.view(p + (size_t)longest * wkvb * elem, be_.act_store(), (size_t)longest * wkv);
    a.attn_sc.xv = be_.view(p + (size_t)longest * (wkvb + wkv) * elem, be_.act_store(), (size_t)longest * wkv);
  }
  be_.embedding_forward(x, a.tokens, W(ParamKind::embedding), n, C, 0, V, true);
  std::vector<KvRows>& kv = a.kv;
  kv.resize(seqs.size());
  for (int l = 0; l < L; l++) {
    for (size_t i = 0, row = 0; i < seqs.size(); row += seqs[i].rows, i++)
      kv[i] = KvRows{(int)row, seqs[i].rows, seqs[i].pos0, seqs[i].k[l], seqs[i].v[l]};
    const InferLayer& w = infer_w_[l];
    be_.rmsnorm_forward(ln1, a.rstd1, x, w.input_norm, n, C, eps);
    be_.copy(h, x);
    AttentionBlock::forward_cached(ev, h, a.attn, a.attn_sc, ln1, a.positions, kv, w.attn, a.ident_pv, n);
    if (ln2f.data != ln2.data) {
      be_.rmsnorm_forward(ln2f, a.rstd2, h, w.post_norm, n, C, eps);
      be_.convert(ln2, ln2f);
    } else {
      be_.rmsnorm_forward(ln2, a.rstd2, h, w.post_norm, n, C, eps);
    }
    if (layer_moe(l))
      moe_->forward(ev, x, a.moe, a.moe_sc, ln2, ln2f, Tensor{}, nullptr, w.moe, a.ident_pv, nullptr);
    else
      dense_.forward(ev, x, a.dense, ln2, w.ffn, ffn_width(l));
    be_.add(x, h);
  }
  const long rows = (long)logit_rows.size();
  if (rows > 0) {
    Section t(ev, "head");
    const Tensor xf = a.xf.part(0, rows * C), lnf = a.lnf.part(0, rows * C);
    const Tensor index = a.logit_index.part(0, rows);
    be_.upload(index, logit_rows.data());
    be_.gather_rows(xf, x, index, rows, C);
    be_.rmsnorm_forward(lnf, a.rstdf.part(0, rows), xf, W(ParamKind::final_norm), rows, C, eps);
    // Host backends write the caller's buffer; others a buffer of the logits' size, downloaded.
    const Tensor out = be_.host_memory() ? be_.view(logits, Store::f32, (size_t)rows * V)
                                         : a.logits.get(be_, Store::f32, (size_t)rows * V, "inference logits");
    be_.matmul_forward(out, lnf, Wg(table_.head_kind()), (int)rows, C, V, false);
    if (!be_.host_memory()) be_.download(logits, out);
  }
  be_.end_inference_pass();
}

// Layer l in reverse; dres is d(x_next) on entry and d(x) of the layer on exit.
void Model::layer_backward(Activations& s, int l) {
  const long N = (long)s.B * s.T;
  const int C = cfg_.hidden_size;
  const BlockEnv ev = env();
  const int li = l - layer_begin_;
  LayerActs& a = layer_acts(s, l);
  // FFN block: dres is d(x_next); it flows to h unchanged plus through the FFN.
  if (a.moe) {
    const Tensor tmask = s.prep.has_token_mask ? s.token_mask : Tensor{};
    moe_->set_sequence_rows(s.weights.aux_kind == AuxLossKind::sequence ? s.T : 0);
    moe_->backward(ev, dln_, dres_, a.moe_saved, moe_sc_, a.ln2, a.ln2f, tmask, s.router.aux_dprobs[li].data(),
                   s.weights.z_coef, s.prep.real_tokens, moe_weights(l), s.ident_pv,
                   s.router.seq_row_grad.empty() ? nullptr : &s.router.seq_row_grad[li]);
  } else {
    dense_.backward(ev, dln_, as_act(dres_, dres_act_), a.dense, a.ln2, ffn_weights(l, false), ffn_width(l));
  }
  {
    Section t(ev, "bwd.norms");
    be_.rmsnorm_backward(dres_, G(ParamKind::post_norm, l), dln_, a.h, W(ParamKind::post_norm, l), a.rstd2, N, C, true);
  }  // dres is now d(h)
  AttentionBlock::backward(ev, dln_, as_act(dres_, dres_act_), a.attn, attn_sc_, a.ln1, s.positions, s.amask,
                           attention_weights(l), s.ident_pv, s.B, s.T);
  {
    Section t(ev, "bwd.norms");
    be_.rmsnorm_backward(dres_, G(ParamKind::input_norm, l), dln_, a.x, W(ParamKind::input_norm, l), a.rstd1, N, C,
                         true);
  }  // dres is now d(x) of this layer
}

}  // namespace moetron
