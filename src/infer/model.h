// An inference model: the config, the parameter table and the weights of an HF model directory, used
// in place from the mapped files -- and, beside them, what generation needs from the directory: the
// tokenizer, the chat template and the end-of-sequence ids.  Unlike Model (training) it holds
// no gradients or activations, and no fp32 copy of a bf16 checkpoint.
#pragma once

#include <cstdint>
#include <ctime>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backend/weights.h"
#include "core/huge_pages.h"
#include "core/mmap.h"
#include "io/hf_config.h"
#include "io/safetensors.h"
#include "jinja/jinja.h"
#include "model/lora.h"
#include "model/params.h"
#include "model/weight_provider.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace moetron {

// How load_inference_model holds the matrices: as stored, or quantized to Q8_0 at load
// (kernels::quantize_q8_0, backend/kernels/q8.h; rows that are not whole blocks of 32 stay as stored).
enum class WeightQuant { none, q8_0 };
// "none" | "q8_0"; Error naming `what` (the option) otherwise.
WeightQuant parse_weight_quant(const std::string& name, const char* what);

struct InferenceModel final : public WeightProvider {
  ModelConfig cfg;
  ParamTable table;
  // The model made in memory (this constructor): fp32 values of every parameter in table layout, for
  // the caller to fill (random init, tests) -- the weights below point into it.  Empty for a model
  // read in place by load_inference_model.
  std::vector<float> owned;

  // A LoRA adapter applied unmerged at run time (load_inference_model's lora_dir): its spec, its whole
  // adapter table and values (fp32).  Null: none.
  struct Adapter {
    LoraSpec spec;
    ParamTable table;
    std::vector<float> values;
  };
  std::unique_ptr<Adapter> lora;

  // allocate_owned: owned is table.total() zeros and the weights point into it; otherwise the caller
  // (load_inference_model) gives the weights with set_weights.
  explicit InferenceModel(const ModelConfig& c, bool allocate_owned = true);
  InferenceModel(const InferenceModel&) = delete;
  InferenceModel& operator=(const InferenceModel&) = delete;

  // A LoRA factor (b: B, else A) adapting base tensor `target` of `layer`, or null.
  const float* lora_factor(ParamKind target, int layer, bool b) const {
    const ParamSpec* s = lora ? lora->table.find_lora(target, layer, b) : nullptr;
    return s ? lora->values.data() + s->offset : nullptr;
  }
  // A small parameter as fp32: a norm, a bias, the router [E, C] or the shared expert's gate.
  const float* vec(ParamKind kind, int layer = -1) const;
  float* vec_mut(ParamKind kind, int layer = -1);  // (tests poison values through it)
  // `count` values of a matrix parameter from element `offset` of its table storage (e.g. expert e's
  // gate rows of ffn_w13: offset e * 2IC, count IC), where they lie: in the mapped file, in the
  // file's dtype, or in `owned`.  The range must lie within one HF tensor (gate and up rows are two).
  // Not for an embedding that is read by row from its file (embedding_row).
  WeightRef mat(ParamKind kind, int layer, size_t offset, size_t count) const;
  // out[hidden] = row `token` of the embedding as fp32.  An untied embedding of a model used in place
  // is read from its file per lookup (read_stored_bytes into scratch), never mapped: a prompt looks up
  // a few hundred of its rows, and a fault would map the page-cache folios around each (most of the
  // table).  Loaded with Q8_0, the row is quantized to Q8_0 on lookup: the values a Q8_0 copy of the
  // table would hold, without holding it.  Error for a token outside the vocabulary.
  void embedding_row(float* out, size_t token, std::vector<uint8_t>& scratch) const;
  // The embedding's tensor when it is read that way, else null.
  const TensorView* embedding_in_file() const { return embedding_file_ ? &*embedding_file_ : nullptr; }
  // How the matrices are held (mixed: the most common): "F32", "BF16", "F16" or "Q8_0"; and the bytes
  // of the weights as held (the matrices in their dtype or Q8_0 with its scales, the small parameters
  // as fp32; an embedding read by row from its file as if held, in its dtype or Q8_0).
  std::string storage_name() const;
  size_t weight_bytes() const;
  // The 2 MiB pages under the matrices used in place (load_inference_model; none when held in memory).
  MappedFile::HugePages huge_pages;

