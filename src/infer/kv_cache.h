// The key/value cache of one sequence: for every layer, the RoPE-rotated keys and the values of all
// positions fed so far, [len, NKV*HD] row-major -- host floats, or tensors in a backend's memory.  Storage grows on demand (reserve() to allocate up
// front); positions are 0..len-1, and tokens() remembers what produced them, so a new prompt that
// shares a prefix with the cached sequence only needs its remaining tokens computed (multi-turn chat).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"
#include "core/line_vector.h"

namespace moetron {

class KvCache {
 public:
  // Host floats.
  KvCache(int layers, int kv_dim) : kv_dim_(kv_dim), k_(layers), v_(layers) {}
  // Backend memory in its act store (the model's inference over a backend: Model::infer), which must
  // outlive the cache: per layer one tensor of keys and one of values, [capacity, kv_dim].
  KvCache(int layers, int kv_dim, Backend& be) : kv_dim_(kv_dim), be_(&be), ka_(layers), va_(layers), kt_(layers), vt_(layers) {}

  int len() const { return (int)tokens_.size(); }
  int layers() const { return be_ ? (int)kt_.size() : (int)k_.size(); }
  int kv_dim() const { return kv_dim_; }
  const std::vector<int32_t>& tokens() const { return tokens_; }
  // The backend holding the cache (null: host floats).
  Backend* backend() const { return be_; }

  // Room for n positions in every layer without reallocating.
  void reserve(int n) {
    if (be_) return reserve_backend((size_t)n);
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

  // Used by the forward: grow every layer to len() + n rows, then commit the n tokens.
  void grow(int n) {
    const size_t rows = tokens_.size() + (size_t)n;
    if (be_) {  // twice the rows when it must grow, as a vector would
      if (kt_.empty() || kt_[0].numel < rows * kv_dim_) reserve_backend(std::max(rows, 2 * tokens_.size()));
      return;
    }
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
  // Host memory only (host floats, or a host backend's tensors): the layer's rows.
  float* keys(int layer) { return be_ ? host_tensor(kt_, layer) : host_layer(k_, layer).data(); }
  float* values(int layer) { return be_ ? host_tensor(vt_, layer) : host_layer(v_, layer).data(); }
  const float* keys(int layer) const { return be_ ? host_tensor(kt_, layer) : host_layer(k_, layer).data(); }
  const float* values(int layer) const { return be_ ? host_tensor(vt_, layer) : host_layer(v_, layer).data(); }
  // Backend storage only: every layer's [capacity, kv_dim] tensors.
  const std::vector<Tensor>& key_tensors() const { return kt_; }
  const std::vector<Tensor>& value_tensors() const { return vt_; }

  // Bytes held (capacity) by the cache.
  size_t bytes() const {
    size_t b = 0;
    for (size_t l = 0; l < k_.size(); l++) b += (k_[l].capacity() + v_[l].capacity()) * sizeof(float);
    for (size_t l = 0; l < kt_.size(); l++) b += kt_[l].nbytes() + vt_[l].nbytes();
    return b;
  }

 private:
  template <class V>
  V& host_layer(std::vector<V>& v, int layer) const {
    MOETRON_ASSERT(be_ == nullptr);
    return v[layer];
  }
  template <class V>
  const V& host_layer(const std::vector<V>& v, int layer) const {
    MOETRON_ASSERT(be_ == nullptr);
    return v[layer];
  }
  float* host_tensor(const std::vector<Tensor>& t, int layer) const {
    MOETRON_ASSERT(be_->host_memory());
    return t[layer].f32();
  }
  // Backend storage for at least `rows` positions, keeping the cached ones.
  void reserve_backend(size_t rows) {
    if (!kt_.empty() && kt_[0].numel >= rows * kv_dim_) return;
    const size_t keep = tokens_.size() * kv_dim_;
    for (auto [t, a] : {std::pair{&kt_, &ka_}, std::pair{&vt_, &va_}})
      for (size_t l = 0; l < t->size(); l++) {
        std::unique_ptr<Allocation> grown = be_->allocate(rows * kv_dim_ * be_->element_bytes(be_->act_store()), "KV cache");
        const Tensor g = be_->view(grown->data(), be_->act_store(), rows * kv_dim_);
        if (keep > 0) be_->copy(g.part(0, keep), (*t)[l].part(0, keep));
        (*t)[l] = g;
        (*a)[l] = std::move(grown);
      }
  }

  int kv_dim_;
  Backend* be_ = nullptr;
  std::vector<int32_t> tokens_;
  std::vector<LineVector<float>> k_, v_;  // host: [L][len * kv_dim], from cache lines (attention's 64-byte loads)
  std::vector<std::unique_ptr<Allocation>> ka_, va_;  // backend: [L] allocations
  std::vector<Tensor> kt_, vt_;                       // and their [capacity, kv_dim] views
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
