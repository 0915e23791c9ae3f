// The model's own layer body as a Runner (infer/runner.h): Model::infer -- the blocks training runs --
// over KV caches in a backend's memory, on the CPU or a GPU.  The weights are read from an HF model
// directory into the backend (fp32 masters; on CUDA with their bf16 GEMM copy), an optional PEFT LoRA
// adapter applied unmerged.  Prompts run in passes of at most prefill_chunk rows.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu_infer.h"
#include "infer/runner.h"
#include "model/model.h"

namespace moetron {

class ModelRunner : public Runner {
 public:
  // Reads model_dir (config.json, safetensors; every tensor checked against the config before the
  // model is allocated) and lora_dir ("": none) onto `backend`.
  ModelRunner(std::unique_ptr<Backend> backend, const std::string& model_dir, const std::string& lora_dir = "",
              int prefill_chunk = 256);
  // A model made by the caller (tests): both must outlive the runner.
  explicit ModelRunner(Model& model, int prefill_chunk = 256);
  // On the CPU over weights used where they lie (infer/model.h InferenceModel: bf16/f16/f32 as stored,
  // or Q8_0), which must outlive the runner: the CPU inference backend (backend/cpu_infer.h), the KV
  // caches in host memory.  row_attention_max_pairs: CpuInferenceBackend's (-1: its default).
  explicit ModelRunner(const WeightProvider& weights, int prefill_chunk = 256, long row_attention_max_pairs = -1);

  const ModelConfig& config() const override { return model_->config(); }
  KvCache new_cache() const override;
  void forward(KvCache& cache, std::span<const int32_t> tokens, float* logits, bool all_logits = false) override;
  void forward_batch(std::span<KvCache* const> caches, std::span<const int32_t> tokens, float* logits) override;
  void prefill_rows(std::span<KvCache* const> caches, std::span<const std::span<const int32_t>> tokens,
                    float* logits) override;

  Model& model() { return *model_; }
  // The CPU inference backend's bytes of weights read by decode passes, and its split tuner (null on
  // another backend); set_profile times the blocks' sections of every pass into *profile (null: off).
  size_t weights_read() const { return infer_be_ ? infer_be_->weights_read() : 0; }
  const DecodeSplitTuner* tuner() const { return infer_be_ ? &infer_be_->tuner() : nullptr; }
  void set_profile(Profile* profile);

 private:
  // One pass: pieces of sequences (cache, its first token, count) in row order; the logits of every
  // row, of each piece's last row, or none.
  struct Piece {
    KvCache* cache;
    const int32_t* tokens;
    int count;
  };
  enum class Logits { all, last, none };
  void pass(std::span<const Piece> pieces, Logits which, float* logits);
  void check_cache(const KvCache& c, const char* op, size_t index) const;
  void check_tokens(std::span<const int32_t> tokens, const char* op, size_t seq) const;

  std::unique_ptr<Backend> own_backend_;
  CpuInferenceBackend* infer_be_ = nullptr;  // own_backend_, when it is the CPU inference backend
  std::unique_ptr<Model> own_model_;
  Model* model_;
  int chunk_;
  int kv_dim_ = 0, v_dim_ = 0;
  // A pass's sequences, tokens and logit rows (kept: decode steps allocate nothing).
  std::vector<Model::InferSequence> seqs_;
  std::vector<int32_t> tokens_;
  std::vector<int> rows_;
  std::vector<Piece> pieces_;
};

}  // namespace moetron
