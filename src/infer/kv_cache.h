// The key/value cache of one sequence: for every layer, the RoPE-rotated keys and the values of all
// positions fed so far, [len, NKV*HD] row-major, in a backend's memory (its act store: fp32 on the CPU,
// bf16 on CUDA).  Latent attention (DeepSeek-V3) caches instead the normed latent [len, kv_lora_rank]
// as its "keys" and the rotated shared RoPE key [len, qk_rope_head_dim] as its "values"
// (cache_widths; model/latent_attention.h expands them per pass).  Storage grows on demand, twice the rows when it must (reserve() to allocate up
// front); positions are 0..len-1, and tokens() remembers what produced them, so a new prompt that
// shares a prefix with the cached sequence only needs its remaining tokens computed (multi-turn chat).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <tuple>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"
#include "io/hf_config.h"

namespace moetron {

class KvCache {
 public:
  // `be` must outlive the cache.
  KvCache(int layers, int kv_dim, Backend& be) : KvCache(layers, kv_dim, kv_dim, be) {}
  // Keys and values of different widths (latent attention).
  KvCache(int layers, int kv_dim, int v_dim, Backend& be)
      : kv_dim_(kv_dim), v_dim_(v_dim), be_(&be), ka_(layers), va_(layers), kt_(layers), vt_(layers) {}

  int len() const { return (int)tokens_.size(); }
  int layers() const { return (int)kt_.size(); }
  int kv_dim() const { return kv_dim_; }  // the keys' width
  int v_dim() const { return v_dim_; }
  const std::vector<int32_t>& tokens() const { return tokens_; }
  Backend& backend() const { return *be_; }

  // Room for n positions in every layer without reallocating.
  void reserve(int n) { reserve_rows((size_t)n); }
  // Keeps the first n positions (n <= len()); the storage stays.
  void truncate(int n) {
    MOETRON_ASSERT(n >= 0 && n <= len());
    tokens_.resize(n);
  }
  void clear() { truncate(0); }

  // Used by the forward: room for len() + n rows (twice the rows when it must grow), then commit the n
  // tokens once their keys and values are written.
  void grow(int n) {
    const size_t rows = tokens_.size() + (size_t)n;
    if (capacity() < rows) reserve_rows(std::max(rows, 2 * tokens_.size()));
  }
  void commit(std::span<const int32_t> tokens) { tokens_.insert(tokens_.end(), tokens.begin(), tokens.end()); }
  // Every layer's [capacity, kv_dim] tensors.
  const std::vector<Tensor>& key_tensors() const { return kt_; }
  const std::vector<Tensor>& value_tensors() const { return vt_; }
  // On a host-memory backend: the layer's rows.
  const float* keys(int layer) const { return host(kt_, layer); }
  const float* values(int layer) const { return host(vt_, layer); }

  // Bytes held (capacity) by the cache.
  size_t bytes() const {
    size_t b = 0;
    for (size_t l = 0; l < kt_.size(); l++) b += kt_[l].nbytes() + vt_[l].nbytes();
    return b;
  }

 private:
  size_t capacity() const { return kt_.empty() ? 0 : kt_[0].numel / kv_dim_; }
  const float* host(const std::vector<Tensor>& t, int layer) const {
    MOETRON_ASSERT(be_->host_memory());
    return t[layer].f32();
  }
  // Storage for at least `rows` positions, keeping the cached ones.
  void reserve_rows(size_t rows) {
    if (capacity() >= rows) return;
    for (auto [t, a, width] : {std::tuple{&kt_, &ka_, (size_t)kv_dim_}, std::tuple{&vt_, &va_, (size_t)v_dim_}})
      for (size_t l = 0; l < t->size(); l++) {
        const size_t keep = tokens_.size() * width;
        std::unique_ptr<Allocation> grown =
            be_->allocate(rows * width * be_->element_bytes(be_->act_store()), "KV cache");
        const Tensor g = be_->view(grown->data(), be_->act_store(), rows * width);
        if (keep > 0) be_->copy(g.part(0, keep), (*t)[l].part(0, keep));
        (*t)[l] = g;
        (*a)[l] = std::move(grown);
      }
  }

  int kv_dim_, v_dim_;
  Backend* be_;
  std::vector<int32_t> tokens_;
  std::vector<std::unique_ptr<Allocation>> ka_, va_;  // [L] allocations
  std::vector<Tensor> kt_, vt_;                       // and their [capacity, kv_dim] views
};

// The widths a config's cache holds per position and layer: keys and values (NKV x HD each), or latent
// attention's latent and RoPE key.
inline std::pair<int, int> cache_widths(const ModelConfig& cfg) {
  if (cfg.is_mla()) return {cfg.kv_lora_rank, cfg.qk_rope_head_dim};
  return {cfg.num_key_value_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim};
}

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