  // A model used in place: where each table.hf_tensors() entry lies, what holds them (the mapped
  // files, kept open), and the small parameters as fp32 (spec i at small[small_offset[i]]).
  // quantized / scales: what Q8_0 refs point into (empty when none).  embedding: the embedding's
  // tensor in the kept files, to be read by row (its ref is then {null, its dtype}), quantized to
  // Q8_0 per row when embedding_q8.
  void set_weights(std::vector<WeightRef> refs, std::shared_ptr<const void> keep_alive, std::vector<float> small,
                   std::vector<size_t> small_offset, HugeVector<int8_t> quantized = {},
                   HugeVector<uint16_t> scales = {}, std::optional<TensorView> embedding = std::nullopt,
                   bool embedding_q8 = false);
  // Whether a parameter kind is copied to fp32 (vec) rather than used in place (mat).
  static bool is_small(ParamKind kind);

  // The weights as a Model reads them (model/weight_provider.h): vec() as f32 tensors, the matrices
  // as Store::stored views resolved through mat() (the embedding read by row: embedding_row).
  const ModelConfig& config() const override { return cfg; }
  Tensor weight(ParamKind kind, int layer) const override;
  const LoraSpec* lora_spec() const override { return lora ? &lora->spec : nullptr; }
  Tensor adapter_factor(ParamKind target, int layer, bool b) const override;

 private:
  // One matrix parameter's storage (spec `spec` of the table).
  class Source final : public WeightSource {
   public:
    Source(const InferenceModel& m, size_t spec) : m_(m), spec_(spec) {}
    Piece piece(size_t offset) const override;
    void rows(float* out, const int32_t* idx, long n, int C) const override;

   private:
    const InferenceModel& m_;
    size_t spec_;
    mutable std::vector<uint8_t> scratch_;  // rows(): an embedding row as stored (one caller at a time)
  };
  std::vector<Source> sources_;  // per spec (matrices only are used)
  // The hf_tensors() entry of spec i holding element `at` of the flat table.
  size_t ref_of(size_t i, size_t at) const;
  // Whether hf_tensors() entry i is Q8_0: quantized at load, or the embedding read by row (null data)
  // and quantized per lookup.
  bool held_q8(size_t i) const { return refs_[i].q8() || (!refs_[i].data && embedding_q8_); }
  std::vector<WeightRef> refs_;                 // per table.hf_tensors() entry
  std::vector<std::vector<size_t>> spec_refs_;  // per spec: its hf_tensors() indices, by offset
  std::shared_ptr<const void> files_;           // what refs_ point into (the mapped files), when not owned
  std::vector<float> small_;
  std::vector<size_t> small_offset_;            // per spec
  HugeVector<int8_t> q8_;                       // Q8_0 matrices (values), when quantized at load
  HugeVector<uint16_t> q8_scales_;              // and their f16 scales
  std::optional<TensorView> embedding_file_;    // the embedding, read by row (embedding_row)
  bool embedding_q8_ = false;                   // and quantized to Q8_0 on lookup
};

// Reads DIR/config.json and maps DIR's safetensors: the matrices are used where they lie, in the
// file's dtype (F32, BF16 or F16; computed in fp32), with no fp32 copy; the small parameters (norms,
// biases, router) are copied to fp32.  Every value is checked finite (Error naming the tensor).
// widen_to_fp32: instead read everything into `owned` as fp32 (tests compare the two).
// lora_dir: a PEFT LoRA adapter directory (model/lora.h) for this base ("": none), applied unmerged by
// the model's linear layers (the base's weights stay as they are).
// quant q8_0: the matrices are quantized to Q8_0 as they are read from the file in 1 MiB pieces
// (read_stored_bytes, never through the mapping), so the process holds the Q8_0 copy, not the file.
// An untied embedding is checked the same way and then read by row from the file (embedding_row),
// never held: only looked up, a few rows a prompt.
std::unique_ptr<InferenceModel> load_inference_model(const std::string& dir, const std::string& lora_dir = "",
                                                     bool widen_to_fp32 = false,
                                                     WeightQuant quant = WeightQuant::none);

