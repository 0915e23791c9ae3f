#include "server/http_request.h"

#include <algorithm>
#include <cstdint>
#include <string_view>

#include <fmt/format.h>

namespace moetron::server::http {

namespace {

constexpr size_t kMaxChunkLine = 1024;    // a chunk-size line: hex digits and extensions
constexpr size_t kMaxTrailerBytes = 8192;  // trailer fields after the last chunk (read, then dropped)
constexpr uint64_t kHuge = uint64_t(1) << 62;  // saturation for declared sizes: "larger than any limit"

bool is_tchar(unsigned char c) {
  if (c >= '0' && c <= '9') return true;
  if ((c | 0x20) >= 'a' && (c | 0x20) <= 'z') return true;
  return std::string_view("!#$%&'*+-.^_`|~").find((char)c) != std::string_view::npos;
}

bool is_token(std::string_view s) { return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return is_tchar(c); }); }

char lower(char c) { return c >= 'A' && c <= 'Z' ? char(c + 32) : c; }

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) { return lower(x) == lower(y); });
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  c = lower(c);
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

// %XX escapes decoded; a '%' not followed by two hex digits is kept as it is.
std::string percent_decode(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); i++) {
    if (s[i] == '%' && i + 2 < s.size() && hex_value(s[i + 1]) >= 0 && hex_value(s[i + 2]) >= 0) {
      out += char(hex_value(s[i + 1]) * 16 + hex_value(s[i + 2]));
      i += 2;
    } else {
      out += s[i];
    }
  }
  return out;
}

// A comma-separated header value's elements, each trimmed (empty elements dropped).
std::vector<std::string_view> list_elements(std::string_view v) {
  std::vector<std::string_view> out;
  while (!v.empty()) {
    const size_t comma = v.find(',');
    const std::string_view e = trim(v.substr(0, comma));
    if (!e.empty()) out.push_back(e);
    if (comma == std::string_view::npos) break;
    v.remove_prefix(comma + 1);
  }
  return out;
}

}  // namespace

const std::string* Request::header(std::string_view name) const {
  for (const auto& [k, v] : headers)
    if (k == name) return &v;
  return nullptr;
}

void RequestParser::reset() {
  std::string remote = std::move(req_.remote_addr);
  req_ = Request{};
  req_.remote_addr = std::move(remote);
  state_ = State::idle;
  scanned_ = line_start_ = lines_ = 0;
  chunked_ = false;
  body_left_ = 0;
  chunk_ = Chunk::size_line;
  trailer_bytes_ = 0;
  continue_due_ = keep_alive_ = false;
  error_status_ = 0;
  error_message_.clear();
}

RequestParser::State RequestParser::fail(int status, std::string message) {
  error_status_ = status;
  error_message_ = std::move(message);
  keep_alive_ = false;
  continue_due_ = false;
  return state_ = State::failed;
}

RequestParser::State RequestParser::feed(std::string& in) {
  if (state_ == State::idle) {
    // Empty lines before a request line are ignored (RFC 9112 2.2: some clients send one after a body).
    size_t skip = 0;
    while (skip + 1 < in.size() && in[skip] == '\r' && in[skip + 1] == '\n') skip += 2;
    in.erase(0, skip);
    if (in.empty() || (in.size() == 1 && in[0] == '\r')) return state_;
    state_ = State::head;
  }
  if (state_ == State::head && scan_head(in) != State::body) return state_;
  if (state_ == State::body) return read_body(in);
  return state_;
}

RequestParser::State RequestParser::end_of_input() {
  if (state_ == State::head || state_ == State::body)
    return fail(400, "The connection was closed before the request was complete.");
  return state_;
}

// Looks for the end of the head in the bytes received so far, checking each new byte once: CR only
// before LF, lines within max_line_bytes, at most max_headers fields, the head within max_head_bytes.
RequestParser::State RequestParser::scan_head(std::string& in) {
  for (; scanned_ < in.size(); scanned_++) {
    const char c = in[scanned_];
    if (scanned_ + 1 > opts_.max_head_bytes)
      return fail(431, fmt::format("The request head exceeds this server's limit of {} bytes.", opts_.max_head_bytes));
    if (scanned_ > 0 && in[scanned_ - 1] == '\r' && c != '\n')
      return fail(400, "Bad request: a CR not followed by LF in the request head.");
    if (c != '\n') {
      if (scanned_ + 1 - line_start_ > opts_.max_line_bytes + 1) {  // + 1: room for the CR of CRLF
        if (lines_ == 0)
          return fail(414, fmt::format("The request line exceeds this server's limit of {} bytes.", opts_.max_line_bytes));
        return fail(431, fmt::format("A request header line exceeds this server's limit of {} bytes.", opts_.max_line_bytes));
      }
      continue;
    }
    if (scanned_ == 0 || in[scanned_ - 1] != '\r') return fail(400, "Bad request: a bare LF in the request head.");
    const bool empty_line = scanned_ - 1 == line_start_;
    line_start_ = scanned_ + 1;
    if (!empty_line) {
      if (++lines_ > opts_.max_headers + 1)
        return fail(431, fmt::format("The request has more than {} header fields.", opts_.max_headers));
      continue;
    }
    const size_t head_end = scanned_ + 1;
    const std::string head = in.substr(0, head_end);
    in.erase(0, head_end);
    if (parse_head(head) == State::failed) return state_;
    return state_ = State::body;
  }
  return state_;
}

