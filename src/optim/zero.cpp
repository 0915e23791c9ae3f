#include "optim/zero.h"

#include <algorithm>
#include <cmath>
#include <tuple>

#include "core/error.h"

namespace moetron {

namespace {

bool in_set(const ParamSpec& s, ParamSet set) {
  const bool expert = s.expert;
  switch (set) {
    case ParamSet::all:
      return true;
    case ParamSet::dense:
      return !expert;
    case ParamSet::experts:
      return expert;
  }
  return true;
}

size_t padded(size_t n) { return (n + 15) / 16 * 16; }

// The flat ranges covering packed [pb, pe) of a packed space made of `ranges`.
std::vector<ShardedAdamW::Range> packed_to_flat(const std::vector<ShardedAdamW::Range>& ranges, size_t pb, size_t pe) {
  std::vector<ShardedAdamW::Range> out;
  size_t p = 0;
  for (const auto& [b, e] : ranges) {
    const size_t lo = std::max(pb, p), hi = std::min(pe, p + (e - b));
    if (lo < hi) out.push_back({b + (lo - p), b + (hi - p)});
    p += e - b;
  }
  return out;
}

}  // namespace

std::vector<ShardedAdamW::Range> ShardedAdamW::set_ranges(const ParamTable& table, ParamSet set) {
  std::vector<Range> out;
  for (const ParamSpec& s : table.specs()) {
    if (!in_set(s, set)) continue;
    const size_t b = s.offset, e = s.offset + padded(s.numel);
    if (!out.empty() && out.back().second == b)
      out.back().second = e;
    else
      out.push_back({b, e});
  }
  return out;
}

std::pair<size_t, size_t> ShardedAdamW::shard_of(size_t total, int parts, int d) {
  const auto [b, e] = shard_range((int64_t)(total / 16), parts, d);
  return {(size_t)b * 16, (size_t)e * 16};
}

std::vector<ShardedAdamW::Range> ShardedAdamW::state_ranges_of(const ParamTable& table, ParamSet set, int group_size,
                                                               int d, bool zero1) {
  const std::vector<Range> ranges = set_ranges(table, set);
  if (!zero1) return ranges;
  size_t total = 0;
  for (const auto& [b, e] : ranges) total += e - b;
  const auto [pb, pe] = shard_of(total, group_size, d);
  return packed_to_flat(ranges, pb, pe);
}

ShardedAdamW::ShardedAdamW(Backend& backend, const ParamTable& table, const AdamWConfig& cfg, dist::Comm& group,
                           dist::Comm& world, bool zero1, ParamSet set)
    : be_(backend), table_(table), cfg_(cfg), group_(group), world_(world), zero1_(zero1), set_(set) {
  ranges_ = set_ranges(table_, set_);
  for (const auto& [b, e] : ranges_) packed_total_ += e - b;
  identity_ = ranges_.size() == 1 && ranges_[0].first == 0 && ranges_[0].second == table_.total();
  std::tie(shard_begin_, shard_end_) = shard_of(packed_total_, group_.size(), group_.rank());
  const std::vector<Range> shard = packed_to_flat(ranges_, shard_begin_, shard_end_);
  state_ranges_ = zero1_ ? shard : ranges_;
  for (const ParamSpec& s : table_.specs()) {
    if (!s.tp_primary || !in_set(s, set_)) continue;
    for (const auto& [b, e] : shard) {
      const size_t lo = std::max(b, s.offset), hi = std::min(e, s.offset + s.numel);
      if (lo < hi) counted_.push_back({lo, hi});
    }
  }
  std::sort(counted_.begin(), counted_.end());
  size_t n = 0;
  for (const auto& [b, e] : state_ranges_) n += e - b;
  state_ = be_.allocate(2 * n * sizeof(float), "AdamW moments");
  m_ = be_.view(state_->data(), Store::f32, n);
  v_ = be_.view(static_cast<float*>(state_->data()) + n, Store::f32, n);
}

std::vector<size_t> ShardedAdamW::shard_counts() const {
  std::vector<size_t> counts(group_.size());
  for (int d = 0; d < group_.size(); d++) {
    const auto [b, e] = shard_of(packed_total_, group_.size(), d);
    counts[d] = e - b;
  }
  return counts;
}

void ShardedAdamW::pack(Tensor buf, Tensor flat) const {
  size_t p = 0;
  for (const auto& [b, e] : ranges_) {
    be_.copy(buf.part(p, e - b), flat.part(b, e - b));
    p += e - b;
  }
}

void ShardedAdamW::unpack(Tensor flat, Tensor buf, size_t pb, size_t pe) const {
  size_t p = 0;
  for (const auto& [b, e] : ranges_) {
    const size_t lo = std::max(pb, p), hi = std::min(pe, p + (e - b));
    if (lo < hi) be_.copy(flat.part(b + (lo - p), hi - lo), buf.part(lo, hi - lo));
    p += e - b;
  }
}

void ShardedAdamW::reduce_gradients(Tensor grads) {
  MOETRON_ASSERT(grads.numel == table_.total() && grads.store == Store::f32);
  if (group_.size() == 1) return;
  float* g = grads.f32_device();
  if (zero1_) {
    const std::vector<size_t> counts = shard_counts();
    if (identity()) {
      group_.reduce_scatter(g + shard_begin_, g, counts, dist::CommDType::f32, dist::ReduceOp::sum);
      return;
    }
    const Tensor buf = buf_.get(be_, Store::f32, packed_total_, "ZeRO-1 packing");
    pack(buf, grads);
    float* bp = buf.f32_device();
    group_.reduce_scatter(bp + shard_begin_, bp, counts, dist::CommDType::f32, dist::ReduceOp::sum);
    unpack(grads, buf, shard_begin_, shard_end_);
    return;
  }
  for (const auto& [rb, re] : ranges_)
    for (size_t b = rb; b < re; b += kBucket)
      group_.all_reduce(g + b, std::min(kBucket, re - b), dist::CommDType::f32, dist::ReduceOp::sum);
}

double ShardedAdamW::local_sum_squares(Tensor values) const {
  // Chunks of the flat index, as global_grad_norm, restricted to the counted intervals.
  MOETRON_ASSERT(values.numel == table_.total());
  return be_.sum_squares(values, counted_);
}

double ShardedAdamW::global_norm(Tensor values) const {
  return std::sqrt(world_.all_reduce_value(local_sum_squares(values)));
}

void ShardedAdamW::state_to_flat(float* m, float* v) const {
  size_t p = 0;
  for (const auto& [b, e] : state_ranges_) {
    be_.download(m + b, m_.part(p, e - b));
    be_.download(v + b, v_.part(p, e - b));
    p += e - b;
  }
}

void ShardedAdamW::state_from_flat(const float* m, const float* v) {
  size_t p = 0;
  for (const auto& [b, e] : state_ranges_) {
    be_.upload(m_.part(p, e - b), m + b);
    be_.upload(v_.part(p, e - b), v + b);
    p += e - b;
  }
}

void ShardedAdamW::step(Tensor params, Tensor grads, double lr, float grad_scale) {
  MOETRON_ASSERT(params.numel == table_.total() && grads.numel == table_.total());
  step_++;
  size_t p = 0;
  for (const auto& [rb, re] : state_ranges_) {
    for (const ParamSpec& s : table_.specs()) {
      const size_t lo = std::max(rb, s.offset), hi = std::min(re, s.offset + s.numel);
      if (lo >= hi) continue;
      const double wd = s.weight_decay ? cfg_.weight_decay : 0.0;
      const size_t at = p + (lo - rb);
      be_.adamw_update(params.part(lo, hi - lo), m_.part(at, hi - lo), v_.part(at, hi - lo), grads.part(lo, hi - lo),
                       grad_scale, lr, cfg_.beta1, cfg_.beta2, cfg_.eps, wd, step_);
    }
    p += re - rb;
  }
  if (zero1_ && group_.size() > 1) {
    const std::vector<size_t> counts = shard_counts();
    float* pp = params.f32_device();
    if (identity()) {
      group_.all_gather(pp, pp + shard_begin_, counts, dist::CommDType::f32);
      return;
    }
    const Tensor buf = buf_.get(be_, Store::f32, packed_total_, "ZeRO-1 packing");
    pack(buf, params);
    float* bp = buf.f32_device();
    group_.all_gather(bp, bp + shard_begin_, counts, dist::CommDType::f32);
    unpack(params, buf, 0, packed_total_);
  }
}

}  // namespace moetron
