#include "optim/zero.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace moetron {

ShardedAdamW::ShardedAdamW(const ParamTable& table, const AdamWConfig& cfg, dist::Comm& dp, dist::Comm& world,
                           bool zero1)
    : table_(table), cfg_(cfg), dp_(dp), world_(world), zero1_(zero1) {
  const auto [b, e] = shard(dp_.rank());
  if (zero1_) {
    state_begin_ = b;
    state_end_ = e;
  } else {
    state_begin_ = 0;
    state_end_ = table_.total();
  }
  for (const ParamSpec& s : table_.specs()) {
    if (!s.tp_primary) continue;
    const size_t lo = std::max(b, s.offset), hi = std::min(e, s.offset + s.numel);
    if (lo < hi) counted_.push_back({lo, hi});
  }
  m_.assign(state_end_ - state_begin_, 0.0f);
  v_.assign(state_end_ - state_begin_, 0.0f);
}

std::pair<size_t, size_t> ShardedAdamW::shard_of(size_t total, int dp, int d) {
  const auto [b, e] = shard_range((int64_t)(total / 16), dp, d);
  return {(size_t)b * 16, (size_t)e * 16};
}

void ShardedAdamW::reduce_gradients(float* grads) {
  if (dp_.size() == 1) return;
  if (zero1_) {
    std::vector<size_t> counts(dp_.size());
    for (int d = 0; d < dp_.size(); d++) {
      const auto [b, e] = shard(d);
      counts[d] = e - b;
    }
    dp_.reduce_scatter(grads + state_begin_, grads, counts, dist::CommDType::f32, dist::ReduceOp::sum);
    return;
  }
  for (size_t b = 0; b < table_.total(); b += kBucket)
    dp_.all_reduce(grads + b, std::min(kBucket, table_.total() - b));
}

double ShardedAdamW::global_norm(const float* values) const {
  // Chunks of the flat index, as global_grad_norm, restricted to the counted intervals.
  constexpr size_t chunk = 1 << 14;
  const size_t n = table_.total();
  const size_t nchunks = (n + chunk - 1) / chunk;
  std::vector<double> partial(nchunks, 0.0);
  const std::vector<Interval>& iv = counted_;
#pragma omp parallel for schedule(static)
  for (size_t c = 0; c < nchunks; c++) {
    const size_t c0 = c * chunk, c1 = std::min(n, c0 + chunk);
    // First interval that ends after c0.
    size_t k = std::upper_bound(iv.begin(), iv.end(), c0, [](size_t x, const Interval& a) { return x < a.end; }) -
               iv.begin();
    double s = 0.0;
    for (; k < iv.size() && iv[k].begin < c1; k++) {
      const size_t lo = std::max(c0, iv[k].begin), hi = std::min(c1, iv[k].end);
      for (size_t i = lo; i < hi; i++) s += (double)values[i] * values[i];
    }
    partial[c] = s;
  }
  double total = 0.0;
  for (double s : partial) total += s;
  total = world_.all_reduce_value(total);
  return std::sqrt(total);
}

void ShardedAdamW::step(float* params, const float* grads, double lr, float grad_scale) {
  step_++;
  for (const ParamSpec& s : table_.specs()) {
    const size_t lo = std::max(state_begin_, s.offset), hi = std::min(state_end_, s.offset + s.numel);
    if (lo >= hi) continue;
    const double wd = s.weight_decay ? cfg_.weight_decay : 0.0;
    adamw_update(params + lo, m_.data() + (lo - state_begin_), v_.data() + (lo - state_begin_), grads + lo, hi - lo,
                 grad_scale, lr, cfg_.beta1, cfg_.beta2, cfg_.eps, wd, step_);
  }
  if (zero1_ && dp_.size() > 1) {
    std::vector<size_t> counts(dp_.size());
    for (int d = 0; d < dp_.size(); d++) {
      const auto [b, e] = shard(d);
      counts[d] = e - b;
    }
    dp_.all_gather(params, params + state_begin_, counts, dist::CommDType::f32);
  }
}

}  // namespace moetron
