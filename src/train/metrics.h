// What a run records per step (DESIGN §2): RUN/metrics.jsonl lines and their TensorBoard scalars,
// and the per-layer MoE telemetry they carry.
#pragma once

#include <filesystem>
#include <fstream>
#include <optional>
#include <vector>

#include <nlohmann/json.hpp>

#include "train/tensorboard.h"

namespace moetron {

// Per MoE layer over one step: each expert's share of the routed assignments, max/min share, the
// coefficient of variation, and the fraction of assignments a capacity limit dropped.  Layers
// with no assignment are left out.
nlohmann::json moe_telemetry(const std::vector<std::vector<double>>& assigned, const std::vector<double>& dropped);

// RUN/metrics.jsonl (appended) and, when asked, RUN/tb/ (TensorBoard events).
class MetricsWriter {
 public:
  MetricsWriter(const std::filesystem::path& run_dir, bool tensorboard);
  // One training step's line; its scalars (loss, ce_loss, aux_loss, z_loss, lr, grad_norm,
  // param_norm, tokens_per_s, mfu) and the MoE layers' max/min share, cv and dropped fraction also
  // go to TensorBoard.
  void step(const nlohmann::json& line);
  // An evaluation's line: step, val_loss, val_ppl.
  void eval(long step, double val_loss);

 private:
  std::ofstream file_;
  std::optional<TensorBoardWriter> tb_;
};

}  // namespace moetron
