#include "server/http.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>

#include <fmt/format.h>

#include "core/error.h"
#include "server/http_request.h"

namespace moetron::server::http {

const char* reason_phrase(int status) {
  switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 413: return "Payload Too Large";
    case 414: return "URI Too Long";
    case 415: return "Unsupported Media Type";
    case 417: return "Expectation Failed";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 503: return "Service Unavailable";
    default: return "Unknown";
  }
}

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr size_t kReadChunk = 64 * 1024;  // one recv; also bounds the input buffered beyond the limits

// Who holds a connection: the event thread (reading a request, replying with an error of its own,
// draining before the close) or a worker (running the handler and writing its response).  Exactly one
// of them touches it at a time; the hand-over goes through Impl's mutex.
enum class Phase { reading, replying, draining, in_worker };

// After a worker's response: keep reading requests, close gracefully (drain what the client still
// sends, so the reply is not lost to a reset), or close at once (the client is gone or the stream was
// cut).
enum class After { keep, linger, close };

struct Conn {
  Conn(int fd, std::string peer, const Options& opts) : fd(fd), peer(std::move(peer)), parser(opts) {
    parser.request().remote_addr = this->peer;
  }
  int fd;
  std::string peer;  // IP address: the key of the per-client count
  RequestParser parser;
  Phase phase = Phase::reading;
  std::string in;              // received bytes the parser has not taken yet (pipelined ones included)
  std::string out;             // bytes the event thread still has to send (100 Continue, an error reply)
  size_t out_sent = 0;
  uint32_t events = 0;         // epoll interest; 0: not registered
  int served = 0;              // responses sent on this connection
  Clock::time_point request_start, last_progress, linger_until;
  After after = After::close;  // set by the worker
};

std::string peer_address(const sockaddr_storage& a) {
  char buf[INET6_ADDRSTRLEN] = "?";
  if (a.ss_family == AF_INET)
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in&>(a).sin_addr, buf, sizeof buf);
  else if (a.ss_family == AF_INET6)
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6&>(a).sin6_addr, buf, sizeof buf);
  return buf;
}

}  // namespace

struct Server::Impl {
  struct Route {
    std::string method, path;
    bool prefix;
    Handler handler;
  };

  Impl(Options o, ErrorBody e) : opts(std::move(o)), error_body(std::move(e)) {
    if (opts.threads < 1) fail("http: at least one worker thread is needed");
    if (opts.read_timeout_ms < 1 || opts.request_timeout_ms < 1 || opts.write_timeout_ms < 1 ||
        opts.keep_alive_timeout_ms < 0 || opts.linger_ms < 0)
      fail("http: timeouts must be positive");
    if (opts.max_connections < 1 || opts.max_connections_per_client < 1)
      fail("http: connection limits must be at least 1");
    epoll_fd = epoll_create1(EPOLL_CLOEXEC);
    wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (epoll_fd < 0 || wake_fd < 0) fail("http: cannot create the event loop: {}", std::strerror(errno));
  }
  ~Impl() {
    for (int fd : {listen_fd, epoll_fd, wake_fd})
      if (fd >= 0) ::close(fd);
  }

  // ---- shared state ----
  const Options opts;
  const ErrorBody error_body;
  Logger logger;
  std::vector<Route> routes;
  int listen_fd = -1, epoll_fd = -1, wake_fd = -1;
  std::atomic<bool> stopping{false};
  std::mutex mu;  // guards ready, returned, workers_exit
  std::condition_variable cv;
  std::deque<Conn*> ready;      // complete requests waiting for a worker
  std::vector<Conn*> returned;  // connections the workers are done with
  bool workers_exit = false;

  // ---- event thread only ----
  std::unordered_map<int, std::unique_ptr<Conn>> conns;  // owns every open connection
  std::unordered_map<std::string, int> per_client;
  Clock::time_point accept_paused_until{};
  bool accept_paused = false;

  void wake() {
    const uint64_t one = 1;
    [[maybe_unused]] const ssize_t n = ::write(wake_fd, &one, sizeof one);
  }
  void log(const std::string& remote, const std::string& method, const std::string& path, int status) {
    if (logger) logger(remote, method, path, status);
  }

