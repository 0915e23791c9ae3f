// Training checkpoints: a Hugging Face model directory plus optimizer and trainer state (DESIGN §1.4, §7),
// written atomically, verified when read, independent of the parallel layout.
//
// On disk, byte by byte:
//
//   RUN/checkpoints/
//     latest                          the directory name of the newest complete checkpoint and "\n",
//                                     e.g. the 12 bytes "step-000100\n"; replaced atomically (latest.tmp-PID,
//                                     fsync, rename, fsync of RUN/checkpoints)
//     step-000100/                    one checkpoint: "step-" and the step, zero-padded to at least 6 digits
//       config.json                   model_config_to_json() with "torch_dtype" = the model files' dtype
//                                     ("float32" | "bfloat16" | "float16"), "architectures": [NAME]
//       generation_config.json        {"_from_model_config": true, "bos_token_id": B, "eos_token_id": E
//                                     (a list when the config names several), "pad_token_id": P (when set)}
//       (LoRA runs: adapter_config.json + adapter_model.safetensors, PEFT's adapter (model/lora.h), instead
//       of the model files; optimizer/ is keyed by the adapter table's internal names)
//       model.safetensors             the model under the Hub names (params/ParamTable::hf_tensors() order),
//         or model-0000K-of-0000N.safetensors + model.safetensors.index.json, exactly as
//         write_model_safetensors() (io/model_files.h) writes them: shards of at most max_shard_bytes,
//         every file with metadata {"format": "pt"}, the index {"metadata": {"total_size": BYTES},
//         "weight_map": {NAME: FILE}}
//       tokenizer.model, tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja
//                                     byte copies of those present in SaveOptions::tokenizer_source_dir
//       optimizer/                    only when AdamW moments are saved:
//         optimizer.safetensors       for every HF tensor NAME (hf_tensors() order) three F32 tensors of
//                                     NAME's shape: NAME.master (fp32 master weights), NAME.exp_avg,
//                                     NAME.exp_avg_sq -- whole tensors, so any layout can resume
//         or optimizer-0000K-of-0000N.safetensors + optimizer.safetensors.index.json, sharded by the
//         same rule and limit as the model (see write_sharded_safetensors)
//       trainer_state.json            written last; a JSON object (dump(2) + "\n"):
//                                       the caller's trainer_state keys (step, consumed_samples, ...), and
//                                       "format": "moetron-checkpoint", "format_version": 1,
//                                       "optimizer_steps": N,
//                                       "files": {REL_PATH: {"size": BYTES, "xxh64": HEX16}, ...} for every
//                                                other file in the directory (REL_PATH like
//                                                "optimizer/optimizer.safetensors"),
//                                       "trainer_state_xxh64": HEX16 of dump() (compact, keys sorted) of
//                                                this object without that key
//     .tmp-step-000100-PID/           a save in progress (or one that crashed); never read
//     .trash-step-000090-PID/         a pruned checkpoint being deleted; never read
//
// HEX16 is XXH64 (seed 0) as 16 lowercase hex digits, most significant first: what `xxhsum -H64 FILE`
// prints. (SHA-256 would read ~0.2 GB/s here; XXH64 is memory-speed and detects accidental corruption.)
//
// A checkpoint directory is complete when its trainer_state.json parses, matches its own checksum and
// every file it lists exists with the listed size (checking all checksums is load_checkpoint's job).
// A save writes everything into .tmp-step-S-PID/, fsyncs every file and directory, renames it to
// step-S/ (replacing an existing step-S/ atomically when the filesystem supports RENAME_EXCHANGE),
// fsyncs RUN/checkpoints, then replaces `latest`, then prunes. A crash at any point therefore leaves
// `latest` naming a complete checkpoint (or absent, before the first save completes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "io/hf_config.h"
#include "io/model_files.h"
#include "io/safetensors.h"
#include "model/lora.h"
#include "model/params.h"

