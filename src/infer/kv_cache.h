// The key/value cache of one sequence: for every layer, the RoPE-rotated keys and the values of all
// positions fed so far, [len, NKV*HD] row-major.  Storage grows on demand (reserve() to allocate up
// front); positions are 0..len-1, and tokens() remembers what produced them, so a new prompt that
// shares a prefix with the cached sequence only needs its remaining tokens computed (multi-turn chat).
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "core/error.h"
#include "core/line_vector.h"

namespace moetron {

class KvCache {
 public:
  KvCache(int layers, int kv_dim) : kv_dim_(kv_dim), k_(layers), v_(layers) {}

  int len() const { return (int)tokens_.size(); }
  int layers() const { return (int)k_.size(); }
  int kv_dim() const { return kv_dim_; }
  const std::vector<int32_t>& tokens() const { return tokens_; }

  // Room for n positions in every layer without reallocating.
  void reserve(int n) {
    for (size_t l = 0; l < k_.size(); l++) {
      k_[l].reserve((size_t)n * kv_dim_);
      v_[l].reserve((size_t)n * kv_dim_);
    }
  }
  // Keeps the first n positions (n <= len()).
  void truncate(int n) {
    MOETRON_ASSERT(n >= 0 && n <= len());
    tokens_.resize(n);
    for (size_t l = 0; l < k_.size(); l++) {
      k_[l].resize((size_t)n * kv_dim_);
      v_[l].resize((size_t)n * kv_dim_);
    }
  }
  void clear() { truncate(0); }

  // Used by the decoder: grow every layer to len() + n rows, then commit the n tokens.
  void grow(int n) {
    const size_t rows = tokens_.size() + (size_t)n;
    for (size_t l = 0; l < k_.size(); l++) {
      if (k_[l].capacity() < rows * kv_dim_) {
        const size_t cap = std::max(rows, 2 * tokens_.size()) * kv_dim_;
        k_[l].reserve(cap);
        v_[l].reserve(cap);
      }
      k_[l].resize(rows * kv_dim_);
      v_[l].resize(rows * kv_dim_);
    }
  }
  void commit(std::span<const int32_t> tokens) { tokens_.insert(tokens_.end(), tokens.begin(), tokens.end()); }
  float* keys(int layer) { return k_[layer].data(); }
  float* values(int layer) { return v_[layer].data(); }
  const float* keys(int layer) const { return k_[layer].data(); }
  const float* values(int layer) const { return v_[layer].data(); }

  // Bytes held (capacity) by the cache.
  size_t bytes() const {
    size_t b = 0;
    for (size_t l = 0; l < k_.size(); l++) b += (k_[l].capacity() + v_[l].capacity()) * sizeof(float);
    return b;
  }

 private:
  int kv_dim_;
  std::vector<int32_t> tokens_;
  std::vector<LineVector<float>> k_, v_;  // [L][len * kv_dim], from cache lines (attention's 64-byte loads)
};

// Length of the common prefix of the cached tokens and `prompt`, capped so at least one prompt token
// remains to be computed (its logits start the generation).
inline int reusable_prefix(const KvCache& cache, std::span<const int32_t> prompt) {
  const auto& t = cache.tokens();
  size_t n = 0;
  while (n < t.size() && n < prompt.size() && t[n] == prompt[n]) n++;
  if (n == prompt.size() && n > 0) n--;
  return (int)n;
}

}  // namespace moetron
