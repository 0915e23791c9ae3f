// Chat templates; chat_template.h states each format and the loss mask.
#include "tokenizer/chat_template.h"

#include <algorithm>
#include <vector>

namespace moetron {

namespace {

constexpr const char* kJoin = "\n\n";  // mistral-common's separator for merged messages and system prompts

void require_bos_eos(const Tokenizer& tok, ChatTemplate t) {
  if (tok.bos_id() < 0 || tok.eos_id() < 0)
    fail("chat template '{}' needs BOS and EOS tokens, but tokenizer '{}' has bos_id {} and eos_id {}",
         chat_template_name(t), tok.path(), tok.bos_id(), tok.eos_id());
}

// Appends tokens with one mask value.
struct Builder {
  const Tokenizer& tok;
  TokenizedDocument& out;
  void special(int32_t id, uint8_t m) {
    if (id < 0) return;
    out.tokens.push_back(id);
    out.loss_mask.push_back(m);
  }
  void text(std::string_view s, uint8_t m) {
    tok.encode_append(s, out.tokens);
    out.loss_mask.resize(out.tokens.size(), m);
  }
  void literal(std::string_view s, uint8_t m) {
    tok.encode_literal_append(s, out.tokens);
    out.loss_mask.resize(out.tokens.size(), m);
  }
};

std::string_view strip_ascii(std::string_view s) {
  const char* ws = " \t\n\r\v\f";
  const size_t b = s.find_first_not_of(ws);
  if (b == std::string_view::npos) return {};
  const size_t e = s.find_last_not_of(ws);
  return s.substr(b, e - b + 1);
}

// Joins the non-empty strings with "\n\n" (mistral-common's _aggregate_content_chunks).
void join_nonempty(std::string& acc, std::string_view part) {
  if (part.empty()) return;
  if (!acc.empty()) acc += kJoin;
  acc += part;
}

// ---- mistral (mistral-common v1) ----

void encode_mistral(const Tokenizer& tok, std::span<const ChatMessage> msgs, Builder& b) {
  require_bos_eos(tok, ChatTemplate::mistral);
  // Validation, as mistral-common's MistralRequestValidator (any mode) applies it.
  if (msgs.empty()) throw ChatError(ChatErrorKind::bad_role_order, "conversation has no messages");
  if (msgs.size() == 1 && msgs[0].role == Role::assistant)
    throw ChatError(ChatErrorKind::bad_role_order, "a conversation of one message must be a user or system message");
  for (size_t i = 0; i < msgs.size(); i++) {
    if (i > 0 && msgs[i - 1].role == Role::assistant && msgs[i].role == Role::system)
      throw ChatError(ChatErrorKind::bad_role_order,
                      fmt::format("message {}: a system message cannot follow an assistant message", i + 1));
    if (msgs[i].role == Role::assistant && msgs[i].content.empty())
      throw ChatError(ChatErrorKind::empty_assistant, fmt::format("message {}: assistant message is empty", i + 1));
  }
  // Normalisation (InstructRequestNormalizer): one system prompt; runs of one role merged.
  std::string system_prompt;
  for (const ChatMessage& m : msgs)
    if (m.role == Role::system) join_nonempty(system_prompt, m.content);
  struct Turn {
    Role role;
    std::string content;
  };
  std::vector<Turn> turns;
  for (size_t i = 0; i < msgs.size();) {
    size_t j = i;
    std::string content;
    while (j < msgs.size() && msgs[j].role == msgs[i].role) join_nonempty(content, msgs[j++].content);
    if (msgs[i].role != Role::system) turns.push_back({msgs[i].role, std::move(content)});
    i = j;
  }
  if (turns.empty() || turns[0].role != Role::user) turns.insert(turns.begin(), Turn{Role::user, ""});
  // Encoding (InstructTokenizerV1): the system prompt goes into the first user message.
  b.special(tok.bos_id(), 0);
  for (size_t i = 0; i < turns.size(); i++) {
    if (turns[i].role == Role::user) {
      std::string text = "[INST] ";
      if (i == 0 && !system_prompt.empty()) text += system_prompt + kJoin;
      text += turns[i].content;
      text += " [/INST]";
      b.text(text, 0);
    } else {
      b.text(turns[i].content, 1);
      b.special(tok.eos_id(), 1);
    }
  }
}

// ---- llama2 (Meta's chat_completion) ----

void encode_llama2(const Tokenizer& tok, std::span<const ChatMessage> msgs, Builder& b) {
  require_bos_eos(tok, ChatTemplate::llama2);
  if (msgs.empty()) throw ChatError(ChatErrorKind::bad_role_order, "conversation has no messages");
  size_t first = 0;
  std::string_view system;
  if (msgs[0].role == Role::system) {
    system = strip_ascii(msgs[0].content);
    first = 1;
  }
  if (first == msgs.size())
    throw ChatError(ChatErrorKind::bad_role_order, "llama2 template: a conversation needs a user message");
  for (size_t i = first; i < msgs.size(); i++) {
    const Role want = (i - first) % 2 == 0 ? Role::user : Role::assistant;
    if (msgs[i].role != want)
      throw ChatError(ChatErrorKind::bad_role_order,
                      fmt::format("llama2 template: message {} is {}, expected {} (an optional system message "
                                  "first, then user and assistant alternating)",
                                  i + 1, role_name(msgs[i].role), role_name(want)));
  }
  for (size_t i = first; i < msgs.size(); i += 2) {
    std::string prompt = "[INST] ";
    if (i == first && first == 1) {
      prompt += "<<SYS>>\n";
      prompt += system;
      prompt += "\n<</SYS>>\n\n";
    }
    prompt += strip_ascii(msgs[i].content);
    prompt += " [/INST]";
    b.special(tok.bos_id(), 0);
    b.text(prompt, 0);
    if (i + 1 < msgs.size()) {
      std::string answer(strip_ascii(msgs[i + 1].content));
      answer += ' ';
      b.text(answer, 1);
      b.special(tok.eos_id(), 1);
    }
  }
}

// ---- chatml ----

void encode_chatml(const Tokenizer& tok, std::span<const ChatMessage> msgs, const ChatOptions& opts, Builder& b) {
  if (msgs.empty()) throw ChatError(ChatErrorKind::bad_role_order, "conversation has no messages");
  b.special(tok.bos_id(), 0);
  for (const ChatMessage& m : msgs) {
    const uint8_t mask = m.role == Role::assistant ? 1 : 0;
    const std::string head = std::string("<|im_start|>") + role_name(m.role) + "\n";
    if (tok.byte_level()) {
      // HF renders the conversation as one string and tokenizes it whole; its added tokens split
      // the text, so each message's "ROLE\n" + content is one stretch of text, and a pre-token may
      // straddle the two ("\n\n" when the content starts with a newline).  Encode the stretch
      // whole; the tokens it shares with "ROLE\n" alone are markup, the rest (a straddling token
      // included, as HF's assistant mask counts it) are content.
      const size_t start = b.out.tokens.size();
      tok.encode_literal_append(head, b.out.tokens);
      const std::vector<int32_t> markup(b.out.tokens.begin() + (long)start, b.out.tokens.end());
      b.out.tokens.resize(start);
      tok.encode_literal_append(head + m.content + "<|im_end|>", b.out.tokens);
      size_t k = 0;
      while (k < markup.size() && start + k < b.out.tokens.size() && b.out.tokens[start + k] == markup[k]) k++;
      b.out.loss_mask.resize(start + k, 0);
      b.out.loss_mask.resize(b.out.tokens.size(), mask);
    } else {
      b.literal(head, 0);
      b.literal(m.content + "<|im_end|>", mask);
    }
    b.literal("\n", 0);
  }
  // EOS closes a final assistant message, unless the EOS is <|im_end|> itself (Qwen's instruct
  // tokenizer_config.json), which already closed it.
  if (msgs.back().role == Role::assistant && !(tok.eos_id() >= 0 && tok.eos_id() == tok.piece_to_id("<|im_end|>")))
    b.special(tok.eos_id(), 1);
  else if (opts.add_generation_prompt)
    b.literal("<|im_start|>assistant\n", 0);
}

// ---- raw ----

void encode_raw(const Tokenizer& tok, std::span<const ChatMessage> msgs, Builder& b) {
  if (msgs.empty()) throw ChatError(ChatErrorKind::bad_role_order, "conversation has no messages");
  b.special(tok.bos_id(), 0);
  for (const ChatMessage& m : msgs) {
    const uint8_t mask = m.role == Role::assistant ? 1 : 0;
    b.text(m.content, mask);
    if (m.role == Role::assistant) b.special(tok.eos_id(), 1);
  }
}

}  // namespace

Role parse_role(std::string_view name) {
  if (name == "user") return Role::user;
  if (name == "assistant") return Role::assistant;
  if (name == "system" || name == "developer") return Role::system;  // OpenAI's newer name for system
  std::string shown(name.substr(0, 40));
  throw ChatError(ChatErrorKind::unknown_role,
                  fmt::format("unknown role '{}' (expected system, developer, user or assistant)", shown));
}

const char* role_name(Role role) {
  switch (role) {
    case Role::system: return "system";
    case Role::user: return "user";
    case Role::assistant: return "assistant";
  }
  return "?";
}

const char* chat_error_kind_name(ChatErrorKind kind) {
  switch (kind) {
    case ChatErrorKind::unknown_role: return "unknown_role";
    case ChatErrorKind::bad_role_order: return "bad_role_order";
    case ChatErrorKind::empty_assistant: return "empty_assistant";
  }
  return "?";
}

ChatTemplate parse_chat_template(std::string_view name) {
  if (name == "mistral") return ChatTemplate::mistral;
  if (name == "llama2") return ChatTemplate::llama2;
  if (name == "chatml") return ChatTemplate::chatml;
  if (name == "raw") return ChatTemplate::raw;
  fail("unknown chat template '{}' (expected mistral, llama2, chatml or raw)", name);
}

const char* chat_template_name(ChatTemplate t) {
  switch (t) {
    case ChatTemplate::mistral: return "mistral";
    case ChatTemplate::llama2: return "llama2";
    case ChatTemplate::chatml: return "chatml";
    case ChatTemplate::raw: return "raw";
  }
  return "?";
}

size_t TokenizedDocument::loss_tokens() const {
  size_t n = 0;
  for (uint8_t m : loss_mask) n += m;
  return n;
}

void apply_chat_template(ChatTemplate tmpl, const Tokenizer& tok, std::span<const ChatMessage> messages,
                         const ChatOptions& opts, TokenizedDocument& out) {
  out.clear();
  Builder b{tok, out};
  switch (tmpl) {
    case ChatTemplate::mistral: encode_mistral(tok, messages, b); break;
    case ChatTemplate::llama2: encode_llama2(tok, messages, b); break;
    case ChatTemplate::chatml: encode_chatml(tok, messages, opts, b); break;
    case ChatTemplate::raw: encode_raw(tok, messages, b); break;
  }
  MOETRON_ASSERT(out.tokens.size() == out.loss_mask.size());
  if (opts.train_on_prompt) std::fill(out.loss_mask.begin(), out.loss_mask.end(), uint8_t{1});
}

TokenizedDocument apply_chat_template(ChatTemplate tmpl, const Tokenizer& tok, std::span<const ChatMessage> messages,
                                      const ChatOptions& opts) {
  TokenizedDocument d;
  apply_chat_template(tmpl, tok, messages, opts, d);
  return d;
}

std::vector<int32_t> chat_stop_ids(ChatTemplate tmpl, const Tokenizer& tok) {
  std::vector<int32_t> ids;
  if (tmpl == ChatTemplate::chatml)
    if (const int32_t id = tok.piece_to_id("<|im_end|>"); id >= 0) ids.push_back(id);
  return ids;
}

void tokenize_text(const Tokenizer& tok, std::string_view text, TokenizedDocument& out) {
  out.clear();
  Builder b{tok, out};
  b.special(tok.bos_id(), 1);
  b.text(text, 1);
  b.special(tok.eos_id(), 1);
}

}  // namespace moetron
