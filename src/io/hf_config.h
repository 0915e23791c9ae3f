// Hugging Face config.json <-> ModelConfig for the MoE models Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE,
// DeepSeek-V3 (and Kimi-K2, model_type kimi_k2) and GLM-4.5, and the dense Mistral / Llama / Qwen3
// models.
//
// Reading follows transformers' semantics: absent optional fields take the defaults of the
// architecture's config class (MixtralConfig, Qwen3MoeConfig, Qwen2MoeConfig, OlmoeConfig,
// MistralConfig, LlamaConfig, Qwen3Config), with two deliberate differences: num_key_value_heads
// defaults to num_attention_heads (transformers' Mistral/Mixtral classes default to 8), and absent
// bos/eos/pad ids are -1 rather than 1/2/None. Fields this struct does not model are kept verbatim in
// `extra` and written back unchanged. Features moetron does not implement (rope scaling, activations
// other than silu, biases other than Qwen2-MoE's q/k/v, per-layer sliding windows) are rejected with
// an Error instead of being silently ignored.
//
// OLMoE (modeling_olmoe.py): every layer MoE (num_experts, intermediate_size per expert), Qwen-style
// names, norm_topk_prob (default false), RMSNorm over the whole q and k projections (not per head),
// and the optional clip_qkv clamp of q, k, v.
// Qwen2-MoE (modeling_qwen2_moe.py) shares Qwen3-MoE's MoE fields and names (no q/k norms), and adds
// q/k/v biases (`qkv_bias`, default true) and the gated shared expert.
// Qwen3 / Qwen3-MoE differ from Mixtral in (modeling_qwen3*.py): an RMSNorm over each head's q and k
// before RoPE (`self_attn.{q,k}_norm.weight` [head_dim]); `head_dim` independent of hidden / heads
// (Qwen3's default 128); the experts' width `moe_intermediate_size` beside `intermediate_size` for
// dense layers, which `decoder_sparse_step` and `mlp_only_layers` place among the MoE layers; the
// top-K router weights renormalised only when `norm_topk_prob`; `num_experts` for the expert count;
// HF names `mlp.gate.weight` and `mlp.experts.e.{gate,up,down}_proj.weight`.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace moetron {

struct ModelConfig {
  // MixtralForCausalLM | Qwen3MoeForCausalLM | MistralForCausalLM | LlamaForCausalLM | Qwen3ForCausalLM
  std::string architecture;
  std::string model_type;  // mixtral | qwen3_moe | mistral | llama | qwen3
  int vocab_size = 0;
  int hidden_size = 0;
  int intermediate_size = 0;  // FFN width (per expert for Mixtral; of the dense layers for Qwen3-MoE)
  int num_hidden_layers = 0;
  int num_attention_heads = 0;
  int num_key_value_heads = 0;
  int head_dim = 0;
  int num_local_experts = 0;    // 0 for dense models (config.json: num_experts for Qwen3-MoE)
  int num_experts_per_tok = 0;  // 0 for dense models
  int moe_intermediate_size = 0;  // the experts' FFN width (Qwen3-MoE); 0: intermediate_size (Mixtral)
  int decoder_sparse_step = 1;    // Qwen3-MoE: layer l is MoE iff (l + 1) % step == 0 ...
  std::vector<int> mlp_only_layers;  // ... and l is not listed here (then a dense FFN of intermediate_size)
  bool norm_topk_prob = true;     // renormalise the top-K router weights to sum 1 (Mixtral: always)
  bool qk_norm = false;           // RMSNorm over each head of q and k before RoPE (Qwen3, Qwen3-MoE)
  bool qk_norm_full = false;      // OLMoE: the q and k norms span every head ([NH*HD], [NKV*HD] weights)
  double clip_qkv = 0.0;          // OLMoE: q, k, v clamped to [-clip_qkv, clip_qkv] after the norms; 0: off
  bool qkv_bias = false;          // q/k/v projection biases (Qwen2-MoE)
  int shared_expert_intermediate_size = 0;  // Qwen2-MoE: a shared expert in every MoE layer; 0: none
  double rms_norm_eps = 1e-5;
  double rope_theta = 1e6;
  int sliding_window = 0;  // 0: none (config null)
  int max_position_embeddings = 0;
  double router_aux_loss_coef = 0.0;  // Mixtral default 0.001; 0 for dense
  double initializer_range = 0.02;
  bool tie_word_embeddings = false;  // the head is the embedding matrix (no lm_head.weight; small Qwen3)
  int bos_token_id = -1;  // -1: absent / null
  int eos_token_id = -1;  // the first one when the config lists several
  int pad_token_id = -1;
  std::vector<int> eos_token_ids;  // every eos id the config names (empty when absent)
  std::string torch_dtype;         // "float32" | "bfloat16" | "float16"; "" when absent
  std::string hidden_act = "silu";