// How a conversation is formatted for the model, and how that was chosen (`source`, for messages:
// "--template", "tokenizer_config.json", ...): a built-in format (tokenizer/chat_template.h), or,
// when `jinja` is set, the model's own Jinja template rendered as transformers does
// (infer/chat_format.h formats with either).
struct TemplateChoice {
  ChatTemplate tmpl = ChatTemplate::mistral;
  std::string source;
  std::shared_ptr<const jinja::Template> jinja = {};
  std::vector<std::pair<std::string, std::string>> special_tokens = {};  // what the Jinja template sees
  // What the template's strftime_now() formats (unset: the local time when rendering): a fixed date
  // makes a dated template's prompts reproducible (the tests compare them with transformers').
  std::optional<std::tm> now = {};
  std::string name() const { return jinja ? "jinja" : chat_template_name(tmpl); }
};

// The chat template of a model directory:
//   1. `explicit_name` when not empty or "auto": a built-in name, "jinja" (the directory's own
//      template, required) or a path ending in .jinja;
//   2. the template the training data was prepared with (trainer_state.json -> config.data.path ->
//      dataset.json "template", for moetron checkpoints; "jinja": the directory's own);
//   3. the directory's own Jinja template (chat_template.jinja or tokenizer_config.json's, with its
//      special tokens) when the tokenizer is byte-level BPE (`byte_level`): rendered as transformers
//      does; with a SentencePiece tokenizer it is recognised instead ("<|im_start|>" -> chatml,
//      "<<SYS>>" -> llama2, "[INST]" -> mistral), as HF's encoding of a rendered text differs there;
//   4. mistral.
TemplateChoice choose_chat_template(const std::string& model_dir, const std::string& explicit_name,
                                    bool byte_level = false);

// The end-of-sequence ids: generation_config.json's eos_token_id (a number or a list) when present,
// else config.json's, plus the tokenizer's EOS (when given).  Never empty unless nothing names one.
std::vector<int32_t> model_eos_ids(const std::string& model_dir, const ModelConfig& cfg, const Tokenizer* tok);

// Adds the chat template's stop tokens to eos_ids: chat_stop_ids of a built-in format (<|im_end|> for
// chatml); for a Jinja template, the end-of-turn markers it writes that the vocabulary holds as one
// token (<|im_end|>, <|eot_id|>, <|eom_id|>, <|return|>, <|call|>, <end_of_turn>, <|end_of_text|>).
void add_chat_stop_ids(std::vector<int32_t>& eos_ids, const TemplateChoice& tc, const Tokenizer& tok,
                       const ModelConfig& cfg);
inline void add_chat_stop_ids(std::vector<int32_t>& eos_ids, ChatTemplate tmpl, const Tokenizer& tok,
                              const ModelConfig& cfg) {
  add_chat_stop_ids(eos_ids, TemplateChoice{tmpl, "", nullptr, {}}, tok, cfg);
}

// The tokenizer for a model directory: `explicit_path` when given (Error when missing), else
// DIR/tokenizer.model, else DIR/tokenizer.json (with DIR/tokenizer_config.json for its BOS/EOS/PAD).  Null when neither exists and `required` is false; Error naming both
// otherwise.  Error when the tokenizer has more pieces than the model's vocabulary.
std::unique_ptr<Tokenizer> load_model_tokenizer(const std::string& model_dir, const std::string& explicit_path,
                                                const ModelConfig& cfg, bool required);

}  // namespace moetron
