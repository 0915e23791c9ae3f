// The training data loader: documents from a token dataset and a loss-mask dataset (Megatron
// .bin/.idx pairs written by `moetron data prepare`, one sequence per document, DESIGN §7) into
// micro-batches (moetron::Batch, B = micro_batch_size rows of T = seq_length tokens).
//
// Per epoch e:
//   1. Order.  The documents are shuffled by a Fisher-Yates pass whose draws are a counter-based
//      function of (seed, e, position) (core/rng.h), so the order is reproducible, differs per
//      epoch, and costs O(documents) memory (never O(tokens)).  shuffle = false keeps file order.
//   2. Units.  Empty documents are skipped (counted).  A document longer than seq_length is split
//      into consecutive chunks of seq_length tokens (the last one shorter), each chunk its own
//      unit and segment (over_long = split), or is dropped (over_long = drop); both are counted.
//   3. Blocks (rows).  packing = true: units are packed greedily in order; a unit that does not fit
//      in the current block's remaining space starts a new block (no document is split unless it is
//      longer than seq_length).  packing = false: one unit per block.
//   4. Global batches.  The blocks are cut into global batches of global_batch_size rows; the last
//      global batch is completed with EMPTY rows (every token padding), so every document appears
//      exactly once per epoch and every epoch ends on an optimizer-step boundary.  The number of
//      rows of epoch e is padded_rows = ceil(blocks / G) * G.
//   5. Sharding.  Rows are dealt in micro-steps of dp_size * micro_batch_size rows: micro-batch k of
//      rank r holds rows (k * dp_size + r) * micro_batch_size + j, j < micro_batch_size.  Ranks' shards
//      are disjoint and together cover the epoch; G / (dp_size * micro_batch_size) consecutive
//      micro-batches of each rank make one optimizer step.  After the last micro-batch of an epoch
//      the next one comes from epoch e + 1.
//
// Row contents (HF conventions, DESIGN §2): tokens of segment s (s = 0, 1, ... per unit within the
// row) have segment_ids = s, position_ids = 0, 1, ... restarting per unit, attention_mask = 1, and
// labels = input_ids where the loss mask is 1, else -100 (aligned with input_ids; the model shifts
// and ignores targets across a segment boundary).  Padding after the last unit: input_ids = 0,
// labels = -100, attention_mask = 0, position_ids = 0, segment_ids = (number of units in the row),
// distinct from every real segment.  An empty row is all padding with segment_ids = 0.
//
// Position: LoaderState {epoch, next_block}, next_block being the first GLOBAL row (over all ranks)
// of the next micro-step.  It does not depend on dp_rank, so every rank saves the same state, and
// it may be restored under another dp_size / micro_batch_size as long as it falls on one of their
// micro-step boundaries (always true at optimizer-step boundaries with the same global batch).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "io/indexed_dataset.h"
#include "model/model.h"

namespace moetron {

struct LoaderConfig {
  int seq_length = 0;
  int micro_batch_size = 1;
  bool packing = true;
  enum class OverLong { split, drop } over_long = OverLong::split;
  uint64_t seed = 0;
  int dp_rank = 0, dp_size = 1;
  // Rows per optimizer step over all data-parallel ranks; a multiple of micro_batch_size * dp_size.
  // 0 means micro_batch_size * dp_size (one micro-batch per rank per step).
  int global_batch_size = 0;
  bool shuffle = true;  // false: documents in file order every epoch (evaluation)
};

// Counts for one epoch (only blocks, padded_rows and padding_tokens can differ between epochs).
struct LoaderStats {
  uint64_t documents = 0;          // sequences in the dataset
  uint64_t empty_documents = 0;    // length 0: skipped
  uint64_t split_documents = 0;    // longer than seq_length, split (over_long = split)
  uint64_t split_chunks = 0;       // the chunks those became
  uint64_t dropped_documents = 0;  // longer than seq_length, dropped (over_long = drop)
  uint64_t dropped_tokens = 0;
  uint64_t tokens = 0;             // real tokens delivered in the epoch
  uint64_t blocks = 0;             // rows holding data
  uint64_t padded_rows = 0;        // blocks plus the empty rows completing the last global batch
  uint64_t padding_tokens = 0;     // padded_rows * seq_length - tokens
};

struct LoaderState {
  uint64_t epoch = 0;
  uint64_t next_block = 0;  // first global row of the next micro-step within the epoch
  // Checked on restore, so a state is not applied to another dataset or packing by mistake.
  uint64_t seed = 0;
  uint64_t documents = 0;
  int seq_length = 0;
  bool packing = true;
  bool operator==(const LoaderState&) const = default;
};

// {"epoch", "next_block", "seed", "documents", "seq_length", "packing"}; from_json fails with an
// Error naming the missing or mistyped field.
void to_json(nlohmann::json& j, const LoaderState& s);
void from_json(const nlohmann::json& j, LoaderState& s);

class DataLoader {
 public:
  // Opens TOKENS.{bin,idx} and MASK.{bin,idx} (same sequence count and lengths).  An empty
  // mask_prefix means every token is a loss token.  Error on a bad config, mismatched datasets, or
  // an epoch without any usable document.
  DataLoader(const std::string& token_prefix, const std::string& mask_prefix, const LoaderConfig& cfg);
  DataLoader(IndexedDataset tokens, IndexedDataset mask, bool has_mask, const LoaderConfig& cfg);

  // This rank's next micro-batch (B = micro_batch_size, T = seq_length); advances the position.
  Batch next();
  void next(Batch& out);  // the same, reusing out's buffers

  LoaderState state() const;
  // Error if the state does not belong to this dataset/config or is not on a micro-step boundary.
  void restore(const LoaderState& state);

  uint64_t epoch() const { return epoch_; }
  const LoaderStats& stats() const { return stats_; }   // of the current epoch
  const LoaderConfig& config() const { return cfg_; }
  size_t documents() const { return tokens_.size(); }
  int global_batch_size() const { return gbs_; }

  // Data rows of epoch `epoch` (computes that epoch's packing; O(documents)).
  uint64_t blocks_per_epoch(uint64_t epoch) const;
  // Optimizer steps of epoch `epoch`: ceil(blocks / global_batch_size).
  uint64_t steps_per_epoch(uint64_t epoch) const;
  // Steps of epochs 0 .. epochs-1: the horizon of an epoch-based LR schedule.
  uint64_t total_steps(uint64_t epochs) const;
  // This rank's micro-batches in the current epoch: padded_rows / (dp_size * micro_batch_size).
  uint64_t micro_batches_per_epoch() const;

 private:
  struct Unit {
    uint64_t doc;
    int32_t offset;
    int32_t length;
  };
  // Packs epoch `epoch`; fills units/block_start when given (block b = units [start[b], start[b+1])).
  LoaderStats plan(uint64_t epoch, std::vector<Unit>* units, std::vector<uint64_t>* block_start) const;
  void enter_epoch(uint64_t epoch);
  void fill_row(Batch& out, int row, uint64_t global_row);

  LoaderConfig cfg_;
  IndexedDataset tokens_, mask_;
  bool has_mask_ = false;
  int gbs_ = 0;
  uint64_t epoch_ = 0, next_block_ = 0;
  LoaderStats stats_;
  std::vector<Unit> units_;
  std::vector<uint64_t> block_start_;
  std::vector<int32_t> mask_buf_;
};

}  // namespace moetron
