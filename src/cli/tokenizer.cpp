// moetron tokenizer train: a SentencePiece tokenizer from chat / prompt-completion / text JSONL.
//   moetron tokenizer train --input F.jsonl... --vocab-size N --output PREFIX
#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "cli/commands.h"
#include "cli/threads.h"
#include "core/error.h"
#include "io/output_guard.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/trainer.h"

namespace moetron::cli {

namespace {

int run_tokenizer_train(int argc, char** argv) {
  CLI::App app{"Train a SentencePiece tokenizer (BPE with byte fallback by default) on JSONL data: chat "
               "('messages'), prompt/completion or 'text' lines.  Writes PREFIX.model and PREFIX.vocab.",
               "moetron tokenizer train"};
  TokenizerTrainOptions o;
  std::string format = "auto";
  bool no_byte_fallback = false;
  app.add_option("--input", o.inputs, "JSONL input files")->required();
  app.add_option("--vocab-size", o.vocab_size, "number of pieces in the vocabulary")->required();
  app.add_option("--output", o.output_prefix,
                 "output prefix (not a directory): writes PREFIX.model and PREFIX.vocab, e.g. out/tokenizer")
      ->required();
  app.add_flag("--force", o.overwrite, "replace an existing PREFIX.model / PREFIX.vocab");
  app.add_option("--model-type", o.model_type, "bpe | unigram")->check(CLI::IsMember({"bpe", "unigram"}));
  app.add_option("--format", format, "auto | chat | prompt_completion | text")
      ->check(CLI::IsMember({"auto", "chat", "prompt_completion", "text"}));
  app.add_option("--character-coverage", o.character_coverage, "fraction of characters covered by pieces");
  app.add_option("--max-sentences", o.max_sentences, "sample at most this many sentences");
  app.add_option("--user-defined-symbols", o.user_defined_symbols, "strings that are always one piece")
      ->delimiter(',');
  app.add_flag("--no-byte-fallback", no_byte_fallback, "map unknown characters to <unk> instead of bytes");
  app.add_option("--threads", o.threads, "training threads (default: all)");
  app.add_option("--seed", o.seed, "seed of SentencePiece's sentence sampling");
  app.add_flag("--verbose", o.verbose, "show SentencePiece's training log");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  check_thread_count("--threads", o.threads);
  o.format = parse_record_format(format);
  o.byte_fallback = !no_byte_fallback;
  {  // --force replaces an earlier tokenizer, never an input (a JSONL file named PREFIX.model)
    InputPaths inputs;
    for (const std::string& f : o.inputs) inputs.files.emplace_back(f);
    for (const char* ext : {".model", ".vocab"}) refuse_output_over_inputs(o.output_prefix + ext, inputs, "--output");
  }
  const TokenizerTrainResult r = train_tokenizer(o);
  const Tokenizer t = Tokenizer::load(r.model_path);
  std::printf("wrote %s (%d pieces, sha256 %s) and %s from %zu texts", r.model_path.c_str(), t.vocab_size(),
              t.sha256().c_str(), r.vocab_path.c_str(), r.texts);
  if (r.skipped_lines) std::printf("; skipped %zu unusable lines", r.skipped_lines);
  std::printf("\n");
  return 0;
}

}  // namespace

int run_tokenizer(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") {
    std::fprintf(argc < 2 ? stderr : stdout,
                 "usage: moetron tokenizer train --input F.jsonl... --vocab-size N --output PREFIX [options]\n");
    return argc < 2 ? 2 : 0;
  }
  const std::string what = argv[1];
  if (what == "train") return run_tokenizer_train(argc - 1, argv + 1);
  std::fprintf(stderr, "moetron tokenizer: unknown subcommand '%s' (available: train)\n", what.c_str());
  return 2;
}

}  // namespace moetron::cli
