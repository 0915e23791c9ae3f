// Data-parallel AdamW with optional ZeRO-1 (DESIGN §6), over one rank's parameter table (the whole
// model, or its tensor-parallel part).
//
// The table's flat arrays [0, total) are cut into dp contiguous shards (multiples of 16 floats,
// the larger first); data-parallel rank d OWNS shard d.
//   zero1 = true   reduce_gradients: reduce-scatter over dp, so each rank holds the summed gradient
//                  of its shard only; step: AdamW on the shard (the Adam moments exist for the
//                  shard only: 1/dp of the memory), then all-gather of the parameters over dp.
//   zero1 = false  reduce_gradients: bucketed all-reduce over dp; step: every rank updates every
//                  parameter (moments for the whole table).
// Gradient (and parameter) norms are global: each rank sums the squares of the elements it owns,
// counting tensors replicated over tp once (ParamSpec::tp_primary), in fixed 16384-float chunks
// of the flat index, and the sums are all-reduced (in rank order) over the world group -- so with
// one process the norm is bitwise global_grad_norm's.
// Padding between tensors is never updated.  Every reduction has a fixed order: the same layout
// gives bitwise-identical runs.
#pragma once

#include <cstddef>
#include <vector>

#include "dist/comm.h"
#include "model/params.h"
#include "optim/adamw.h"

namespace moetron {

class ShardedAdamW {
 public:
  // dp: the data-parallel group; world: every rank (for norms).  Both must outlive the optimizer.
  ShardedAdamW(const ParamTable& table, const AdamWConfig& cfg, dist::Comm& dp, dist::Comm& world, bool zero1);

  // Sums grads[table.total()] over the data-parallel group (ZeRO-1: valid in the owned shard only).
  void reduce_gradients(float* grads);
  // The L2 norm over the whole model of a flat array laid out by the table (collective over world):
  // call after reduce_gradients for the gradient norm, or on the parameters.
  double global_norm(const float* values) const;
  // One AdamW step with gradient grads * grad_scale at learning rate lr, then (ZeRO-1) the
  // all-gather of the parameters.  Collective over dp.
  void step(float* params, const float* grads, double lr, float grad_scale);

  bool zero1() const { return zero1_; }
  // The shard [begin, end) of the flat arrays that data-parallel rank d owns.
  std::pair<size_t, size_t> shard(int d) const { return shard_of(table_.total(), dp_.size(), d); }
  // The same for a table of `total` floats (a multiple of 16) over dp ranks.
  static std::pair<size_t, size_t> shard_of(size_t total, int dp, int d);
  // The range whose moments this rank holds: its shard (ZeRO-1) or everything.
  size_t state_begin() const { return state_begin_; }
  size_t state_end() const { return state_end_; }
  // Moments for [state_begin, state_end).
  std::vector<float>& exp_avg() { return m_; }
  std::vector<float>& exp_avg_sq() { return v_; }
  const std::vector<float>& exp_avg() const { return m_; }
  const std::vector<float>& exp_avg_sq() const { return v_; }
  long steps_taken() const { return step_; }
  void set_steps_taken(long s) { step_ = s; }
  // Bytes of optimizer state this rank holds (the Adam moments' allocations; fp32 parameters are
  // their own master weights).
  size_t state_bytes() const { return (m_.capacity() + v_.capacity()) * sizeof(float); }
  // Elements per all-reduce bucket (zero1 = false).
  static constexpr size_t kBucket = size_t(1) << 22;

 private:
  struct Interval {
    size_t begin, end;
  };
  const ParamTable& table_;
  AdamWConfig cfg_;
  dist::Comm& dp_;
  dist::Comm& world_;
  bool zero1_;
  size_t state_begin_ = 0, state_end_ = 0;
  std::vector<Interval> counted_;  // owned parts of primary tensors, sorted: what this rank's norm sums
  std::vector<float> m_, v_;
  long step_ = 0;
};

}  // namespace moetron