// The complete head (ending in an empty line): request line, fields, then the framing they imply.
RequestParser::State RequestParser::parse_head(const std::string& head) {
  std::string_view rest(head);
  auto next_line = [&rest] {
    const size_t end = rest.find("\r\n");
    const std::string_view line = rest.substr(0, end);
    rest.remove_prefix(end + 2);
    return line;
  };

  // Request line: method SP request-target SP HTTP-version, single spaces.
  const std::string_view line = next_line();
  const size_t sp1 = line.find(' '), sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp2 == std::string_view::npos || line.find(' ', sp2 + 1) != std::string_view::npos)
    return fail(400, "Bad request: the request line is not 'METHOD /path HTTP/1.1'.");
  const std::string_view method = line.substr(0, sp1), target = line.substr(sp1 + 1, sp2 - sp1 - 1),
                         version = line.substr(sp2 + 1);
  if (!is_token(method)) return fail(400, "Bad request: the method is not a token.");
  if (target.empty() || target[0] != '/' ||
      !std::all_of(target.begin(), target.end(), [](char c) { return (unsigned char)c > 0x20 && (unsigned char)c < 0x7f; }))
    return fail(400, "Bad request: the request target must be a path starting with '/'.");
  if (version == "HTTP/1.1")
    req_.minor_version = 1;
  else if (version == "HTTP/1.0")
    req_.minor_version = 0;
  else
    return fail(400, "Bad request: this server speaks HTTP/1.0 and HTTP/1.1 only.");
  req_.method = std::string(method);
  req_.target = std::string(target);
  req_.path = percent_decode(target.substr(0, target.find('?')));

  // Header fields: name ":" OWS value OWS, no whitespace before the colon, no line folding.
  while (!rest.empty()) {
    const std::string_view field = next_line();
    if (field.empty()) break;
    const size_t colon = field.find(':');
    if (colon == std::string_view::npos || !is_token(field.substr(0, colon)))
      return fail(400, "Bad request: a header line is not 'Name: value'.");
    const std::string_view value = trim(field.substr(colon + 1));
    if (std::any_of(value.begin(), value.end(), [](char c) { return ((unsigned char)c < 0x20 && c != '\t') || c == 0x7f; }))
      return fail(400, "Bad request: a control character in a header value.");
    std::string name(field.substr(0, colon));
    std::transform(name.begin(), name.end(), name.begin(), lower);
    req_.headers.emplace_back(std::move(name), std::string(value));
  }

  // Framing and the fields that change how the request is read.
  bool has_length = false, has_te = false, has_host = false, close = false, keep = false, expect = false;
  uint64_t length = 0;
  std::string te;
  for (const auto& [name, value] : req_.headers) {
    if (name == "content-length") {
      if (value.empty() || !std::all_of(value.begin(), value.end(), [](char c) { return c >= '0' && c <= '9'; }))
        return fail(400, "Bad request: Content-Length is not a non-negative integer.");
      uint64_t n = 0;
      for (char c : value) n = n >= kHuge / 10 ? kHuge : n * 10 + uint64_t(c - '0');
      if (has_length && n != length) return fail(400, "Bad request: differing Content-Length headers.");
      has_length = true;
      length = n;
    } else if (name == "transfer-encoding") {
      has_te = true;
      te += (te.empty() ? "" : ",") + value;
    } else if (name == "host") {
      if (has_host) return fail(400, "Bad request: more than one Host header.");
      has_host = true;
    } else if (name == "connection") {
      for (std::string_view e : list_elements(value)) {
        close = close || iequals(e, "close");
        keep = keep || iequals(e, "keep-alive");
      }
    } else if (name == "content-encoding") {
      for (std::string_view e : list_elements(value))
        if (!iequals(e, "identity"))
          return fail(415, fmt::format("Content-Encoding '{}' is not supported; send the body unencoded.",
                                       std::string(e.substr(0, 40))));
    } else if (name == "expect") {
      if (!iequals(value, "100-continue"))
        return fail(417, "Expect: only 100-continue is supported.");
      expect = true;
    }
  }
  keep_alive_ = !close && (req_.minor_version == 1 || keep);
  if (req_.minor_version == 1 && !has_host) return fail(400, "Bad request: an HTTP/1.1 request needs a Host header.");
  if (has_te) {
    if (has_length) return fail(400, "Bad request: both Content-Length and Transfer-Encoding.");
    if (req_.minor_version == 0) return fail(400, "Bad request: Transfer-Encoding in an HTTP/1.0 request.");
    const std::vector<std::string_view> codings = list_elements(te);
    if (codings.size() != 1 || !iequals(codings[0], "chunked"))
      return fail(400, "Bad request: the only Transfer-Encoding supported is chunked.");
    chunked_ = true;
  } else if (length > opts_.max_body_bytes) {
    return fail(413, fmt::format("The request body exceeds this server's limit of {} bytes.", opts_.max_body_bytes));
  } else {
    body_left_ = (size_t)length;
    req_.body.reserve(body_left_);
  }
  continue_due_ = expect && req_.minor_version == 1 && (chunked_ || body_left_ > 0);
  return state_;
}

