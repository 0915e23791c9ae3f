#include "data/loader.h"
#include "core/json_limits.h"

#include <algorithm>
#include <numeric>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/rng.h"
#include "ops/cross_entropy.h"

namespace moetron {

namespace {

constexpr int32_t kIgnore = -100;  // HF's ignore index; equals ops::IGNORE_INDEX

// The j-th Fisher-Yates draw of epoch `epoch`: uniform in [0, bound) (multiply-high, bias < 2^-40
// for any realistic document count).
uint64_t shuffle_draw(uint64_t seed, uint64_t epoch, uint64_t j, uint64_t bound) {
  static const uint64_t key = hash_name("data.loader.shuffle");
  const uint64_t r = mix64(mix64(mix64(seed ^ key) + epoch) + j);
  return (uint64_t)(((unsigned __int128)r * bound) >> 64);
}

uint64_t get_u64(const nlohmann::json& j, const char* field) {
  auto it = j.find(field);
  if (it == j.end()) fail("loader state: field '{}' is missing", field);
  if (!it->is_number_unsigned() && !(it->is_number_integer() && it->get<int64_t>() >= 0))
    fail("loader state: field '{}' = {} is not a non-negative integer", field, it->dump());
  return it->get<uint64_t>();
}

}  // namespace

static_assert(kIgnore == ops::IGNORE_INDEX, "loader labels must use the model's ignore index");

void to_json(nlohmann::json& j, const LoaderState& s) {
  j = nlohmann::json{{"epoch", s.epoch},         {"next_block", s.next_block}, {"seed", s.seed},
                     {"documents", s.documents}, {"seq_length", s.seq_length}, {"packing", s.packing}};
}

void from_json(const nlohmann::json& j, LoaderState& s) {
  if (!j.is_object()) fail("loader state: expected a JSON object, got {}", json_preview(j));
  s.epoch = get_u64(j, "epoch");
  s.next_block = get_u64(j, "next_block");
  s.seed = get_u64(j, "seed");
  s.documents = get_u64(j, "documents");
  const uint64_t T = get_u64(j, "seq_length");
  if (T > (uint64_t)INT32_MAX) fail("loader state: field 'seq_length' = {} is too large", T);
  s.seq_length = (int)T;
  auto it = j.find("packing");
  if (it == j.end()) fail("loader state: field 'packing' is missing");
  if (!it->is_boolean()) fail("loader state: field 'packing' = {} is not a boolean", it->dump());
  s.packing = it->get<bool>();
}

DataLoader::DataLoader(const std::string& token_prefix, const std::string& mask_prefix, const LoaderConfig& cfg)
    : DataLoader(IndexedDataset::open(token_prefix),
                 mask_prefix.empty() ? IndexedDataset() : IndexedDataset::open(mask_prefix), !mask_prefix.empty(),
                 cfg) {}

DataLoader::DataLoader(IndexedDataset tokens, IndexedDataset mask, bool has_mask, const LoaderConfig& cfg)
    : cfg_(cfg), tokens_(std::move(tokens)), mask_(std::move(mask)), has_mask_(has_mask) {
  if (cfg_.seq_length <= 0) fail("data loader: seq_length = {}, expected > 0", cfg_.seq_length);
  if (cfg_.micro_batch_size <= 0) fail("data loader: micro_batch_size = {}, expected > 0", cfg_.micro_batch_size);
  if (cfg_.dp_size <= 0) fail("data loader: dp_size = {}, expected > 0", cfg_.dp_size);
  if (cfg_.dp_rank < 0 || cfg_.dp_rank >= cfg_.dp_size)
    fail("data loader: dp_rank = {} outside [0, dp_size = {})", cfg_.dp_rank, cfg_.dp_size);
  const int step_rows = cfg_.micro_batch_size * cfg_.dp_size;
  gbs_ = cfg_.global_batch_size == 0 ? step_rows : cfg_.global_batch_size;
  if (gbs_ <= 0 || gbs_ % step_rows != 0)
    fail("data loader: global_batch_size = {} is not a positive multiple of micro_batch_size * dp_size = {} * {}",
         gbs_, cfg_.micro_batch_size, cfg_.dp_size);
  if (has_mask_) {
    if (mask_.size() != tokens_.size())
      fail("{}: {} sequences, but the token dataset {} has {}", mask_.idx_path(), mask_.size(), tokens_.idx_path(),
           tokens_.size());
    for (size_t i = 0; i < tokens_.size(); i++)
      if (mask_.length(i) != tokens_.length(i))
        fail("{}: sequence {} has {} elements, but the token dataset {} has {}", mask_.idx_path(), i,
             mask_.length(i), tokens_.idx_path(), tokens_.length(i));
  }
  enter_epoch(0);
}

LoaderStats DataLoader::plan(uint64_t epoch, std::vector<Unit>* units, std::vector<uint64_t>* block_start) const {
  const uint64_t n = tokens_.size();
  const int64_t T = cfg_.seq_length;
  std::vector<uint64_t> order(n);
  std::iota(order.begin(), order.end(), uint64_t(0));
  if (cfg_.shuffle)
    for (uint64_t i = n; i > 1; i--) std::swap(order[i - 1], order[shuffle_draw(cfg_.seed, epoch, i - 1, i)]);

  LoaderStats st;
  st.documents = n;
  if (units) units->clear();
  if (block_start) block_start->clear();
  uint64_t unit_count = 0;
  int64_t room = 0;  // free tokens in the current block; 0 before the first block
  auto place = [&](uint64_t doc, int64_t offset, int64_t len) {
    if (!cfg_.packing || len > room) {  // start a new block
      if (block_start) block_start->push_back(unit_count);
      st.blocks++;
      room = T;
    }
    if (units) units->push_back(Unit{doc, (int32_t)offset, (int32_t)len});
    unit_count++;
    room -= len;
    st.tokens += (uint64_t)len;
  };
  for (uint64_t doc : order) {
    const int64_t len = (int64_t)tokens_.length(doc);
    if (len == 0) {
      st.empty_documents++;
    } else if (len <= T) {
      place(doc, 0, len);
    } else if (cfg_.over_long == LoaderConfig::OverLong::drop) {
      st.dropped_documents++;
      st.dropped_tokens += (uint64_t)len;
    } else {
      st.split_documents++;
      for (int64_t off = 0; off < len; off += T) {
        place(doc, off, std::min(T, len - off));
        st.split_chunks++;
      }
    }
  }
  if (block_start) block_start->push_back(unit_count);
  if (st.blocks == 0)
    fail("{}: no usable documents for seq_length {} ({} documents: {} empty, {} longer than seq_length dropped)",
         tokens_.idx_path(), T, n, st.empty_documents, st.dropped_documents);
  st.padded_rows = (st.blocks + (uint64_t)gbs_ - 1) / (uint64_t)gbs_ * (uint64_t)gbs_;
  st.padding_tokens = st.padded_rows * (uint64_t)T - st.tokens;
  return st;
}

void DataLoader::enter_epoch(uint64_t epoch) {
  stats_ = plan(epoch, &units_, &block_start_);
  epoch_ = epoch;
  next_block_ = 0;
}

uint64_t DataLoader::blocks_per_epoch(uint64_t epoch) const {
  return epoch == epoch_ ? stats_.blocks : plan(epoch, nullptr, nullptr).blocks;
}

uint64_t DataLoader::steps_per_epoch(uint64_t epoch) const {
  return (blocks_per_epoch(epoch) + (uint64_t)gbs_ - 1) / (uint64_t)gbs_;
}

uint64_t DataLoader::total_steps(uint64_t epochs) const {
  uint64_t total = 0;
  for (uint64_t e = 0; e < epochs; e++) total += steps_per_epoch(e);
  return total;
}

uint64_t DataLoader::micro_batches_per_epoch() const {
  return stats_.padded_rows / ((uint64_t)cfg_.dp_size * (uint64_t)cfg_.micro_batch_size);
}

LoaderState DataLoader::state() const {
  LoaderState s;
  s.epoch = epoch_;
  s.next_block = next_block_;
  s.seed = cfg_.seed;
  s.documents = tokens_.size();
  s.seq_length = cfg_.seq_length;
  s.packing = cfg_.packing;
  return s;
}

void DataLoader::restore(const LoaderState& s) {
  if (s.seed != cfg_.seed || s.documents != tokens_.size() || s.seq_length != cfg_.seq_length ||
      s.packing != cfg_.packing)
    fail("data loader: the saved state (seed {}, {} documents, seq_length {}, packing {}) does not match this "
         "loader (seed {}, {} documents in {}, seq_length {}, packing {})",
         s.seed, s.documents, s.seq_length, s.packing, cfg_.seed, tokens_.size(), tokens_.idx_path(),
         cfg_.seq_length, cfg_.packing);
  const uint64_t step_rows = (uint64_t)cfg_.dp_size * (uint64_t)cfg_.micro_batch_size;
  if (s.next_block % step_rows != 0)
    fail("data loader: saved next_block {} is not a multiple of dp_size * micro_batch_size = {}", s.next_block,
         step_rows);
  const uint64_t rows = s.epoch == epoch_ ? stats_.padded_rows : plan(s.epoch, nullptr, nullptr).padded_rows;
  if (s.next_block > rows)
    fail("data loader: saved next_block {} is beyond the {} rows of epoch {}", s.next_block, rows, s.epoch);
  if (s.next_block == rows) {  // saved right after an epoch's last micro-batch
    enter_epoch(s.epoch + 1);
  } else {
    if (s.epoch != epoch_) enter_epoch(s.epoch);
    next_block_ = s.next_block;
  }
}

Batch DataLoader::next() {
  Batch b;
  next(b);
  return b;
}

void DataLoader::next(Batch& out) {
  const int B = cfg_.micro_batch_size, T = cfg_.seq_length;
  const size_t N = (size_t)B * T;
  out.B = B;
  out.T = T;
  out.input_ids.assign(N, 0);
  out.labels.assign(N, kIgnore);
  out.attention_mask.assign(N, 0);
  out.position_ids.assign(N, 0);
  out.segment_ids.assign(N, 0);
  const uint64_t first = (next_block_ + (uint64_t)cfg_.dp_rank * B);
  for (int r = 0; r < B; r++) fill_row(out, r, first + (uint64_t)r);
  next_block_ += (uint64_t)cfg_.dp_size * B;
  if (next_block_ >= stats_.padded_rows) enter_epoch(epoch_ + 1);
}

// Row `row` of `out` (already all padding) from global row `global_row` of the current epoch.
void DataLoader::fill_row(Batch& out, int row, uint64_t global_row) {
  if (global_row >= stats_.blocks) return;  // an empty row completing the last global batch
  const size_t base = (size_t)row * cfg_.seq_length;
  int32_t* ids = out.input_ids.data() + base;
  size_t t = 0;
  int32_t seg = 0;
  for (uint64_t u = block_start_[global_row]; u < block_start_[global_row + 1]; u++, seg++) {
    const Unit& unit = units_[u];
    const size_t len = (size_t)unit.length;
    MOETRON_ASSERT(t + len <= (size_t)cfg_.seq_length);
    tokens_.read(unit.doc, (size_t)unit.offset, len, ids + t);
    if (has_mask_) {
      mask_buf_.resize(len);
      mask_.read(unit.doc, (size_t)unit.offset, len, mask_buf_.data());
    }
    for (size_t k = 0; k < len; k++) {
      const size_t i = base + t + k;
      const int32_t m = has_mask_ ? mask_buf_[k] : 1;
      if (m != 0 && m != 1)
        fail("{}: sequence {} element {} = {}, expected a loss mask of 0 or 1", mask_.bin_path(), unit.doc,
             (size_t)unit.offset + k, m);
      out.labels[i] = m ? ids[t + k] : kIgnore;
      out.attention_mask[i] = 1;
      out.position_ids[i] = (int32_t)k;
      out.segment_ids[i] = seg;
    }
    t += len;
  }
  for (size_t k = t; k < (size_t)cfg_.seq_length; k++) out.segment_ids[base + k] = seg;
}

}  // namespace moetron
