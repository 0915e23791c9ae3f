// The distributed side of checkpoints (DESIGN §7): a checkpoint holds whole Hugging Face tensors
// whatever the layout, so saving gathers every rank's part to world rank 0, and resuming (or
// initialising from an HF directory) has each rank read only its own slices.  Host memory only:
// a rank on a device backend passes host copies of its parameters and moments.
#pragma once

#include <string>
#include <vector>

#include "dist/comm.h"
#include "dist/grid.h"
#include "io/hf_config.h"
#include "io/model_files.h"
#include "model/lora.h"
#include "model/params.h"
#include "train/layout.h"

namespace moetron {

// One rank's part of the training state, host copies in its table's flat layout: the parameters,
// and the Adam moments (zeros outside the ranges its optimizers hold).
struct RankState {
  const float* params = nullptr;
  std::vector<float> exp_avg, exp_avg_sq;
};

// The flat ranges of `table` whose moments the rank at data-parallel rank d holds (ZeRO-1 shards,
// or the whole sets on the first rank of each group without it), in the order of its optimizers'
// packed moments: the dense and the expert sets under expert parallelism, else one set.
std::vector<std::pair<size_t, size_t>> rank_state_ranges(const ParamTable& table, const Layout& layout, int d);

// Collective over `world`.  Every rank sends its part (parameters from the ranks with edp rank 0
// of each (stage, tp rank); moments from every rank holding some); world rank 0 assembles the whole
// model's params / exp_avg / exp_avg_sq (whole.total() floats each; untouched elsewhere).  lora:
// the tables are LoRA adapter tables of this spec (model/lora.h), else the model's.
void gather_whole_state(dist::Comm& world, const Layout& layout, const dist::GridShape& shape,
                        const dist::GridCoord& me, const ModelConfig& model, const ParamTable& local,
                        const RankState& mine, const ParamTable& whole, std::vector<float>& params,
                        std::vector<float>& exp_avg, std::vector<float>& exp_avg_sq,
                        const LoraSpec* lora = nullptr);

// This rank's slices of a checkpoint's optimizer/*.safetensors (the fp32 masters and moments of
// every HF tensor of `local`), into flat arrays of local.total() floats.
void read_rank_optimizer_state(const std::string& checkpoint_dir, const ParamTable& local, float* params,
                               float* exp_avg, float* exp_avg_sq);

// This rank's slices of an HF model directory's weights into params (local.total() floats);
// Error when the directory holds a tensor the whole model (config.json) lacks.
void read_rank_hf_weights(const ModelTensors& files, const std::string& dir, const ModelConfig& model,
                          const ParamTable& local, float* params);

}  // namespace moetron
