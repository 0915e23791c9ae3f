#include "io/gguf_arch.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/error.h"

namespace moetron::gguf {

namespace {

[[noreturn]] void refuse(const std::string& msg) { throw InputError(msg); }

}  // namespace

Arch arch_for(const ModelConfig& cfg, const std::string& src) {
  const std::string& t = cfg.model_type;
  if (t == "mixtral" || t == "mistral" || t == "llama")
    return {.name = "llama", .permute_qk = true, .moe = cfg.is_moe(), .norm_topk = true};
  if (t == "qwen3_moe") return {.name = "qwen3moe", .moe = true, .norm_topk = true, .qk_norm = 1};
  if (t == "qwen2_moe")
    return {.name = "qwen2moe", .moe = true, .shared_expert = true, .attn_is_hidden = true, .needs_output = true};
  if (t == "olmoe")
    return {
        .name = "olmoe", .moe = true, .qk_norm = 2, .attn_is_hidden = true, .kv_is_heads = true, .needs_output = true};
  if (t == "qwen3") return {.name = "qwen3", .qk_norm = 1};
  if (t == "glm4_moe")  // either norm choice (expert_weights_norm), q/k norm optional (use_qk_norm)
    return {.name = "glm4moe",
            .moe = true,
            .norm_topk = cfg.norm_topk_prob,
            .shared_expert = cfg.has_shared_expert(),
            .qk_norm = cfg.qk_norm ? 1 : 0,
            .sigmoid_router = true};
  refuse(
      fmt::format("{}: field 'model_type' = '{}' has no GGUF export (supported: mixtral, mistral, llama, qwen3_moe, "
                  "qwen2_moe, olmoe, qwen3, glm4_moe)",
                  src, t));
}

int check_expressible(const ModelConfig& cfg, const Arch& a, bool window_as_context, const std::string& src) {
  const std::string tail = " (a GGUF of this model would compute another one in llama.cpp, so none is written)";
  const int L = cfg.num_hidden_layers;
  if (a.moe) {
    if (!cfg.is_moe()) refuse(fmt::format("{}: the model has no experts (num_experts){}", src, tail));
    for (int l = 0; l < L; l++) {
      if (cfg.is_moe_layer(l) || (a.sigmoid_router && l < cfg.first_k_dense_replace)) continue;
      const bool listed =
          std::find(cfg.mlp_only_layers.begin(), cfg.mlp_only_layers.end(), l) != cfg.mlp_only_layers.end();
      refuse(
          fmt::format("{}: field '{}' makes layer {} a dense FFN, and llama.cpp's {} graph runs every layer as MoE{}",
                      src, listed ? "mlp_only_layers" : "decoder_sparse_step", l, a.name, tail));
    }
    if (cfg.norm_topk_prob != a.norm_topk)
      refuse(fmt::format("{}: field 'norm_topk_prob' = {}: llama.cpp's {} graph {} the top-{} router weights{}", src,
                         cfg.norm_topk_prob, a.name, a.norm_topk ? "always renormalises" : "never renormalises",
                         cfg.num_experts_per_tok, tail));
  } else if (cfg.is_moe()) {
    refuse(fmt::format("{}: a dense {} model has experts (num_local_experts){}", src, cfg.model_type, tail));
  }
  if (cfg.has_shared_expert() != a.shared_expert)
    refuse(fmt::format("{}: field 'shared_expert_intermediate_size' = {}: llama.cpp's {} graph {} a shared expert{}",
                       src, cfg.shared_expert_intermediate_size, a.name, a.shared_expert ? "requires" : "has no",
                       tail));
  const int want_qk = cfg.qk_norm_full ? 2 : cfg.qk_norm ? 1 : 0;
  auto qk_name = [](int k) { return k == 0 ? "none" : k == 1 ? "per head" : "over all heads"; };
  if (want_qk != a.qk_norm)
    refuse(fmt::format("{}: the model's q/k norms ({}) differ from llama.cpp's {} graph's ({}){}", src,
                       qk_name(want_qk), a.name, qk_name(a.qk_norm), tail));
  if (cfg.clip_qkv > 0)
    refuse(fmt::format("{}: field 'clip_qkv' = {}: llama.cpp's {} graph does not clamp q, k and v{}", src, cfg.clip_qkv,
                       a.name, tail));
  if (a.sigmoid_router && cfg.topk_group < cfg.n_group)
    refuse(fmt::format("{}: fields 'n_group' = {}, 'topk_group' = {}: llama.cpp's {} graph searches every expert, "
                       "not the best groups{}",
                       src, cfg.n_group, cfg.topk_group, a.name, tail));
  if (cfg.qkv_bias && a.name != "qwen2moe" && a.name != "llama" && a.name != "glm4moe")
    refuse(fmt::format("{}: field 'qkv_bias' = true: llama.cpp's {} graph has no q/k/v biases{}", src, a.name, tail));
  if (a.attn_is_hidden && (int64_t)cfg.num_attention_heads * cfg.head_dim != cfg.hidden_size)
    refuse(
        fmt::format("{}: field 'head_dim' = {}: num_attention_heads x head_dim = {} differs from hidden_size {}, which "
                    "llama.cpp's {} graph assumes{}",
                    src, cfg.head_dim, (int64_t)cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, a.name, tail));
  if (a.kv_is_heads && cfg.num_key_value_heads != cfg.num_attention_heads)
    refuse(
        fmt::format("{}: field 'num_key_value_heads' = {} (grouped-query attention): llama.cpp's {} graph sizes the "
                    "k norm for {} heads{}",
                    src, cfg.num_key_value_heads, a.name, cfg.num_attention_heads, tail));
  if (cfg.head_dim % 2 != 0)
    refuse(fmt::format("{}: field 'head_dim' = {} is odd (RoPE pairs values)", src, cfg.head_dim));
  int context = cfg.max_position_embeddings;
  if (cfg.sliding_window > 0 && cfg.sliding_window < cfg.max_position_embeddings) {
    if (!window_as_context)
      refuse(fmt::format(
          "{}: field 'sliding_window' = {} is shorter than max_position_embeddings {}: llama.cpp's {} graph attends to "
          "every earlier position, so beyond {} positions the GGUF would compute another model. Pass "
          "--sliding-window-as-context to export it with context_length {} (exact within it)",
          src, cfg.sliding_window, cfg.max_position_embeddings, a.name, cfg.sliding_window, cfg.sliding_window));
    context = cfg.sliding_window;
  }
  return context;
}

void add_arch_keys(KeyValues& kv, const ModelConfig& cfg, const Arch& a, int context) {
  const std::string& A = a.name;
  auto u32 = [&](const std::string& key, int64_t v) { kv.emplace_back(A + "." + key, Value::u32((uint32_t)v)); };
  u32("vocab_size", cfg.vocab_size);
  u32("context_length", context);
  u32("embedding_length", cfg.hidden_size);
  u32("block_count", cfg.num_hidden_layers);
  u32("feed_forward_length", cfg.intermediate_size);
  u32("attention.head_count", cfg.num_attention_heads);
  u32("attention.head_count_kv", cfg.num_key_value_heads);
  u32("attention.key_length", cfg.head_dim);
  u32("attention.value_length", cfg.head_dim);
  u32("rope.dimension_count", cfg.rope_dim());
  kv.emplace_back(A + ".rope.freq_base", Value::f32((float)cfg.rope_theta));
  kv.emplace_back(A + ".attention.layer_norm_rms_epsilon", Value::f32((float)cfg.rms_norm_eps));
  if (cfg.is_moe()) {
    u32("expert_count", cfg.num_local_experts);
    u32("expert_used_count", cfg.num_experts_per_tok);
    if (A == "qwen3moe" || A == "qwen2moe" || a.sigmoid_router)
      u32("expert_feed_forward_length", cfg.expert_intermediate_size());
    if (a.sigmoid_router) {
      u32("expert_shared_count", cfg.n_shared_experts);
      u32("leading_dense_block_count", cfg.first_k_dense_replace);
      kv.emplace_back(A + ".expert_weights_scale", Value::f32((float)cfg.routed_scaling_factor));
      kv.emplace_back(A + ".expert_weights_norm", Value::boolean(cfg.norm_topk_prob));
      u32("expert_gating_func", 2);  // llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
    } else if (cfg.has_shared_expert()) {
      u32("expert_shared_feed_forward_length", cfg.shared_expert_intermediate_size);
    }
  }
}

}  // namespace moetron::gguf
