// Reading one HTTP/1.1 request from a byte stream, incrementally and within limits: the head (request
// line and header fields), then the body framed by Content-Length or chunked transfer encoding.  No
// I/O: the event thread (http.cpp) appends what it receives and feeds it here, so the parser's memory
// is bounded by the limits whatever the client sends (a body is refused the moment its decoded size
// would pass max_body_bytes, whatever the framing).  The statuses it fails with are listed in http.h.
#pragma once

#include <cstddef>
#include <string>

#include "server/http.h"

namespace moetron::server::http {

class RequestParser {
 public:
  enum class State { idle, head, body, done, failed };

  explicit RequestParser(const Options& opts) : opts_(opts) {}

  // Consumes bytes from the front of `in` (what it takes is erased; bytes after a complete request
  // stay there for the next one).  Returns the state after them: idle (nothing of a request yet; empty
  // lines before a request line are skipped), head / body (more is needed), done (request() is
  // complete), failed (error_status() / error_message() say why; the connection must be closed).
  State feed(std::string& in);
  // The peer closed its side: a request cut short fails (400); idle stays idle.
  State end_of_input();
  State state() const { return state_; }

  // True once per request when its head asked for "Expect: 100-continue" and a body is due.
  bool take_continue() {
    const bool due = continue_due_;
    continue_due_ = false;
    return due;
  }
  // Whether the connection may serve another request after this one (HTTP version and Connection).
  bool keep_alive() const { return keep_alive_; }
  int error_status() const { return error_status_; }
  const std::string& error_message() const { return error_message_; }
  Request& request() { return req_; }
  // What is known of the request so far, for logs ("" before the request line is parsed).
  const std::string& method() const { return req_.method; }
  const std::string& path() const { return req_.path; }

  // Ready for the next request on the same connection (remote_addr is kept).
  void reset();

 private:
  State fail(int status, std::string message);
  State scan_head(std::string& in);
  State parse_head(const std::string& head);
  State read_body(std::string& in);
  State read_chunked(std::string& in);

  const Options& opts_;
  State state_ = State::idle;
  Request req_;
  // head
  size_t scanned_ = 0, line_start_ = 0, lines_ = 0;
  // body
  bool chunked_ = false;
  size_t body_left_ = 0;  // Content-Length: bytes still due; chunked: bytes left in this chunk
  enum class Chunk { size_line, data, data_end, trailer } chunk_ = Chunk::size_line;
  size_t trailer_bytes_ = 0;
  bool continue_due_ = false, keep_alive_ = false;
  int error_status_ = 0;
  std::string error_message_;
};

}  // namespace moetron::server::http
