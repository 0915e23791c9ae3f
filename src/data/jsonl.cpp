#include "data/jsonl.h"
#include "core/json_limits.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include <nlohmann/json.hpp>

#include "core/error.h"
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
        std::string* content = string_member(m, "content");
        if (!content)
          return set_error(err, SkipReason::missing_field, fmt::format("messages[{}] has no string 'content'", i));
        ChatMessage cm;
        try {
          cm.role = parse_role(*role);
        } catch (const ChatError& e) {
          return set_error(err, skip_reason_of(e.kind()), fmt::format("messages[{}]: {}", i, e.what()));
        }
        cm.content = std::move(*content);
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

LineReader::LineReader(const std::string& path, size_t max_line_bytes) : path_(path), max_line_(max_line_bytes) {
  if (max_line_ == 0) fail("{}: the maximum line length must be at least 1 byte", path);
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) fail("{}: cannot open: {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd_, &st) == 0) {
    if (S_ISDIR(st.st_mode)) {
      ::close(fd_);
      fd_ = -1;
      fail("{}: is a directory, expected a JSONL file", path);
    }
    file_size_ = (uint64_t)st.st_size;
  }
  buf_.resize(size_t{1} << 20);
}

LineReader::~LineReader() {
  if (fd_ >= 0) ::close(fd_);
}

bool LineReader::fill() {
  pos_ = len_ = 0;
  for (;;) {
    const ssize_t n = ::read(fd_, buf_.data(), buf_.size());
    if (n > 0) {
      len_ = (size_t)n;
      return true;
    }
    if (n == 0) return false;
    if (errno != EINTR) fail("{}: read error after line {}: {}", path_, line_number_, std::strerror(errno));
  }
}

bool LineReader::longer_than_limit() {
  // The line runs past the buffer: its length is found by reading ahead with pread (into scan_, not
  // stored), up to its '\n' or one byte past the limit, so a line over the limit is never held --
  // not even its first max_line bytes.  Lines that fit the buffer (nearly all) skip this.
  uint64_t n = len_ - pos_;
  off_t at = (off_t)(bytes_read_ + (len_ - pos_));  // the file offset of the buffer's end
  scan_.resize(buf_.size());
  while (n <= max_line_) {
    const ssize_t got = ::pread(fd_, scan_.data(), scan_.size(), at);
    if (got < 0) {
      if (errno == EINTR) continue;
      fail("{}: read error after line {}: {}", path_, line_number_, std::strerror(errno));
    }
    if (got == 0) break;  // the file ends the line
    const char* nl = static_cast<const char*>(std::memchr(scan_.data(), '\n', (size_t)got));
    n += nl ? (uint64_t)(nl - scan_.data()) : (uint64_t)got;
    if (nl) break;
    at += got;
  }
  return n > max_line_;
}

bool LineReader::next(std::string& line) {
  line.clear();
  too_long_ = false;
  if (pos_ == len_ && !fill()) return false;
  if (!std::memchr(buf_.data() + pos_, '\n', len_ - pos_) && longer_than_limit()) {
    too_long_ = true;
    std::string().swap(line);
  }
  uint64_t n = 0;
  bool any = false;
  for (;;) {
    if (pos_ == len_ && !fill()) break;
    any = true;
    const char* p = buf_.data() + pos_;
    const size_t avail = len_ - pos_;
    const char* nl = static_cast<const char*>(std::memchr(p, '\n', avail));
    const size_t take = nl ? (size_t)(nl - p) : avail;
    n += take;
    if (!too_long_) {
      if (n > max_line_) {
        too_long_ = true;
        std::string().swap(line);  // give back what the line held so far
      } else {
        line.append(p, take);
      }
    }
    const size_t used = take + (nl ? 1 : 0);
    pos_ += used;
    bytes_read_ += used;
    if (nl) break;
  }
  if (!any) return false;
  line_number_++;
  line_bytes_ = n;
  return true;
}

}  // namespace moetron
