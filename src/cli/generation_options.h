// The options `moetron generate` and `moetron chat` share: sampling, seed, stop strings, threads; and
// the model they run, which serve takes too (the weight format also bench generate).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "infer/model.h"
#include "infer/runner.h"
#include "infer/sampler.h"

namespace moetron::cli {

struct GenerationOptions {
  SamplingParams sampling;
  long long seed = -1;  // < 0: a random seed
  std::vector<std::string> stop;
  int threads = 0;  // 0: all
};

// --temperature --top-k --top-p --repetition-penalty --seed --stop --threads
void add_generation_options(CLI::App& app, GenerationOptions& g);

// --quantize none|q8_0 (the weights as stored, or quantized to Q8_0 at load), for the commands that
// load an inference model; parse the value with parse_weight_quant(value, "--quantize").
void add_quantize_option(CLI::App& app, std::string& value);

// The model generate, chat and serve run: --model (required) --device --lora --quantize --tokenizer
// --template.
struct ModelOptions {
  std::string dir, device = "cpu", lora_dir, quantize = "none", tokenizer_path, template_name = "auto";
};
void add_model_options(CLI::App& app, ModelOptions& m);

// The model on its device, with its adapter, run by the model's layer body (infer/model_runner.h).
// cpu: over the weights used in place in the chosen format (load_inference_model), on the CPU
// inference backend; cuda: on the GPU (bf16 weights, the KV caches on the device).
struct LoadedModel {
  ModelConfig cfg;
  std::unique_ptr<InferenceModel> weights;  // cpu only
  std::unique_ptr<Runner> runner;
  std::string storage;  // how the weights are held, for messages: "BF16", "Q8_0", "cuda bf16", ...
};
// After parsing.  --device cuda without a usable GPU, or with --quantize other than none, is an
// InputError (exit 2) naming the reason, before anything is read.
LoadedModel load_model(const ModelOptions& m);

// After parsing: sets the seed (random when none was given), checks the sampling parameters (error
// naming the option) and applies the thread count to OpenMP and BLAS.
void apply_generation_options(GenerationOptions& g);

}  // namespace moetron::cli
