// Hugging Face config.json <-> ModelConfig for Mixtral (MoE) and dense Mistral / Llama models.
//
// Reading follows transformers' semantics: absent optional fields take the defaults of the
// architecture's config class (MixtralConfig, MistralConfig, LlamaConfig), with two deliberate
// differences: num_key_value_heads defaults to num_attention_heads (transformers' Mistral/Mixtral
// classes default to 8), and absent bos/eos/pad ids are -1 rather than 1/2/None. Fields this
// struct does not model are kept verbatim in `extra` and written back unchanged. Features moetron
// does not implement (rope scaling, tied embeddings, activations other than silu, biases) are
// rejected with an Error instead of being silently ignored.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace moetron {

struct ModelConfig {
  std::string architecture;  // MixtralForCausalLM | MistralForCausalLM | LlamaForCausalLM
  std::string model_type;    // mixtral | mistral | llama
  int vocab_size = 0;
  int hidden_size = 0;
  int intermediate_size = 0;  // FFN width (per expert for MoE)
  int num_hidden_layers = 0;
  int num_attention_heads = 0;
  int num_key_value_heads = 0;
  int head_dim = 0;
  int num_local_experts = 0;    // 0 for dense models
  int num_experts_per_tok = 0;  // 0 for dense models
  double rms_norm_eps = 1e-5;
  double rope_theta = 1e6;
  int sliding_window = 0;  // 0: none (config null)
  int max_position_embeddings = 0;
  double router_aux_loss_coef = 0.0;  // Mixtral default 0.001; 0 for dense
  double initializer_range = 0.02;
  bool tie_word_embeddings = false;
  int bos_token_id = -1;  // -1: absent / null
  int eos_token_id = -1;  // the first one when the config lists several
  int pad_token_id = -1;
  std::vector<int> eos_token_ids;  // every eos id the config names (empty when absent)
  std::string torch_dtype;         // "float32" | "bfloat16" | "float16"; "" when absent
  std::string hidden_act = "silu";
  nlohmann::json extra = nlohmann::json::object();  // every other config.json field

  bool is_moe() const { return num_local_experts > 0; }
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
