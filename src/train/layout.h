// The parallel layout of a run, resolved and checked in ONE place: `moetron train`, `moetron plan`,
// `moetron eval` and the process grid all use it, so plan accepts exactly what train accepts.
//
// world = pp x dp x tp; ep divides dp.  tp splits attention heads (kv heads are replicated when
// NKV < tp), the expert FFN width I and the vocabulary; pp splits the layers into contiguous stages
// (equal ones, or parallel.layers_per_stage); ep splits the experts.  Rules (an Error with a
// one-line reason naming the field and the numbers): world % (tp*pp); dp % ep; NH % tp;
// NKV % tp or tp % NKV; E % ep (a dense model needs ep 1); I % tp; V % tp;
// parallel.layers_per_stage: empty and L % pp, or pp entries >= 1 summing to L;
// global_batch_size % (micro_batch_size * dp); 1 <= seq_length <= max_position_embeddings; and the
// device's (check_device_rules).  The world's rules are dist::grid_shape's, the model's tensor and
// expert splits model/params.h's (check_tp_split, check_ep_split).
#pragma once

#include <string>
#include <vector>

#include "io/hf_config.h"
#include "model/model.h"
#include "model/params.h"
#include "train/config.h"

namespace moetron {

struct Layout {
  int world = 1, tp = 1, pp = 1, dp = 1, ep = 1;
  bool zero1 = true;
  std::vector<int> stage_starts;  // pp + 1 values: stage s holds layers [stage_starts[s], stage_starts[s+1])
  int micro_batches = 1;          // per optimizer step per data-parallel rank
  LayerRange stage_layers(int stage) const { return {stage_starts.at(stage), stage_starts.at(stage + 1)}; }
};

// The layout of `cfg` for `model` over `world` ranks, checked.
Layout resolve_layout(const TrainConfig& cfg, const ModelConfig& model, int world);

// 1 <= data.seq_length <= the model's max_position_embeddings (`model_source`, e.g. its config.json,
// named in the message when not empty).  resolve_layout applies it (train, plan); eval on its own.
void check_seq_length(const TrainConfig& cfg, const ModelConfig& model, const std::string& model_source);

// The part of the parameter table the rank at (stage, tp rank, ep rank) holds.
ParamShard layout_shard(const Layout& layout, const ModelConfig& model, int stage, int tp_rank, int ep_rank);

// What the run's device needs of the config and the model: device cpu trains fp32 parameters;
// device cuda bf16 GEMM weights from fp32 masters (model.dtype bf16) within the CUDA kernels'
// limits (head_dim even and <= 128, at most 256 experts).  Nothing here needs a GPU: whether one can
// be used is the trainer's check at setup.
void check_device_rules(const TrainConfig& cfg, const ModelConfig& model);

// The first layer of each pipeline stage and L after the last (Layout::stage_starts).
std::vector<int> stage_layer_starts(const TrainConfig& cfg, const ModelConfig& model);

}  // namespace moetron
