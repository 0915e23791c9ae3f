// Perplexity of a token sequence under a model (as llama.cpp's llama-perplexity): the text is cut into
// windows of `ctx` tokens, each scored from a fresh KV cache, every token after a window's first one
// predicted from those before it in the window.  perplexity = exp(sum of -log p / tokens scored).
#pragma once

#include <cstdint>
#include <span>

#include "infer/runner.h"

namespace moetron {

struct PerplexityOptions {
  int ctx = 512;   // tokens per window (at least 2)
  int step = 64;   // tokens per forward call: prefill in pieces of `step` rows; 1 scores with the
                   // decoding kernels (one token at a time), as generation computes
};

struct PerplexityResult {
  double nll = 0;   // sum of -log p(token | the window before it), natural log
  long scored = 0;  // tokens scored
  int windows = 0;
  double perplexity() const;
};

// Error when fewer than 2 tokens, ctx < 2, step < 1, ctx beyond the model's positions, a token
// outside the vocabulary, or more than 256 MiB of logits per forward (step x vocabulary).
PerplexityResult perplexity(Runner& dec, std::span<const int32_t> tokens, const PerplexityOptions& o);

}  // namespace moetron
