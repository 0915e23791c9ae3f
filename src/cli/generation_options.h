// The options `moetron generate` and `moetron chat` share: sampling, seed, stop strings, threads.
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

// After parsing: sets the seed (random when none was given), checks the sampling parameters (error
// naming the option) and applies the thread count to OpenMP and BLAS.
void apply_generation_options(GenerationOptions& g);

}  // namespace moetron::cli