  // A complete response with a body; `connection`: the Connection header's value, or nullptr for none.
  static std::string response_bytes(int status, const std::string& content_type,
                                    const std::vector<std::pair<std::string, std::string>>& headers,
                                    const std::string& body, const char* connection) {
    std::string s = fmt::format("HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\n", status,
                                reason_phrase(status), content_type, body.size());
    for (const auto& [k, v] : headers) s += k + ": " + v + "\r\n";
    if (connection) s += fmt::format("Connection: {}\r\n", connection);
    s += "\r\n";
    s += body;
    return s;
  }
  std::string error_bytes(int status, const std::string& message) {
    return response_bytes(status, "application/json", {}, error_body(status, message), "close");
  }

  // ---- event thread ----
  void set_events(Conn& c, uint32_t events) {
    if (events == c.events) return;
    epoll_event ev{};
    ev.events = events;
    ev.data.fd = c.fd;
    const int op = c.events == 0 ? EPOLL_CTL_ADD : events == 0 ? EPOLL_CTL_DEL : EPOLL_CTL_MOD;
    epoll_ctl(epoll_fd, op, c.fd, &ev);
    c.events = events;
  }

  void close_conn(Conn& c) {
    const int fd = c.fd;  // a copy: erase() destroys c
    ::close(fd);          // also removes it from the epoll set
    if (--per_client[c.peer] == 0) per_client.erase(c.peer);
    conns.erase(fd);
  }

