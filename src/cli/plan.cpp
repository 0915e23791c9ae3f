// moetron plan: validate a run's parallel layout and print per-rank memory, FLOPs and communication
// (the original workflow's "pre-compile" step). Nothing is allocated and no weights are read.
//   moetron plan configs/mixtral-8x7b-sft.yaml --world-size 64 [--device-memory 80GB] [--json] [k=v ...]
//   moetron plan C.yaml --world-size 16 --device-memory 80GB --search [--top N] [--peak-tflops ...]:
//     every layout ranked by estimated step time (train/plan_search.h).
// Exit status: 0 fits (--search: some layout fits); 1 an invalid config or layout, or a rank over
// --device-memory (--search: none fits); CLI11's codes for unusable arguments.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"
#include "train/config.h"
#include "train/plan.h"
#include "train/plan_search.h"

namespace moetron::cli {

int run_plan(int argc, char** argv) {
  CLI::App app{
      "Validate a training config's parallel layout on N ranks and estimate per-rank memory, FLOPs and\n"
      "communication per step. The config is given with --config or as the first argument; the other\n"
      "arguments are key=value overrides (e.g. parallel.tp=4). model.init is read relative to the\n"
      "current directory (only its config.json).",
      "moetron plan"};
  std::string config, device_memory;
  std::vector<std::string> args;
  int world = 0;
  bool json = false;
  app.add_option("-c,--config", config, "YAML training config");
  app.add_option("-n,--world-size", world, "number of ranks (GPUs or processes)")->required();
  app.add_option("--device-memory", device_memory,
                 "fail (exit 1) when a rank needs more: 80GB (10^9), 80GiB (2^30) or bytes");
  app.add_flag("--json", json, "print the plan as one JSON object");
  bool search = false;
  size_t top = 10;
  SearchHardware hw;
  app.add_flag("--search", search,
               "rank every layout (tp within a node, pp, ep, micro-batch size, recompute) that fits --device-memory "
               "by estimated step time");
  app.add_option("--top", top, "--search: how many layouts to list")->check(CLI::Range(1, 1000));
  app.add_option("--peak-tflops", hw.peak_tflops, "--search: dense bf16 peak per device")->check(CLI::Range(1e-3, 1e6));
  app.add_option("--efficiency", hw.efficiency, "--search: achieved fraction of the peak")
      ->check(CLI::Range(1e-3, 1.0));
  app.add_option("--intra-node-gbps", hw.intra_node_gbps, "--search: GB/s per device within a node")
      ->check(CLI::Range(1e-3, 1e6));
  app.add_option("--inter-node-gbps", hw.inter_node_gbps, "--search: GB/s per device between nodes")
      ->check(CLI::Range(1e-3, 1e6));
  app.add_option("--devices-per-node", hw.devices_per_node, "--search: devices per node")->check(CLI::Range(1, 1024));
  app.add_option("--reserve", hw.reserve, "--search: fraction of --device-memory kept free (context, workspaces)")
      ->check(CLI::Range(0.0, 0.9));
  app.add_option("args", args, "CONFIG (when --config is absent) and key=value overrides");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  std::vector<std::string> overrides;
  for (const std::string& a : args) {
    if (a.find('=') != std::string::npos) {
      overrides.push_back(a);
    } else if (config.empty()) {
      config = a;
    } else {
      std::fprintf(stderr, "moetron plan: unexpected argument '%s' (the config is '%s'; overrides are key=value)\n",
                   a.c_str(), config.c_str());
      return 2;
    }
  }
  if (config.empty()) {
    std::fprintf(stderr, "moetron plan: no config given (moetron plan C.yaml --world-size N, or --config C.yaml)\n");
    return 2;
  }
  const int64_t limit = device_memory.empty() ? 0 : parse_byte_size(device_memory, "--device-memory");

  const TrainConfig cfg = load_train_config(config, overrides);
  std::string source;
  const ModelConfig model = plan_model_config(cfg, &source);
  if (search) {
    if (world > 65536) throw InputError(fmt::format("--world-size {}: --search takes at most 65536 devices", world));
    const SearchResult r = search_layouts(cfg, model, world, limit, hw);
    const bool any = !r.ranked.empty() && r.ranked.front().fits;
    if (json) {
      nlohmann::json j = search_to_json(r, hw);
      j["config"] = config;
      j["world"] = world;
      if (limit > 0) j["device_memory"] = limit;
      std::printf("%s\n", j.dump(2).c_str());
    } else {
      std::printf("moetron plan --search: %s (%s) on %d devices\n%s", config.c_str(), source.c_str(), world,
                  format_search(r, hw, world, limit, top).c_str());
    }
    std::fflush(stdout);
    if (!any) std::fprintf(stderr, "moetron plan: error: no layout fits --device-memory %s\n", device_memory.c_str());
    return any ? 0 : 1;
  }
  const Plan plan = make_plan(cfg, model, world, source);
  const StagePlan& big = plan.largest_stage();
  const bool fits = limit == 0 || big.total_bytes() <= limit;

  if (json) {
    nlohmann::json j = plan_to_json(plan);
    j["config"] = config;
    if (limit > 0) {
      j["device_memory"] = limit;
      j["fits"] = fits;
    }
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("moetron plan: %s on %d ranks\n\n%s", config.c_str(), world, format_plan(plan).c_str());
    if (limit > 0 && fits)
      std::printf("fits: the largest rank (stage %d) needs %s of --device-memory %s (%.1f%%)\n", big.stage,
                  format_bytes((double)big.total_bytes()).c_str(), format_bytes((double)limit).c_str(),
                  100.0 * (double)big.total_bytes() / (double)limit);
  }
  std::fflush(stdout);
  if (!fits) {
    std::fprintf(stderr,
                 "moetron plan: error: a rank of pipeline stage %d needs %s (%lld bytes), more than --device-memory "
                 "%s (%lld bytes)\n",
                 big.stage, format_bytes((double)big.total_bytes()).c_str(), (long long)big.total_bytes(),
                 device_memory.c_str(), (long long)limit);
    return 1;
  }
  return 0;
}

}  // namespace moetron::cli
