// Fuzz target: the bytes a client of `moetron serve` sends on one connection, through the HTTP
// request reader (src/server/http_request.h: request line, header fields, Content-Length or chunked
// bodies, pipelined requests), with small limits so they are reached.  Checks: every request it
// completes is within the limits, every failure is a 4xx with a message, and reading the stream in
// pieces (as the event thread receives it) gives exactly what reading it at once gives.
// Input: the first byte sets the size of the pieces (1..256), the rest is the stream.
#include <vector>

#include "fuzz_common.h"
#include "server/http_request.h"

using namespace moetron::server::http;

namespace {

struct Outcome {
  RequestParser::State state;
  int status = 0;
  std::string method, target, body;
  std::vector<std::pair<std::string, std::string>> headers;
  bool keep_alive = false;
  bool operator==(const Outcome&) const = default;
};

// Feeds `stream` in pieces of `piece` bytes; the outcome of each request, then how the stream ended.
std::vector<Outcome> read_all(const Options& o, std::string_view stream, size_t piece) {
  RequestParser p(o);
  std::vector<Outcome> out;
  std::string buf;
  size_t at = 0;
  while (true) {
    if (at < stream.size()) {
      const size_t n = std::min(piece, stream.size() - at);
      buf.append(stream.data() + at, n);
      at += n;
    }
    RequestParser::State s = p.feed(buf);
    while (s == RequestParser::State::done) {
      const Request& r = p.request();
      if (r.body.size() > o.max_body_bytes || r.method.empty()) std::abort();
      out.push_back({s, 0, r.method, r.target, r.body, r.headers, p.keep_alive()});
      p.reset();
      s = p.feed(buf);
    }
    if (s == RequestParser::State::failed) {
      if (p.error_status() < 400 || p.error_status() >= 500 || p.error_message().empty()) std::abort();
      out.push_back({s, p.error_status(), {}, {}, {}, {}, false});
      return out;
    }
    (void)p.take_continue();
    if (at >= stream.size()) {
      // Everything is in: a request still open has no more bytes coming.
      const RequestParser::State e = p.end_of_input();
      out.push_back({e, e == RequestParser::State::failed ? p.error_status() : 0, {}, {}, {}, {}, false});
      return out;
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  Options o;
  o.max_line_bytes = 256;
  o.max_head_bytes = 1024;
  o.max_headers = 16;
  o.max_body_bytes = 512;
  const size_t piece = size_t(data[0]) + 1;
  const std::string_view stream = moetron::fuzz::as_text(data + 1, size - 1);
  const std::vector<Outcome> whole = read_all(o, stream, stream.size() + 1);
  const std::vector<Outcome> pieces = read_all(o, stream, piece);
  if (!(whole == pieces)) {
    std::fprintf(stderr, "reading in pieces of %zu bytes differs from reading at once\n", piece);
    std::abort();
  }
  return 0;
}
