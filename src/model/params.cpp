#include "model/params.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "core/error.h"
#include "core/rng.h"

namespace moetron {

namespace {

std::string layer_prefix(int layer) { return fmt::format("model.layers.{}.", layer); }

// The moe block's prefix: Mixtral's block_sparse_moe, Qwen3-MoE's mlp.
const char* moe_block(const ModelConfig& cfg) { return cfg.mixtral_names() ? "block_sparse_moe." : "mlp."; }

// The shared expert(s): Qwen2-MoE's gated mlp.shared_expert, DeepSeek's / GLM's mlp.shared_experts.
std::string shared_block(const ModelConfig& cfg) {
  return cfg.shared_expert_gated() ? "mlp.shared_expert." : "mlp.shared_experts.";
}

std::string spec_name(const ModelConfig& cfg, ParamKind kind, int layer) {
  const std::string p = layer >= 0 ? layer_prefix(layer) : "";
  const bool moe = layer >= 0 && cfg.is_moe_layer(layer);
  switch (kind) {
    case ParamKind::embedding:
      return "model.embed_tokens.weight";
    case ParamKind::input_norm:
      return p + "input_layernorm.weight";
    case ParamKind::q_proj:
      return p + "self_attn.q_proj.weight";
    case ParamKind::k_proj:
      return p + "self_attn.k_proj.weight";
    case ParamKind::v_proj:
      return p + "self_attn.v_proj.weight";
    case ParamKind::o_proj:
      return p + "self_attn.o_proj.weight";
    case ParamKind::q_bias:
      return p + "self_attn.q_proj.bias";
    case ParamKind::k_bias:
      return p + "self_attn.k_proj.bias";
    case ParamKind::v_bias:
      return p + "self_attn.v_proj.bias";
    case ParamKind::shared_w13:
      return p + shared_block(cfg) + "gate_up_proj";
    case ParamKind::shared_w2:
      return p + shared_block(cfg) + "down_proj.weight";
    case ParamKind::router_bias:
      return p + moe_block(cfg) + "gate.e_score_correction_bias";
    case ParamKind::q_a_proj:
      return p + "self_attn.q_a_proj.weight";
    case ParamKind::q_a_norm:
      return p + "self_attn.q_a_layernorm.weight";
    case ParamKind::q_b_proj:
      return p + "self_attn.q_b_proj.weight";
    case ParamKind::kv_a_proj:
      return p + "self_attn.kv_a_proj_with_mqa.weight";
    case ParamKind::kv_a_norm:
      return p + "self_attn.kv_a_layernorm.weight";
    case ParamKind::kv_b_proj:
      return p + "self_attn.kv_b_proj.weight";
    case ParamKind::shared_gate:
      return p + "mlp.shared_expert_gate.weight";
    case ParamKind::q_norm:
      return p + "self_attn.q_norm.weight";
    case ParamKind::k_norm:
      return p + "self_attn.k_norm.weight";
    case ParamKind::post_norm:
      return p + "post_attention_layernorm.weight";
    case ParamKind::router:
      return p + moe_block(cfg) + "gate.weight";
    case ParamKind::ffn_w13:
      return p + (moe ? std::string(moe_block(cfg)) + "experts.w13" : "mlp.gate_up_proj");
    case ParamKind::ffn_w2:
      return p + (moe ? std::string(moe_block(cfg)) + "experts.w2" : "mlp.down_proj.weight");
    case ParamKind::final_norm:
      return "model.norm.weight";
    case ParamKind::lm_head:
      return "lm_head.weight";
    case ParamKind::lora_a:
    case ParamKind::lora_b:
      return "";  // named by the adapter table (model/lora.cpp)
  }
  return "";
}

bool is_ffn(ParamKind kind) {
  return kind == ParamKind::ffn_w13 || kind == ParamKind::ffn_w2 || kind == ParamKind::shared_w13 ||
         kind == ParamKind::shared_w2;
}

HfTensorRef make_ref(std::string name, std::vector<int64_t> shape, size_t offset, size_t numel, size_t spec_index,
                     int stacked_index) {
  HfTensorRef t;
  t.name = std::move(name);
  t.full_shape = shape;
  t.shape = std::move(shape);
  t.offset = offset;
  t.numel = numel;
  t.spec_index = spec_index;
  t.stacked_index = stacked_index;
  return t;
}

}  // namespace

std::pair<int64_t, int64_t> shard_range(int64_t n, int parts, int part) {
  if (parts <= 0 || part < 0 || part >= parts) fail("shard_range: part {} of {} is invalid", part, parts);
  const int64_t base = n / parts, extra = n % parts;
  const int64_t begin = part * base + std::min<int64_t>(part, extra);
  return {begin, begin + base + (part < extra ? 1 : 0)};
}

ParamTable::ParamTable(const ModelConfig& cfg, const ParamShard& shard)
    : num_layers_(cfg.num_hidden_layers), moe_(cfg.is_moe()), shard_(shard), tied_(cfg.tie_word_embeddings) {
  if (cfg.router_sigmoid && cfg.extra.is_object()) {  // DeepSeek-V3 / GLM-4.5's field, kept verbatim
    const auto it = cfg.extra.find("num_nextn_predict_layers");
    if (it != cfg.extra.end() && it->is_number_integer() && it->get<int64_t>() > 0 && it->get<int64_t>() <= 64)
      mtp_layers_ = (int)it->get<int64_t>();
  }
  const int64_t C = cfg.hidden_size, V = cfg.vocab_size;
  const int64_t NH = cfg.num_attention_heads, NKV = cfg.num_key_value_heads, HD = cfg.head_dim;
  const int64_t Q = NH * HD;
  const int64_t KV = NKV * HD;
  const int64_t E = moe_ ? cfg.num_local_experts : 1;
  // The shard: layers [lb, le), experts [eb, ee), tensor-parallel rank r of tp.
  const int L = num_layers_;
  const int lb = shard.layer_begin, le = shard.layer_end < 0 ? L : shard.layer_end;
  const int eb = shard.expert_begin, ee = shard.expert_end < 0 ? (int)E : shard.expert_end;
  const int tp = shard.tp_size, r = shard.tp_rank;
  if (lb < 0 || lb >= le || le > L)
    fail("parameter shard: layer range [{}, {}) is outside the model's {} layers (num_hidden_layers)", lb, le, L);
  if (eb < 0 || eb >= ee || ee > E)
    fail("parameter shard: expert range [{}, {}) is outside the model's {} experts (num_local_experts)", eb, ee, E);
  if (tp < 1 || r < 0 || r >= tp) fail("parameter shard: tp_rank {} is outside [0, tp_size {})", r, tp);
  check_tp_split(cfg, tp, lb, le);
  whole_ = lb == 0 && le == L && eb == 0 && ee == E && tp == 1;
  const bool split = tp > 1;
  // This rank's heads, kv heads (one replicated head when NKV < tp), FFN rows and vocabulary rows.
  const int64_t h0 = NH / tp * r, nh = NH / tp;
  const bool kv_replicated = NKV < tp;
  const int64_t kv0 = kv_replicated ? r / (tp / NKV) : NKV / tp * r, nkv = kv_replicated ? 1 : NKV / tp;
  const auto [v0, v1] = shard_range(V, tp, r);
  vocab_begin_ = v0;
  vocab_end_ = v1;
  const int64_t Vr = v1 - v0, Qr = nh * HD, KVr = nkv * HD;
  const int El = ee - eb;
  const bool first_stage = lb == 0, last_stage = le == L;

  auto replicated = [&](ParamSpec& s) {
    s.tp_split = TpSplit::none;
    s.tp_primary = r == 0;
  };
  auto rows = [&](ParamSpec& s) { s.tp_split = split ? TpSplit::rows : TpSplit::none; };
  auto cols = [&](ParamSpec& s) { s.tp_split = split ? TpSplit::cols : TpSplit::none; };
  if (first_stage) rows(add(cfg, ParamKind::embedding, -1, {Vr, C}, true));
  for (int l = lb; l < le; l++) {
    const bool moe_l = cfg.is_moe_layer(l);
    const int64_t Ir = cfg.ffn_size(l) / tp, El_l = moe_l ? El : 1;
    replicated(add(cfg, ParamKind::input_norm, l, {C}, false));
    if (cfg.is_mla()) {
      // Latent attention: the down-projections and their norms whole on every tp rank, the
      // up-projections and o_proj split by heads.
      const int64_t qr = cfg.q_lora_rank, kvr = cfg.kv_lora_rank, dr = cfg.qk_rope_head_dim;
      const int64_t dn = cfg.qk_nope_head_dim, dv = cfg.v_head_dim;
      if (qr > 0) {
        replicated(add(cfg, ParamKind::q_a_proj, l, {qr, C}, true));
        replicated(add(cfg, ParamKind::q_a_norm, l, {qr}, false));
        rows(add(cfg, ParamKind::q_b_proj, l, {Qr, qr}, true));
      } else {
        rows(add(cfg, ParamKind::q_proj, l, {Qr, C}, true));
      }
      replicated(add(cfg, ParamKind::kv_a_proj, l, {kvr + dr, C}, true));
      replicated(add(cfg, ParamKind::kv_a_norm, l, {kvr}, false));
      rows(add(cfg, ParamKind::kv_b_proj, l, {nh * (dn + dv), kvr}, true));
      cols(add(cfg, ParamKind::o_proj, l, {C, nh * dv}, true));
    } else {
    rows(add(cfg, ParamKind::q_proj, l, {Qr, C}, true));
    for (ParamKind k : {ParamKind::k_proj, ParamKind::v_proj}) {
      ParamSpec& s = add(cfg, k, l, {KVr, C}, true);
      rows(s);
      if (kv_replicated) s.tp_primary = r % (tp / NKV) == 0;
    }
    if (cfg.qkv_bias) {  // split with their projections' rows; no weight decay (HF's AdamW groups decay them)
      rows(add(cfg, ParamKind::q_bias, l, {Qr}, true));
      for (ParamKind k : {ParamKind::k_bias, ParamKind::v_bias}) {
        ParamSpec& s = add(cfg, k, l, {KVr}, true);
        rows(s);
        if (kv_replicated) s.tp_primary = r % (tp / NKV) == 0;
      }
    }
    cols(add(cfg, ParamKind::o_proj, l, {C, Qr}, true));
    if (cfg.qk_norm_full) {  // OLMoE: over the whole projections, split with their heads
      rows(add(cfg, ParamKind::q_norm, l, {Qr}, false));
      ParamSpec& s = add(cfg, ParamKind::k_norm, l, {KVr}, false);
      rows(s);
      if (kv_replicated) s.tp_primary = r % (tp / NKV) == 0;
    } else if (cfg.qk_norm) {  // per head: whole on every rank, each rank's gradient covers its heads only
      replicated(add(cfg, ParamKind::q_norm, l, {HD}, false));
      replicated(add(cfg, ParamKind::k_norm, l, {HD}, false));
    }
    }
    replicated(add(cfg, ParamKind::post_norm, l, {C}, false));
    if (moe_l) replicated(add(cfg, ParamKind::router, l, {E, C}, true));
    if (moe_l && cfg.has_selection_bias()) replicated(add(cfg, ParamKind::router_bias, l, {E}, false));
    ParamSpec& w13 = add(cfg, ParamKind::ffn_w13, l, {El_l, 2 * Ir, C}, true);
    rows(w13);
    w13.expert = moe_l;
    ParamSpec& w2 = add(cfg, ParamKind::ffn_w2, l, {El_l, C, Ir}, true);
    cols(w2);
    w2.expert = moe_l;
    if (moe_l && cfg.has_shared_expert()) {  // a dense FFN: split over tp like one, whole on every ep rank
      const int64_t Is = cfg.shared_expert_intermediate_size / tp;
      rows(add(cfg, ParamKind::shared_w13, l, {1, 2 * Is, C}, true));
      cols(add(cfg, ParamKind::shared_w2, l, {1, C, Is}, true));
      if (cfg.shared_expert_gated()) replicated(add(cfg, ParamKind::shared_gate, l, {1, C}, true));
    }
  }
  if (last_stage) {
    replicated(add(cfg, ParamKind::final_norm, -1, {C}, false));
    // Tied embeddings: the head reads the embedding, which only a stage that is also the first holds.
    if (cfg.tie_word_embeddings && !first_stage)
      fail("parameter shard: tie_word_embeddings needs the embedding and the head on one pipeline stage "
           "(layers [{}, {}) of {} hold the head only)",
           lb, le, L);
    if (!cfg.tie_word_embeddings) rows(add(cfg, ParamKind::lm_head, -1, {Vr, C}, true));
  }

  // The HF tensors: experts (or the dense FFN) split out of the stacked storage; each with the
  // slice of the whole tensor it holds.
  auto slice_of = [&](HfTensorRef& t, const ParamSpec& s, int64_t begin, int64_t end) {
    if (s.tp_split == TpSplit::none) return;
    t.slice_dim = s.tp_split == TpSplit::rows ? 0 : (int)t.full_shape.size() - 1;
    t.slice_begin = begin;
    t.slice_end = end;
  };
  for (size_t si = 0; si < specs_.size(); si++) {
    const ParamSpec& s = specs_[si];
    if (!is_ffn(s.kind)) {
      HfTensorRef t = make_ref(s.name, s.shape, s.offset, s.numel, si, -1);
      switch (s.kind) {
        case ParamKind::embedding:
        case ParamKind::lm_head:
          t.full_shape = {V, C};
          slice_of(t, s, v0, v1);
          break;
        case ParamKind::q_proj:
          t.full_shape = {Q, C};
          slice_of(t, s, h0 * HD, (h0 + nh) * HD);
          break;
        case ParamKind::k_proj:
        case ParamKind::v_proj:
          t.full_shape = {KV, C};
          slice_of(t, s, kv0 * HD, (kv0 + nkv) * HD);
          break;
        case ParamKind::q_bias:
          t.full_shape = {Q};
          slice_of(t, s, h0 * HD, (h0 + nh) * HD);
          break;
        case ParamKind::k_bias:
        case ParamKind::v_bias:
          t.full_shape = {KV};
          slice_of(t, s, kv0 * HD, (kv0 + nkv) * HD);
          break;
        case ParamKind::q_norm:  // OLMoE's span the heads (Qwen3's [HD] are whole: tp_split none)
          if (cfg.qk_norm_full) {
            t.full_shape = {Q};
            slice_of(t, s, h0 * HD, (h0 + nh) * HD);
          }
          break;
        case ParamKind::k_norm:
          if (cfg.qk_norm_full) {
            t.full_shape = {KV};
            slice_of(t, s, kv0 * HD, (kv0 + nkv) * HD);
          }
          break;
        case ParamKind::o_proj:
          if (cfg.is_mla()) {
            t.full_shape = {C, NH * cfg.v_head_dim};
            slice_of(t, s, h0 * cfg.v_head_dim, (h0 + nh) * cfg.v_head_dim);
          } else {
            t.full_shape = {C, Q};
            slice_of(t, s, h0 * HD, (h0 + nh) * HD);
          }
          break;
        case ParamKind::q_b_proj:
          t.full_shape = {Q, cfg.q_lora_rank};
          slice_of(t, s, h0 * HD, (h0 + nh) * HD);
          break;
        case ParamKind::kv_b_proj: {
          const int64_t w = cfg.qk_nope_head_dim + cfg.v_head_dim;
          t.full_shape = {NH * w, cfg.kv_lora_rank};
          slice_of(t, s, h0 * w, (h0 + nh) * w);
          break;
        }
        default:
          break;
      }
      hf_tensors_.push_back(std::move(t));
      continue;
    }
    const std::string p = layer_prefix(s.layer);
    const bool shared = s.kind == ParamKind::shared_w13 || s.kind == ParamKind::shared_w2;
    const int64_t I = shared ? cfg.shared_expert_intermediate_size : cfg.ffn_size(s.layer), Ir = I / tp, i0 = Ir * r;
    const size_t IC = (size_t)Ir * C;
    const bool mixtral = cfg.mixtral_names();
    for (int el = 0; el < s.shape[0]; el++) {
      const int e = s.expert ? eb + el : 0;
      auto name = [&](const char* mixtral_suffix, const char* qwen_suffix, const char* dense_name) {
        if (shared) return fmt::format("{}{}{}.weight", p, shared_block(cfg), qwen_suffix);
        if (!s.expert) return p + dense_name;
        return fmt::format("{}{}experts.{}.{}.weight", p, moe_block(cfg), e, mixtral ? mixtral_suffix : qwen_suffix);
      };
      if (s.kind == ParamKind::ffn_w13 || s.kind == ParamKind::shared_w13) {
        const size_t base = s.offset + 2 * IC * el;
        HfTensorRef w1 = make_ref(name("w1", "gate_proj", "mlp.gate_proj.weight"), {Ir, C}, base, IC, si, e);
        HfTensorRef w3 = make_ref(name("w3", "up_proj", "mlp.up_proj.weight"), {Ir, C}, base + IC, IC, si, e);
        for (HfTensorRef* t : {&w1, &w3}) {
          t->full_shape = {I, C};
          slice_of(*t, s, i0, i0 + Ir);
          hf_tensors_.push_back(std::move(*t));
        }
      } else {
        HfTensorRef w2 =
            make_ref(name("w2", "down_proj", "mlp.down_proj.weight"), {C, Ir}, s.offset + IC * el, IC, si, e);
        w2.full_shape = {C, I};
        slice_of(w2, s, i0, i0 + Ir);
        hf_tensors_.push_back(std::move(w2));
      }
    }
  }
}

ParamSpec& ParamTable::add(const ModelConfig& cfg, ParamKind kind, int layer, std::vector<int64_t> shape, bool decay) {
  ParamSpec s;
  s.name = spec_name(cfg, kind, layer);
  s.kind = kind;
  s.layer = layer;
  // Overflow-checked: a ModelConfig that skipped validate_model_config (built in code) must not wrap
  // into a small table that later code indexes past.
  uint64_t numel = 1;
  for (int64_t d : shape)
    if (d < 0 || __builtin_mul_overflow(numel, (uint64_t)d, &numel) || numel > kMaxModelParameters)
      fail("parameter table: tensor '{}' of shape [{}] has more than {} elements (the config's sizes are too large)",
           s.name, fmt::join(shape, ", "), kMaxModelParameters);
  s.numel = (size_t)numel;
  s.shape = std::move(shape);
  s.offset = total_;
  s.weight_decay = decay;
  s.n_stacked = is_ffn(kind) ? (int)s.shape[0] : 0;
  // Keep every tensor 16-float aligned (64 bytes) for vector loads.
  total_ += (s.numel + 15) / 16 * 16;
  if (total_ > kMaxModelParameters)
    fail("parameter table: the model has more than {} parameters (2^44) once '{}' is added (the config's sizes are "
         "too large)",
         kMaxModelParameters, s.name);
  specs_.push_back(std::move(s));
  return specs_.back();
}

bool ParamTable::has(ParamKind kind, int layer) const {
  for (const ParamSpec& s : specs_)
    if (s.kind == kind && s.layer == layer) return true;
  return false;
}

const ParamSpec& ParamTable::at(ParamKind kind, int layer) const {
  for (const ParamSpec& s : specs_)
    if (s.kind == kind && s.layer == layer) return s;
  fail("parameter table: no parameter of kind {} in layer {}", (int)kind, layer);
}

const ParamSpec* ParamTable::find_lora(ParamKind target, int layer, bool b) const {
  const ParamKind k = b ? ParamKind::lora_b : ParamKind::lora_a;
  for (const ParamSpec& s : specs_)
    if (s.kind == k && s.target == target && s.layer == layer) return &s;
  return nullptr;
}

const HfTensorRef* ParamTable::find_hf(const std::string& name) const {
  for (const HfTensorRef& t : hf_tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

namespace {

// Calls f(whole_ptr, shard_ptr, n) for every contiguous run of a shard tensor inside the whole one.
template <typename F>
void for_each_run(const ParamTable& whole, const ParamTable& shard, F&& f) {
  if (!whole.is_whole()) fail("parameter shard copy: the first table must be the whole model");
  std::map<std::string, const HfTensorRef*> by_name;
  for (const HfTensorRef& t : whole.hf_tensors()) by_name[t.name] = &t;
  for (const HfTensorRef& t : shard.hf_tensors()) {
    const auto it = by_name.find(t.name);
    if (it == by_name.end()) fail("parameter shard copy: tensor '{}' is not part of the whole model", t.name);
    const HfTensorRef& w = *it->second;
    if (w.shape != t.full_shape) fail("parameter shard copy: tensor '{}' has another shape in the whole model", t.name);
    if (t.slice_dim < 0) {
      f(w.offset, t.offset, t.numel);
    } else if (t.slice_dim == 0) {
      const size_t row = t.numel / (size_t)t.shape[0];  // elements per index of dim 0 (1 for a bias)
      f(w.offset + (size_t)t.slice_begin * row, t.offset, t.numel);
    } else {
      const size_t cols = (size_t)t.shape.back(), full_cols = (size_t)w.shape.back();
      for (size_t a = 0; a < t.numel / cols; a++)
        f(w.offset + a * full_cols + (size_t)t.slice_begin, t.offset + a * cols, cols);
    }
  }
}

}  // namespace

void check_tp_split(const ModelConfig& cfg, int tp, int layer_begin, int layer_end) {
  if (tp < 1) fail("parallel.tp: tp {} must be >= 1", tp);
  if (cfg.num_attention_heads % tp != 0)
    fail("parallel.tp: tp {} does not divide num_attention_heads {}", tp, cfg.num_attention_heads);
  const int nkv = cfg.num_key_value_heads;
  if (nkv % tp != 0 && tp % nkv != 0)
    fail("parallel.tp: num_key_value_heads {} and tp {}: neither divides the other (kv heads are split over "
         "tp, or replicated when tp is a multiple of them)",
         nkv, tp);
  if (cfg.shared_expert_intermediate_size % tp != 0)
    fail("parallel.tp: tp {} does not divide shared_expert_intermediate_size {} (the FFN width is split over tp)", tp,
         cfg.shared_expert_intermediate_size);
  // Only under tp > 1 (every size divides by 1): a config built in code may have 2^31 layers, which
  // the parameter table's 2^44 bound refuses after its first few thousand.
  if (tp > 1) {
    const int end = layer_end < 0 ? cfg.num_hidden_layers : layer_end;
    for (int l = layer_begin; l < end; l++)
      if (cfg.ffn_size(l) % tp != 0)
        fail("parallel.tp: tp {} does not divide {} {} (the FFN width is split over tp)", tp,
             cfg.is_moe_layer(l) && cfg.moe_intermediate_size > 0 ? "moe_intermediate_size" : "intermediate_size",
             cfg.ffn_size(l));
  }
}

void check_ep_split(const ModelConfig& cfg, int ep) {
  if (ep < 1) fail("parallel.ep: ep {} must be >= 1", ep);
  if (!cfg.is_moe() && ep != 1)
    fail("parallel.ep: ep {} needs an MoE model; {} is dense (num_local_experts 0)", ep, cfg.architecture);
  if (cfg.is_moe() && cfg.num_local_experts % ep != 0)
    fail("parallel.ep: ep {} does not divide num_local_experts {}", ep, cfg.num_local_experts);
}

ParamShard make_param_shard(const ModelConfig& cfg, int layer_begin, int layer_end, int tp_rank, int tp_size,
                            int ep_rank, int ep_size) {
  ParamShard s;
  s.layer_begin = layer_begin;
  s.layer_end = layer_end;
  s.tp_rank = tp_rank;
  s.tp_size = tp_size;
  if (ep_size > 1) {
    check_ep_split(cfg, ep_size);
    const int El = cfg.num_local_experts / ep_size;
    s.expert_begin = ep_rank * El;
    s.expert_end = (ep_rank + 1) * El;
  }
  return s;
}

void copy_from_whole(const ParamTable& whole, const float* whole_values, const ParamTable& shard, float* shard_values) {
  for_each_run(whole, shard, [&](size_t wo, size_t so, size_t n) {
    std::copy(whole_values + wo, whole_values + wo + n, shard_values + so);
  });
}

void copy_to_whole(const ParamTable& shard, const float* shard_values, const ParamTable& whole, float* whole_values) {
  for_each_run(whole, shard, [&](size_t wo, size_t so, size_t n) {
    std::copy(shard_values + so, shard_values + so + n, whole_values + wo);
  });
}

void copy_to_whole(const ParamTable& shard, const float* shard_values, const ParamTable& whole, float* whole_values,
                   const std::vector<std::pair<size_t, size_t>>& only) {
  for_each_run(whole, shard, [&](size_t wo, size_t so, size_t n) {
    // The first range that ends after so.
    auto it = std::upper_bound(only.begin(), only.end(), so,
                               [](size_t x, const std::pair<size_t, size_t>& r) { return x < r.second; });
    for (; it != only.end() && it->first < so + n; ++it) {
      const size_t lo = std::max(so, it->first), hi = std::min(so + n, it->second);
      std::copy(shard_values + lo, shard_values + hi, whole_values + wo + (lo - so));
    }
  });
}

void init_parameters(const ParamTable& table, const ModelConfig& cfg, uint64_t seed, float* params) {
  for (const HfTensorRef& t : table.hf_tensors()) init_hf_tensor(table, cfg, seed, t, params + t.offset);
}

void init_hf_tensor(const ParamTable& table, const ModelConfig& cfg, uint64_t seed, const HfTensorRef& t, float* p) {
  const double std = cfg.initializer_range;
  {
    if (table.spec_of(t).is_norm() || table.spec_of(t).is_bias() || table.spec_of(t).is_buffer()) {
      const float fill = table.spec_of(t).is_norm() ? 1.0f : 0.0f;
      for (size_t i = 0; i < t.numel; i++) p[i] = fill;
      return;
    }
    const uint64_t key = hash_name(t.name);
    if (t.slice_dim < 0) {
#pragma omp parallel for schedule(static)
      for (size_t i = 0; i < t.numel; i++) p[i] = (float)(std * normal_at(seed, key, i));
      return;
    }
    // A slice of a 2-d tensor: element (a, b) of the slice is element (a + begin, b) (rows) or
    // (a, b + begin) (columns) of the whole tensor; a 1-d slice is one row.
    const bool one_d = t.shape.size() == 1;
    const size_t cols = one_d ? t.numel : (size_t)t.shape.back(), full_cols = one_d ? 0 : (size_t)t.full_shape.back();
    if (one_d) {
#pragma omp parallel for schedule(static)
      for (size_t i = 0; i < t.numel; i++) p[i] = (float)(std * normal_at(seed, key, i + (size_t)t.slice_begin));
      return;
    }
    const size_t row_off = t.slice_dim == 0 ? (size_t)t.slice_begin : 0;
    const size_t col_off = t.slice_dim == 0 ? 0 : (size_t)t.slice_begin;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < t.numel; i++) {
      const size_t a = i / cols, b = i % cols;
      p[i] = (float)(std * normal_at(seed, key, (a + row_off) * full_cols + b + col_off));
    }
  }
}

}  // namespace moetron
