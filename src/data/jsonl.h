// JSONL training records: reading files line by line and parsing one line into a record.
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

#include "tokenizer/chat_template.h"
#include "tokenizer/utf8.h"  // is_valid_utf8

namespace moetron {

// The default longest line a LineReader holds: 16 MiB, far above any real chat record.  A longer line
// is not read into memory (a JSON DOM, its strings and the tokenizer's work arrays take tens of times
// a line's size: a 200 MB line took 4 GB).
constexpr size_t kDefaultMaxLineBytes = size_t{16} << 20;

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
};
constexpr int kSkipReasonCount = 8;
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

// Reads a text file line by line ('\n' separated; the '\n' is dropped, a final line without one is
// still a line).  Memory: the current line (at most max_line_bytes; a longer one is measured by
// reading ahead and never stored) and two 1 MiB buffers.
class LineReader {
 public:
  // Error naming the file if it cannot be opened or is a directory.
  explicit LineReader(const std::string& path, size_t max_line_bytes = kDefaultMaxLineBytes);
  ~LineReader();
  LineReader(const LineReader&) = delete;
  LineReader& operator=(const LineReader&) = delete;

  // Reads the next line into `line`; false at the end of the file.  Error on a read error.  A line of
  // more than max_line_bytes bytes is consumed without being stored: `line` is then empty and
  // too_long() true (line_bytes() says how long it was).
  bool next(std::string& line);
  bool too_long() const { return too_long_; }          // of the last line read
  uint64_t line_bytes() const { return line_bytes_; }  // length of the last line read, without its '\n'
  size_t max_line_bytes() const { return max_line_; }
  size_t line_number() const { return line_number_; }  // 1-based number of the last line read
  uint64_t bytes_read() const { return bytes_read_; }
  uint64_t file_size() const { return file_size_; }
  const std::string& path() const { return path_; }

 private:
  bool fill();  // refills buf_; false at the end of the file
  bool longer_than_limit();  // whether the line starting at pos_ (past the buffer) exceeds max_line_

  std::string path_;
  int fd_ = -1;
  std::vector<char> buf_;
  std::vector<char> scan_;  // longer_than_limit's read-ahead (allocated on first use)
  size_t pos_ = 0, len_ = 0;
  size_t max_line_;
  bool too_long_ = false;
  uint64_t line_bytes_ = 0;
  size_t line_number_ = 0;
  uint64_t bytes_read_ = 0, file_size_ = 0;
};

}  // namespace moetron
