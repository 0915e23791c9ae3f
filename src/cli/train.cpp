// moetron train: train (pretraining or SFT) from a YAML config with k=v overrides.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cli/commands.h"
#include "dist/comm.h"
#include "train/config.h"
#include "train/trainer.h"

namespace moetron::cli {

int run_train(int argc, char** argv) {
  CLI::App app{
      "Train a Mixtral/Mistral model from a YAML config (see configs/). Overrides: dotted key=value,\n"
      "e.g. moetron train -c configs/tiny-mixtral.yaml train.max_steps=10 run_dir=runs/x",
      "moetron train"};
  std::string config;
  std::vector<std::string> overrides;
  TrainOptions options;
  app.add_option("-c,--config", config, "YAML config file")->required();
  app.add_option("overrides", overrides, "key=value overrides of config entries");
  std::string nan_steps, fail_at, router_bias;
  app.add_option("--debug-inject-nan", nan_steps,
                 "STEP[,STEP...]: make the gradient of these steps NaN (tests the divergence handling)");
  app.add_option("--debug-fail", fail_at,
                 "RANK:STEP: world rank RANK fails with an error at step STEP (tests the failure handling)");
  app.add_option("--debug-router-bias", router_bias,
                 "B0,B1,...: add these constants to the router logits of every MoE layer, one per expert (tests "
                 "skewed routing)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  for (size_t pos = 0; pos < nan_steps.size();) {
    size_t end = nan_steps.find(',', pos);
    if (end == std::string::npos) end = nan_steps.size();
    const std::string item = nan_steps.substr(pos, end - pos);
    char* stop = nullptr;
    const long v = std::strtol(item.c_str(), &stop, 10);
    if (item.empty() || *stop != '\0' || v < 1) {
      std::fprintf(stderr, "moetron train: --debug-inject-nan: '%s' is not a step number (1, 2, ...)\n", item.c_str());
      return 2;
    }
    options.inject_nan_steps.push_back(v);
    pos = end + 1;
  }
  for (size_t pos = 0; pos < router_bias.size();) {
    size_t end = router_bias.find(',', pos);
    if (end == std::string::npos) end = router_bias.size();
    const std::string item = router_bias.substr(pos, end - pos);
    char* stop = nullptr;
    const double v = std::strtod(item.c_str(), &stop);
    if (item.empty() || *stop != '\0') {
      std::fprintf(stderr, "moetron train: --debug-router-bias: '%s' is not a number\n", item.c_str());
      return 2;
    }
    options.router_bias.push_back((float)v);
    pos = end + 1;
  }
  if (!fail_at.empty()) {
    const size_t colon = fail_at.find(':');
    // The halves live until the end checks (strtol's end pointers point into them).
    const std::string rank_text = colon == std::string::npos ? "" : fail_at.substr(0, colon);
    const std::string step_text = colon == std::string::npos ? "" : fail_at.substr(colon + 1);
    char* e1 = nullptr;
    char* e2 = nullptr;
    const long rank = std::strtol(rank_text.c_str(), &e1, 10);
    const long step = std::strtol(step_text.c_str(), &e2, 10);
    if (colon == std::string::npos || rank_text.empty() || step_text.empty() || *e1 != '\0' || *e2 != '\0' ||
        rank < 0 || step < 1) {
      std::fprintf(stderr, "moetron train: --debug-fail: '%s' is not RANK:STEP (e.g. 2:3)\n", fail_at.c_str());
      return 2;
    }
    options.fail_rank = (int)rank;
    options.fail_step = step;
  }
  // Exit codes: 2 for problems found before any work (config, data, model, checkpoint to resume),
  // 1 for failures during training (main's handler), 0 when done or stopped with a checkpoint.
  TrainConfig cfg;
  try {
    cfg = load_train_config(config, overrides);
  } catch (const Error& e) {
    std::fprintf(stderr, "moetron train: error: %s\n", e.what());
    return 2;
  }
  // The processes of this run: MPI when a launcher (mpirun, srun) started us, else just this one.
  std::unique_ptr<dist::Comm> world;
  try {
    world = dist::make_world_comm();
  } catch (const Error& e) {
    std::fprintf(stderr, "moetron train: error: %s\n", e.what());
    return 2;
  }
  options.world = world.get();
  const bool distributed = world->size() > 1;
  // In a distributed run a failing rank ends the whole job (its peers would wait for it forever);
  // the message names the rank.
  auto failed = [&](int code, const char* what) {
    if (!distributed) {
      std::fprintf(stderr, "moetron train: error: %s\n", what);
      return code;
    }
    world->abort(code, fmt::format("moetron train: rank {} of {}: error: {}", world->rank(), world->size(), what));
    return code;  // not reached: abort ends the process
  };
  TrainSummary s;
  try {
    s = run_training(cfg, options);
  } catch (const SetupError& e) {
    return failed(2, e.what());
  } catch (const std::exception& e) {
    if (!distributed) throw;  // main's handler: exit 1
    return failed(1, e.what());
  }
  if (s.world_rank == 0)
    std::printf("%s at step %ld of %ld, loss %.4f; checkpoint %s\n", s.interrupted ? "stopped" : "finished",
                s.last_step, s.total_steps, s.last_loss, s.last_checkpoint.c_str());
  return 0;
}

}  // namespace moetron::cli
