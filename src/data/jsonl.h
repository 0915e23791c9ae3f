// JSONL training records: parsing one line into a record (io/line_reader.h reads the lines).
//
// A line is one JSON object in one of three formats:
//   chat               {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
//                      (OpenAI / Hugging Face style, the No Robots schema; other keys are ignored)
//   prompt_completion  {"prompt": "...", "completion": "..."}  -> a user and an assistant message
//   text               {"text": "..."}                         -> a plain document
// `auto` detects the format of a file from its first object that has one of these keys, checked in
// the order messages, prompt+completion, text (No Robots lines carry both "prompt" and "messages").
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "io/line_reader.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/utf8.h"  // is_valid_utf8

namespace moetron {

enum class RecordFormat : uint8_t { auto_detect, chat, prompt_completion, text };
// "auto" | "chat" | "prompt_completion" | "text"; Error otherwise.
RecordFormat parse_record_format(std::string_view name);
const char* record_format_name(RecordFormat f);

// Why a line was not used; counted per kind in dataset.json.
enum class SkipReason : uint8_t {
  invalid_json,     // not parseable JSON, or not an object
  invalid_utf8,     // the line's bytes are not valid UTF-8
  missing_field,    // the file's format needs a key the line lacks, or a value has the wrong type
  unknown_role,     // a message role other than system/user/assistant
  bad_role_order,   // an order of roles the chat template cannot express
  empty_assistant,  // an empty assistant message (mistral template, as mistral-common)
  no_loss_tokens,   // the document has no token in the loss (no assistant message) and
                    // --train-on-prompt is off
  line_too_long,    // more bytes than the reader's maximum line length (never held in memory)
  template_error,   // the model's Jinja template refused the conversation (raise_exception, ...)
  not_prefix_stable,  // a template without {% generation %} that renders earlier turns differently
                      // once later ones exist: the assistant turns cannot be located for the mask
};
constexpr int kSkipReasonCount = 10;
const char* skip_reason_name(SkipReason r);
SkipReason skip_reason_of(ChatErrorKind k);

// One parsed line.
struct Record {
  RecordFormat format = RecordFormat::chat;
  std::vector<ChatMessage> messages;  // chat and prompt_completion
  std::string text;                   // text
};

struct RecordError {
  SkipReason reason = SkipReason::invalid_json;
  std::string message;
};

// Parses one line of a file whose format is `format` (auto_detect: this line's own keys decide).
// Returns false and fills `err` when the line cannot be used; never throws for bad input.
bool parse_record(std::string_view line, RecordFormat format, Record& out, RecordError& err);

// The format of a file from its first JSON object with a recognised key, reading at most
// `max_lines` lines (lines longer than max_line_bytes are passed over); auto_detect when there is
// none.  Error naming the file if it cannot be read.
RecordFormat detect_file_format(const std::string& path, size_t max_lines = 10000,
                                size_t max_line_bytes = kDefaultMaxLineBytes);

}  // namespace moetron
