#include "data/jsonl.h"
#include "core/json_limits.h"

#include <cstdlib>
#include <optional>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/chat_content.h"
#include "tokenizer/utf8.h"

namespace moetron {

RecordFormat parse_record_format(std::string_view name) {
  if (name == "auto") return RecordFormat::auto_detect;
  if (name == "chat") return RecordFormat::chat;
  if (name == "prompt_completion") return RecordFormat::prompt_completion;
  if (name == "text") return RecordFormat::text;
  fail("unknown input format '{}' (expected auto, chat, prompt_completion or text)", name);
}

const char* record_format_name(RecordFormat f) {
  switch (f) {
    case RecordFormat::auto_detect: return "auto";
    case RecordFormat::chat: return "chat";
    case RecordFormat::prompt_completion: return "prompt_completion";
    case RecordFormat::text: return "text";
  }
  return "?";
}

const char* skip_reason_name(SkipReason r) {
  switch (r) {
    case SkipReason::invalid_json: return "invalid_json";
    case SkipReason::invalid_utf8: return "invalid_utf8";
    case SkipReason::missing_field: return "missing_field";
    case SkipReason::unknown_role: return "unknown_role";
    case SkipReason::bad_role_order: return "bad_role_order";
    case SkipReason::empty_assistant: return "empty_assistant";
    case SkipReason::no_loss_tokens: return "no_loss_tokens";
    case SkipReason::line_too_long: return "line_too_long";
    case SkipReason::template_error: return "template_error";
    case SkipReason::not_prefix_stable: return "not_prefix_stable";
  }
  return "?";
}

SkipReason skip_reason_of(ChatErrorKind k) {
  switch (k) {
    case ChatErrorKind::unknown_role: return SkipReason::unknown_role;
    case ChatErrorKind::bad_role_order: return SkipReason::bad_role_order;
    case ChatErrorKind::empty_assistant: return SkipReason::empty_assistant;
  }
  return SkipReason::bad_role_order;
}

namespace {

bool set_error(RecordError& err, SkipReason r, std::string msg) {
  err.reason = r;
  err.message = std::move(msg);
  return false;
}

RecordFormat format_of_object(const nlohmann::json& j) {
  if (!j.is_object()) return RecordFormat::auto_detect;
  if (j.contains("messages")) return RecordFormat::chat;
  if (j.contains("prompt") && j.contains("completion")) return RecordFormat::prompt_completion;
  if (j.contains("text")) return RecordFormat::text;
  return RecordFormat::auto_detect;
}

// Points at a string member, or returns nullptr.  Non-const: parse_record moves the strings out of
// its own DOM rather than copying them (a copy is one more line-sized buffer).
std::string* string_member(nlohmann::json& j, const char* key) {
  const auto it = j.find(key);
  if (it == j.end() || !it->is_string()) return nullptr;
  return it->get_ptr<std::string*>();
}

}  // namespace

bool parse_record(std::string_view line, RecordFormat format, Record& out, RecordError& err) {
  out.messages.clear();
  out.text.clear();
  if (!is_valid_utf8(line)) return set_error(err, SkipReason::invalid_utf8, "the line is not valid UTF-8");
  nlohmann::json j = parse_json_or_discarded(line);
  if (j.is_discarded())
    return set_error(err, SkipReason::invalid_json,
                     fmt::format("the line is not valid JSON (or nested deeper than {} levels)", kMaxJsonDepth));
  if (!j.is_object()) return set_error(err, SkipReason::invalid_json, "the line is JSON but not an object");
  if (format == RecordFormat::auto_detect) {
    format = format_of_object(j);
    if (format == RecordFormat::auto_detect)
      return set_error(err, SkipReason::missing_field, "none of 'messages', 'prompt'+'completion' or 'text'");
  }
  out.format = format;
  switch (format) {
    case RecordFormat::chat: {
      const auto it = j.find("messages");
      if (it == j.end()) return set_error(err, SkipReason::missing_field, "no 'messages' (the file's format is chat)");
      if (!it->is_array()) return set_error(err, SkipReason::missing_field, "'messages' is not an array");
      out.messages.reserve(it->size());
      for (size_t i = 0; i < it->size(); i++) {
        nlohmann::json& m = (*it)[i];
        if (!m.is_object())
          return set_error(err, SkipReason::missing_field, fmt::format("messages[{}] is not an object", i));
        const std::string* role = string_member(m, "role");
        if (!role) return set_error(err, SkipReason::missing_field, fmt::format("messages[{}] has no string 'role'", i));
        const auto content = m.find("content");
        if (content == m.end())
          return set_error(err, SkipReason::missing_field, fmt::format("messages[{}] has no 'content'", i));
        ContentError bad;
        std::optional<std::string> text;
        if (content->is_string())
          text = std::move(content->get_ref<std::string&>());  // moved, not copied (a line-sized string)
        else
          text = chat_content_text(*content, bad);
        if (!text)
          return set_error(err, SkipReason::missing_field,
                           fmt::format("messages[{}].content{} {}", i, bad.where, bad.message));
        ChatMessage cm;
        try {
          cm.role = parse_role(*role);
        } catch (const ChatError& e) {
          return set_error(err, skip_reason_of(e.kind()), fmt::format("messages[{}]: {}", i, e.what()));
        }
        cm.content = std::move(*text);
        out.messages.push_back(std::move(cm));
      }
      return true;
    }
    case RecordFormat::prompt_completion: {
      std::string* prompt = string_member(j, "prompt");
      std::string* completion = string_member(j, "completion");
      if (!prompt || !completion)
        return set_error(err, SkipReason::missing_field,
                         "needs string 'prompt' and 'completion' (the file's format is prompt_completion)");
      out.messages.push_back({Role::user, std::move(*prompt)});
      out.messages.push_back({Role::assistant, std::move(*completion)});
      return true;
    }
    case RecordFormat::text: {
      std::string* text = string_member(j, "text");
      if (!text) return set_error(err, SkipReason::missing_field, "no string 'text' (the file's format is text)");
      out.text = std::move(*text);
      return true;
    }
    case RecordFormat::auto_detect: break;
  }
  return set_error(err, SkipReason::missing_field, "unknown format");
}

RecordFormat detect_file_format(const std::string& path, size_t max_lines, size_t max_line_bytes) {
  LineReader r(path, max_line_bytes);
  std::string line;
  while (r.line_number() < max_lines && r.next(line)) {
    if (r.too_long() || !is_valid_utf8(line)) continue;
    nlohmann::json j = parse_json_or_discarded(line);
    if (j.is_discarded()) continue;
    const RecordFormat f = format_of_object(j);
    if (f != RecordFormat::auto_detect) return f;
  }
  return RecordFormat::auto_detect;
}

}  // namespace moetron
