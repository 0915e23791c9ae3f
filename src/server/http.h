// moetron's HTTP/1.1 server layer: the transport under moetron serve (server.h), built so that no
// client can hold more than a bounded share of it.
//
// Threads.  One event thread (run()) accepts connections and reads every request head and body with
// non-blocking sockets (epoll), so a slow or stalled client costs a connection slot and a buffer, never
// a thread.  Only a complete request goes to the worker pool (Options::threads), whose thread runs the
// handler and writes the response; then the connection returns to the event thread (keep-alive) or is
// closed.
//
// Limits (Options), each answered with a status and a JSON body from the caller's ErrorBody, after
// which the connection is closed (the server stops reading the request, lets the reply drain for at
// most linger_ms, then closes):
//   request line or one header line over max_line_bytes: 414 / 431; head over max_head_bytes or more
//   than max_headers fields: 431;
//   body over max_body_bytes: 413, up front when Content-Length says so, else (chunked) the moment the
//   decoded bytes would exceed it; a chunk-size line over 1 KiB or trailers over 8 KiB: 400 / 431;
//   no byte for read_timeout_ms inside a request, or a request (head + body) not complete
//   request_timeout_ms after its first byte: 408;
//   a connection beyond max_connections in all or max_connections_per_client from one IP address:
//   503 and closed at once, before anything is read;
//   malformed request line, header line, Content-Length (not digits, differing duplicates, a list),
//   Transfer-Encoding other than "chunked", both Content-Length and Transfer-Encoding, a missing
//   Host in HTTP/1.1, bare CR or LF: 400; Content-Encoding other than identity: 415; an Expect other
//   than 100-continue: 417 (100-continue is answered "100 Continue" once the head is accepted).
// Idle connections: a new one that sends nothing for read_timeout_ms, or a kept-alive one that sends
// no next request for keep_alive_timeout_ms, is closed without a reply.  HTTP/1.0 and 1.1; pipelined
// requests are answered in order.
//
// Routing: exact paths and path prefixes (route_prefix), per method; an unknown path gets 404, a
// known path with another method 405 (both through ErrorBody).  A handler that throws gets 500.
//
// No global state: any number of servers may run in one process.  SIGPIPE is not needed (every send
// uses MSG_NOSIGNAL).
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace moetron::server::http {

struct Options {
  int threads = 8;                       // worker threads running handlers
  size_t max_line_bytes = 8 * 1024;      // request line, each header line
  size_t max_head_bytes = 64 * 1024;     // request line + headers
  size_t max_headers = 128;              // header fields
  size_t max_body_bytes = 1 << 20;       // decoded body bytes, whatever the framing
  int read_timeout_ms = 10000;           // silence allowed inside a request (and before a first one)
  int request_timeout_ms = 30000;        // whole request, head and body, from its first byte
  int write_timeout_ms = 10000;          // a client that takes no response bytes for this long is dropped
  int keep_alive_timeout_ms = 5000;      // idle time allowed between requests on one connection
  int keep_alive_max_requests = 100;     // requests per connection before it is closed
  int max_connections = 1024;            // open connections in all
  int max_connections_per_client = 16;   // open connections from one IP address
  int linger_ms = 2000;                  // after an error reply: input discarded for at most this long
};

struct Request {
  std::string method;                    // as sent ("GET", "POST", ...)
  std::string target;                    // as sent ("/v1/models/x?y=1")
  std::string path;                      // target without the query, %XX decoded
  std::string tail;                      // for a prefix route: the path after the prefix (non-empty)
  int minor_version = 1;                 // HTTP/1.<minor_version>: 0 or 1
  std::vector<std::pair<std::string, std::string>> headers;  // names lower-cased, values trimmed
  std::string body;                      // decoded (Content-Length or chunked)
  std::string remote_addr;               // the client's IP address

  // The value of a header (name in lower case), or nullptr.  Repeated headers: the first.
  const std::string* header(std::string_view name) const;
};

// Where a streamed response's body goes: the bytes are sent as they are written (chunked transfer
// encoding for HTTP/1.1).  Used only on the worker thread that runs the handler's stream function.
class StreamSink {
 public:
  virtual ~StreamSink() = default;
  // Sends the bytes (waiting up to write_timeout_ms for the client to take each part).  False when
  // they could not be sent: the client went away or stalled, or the server is stopping; the stream
  // should end then (the connection is closed).
  virtual bool write(std::string_view data) = 0;
  // False once the client is known to be gone (reset or fully closed), or the server is stopping;
  // cheap (no I/O beyond a poll).  A stream waiting for data calls it to give up early.
  virtual bool connected() = 0;
};

struct Response {
  int status = 200;
  std::string content_type = "application/json";
  std::vector<std::pair<std::string, std::string>> headers;  // extra headers
  std::string body;
  // When set, the response is streamed: after the head, this runs on the worker thread and writes the
  // body through the sink (body above is ignored).  It returns true when the body is complete (then
  // the terminating chunk is sent and the connection may be kept alive), false to abort it (the
  // connection is closed, so the client sees an incomplete body).
  std::function<bool(StreamSink&)> stream;
};

using Handler = std::function<void(const Request&, Response&)>;
// The JSON body of an error reply with this status; `message` says what was wrong in words.
using ErrorBody = std::function<std::string(int status, const std::string& message)>;
// Called after each reply with what is known of the request (method and path may be empty when the
// request could not be parsed).  From the event thread or a worker; must be thread-safe.
using Logger = std::function<void(const std::string& remote, const std::string& method, const std::string& path,
                                  int status)>;

class Server {
 public:
  Server(Options opts, ErrorBody error_body);
  ~Server();  // stop(); closes the listening socket.  run() must have returned.
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Routes, before run().  route: exactly this path.  route_prefix: a path that starts with the prefix
  // and has more after it (the rest in Request::tail).  Exact routes win, then the longest prefix.
  void route(const std::string& method, const std::string& path, Handler h);
  void route_prefix(const std::string& method, const std::string& prefix, Handler h);
  void set_logger(Logger logger);

  // Binds and listens (port 0: any free port); returns the port.  Error naming host:port and the
  // reason when it cannot.
  int bind(const std::string& host, int port);
  // Serves until stop(): the calling thread becomes the event thread; the workers start here.  On
  // return every connection is closed and every worker joined.  A running handler is waited for, so
  // the caller stops what handlers wait on first.
  void run();
  // Makes run() return (soon: the event thread wakes at once; workers finish their current response,
  // whose writes fail from now on).  Thread-safe, idempotent; before run() it makes run() return at once.
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The reason phrase of a status ("Not Found"); "Unknown" for one this server never sends.
const char* reason_phrase(int status);

}  // namespace moetron::server::http