namespace moetron {

// What the trainer hands over (save) -- all arrays laid out by `table`, table->total() floats each.
struct CheckpointContents {
  const ModelConfig* model_config = nullptr;
  // The whole model's table, or for a LoRA run the whole adapter table (table->is_lora()): the
  // model files are then the PEFT adapter (adapter_config.json + adapter_model.safetensors,
  // model/lora.h) of `lora` over the base `base_model`, and optimizer/ holds the adapters' state.
  const ParamTable* table = nullptr;
  const LoraSpec* lora = nullptr;
  std::string base_model;
  const float* params = nullptr;      // fp32 master weights
  const float* exp_avg = nullptr;     // AdamW moments; both null for a model without optimizer state
  const float* exp_avg_sq = nullptr;
  long optimizer_steps = 0;
  nlohmann::json trainer_state = nlohmann::json::object();  // step, consumed_samples, loader_state, rng, ...
};

struct SaveOptions {
  DType model_dtype = DType::F32;  // F32, BF16 or F16 for the model files; optimizer/ is always F32
  size_t max_shard_bytes = kDefaultMaxShardBytes;  // 0: no limit
  std::string tokenizer_source_dir;                // "" or a directory to copy tokenizer files from
  std::string tokenizer_model_file;                // "" or a file copied as tokenizer.model (or, for
                                                   // a tokenizer.json, as tokenizer.json with its
                                                   // tokenizer_config.json) when tokenizer_source_dir
                                                   // has none (the data's tokenizer)
  int keep_last = 3;                               // complete checkpoints kept; <= 0 keeps all
  // Test hook: called after each stage of the save with what was just done -- a file name relative to
  // the checkpoint ("config.json", "model" for all model files, "optimizer/optimizer.safetensors", ...,
  // "trainer_state.json"), then "renamed", "latest", "pruned".
  std::function<void(const std::string&)> on_progress;
};

// Saves RUN_DIR/checkpoints/step-%06ld/ as described above; returns its path.
std::string save_checkpoint(const std::string& run_dir, long step, const CheckpointContents& contents,
                            const SaveOptions& options);

// The checkpoint `RUN_DIR/checkpoints/latest` names, as a path; "" when there is no checkpoint. Error when
// `latest` names a missing or incomplete directory. When `latest` is absent (a crash between the rename
// of the first checkpoint and the write of `latest`), the complete step-* directory with the highest
// step is returned, if any.
std::string find_latest_checkpoint(const std::string& run_dir);

struct LoadedCheckpoint {
  nlohmann::json trainer_state;  // as given to save_checkpoint (the reserved keys removed)
  long optimizer_steps = 0;
};

// Loads checkpoint directory `dir`: verifies every listed file's size and checksum (Error naming the
// file), refuses a config.json whose architecture differs from `expected` (see check_same_architecture),
// fills params (from optimizer/ NAME.master when present -- exact fp32 --, else from the model files,
// or for an adapter table from the PEFT adapter, whose rank and targets must be the table's)
// and, when exp_avg/exp_avg_sq are non-null, the moments (Error when the checkpoint has none).
LoadedCheckpoint load_checkpoint(const std::string& dir, const ModelConfig& expected, const ParamTable& table,
                                 float* params, float* exp_avg, float* exp_avg_sq);

// Error "SOURCE: ... FIELD: checkpoint A, expected B; ..." listing every field that changes the
// parameters or the function they compute: architectures, model_type, vocab_size, hidden_size,
// intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
// num_local_experts, num_experts_per_tok, rms_norm_eps, rope_theta, sliding_window,
// tie_word_embeddings, hidden_act. Training knobs (router_aux_loss_coef, initializer_range), token ids,
// max_position_embeddings and torch_dtype may differ.
void check_same_architecture(const ModelConfig& checkpoint, const ModelConfig& expected, const std::string& source);

// ---- pieces shared with `moetron convert` ----------------------------------------------------------

// What validate_trainer_state checks: the checkpoint format (any), or also what training resumes from.
enum class TrainerStateUse { any, resume };
// The largest counter a trainer state may hold (step, optimizer_steps, consumed_*): 2^53.
constexpr uint64_t kMaxStateCount = uint64_t{1} << 53;

// Checks a parsed trainer_state.json (its own checksum is read_trainer_state's job, so a resealed file
// lands here too); `source` names it in errors: "SOURCE: field 'NAME' ...".  Always: "format",
// "format_version", "optimizer_steps" (an integer in [0, 2^53]) and the "files" manifest -- a
// non-empty object that lists config.json and model.safetensors or model.safetensors.index.json,
// whose names are plain file names of the directory or optimizer/NAME (nothing absolute, no "..",
// ".", empty component or control character) and whose entries are {"size": BYTES, "xxh64": 16
// lowercase hex digits} (a LoRA checkpoint lists adapter_config.json and adapter_model.safetensors in
// place of the model weights).  With TrainerStateUse::resume also the trainer's keys: "step",
// "consumed_samples", "consumed_tokens" (integers in [0, 2^53]) and "loader_state" (what
// data/loader.h's LoaderState reads).  Pure: no file is touched (so it can be fuzzed).
void validate_trainer_state(const nlohmann::json& state, const std::string& source,
                            TrainerStateUse use = TrainerStateUse::any);

// Reads DIR/trainer_state.json, checks its own checksum and validate_trainer_state(any); Error naming
// the file.
nlohmann::json read_trainer_state(const std::string& dir);
// True when `dir` is a complete checkpoint (see above); *why (when given) says what is missing otherwise.
bool is_complete_checkpoint(const std::string& dir, std::string* why = nullptr);
// Checks the size and checksum of every file state["files"] lists (in parallel), and that it lists
// every file in `dir` but trainer_state.json; Error naming the first bad file.
void verify_checkpoint_files(const std::string& dir, const nlohmann::json& state);
// Writes DIR/trainer_state.json (fsynced) from `state` plus the format keys, "files" for every other
// file under DIR and the self checksum. Returns the object written.
nlohmann::json write_trainer_state(const std::string& dir, nlohmann::json state);

// One tensor for write_sharded_safetensors: either fp32 values stored as `dtype` (f32 != null; converted
// while writing, nothing copied), or raw bytes of `dtype` from `bytes`, called just before the tensor's
// shard is written; the pointer it returns must stay valid until that shard is written (`scratch` is a
// buffer the writer frees afterwards).
struct ShardTensor {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const float* f32 = nullptr;
  std::function<const void*(std::vector<uint8_t>& scratch)> bytes;
};
// Writes STEM.safetensors, or STEM-0000K-of-0000N.safetensors + STEM.safetensors.index.json, into
// DIR with transformers' greedy rule (tensors in the given order; a new shard starts when the next
// tensor would push the current one past max_shard_bytes; 0 = no limit), metadata {"format": "pt"}.
// Memory: one shard's `bytes` buffers at a time. Calls after_file(FILE) after each file. Returns the
// file names written.
std::vector<std::string> write_sharded_safetensors(const std::string& dir, const std::string& stem,
                                                   const std::vector<ShardTensor>& tensors, size_t max_shard_bytes,
                                                   const std::function<void(const std::string&)>& after_file = {});

// The tensors of DIR/STEM.safetensors or of the shards DIR/STEM.safetensors.index.json names.
class ShardedSafetensors {
 public:
  static bool exists(const std::string& dir, const std::string& stem);
  static ShardedSafetensors open(const std::string& dir, const std::string& stem);
  const TensorView* find(const std::string& name) const;  // null when absent
  std::vector<std::string> names() const;                 // sorted

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorView*> tensors_;
};

// Writes `text` to PATH.tmp-PID, fsyncs, renames it to PATH and fsyncs the directory.
void write_file_atomic(const std::string& path, const std::string& text);
// fsync of a directory (its entries); Error naming it.
void fsync_directory(const std::string& dir);

}  // namespace moetron
