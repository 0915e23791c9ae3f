// Data-parallel AdamW with optional ZeRO-1 (DESIGN §6), over one rank's parameter table (the whole
// model, or its tensor- / expert-parallel part), or over one SET of its tensors.
//
// Parameter sets: `all` (every tensor), or, under expert parallelism, two optimizers: `dense` (every
// tensor but the experts, reduced and sharded over the data-parallel group) and `experts` (the
// stacked expert tensors this rank holds, reduced and sharded over the expert-data-parallel group:
// the ranks holding the same experts).  The set's tensors, in table order, form a packed index
// space [0, size()) -- for `all` it IS the table's flat index.
//
// The packed space is cut into `group` contiguous shards (multiples of 16 floats, the larger first);
// group rank d OWNS shard d.
//   zero1 = true   reduce_gradients: reduce-scatter over the group, so each rank holds the summed
//                  gradient of its shard only; step: AdamW on the shard (the Adam moments exist for
//                  the shard only: 1/group of the memory), then all-gather of the parameters.
//   zero1 = false  reduce_gradients: bucketed all-reduce over the group; step: every rank updates
//                  every parameter of the set (moments for the whole set).
// Gradient (and parameter) norms are global: each rank sums the squares of the elements of its
// shard, counting tensors replicated over tp once (ParamSpec::tp_primary), in fixed 16384-float
// chunks of the flat index, and the sums are all-reduced (in rank order) over the world group --
// so with one process the norm is bitwise global_grad_norm's.  With two optimizers the norm is
// sqrt(world-sum of both local_sum_squares): every parameter of the model counted once.
// Padding between tensors is never updated.  Every reduction has a fixed order: the same layout
// gives bitwise-identical runs.
// Memory: parameters, gradients and the moments live in the backend's memory (host memory on the
// CPU, device memory on a GPU); `group` is a Comm over that memory (dist/staged_comm.h for a device
// over MPI), `world` a host group for the norms.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "dist/comm.h"
#include "model/params.h"
#include "optim/adamw.h"

namespace moetron {

enum class ParamSet { all, dense, experts };

class ShardedAdamW {
 public:
  using Range = std::pair<size_t, size_t>;  // [begin, end) of the table's flat index

  // group: the ranks that hold the same values of this set and sum their gradients (dp, or edp for
  // the experts), over the backend's memory; world: every rank (for norms).  All must outlive the
  // optimizer.
  ShardedAdamW(Backend& backend, const ParamTable& table, const AdamWConfig& cfg, dist::Comm& group,
               dist::Comm& world, bool zero1, ParamSet set = ParamSet::all);

  // Sums grads[table.total()] over the group (ZeRO-1: valid in the owned shard only).
  void reduce_gradients(Tensor grads);
  // The L2 norm over the whole model of a flat array laid out by the table (collective over world):
  // call after reduce_gradients for the gradient norm, or on the parameters.  (One optimizer for
  // the whole table only; with several, combine local_sum_squares.)
  double global_norm(Tensor values) const;
  // This rank's part of the squared norm (not reduced).
  double local_sum_squares(Tensor values) const;
  // One AdamW step with gradient grads * grad_scale at learning rate lr, then (ZeRO-1) the
  // all-gather of the parameters.  Collective over the group.
  void step(Tensor params, Tensor grads, double lr, float grad_scale);

  bool zero1() const { return zero1_; }
  ParamSet set() const { return set_; }
  // Floats in the packed space of the set.
  size_t size() const { return packed_total_; }
  // The shard [begin, end) of a packed space of `total` floats (a multiple of 16) over `parts` ranks.
  static std::pair<size_t, size_t> shard_of(size_t total, int parts, int d);
  // The flat ranges of `table` that belong to `set` (each tensor with its padding; merged).
  static std::vector<Range> set_ranges(const ParamTable& table, ParamSet set);
  // The flat ranges whose moments group rank d (of group_size) holds, in order.
  static std::vector<Range> state_ranges_of(const ParamTable& table, ParamSet set, int group_size, int d, bool zero1);
  // This rank's: the moments exp_avg()/exp_avg_sq() (backend memory) are these ranges packed, in
  // order.
  const std::vector<Range>& state_ranges() const { return state_ranges_; }
  Tensor exp_avg() const { return m_; }
  Tensor exp_avg_sq() const { return v_; }
  // Between the packed moments and HOST flat arrays laid out by the table (only the state ranges
  // are read or written).
  void state_to_flat(float* m, float* v) const;
  void state_from_flat(const float* m, const float* v);
  long steps_taken() const { return step_; }
  void set_steps_taken(long s) { step_ = s; }
  // Bytes of optimizer state this rank holds (the Adam moments' allocations; fp32 parameters are
  // their own master weights).
  size_t state_bytes() const { return state_ ? state_->bytes() : 0; }
  // Elements per all-reduce bucket (zero1 = false).
  static constexpr size_t kBucket = size_t(1) << 22;

 private:
  // Packs the ranges of flat into buf (packed order) / unpacks [pb, pe) of the packed space.
  void pack(Tensor buf, Tensor flat) const;
  void unpack(Tensor flat, Tensor buf, size_t pb, size_t pe) const;
  bool identity() const { return identity_; }
  std::vector<size_t> shard_counts() const;

  Backend& be_;
  const ParamTable& table_;
  AdamWConfig cfg_;
  dist::Comm& group_;
  dist::Comm& world_;
  bool zero1_;
  ParamSet set_;
  std::vector<Range> ranges_;        // the set's flat ranges
  size_t packed_total_ = 0;
  bool identity_ = false;            // ranges_ == [0, total): packed index == flat index
  size_t shard_begin_ = 0, shard_end_ = 0;  // this rank's shard of the packed space
  std::vector<Range> state_ranges_;  // flat ranges whose moments this rank holds
  std::vector<Range> counted_;       // owned parts of primary tensors, sorted: what this rank's norm sums
  std::unique_ptr<Allocation> state_;  // the moments, m then v
  Tensor m_, v_;
  GrowableBuffer buf_;                 // packing buffer (sets other than a whole table)
  long step_ = 0;
};

}  // namespace moetron
