#include "infer/generate.h"
#include "core/json_limits.h"

#include <algorithm>
#include <chrono>
#include <fstream>
#include <optional>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "io/line_reader.h"
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

namespace {

void check_options(std::span<const int32_t> prompt, const GenerateOptions& opts, const Tokenizer* tok) {
  if (prompt.empty()) fail("[generate] the prompt has no tokens");
  if (opts.max_new_tokens < 0) fail("[generate] max_new_tokens must be >= 0, got {}", opts.max_new_tokens);
  if (!tok && !opts.stop.empty()) fail("[generate] stop strings need a tokenizer");
  if (opts.max_positions > 0 && (int)prompt.size() > opts.max_positions)
    fail("[generate] the prompt has {} tokens, more than the model's {} positions", prompt.size(), opts.max_positions);
}

}  // namespace

Generation::Generation(Runner& runner, KvCache& cache, std::span<const int32_t> prompt, const GenerateOptions& opts,
                       const Tokenizer* tok, GenerateCallbacks callbacks, bool prefill)
    : cache_(cache), opts_((check_options(prompt, opts, tok), opts)), tok_(tok), cb_(std::move(callbacks)),
      V_(runner.vocab_size()), logits_(V_), sampler_(opts.sampling, V_) {
  r_.prompt_tokens = (int)prompt.size();
  r_.reused_tokens = reusable_prefix(cache, prompt);
  cache.truncate(r_.reused_tokens);
  to_prefill_ = prompt.subspan(r_.reused_tokens);
  t0_ = Clock::now();
  if (prefill) {
    runner.forward(cache, to_prefill_, logits_.data());
    prefilled();
  }
  context_.assign(prompt.begin(), prompt.end());
  if (tok) {
    std::vector<int32_t> ctx;  // completions: decode from the prompt's last non-control token
    if (!opts.chat_reply)
      for (size_t i = prompt.size(); i-- > 0;)
        if (prompt[i] != tok->bos_id() && prompt[i] != tok->eos_id() && !tok->decode(prompt.subspan(i, 1)).empty()) {
          ctx.push_back(prompt[i]);
          break;
        }
    text_.emplace(*tok, ctx, opts.stop);
  }
  r_.finish = FinishReason::length;
  done_ = opts.max_new_tokens == 0;
}

void Generation::prefilled() {
  check_finite_logits("generate", logits_.data(), 1, V_, cache_.len() - 1);
  r_.prefill_seconds = seconds_since(t0_);
  t1_ = Clock::now();
}

bool Generation::emit(const std::string& piece) { return piece.empty() || !cb_.on_text || cb_.on_text(piece); }

bool Generation::advance() {
  if (done_) return false;
  done_ = true;  // unless every check below lets it go on
  const int32_t next = sampler_.next(logits_.data(), context_, r_.tokens);
  if (std::find(opts_.eos_ids.begin(), opts_.eos_ids.end(), next) != opts_.eos_ids.end()) {
    r_.finish = FinishReason::stop;
    return false;
  }
  r_.tokens.push_back(next);
  context_.push_back(next);
  if (cb_.on_token && !cb_.on_token(next)) {
    r_.finish = FinishReason::cancelled;
    return false;
  }
  if (text_) {
    if (!emit(text_->push(next))) {
      r_.finish = FinishReason::cancelled;
      return false;
    }
    if (text_->stopped()) {
      r_.finish = FinishReason::stop;
      return false;
    }
  }
  if ((int)r_.tokens.size() >= opts_.max_new_tokens) return false;
  if (opts_.max_positions > 0 && cache_.len() + 1 >= opts_.max_positions) return false;  // no room for another
  next_ = next;
  done_ = false;
  return true;
}

void Generation::fed() { check_finite_logits("generate", logits_.data(), 1, V_, cache_.len() - 1); }

GenerateResult Generation::finish() {
  if (text_) {
    if (r_.finish != FinishReason::cancelled && !emit(text_->finish())) r_.finish = FinishReason::cancelled;
    r_.text = text_->text();
  }
  r_.decode_seconds = seconds_since(t1_);
  return std::move(r_);
}

GenerateResult generate(Runner& runner, KvCache& cache, std::span<const int32_t> prompt, const GenerateOptions& opts,
                        const Tokenizer* tok, const GenerateCallbacks& cb) {
  Generation g(runner, cache, prompt, opts, tok, cb);
  while (g.advance()) {
    const int32_t next = g.next_token();
    runner.forward(cache, std::span<const int32_t>(&next, 1), g.logits());
    g.fed();
  }
  return g.finish();
}

std::vector<int32_t> generate_greedy(Runner& runner, KvCache& cache, std::span<const int32_t> prompt,
                                     int max_new_tokens, std::span<const int32_t> eos_ids) {
  GenerateOptions o;
  o.max_new_tokens = max_new_tokens;
  o.eos_ids.assign(eos_ids.begin(), eos_ids.end());
  return generate(runner, cache, prompt, o, nullptr).tokens;
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

AnswerAccuracy chat_answer_accuracy(Runner& runner, const Tokenizer& tok, ChatTemplate tmpl,
                                    std::span<const int32_t> eos_ids, const std::string& jsonl_path,
                                    int max_new_tokens, long limit) {
  return chat_answer_accuracy(
      runner, tok, [&](const std::vector<ChatMessage>& m) { return chat_prompt_tokens(tmpl, tok, m); }, eos_ids,
      jsonl_path, max_new_tokens, limit);
}

AnswerAccuracy chat_answer_accuracy(Runner& runner, const Tokenizer& tok,
                                    const std::function<std::vector<int32_t>(const std::vector<ChatMessage>&)>& prompt_of,
                                    std::span<const int32_t> eos_ids, const std::string& jsonl_path, int max_new_tokens,
                                    long limit) {
  LineReader in(jsonl_path);  // lines of up to kDefaultMaxLineBytes; longer ones are never held
  AnswerAccuracy acc;
  KvCache cache = runner.new_cache();
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
    const std::vector<int32_t> prompt = prompt_of(msgs);
    // The model's positions bound prompt + reply, as for --prompt.
    const int positions = runner.config().max_position_embeddings;
    if (positions > 0 && (long)prompt.size() > positions)
      fail("{}:{}: the conversation is {} tokens, more than the model's {} positions (max_position_embeddings)",
           jsonl_path, line_no, prompt.size(), positions);
    GenerateOptions o;
    o.max_new_tokens = max_new_tokens;
    o.eos_ids.assign(eos_ids.begin(), eos_ids.end());
    o.max_positions = positions;
    std::vector<int32_t> reply = generate(runner, cache, prompt, o, nullptr).tokens;
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
