// The model-shape options of `moetron bench train` and `moetron bench generate`: a random Mixtral of
// the given shape (a dense Mistral with --experts 0).
#pragma once

#include <cstdint>
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

// Bounds of the bench commands' sizes: positions per sequence, sequences decoded together, and the
// parameters of a random model (2^30: 4 GiB in fp32; a larger model is read with --model).
constexpr int kMaxBenchPositions = 1 << 20;
constexpr int kMaxBenchBatch = 1024;
constexpr int64_t kMaxBenchRandomParams = int64_t{1} << 30;

// Error naming the shape flags when the random model of `cfg` holds more than kMaxBenchRandomParams
// (it lives in this machine's memory).  device_bytes > 0: the model lives on a device of that many
// bytes instead (bench train --device cuda), which must hold bytes_per_param for every parameter.
void check_bench_model_size(const ModelConfig& cfg, int64_t device_bytes = 0, double bytes_per_param = 0);
// Error unless prompt + new tokens fit the model's max_position_embeddings and `sequences` KV caches
// of that length fit in half of this machine's memory.
void check_bench_positions(const ModelConfig& cfg, int prompt_tokens, int new_tokens, int sequences);

// "MixtralForCausalLM hidden 512, 4 layers, 8 heads (2 kv), experts 8 top-2, intermediate 1408, vocab 32000"
std::string describe_model_shape(const ModelConfig& cfg);

}  // namespace moetron::cli
