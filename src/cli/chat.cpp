// moetron chat: an interactive multi-turn chat on the terminal.  Each line read is a user turn; the
// reply streams as it is generated and joins the history, so later turns see the whole conversation
// (the KV cache keeps the shared prefix, so only the new turn is computed).  Commands: /reset (forget
// the history), /system TEXT (set the system message and reset), /exit (or end of input).
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <string>

#include <CLI/CLI.hpp>

#include "cli/commands.h"
#include "cli/generation_options.h"
#include "core/error.h"
#include "infer/chat_format.h"
#include "infer/generate.h"
#include "infer/model.h"

namespace moetron::cli {

int run_chat(int argc, char** argv) {
  CLI::App app{"Interactive multi-turn chat with a model directory, using its chat template.\n"
               "Type a message and Enter; /reset forgets the conversation, /system TEXT sets a system\n"
               "message (and resets), /exit or end of input quits.",
               "moetron chat"};
  ModelOptions m;
  std::string system;
  int max_new_tokens = 512;
  GenerationOptions g;
  add_model_options(app, m);
  app.add_option("--system", system, "a system message at the start of the conversation");
  app.add_option("--max-new-tokens", max_new_tokens, "longest reply in tokens");
  add_generation_options(app, g);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (max_new_tokens < 1) fail("--max-new-tokens must be >= 1, got {}", max_new_tokens);
  apply_generation_options(g);
  const LoadedModel model = load_model(m);
  const std::unique_ptr<Tokenizer> tok = load_model_tokenizer(m.dir, m.tokenizer_path, model.cfg, true);
  const TemplateChoice tc = choose_chat_template(m.dir, m.template_name, tok->byte_level());
  Runner& runner = *model.runner;
  KvCache cache = runner.new_cache();
  GenerateOptions o;
  o.max_new_tokens = max_new_tokens;
  o.sampling = g.sampling;
  o.eos_ids = model_eos_ids(m.dir, model.cfg, tok.get());
  add_chat_stop_ids(o.eos_ids, tc, *tok, model.cfg);
  o.stop = g.stop;
  o.max_positions = model.cfg.max_position_embeddings;
  o.chat_reply = true;

  const bool interactive = isatty(STDIN_FILENO);
  if (interactive)
    std::printf("moetron chat: %s, template %s (%s). /reset, /system TEXT, /exit\n", m.dir.c_str(),
                tc.name().c_str(), tc.source.c_str());
  std::vector<ChatMessage> history;
  auto reset = [&] {
    history.clear();
    if (!system.empty()) history.push_back({Role::system, system});
  };
  reset();
  std::string line;
  for (;;) {
    if (interactive) {
      std::printf("> ");
      std::fflush(stdout);
    }
    if (!std::getline(std::cin, line)) break;
    if (line == "/exit" || line == "/quit") break;
    if (line == "/reset") {
      reset();
      std::printf("[conversation reset]\n");
      std::fflush(stdout);
      continue;
    }
    if (line.rfind("/system", 0) == 0 && (line.size() == 7 || line[7] == ' ')) {
      system = line.size() > 8 ? line.substr(8) : "";
      reset();
      std::printf("[system message %s; conversation reset]\n", system.empty() ? "cleared" : "set");
      std::fflush(stdout);
      continue;
    }
    if (line.empty()) continue;
    history.push_back({Role::user, line});
    std::vector<int32_t> prompt;
    try {
      prompt = chat_prompt_tokens(tc, *tok, history);
    } catch (const Error& e) {
      history.pop_back();
      std::printf("[cannot format this conversation: %s]\n", e.what());
      continue;
    }
    if (o.max_positions > 0 && (int)prompt.size() >= o.max_positions) {
      history.pop_back();
      std::printf("[the conversation (%zu tokens) fills the model's %d positions; /reset to start over]\n",
                  prompt.size(), o.max_positions);
      std::fflush(stdout);
      continue;
    }
    GenerateCallbacks cb;
    cb.on_text = [](const std::string& piece) {
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
      return true;
    };
    const GenerateResult r = generate(runner, cache, prompt, o, tok.get(), cb);
    std::printf("\n");
    std::fflush(stdout);
    history.push_back({Role::assistant, r.text.empty() ? std::string(" ") : r.text});
  }
  return 0;
}

}  // namespace moetron::cli
