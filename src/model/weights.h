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

// Adds every HF tensor of `values` (params or grads, laid out by `table`) to a writer under the
// Hub names, with `prefix` prepended (e.g. "grad.").  The writer references `values`.
void add_hf_tensors(SafetensorsWriter& writer, const ParamTable& table, const float* values, DType storage,
                    const std::string& prefix = "");

}  // namespace moetron
