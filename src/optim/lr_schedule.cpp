#include "optim/lr_schedule.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace moetron {

LrDecay lr_decay_from_string(const std::string& name) {
  if (name == "cosine") return LrDecay::cosine;
  if (name == "linear") return LrDecay::linear;
  if (name == "constant") return LrDecay::constant;
  fail("train.schedule: unknown schedule '{}', expected one of cosine, linear, constant", name);
}

double LrSchedule::at(long step) const {
  if (warmup_steps > 0 && step <= warmup_steps) return lr * (double)step / (double)warmup_steps;
  if (decay == LrDecay::constant) return lr;
  const long span = std::max<long>(1, decay_steps - warmup_steps);
  const double progress = std::clamp((double)(step - warmup_steps) / (double)span, 0.0, 1.0);
  const double factor = decay == LrDecay::cosine ? 0.5 * (1.0 + std::cos(M_PI * progress)) : 1.0 - progress;
  return min_lr + (lr - min_lr) * factor;
}

}  // namespace moetron
