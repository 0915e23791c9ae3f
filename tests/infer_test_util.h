// Shared by the inference tests: the golden model directories, random prompts, the training forward's
// logits of a whole sequence (the reference a KV-cache forward must meet) and the error measure.
//
// Tolerance of the KV-vs-recompute comparison (kTol): max|a-b| <= 1e-5 * max|b| over each step's logits.
// Both paths are fp32 with the same formulas; they differ only in summation order (matrix-vector kernels,
// per-row attention over a cache, GEMMs over other shapes), which moves logits by ~1e-7 relative on these
// 2-layer models.  A wrong position, cache slot, window or mask moves them by far more (the golden models
// scale q/k so attention is sharp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "core/rng.h"
#include "io/hf_config.h"
#include "io/model_files.h"
#include "model/model.h"
#include "model/weights.h"

namespace moetron::testing {

inline const std::filesystem::path kGoldenDir = std::filesystem::path(MOETRON_SOURCE_DIR) / "tests" / "golden";
inline const std::filesystem::path kGenerateDir = kGoldenDir / "generate";
constexpr double kKvTol = 1e-5;

// Every model directory with weights: the forward goldens and the generation goldens.
inline std::vector<std::string> inference_model_dirs() {
  std::vector<std::string> dirs;
  for (const char* c :
       {"mixtral_gqa", "mixtral_e3_k1", "mixtral_swa_padded", "mistral_dense", "llama_dense", "qwen3_moe_mixed",
        "qwen3_moe_norm_topk_padded", "qwen2_moe_shared", "olmoe_clip", "olmoe_plain", "qwen3_dense",
        "glm4_moe_partial", "glm4_moe_air", "deepseek_v3_mla_yarn", "deepseek_v3_plain_q"})
    dirs.push_back((kGoldenDir / c).string());
  for (const char* c : {"mixtral_gqa", "llama_dense", "qwen3_moe", "olmoe"})
    dirs.push_back((kGenerateDir / c).string());
  return dirs;
}

inline std::vector<int32_t> random_tokens(int n, int V, uint64_t seed) {
  std::vector<int32_t> t(n);
  for (int i = 0; i < n; i++) t[i] = (int32_t)(mix64(seed * 1000003 + i) % (uint64_t)V);
  return t;
}

// [T, V] logits of the training model's forward over the whole sequence.
inline std::vector<float> recompute_logits(const std::string& dir, const std::vector<int32_t>& tokens) {
  const ModelConfig cfg = load_model_config(dir + "/config.json");
  Model model(cfg);
  load_hf_weights(ModelTensors::open(dir), model.table(), model.params().data(), dir);
  Batch b;
  b.B = 1;
  b.T = (int)tokens.size();
  b.input_ids = tokens;
  model.forward(b, {});
  return std::vector<float>(model.logits(), model.logits() + tokens.size() * (size_t)cfg.vocab_size);
}

// max|a - b| / max|b| over n values.
inline double rel_err(const float* a, const float* b, int n) {
  double err = 0, ref = 0;
  for (int i = 0; i < n; i++) {
    err = std::max(err, std::fabs((double)a[i] - b[i]));
    ref = std::max(ref, std::fabs((double)b[i]));
  }
  return err / ref;
}

}  // namespace moetron::testing
