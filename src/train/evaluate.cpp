#include "train/evaluate.h"
#include "core/json_limits.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "backend/select.h"
#include "data/loader.h"
#include "io/hf_config.h"
#include "io/model_files.h"
#include "model/model.h"
#include "model/weights.h"
#include "train/checkpoint.h"
#include "train/layout.h"
#include "train/trainer.h"

namespace moetron {

namespace fs = std::filesystem;

LoaderConfig training_loader_config(const TrainConfig& cfg) {
  LoaderConfig lc;
  lc.seq_length = cfg.data.seq_length;
  lc.micro_batch_size = cfg.train.micro_batch_size;
  lc.packing = cfg.data.packing;
  lc.over_long = cfg.data.over_long == "drop" ? LoaderConfig::OverLong::drop : LoaderConfig::OverLong::split;
  lc.seed = cfg.seed;
  lc.global_batch_size = cfg.train.global_batch_size;
  return lc;
}

LoaderConfig validation_loader_config(const TrainConfig& cfg) {
  LoaderConfig lc = training_loader_config(cfg);
  lc.shuffle = false;
  lc.global_batch_size = 0;  // one micro-batch (per data-parallel rank) per call
  return lc;
}

std::string split_mask_prefix(const std::string& data_dir, const std::string& split) {
  const fs::path mask = fs::path(data_dir) / (split + "_mask");
  return fs::exists(mask.string() + ".idx") ? mask.string() : "";
}

std::string resolve_eval_model(const TrainConfig& cfg, const std::string& model_override) {
  if (!model_override.empty()) return model_override;
  std::string latest;
  try {
    latest = find_latest_checkpoint(cfg.run_dir);
  } catch (const Error& e) {
    throw SetupError(e.what());
  }
  if (!latest.empty()) return latest;
  if (cfg.model.init != "random") return cfg.model.init;
  throw SetupError(fmt::format(
      "eval: nothing to evaluate: run_dir '{}' has no checkpoint and model.init is 'random'; give --model DIR",
      cfg.run_dir));
}

EvalResult evaluate_model(const TrainConfig& cfg, const std::string& model_dir, long batches) {
  // Everything that can be wrong with the inputs is found before the model is built; the device
  // first (no usable GPU for device: cuda).
  const std::string why = device_unavailable_reason(cfg.device);
  if (!why.empty()) throw SetupError(fmt::format("device: {}: {}", cfg.device, why));
  const fs::path data = cfg.data.path;
  if (!fs::exists(data / "valid.idx"))
    throw SetupError(fmt::format(
        "data.path: '{}' has no validation split (valid.idx/valid.bin); prepare the data with --valid-fraction "
        "or --valid-input",
        data.string()));
  if (!fs::exists(fs::path(model_dir) / "config.json"))
    throw SetupError(fmt::format("eval: model directory '{}' has no config.json", model_dir));
  ModelConfig mcfg;
  std::optional<ModelTensors> files;
  try {
    mcfg = load_model_config((fs::path(model_dir) / "config.json").string());
    check_seq_length(cfg, mcfg, (fs::path(model_dir) / "config.json").string());
    files.emplace(ModelTensors::open(model_dir));
  } catch (const Error& e) {
    throw SetupError(e.what());
  }
  const fs::path meta = data / "dataset.json";
  if (fs::exists(meta)) {
    std::stringstream meta_text;
    meta_text << std::ifstream(meta).rdbuf();
    const nlohmann::json d = parse_json_or_discarded(meta_text.str());
    const long vocab = d.is_object() ? d.value("/tokenizer/vocab_size"_json_pointer, -1L) : -1L;
    if (vocab > mcfg.vocab_size)
      throw SetupError(fmt::format(
          "eval: the data in '{}' was tokenized with a {}-token vocabulary, but the model in '{}' has vocab_size {}",
          data.string(), vocab, model_dir, mcfg.vocab_size));
  }

  DataLoader valid((data / "valid").string(), split_mask_prefix(data.string(), "valid"),
                   validation_loader_config(cfg));
  const long n = batches > 0 ? batches : static_cast<long>(valid.steps_per_epoch(0));

  std::unique_ptr<Backend> backend;
  try {
    check_weights_size(*files, ParamTable(mcfg), model_dir);  // before allocating from config.json
    check_device_rules(cfg, mcfg);
    backend = make_backend(cfg.device);
  } catch (const Error& e) {
    throw SetupError(e.what());
  }
  Model model(*backend, mcfg);
  {
    std::vector<float> params(model.table().total(), 0.0f);
    load_hf_weights(*files, model.table(), params.data(), model_dir);
    model.set_params(params.data());
  }
  files.reset();

  // The trainer's evaluation: token cross-entropy summed over the batches, divided by their loss tokens.
  LossWeights w;
  w.ce_scale = 1.0;
  double ce_sum = 0;
  long tokens = 0;
  Batch b;
  for (long i = 0; i < n; i++) {
    valid.next(b);
    const Losses l = model.forward(b, w);
    ce_sum += l.ce_sum;
    tokens += l.loss_tokens;
  }
  EvalResult r;
  r.model_dir = model_dir;
  r.loss = tokens > 0 ? ce_sum / static_cast<double>(tokens) : std::nan("");
  r.perplexity = std::exp(r.loss);
  r.loss_tokens = tokens;
  r.batches = n;
  return r;
}

}  // namespace moetron
