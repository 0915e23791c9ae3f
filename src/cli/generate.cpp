// moetron generate: text generation with a KV cache from an HF model directory (plain, or --chat
// with the model's chat template), streaming the reply to stdout; --prompt-ids for token ids in and
// out; --eval-chat for the exact-answer accuracy over a chat JSONL file.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <CLI/CLI.hpp>

#include "cli/commands.h"
#include "cli/generation_options.h"
#include "core/error.h"
#include "infer/chat_format.h"
#include "infer/generate.h"
#include "infer/model.h"
#include "infer/perplexity.h"

namespace moetron::cli {

namespace {

std::vector<int32_t> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  std::string item;
  std::stringstream ss(s);
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    long v = 0;
    try {
      v = std::stol(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size() || v < 0 || v > INT32_MAX)
      fail("--prompt-ids: '{}' is not a token id (expected comma-separated non-negative integers)", item);
    ids.push_back((int32_t)v);
  }
  if (ids.empty()) fail("--prompt-ids: no ids given");
  return ids;
}

// A text file for --perplexity, whole: at most kMaxPerplexityBytes (Error naming the file otherwise).
constexpr uintmax_t kMaxPerplexityBytes = 64u << 20;

std::string read_text(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) fail("--perplexity: {} is not a readable file", path);
  const uintmax_t size = std::filesystem::file_size(path, ec);
  if (ec) fail("--perplexity: {}: {}", path, ec.message());
  if (size > kMaxPerplexityBytes)
    fail("--perplexity: {} is {} bytes; at most {} MiB of text is scored", path, size, kMaxPerplexityBytes >> 20);
  std::ifstream in(path, std::ios::binary);
  std::string text((size_t)size, '\0');
  if (!in.read(text.data(), (std::streamsize)size)) fail("--perplexity: could not read {}", path);
  return text;
}

}  // namespace

int run_generate(int argc, char** argv) {
  CLI::App app{"Generate text with a KV cache from a Hugging Face model directory (a moetron checkpoint or any HF\n"
               "Mixtral / Mistral / Llama directory).  Greedy by default; --temperature > 0 samples.",
               "moetron generate"};
  ModelOptions m;
  std::string prompt, prompt_ids, eval_chat, system;
  bool chat = false, stats = false;
  int max_new_tokens = 256;
  long limit = 0;
  GenerationOptions g;
  add_model_options(app, m);
  app.add_option("--prompt", prompt, "the prompt text");
  app.add_option("--prompt-ids", prompt_ids, "the prompt as comma-separated token ids; prints the reply's ids");
  app.add_flag("--chat", chat, "treat the prompt as a user turn and apply the chat template");
  app.add_option("--system", system, "with --chat: a system message first");
  app.add_option("--max-new-tokens", max_new_tokens, "stop after this many new tokens");
  add_generation_options(app, g);
  app.add_flag("--stats", stats, "print prompt length, prefill and decode tokens/s to stderr");
  app.add_option("--eval-chat", eval_chat,
                 "JSONL of conversations: report the exact-answer accuracy of the last assistant turn (greedy)");
  app.add_option("--limit", limit, "with --eval-chat: at most this many conversations (0: all)");
  std::string ppl_file;
  PerplexityOptions ppl;
  app.add_option("--perplexity", ppl_file,
                 "a text file: print the model's perplexity on it (BOS, then the text; windows of --ppl-ctx tokens)");
  app.add_option("--ppl-ctx", ppl.ctx, "with --perplexity: tokens per window, each from a fresh cache");
  app.add_option("--ppl-step", ppl.step,
                 "with --perplexity: tokens per forward call (1: one at a time, with the decoding kernels)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if ((int)!prompt.empty() + (int)!prompt_ids.empty() + (int)!eval_chat.empty() + (int)!ppl_file.empty() != 1)
    fail("give exactly one of --prompt, --prompt-ids, --eval-chat or --perplexity");
  if (max_new_tokens < 0) fail("--max-new-tokens must be >= 0, got {}", max_new_tokens);
  apply_generation_options(g);
  const LoadedModel model = load_model(m);
  const std::unique_ptr<Tokenizer> tok = load_model_tokenizer(m.dir, m.tokenizer_path, model.cfg,
                                                              /*required=*/prompt_ids.empty());
  Runner& runner = *model.runner;
  if (!ppl_file.empty()) {
    const std::vector<int32_t> ids = completion_prompt_tokens(*tok, read_text(ppl_file));
    const PerplexityResult r = perplexity(runner, ids, ppl);
    std::printf("perplexity: %.4f (%ld tokens scored in %d windows of up to %d; weights %s)\n", r.perplexity(),
                r.scored, r.windows, ppl.ctx, model.storage.c_str());
    return 0;
  }
  KvCache cache = runner.new_cache();
  GenerateOptions o;
  o.max_new_tokens = max_new_tokens;
  o.sampling = g.sampling;
  o.eos_ids = model_eos_ids(m.dir, model.cfg, tok.get());
  o.stop = g.stop;
  o.max_positions = model.cfg.max_position_embeddings;
  o.chat_reply = chat;

  if (!eval_chat.empty()) {
    const TemplateChoice tc = choose_chat_template(m.dir, m.template_name, tok->byte_level());
    add_chat_stop_ids(o.eos_ids, tc, *tok, model.cfg);
    const AnswerAccuracy acc = chat_answer_accuracy(
        runner, *tok, [&](const std::vector<ChatMessage>& msgs) { return chat_prompt_tokens(tc, *tok, msgs); }, o.eos_ids,
        eval_chat, max_new_tokens, limit);
    for (const std::string& e : acc.examples) std::printf("  %s\n", e.c_str());
    std::printf("exact-answer accuracy: %ld / %ld = %.1f%%\n", acc.correct, acc.total, 100.0 * acc.fraction());
    return 0;
  }
  GenerateResult r;
  if (!prompt_ids.empty()) {
    if (!g.stop.empty() && !tok) fail("--stop needs a tokenizer");
    const std::vector<int32_t> ids = parse_ids(prompt_ids);
    r = generate(runner, cache, ids, o, tok.get());
    for (size_t i = 0; i < r.tokens.size(); i++) std::printf("%s%d", i ? "," : "", r.tokens[i]);
    std::printf("\n");
  } else {
    std::vector<int32_t> ids;
    if (chat) {
      const TemplateChoice tc = choose_chat_template(m.dir, m.template_name, tok->byte_level());
      add_chat_stop_ids(o.eos_ids, tc, *tok, model.cfg);
      std::vector<ChatMessage> msgs;
      if (!system.empty()) msgs.push_back({Role::system, system});
      msgs.push_back({Role::user, prompt});
      ids = chat_prompt_tokens(tc, *tok, msgs);
    } else {
      if (!system.empty()) fail("--system needs --chat");
      ids = completion_prompt_tokens(*tok, prompt);
    }
    GenerateCallbacks cb;
    cb.on_text = [](const std::string& piece) {
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
      return true;
    };
    r = generate(runner, cache, ids, o, tok.get(), cb);
    std::printf("\n");
  }
  if (stats) {
    const double decoded = r.tokens.size() > 1 ? (double)r.tokens.size() - 1 : 0.0;
    std::fprintf(stderr, "prompt %d tokens, prefill %.1f tok/s; %zu new tokens, decode %.1f tok/s; finish: %s\n",
                 r.prompt_tokens, r.prompt_tokens / std::max(r.prefill_seconds, 1e-9), r.tokens.size(),
                 decoded / std::max(r.decode_seconds, 1e-9), finish_reason_name(r.finish));
  }
  return 0;
}

}  // namespace moetron::cli
