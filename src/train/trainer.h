// The training loop of `moetron train`: one process, or every rank of a distributed run (DESIGN §6).
//
// One optimizer step = gradient accumulation over the micro-batches of one global batch:
//   loss = (sum of token cross-entropies over the global batch) / (loss tokens in the global batch)
//        + aux_coef * mean over micro-batches (holding real tokens) of the load-balancing loss
//        + z_coef   * mean over those micro-batches of the router z-loss
// then global-norm clipping, the LR schedule, AdamW.  A non-finite loss or gradient norm skips the
// update (logged); `train.nan_skip_limit` skips in a row abort the run before any bad checkpoint.
// SIGTERM / SIGINT finish the current step, save a checkpoint and exit 0 (Slurm preemption).
//
// Distributed (pp x dp x tp, with ep dividing dp): each data-parallel rank takes its micro-batches
// of the global batch (DataLoader dp sharding); the token counts that scale the loss are summed over
// dp before the forward passes, so every layout optimises the same objective; the gradients are
// reduced over dp (ZeRO-1: reduce-scatter, sharded AdamW, all-gather; else all-reduce); clipping
// uses the global norm.  Tensor and expert parallelism are the model's (model/model.h); under
// ep > 1 the expert tensors have their own optimizer, reduced and sharded over edp (the ranks
// holding the same experts), the others over dp.  Under pp > 1 the stages of one dp rank read the
// same micro-batches and run them in the 1F1B schedule (warm-up forwards, one forward one backward,
// cool-down backwards), passing hidden states forward and their gradients back; the losses are
// summed over the stages.  World rank 0 alone writes the run directory (log, metrics.jsonl,
// TensorBoard, checkpoints); checkpoints hold whole tensors gathered to it, and every rank reads its
// part on resume, so any layout resumes any other.  A signal seen by any rank stops every rank after
// the same step.  metrics.jsonl adds comm_bytes (bytes rank 0 sent in the step), comm_bytes_max /
// comm_bytes_all_ranks, optimizer_state_bytes (the largest rank's) and, under pp > 1, pipeline (the
// peak micro-batches and activation bytes each stage kept).
#pragma once

#include <cstdint>
#include <string>

#include <vector>

#include "core/error.h"
#include "train/config.h"

namespace moetron {

namespace dist {
class Comm;
}

struct TrainSummary {
  long first_step = 0;     // first step run by this invocation (1-based)
  long last_step = 0;      // last completed optimizer step
  long total_steps = 0;    // the schedule horizon
  double last_loss = 0.0;
  bool interrupted = false;  // stopped early by SIGTERM/SIGINT or train.exit_interval (with a checkpoint)
  std::string last_checkpoint;
  int world_rank = 0, world_size = 1;  // this process in the run (rank 0 writes the run directory)
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
  // Debugging aid for the failure handling: world rank fail_rank fails with an Error at the start of
  // step fail_step (-1: never).
  int fail_rank = -1;
  long fail_step = -1;
  // Test aid: a constant bias[E] added to the router logits of every MoE layer (skewed routing).
  std::vector<float> router_bias;
  // The processes of a distributed run (dist::make_world_comm(); must outlive the call); null: this
  // process alone.
  dist::Comm* world = nullptr;
};

// Runs the whole training described by cfg (validated first: SetupError before any work).  In a
// distributed run every rank calls it with the same cfg; an Error on any rank must end the whole job
// (the CLI calls Comm::abort), since its peers would otherwise wait for it forever.
TrainSummary run_training(const TrainConfig& cfg, const TrainOptions& options = {});

}  // namespace moetron
