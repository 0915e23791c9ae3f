#include "infer/generate.h"

#include <algorithm>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace moetron {

namespace {

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  const auto e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

}  // namespace

std::vector<int32_t> generate_greedy(MixtralModel& model, const std::vector<int32_t>& prompt, int max_new_tokens,
                                     int32_t eos_id) {
  if (prompt.empty()) fail("[generate] the prompt has no tokens");
  const int V = model.config().vocab_size;
  Batch b;
  b.B = 1;
  b.input_ids = prompt;
  std::vector<int32_t> out;
  for (int i = 0; i < max_new_tokens; i++) {
    b.T = (int)b.input_ids.size();
    model.forward(b, {});
    const float* last = model.logits() + (size_t)(b.T - 1) * V;
    const int32_t next = (int32_t)(std::max_element(last, last + V) - last);
    if (next == eos_id) break;
    out.push_back(next);
    b.input_ids.push_back(next);
  }
  return out;
}

std::vector<int32_t> chat_prompt_tokens(ChatTemplate tmpl, const Tokenizer& tok, const std::vector<ChatMessage>& messages) {
  ChatOptions o;
  o.add_generation_prompt = true;
  return apply_chat_template(tmpl, tok, messages, o).tokens;
}

AnswerAccuracy chat_answer_accuracy(MixtralModel& model, const Tokenizer& tok, ChatTemplate tmpl,
                                    const std::string& jsonl_path, int max_new_tokens, long limit) {
  std::ifstream in(jsonl_path);
  if (!in) fail("{}: cannot open", jsonl_path);
  AnswerAccuracy acc;
  long line_no = 0;
  for (std::string line; std::getline(in, line) && (limit <= 0 || acc.total < limit);) {
    line_no++;
    if (trim(line).empty()) continue;
    const auto j = nlohmann::json::parse(line, nullptr, false);
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
    const std::vector<int32_t> reply = generate_greedy(model, chat_prompt_tokens(tmpl, tok, msgs), max_new_tokens,
                                                       tok.eos_id());
    const std::string text = trim(tok.decode(reply));
    acc.total++;
    acc.correct += text == expected;
    if (acc.examples.size() < 5)
      acc.examples.push_back(fmt::format("{} => {} (expected {})", msgs.back().content, text, expected));
  }
  return acc;
}

}  // namespace moetron
