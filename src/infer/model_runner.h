// The model's own layer body as a Runner (infer/runner.h): Model::infer -- the blocks training runs --
// over KV caches in a backend's memory, on the CPU or a GPU.  The weights are read from an HF model
// directory into the backend (fp32 masters; on CUDA with their bf16 GEMM copy), an optional PEFT LoRA
// adapter applied unmerged.  Prompts run in passes of at most prefill_chunk rows.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "infer/runner.h"
#include "model/model.h"

namespace moetron {

class ModelRunner final : public Runner {
 public:
  // Reads model_dir (config.json, safetensors; every tensor checked against the config before the
  // model is allocated) and lora_dir ("": none) onto `backend`.
  ModelRunner(std::unique_ptr<Backend> backend, const std::string& model_dir, const std::string& lora_dir = "",
              int prefill_chunk = 256);
  // A model made by the caller (tests): both must outlive the runner.
  explicit ModelRunner(Model& model, int prefill_chunk = 256);

  const ModelConfig& config() const override { return model_->config(); }
  KvCache new_cache() const override;
  void forward(KvCache& cache, std::span<const int32_t> tokens, float* logits, bool all_logits = false) override;
  void forward_batch(std::span<KvCache* const> caches, std::span<const int32_t> tokens, float* logits) override;
  void prefill_rows(std::span<KvCache* const> caches, std::span<const std::span<const int32_t>> tokens,
                    float* logits) override;

  Model& model() { return *model_; }

 private:
  // One pass: pieces of sequences (cache, its first token, count) in row order; logits of each
  // piece's last row when `last_rows`, else of every row.
  struct Piece {
    KvCache* cache;
    const int32_t* tokens;
    int count;
  };
  void pass(const std::vector<Piece>& pieces, bool last_rows, float* logits);
  void check_cache(const KvCache& c, const char* op, size_t index) const;
  void check_tokens(std::span<const int32_t> tokens, const char* op, size_t seq) const;

  std::unique_ptr<Backend> own_backend_;
  std::unique_ptr<Model> own_model_;
  Model* model_;
  int chunk_;
  int kv_dim_;
};

}  // namespace moetron
