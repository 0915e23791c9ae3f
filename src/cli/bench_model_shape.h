// The model-shape options of `moetron bench train` and `moetron bench generate`: a random Mixtral of
// the given shape (a dense Mistral with --experts 0).
#pragma once

#include <string>

#include <CLI/CLI.hpp>

#include "io/hf_config.h"

namespace moetron::cli {

struct BenchModelShape {
  int hidden = 512, layers = 4, heads = 8, kv_heads = 2, experts = 8, top_k = 2, intermediate = 1408,
      vocab = 32000;
};

// --hidden --layers --heads --kv-heads --experts --top-k --intermediate --vocab
void add_model_shape_options(CLI::App& app, BenchModelShape& shape);

// The HF config of that shape (error naming `where` when the numbers do not make a model).
ModelConfig bench_model_config(const BenchModelShape& shape, const std::string& where);

// "MixtralForCausalLM hidden 512, 4 layers, 8 heads (2 kv), experts 8 top-2, intermediate 1408, vocab 32000"
std::string describe_model_shape(const ModelConfig& cfg);

}  // namespace moetron::cli
