// What generation, chat, serve and perplexity run: a model's forward over per-sequence KV caches
// (infer/kv_cache.h), prefill and decode, one sequence or a batch of them.  The implementation is
// ModelRunner (infer/model_runner.h): the model's own layer body (Model::infer) on a backend -- over
// the weights used in place on the CPU inference backend, or on a GPU.
#pragma once

#include <cstdint>
#include <span>

#include "infer/kv_cache.h"
#include "io/hf_config.h"

namespace moetron {

class Runner {
 public:
  virtual ~Runner() = default;
  virtual const ModelConfig& config() const = 0;
  int vocab_size() const { return config().vocab_size; }
  // An empty cache for one sequence, in the runner's memory.
  virtual KvCache new_cache() const = 0;

  // Feeds `tokens` at positions cache.len(), cache.len()+1, ...; appends their keys and values to the
  // cache and writes logits: [tokens.size(), V] when all_logits, else [V] for the last token only.
  // Error for an empty span or a token outside the vocabulary (the cache is then unchanged).
  virtual void forward(KvCache& cache, std::span<const int32_t> tokens, float* logits, bool all_logits = false) = 0;

  // One decoding step of several sequences at once (continuous batching): tokens[i] is fed to
  // *caches[i] at its next position; logits [n, V].  Row i's logits and cache are what forward(*caches[i],
  // {tokens[i]}) gives alone: bitwise on the CPU inference backend (per-row kernels), to rounding on
  // backends whose GEMMs see the batch's shape.  Error (nothing changed) for a count mismatch, a token outside
  // the vocabulary, a cache of another runner or one cache given twice.
  virtual void forward_batch(std::span<KvCache* const> caches, std::span<const int32_t> tokens, float* logits) = 0;

  // Feeds several sequences' tokens in one pass: tokens[s] into *caches[s] at its next positions;
  // logits [caches.size(), V]: each sequence's last token's, what feeding its tokens one at a time
  // gives.  Error as forward_batch (nothing changed).
  virtual void prefill_rows(std::span<KvCache* const> caches, std::span<const std::span<const int32_t>> tokens,
                            float* logits) = 0;
};

}  // namespace moetron
