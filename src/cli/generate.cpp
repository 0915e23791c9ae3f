// moetron generate: greedy text generation from an HF model directory; or, with --eval-chat, the
// exact-answer accuracy over a chat JSONL file.
#include <cstdio>
#include <filesystem>
#include <string>

#include <CLI/CLI.hpp>

#include "cli/commands.h"
#include "core/error.h"
#include "infer/generate.h"
#include "io/hf_config.h"
#include "io/model_files.h"
#include "model/mixtral.h"
#include "model/weights.h"

namespace fs = std::filesystem;

namespace moetron::cli {

int run_generate(int argc, char** argv) {
  CLI::App app{"Greedy generation from a Hugging Face model directory (a moetron checkpoint or any HF Mixtral /\n"
               "Mistral / Llama directory with tokenizer.model).",
               "moetron generate"};
  std::string model_dir, prompt, tokenizer_path, template_name = "mistral", eval_chat;
  bool chat = false;
  int max_new_tokens = 64;
  long limit = 0;
  app.add_option("--model", model_dir, "model directory")->required();
  app.add_option("--prompt", prompt, "the prompt text");
  app.add_flag("--chat", chat, "treat the prompt as a user turn and apply the chat template");
  app.add_option("--template", template_name, "chat template: mistral | llama2 | chatml | raw");
  app.add_option("--tokenizer", tokenizer_path, "tokenizer.model (default: MODEL/tokenizer.model)");
  app.add_option("--max-new-tokens", max_new_tokens, "stop after this many new tokens");
  app.add_option("--eval-chat", eval_chat,
                 "JSONL of conversations: report the exact-answer accuracy of the last assistant turn");
  app.add_option("--limit", limit, "with --eval-chat: at most this many conversations (0: all)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (prompt.empty() == eval_chat.empty()) fail("give exactly one of --prompt or --eval-chat");
  if (tokenizer_path.empty()) tokenizer_path = (fs::path(model_dir) / "tokenizer.model").string();
  if (!fs::exists(tokenizer_path))
    fail("{}: no tokenizer.model; pass --tokenizer PATH", tokenizer_path);
  const Tokenizer tok = Tokenizer::load(tokenizer_path);
  const ModelConfig cfg = load_model_config((fs::path(model_dir) / "config.json").string());
  if (tok.vocab_size() > cfg.vocab_size)
    fail("{}: the tokenizer has {} pieces but the model's vocab_size is {}", tokenizer_path, tok.vocab_size(),
         cfg.vocab_size);
  MixtralModel model(cfg);
  load_hf_weights(ModelTensors::open(model_dir), model.table(), model.params().data(), model_dir);
  const ChatTemplate tmpl = parse_chat_template(template_name);

  if (!eval_chat.empty()) {
    const AnswerAccuracy acc = chat_answer_accuracy(model, tok, tmpl, eval_chat, max_new_tokens, limit);
    for (const std::string& e : acc.examples) std::printf("  %s\n", e.c_str());
    std::printf("exact-answer accuracy: %ld / %ld = %.1f%%\n", acc.correct, acc.total, 100.0 * acc.fraction());
    return 0;
  }
  std::vector<int32_t> ids;
  if (chat) {
    ids = chat_prompt_tokens(tmpl, tok, {ChatMessage{Role::user, prompt}});
  } else {
    if (tok.bos_id() >= 0) ids.push_back(tok.bos_id());
    tok.encode_append(prompt, ids);
  }
  const std::vector<int32_t> out = generate_greedy(model, ids, max_new_tokens, tok.eos_id());
  std::printf("%s\n", tok.decode(out).c_str());
  return 0;
}

}  // namespace moetron::cli
