// Text generation with a KV cache: prefill the prompt (reusing the cached prefix it shares with the
// previous sequence), then decode one token at a time until an end-of-sequence token, a stop string,
// max_new_tokens, the model's position limit, or the caller cancels.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "infer/runner.h"
#include "infer/sampler.h"
#include "infer/text_stream.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace moetron {

enum class FinishReason { stop, length, cancelled };
// "stop" (EOS or a stop string), "length" (max_new_tokens or the position limit), "cancelled".
const char* finish_reason_name(FinishReason r);

struct GenerateOptions {
  int max_new_tokens = 256;
  SamplingParams sampling;
  std::vector<int32_t> eos_ids;   // any of them ends the reply (not part of it)
  std::vector<std::string> stop;  // stop strings (need a tokenizer)
  int max_positions = 0;          // > 0: prompt + reply never exceed this many positions
  bool chat_reply = true;         // text of a chat reply (true) or of a completion (see text_stream.h)
};

struct GenerateResult {
  std::vector<int32_t> tokens;  // the reply's tokens, without the EOS that ended it
  std::string text;             // the reply's text (with a tokenizer), stop string excluded
  FinishReason finish = FinishReason::length;
  int prompt_tokens = 0;
  int reused_tokens = 0;         // prompt tokens whose keys/values came from the cache
  double prefill_seconds = 0.0;  // the prompt's forward pass
  double decode_seconds = 0.0;   // everything after it
};

struct GenerateCallbacks {
  // Each new token of the reply; return false to stop (FinishReason::cancelled).
  std::function<bool(int32_t)> on_token;
  // Each piece of final text (never empty); return false to stop (cancelled).
  std::function<bool(const std::string&)> on_text;
};

// One generation, step by step, so a server can run several in one batch (Runner::forward_batch):
//   Generation g(runner, cache, prompt, opts, tok, cb);      // validates, prefills
//   while (g.advance()) { <logits of g.next_token() at g.cache()'s next position into g.logits()>; g.fed(); }
//   GenerateResult r = g.finish();
// generate() below is exactly this loop with Runner::forward.  Errors (bad options, non-finite
// logits) are Errors thrown by the constructor, advance() or fed().
class Generation {
 public:
  // prefill false: the caller feeds to_prefill() into cache() itself (e.g. several prompts at once with
  // Runner::prefill_rows), writes the last token's logits into logits(), then calls prefilled().
  Generation(Runner& runner, KvCache& cache, std::span<const int32_t> prompt, const GenerateOptions& opts,
             const Tokenizer* tok, GenerateCallbacks callbacks = {}, bool prefill = true);
  // The prompt tokens not already in the cache (never empty).
  std::span<const int32_t> to_prefill() const { return to_prefill_; }
  void prefilled();
  // Samples a token from the current logits and hands it out (callbacks, text, stop checks): true when
  // generation goes on and next_token() must be fed, false when it has finished.
  bool advance();
  int32_t next_token() const { return next_; }
  KvCache& cache() { return cache_; }
  float* logits() { return logits_.data(); }
  // The logits of next_token() are in logits() (and the cache holds its keys and values).
  void fed();
  // Flushes the text and returns the result (once, after advance() returned false).
  GenerateResult finish();

 private:
  KvCache& cache_;
  const GenerateOptions& opts_;
  const Tokenizer* tok_;
  GenerateCallbacks cb_;
  int V_;
  GenerateResult r_;
  std::vector<float> logits_;
  Sampler sampler_;
  std::vector<int32_t> context_;
  std::optional<TextStream> text_;
  std::chrono::steady_clock::time_point t0_, t1_;
  std::span<const int32_t> to_prefill_;
  int32_t next_ = -1;
  bool done_ = false;
  bool emit(const std::string& piece);
};

// `tok` may be null for token-only generation (then `stop` must be empty).  The cache holds the
// prompt and reply afterwards (except the last sampled token), ready for a follow-up prompt.
GenerateResult generate(Runner& runner, KvCache& cache, std::span<const int32_t> prompt, const GenerateOptions& opts,
                        const Tokenizer* tok, const GenerateCallbacks& callbacks = {});

// Greedy tokens (at most max_new_tokens; stops before any of eos_ids).
std::vector<int32_t> generate_greedy(Runner& runner, KvCache& cache, std::span<const int32_t> prompt,
                                     int max_new_tokens, std::span<const int32_t> eos_ids);

// The prompt tokens for a chat: the template applied to `messages` (ending with a user turn) with the
// generation prompt.
std::vector<int32_t> chat_prompt_tokens(ChatTemplate tmpl, const Tokenizer& tok, const std::vector<ChatMessage>& messages);

// The prompt tokens for a plain completion: BOS (when the tokenizer has one) + encode(text).
std::vector<int32_t> completion_prompt_tokens(const Tokenizer& tok, const std::string& text);

struct AnswerAccuracy {
  long correct = 0, total = 0;
  std::vector<std::string> examples;  // a few "prompt => reply (expected ...)" lines
  double fraction() const { return total > 0 ? (double)correct / (double)total : 0.0; }
};

// Exact-answer accuracy over a chat JSONL file: for each line's conversation the last assistant turn
// is the expected answer, everything before it the prompt; the greedy reply (whitespace-trimmed) must
// equal the answer (whitespace-trimmed).  Errors name file:line for unusable lines.
AnswerAccuracy chat_answer_accuracy(Runner& runner, const Tokenizer& tok, ChatTemplate tmpl,
                                    std::span<const int32_t> eos_ids, const std::string& jsonl_path,
                                    int max_new_tokens, long limit);
// The same with any formatting of the conversation (e.g. infer/chat_format.h's, a model's template).
AnswerAccuracy chat_answer_accuracy(Runner& runner, const Tokenizer& tok,
                                    const std::function<std::vector<int32_t>(const std::vector<ChatMessage>&)>& prompt_of,
                                    std::span<const int32_t> eos_ids, const std::string& jsonl_path, int max_new_tokens,
                                    long limit);

}  // namespace moetron