  void accept_all(Clock::time_point now) {
    for (int i = 0; i < 256; i++) {
      sockaddr_storage addr{};
      socklen_t len = sizeof addr;
      const int fd = accept4(listen_fd, reinterpret_cast<sockaddr*>(&addr), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          // Out of descriptors: stop accepting for a moment rather than spin on the listening socket.
          epoll_event ev{};
          epoll_ctl(epoll_fd, EPOLL_CTL_MOD, listen_fd, &ev);
          accept_paused = true;
          accept_paused_until = now + milliseconds(100);
        }
        return;
      }
      std::string peer = peer_address(addr);
      const auto it = per_client.find(peer);
      const int from_peer = it == per_client.end() ? 0 : it->second;
      if ((int)conns.size() >= opts.max_connections || from_peer >= opts.max_connections_per_client) {
        refuse(fd, peer, from_peer >= opts.max_connections_per_client);
        continue;
      }
      const int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);  // a reply's writes go out at once
      auto c = std::make_unique<Conn>(fd, peer, opts);
      c->last_progress = now;
      per_client[peer]++;
      Conn& ref = *c;
      conns.emplace(fd, std::move(c));
      set_events(ref, EPOLLIN);
    }
  }

  // Over a connection limit: a 503 (best effort: one non-blocking send) and the close, without
  // reading a request, so a refused connection costs nothing after this call.
  void refuse(int fd, const std::string& peer, bool per_peer) {
    const std::string msg =
        per_peer ? fmt::format("Too many connections from {}: this server allows {} per client.", peer,
                               opts.max_connections_per_client)
                 : fmt::format("Too many connections: this server allows {} in all.", opts.max_connections);
    const std::string bytes = error_bytes(503, msg);
    [[maybe_unused]] ssize_t n = send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    shutdown(fd, SHUT_WR);
    char buf[4096];  // what already arrived, so the close is less likely to reset the reply away
    n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    ::close(fd);
    log(peer, "", "", 503);
  }

  // Sends what it can of c.out; when all is sent, an error reply turns into the drain before close.
  // False when the connection was closed (a send error): c is gone then.
  bool flush(Conn& c, Clock::time_point now) {
    while (c.out_sent < c.out.size()) {
      const ssize_t n = send(c.fd, c.out.data() + c.out_sent, c.out.size() - c.out_sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        c.out_sent += (size_t)n;
        c.last_progress = now;
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        set_events(c, c.phase == Phase::replying ? EPOLLOUT : EPOLLIN | EPOLLOUT);
        return true;
      }
      close_conn(c);
      return false;
    }
    c.out.clear();
    c.out_sent = 0;
    if (c.phase == Phase::replying)
      start_drain(c, now);
    else
      set_events(c, EPOLLIN);
    return true;
  }

  // Graceful close: no more output (FIN), and input read and dropped until the client closes too or
  // linger_ms pass.  Closing with unread input would send a reset, which can destroy the reply
  // before the client reads it.
  void start_drain(Conn& c, Clock::time_point now) {
    shutdown(c.fd, SHUT_WR);
    c.phase = Phase::draining;
    c.linger_until = now + milliseconds(opts.linger_ms);
    c.in.clear();
    set_events(c, EPOLLIN);
  }

  // Answers with an error and closes (gracefully); c may be gone on return.
  void reply_error(Conn& c, int status, const std::string& message, Clock::time_point now) {
    log(c.peer, c.parser.method(), c.parser.path(), status);
    c.out.erase(0, c.out_sent);  // after what is left of a 100 Continue, if any
    c.out_sent = 0;
    c.out += error_bytes(status, message);
    c.phase = Phase::replying;
    c.last_progress = now;
    flush(c, now);
  }

  // Feeds the buffered input to the parser and acts on the result; c may be gone on return.
  void advance(Conn& c, Clock::time_point now) {
    const bool was_idle = c.parser.state() == RequestParser::State::idle;
    const RequestParser::State st = c.parser.feed(c.in);
    if (was_idle && st != RequestParser::State::idle) c.request_start = now;
    // Progress is a request's bytes: empty lines between requests do not keep an idle connection open.
    if (st != RequestParser::State::idle) c.last_progress = now;
    if (st == RequestParser::State::failed) {
      reply_error(c, c.parser.error_status(), c.parser.error_message(), now);
      return;
    }
    if (c.parser.take_continue()) {
      c.out += "HTTP/1.1 100 Continue\r\n\r\n";
      if (!flush(c, now)) return;
    }
    if (st == RequestParser::State::done) dispatch(c);
  }

  void dispatch(Conn& c) {
    c.phase = Phase::in_worker;
    set_events(c, 0);
    {
      std::lock_guard lock(mu);
      ready.push_back(&c);
    }
    cv.notify_one();
  }

  void on_event(Conn& c, uint32_t events, Clock::time_point now) {
    if (c.phase == Phase::in_worker) return;
    if (events & EPOLLERR) {  // reset: nothing more can be sent or received
      close_conn(c);
      return;
    }
    if ((events & EPOLLOUT) && !c.out.empty() && (!flush(c, now) || c.phase == Phase::replying)) return;
    if (c.phase == Phase::replying) {
      if (events & EPOLLHUP) close_conn(c);  // closed both ways before taking the reply
      return;
    }
    if (!(events & (EPOLLIN | EPOLLHUP))) return;
    char buf[kReadChunk];
    if (c.phase == Phase::draining) {
      for (int i = 0; i < 4; i++) {
        const ssize_t n = recv(c.fd, buf, sizeof buf, 0);
        if (n > 0) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
        close_conn(c);  // the client closed (or reset): done
        return;
      }
      return;
    }
    if (c.phase != Phase::reading) return;
    const ssize_t n = recv(c.fd, buf, sizeof buf, 0);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    if (n <= 0) {
      if (n == 0 && c.parser.end_of_input() == RequestParser::State::failed)
        reply_error(c, c.parser.error_status(), c.parser.error_message(), now);
      else
        close_conn(c);
      return;
    }
    c.in.append(buf, (size_t)n);
    advance(c, now);
  }

  // A worker is done with c.
  void on_returned(Conn& c, Clock::time_point now) {
    if (c.after == After::close || stopping) {
      close_conn(c);
      return;
    }
    if (c.after == After::linger) {
      start_drain(c, now);
      return;
    }
    c.served++;
    c.parser.reset();
    c.phase = Phase::reading;
    c.last_progress = now;
    set_events(c, EPOLLIN);
    if (!c.in.empty()) advance(c, now);  // a pipelined request
  }

  // Closes or answers the connections whose time is up; returns the time until the next deadline.
  milliseconds check_deadlines(Clock::time_point now) {
    Clock::time_point next = now + milliseconds(1000);
    if (accept_paused) {
      if (now >= accept_paused_until) {
        epoll_event ev{};
        ev.events = EPOLLIN;
        ev.data.fd = listen_fd;
        epoll_ctl(epoll_fd, EPOLL_CTL_MOD, listen_fd, &ev);
        accept_paused = false;
      } else {
        next = std::min(next, accept_paused_until);
      }
    }
    std::vector<Conn*> due;
    for (auto& [fd, cp] : conns) {
      const Conn& c = *cp;
      Clock::time_point d = Clock::time_point::max();
      switch (c.phase) {
        case Phase::reading:
          if (c.parser.state() == RequestParser::State::idle)
            d = c.last_progress + milliseconds(c.served == 0 ? opts.read_timeout_ms : opts.keep_alive_timeout_ms);
          else
            d = std::min(c.request_start + milliseconds(opts.request_timeout_ms),
                         c.last_progress + milliseconds(opts.read_timeout_ms));
          break;
        case Phase::replying: d = c.last_progress + milliseconds(opts.write_timeout_ms); break;
        case Phase::draining: d = c.linger_until; break;
        case Phase::in_worker: break;
      }
      if (d <= now)
        due.push_back(cp.get());
      else
        next = std::min(next, d);
    }
    for (Conn* c : due) {
      if (c->phase == Phase::reading && c->parser.state() != RequestParser::State::idle) {
        const bool whole = now >= c->request_start + milliseconds(opts.request_timeout_ms);
        reply_error(*c, 408,
                    whole ? fmt::format("The request was not complete within {} ms.", opts.request_timeout_ms)
                          : fmt::format("The client sent nothing for {} ms in the middle of a request.",
                                        opts.read_timeout_ms),
                    now);
      } else {
        close_conn(*c);
      }
    }
    return std::chrono::duration_cast<milliseconds>(next - now) + milliseconds(1);
  }

  void event_loop() {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = listen_fd;
    epoll_ctl(epoll_fd, EPOLL_CTL_ADD, listen_fd, &ev);
    ev.data.fd = wake_fd;
    epoll_ctl(epoll_fd, EPOLL_CTL_ADD, wake_fd, &ev);
    epoll_event events[256];
    milliseconds wait(0);
    while (!stopping) {
      const int n = epoll_wait(epoll_fd, events, 256, (int)wait.count());
      if (n < 0 && errno != EINTR) fail("http: epoll_wait: {}", std::strerror(errno));
      const Clock::time_point now = Clock::now();
      for (int i = 0; i < n; i++) {
        const int fd = events[i].data.fd;
        if (fd == listen_fd) {
          accept_all(now);
        } else if (fd == wake_fd) {
          uint64_t count;
          [[maybe_unused]] const ssize_t r = ::read(wake_fd, &count, sizeof count);
          std::vector<Conn*> back;
          {
            std::lock_guard lock(mu);
            back.swap(returned);
          }
          for (Conn* c : back) on_returned(*c, now);
        } else if (const auto it = conns.find(fd); it != conns.end()) {
          on_event(*it->second, events[i].events, now);
        }
      }
      wait = check_deadlines(now);
    }
  }

  // ---- workers ----
  void worker_loop() {
    for (;;) {
      Conn* c = nullptr;
      {
        std::unique_lock lock(mu);
        cv.wait(lock, [&] { return workers_exit || !ready.empty(); });
        if (ready.empty()) return;  // workers_exit (the queue was emptied by the event thread)
        c = ready.front();
        ready.pop_front();
      }
      serve(*c);
      {
        std::lock_guard lock(mu);
        returned.push_back(c);
      }
      wake();
    }
  }

  // Sends all of data, waiting up to write_timeout_ms each time the client takes nothing; false when
  // the client is gone or stalled, or the server is stopping.
  bool write_all(int fd, std::string_view data) {
    size_t off = 0;
    while (off < data.size()) {
      if (stopping) return false;
      const ssize_t n = send(fd, data.data() + off, data.size() - off, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        off += (size_t)n;
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return false;
      const Clock::time_point give_up = Clock::now() + milliseconds(opts.write_timeout_ms);
      for (;;) {  // in slices, so that stop() is seen
        if (stopping) return false;
        const auto left = std::chrono::duration_cast<milliseconds>(give_up - Clock::now()).count();
        if (left <= 0) return false;
        pollfd p{fd, POLLOUT, 0};
        const int r = poll(&p, 1, (int)std::min<long>(left, 100));
        if (r < 0 && errno != EINTR) return false;
        if (r > 0) {
          if (p.revents & (POLLERR | POLLHUP | POLLNVAL)) return false;
          break;
        }
      }
    }
    return true;
  }

  class Sink : public StreamSink {
   public:
    Sink(Impl& srv, int fd, bool chunked) : srv_(srv), fd_(fd), chunked_(chunked) {}
    bool write(std::string_view data) override {
      if (failed_ || srv_.stopping) return false;
      if (data.empty()) return true;  // an empty chunk would end the body
      if (chunked_) {
        std::string frame = fmt::format("{:x}\r\n", data.size());
        frame.append(data);
        frame += "\r\n";
        failed_ = !srv_.write_all(fd_, frame);
      } else {
        failed_ = !srv_.write_all(fd_, data);
      }
      return !failed_;
    }
    bool connected() override {
      if (failed_ || srv_.stopping) return false;
      // POLLHUP / POLLERR: reset or closed both ways.  A half-close (FIN) alone is not "gone": HTTP
      // lets a client end its side and still read the reply.
      pollfd p{fd_, 0, 0};
      if (poll(&p, 1, 0) > 0 && (p.revents & (POLLERR | POLLHUP | POLLNVAL))) failed_ = true;
      return !failed_;
    }
    bool failed() const { return failed_; }

   private:
    Impl& srv_;
    int fd_;
    bool chunked_;
    bool failed_ = false;
  };

  void route_request(Request& req, Response& res) {
    const Route* best = nullptr;
    std::vector<std::string> allowed;  // methods of the matching path
    auto consider = [&](bool prefix) {
      for (const Route& r : routes) {
        if (r.prefix != prefix) continue;
        const bool match = prefix ? req.path.size() > r.path.size() && req.path.compare(0, r.path.size(), r.path) == 0
                                  : req.path == r.path;
        if (!match) continue;
        if (std::find(allowed.begin(), allowed.end(), r.method) == allowed.end()) allowed.push_back(r.method);
        if (r.method == req.method && (!best || r.path.size() > best->path.size())) best = &r;
      }
    };
    consider(false);
    if (allowed.empty()) consider(true);
    if (best) {
      if (best->prefix) req.tail = req.path.substr(best->path.size());
      best->handler(req, res);
      return;
    }
    res = Response{};
    if (allowed.empty()) {
      res.status = 404;
      res.body = error_body(404, fmt::format("Unknown request URL: {} {}", req.method, req.path));
      return;
    }
    std::string list;
    for (const std::string& m : allowed) list += (list.empty() ? "" : ", ") + m;
    res.status = 405;
    res.headers.emplace_back("Allow", list);
    res.body = error_body(405, fmt::format("{} {} is not supported; use {}", req.method, req.path, list));
  }

  // On a worker: runs the handler for c's complete request and writes the response.
  void serve(Conn& c) {
    Request& req = c.parser.request();
    Response res;
    try {
      route_request(req, res);
    } catch (const std::exception& e) {
      res = Response{};
      res.status = 500;
      res.body = error_body(500, std::string("internal error: ") + e.what());
    } catch (...) {
      res = Response{};
      res.status = 500;
      res.body = error_body(500, "internal error: unknown exception");
    }
    log(c.peer, req.method, req.path, res.status);
    if (!c.out.empty() && !write_all(c.fd, std::string_view(c.out).substr(c.out_sent))) {  // a 100 Continue still due
      c.after = After::close;
      return;
    }
    c.out.clear();
    c.out_sent = 0;
    const bool http11 = req.minor_version == 1;
    bool keep = c.parser.keep_alive() && c.served + 1 < opts.keep_alive_max_requests && !stopping;
    if (!res.stream) {
      const char* connection = keep ? (http11 ? nullptr : "keep-alive") : "close";
      const bool ok = write_all(c.fd, response_bytes(res.status, res.content_type, res.headers, res.body, connection));
      c.after = !ok ? After::close : keep ? After::keep : After::linger;
      return;
    }
    // Streamed: chunked for HTTP/1.1; an HTTP/1.0 client reads to the close.
    if (!http11) keep = false;
    std::string head = fmt::format("HTTP/1.1 {} {}\r\nContent-Type: {}\r\n", res.status, reason_phrase(res.status),
                                   res.content_type);
    for (const auto& [k, v] : res.headers) head += k + ": " + v + "\r\n";
    if (http11) head += "Transfer-Encoding: chunked\r\n";
    if (!keep) head += "Connection: close\r\n";
    head += "\r\n";
    if (!write_all(c.fd, head)) {
      c.after = After::close;
      return;
    }
    Sink sink(*this, c.fd, http11);
    bool complete = false;
    try {
      complete = res.stream(sink);
    } catch (const std::exception&) {
      complete = false;  // the head is out: the only way left to signal failure is the cut
    }
    if (!complete || sink.failed() || (http11 && !write_all(c.fd, "0\r\n\r\n"))) {
      c.after = After::close;
      return;
    }
    c.after = keep ? After::keep : After::linger;
  }
};

