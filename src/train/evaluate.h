// `moetron eval`: validation loss and perplexity of a model directory (a checkpoint or any HF model)
// on the validation split of a run's data, with the run's sequence length and packing -- the same
// batches and the same arithmetic as the trainer's periodic evaluation, so the figure of a checkpoint
// equals the `val_loss` the run logged when it saved it.
#pragma once

#include <string>

#include "data/loader.h"
#include "train/config.h"

namespace moetron {

struct EvalResult {
  std::string model_dir;  // what was evaluated
  double loss = 0;        // mean token cross-entropy over the loss tokens (nats)
  double perplexity = 0;  // exp(loss)
  long loss_tokens = 0;   // tokens with a target in the batches evaluated
  long batches = 0;       // micro-batches evaluated
};

// The run's data loading (one process; the caller sets the data-parallel shard): the training
// split's settings, and the validation split's (the same, unshuffled, one micro-batch per call --
// the trainer's periodic evaluation and `moetron eval` read the same batches).
LoaderConfig training_loader_config(const TrainConfig& cfg);
LoaderConfig validation_loader_config(const TrainConfig& cfg);
// "DATA/SPLIT_mask" when DATA/SPLIT_mask.idx exists, else "" (every token is a loss token).
std::string split_mask_prefix(const std::string& data_dir, const std::string& split);

// The model to evaluate: `model_override` when given, else the newest complete checkpoint of the
// run directory, else model.init when it is a directory. SetupError when there is none.
std::string resolve_eval_model(const TrainConfig& cfg, const std::string& model_override);

// Evaluates `model_dir` on DATA/valid with the config's seq_length, packing, over_long and
// micro_batch_size. batches > 0: the first `batches` micro-batches (the trainer uses
// eval.batches); batches == 0: the whole validation split once. SetupError (before any work) for a
// missing validation split, a model directory without weights, or a model whose vocabulary cannot
// hold the data's tokens.
EvalResult evaluate_model(const TrainConfig& cfg, const std::string& model_dir, long batches);

}  // namespace moetron
