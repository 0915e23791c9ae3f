// moetron train: train (pretraining or SFT) from a YAML config with k=v overrides.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cli/commands.h"
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
  std::string nan_steps;
  app.add_option("--debug-inject-nan", nan_steps,
                 "STEP[,STEP...]: make the gradient of these steps NaN (tests the divergence handling)");
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
  // Exit codes: 2 for problems found before any work (config, data, model, checkpoint to resume),
  // 1 for failures during training (main's handler), 0 when done or stopped with a checkpoint.
  TrainConfig cfg;
  try {
    cfg = load_train_config(config, overrides);
  } catch (const Error& e) {
    std::fprintf(stderr, "moetron train: error: %s\n", e.what());
    return 2;
  }
  TrainSummary s;
  try {
    s = run_training(cfg, options);
  } catch (const SetupError& e) {
    std::fprintf(stderr, "moetron train: error: %s\n", e.what());
    return 2;
  }
  std::printf("%s at step %ld of %ld, loss %.4f; checkpoint %s\n", s.interrupted ? "stopped" : "finished", s.last_step,
              s.total_steps, s.last_loss, s.last_checkpoint.c_str());
  return 0;
}

}  // namespace moetron::cli
