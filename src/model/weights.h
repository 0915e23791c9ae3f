// Moving parameters between the flat parameter table and Hugging Face tensor files.
// Reading accepts the Hub names (`block_sparse_moe.experts.e.w1.weight`, ...) and the
// transformers-5 in-memory packing (`mlp.gate.weight`, `mlp.experts.gate_up_proj` [E,2I,C] with the
// gate rows first, `mlp.experts.down_proj` [E,C,I] -- exactly moetron's stacked storage) for MoE
// models; writing always uses the Hub names.
#pragma once

#include <string>
#include <vector>

#include "core/dtype.h"
#include "io/safetensors.h"
#include "model/params.h"

namespace moetron {

class ModelTensors;

// Fills params (table.total() floats) from the model directory's tensors (any float dtype).
// Every parameter must be present with the right shape; a tensor the table does not know is an
// Error too (it means the config and the weights disagree).  `source` names the directory.
void load_hf_weights(const ModelTensors& files, const ParamTable& table, float* params, const std::string& source);

// Everything load_hf_weights checks, from the tensor headers alone: every parameter present with
// the shape config.json implies, no tensor the model lacks.  Call it before allocating what
// config.json asks for (a config of vocab_size 2^22 beside a 300 KB file is refused at once, not
// after gigabytes are allocated).  DeepSeek-V3's and GLM-4.5's multi-token-prediction layers
// (`model.layers.L.*` .. for the config's num_nextn_predict_layers past num_hidden_layers) are not
// part of the model and are skipped, as transformers skips them: returns how many tensors were.
size_t check_weights_size(const ModelTensors& files, const ParamTable& table, const std::string& source);
// The note a loader logs for them ("" when none).
std::string mtp_note(size_t ignored, const ParamTable& table, const std::string& source);

// Which part of the model one process of a parallel layout holds (DESIGN §6). The default is the
// whole model.
struct WeightShard {
  int layer_begin = 0, layer_end = -1;    // pipeline stage: decoder layers [begin, end); -1: to the last.
                                          // The first stage holds the embedding, the last the final
                                          // norm and the head.
  int expert_begin = 0, expert_end = -1;  // expert parallel: experts [begin, end) of every MoE layer
  int tp_rank = 0, tp_size = 1;           // tensor parallel (Megatron): q/k/v, w1/w3 split by rows
                                          // (heads / FFN width), o and w2 by columns, embedding and
                                          // head by vocabulary rows; norms and router whole
};

// One HF tensor, or the part of it a shard holds: dimension `dim` restricted to [begin, end)
// (dim == -1: the whole tensor).
struct HfTensorSlice {
  const HfTensorRef* ref = nullptr;  // the whole tensor: Hub name, shape, place in the full table
  int dim = -1;
  int64_t begin = 0, end = 0;
  std::vector<int64_t> shape() const;  // of the slice
  size_t numel() const;
};

// The HF tensors (or parts of them) `shard` holds, in table order. Throws Error naming the field
// when the layout does not fit the model: a layer or expert range outside it, tp_rank outside
// [0, tp_size), attention heads, FFN width or kv heads (NKV % tp, or tp % NKV when the kv heads are
// replicated) not divisible.
std::vector<HfTensorSlice> shard_slices(const ModelConfig& cfg, const ParamTable& table, const WeightShard& shard);

// Reads one slice as fp32 into out[slice.numel()] from its Hub-named tensor or, for MoE tensors,
// from the transformers-5 packed tensor that holds it. Returns the name of the tensor read. Throws
// Error (naming `source`) when neither exists or the shape differs from what config.json implies.
std::string read_hf_slice(const ModelTensors& files, const ParamTable& table, const HfTensorSlice& slice,
                          float* out, const std::string& source);

// Where the values of one HF tensor lie in the files, without reading them: its Hub-named tensor, or
// its part of a transformers-5 packed one (expert e's gate or up rows of gate_up_proj, ...).  The view
// has the ref's name and shape, the file's dtype and a pointer into the mapping.  Error (naming
// `source`) as read_hf_slice when neither exists or a shape differs from what config.json implies.
TensorView hf_tensor_view(const ModelTensors& files, const ParamTable& table, const HfTensorRef& ref,
                          const std::string& source);

// Adds every HF tensor of `values` (params or grads, laid out by `table`) to a writer under the
// Hub names, with `prefix` prepended (e.g. "grad.").  The writer references `values`.
void add_hf_tensors(SafetensorsWriter& writer, const ParamTable& table, const float* values, DType storage,
                    const std::string& prefix = "");

// Writes a randomly initialised model (init_parameters with `seed`) as an HF directory: DIR/config.json
// and DIR's safetensors in `storage` (for benchmarks and tests).  DIR is created; the caller checks it
// holds nothing of the user's.  Returns the parameter count.
size_t write_random_model(const std::string& dir, const ModelConfig& cfg, uint64_t seed, DType storage);

}  // namespace moetron
