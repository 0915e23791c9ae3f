#include "model/params.h"

#include <fmt/format.h>

#include "core/error.h"
#include "core/rng.h"

namespace moetron {

namespace {

std::string layer_prefix(int layer) { return fmt::format("model.layers.{}.", layer); }

std::string spec_name(ParamKind kind, int layer, bool moe) {
  const std::string p = layer >= 0 ? layer_prefix(layer) : "";
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
    case ParamKind::post_norm:
      return p + "post_attention_layernorm.weight";
    case ParamKind::router:
      return p + "block_sparse_moe.gate.weight";
    case ParamKind::ffn_w13:
      return p + (moe ? "block_sparse_moe.experts.w13" : "mlp.gate_up_proj");
    case ParamKind::ffn_w2:
      return p + (moe ? "block_sparse_moe.experts.w2" : "mlp.down_proj.weight");
    case ParamKind::final_norm:
      return "model.norm.weight";
    case ParamKind::lm_head:
      return "lm_head.weight";
  }
  return "";
}

bool is_ffn(ParamKind kind) { return kind == ParamKind::ffn_w13 || kind == ParamKind::ffn_w2; }

}  // namespace

ParamTable::ParamTable(const ModelConfig& cfg) : num_layers_(cfg.num_hidden_layers), moe_(cfg.is_moe()) {
  const int64_t C = cfg.hidden_size, V = cfg.vocab_size, I = cfg.intermediate_size;
  const int64_t Q = (int64_t)cfg.num_attention_heads * cfg.head_dim;
  const int64_t KV = (int64_t)cfg.num_key_value_heads * cfg.head_dim;
  const int64_t E = moe_ ? cfg.num_local_experts : 1;
  add(ParamKind::embedding, -1, {V, C}, true);
  for (int l = 0; l < num_layers_; l++) {
    add(ParamKind::input_norm, l, {C}, false);
    add(ParamKind::q_proj, l, {Q, C}, true);
    add(ParamKind::k_proj, l, {KV, C}, true);
    add(ParamKind::v_proj, l, {KV, C}, true);
    add(ParamKind::o_proj, l, {C, Q}, true);
    add(ParamKind::post_norm, l, {C}, false);
    if (moe_) add(ParamKind::router, l, {E, C}, true);
    add(ParamKind::ffn_w13, l, {E, 2 * I, C}, true);
    add(ParamKind::ffn_w2, l, {E, C, I}, true);
  }
  add(ParamKind::final_norm, -1, {C}, false);
  add(ParamKind::lm_head, -1, {V, C}, true);

  // The HF tensors: experts (or the dense FFN) split out of the stacked storage.
  for (size_t si = 0; si < specs_.size(); si++) {
    const ParamSpec& s = specs_[si];
    if (!is_ffn(s.kind)) {
      hf_tensors_.push_back({s.name, s.shape, s.offset, s.numel, si, -1});
      continue;
    }
    const std::string p = layer_prefix(s.layer);
    const size_t IC = (size_t)I * C;
    for (int e = 0; e < s.shape[0]; e++) {
      auto name = [&](const char* expert_suffix, const char* dense_name) {
        return moe_ ? fmt::format("{}block_sparse_moe.experts.{}.{}.weight", p, e, expert_suffix) : p + dense_name;
      };
      if (s.kind == ParamKind::ffn_w13) {
        const size_t base = s.offset + 2 * IC * e;
        hf_tensors_.push_back({name("w1", "mlp.gate_proj.weight"), {I, C}, base, IC, si, e});
        hf_tensors_.push_back({name("w3", "mlp.up_proj.weight"), {I, C}, base + IC, IC, si, e});
      } else {
        hf_tensors_.push_back({name("w2", "mlp.down_proj.weight"), {C, I}, s.offset + IC * e, IC, si, e});
      }
    }
  }
}

void ParamTable::add(ParamKind kind, int layer, std::vector<int64_t> shape, bool decay) {
  ParamSpec s;
  s.name = spec_name(kind, layer, moe_);
  s.kind = kind;
  s.layer = layer;
  s.numel = 1;
  for (int64_t d : shape) s.numel *= (size_t)d;
  s.shape = std::move(shape);
  s.offset = total_;
  s.weight_decay = decay;
  s.n_stacked = is_ffn(kind) ? (int)s.shape[0] : 0;
  // Keep every tensor 16-float aligned (64 bytes) for vector loads.
  total_ += (s.numel + 15) / 16 * 16;
  specs_.push_back(std::move(s));
}

const ParamSpec& ParamTable::at(ParamKind kind, int layer) const {
  for (const ParamSpec& s : specs_)
    if (s.kind == kind && s.layer == layer) return s;
  fail("parameter table: no parameter of kind {} in layer {}", (int)kind, layer);
}

const HfTensorRef* ParamTable::find_hf(const std::string& name) const {
  for (const HfTensorRef& t : hf_tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

void init_parameters(const ParamTable& table, const ModelConfig& cfg, uint64_t seed, float* params) {
  const double std = cfg.initializer_range;
  for (const HfTensorRef& t : table.hf_tensors()) {
    float* p = params + t.offset;
    if (table.spec_of(t).is_norm()) {
      for (size_t i = 0; i < t.numel; i++) p[i] = 1.0f;
      continue;
    }
    const uint64_t key = hash_name(t.name);
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < t.numel; i++) p[i] = (float)(std * normal_at(seed, key, i));
  }
}

}  // namespace moetron
