// The options `moetron generate` and `moetron chat` share: sampling, seed, stop strings, threads (and
// the weight format, which serve and bench generate take too).
#pragma once

#include <string>
#include <vector>

#include <CLI/CLI.hpp>

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

// After parsing: sets the seed (random when none was given), checks the sampling parameters (error
// naming the option) and applies the thread count to OpenMP and BLAS.
void apply_generation_options(GenerationOptions& g);

}  // namespace moetron::cli
