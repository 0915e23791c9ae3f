// A reference case of tests/golden/ (tools/make_golden.py) or tests/golden/lora/
// (tools/make_lora_golden.py): its directory, model config, input batch and expected outputs, and the
// comparisons the golden tests make.
#pragma once

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include "io/hf_config.h"
#include "io/safetensors.h"
#include "model/batch.h"
#include "model/batch_io.h"
#include "model/losses.h"

namespace moetron::testing {

// max|a-b| / max|b| over b.size() elements.
inline double normalized_max_error(const float* a, const std::vector<float>& b) {
  double max_err = 0.0, max_ref = 0.0;
  for (size_t i = 0; i < b.size(); i++) {
    max_err = std::max(max_err, std::fabs((double)a[i] - (double)b[i]));
    max_ref = std::max(max_ref, std::fabs((double)b[i]));
  }
  return max_ref > 0 ? max_err / max_ref : max_err;
}
inline double normalized_max_error(const std::vector<float>& a, const std::vector<float>& b) {
  return normalized_max_error(a.data(), b);
}

inline double meta_double(const SafetensorsFile& f, const std::string& key) {
  auto it = f.metadata().find(key);
  if (it == f.metadata().end()) throw std::runtime_error("expected.safetensors metadata lacks " + key);
  return std::stod(it->second);
}

struct GoldenCase {
  std::filesystem::path dir;
  ModelConfig cfg;
  Batch batch;
  SafetensorsFile expected;
};

inline GoldenCase load_golden_case(const std::filesystem::path& dir) {
  return GoldenCase{dir, load_model_config((dir / "config.json").string()),
                    read_batch_safetensors((dir / "input.safetensors").string()),
                    SafetensorsFile::open((dir / "expected.safetensors").string())};
}

// HF's loss weights for one batch: the mean over its loss tokens, the config's aux coefficient.
inline LossWeights golden_loss_weights(const ModelConfig& cfg, const Batch& batch) {
  LossWeights w;
  w.ce_scale = 1.0 / (double)count_loss_tokens(batch);
  w.aux_coef = cfg.router_aux_loss_coef;
  return w;
}

}  // namespace moetron::testing
