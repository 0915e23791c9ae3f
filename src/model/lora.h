// LoRA adapters (Hu et al.; PEFT's format): for a frozen base weight W [out, in] the layer computes
//   y = x W^T + scale * (x A^T) B^T,   A [r, in], B [out, r], scale = alpha / r (alpha / sqrt(r): rsLoRA)
// on the attention projections (q/k/v/o_proj), the router, the dense FFN layers' and shared experts'
// gate/up/down projections, and every routed expert's gate_up and down projections, stacked per
// expert like the expert weights: A13 [E, r, C], B13 [E, 2I, r] (gate rows
// then up rows, as w13), A2 [E, r, I], B2 [E, C, r].  PEFT's initialisation: A uniform in
// +-1/sqrt(in) (kaiming_uniform with a = sqrt(5)), B zero, so the initial model is the base.
//
// The adapters form their own ParamTable (params.h: kinds lora_a / lora_b, ParamSpec::target the
// base tensor they adapt), so AdamW, ZeRO-1, gradient norms and the shard / whole copies serve them
// as they serve a model.  Sharding follows the base: under tensor parallelism a column-parallel
// base (q, k, v, gate_up: rows split) splits B by the same rows and keeps A whole; a row-parallel
// base (o, down: columns split) splits A by the same columns and keeps B whole.  A whole factor's
// gradient is then a partial sum on each tp rank (Model::reduce_replicated_grads sums it);
// expert adapters live with their experts under ep (ParamSpec::expert).
//
// Internal tensor names (the adapter table's hf_tensors, what checkpoints' optimizer state is keyed
// by): "model.layers.L.self_attn.q_proj.lora_A.weight" (as PEFT without its "base_model.model."
// prefix); per expert "model.layers.L.mlp.experts.E.gate_up_proj.lora_A", "...lora_B.gate" /
// "...lora_B.up" (the two row blocks tp splits separately), "...down_proj.lora_A", "...lora_B".
//
// On disk (PEFT >= 0.17, `peft.PeftModel.from_pretrained(base, DIR)` loads it):
//   adapter_config.json         {"peft_type": "LORA", "r", "lora_alpha", "target_modules": [q_proj, ...],
//                                "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], ...}
//   adapter_model.safetensors   F32 tensors "base_model.model.model.layers.L.self_attn.q_proj.lora_A.weight"
//                               [r, C], "...lora_B.weight" [out, r]; for the fused experts (PEFT's
//                               ParamWrapper) "base_model.model.model.layers.L.mlp.experts.lora_A.weight"
//                               [E*r, in] (row e*r + j = A_e[j]) and "...lora_B.weight" [out, r*E]
//                               (column j*E + e = B_e[:, j]).  PEFT nests one wrapper per targeted
//                               parameter in the experts module's parameter order (gate_up_proj, then
//                               down_proj; whatever order adapter_config.json lists them in), so with
//                               both targeted gate_up's names read "experts.base_layer.lora_A".
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/hf_config.h"
#include "model/params.h"

namespace moetron {

// mlp: the gate_proj, up_proj and down_proj of every dense FFN layer and every shared expert (PEFT's
// target_modules names match both).
// router: the MoE router (PEFT target_parameters "mlp.gate.weight"), run in fp32 as the router is.
enum class LoraTarget { q_proj, k_proj, v_proj, o_proj, experts_gate_up, experts_down, mlp, router };

struct LoraSpec {
  int rank = 0;  // 0: no adapters
  double alpha = 0.0;
  bool rslora = false;  // scale alpha / sqrt(r) (PEFT use_rslora)
  std::vector<LoraTarget> targets;  // sorted, unique
  // How Model keeps the frozen base: bf16 (model.dtype bf16: 2 bytes a parameter, each
  // layer widened to fp32 when it runs) or fp32.  Not part of the adapter.
  bool base_bf16 = false;
  bool on() const { return rank > 0; }
  float scale() const;
  bool has(LoraTarget t) const;
  // The base tensor a target adapts (q_proj .. o_proj, ffn_w13, ffn_w2) and back.
  static ParamKind base_kind(LoraTarget t);
};

// The config names of the targets: q_proj, k_proj, v_proj, o_proj, experts.gate_up_proj,
// experts.down_proj; "experts" names both expert ones and "attention" the four projections.
// Error "FIELD: unknown target 'X' (valid: ...)" or "FIELD: target 'X': the model has no routed
// experts"; an empty list is an error too.
std::vector<LoraTarget> parse_lora_targets(const std::vector<std::string>& names, const ModelConfig& cfg,
                                           const std::string& field);
std::string lora_target_name(LoraTarget t);

// Fills values (table.total() floats, an adapter table) with PEFT's initialisation from the counter
// RNG keyed by (seed, internal tensor name, index in the whole tensor): any shard holds the whole
// table's values.
void init_lora_parameters(const ParamTable& table, uint64_t seed, float* values);

// ---- PEFT adapter directories --------------------------------------------------------------------

// Writes DIR/adapter_config.json and DIR/adapter_model.safetensors (atomically, F32) from a WHOLE
// adapter table's values.  base_model: the base's path or name (adapter_config's
// base_model_name_or_path; may be "").
void write_peft_adapter(const std::string& dir, const ModelConfig& cfg, const LoraSpec& spec, const ParamTable& table,
                        const float* values, const std::string& base_model);

struct PeftAdapter {
  LoraSpec spec;
  std::vector<float> values;  // laid out by the whole adapter table of (cfg, spec)
};
// Reads a PEFT LoRA adapter directory for a base of config `cfg`.  Errors name the file and the
// field: not LoRA, options moetron does not implement (DoRA, biases, dropout on experts, per-layer
// ranks, target regexes, modules_to_save, ...), a target the base lacks, a tensor missing,
// unexpected or of a shape the base does not imply (an adapter made for another model).  Every error
// is an InputError (the CLI exits 2).
PeftAdapter read_peft_adapter(const std::string& dir, const ModelConfig& cfg);

// W += scale * B A for every adapted tensor: base_values laid out by the WHOLE base table, adapter
// values by the WHOLE adapter table of the same model.
void merge_lora(const ParamTable& base, float* base_values, const ParamTable& adapters, const float* adapter_values,
                const LoraSpec& spec);

}  // namespace moetron
