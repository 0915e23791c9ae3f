// The model's layer body as a Runner; see model_runner.h.
#include "infer/model_runner.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <optional>

#include "core/error.h"
#include "io/model_files.h"
#include "model/lora.h"
#include "model/weights.h"

namespace moetron {

ModelRunner::ModelRunner(std::unique_ptr<Backend> backend, const std::string& model_dir, const std::string& lora_dir,
                         int prefill_chunk)
    : own_backend_(std::move(backend)), chunk_(std::max(1, prefill_chunk)) {
  const ModelConfig cfg = load_model_config((std::filesystem::path(model_dir) / "config.json").string());
  const ModelTensors files = ModelTensors::open(model_dir);
  check_weights_size(files, ParamTable(cfg), model_dir);  // before allocating what config.json asks for
  std::optional<PeftAdapter> adapter;
  if (!lora_dir.empty()) adapter = read_peft_adapter(lora_dir, cfg);
  own_model_ =
      std::make_unique<Model>(*own_backend_, cfg, nullptr, nullptr, LayerRange{}, adapter ? adapter->spec : LoraSpec{});
  model_ = own_model_.get();
  model_->release_gradients();  // inference: parameters (and their GEMM copy) only
  {
    std::vector<float> params(model_->table().total(), 0.0f);
    load_hf_weights(files, model_->table(), params.data(), model_dir);
    model_->set_params(params.data());
  }
  if (adapter) model_->set_train_params(adapter->values.data());
  std::tie(kv_dim_, v_dim_) = cache_widths(cfg);
}

ModelRunner::ModelRunner(const WeightProvider& weights, int prefill_chunk, long row_attention_max_pairs)
    : chunk_(std::max(1, prefill_chunk)) {
  auto be = std::make_unique<CpuInferenceBackend>(row_attention_max_pairs);
  infer_be_ = be.get();
  own_backend_ = std::move(be);
  own_model_ = std::make_unique<Model>(*own_backend_, weights);
  model_ = own_model_.get();
  std::tie(kv_dim_, v_dim_) = cache_widths(weights.config());
}

void ModelRunner::set_profile(Profile* profile) { model_->set_profile(profile); }

ModelRunner::ModelRunner(Model& model, int prefill_chunk)
    : model_(&model), chunk_(std::max(1, prefill_chunk)) {
  std::tie(kv_dim_, v_dim_) = cache_widths(model.config());
}

KvCache ModelRunner::new_cache() const {
  return KvCache(config().num_hidden_layers, kv_dim_, v_dim_, model_->backend());
}

void ModelRunner::check_cache(const KvCache& c, const char* op, size_t index) const {
  if (&c.backend() != &model_->backend() || c.layers() != config().num_hidden_layers || c.kv_dim() != kv_dim_ ||
      c.v_dim() != v_dim_)
    fail("[{}] KV cache {} is not one of this model's (new_cache()): {} layers of width {} on another backend", op,
         index, c.layers(), c.kv_dim());
}

void ModelRunner::check_tokens(std::span<const int32_t> tokens, const char* op, size_t seq) const {
  const int V = config().vocab_size;
  for (size_t i = 0; i < tokens.size(); i++)
    if (tokens[i] < 0 || tokens[i] >= V)
      fail("[{}] token id {} at position {} of sequence {} is outside the vocabulary [0, {})", op, tokens[i], i, seq,
           V);
}

void ModelRunner::pass(std::span<const Piece> pieces, Logits which, float* logits) {
  std::vector<Model::InferSequence>& seqs = seqs_;
  std::vector<int32_t>& tokens = tokens_;
  std::vector<int>& rows = rows_;
  seqs.clear();
  tokens.clear();
  rows.clear();
  for (const Piece& p : pieces) {
    p.cache->grow(p.count);  // room for the new rows (the backend storage keeps the cached ones)
    seqs.push_back({p.cache->len(), p.count, p.cache->key_tensors().data(), p.cache->value_tensors().data()});
    for (int i = 0; i < p.count; i++) {
      if (which == Logits::all || (which == Logits::last && i + 1 == p.count)) rows.push_back((int)tokens.size());
      tokens.push_back(p.tokens[i]);
    }
  }
  model_->infer(seqs, tokens, rows, logits);
  for (const Piece& p : pieces) p.cache->commit(std::span<const int32_t>(p.tokens, p.count));
}

void ModelRunner::forward(KvCache& cache, std::span<const int32_t> tokens, float* logits, bool all_logits) {
  if (tokens.empty()) fail("[ModelRunner::forward] no tokens to feed");
  check_cache(cache, "ModelRunner::forward", 0);
  check_tokens(tokens, "ModelRunner::forward", 0);
  const int V = config().vocab_size;
  const int total = (int)tokens.size();
  for (int s = 0; s < total; s += chunk_) {
    const int n = std::min(chunk_, total - s);
    if (all_logits) {
      const Piece p{&cache, tokens.data() + s, n};
      pass(std::span(&p, 1), Logits::all, logits + (size_t)s * V);
    } else {
      // Only the prompt's last row's logits are wanted: earlier passes want none.
      const Piece p{&cache, tokens.data() + s, n};
      pass(std::span(&p, 1), s + n == total ? Logits::last : Logits::none, logits);
    }
  }
}

void ModelRunner::forward_batch(std::span<KvCache* const> caches, std::span<const int32_t> tokens, float* logits) {
  const char* op = "ModelRunner::forward_batch";
  if (tokens.empty() || caches.size() != tokens.size())
    fail("[{}] {} caches for {} tokens (one token per sequence, at least one)", op, caches.size(), tokens.size());
  std::vector<Piece>& pieces = pieces_;
  pieces.clear();
  for (size_t i = 0; i < caches.size(); i++) {
    check_cache(*caches[i], op, i);
    check_tokens(tokens.subspan(i, 1), op, i);
    for (size_t j = 0; j < i; j++)
      if (caches[j] == caches[i]) fail("[{}] sequences {} and {} share a KV cache", op, j, i);
    pieces.push_back({caches[i], tokens.data() + i, 1});
  }
  pass(pieces, Logits::last, logits);
}

void ModelRunner::prefill_rows(std::span<KvCache* const> caches, std::span<const std::span<const int32_t>> tokens,
                               float* logits) {
  const char* op = "ModelRunner::prefill_rows";
  if (caches.empty() || caches.size() != tokens.size())
    fail("[{}] {} caches for {} token lists", op, caches.size(), tokens.size());
  for (size_t s = 0; s < caches.size(); s++) {
    if (tokens[s].empty()) fail("[{}] sequence {} has no tokens to feed", op, s);
    check_cache(*caches[s], op, s);
    check_tokens(tokens[s], op, s);
    for (size_t j = 0; j < s; j++)
      if (caches[j] == caches[s]) fail("[{}] sequences {} and {} share a KV cache", op, j, s);
  }
  // Passes of at most chunk_ rows, a sequence split where a pass ends; a sequence's logits are its
  // final piece's last row's.
  const int V = config().vocab_size;
  std::vector<Piece> pieces;
  std::vector<size_t> seq_of;  // per piece
  std::vector<float> out;
  int rows = 0;
  const auto flush = [&] {
    if (pieces.empty()) return;
    out.resize(pieces.size() * (size_t)V);
    pass(pieces, Logits::last, out.data());
    for (size_t p = 0; p < pieces.size(); p++)
      if (pieces[p].tokens + pieces[p].count == tokens[seq_of[p]].data() + tokens[seq_of[p]].size())
        std::memcpy(logits + seq_of[p] * V, out.data() + p * V, sizeof(float) * V);
    pieces.clear();
    seq_of.clear();
    rows = 0;
  };
  for (size_t s = 0; s < caches.size(); s++)
    for (size_t i = 0; i < tokens[s].size();) {
      const int n = (int)std::min<size_t>(chunk_ - rows, tokens[s].size() - i);
      pieces.push_back({caches[s], tokens[s].data() + i, n});
      seq_of.push_back(s);
      rows += n;
      i += n;
      if (rows == chunk_) flush();
    }
  flush();
}

}  // namespace moetron
