// moetron report: one self-contained HTML page of a run's curves and expert-load heatmaps.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <string>

#include "cli/commands.h"
#include "core/error.h"
#include "io/output_guard.h"
#include "train/report.h"

namespace moetron::cli {

int run_report(int argc, char** argv) {
  CLI::App app{
      "Write an HTML page (inline SVG, nothing fetched) with a run's loss, val_loss, lr and grad-norm curves and a\n"
      "per-layer heatmap of each expert's share of the routed tokens over time, from RUN_DIR/metrics.jsonl.",
      "moetron report"};
  std::string run_dir, output, loss_scale = "auto";
  int bins = 100;
  app.add_option("run_dir", run_dir, "run directory (holds metrics.jsonl and config.yaml)")->required();
  app.add_option("-o,--output", output, "output HTML file (default RUN_DIR/report.html)");
  app.add_option("--loss-scale", loss_scale, "y axis of the loss charts: auto (log when they span 10x), linear, log")
      ->check(CLI::IsMember({"auto", "linear", "log"}));
  app.add_option("--heatmap-bins", bins, "most time bins per heatmap; more logged steps are averaged")
      ->check(CLI::Range(1, 10000));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  ReportOptions opt;
  opt.loss_scale = loss_scale == "log" ? LossScale::log : loss_scale == "linear" ? LossScale::linear : LossScale::automatic;
  opt.max_heatmap_bins = bins;
  const std::string target = output.empty() ? (std::filesystem::path(run_dir) / "report.html").string() : output;
  {  // a report replaces an earlier report, never what it is drawn from (metrics.jsonl, config.yaml, ...)
    InputPaths inputs;
    inputs.add_tree(run_dir, ".html");
    refuse_output_over_inputs(target, inputs, "--output");
  }
  write_report(run_dir, target, opt);
  std::printf("wrote %s\n", target.c_str());
  return 0;
}

}  // namespace moetron::cli
