#include "infer/generate.h"
#include "core/json_limits.h"

#include <algorithm>
#include <chrono>
#include <fstream>
#include <optional>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "data/jsonl.h"
#include "core/error.h"
#include "infer/text_stream.h"

namespace moetron {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  const auto e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

// Logits with a NaN or an infinity (weights or activations that overflowed) cannot be sampled from:
// argmax and softmax would pick garbage token after garbage token.  Stop with an Error instead.
void check_logits(const float* logits, int V, int position) {
  const size_t i = first_non_finite(logits, (size_t)V);
  if (i != (size_t)V)
    fail("[generate] the model's logits at position {} are not finite (token {}: {}): the weights or activations "
         "overflowed; stopping instead of sampling from them",
         position, i, logits[i]);
}

}  // namespace

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::stop:
      return "stop";
    case FinishReason::length:
      return "length";
    case FinishReason::cancelled:
      return "cancelled";
  }
  return "?";
}

GenerateResult generate(Decoder& decoder, KvCache& cache, std::span<const int32_t> prompt, const GenerateOptions& opts,
                        const Tokenizer* tok, const GenerateCallbacks& cb) {
  if (prompt.empty()) fail("[generate] the prompt has no tokens");
  if (opts.max_new_tokens < 0) fail("[generate] max_new_tokens must be >= 0, got {}", opts.max_new_tokens);
  if (!tok && !opts.stop.empty()) fail("[generate] stop strings need a tokenizer");
  if (opts.max_positions > 0 && (int)prompt.size() > opts.max_positions)
    fail("[generate] the prompt has {} tokens, more than the model's {} positions", prompt.size(), opts.max_positions);
  const int V = decoder.vocab_size();
  GenerateResult r;
  r.prompt_tokens = (int)prompt.size();
  r.reused_tokens = reusable_prefix(cache, prompt);
  cache.truncate(r.reused_tokens);

  std::vector<float> logits(V);
  const auto t0 = Clock::now();
  decoder.forward(cache, prompt.subspan(r.reused_tokens), logits.data());
  check_logits(logits.data(), V, cache.len() - 1);
  r.prefill_seconds = seconds_since(t0);
  const auto t1 = Clock::now();

  Sampler sampler(opts.sampling, V);
  std::vector<int32_t> context(prompt.begin(), prompt.end());
  std::optional<TextStream> text;
  if (tok) {
    std::vector<int32_t> ctx;  // completions: decode from the prompt's last non-control token
    if (!opts.chat_reply)
      for (size_t i = prompt.size(); i-- > 0;)
        if (prompt[i] != tok->bos_id() && prompt[i] != tok->eos_id() && !tok->decode(prompt.subspan(i, 1)).empty()) {
          ctx.push_back(prompt[i]);
          break;
        }
    text.emplace(*tok, ctx, opts.stop);
  }
  auto emit = [&](const std::string& piece) { return piece.empty() || !cb.on_text || cb.on_text(piece); };

  r.finish = FinishReason::length;
  bool done = opts.max_new_tokens == 0;
  while (!done) {
    const int32_t next = sampler.next(logits.data(), context, r.tokens);
    if (std::find(opts.eos_ids.begin(), opts.eos_ids.end(), next) != opts.eos_ids.end()) {
      r.finish = FinishReason::stop;
      break;
    }
    r.tokens.push_back(next);
    context.push_back(next);
    if (cb.on_token && !cb.on_token(next)) {
      r.finish = FinishReason::cancelled;
      break;
    }
    if (text) {
      if (!emit(text->push(next))) {
        r.finish = FinishReason::cancelled;
        break;
      }
      if (text->stopped()) {
        r.finish = FinishReason::stop;
        break;
      }
    }
    if ((int)r.tokens.size() >= opts.max_new_tokens) break;
    if (opts.max_positions > 0 && cache.len() + 1 >= opts.max_positions) break;  // no room for another token
    decoder.forward(cache, std::span<const int32_t>(&next, 1), logits.data());
    check_logits(logits.data(), V, cache.len() - 1);
  }
  if (text) {
    if (r.finish != FinishReason::cancelled && !emit(text->finish())) r.finish = FinishReason::cancelled;
    r.text = text->text();
  }
  r.decode_seconds = seconds_since(t1);
  return r;
}

