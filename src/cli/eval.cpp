// moetron eval: validation loss and perplexity of a checkpoint (or any HF model directory) on a
// run's validation split.
#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "cli/commands.h"
#include "train/config.h"
#include "train/evaluate.h"
#include "train/trainer.h"

namespace moetron::cli {

int run_eval(int argc, char** argv) {
  CLI::App app{
      "Validation loss and perplexity of a model on a run's validation split (DATA/valid.*), with the\n"
      "run's seq_length, packing and micro_batch_size. The model: --model DIR, else the run directory's\n"
      "newest checkpoint, else model.init.",
      "moetron eval"};
  std::string config, model;
  std::vector<std::string> overrides;
  long batches = -1;
  bool all = false, json = false;
  app.add_option("-c,--config", config, "YAML config file (the run's)")->required();
  app.add_option("overrides", overrides, "key=value overrides of config entries");
  app.add_option("--model", model, "model directory to evaluate (default: the run's newest checkpoint)");
  app.add_option("--batches", batches, "micro-batches to evaluate (default: eval.batches, as the trainer does)")
      ->check(CLI::PositiveNumber);
  app.add_flag("--all", all, "evaluate the whole validation split once");
  app.add_flag("--json", json, "also print one JSON line");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (all && batches > 0) {
    std::fprintf(stderr, "moetron eval: error: give --batches or --all, not both\n");
    return 2;
  }
  EvalResult r;
  try {
    const TrainConfig cfg = load_train_config(config, overrides);
    const std::string dir = resolve_eval_model(cfg, model);
    r = evaluate_model(cfg, dir, all ? 0 : batches > 0 ? batches : cfg.eval.batches);
  } catch (const SetupError& e) {
    std::fprintf(stderr, "moetron eval: error: %s\n", e.what());
    return 2;
  } catch (const Error& e) {
    // Config errors (load_train_config) are setup errors too.
    std::fprintf(stderr, "moetron eval: error: %s\n", e.what());
    return 2;
  }
  std::printf("%s: val_loss %.6f  perplexity %.4f  (%ld loss tokens, %ld micro-batches)\n", r.model_dir.c_str(),
              r.loss, r.perplexity, r.loss_tokens, r.batches);
  if (json)
    std::printf("{\"model\": \"%s\", \"val_loss\": %.17g, \"val_ppl\": %.17g, \"loss_tokens\": %ld, \"batches\": %ld}\n",
                r.model_dir.c_str(), r.loss, r.perplexity, r.loss_tokens, r.batches);
  return 0;
}

}  // namespace moetron::cli
