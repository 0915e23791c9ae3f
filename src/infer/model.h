// An inference model: the config, the parameter table and the fp32 parameters of an HF Mixtral /
// Mistral / Llama directory -- and, beside them, what generation needs from the directory: the
// tokenizer, the chat template and the end-of-sequence ids.  Unlike MixtralModel (training) it holds
// no gradients or activations.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "io/hf_config.h"
#include "model/lora.h"
#include "model/params.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace moetron {

struct InferenceModel {
  ModelConfig cfg;
  ParamTable table;
  std::vector<float> params;  // table.total() floats
  // A bf16 copy of `params` (same offsets), made by keep_bf16_copy() when every value is exactly a
  // bf16 value -- a bf16 checkpoint, as most published ones are.  Decoding then streams half the
  // bytes per token with bitwise the same results (bf16 widens to fp32 exactly); prefill GEMMs keep
  // using the fp32 values.  Empty otherwise.
  std::vector<uint16_t> params_bf16;

  // A LoRA adapter applied unmerged at run time (load_inference_model's lora_dir): its spec, its whole
  // adapter table and values (fp32).  Null: none.
  struct Adapter {
    LoraSpec spec;
    ParamTable table;
    std::vector<float> values;
  };
  std::unique_ptr<Adapter> lora;

  explicit InferenceModel(const ModelConfig& c) : cfg(c), table(c), params(table.total(), 0.0f) {}
  // A LoRA factor (b: B, else A) adapting base tensor `target` of `layer`, or null.
  const float* lora_factor(ParamKind target, int layer, bool b) const {
    const ParamSpec* s = lora ? lora->table.find_lora(target, layer, b) : nullptr;
    return s ? lora->values.data() + s->offset : nullptr;
  }
  const float* weight(ParamKind kind, int layer = -1) const { return params.data() + table.at(kind, layer).offset; }
  const uint16_t* weight_bf16(ParamKind kind, int layer = -1) const {
    return params_bf16.empty() ? nullptr : params_bf16.data() + table.at(kind, layer).offset;
  }
  // Fills params_bf16 when every parameter is exactly representable in bf16; returns whether it did.
  bool keep_bf16_copy();
};

// Reads DIR/config.json and DIR's safetensors (any float dtype; computed in fp32), and keeps a bf16
// copy for decoding when the values allow it exactly (keep_bf16_copy).  lora_dir: a PEFT LoRA adapter
// directory (model/lora.h) for this base ("": none), applied unmerged by the Decoder (the base's
// weights stay as they are: its bf16 copy too).
std::unique_ptr<InferenceModel> load_inference_model(const std::string& dir, const std::string& lora_dir = "");

// How the chat template was chosen, for messages ("--template", "tokenizer_config.json", ...).
struct TemplateChoice {
  ChatTemplate tmpl = ChatTemplate::mistral;
  std::string source;
};

// The chat template of a model directory: `explicit_name` when not empty; otherwise the template the
// training data was prepared with (trainer_state.json -> config.data.path -> dataset.json "template",
// for moetron checkpoints); otherwise recognised from the Jinja chat template in tokenizer_config.json
// or chat_template.jinja ("<|im_start|>" -> chatml, "<<SYS>>" -> llama2, "[INST]" -> mistral);
// otherwise mistral.
TemplateChoice choose_chat_template(const std::string& model_dir, const std::string& explicit_name);

// The end-of-sequence ids: generation_config.json's eos_token_id (a number or a list) when present,
// else config.json's, plus the tokenizer's EOS (when given).  Never empty unless nothing names one.
std::vector<int32_t> model_eos_ids(const std::string& model_dir, const ModelConfig& cfg, const Tokenizer* tok);

// Adds the chat template's stop tokens (chat_stop_ids: <|im_end|> for chatml) to eos_ids.
void add_chat_stop_ids(std::vector<int32_t>& eos_ids, ChatTemplate tmpl, const Tokenizer& tok, const ModelConfig& cfg);

// The tokenizer for a model directory: `explicit_path` when given (Error when missing), else
// DIR/tokenizer.model, else DIR/tokenizer.json (with DIR/tokenizer_config.json for its BOS/EOS/PAD).  Null when neither exists and `required` is false; Error naming both
// otherwise.  Error when the tokenizer has more pieces than the model's vocabulary.
std::unique_ptr<Tokenizer> load_model_tokenizer(const std::string& model_dir, const std::string& explicit_path,
                                                const ModelConfig& cfg, bool required);

}  // namespace moetron
