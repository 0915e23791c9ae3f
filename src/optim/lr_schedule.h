// Learning-rate schedules (Megatron semantics): linear warmup from 0 to lr over warmup_steps, then
// cosine / linear / constant decay from lr to min_lr at decay_steps (= the run's total steps).
#pragma once

#include <string>

namespace moetron {

enum class LrDecay { cosine, linear, constant };

LrDecay lr_decay_from_string(const std::string& name);  // Error names the value and the choices

struct LrSchedule {
  double lr = 1e-5;
  double min_lr = 0.0;
  long warmup_steps = 0;
  long decay_steps = 1;  // total optimizer steps
  LrDecay decay = LrDecay::cosine;

  // Learning rate for optimizer step `step` (1-based: the first update uses step 1).
  double at(long step) const;
};

}  // namespace moetron
