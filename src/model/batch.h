// A micro-batch and what every backend's forward derives from it on the host, written once:
// positions, next-token targets and the real-token mask.
#pragma once

#include <cstdint>
#include <vector>

namespace moetron {

// One micro-batch.  All tensors are [B,T] row-major; optional ones are empty when absent.
struct Batch {
  int B = 0, T = 0;
  std::vector<int32_t> input_ids;
  std::vector<int32_t> labels;          // HF-aligned: the model shifts; -100 = ignored
  std::vector<int32_t> attention_mask;  // 1 = real token (right padding)
  std::vector<int32_t> position_ids;    // default: 0..T-1, restarting per segment when segment_ids given
  std::vector<int32_t> segment_ids;     // packed documents: attention stays within a segment, and
                                        // the last token of a segment has no target
};

// What the model computes from a batch before any kernel runs (N = B*T entries each).
struct PreparedBatch {
  std::vector<int32_t> positions;   // given, or 0..T-1 restarting at each segment start
  std::vector<int32_t> targets;     // the next token's label within the same segment, or -100
  std::vector<uint8_t> token_mask;  // 1 for real tokens (attention_mask != 0; all 1 without a mask)
  bool has_labels = false, has_token_mask = false;
  long loss_tokens = 0;  // targets that are not ignored
  long real_tokens = 0;  // token_mask != 0
};
PreparedBatch prepare_batch(const Batch& batch);

// Number of positions whose target (the next token's label in the same segment) is not ignored.
long count_loss_tokens(const Batch& batch);

}  // namespace moetron