  // DeepSeek-V3 / GLM-4.5 routing (modeling_deepseek_v3.py DeepseekV3TopkRouter): scores =
  // sigmoid(logits); the experts are chosen by scores + e_score_correction_bias (a per-layer [E] f32
  // selection bias, `mlp.gate.e_score_correction_bias`, moved by aux-loss-free balancing, never by the
  // optimizer) among the topk_group best of n_group expert groups (a group's score: the sum of its two
  // best biased scores); the weights are the unbiased scores of the chosen, renormalised when
  // norm_topk_prob, times routed_scaling_factor.
  bool router_sigmoid = false;
  int n_group = 1, topk_group = 1;
  double routed_scaling_factor = 1.0;
  // Ungated shared experts (`mlp.shared_experts.*`) of width moe_intermediate_size * n_shared_experts,
  // held as shared_expert_intermediate_size; Qwen2-MoE's single shared expert is gated instead.
  int n_shared_experts = 0;
  // The first layers are dense FFNs of intermediate_size (DeepSeek-V3, GLM-4.5); the rest MoE.
  int first_k_dense_replace = 0;

  // RoPE: the rotated part of each q/k head (GLM's partial_rotary_factor; MLA's qk_rope_head_dim),
  // the pair layout (rope_interleave: DeepSeek's (x0,x1),(x2,x3).. pairs; else rotate-half), and
  // YaRN scaling (rope_type "yarn").
  int rotary_dim = 0;  // 0: head_dim
  double partial_rotary_factor = 1.0;
  bool rope_interleave = false;
  std::string rope_type = "default";  // "default" | "yarn"
  double yarn_factor = 0.0;  // yarn: the context extension (absent: max / original max positions)
  int yarn_original_max_position_embeddings = 0;
  double yarn_beta_fast = 32.0, yarn_beta_slow = 1.0;
  double yarn_mscale = 0.0, yarn_mscale_all_dim = 0.0;  // 0: absent
  double yarn_attention_factor = 0.0;                   // 0: absent (derived)

  // Multi-head latent attention (DeepSeek-V3): kv_lora_rank > 0.  q = q_b(norm(q_a(x))) with
  // q_lora_rank > 0, else q_proj(x); [latent | k_rope] = kv_a_proj_with_mqa(x), the latent normed;
  // kv_b_proj(latent) gives each head [k_nope | v].  A head's query/key is [nope | rope]:
  // head_dim = qk_nope_head_dim + qk_rope_head_dim; values are v_head_dim wide.
  int q_lora_rank = 0, kv_lora_rank = 0, qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;

  nlohmann::json extra = nlohmann::json::object();  // every other config.json field

  bool is_moe() const { return num_local_experts > 0; }
  // Whether decoder layer l has a routed MoE block (otherwise a dense FFN).
  bool is_moe_layer(int l) const;
  int expert_intermediate_size() const { return moe_intermediate_size > 0 ? moe_intermediate_size : intermediate_size; }
  // The FFN width of layer l: the experts' in a MoE layer, intermediate_size in a dense one.
  int ffn_size(int l) const { return is_moe_layer(l) ? expert_intermediate_size() : intermediate_size; }
  // Hugging Face tensor names of the MoE block: Mixtral's `block_sparse_moe.{gate, experts.e.w1/w3/w2}`
  // or (Qwen3-MoE) `mlp.{gate, experts.e.gate_proj/up_proj/down_proj}`.
  bool mixtral_names() const { return model_type == "mixtral"; }
  // Qwen2-MoE: every MoE layer also runs a dense "shared expert" FFN of this width, scaled per token by
  // sigmoid(x . shared_expert_gate) (`mlp.shared_expert.{gate,up,down}_proj`, `mlp.shared_expert_gate`).
  bool has_shared_expert() const { return shared_expert_intermediate_size > 0; }
  // Qwen2-MoE's shared expert is scaled by sigmoid(x . shared_expert_gate); DeepSeek's are not.
  bool shared_expert_gated() const { return has_shared_expert() && n_shared_experts == 0; }
  bool is_mla() const { return kv_lora_rank > 0; }
  // The dims of each head rotated by RoPE, and the value head width.
  int rope_dim() const { return rotary_dim > 0 ? rotary_dim : head_dim; }
  int value_head_dim() const { return is_mla() ? v_head_dim : head_dim; }
  // The per-layer MoE selection bias (e_score_correction_bias) exists.
  bool has_selection_bias() const { return router_sigmoid; }
  // YaRN: the multiplier of cos/sin (attention_factor) and of the softmax scale (DeepSeek's
  // mscale_all_dim squared; 1 otherwise).
  double rope_attention_factor() const;
  double softmax_scale_factor() const;
};

// Parses and validates; errors name `source_name` and the field.
ModelConfig model_config_from_json(const nlohmann::json& j, const std::string& source_name);
// Reads the config.json at `path`.
ModelConfig load_model_config(const std::string& path);
// HF field names: `extra` first, then the modelled fields (architectures: [architecture],
// model_type, torch_dtype, rope_theta plus rope_parameters {rope_type: default, rope_theta}, ...).
nlohmann::json model_config_to_json(const ModelConfig& cfg);
// The most parameters a config may imply (2^44, 1.76e13): validate_model_config bounds its estimate,
// ParamTable its exact total.
constexpr uint64_t kMaxModelParameters = uint64_t{1} << 44;

// Consistency checks (also run by model_config_from_json); errors name `source` and the field.
void validate_model_config(const ModelConfig& cfg, const std::string& source);

}  // namespace moetron