std::vector<int32_t> generate_greedy(Decoder& decoder, KvCache& cache, std::span<const int32_t> prompt,
                                     int max_new_tokens, std::span<const int32_t> eos_ids) {
  GenerateOptions o;
  o.max_new_tokens = max_new_tokens;
  o.eos_ids.assign(eos_ids.begin(), eos_ids.end());
  return generate(decoder, cache, prompt, o, nullptr).tokens;
}

std::vector<int32_t> chat_prompt_tokens(ChatTemplate tmpl, const Tokenizer& tok, const std::vector<ChatMessage>& messages) {
  ChatOptions o;
  o.add_generation_prompt = true;
  return apply_chat_template(tmpl, tok, messages, o).tokens;
}

std::vector<int32_t> completion_prompt_tokens(const Tokenizer& tok, const std::string& text) {
  std::vector<int32_t> ids;
  if (tok.bos_id() >= 0) ids.push_back(tok.bos_id());
  tok.encode_append(text, ids);
  return ids;
}

AnswerAccuracy chat_answer_accuracy(Decoder& decoder, const Tokenizer& tok, ChatTemplate tmpl,
                                    std::span<const int32_t> eos_ids, const std::string& jsonl_path,
                                    int max_new_tokens, long limit) {
  LineReader in(jsonl_path);  // lines of up to kDefaultMaxLineBytes; longer ones are never held
  AnswerAccuracy acc;
  KvCache cache = decoder.new_cache();
  for (std::string line; (limit <= 0 || acc.total < limit) && in.next(line);) {
    const size_t line_no = in.line_number();
    if (in.too_long())
      fail("{}:{}: the line is {} bytes, more than the {} a conversation may take", jsonl_path, line_no,
           in.line_bytes(), kDefaultMaxLineBytes);
    if (trim(line).empty()) continue;
    const auto j = parse_json_or_discarded(line);
    if (!j.is_object() || !j.contains("messages") || !j["messages"].is_array() || j["messages"].empty())
      fail("{}:{}: expected an object with a non-empty 'messages' array", jsonl_path, line_no);
    std::vector<ChatMessage> msgs;
    for (const auto& m : j["messages"]) {
      if (!m.is_object() || !m.contains("role") || !m.contains("content") || !m["role"].is_string() ||
          !m["content"].is_string())
        fail("{}:{}: each message needs string 'role' and 'content'", jsonl_path, line_no);
      msgs.push_back({parse_role(m["role"].get<std::string>()), m["content"].get<std::string>()});
    }
    if (msgs.back().role != Role::assistant)
      fail("{}:{}: the last message must be the assistant's answer", jsonl_path, line_no);
    const std::string expected = trim(msgs.back().content);
    msgs.pop_back();
    const std::vector<int32_t> prompt = chat_prompt_tokens(tmpl, tok, msgs);
    // The model's positions bound prompt + reply, as for --prompt.
    const int positions = decoder.config().max_position_embeddings;
    if (positions > 0 && (long)prompt.size() > positions)
      fail("{}:{}: the conversation is {} tokens, more than the model's {} positions (max_position_embeddings)",
           jsonl_path, line_no, prompt.size(), positions);
    GenerateOptions o;
    o.max_new_tokens = max_new_tokens;
    o.eos_ids.assign(eos_ids.begin(), eos_ids.end());
    o.max_positions = positions;
    std::vector<int32_t> reply = generate(decoder, cache, prompt, o, nullptr).tokens;
    // Ids past the tokenizer (the model's padding rows) have no text (see text_stream.h).
    std::erase_if(reply, [&](int32_t id) { return id >= tok.vocab_size(); });
    const std::string text = trim(tok.decode(reply));
    acc.total++;
    acc.correct += text == expected;
    if (acc.examples.size() < 5)
      acc.examples.push_back(fmt::format("{} => {} (expected {})", msgs.back().content, text, expected));
  }
  return acc;
}

}  // namespace moetron
