// moetron train: train (pretraining or SFT) from a YAML config with k=v overrides.
#include <CLI/CLI.hpp>
#include <cstdio>
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
  app.add_option("-c,--config", config, "YAML config file")->required();
  app.add_option("overrides", overrides, "key=value overrides of config entries");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  const TrainConfig cfg = load_train_config(config, overrides);
  const TrainSummary s = run_training(cfg);
  std::printf("%s at step %ld of %ld, loss %.4f; checkpoint %s\n", s.interrupted ? "stopped" : "finished", s.last_step,
              s.total_steps, s.last_loss, s.last_checkpoint.c_str());
  return 0;
}

}  // namespace moetron::cli
