// The parallel layout, resolved once; see layout.h.
#include "train/layout.h"

#include "backend/select.h"
#include "core/error.h"
#include "dist/grid.h"

namespace moetron {

std::vector<int> stage_layer_starts(const TrainConfig& cfg, const ModelConfig& mc) {
  const int pp = cfg.parallel.pp, L = mc.num_hidden_layers;
  const std::vector<int>& per = cfg.parallel.layers_per_stage;
  std::vector<int> starts = {0};
  if (per.empty()) {
    if (pp < 1 || L % pp != 0)
      fail(
          "parallel.pp: pp {} does not divide num_hidden_layers {} (stages hold equal contiguous layer ranges; "
          "parallel.layers_per_stage sets uneven ones)",
          pp, L);
    for (int s = 0; s < pp; s++) starts.push_back(starts.back() + L / pp);
    return starts;
  }
  if ((int)per.size() != pp)
    fail("parallel layout: parallel.layers_per_stage has {} entries, pp is {} (one per stage)", per.size(), pp);
  for (size_t s = 0; s < per.size(); s++) {
    if (per[s] < 1) fail("parallel layout: parallel.layers_per_stage[{}] is {}: every stage needs a layer", s, per[s]);
    starts.push_back(starts.back() + per[s]);
  }
  if (starts.back() != L)
    fail("parallel layout: parallel.layers_per_stage sums to {} layers, the model has {} (num_hidden_layers)",
         starts.back(), L);
  return starts;
}

namespace {

// The process grid's shape, after every rule but the device's.
dist::GridShape validate_layout(const TrainConfig& cfg, const ModelConfig& mc, int world) {
  const int tp = cfg.parallel.tp, pp = cfg.parallel.pp, ep = cfg.parallel.ep;
  const dist::GridShape shape = dist::grid_shape(world, tp, pp, ep);
  const int dp = shape.dp;
  check_tp_split(mc, tp);
  stage_layer_starts(cfg, mc);
  if (mc.tie_word_embeddings && pp > 1)
    fail("parallel.pp: pp {} with tie_word_embeddings: the head is the embedding matrix, which the first and "
         "the last stage would both need (not supported; use pp 1)",
         pp);
  check_ep_split(mc, ep);
  if (mc.vocab_size % tp != 0)
    fail("parallel.tp: tp {} does not divide vocab_size {} (the embedding and the head are split over tp)", tp,
         mc.vocab_size);
  const int gbs = cfg.train.global_batch_size, mbs = cfg.train.micro_batch_size;
  if (gbs < 1 || mbs < 1)
    fail("batch: train.global_batch_size {} and train.micro_batch_size {} must be >= 1", gbs, mbs);
  if (gbs % (mbs * dp) != 0)
    fail("batch: train.global_batch_size {} is not divisible by micro_batch_size {} x data-parallel size {} = {}",
         gbs, mbs, dp, mbs * dp);
  check_seq_length(cfg, mc, "");
  return shape;
}

}  // namespace

void check_seq_length(const TrainConfig& cfg, const ModelConfig& mc, const std::string& model_source) {
  if (cfg.data.seq_length < 1) fail("data.seq_length must be >= 1, got {}", cfg.data.seq_length);
  if (cfg.data.seq_length > mc.max_position_embeddings)
    fail("data.seq_length {} exceeds the model's max_position_embeddings {}{} (sequences may not be longer than the "
         "positions the model has)",
         cfg.data.seq_length, mc.max_position_embeddings, model_source.empty() ? "" : " in " + model_source);
}

void check_device_rules(const TrainConfig& cfg, const ModelConfig& mc) {
  if (cfg.device == "cpu") {
    // LoRA: bf16 keeps the frozen base in bf16 (computed in fp32); the adapters train in fp32.
    if (cfg.model.dtype != "fp32" && !(cfg.lora.rank > 0 && cfg.model.dtype == "bf16"))
      fail("model.dtype: '{}' is not supported on device cpu (it trains fp32 parameters; bf16 is for a LoRA run's "
           "frozen base); use fp32",
           cfg.model.dtype);
  } else if (cfg.device == "cuda") {
    if (cfg.model.dtype != "bf16")
      fail(
          "model.dtype: '{}' on device cuda: the CUDA backend trains with bf16 GEMM weights copied from fp32 master "
          "weights (mixed precision); set model.dtype: bf16",
          cfg.model.dtype);
  } else {
    fail("device: '{}' is not a device moetron trains on (cpu, cuda)", cfg.device);
  }
  check_device_model(cfg.device, mc.head_dim, mc.is_moe() ? mc.num_local_experts : 0);
}

Layout resolve_layout(const TrainConfig& cfg, const ModelConfig& model, int world) {
  const dist::GridShape shape = validate_layout(cfg, model, world);
  check_device_rules(cfg, model);
  Layout l;
  l.world = shape.world;
  l.tp = shape.tp;
  l.pp = shape.pp;
  l.ep = shape.ep;
  l.dp = shape.dp;
  l.zero1 = cfg.parallel.zero1;
  l.stage_starts = stage_layer_starts(cfg, model);
  l.micro_batches = cfg.train.global_batch_size / (cfg.train.micro_batch_size * l.dp);
  return l;
}

ParamShard layout_shard(const Layout& layout, const ModelConfig& model, int stage, int tp_rank, int ep_rank) {
  const LayerRange r = layout.stage_layers(stage);
  return make_param_shard(model, r.begin, r.end, tp_rank, layout.tp, ep_rank, layout.ep);
}

}  // namespace moetron
