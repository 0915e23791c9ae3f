// moetron data synthetic: the demo's deterministic synthetic chat dataset (see data/synthetic.h).
#include <cstdio>
#include <filesystem>
#include <string>

#include <CLI/CLI.hpp>

#include "cli/commands.h"
#include "data/synthetic.h"

namespace moetron::cli {

int run_data_synthetic(int argc, char** argv) {
  CLI::App app{"Write a synthetic chat dataset a small model can learn quickly: OUTPUT/train.jsonl and\n"
               "OUTPUT/test.jsonl (held-out questions that never occur in train.jsonl).",
               "moetron data synthetic"};
  SyntheticOptions o;
  std::string output;
  app.add_option("--task", o.task, "addition (two-digit numbers)");
  app.add_option("--train-examples", o.train_examples, "training conversations");
  app.add_option("--test-examples", o.test_examples, "held-out conversations");
  app.add_option("--seed", o.seed, "seed of the example order and the held-out choice");
  app.add_option("--output", output, "output directory")->required();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  const std::filesystem::path dir(output);
  for (const char* f : {"train.jsonl", "test.jsonl"})
    if (std::filesystem::exists(dir / f)) {
      std::fprintf(stderr, "moetron data synthetic: %s already exists; it is never overwritten (choose another --output)\n",
                   (dir / f).string().c_str());
      return 2;
    }
  std::filesystem::create_directories(output);
  write_synthetic_chat((dir / "train.jsonl").string(), (dir / "test.jsonl").string(), o);
  std::printf("wrote %s/train.jsonl (%ld conversations) and %s/test.jsonl (%ld held out)\n", output.c_str(),
              o.train_examples, output.c_str(), o.test_examples);
  return 0;
}

}  // namespace moetron::cli
