#include "model/batch.h"

#include "ops/cross_entropy.h"

namespace moetron {

namespace {

// The target of position i: the next position's label when it is in the same segment.
bool has_next_in_segment(const Batch& b, long i, int t) {
  return t + 1 < b.T && (b.segment_ids.empty() || b.segment_ids[i] == b.segment_ids[i + 1]);
}

}  // namespace

PreparedBatch prepare_batch(const Batch& batch) {
  const int B = batch.B, T = batch.T;
  const long N = (long)B * T;
  PreparedBatch p;
  p.positions.resize(N);
  for (int b = 0; b < B; b++)
    for (int t = 0; t < T; t++) {
      const long i = (long)b * T + t;
      if (!batch.position_ids.empty())
        p.positions[i] = batch.position_ids[i];
      else if (!batch.segment_ids.empty() && t > 0 && batch.segment_ids[i] == batch.segment_ids[i - 1])
        p.positions[i] = p.positions[i - 1] + 1;
      else if (!batch.segment_ids.empty())
        p.positions[i] = 0;
      else
        p.positions[i] = t;
    }
  p.has_labels = !batch.labels.empty();
  p.targets.assign(N, ops::IGNORE_INDEX);
  if (p.has_labels)
    for (int b = 0; b < B; b++)
      for (int t = 0; t + 1 < T; t++) {
        const long i = (long)b * T + t;
        if (has_next_in_segment(batch, i, t)) p.targets[i] = batch.labels[i + 1];
      }
  for (long i = 0; i < N; i++) p.loss_tokens += p.targets[i] != ops::IGNORE_INDEX;
  p.has_token_mask = !batch.attention_mask.empty();
  p.token_mask.assign(N, 1);
  if (p.has_token_mask)
    for (long i = 0; i < N; i++) p.token_mask[i] = batch.attention_mask[i] != 0;
  for (long i = 0; i < N; i++) p.real_tokens += p.token_mask[i];
  return p;
}

long count_loss_tokens(const Batch& b) {
  if (b.labels.empty()) return 0;
  long count = 0;
  for (int r = 0; r < b.B; r++)
    for (int t = 0; t + 1 < b.T; t++) {
      const long i = (long)r * b.T + t;
      if (has_next_in_segment(b, i, t) && b.labels[i + 1] != ops::IGNORE_INDEX) count++;
    }
  return count;
}

}  // namespace moetron
