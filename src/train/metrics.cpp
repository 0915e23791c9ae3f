#include "train/metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace moetron {

nlohmann::json moe_telemetry(const std::vector<std::vector<double>>& assigned, const std::vector<double>& dropped) {
  nlohmann::json layers = nlohmann::json::array();
  for (size_t l = 0; l < assigned.size(); l++) {
    const std::vector<double>& a = assigned[l];
    double total = 0;
    for (double x : a) total += x;
    if (total <= 0) continue;
    double mx = 0, mn = 1, mean = 1.0 / a.size(), var = 0;
    for (double x : a) {
      const double share = x / total;
      mx = std::max(mx, share);
      mn = std::min(mn, share);
      var += (share - mean) * (share - mean);
    }
    std::vector<double> shares(a.size());
    for (size_t e = 0; e < a.size(); e++) shares[e] = a[e] / total;
    layers.push_back({{"layer", l},
                      {"shares", shares},
                      {"max_share", mx},
                      {"min_share", mn},
                      {"cv", std::sqrt(var / a.size()) / mean},
                      {"dropped_fraction", dropped[l] / total}});
  }
  return layers;
}

MetricsWriter::MetricsWriter(const std::filesystem::path& run_dir, bool tensorboard)
    : file_(run_dir / "metrics.jsonl", std::ios::app) {
  if (!file_) fail("{}: cannot open for writing", (run_dir / "metrics.jsonl").string());
  if (tensorboard) tb_.emplace((run_dir / "tb").string());
}

void MetricsWriter::step(const nlohmann::json& m) {
  file_ << m.dump() << '\n';
  file_.flush();
  if (!tb_) return;
  const long step = m["step"].get<long>();
  for (const char* k : {"loss", "ce_loss", "aux_loss", "z_loss", "lr", "grad_norm", "param_norm", "tokens_per_s", "mfu"})
    tb_->scalar(k, step, m[k].get<double>());
  if (m.contains("moe"))
    for (const auto& layer : m["moe"])
      for (const char* k : {"max_share", "min_share", "cv", "dropped_fraction", "bias_max", "bias_min"})
        if (layer.contains(k))
          tb_->scalar(fmt::format("moe/layer_{}/{}", layer["layer"].get<int>(), k), step, layer[k].get<double>());
  tb_->flush();
}

void MetricsWriter::eval(long step, double val) {
  file_ << nlohmann::json{{"step", step}, {"val_loss", val}, {"val_ppl", std::exp(val)}}.dump() << '\n';
  file_.flush();
  if (tb_) {
    tb_->scalar("val_loss", step, val);
    tb_->flush();
  }
}

}  // namespace moetron