Server::Server(Options opts, ErrorBody error_body) : impl_(std::make_unique<Impl>(std::move(opts), std::move(error_body))) {}

Server::~Server() { stop(); }

void Server::route(const std::string& method, const std::string& path, Handler h) {
  impl_->routes.push_back({method, path, false, std::move(h)});
}

void Server::route_prefix(const std::string& method, const std::string& prefix, Handler h) {
  impl_->routes.push_back({method, prefix, true, std::move(h)});
}

void Server::set_logger(Logger logger) { impl_->logger = std::move(logger); }

int Server::bind(const std::string& host, int port) {
  if (impl_->listen_fd >= 0) fail("http: already bound");
  if (port < 0 || port > 65535) fail("port {} is outside [0, 65535]", port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const std::string port_text = std::to_string(port);
  const int gai = getaddrinfo(host.empty() ? nullptr : host.c_str(), port_text.c_str(), &hints, &res);
  if (gai != 0) fail("cannot bind to {}:{}: {}", host, port, gai_strerror(gai));
  std::string why = "no address";
  for (addrinfo* a = res; a; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      why = std::strerror(errno);
      continue;
    }
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, SOMAXCONN) == 0) {
      impl_->listen_fd = fd;
      break;
    }
    why = std::strerror(errno);
    ::close(fd);
  }
  freeaddrinfo(res);
  if (impl_->listen_fd < 0) fail("cannot bind to {}:{}: {}", host, port, why);
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  getsockname(impl_->listen_fd, reinterpret_cast<sockaddr*>(&addr), &len);
  return ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6&>(addr).sin6_port
                                          : reinterpret_cast<sockaddr_in&>(addr).sin_port);
}

void Server::run() {
  Impl& s = *impl_;
  if (s.listen_fd < 0) fail("http: bind() before run()");
  std::vector<std::thread> workers;
  for (int i = 0; i < s.opts.threads; i++) workers.emplace_back([&s] { s.worker_loop(); });
  std::exception_ptr error;
  try {
    s.event_loop();
  } catch (...) {
    error = std::current_exception();
  }
  // Requests not yet started are dropped; running ones finish (their writes fail from now on).
  {
    std::lock_guard lock(s.mu);
    s.ready.clear();
    s.workers_exit = true;
  }
  s.cv.notify_all();
  for (std::thread& t : workers) t.join();
  for (auto& [fd, c] : s.conns) ::close(fd);
  s.conns.clear();
  s.per_client.clear();
  s.returned.clear();
  if (error) std::rethrow_exception(error);
}

void Server::stop() {
  impl_->stopping = true;
  impl_->wake();
}

}  // namespace moetron::server::http
