// moetron: one binary, one subcommand per job (DESIGN §2).
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>

#include "cli/commands.h"
#include "core/error.h"
#include "core/interrupt.h"

namespace {

void print_usage(FILE* f) {
  std::fprintf(f,
               "usage: moetron <command> [options]\n"
               "\n"
               "commands:\n"
               "  forward   one forward (and backward) pass of an HF model directory on a batch\n"
               "  tokenizer train a SentencePiece tokenizer (tokenizer train)\n"
               "  data      prepare chat / prompt-completion / text JSONL into token datasets (data prepare)\n"
               "  generate  text generation with a KV cache (generate --model DIR --prompt TEXT [--chat])\n"
               "  chat      interactive multi-turn chat with a model (chat --model DIR; /reset, /exit)\n"
               "  serve     OpenAI-compatible HTTP server (serve --model DIR [--host 127.0.0.1] [--port 8000])\n"
               "  train     train from a YAML config (train -c CONFIG [key=value ...])\n"
               "  eval      validation loss and perplexity of a checkpoint (eval -c CONFIG [--model DIR])\n"
               "  plan      validate a parallel layout; per-rank memory, FLOPs, communication (plan C.yaml -n N)\n"
               "  convert   re-encode a model / checkpoint directory: dtype, shard size, optimizer state\n"
               "  template  a chat template applied as transformers does (template render --model DIR --input F.jsonl)\n"
               "  export    a model directory as a GGUF file for llama.cpp / ollama (export gguf --model DIR --output F)\n"
               "  report    an HTML page of a run's curves and expert-load heatmaps (report RUN_DIR)\n"
               "  bench     benchmarks (bench train | data | checkpoint | generate)\n"
               "\n"
               "Run 'moetron <command> --help' for a command's options.\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    print_usage(stderr);
    return 2;
  }
  const std::string cmd = argv[1];
  if (cmd == "-h" || cmd == "--help" || cmd == "help") {
    print_usage(stdout);
    return 0;
  }
  // Commands that write files unwind on SIGINT / SIGTERM, removing their temporaries (core/interrupt.h);
  // train and serve have their own handling, and the others write nothing that outlives them.
  std::optional<moetron::InterruptScope> interrupt;
  if (cmd == "forward" || cmd == "convert" || cmd == "export" || cmd == "data") interrupt.emplace();
  try {
    if (cmd == "forward") return moetron::cli::run_forward(argc - 1, argv + 1);
    if (cmd == "generate") return moetron::cli::run_generate(argc - 1, argv + 1);
    if (cmd == "chat") return moetron::cli::run_chat(argc - 1, argv + 1);
    if (cmd == "serve") return moetron::cli::run_serve(argc - 1, argv + 1);
    if (cmd == "train") return moetron::cli::run_train(argc - 1, argv + 1);
    if (cmd == "eval") return moetron::cli::run_eval(argc - 1, argv + 1);
    if (cmd == "bench") return moetron::cli::run_bench(argc - 1, argv + 1);
    if (cmd == "tokenizer") return moetron::cli::run_tokenizer(argc - 1, argv + 1);
    if (cmd == "data") return moetron::cli::run_data(argc - 1, argv + 1);
    if (cmd == "convert") return moetron::cli::run_convert(argc - 1, argv + 1);
    if (cmd == "export") return moetron::cli::run_export(argc - 1, argv + 1);
    if (cmd == "report") return moetron::cli::run_report(argc - 1, argv + 1);
    if (cmd == "plan") return moetron::cli::run_plan(argc - 1, argv + 1);
    if (cmd == "template") return moetron::cli::run_template(argc - 1, argv + 1);
  } catch (const moetron::Interrupted& e) {
    std::fprintf(stderr, "moetron %s: %s\n", cmd.c_str(), e.what());
    return 128 + e.signal();
  } catch (const moetron::InputError& e) {
    std::fprintf(stderr, "moetron %s: error: %s\n", cmd.c_str(), e.what());
    return 2;
  } catch (const moetron::Error& e) {
    std::fprintf(stderr, "moetron %s: error: %s\n", cmd.c_str(), e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moetron %s: unexpected error: %s\n", cmd.c_str(), e.what());
    return 1;
  }
  std::fprintf(stderr, "moetron: unknown command '%s'\n", cmd.c_str());
  print_usage(stderr);
  return 2;
}
