// The training loop of `moetron train` (single process; distribution comes with the dist issues).
//
// One optimizer step = gradient accumulation over the micro-batches of one global batch:
//   loss = (sum of token cross-entropies over the global batch) / (loss tokens in the global batch)
//        + aux_coef * mean over micro-batches (holding real tokens) of the load-balancing loss
//        + z_coef   * mean over those micro-batches of the router z-loss
// then global-norm clipping, the LR schedule, AdamW.  A non-finite loss or gradient norm skips the
// update (logged); `train.nan_skip_limit` skips in a row abort the run before any bad checkpoint.
// SIGTERM / SIGINT finish the current step, save a checkpoint and exit 0 (Slurm preemption).
#pragma once

#include <cstdint>
#include <string>

#include <vector>

#include "core/error.h"
#include "train/config.h"

namespace moetron {

struct TrainSummary {
  long first_step = 0;     // first step run by this invocation (1-based)
  long last_step = 0;      // last completed optimizer step
  long total_steps = 0;    // the schedule horizon
  double last_loss = 0.0;
  bool interrupted = false;  // stopped early by SIGTERM/SIGINT or train.exit_interval (with a checkpoint)
  std::string last_checkpoint;
};

// A problem found before any training work (config, data, model or checkpoint to resume): the CLI
// exits 2 for these, 1 for failures during training.
class SetupError : public Error {
 public:
  explicit SetupError(const std::string& what) : Error(what) {}
};

// Options that are not part of the run's config.
struct TrainOptions {
  // Debugging aid for the divergence handling: make the gradient of these steps NaN.
  std::vector<long> inject_nan_steps;
};

// Runs the whole training described by cfg (validated first: SetupError before any work).
TrainSummary run_training(const TrainConfig& cfg, const TrainOptions& options = {});

}  // namespace moetron
