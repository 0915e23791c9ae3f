// What the CLI's `--device cuda` paths call (src/cli/forward.cpp, src/cli/bench.cpp).  Host code;
// built without CUDA these fail with "built without CUDA".
#pragma once

#include <vector>

#include "io/hf_config.h"
#include "model/mixtral.h"

namespace moetron::gpu {

struct ForwardResult {
  Losses losses;
  std::vector<float> logits;  // [B,T,V]
  std::vector<float> grads;   // ParamTable layout; empty unless asked for
};

// One forward (and, with want_grads, backward) pass of CudaMixtralModel with the given parameters
// (ParamTable layout, host memory).
ForwardResult forward_pass(const ModelConfig& cfg, const std::vector<float>& params, const Batch& batch,
                           const LossWeights& weights, bool want_grads);

struct BenchTrainOptions {
  int seq = 4096;
  int micro_batch = 1;
  int grad_accum = 1;     // micro-batches per optimizer step
  int steps = 5;          // timed steps
  int warmup = 1;         // untimed steps first
  double peak_tflops = 989.0;  // dense bf16 peak the MFU is measured against (H100/H200 SXM)
  bool json = false;
  bool profile = false;
};

// `moetron bench train --device cuda`: training steps (forward, backward, grad-norm clip, AdamW)
// on random tokens; prints tokens/s and MFU.  Returns the exit code.
int bench_train(const ModelConfig& cfg, const BenchTrainOptions& options);

}  // namespace moetron::gpu