RequestParser::State RequestParser::read_body(std::string& in) {
  if (chunked_) return read_chunked(in);
  const size_t n = std::min(body_left_, in.size());
  req_.body.append(in, 0, n);
  in.erase(0, n);
  body_left_ -= n;
  if (body_left_ == 0) state_ = State::done;
  return state_;
}

// chunked-body = *chunk last-chunk trailer-section CRLF; chunk = chunk-size [ext] CRLF data CRLF.
// Decoded bytes go straight into the body, so memory follows the decoded size, not the chunk sizes
// the client declares.
RequestParser::State RequestParser::read_chunked(std::string& in) {
  const auto too_large = [this] {
    return fail(413, fmt::format("The request body exceeds this server's limit of {} bytes.", opts_.max_body_bytes));
  };
  for (;;) {
    switch (chunk_) {
      case Chunk::size_line: {
        const size_t lf = in.find('\n');
        if (lf == std::string::npos) {
          if (in.size() > kMaxChunkLine) return fail(400, "Bad request: a chunk-size line is too long.");
          return state_;
        }
        if (lf == 0 || in[lf - 1] != '\r' || lf - 1 > kMaxChunkLine)
          return fail(400, "Bad request: a malformed chunk-size line.");
        const std::string_view line(in.data(), lf - 1);
        size_t i = 0;
        uint64_t size = 0;
        for (; i < line.size() && hex_value(line[i]) >= 0; i++)
          size = size >= kHuge / 16 ? kHuge : size * 16 + uint64_t(hex_value(line[i]));
        const std::string_view ext = trim(line.substr(i));
        if (i == 0 || (!ext.empty() && ext[0] != ';') ||
            std::any_of(ext.begin(), ext.end(), [](char c) { return ((unsigned char)c < 0x20 && c != '\t') || c == 0x7f; }))
          return fail(400, "Bad request: a malformed chunk-size line.");
        in.erase(0, lf + 1);
        if (size > opts_.max_body_bytes - req_.body.size()) return too_large();
        body_left_ = (size_t)size;
        chunk_ = size == 0 ? Chunk::trailer : Chunk::data;
        break;
      }
      case Chunk::data: {
        const size_t n = std::min(body_left_, in.size());
        req_.body.append(in, 0, n);
        in.erase(0, n);
        body_left_ -= n;
        if (body_left_ > 0) return state_;
        chunk_ = Chunk::data_end;
        break;
      }
      case Chunk::data_end:
        if (in.size() < 2) {
          if (!in.empty() && in[0] != '\r') return fail(400, "Bad request: chunk data not followed by CRLF.");
          return state_;
        }
        if (in[0] != '\r' || in[1] != '\n') return fail(400, "Bad request: chunk data not followed by CRLF.");
        in.erase(0, 2);
        chunk_ = Chunk::size_line;
        break;
      case Chunk::trailer: {
        // Trailer fields are read and dropped (none changes how moetron handles a request).
        const size_t lf = in.find('\n');
        if (lf == std::string::npos) {
          if (trailer_bytes_ + in.size() > kMaxTrailerBytes)
            return fail(431, fmt::format("The request trailers exceed this server's limit of {} bytes.", kMaxTrailerBytes));
          return state_;
        }
        if (lf == 0 || in[lf - 1] != '\r') return fail(400, "Bad request: a bare LF in the request trailers.");
        trailer_bytes_ += lf + 1;
        if (trailer_bytes_ > kMaxTrailerBytes)
          return fail(431, fmt::format("The request trailers exceed this server's limit of {} bytes.", kMaxTrailerBytes));
        in.erase(0, lf + 1);
        if (lf == 1) return state_ = State::done;  // the empty line
        break;
      }
    }
  }
}

}  // namespace moetron::server::http
