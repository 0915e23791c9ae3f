// `moetron report`: one self-contained HTML page of a training run (inline SVG and CSS; no scripts,
// nothing fetched), read from RUN_DIR/metrics.jsonl and RUN_DIR/config.yaml:
//   - a summary table (steps, final loss, best val_loss, median tokens/s, ...) and the run's config;
//   - one small line chart per scalar over steps: loss, ce_loss, aux_loss, z_loss (when not all zero),
//     val_loss, lr, grad_norm, tokens_per_s, and the router load CV of every MoE layer;
//   - per MoE layer a heatmap of each expert's share of the routed tokens over time (x: steps,
//     y: experts, colour: share, diverging around the uniform share 1/E).
// Input lines (one JSON object each, blank lines ignored):
//   training: {"step", "loss", "ce_loss", "aux_loss", "z_loss", "lr", "grad_norm", "tokens_per_s", ...,
//              "moe": [{"layer", "max_share", "min_share", "cv", "dropped_fraction", "shares": [..]}]}
//   eval:     {"step", "val_loss", "val_ppl"}   (a line with "val_loss" is an eval line)
// A value may be null (the trainer writes a non-finite loss as null): that point is left out of its
// chart. Absent keys skip their chart with a note. A line that is not a JSON object, has no integer
// "step", or holds a value of the wrong type is an Error naming FILE:LINE.
#pragma once

#include <string>

namespace moetron {

enum class LossScale { automatic, linear, log };

struct ReportOptions {
  // y axis of the loss charts (loss, ce_loss, val_loss); automatic: log when every value is > 0 and
  // the largest is at least 10x the smallest.
  LossScale loss_scale = LossScale::automatic;
  int max_heatmap_bins = 100;  // time bins of the share heatmaps; more logged steps are averaged per bin
};

// Reads RUN_DIR/metrics.jsonl (required) and RUN_DIR/config.yaml (optional) and returns the page.
std::string render_report_html(const std::string& run_dir, const ReportOptions& options = {});

// Renders and writes the page to `output` (empty: RUN_DIR/report.html), atomically (temporary file
// in the same directory, then rename).
void write_report(const std::string& run_dir, const std::string& output, const ReportOptions& options = {});

}  // namespace moetron
