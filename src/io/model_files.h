// The tensors of a Hugging Face model directory, single-file or sharded.
//
//   DIR/model.safetensors                       one file, or
//   DIR/model.safetensors.index.json            {"metadata": {"total_size": BYTES},
//                                                "weight_map": {"tensor.name": "FILE", ...}}
//   DIR/model-0000K-of-0000N.safetensors        the shards it names
// When both exist, model.safetensors wins (as in transformers).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "io/safetensors.h"

namespace moetron {

class ModelTensors {
 public:
  // Opens DIR's safetensors (each shard once). Throws Error when neither file exists (naming a
  // pytorch_model.bin pickle checkpoint if there is one), when the index is malformed, names a
  // missing shard, or lists a tensor its shard does not contain.
  static ModelTensors open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  // Null when absent.
  const TensorView* find(const std::string& name) const;
  // Throws Error "DIR: tensor 'NAME' not found" when absent.
  const TensorView& get(const std::string& name) const;
  // All tensor names, sorted. For a sharded model: the index's weight_map keys.
  std::vector<std::string> names() const;
  size_t num_files() const { return files_.size(); }
  const SafetensorsFile& file(size_t i) const { return *files_.at(i); }

 private:
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;  // stable addresses for the views
  std::map<std::string, const TensorView*> tensors_;
};

// One tensor to save: fp32 values stored on disk as `storage` (F32, F16 or BF16).
struct ModelTensorToWrite {
  std::string name;
  DType storage = DType::F32;
  std::vector<int64_t> shape;
  const float* data = nullptr;
};

// transformers' default max_shard_size ("5GB").
constexpr size_t kDefaultMaxShardBytes = 5'000'000'000;

// Writes the tensors into DIR (created if missing) the way transformers' save_pretrained does:
// tensors are packed into shards in the given order, a new shard starting when the next tensor
// would push the current one past max_shard_bytes (a larger tensor gets a shard of its own;
// max_shard_bytes == 0 means no limit). One shard -> DIR/model.safetensors; several ->
// DIR/model-0000K-of-0000N.safetensors plus DIR/model.safetensors.index.json. Each file carries
// metadata {"format": "pt"} (transformers refuses safetensors metadata without it). Each file is
// written atomically, the index last; stale model.safetensors / index / model-*-of-*.safetensors
// files from an earlier save are removed afterwards.
void write_model_safetensors(const std::string& dir, const std::vector<ModelTensorToWrite>& tensors,
                             size_t max_shard_bytes = kDefaultMaxShardBytes);

}  // namespace moetron
