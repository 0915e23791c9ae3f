// moetron data prepare: chat / prompt-completion / text JSONL -> token and loss-mask datasets.
//   moetron data prepare --input F.jsonl... --tokenizer T.model|tokenizer.json --output DIR [--template auto]
//                        [--format auto] [--valid-fraction 0.01 | --valid-input V.jsonl...]
//                        [--train-on-prompt] [--threads N] [--strict] [--seed S] [--max-line-bytes N]
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "cli/commands.h"
#include "cli/threads.h"
#include "core/error.h"
#include "core/sha256.h"
#include "data/prepare.h"
#include "io/output_guard.h"
#include "jinja/model_template.h"

namespace moetron::cli {

namespace fs = std::filesystem;

namespace {

// --template: a built-in format, or a Jinja template (the model directory's, beside the tokenizer,
// or a file) with the special tokens of the tokenizer_config.json beside the tokenizer.
void resolve_template(const std::string& name, PrepareOptions& o) {
  const bool file = name.size() > 6 && name.compare(name.size() - 6, 6, ".jinja") == 0;
  if (name != "auto" && name != "jinja" && !file) {
    o.chat_template = parse_chat_template(name);
    return;
  }
  const std::string dir = fs::path(o.tokenizer_path).parent_path().string();
  const bool json_tokenizer = fs::path(o.tokenizer_path).extension() == ".json";
  std::optional<jinja::ModelTemplate> mt;
  if (file) {
    mt = jinja::load_template_file(name, dir.empty() ? "." : dir);
  } else {
    mt = jinja::load_model_template(dir.empty() ? "." : dir);
  }
  if (!mt || (name == "auto" && !json_tokenizer)) {
    if (name == "jinja")
      throw InputError(fmt::format("--template jinja: {} holds no chat template (chat_template.jinja or tokenizer_config.json's "
                                   "\"chat_template\")", dir.empty() ? "." : dir));
    o.chat_template = ChatTemplate::mistral;  // auto without a template (or with a SentencePiece model)
    return;
  }
  if (!json_tokenizer)
    throw InputError(fmt::format("--template {}: a Jinja template needs a Hugging Face tokenizer.json (byte-level BPE) to "
                                 "encode its rendering as transformers does; for {} use mistral | llama2 | chatml | raw",
                                 name, o.tokenizer_path));
  JinjaChat jc;
  jc.tmpl = std::make_shared<const jinja::Template>(mt->source, fs::path(mt->origin).filename().string());
  jc.special_tokens = mt->special_tokens;
  jc.origin = mt->origin;
  jc.sha256 = sha256_hex(mt->source);
  std::fprintf(stderr, "data prepare: chat template %s (Jinja)\n", mt->origin.c_str());
  o.jinja = std::move(jc);
}

int run_data_prepare(int argc, char** argv) {
  CLI::App app{"Tokenize JSONL ('messages' chats, 'prompt'+'completion' pairs or 'text' documents) with a chat "
               "template into Megatron .bin/.idx token and loss-mask datasets plus dataset.json.",
               "moetron data prepare"};
  PrepareOptions o;
  std::string tmpl = "auto", format = "auto";
  bool quiet = false;
  app.add_option("--input", o.inputs, "JSONL input files")->required();
  app.add_option("--tokenizer", o.tokenizer_path, "SentencePiece tokenizer.model or Hugging Face tokenizer.json (byte-level BPE)")->required();
  app.add_option("--output", o.output_dir, "output directory")->required();
  app.add_option("--template", tmpl,
                 "chat template: auto (the model's own Jinja template when the tokenizer.json's directory has one, "
                 "else mistral) | jinja (that template, required) | F.jinja (a template file) | mistral | llama2 | "
                 "chatml | raw");
  app.add_option("--format", format, "auto | chat | prompt_completion | text (auto: detected per file)")
      ->check(CLI::IsMember({"auto", "chat", "prompt_completion", "text"}));
  auto* frac = app.add_option("--valid-fraction", o.valid_fraction,
                              "fraction of the input lines that go to the valid split (default 0.01)");
  auto* vin = app.add_option("--valid-input", o.valid_inputs, "JSONL files for the valid split instead");
  frac->excludes(vin);
  app.add_flag("--train-on-prompt", o.train_on_prompt, "put every token in the loss, not only the assistant's");
  app.add_option("--threads", o.threads, "tokenizer threads (default: all)");
  app.add_flag("--strict", o.strict, "stop at the first unusable line (exit 1, nothing written)");
  app.add_option("--seed", o.seed, "seed of the train/valid split");
  app.add_option("--max-line-bytes", o.max_line_bytes,
                 "longer lines are skipped unread (reason line_too_long; --strict: an error); default 16 MiB")
      ->check(CLI::PositiveNumber);
  app.add_flag("--quiet", quiet, "do not list skipped lines on stderr");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  check_thread_count("--threads", o.threads);
  resolve_template(tmpl, o);
  o.format = parse_record_format(format);
  o.progress = ::isatty(STDERR_FILENO);
  if (quiet) o.log = nullptr;
  {  // the output directory never holds (and so never replaces) an input, the tokenizer included
    InputPaths inputs;
    for (const std::string& f : o.inputs) inputs.files.emplace_back(f);
    for (const std::string& f : o.valid_inputs) inputs.files.emplace_back(f);
    inputs.files.emplace_back(o.tokenizer_path);
    refuse_output_over_inputs(o.output_dir, inputs, "--output");
  }
  const PrepareReport r = prepare_dataset(o);
  std::printf("wrote %s: train %llu documents, %llu tokens (%llu in the loss); valid %llu documents, %llu tokens "
              "(%llu in the loss); %llu lines read, %llu skipped, %llu blank; %.1f s with %d threads\n",
              o.output_dir.c_str(), (unsigned long long)r.train.documents, (unsigned long long)r.train.tokens,
              (unsigned long long)r.train.loss_tokens, (unsigned long long)r.valid.documents,
              (unsigned long long)r.valid.tokens, (unsigned long long)r.valid.loss_tokens,
              (unsigned long long)r.lines, (unsigned long long)r.skipped, (unsigned long long)r.blank_lines, r.seconds,
              r.threads);
  if (r.skipped) {
    std::printf("skipped lines by reason:");
    for (int k = 0; k < kSkipReasonCount; k++)
      if (r.skipped_by_reason[k])
        std::printf(" %s %llu", skip_reason_name((SkipReason)k), (unsigned long long)r.skipped_by_reason[k]);
    std::printf(" (listed in dataset.json)\n");
  }
  return 0;
}

}  // namespace

int run_data(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") {
    std::fprintf(argc < 2 ? stderr : stdout,
                 "usage: moetron data prepare --input F.jsonl... --tokenizer T.model --output DIR [options]\n");
    return argc < 2 ? 2 : 0;
  }
  const std::string what = argv[1];
  if (what == "prepare") return run_data_prepare(argc - 1, argv + 1);
  if (what == "synthetic") return run_data_synthetic(argc - 1, argv + 1);
  std::fprintf(stderr, "moetron data: unknown subcommand '%s' (available: prepare, synthetic)\n", what.c_str());
  return 2;
}

}  // namespace moetron::cli
