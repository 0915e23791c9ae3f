// moetron serve against hostile clients, as a child process (the real binary, its own memory):
// well over 500 malformed requests -- truncated and invalid JSON, wrong types and out-of-range values
// for every field, negative and huge max_tokens, too-long prompts, bodies over the size limit,
// garbage instead of HTTP, bad framing, clients that stall before or inside a request, clients that
// disconnect mid-stream.  Each must get a 4xx with an error object, or a clean close; afterwards the
// server answers a valid request with the expected reply and exits cleanly on SIGTERM.  The child's
// resident memory before and after is printed (and bounded).  Short timeouts (flags) keep it fast.
// Then the transport's own limits, each against a fresh server: chunked bodies over the size limit
// (refused as they arrive, memory bounded), chunked bodies within it, slowloris clients (no thread
// held, each cut off at the request deadline), the per-client connection cap, and malformed framing.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

const fs::path kGen = fs::path(MOETRON_SOURCE_DIR) / "tests" / "golden" / "generate";

struct Child {
  pid_t pid = -1;
  int port = 0;
};

// Starts `moetron serve` on a free port; returns once it prints the port.
Child start_server(const std::vector<std::string>& extra) {
  int out[2];
  if (pipe(out) != 0) throw std::runtime_error("pipe");
  std::vector<std::string> args = {MOETRON_BINARY, "serve", "--model", (kGen / "mixtral_gqa").string(), "--port", "0",
                                   "--quiet"};
  args.insert(args.end(), extra.begin(), extra.end());
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(out[1], STDOUT_FILENO);
    close(out[0]);
    close(out[1]);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    setenv("OMP_NUM_THREADS", "2", 1);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(out[1]);
  std::string line;
  char c;
  while (read(out[0], &c, 1) == 1 && c != '\n') line += c;
  close(out[0]);
  Child ch;
  ch.pid = pid;
  const auto colon = line.rfind(':');
  if (line.find("listening on http://127.0.0.1:") == std::string::npos || colon == std::string::npos)
    throw std::runtime_error("moetron serve did not start: '" + line + "'");
  ch.port = std::stoi(line.substr(colon + 1));
  return ch;
}

// A field of /proc/PID/status in KiB: "VmRSS:" (resident now) or "VmHWM:" (the peak so far).
long status_kib(pid_t pid, const std::string& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field, 0) == 0) return std::stol(line.substr(field.size()));
  return -1;
}

long rss_kib(pid_t pid) { return status_kib(pid, "VmRSS:"); }

bool alive(pid_t pid) { return kill(pid, 0) == 0 && waitpid(pid, nullptr, WNOHANG) == 0; }

// A connection to 127.0.0.1:port from the source address `from` (any 127.x.y.z is this machine too,
// so a test can be two clients).
int connect_to(int port, const char* from = nullptr) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (from) {
    sockaddr_in src{};
    src.sin_family = AF_INET;
    inet_pton(AF_INET, from, &src.sin_addr);
    if (bind(fd, (sockaddr*)&src, sizeof src) != 0) {
      close(fd);
      return -1;
    }
  }
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons((uint16_t)port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, (sockaddr*)&a, sizeof a) != 0) {
    close(fd);
    return -1;
  }
  timeval tv{5, 0};  // a server that never answers nor closes fails the test instead of hanging it
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

// What came back: a complete response, a clean close (""), or "TIMEOUT".
std::string read_reply(int fd) {
  std::string got;
  char buf[4096];
  for (;;) {
    const size_t head_end = got.find("\r\n\r\n");
    if (head_end != std::string::npos) {
      const size_t cl = got.find("Content-Length: ");
      if (cl != std::string::npos && cl < head_end &&
          got.size() >= head_end + 4 + std::stoul(got.substr(cl + 16)))
        return got;
    }
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n == 0) return got;
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK ? "TIMEOUT" : got;  // ECONNRESET: a close
    got.append(buf, n);
  }
}

// Sends raw bytes (send errors ignored: the server may close first), then reads the reply.
std::string raw(int port, const std::string& bytes, bool half_close = false) {
  const int fd = connect_to(port);
  if (fd < 0) return "CONNECT FAILED";
  send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  if (half_close) shutdown(fd, SHUT_WR);
  const std::string r = read_reply(fd);
  close(fd);
  return r;
}

// A 4xx response or a clean close.
::testing::AssertionResult rejected(const std::string& reply) {
  if (reply.empty() || reply.rfind("HTTP/1.1 4", 0) == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "reply: '" << reply.substr(0, 300) << "'";
}

std::string http_post(const std::string& path, const std::string& body, const std::string& extra_headers = "") {
  return "POST " + path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n" +
         extra_headers + "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

}  // namespace

TEST(ServeHostile, MalformedRequestsGet4xxAndTheServerKeepsServing) {
  signal(SIGPIPE, SIG_IGN);
  const json expected = [] {
    std::ifstream in(kGen / "expected.json");
    return json::parse(in)["cases"][0]["text"];
  }();
  const Child srv = start_server({"--read-timeout-ms", "300", "--write-timeout-ms", "300", "--keep-alive-s", "1",
                                  "--max-body-bytes", "65536", "--max-tokens-limit", "400", "--queue-size", "4"});
  const json good_chat = {{"messages", {{{"role", "user"}, {"content", expected["chat"]["user"]}}}},
                          {"max_tokens", expected["max_tokens"]},
                          {"temperature", 0}};
  httplib::Client cli("127.0.0.1", srv.port);
  cli.set_keep_alive(true);
  cli.set_tcp_nodelay(true);
  cli.set_read_timeout(5, 0);
  auto valid_request_works = [&] {
    auto r = cli.Post("/v1/chat/completions", good_chat.dump(), "application/json");
    for (int tries = 0; r && r->status == 429 && tries < 100; tries++) {  // the queue drains
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      r = cli.Post("/v1/chat/completions", good_chat.dump(), "application/json");
    }
    return r && r->status == 200 &&
           json::parse(r->body)["choices"][0]["message"]["content"] == expected["chat"]["content"];
  };
  ASSERT_TRUE(valid_request_works());
  const long rss_before = rss_kib(srv.pid);

  long sent = 0;
  auto t_section = std::chrono::steady_clock::now();
  auto section = [&](const char* name) {
    const auto now = std::chrono::steady_clock::now();
    std::printf("  %-28s %6.2f s, %ld requests so far\n", name, std::chrono::duration<double>(now - t_section).count(),
                sent);
    t_section = now;
  };
  // A request through the keep-alive client that must get a 4xx with an OpenAI error object.
  auto expect_4xx = [&](const std::string& path, const std::string& body) {
    sent++;
    auto r = cli.Post(path.c_str(), body, "application/json");
    ASSERT_TRUE(r) << "no reply (" << httplib::to_string(r.error()) << ") to " << body.substr(0, 200);
    ASSERT_GE(r->status, 400) << body.substr(0, 200);
    ASSERT_LT(r->status, 500) << body.substr(0, 200) << " -> " << r->body;
    const json j = json::parse(r->body, nullptr, false);
    ASSERT_TRUE(j.is_object() && j.contains("error") && j["error"].contains("message") &&
                j["error"].contains("type") && j["error"].contains("param") && j["error"].contains("code"))
        << r->body;
  };

  // 1. Every proper prefix of valid bodies (truncated JSON), on both endpoints.
  json long_chat = good_chat;
  long_chat["messages"].insert(long_chat["messages"].begin(), {{"role", "system"}, {"content", "Be brief, \"exact\" \u00e9."}});
  long_chat["stop"] = {"\n\n", "END"};
  long_chat["top_p"] = 0.9;
  long_chat["seed"] = 7;
  const std::string chat_text = long_chat.dump();
  const std::string comp_text = json{{"prompt", "Once upon a time"}, {"max_tokens", 4}, {"stop", {"x"}}}.dump();
  for (size_t n = 0; n < chat_text.size(); n++) expect_4xx("/v1/chat/completions", chat_text.substr(0, n));
  for (size_t n = 0; n < comp_text.size(); n++) expect_4xx("/v1/completions", comp_text.substr(0, n));

  section("truncated JSON");
  // 2. Wrong types and out-of-range values, field by field.
  const std::string long_stop = std::string(1, '"').append(300, 'x').append(1, '"');  // over 256 bytes
  const std::vector<std::pair<std::string, std::vector<std::string>>> bad_fields = {
      {"model", {"1", "true", "[]", "{}"}},
      {"max_tokens", {"-1", "0", "-9223372036854775808", "1.5", "\"10\"", "true", "[]", "1e30", "401",
                      "9223372036854775807", "99999999999999999999999", "500"}},
      {"max_completion_tokens", {"-3", "\"x\""}},
      {"temperature", {"-0.1", "2.5", "\"1\"", "true", "[]", "{}", "1e400"}},
      {"top_p", {"-1", "1.5", "\"x\"", "[]"}},
      {"top_k", {"-1", "1.5", "\"5\""}},
      {"n", {"0", "2", "\"1\"", "1.5", "-1"}},
      {"stream", {"\"yes\"", "1", "[]", "{}"}},
      {"stream_options", {"1", "\"x\"", "[]", "{\"include_usage\": \"yes\"}"}},
      {"stop", {"5", "[1]", "[\"a\",\"b\",\"c\",\"d\",\"e\"]", "[[]]", "{\"a\":1}", long_stop}},
      {"seed", {"1.5", "\"1\"", "true", "[]"}},
      {"presence_penalty", {"3", "-3", "\"0\""}},
      {"frequency_penalty", {"2.5", "[]"}},
      {"repetition_penalty", {"0", "-1", "\"1\"", "101"}},
      {"logprobs", {"true", "5"}},
      {"tools", {"[{\"type\":\"function\"}]"}},
      {"user", {"5", "[]"}},
  };
  for (const auto& [name, values] : bad_fields)
    for (const std::string& v : values) {
      // The literal text goes in (e.g. 1e400 and huge integers, which a JSON value would not keep).
      const std::string field = ",\"" + name + "\":" + v + "}";
      expect_4xx("/v1/chat/completions", chat_text.substr(0, chat_text.size() - 1) + field);
      if (name != "tools" && name != "max_completion_tokens")
        expect_4xx("/v1/completions", comp_text.substr(0, comp_text.size() - 1) + field);
    }
  const std::vector<std::string> bad_messages = {
      "\"hi\"", "1", "{}", "[]", "null", "[1]", "[null]", "[\"hi\"]", "[{}]", "[{\"role\":\"user\"}]",
      "[{\"content\":\"x\"}]", "[{\"role\":\"robot\",\"content\":\"x\"}]", "[{\"role\":1,\"content\":\"x\"}]",
      "[{\"role\":\"user\",\"content\":5}]", "[{\"role\":\"user\",\"content\":{}}]",
      "[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\"}]}]", "[{\"role\":\"user\",\"content\":[5]}]",
      "[{\"role\":\"user\",\"content\":[{\"type\":\"text\"}]}]", "[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":1}]}]",
      "[{\"role\":\"assistant\",\"content\":\"only me\"}]", "[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"assistant\",\"content\":\"\"}]"};
  for (const std::string& m : bad_messages) expect_4xx("/v1/chat/completions", "{\"messages\":" + m + "}");
  const std::vector<std::string> bad_prompts = {"5", "[]", "[\"a\",\"b\"]", "[1,2,3]", "{}", "true", "null", "[[1]]"};
  for (const std::string& p : bad_prompts) expect_4xx("/v1/completions", "{\"prompt\":" + p + "}");
  for (const char* b : {"[]", "1", "\"x\"", "null", "true", "{\"messages\":[{\"role\":\"user\",\"content\":\"\xc3\x28\"}]}",
                               "{\"a\":1,}", "{'messages':1}", "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}}"}) {
    expect_4xx("/v1/chat/completions", b);
    expect_4xx("/v1/completions", b);
  }
  // Deep nesting (the parser must neither crash nor recurse without bound).
  expect_4xx("/v1/chat/completions", std::string(100000 / 2, '[') + std::string(100000 / 2, ']'));
  expect_4xx("/v1/chat/completions", "{\"messages\":" + std::string(20000, '[') + std::string(20000, ']') + "}");

  section("wrong types and values");
  // 3. Too-long prompts (under the body limit) and bodies over it.
  std::string words;
  for (int i = 0; i < 600; i++) words += "cat ";
  for (int i = 0; i < 10; i++) {
    expect_4xx("/v1/completions", json{{"prompt", words}}.dump());
    expect_4xx("/v1/chat/completions", json{{"messages", {{{"role", "user"}, {"content", words}}}}}.dump());
    expect_4xx("/v1/completions", json{{"prompt", std::string(70000 + 1000 * i, 'a')}}.dump());
  }
  expect_4xx("/v1/completions", json{{"prompt", std::string(5'000'000, 'a')}}.dump());

  section("too long / too large");
  // 4. Unknown routes and methods.
  for (const char* path : {"/", "/v1", "/v1/chat", "/v1/embeddings", "/v2/completions", "/v1/completions/x",
                           "/../../etc/passwd", "/v1/models/../x"}) {
    sent += 2;
    auto g = cli.Get(path);
    ASSERT_TRUE(g);
    EXPECT_GE(g->status, 400);
    EXPECT_LT(g->status, 500);
    auto p = cli.Post(path, "{}", "application/json");
    ASSERT_TRUE(p);
    EXPECT_GE(p->status, 400);
    EXPECT_LT(p->status, 500);
  }
  for (const char* m : {"PUT", "DELETE", "PATCH", "OPTIONS", "BREW"}) {
    sent++;
    EXPECT_TRUE(rejected(raw(srv.port, std::string(m) + " /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")));
  }

  section("routes and methods");
  // 5. Garbage and bad framing over raw sockets.
  const std::vector<std::string> garbage = {
      "GARBAGE\r\n\r\n",
      std::string("\x00\x01\x02\xff\xfe\r\n\r\n", 9),
      "POST /v1/completions HTTP/9.9\r\n\r\n",
      "POST /v1/completions\r\n\r\n",
      " / HTTP/1.1\r\n\r\n",
      "POST /v1/completions HTTP/1.1\r\nContent-Length: abc\r\n\r\n{}",
      "POST /v1/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n{}",
      "POST /v1/completions HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n{}",
      "POST /v1/completions HTTP/1.1\r\nContent-Length: 10000000\r\n\r\n{}",
      "POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nZZZ\r\nabc\r\n0\r\n\r\n",
      "POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n10000000\r\nabc\r\n",
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nBadHeader\r\n\r\n",
      "GET /" + std::string(20000, 'a') + " HTTP/1.1\r\nHost: x\r\n\r\n",
      "GET /health HTTP/1.1\r\n" + std::string(20000, 'X') + ": y\r\n\r\n",
      http_post("/v1/completions", "{\"prompt\":\"hi\"}", "Content-Encoding: gzip\r\n"),
      http_post("/v1/completions", std::string(64, '\0')),
  };
  for (const std::string& g : garbage) {
    for (bool half : {false, true}) {
      sent++;
      EXPECT_TRUE(rejected(raw(srv.port, g, half))) << "request: " << g.substr(0, 80);
    }
  }
  // Many headers, then a malformed body.
  std::string many = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n";
  for (int i = 0; i < 2000; i++) many += "X-" + std::to_string(i) + ": y\r\n";
  sent++;
  EXPECT_TRUE(rejected(raw(srv.port, many + "Content-Length: 1\r\n\r\n{")));

  section("garbage and framing");
  // 6. Clients that stall: silent connections, half-sent headers, half-sent bodies.  The server must
  // close each within about its read timeout (300 ms), with or without a 4xx.
  {
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> th;
    std::vector<std::string> replies(12);
    for (int i = 0; i < 12; i++)
      th.emplace_back([&, i] {
        const std::string part = i % 3 == 0   ? ""
                                 : i % 3 == 1 ? "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                              : "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\":";
        replies[i] = raw(srv.port, part);
      });
    for (auto& t : th) t.join();
    sent += 12;
    for (const std::string& r : replies) EXPECT_TRUE(rejected(r));
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 4.0);
  }

  section("stalled clients");
  // 7. Clients that disconnect mid-stream (after the first event), or never read the stream.
  for (int i = 0; i < 12; i++) {
    sent++;
    const int fd = connect_to(srv.port);
    ASSERT_GE(fd, 0);
    const std::string req = http_post(i % 2 ? "/v1/completions" : "/v1/chat/completions",
                                      i % 2 ? json{{"prompt", "Once"}, {"max_tokens", 400}, {"stream", true}}.dump()
                                            : json{{"messages", {{{"role", "user"}, {"content", "Hi"}}}},
                                                   {"max_tokens", 400},
                                                   {"stream", true}}
                                                  .dump());
    send(fd, req.data(), req.size(), MSG_NOSIGNAL);
    if (i % 3 != 2) {
      char buf[256];
      const ssize_t n = recv(fd, buf, sizeof buf, 0);
      EXPECT_GT(n, 0);
      const std::string status(buf, n > 12 ? 12 : 0);  // 429: the queue is full of earlier deserters
      EXPECT_TRUE(status == "HTTP/1.1 200" || status == "HTTP/1.1 429") << status;
    }
    if (i % 3 == 1) {  // abortive close (RST)
      linger l{1, 0};
      setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
    }
    close(fd);
  }

  section("mid-stream disconnects");
  ASSERT_TRUE(alive(srv.pid)) << "the server died";
  EXPECT_GE(sent, 500);
  // The server still serves, with the right reply.
  EXPECT_TRUE(valid_request_works());
  auto h = cli.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  const long rss_after = rss_kib(srv.pid);
  std::printf("hostile clients: %ld malformed requests; server RSS before %.1f MiB, after %.1f MiB\n", sent,
              rss_before / 1024.0, rss_after / 1024.0);
  ::testing::Test::RecordProperty("rss_before_kib", (int)rss_before);
  ::testing::Test::RecordProperty("rss_after_kib", (int)rss_after);
  EXPECT_LT(rss_after - rss_before, 64 * 1024) << "resident memory grew by more than 64 MiB";

  // SIGTERM: a clean exit.
  kill(srv.pid, SIGTERM);
  int status = 0;
  waitpid(srv.pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
}

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The status code of a reply ("HTTP/1.1 413 ..." -> 413), 0 when there is none.
int status_of(const std::string& reply) {
  if (reply.rfind("HTTP/1.1 ", 0) != 0 || reply.size() < 12) return 0;
  return std::atoi(reply.substr(9, 3).c_str());
}

// The body after the head, parsed as JSON (discarded when it is not JSON).
json body_of(const std::string& reply) {
  const size_t head_end = reply.find("\r\n\r\n");
  if (head_end == std::string::npos) return json(json::value_t::discarded);
  return json::parse(reply.substr(head_end + 4), nullptr, false);
}

::testing::AssertionResult is_error_reply(const std::string& reply, int status) {
  const json j = body_of(reply);
  if (status_of(reply) != status || !j.is_object() || !j.contains("error") || !j["error"].contains("message") ||
      !j["error"].contains("type") || !j["error"].contains("param") || !j["error"].contains("code"))
    return ::testing::AssertionFailure() << "expected " << status << " with an error object, got '"
                                         << reply.substr(0, 400) << "'";
  return ::testing::AssertionSuccess();
}

// SIGTERM, and the exit status must be 0.
void stop_server(const Child& srv) {
  kill(srv.pid, SIGTERM);
  int status = 0;
  waitpid(srv.pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
}

json expected_text() {
  std::ifstream in(kGen / "expected.json");
  return json::parse(in)["cases"][0]["text"];
}

std::string good_chat_body(const json& t) {
  return json{{"messages", {{{"role", "user"}, {"content", t["chat"]["user"]}}}},
              {"max_tokens", t["max_tokens"]},
              {"temperature", 0}}
      .dump();
}

// A chat reply with the expected greedy text.
::testing::AssertionResult is_expected_chat(const std::string& reply, const json& t) {
  const json j = body_of(reply);
  if (status_of(reply) == 200 && j.is_object() && j.contains("choices") &&
      j["choices"][0]["message"]["content"] == t["chat"]["content"])
    return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "reply: '" << reply.substr(0, 400) << "'";
}

std::string health_request(bool close = true) {
  return std::string("GET /health HTTP/1.1\r\nHost: x\r\n") + (close ? "Connection: close\r\n" : "") + "\r\n";
}

}  // namespace

// CVE-2025-46728 in cpp-httplib 0.11.4 (the server's old transport): a chunked body ignored the size
// limit and was buffered whole (64 MB of it took the server from 165 MB to 3.3 GB).  Now the decoded
// bytes are counted as they arrive: the body is refused with 413 once it passes the limit, and the
// server's memory grows by about the limit, not by what the client sends.
TEST(ServeHostile, ChunkedBodyOverTheLimitGets413AndMemoryStaysBounded) {
  signal(SIGPIPE, SIG_IGN);
  const long limit = 1 << 20;
  const Child srv = start_server({"--max-body-bytes", std::to_string(limit)});
  const json t = expected_text();
  ASSERT_TRUE(is_expected_chat(raw(srv.port, http_post("/v1/chat/completions", good_chat_body(t))), t));
  const long rss_before = rss_kib(srv.pid), hwm_before = status_kib(srv.pid, "VmHWM:");

  // 64 MiB of valid-looking JSON text in 64 KiB chunks; the sender stops as soon as a reply arrives.
  const int fd = connect_to(srv.port);
  ASSERT_GE(fd, 0);
  const std::string head =
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n";
  ASSERT_EQ(send(fd, head.data(), head.size(), MSG_NOSIGNAL), (ssize_t)head.size());
  const std::string chunk = "10000\r\n" + std::string(65536, 'a') + "\r\n";
  const std::string opening = "e\r\n{\"prompt\": \"aa\r\n";  // 14 bytes: {"prompt": "aa
  send(fd, opening.data(), opening.size(), MSG_NOSIGNAL);
  long sent = 0, rss_peak = rss_before;
  for (int i = 0; i < 1024; i++) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 0) > 0) break;  // the server answered
    if (send(fd, chunk.data(), chunk.size(), MSG_NOSIGNAL) != (ssize_t)chunk.size()) break;  // or closed
    sent += 65536;
    if (i % 8 == 0) rss_peak = std::max(rss_peak, rss_kib(srv.pid));
  }
  const std::string reply = read_reply(fd);
  close(fd);
  rss_peak = std::max(rss_peak, rss_kib(srv.pid));
  EXPECT_TRUE(is_error_reply(reply, 413));
  EXPECT_LT(sent, 32L << 20) << "the server took " << sent << " bytes before refusing";

  // A chunk that declares more than the limit is refused at its size line, before its data.
  EXPECT_TRUE(is_error_reply(raw(srv.port, head + "4000000\r\n" + std::string(1000, 'a')), 413));
  EXPECT_TRUE(is_error_reply(raw(srv.port, head + "100001\r\n" + std::string(1000, 'a')), 413));  // limit + 1 bytes
  // A 4 MB prompt in 1 MiB chunks (under the old transport it was decoded and tokenized in full).
  {
    std::string body = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
    for (int i = 0; i < 4; i++) body += "100000\r\n" + std::string(1 << 20, 'a') + "\r\n";
    EXPECT_TRUE(is_error_reply(raw(srv.port, body + "0\r\n\r\n"), 413));
  }
  const long rss_after = rss_kib(srv.pid), hwm_after = status_kib(srv.pid, "VmHWM:");
  std::printf("chunked 64 MiB body, limit 1 MiB: refused with 413 after %.1f MiB sent; server RSS before %.1f MiB, "
              "peak seen %.1f MiB, after %.1f MiB; VmHWM %.1f -> %.1f MiB\n",
              sent / 1048576.0, rss_before / 1024.0, rss_peak / 1024.0, rss_after / 1024.0, hwm_before / 1024.0,
              hwm_after / 1024.0);
  ::testing::Test::RecordProperty("rss_before_kib", (int)rss_before);
  ::testing::Test::RecordProperty("rss_peak_kib", (int)rss_peak);
  const long bound_kib = limit / 1024 + 8 * 1024;  // the limit + 8 MiB
  EXPECT_LT(rss_peak - rss_before, bound_kib) << "resident memory grew by " << (rss_peak - rss_before) << " KiB";
  EXPECT_LT(hwm_after - hwm_before, bound_kib) << "peak resident memory grew by " << (hwm_after - hwm_before) << " KiB";
  ASSERT_TRUE(alive(srv.pid));
  EXPECT_TRUE(is_expected_chat(raw(srv.port, http_post("/v1/chat/completions", good_chat_body(t))), t));
  stop_server(srv);
}

// Chunked bodies within the limit are requests like any other: small chunks, a chunk extension and a
// trailer, one byte per write; and Expect: 100-continue gets "100 Continue" before the reply.
TEST(ServeHostile, ChunkedBodyWithinTheLimitIsServed) {
  signal(SIGPIPE, SIG_IGN);
  const Child srv = start_server({"--max-body-bytes", "65536"});
  const json t = expected_text();
  const std::string body = good_chat_body(t);
  std::string chunked;
  for (size_t i = 0; i < body.size(); i += 7) {
    const std::string piece = body.substr(i, 7);
    char size[16];
    std::snprintf(size, sizeof size, "%zx", piece.size());
    chunked += std::string(size) + (i == 0 ? ";name=value" : "") + "\r\n" + piece + "\r\n";
  }
  chunked += "0\r\nX-Trailer: ignored\r\n\r\n";
  const std::string head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                           "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n";
  EXPECT_TRUE(is_expected_chat(raw(srv.port, head + chunked), t));
  {  // byte by byte
    const int fd = connect_to(srv.port);
    ASSERT_GE(fd, 0);
    const std::string all = head + chunked;
    for (char c : all) ASSERT_EQ(send(fd, &c, 1, MSG_NOSIGNAL), 1);
    EXPECT_TRUE(is_expected_chat(read_reply(fd), t));
    close(fd);
  }
  {  // Expect: 100-continue: the interim reply comes before the body is sent
    const int fd = connect_to(srv.port);
    ASSERT_GE(fd, 0);
    const std::string h = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nExpect: 100-continue\r\n"
                          "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n";
    send(fd, h.data(), h.size(), MSG_NOSIGNAL);
    char buf[64];
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    EXPECT_EQ(std::string(buf, n > 0 ? n : 0), "HTTP/1.1 100 Continue\r\n\r\n");
    send(fd, body.data(), body.size(), MSG_NOSIGNAL);
    EXPECT_TRUE(is_expected_chat(read_reply(fd), t));
    close(fd);
  }
  // The same body through httplib's client, which sends a body of unknown length chunked.
  httplib::Client cli("127.0.0.1", srv.port);
  cli.set_read_timeout(5, 0);
  auto r = cli.Post(
      "/v1/chat/completions",
      [&](size_t offset, httplib::DataSink& sink) {
        if (offset < body.size()) sink.write(body.data() + offset, std::min<size_t>(10, body.size() - offset));
        if (offset + 10 >= body.size()) sink.done();
        return true;
      },
      "application/json");
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(json::parse(r->body)["choices"][0]["message"]["content"], t["chat"]["content"]);
  stop_server(srv);
}

// Slowloris: clients that send one header line (or body byte) at a time, each well inside the read
// timeout, never finishing.  Under the old transport 16 of them held every HTTP thread and /health stopped answering.
// Now heads are read by the event thread (two worker threads here, fewer than the slow clients), so
// /health answers at once throughout, and each slow client gets 408 and is closed when the request
// deadline (2 s from its first byte) passes.
TEST(ServeHostile, SlowlorisHoldsNoThreadAndMeetsTheRequestDeadline) {
  signal(SIGPIPE, SIG_IGN);
  const int deadline_ms = 2000, n_slow = 32;
  const Child srv = start_server({"--request-timeout-ms", std::to_string(deadline_ms), "--http-threads", "2",
                                  "--max-connections-per-client", "64"});
  struct Slow {
    std::string reply;
    double answered_after = -1;  // seconds from the first byte to the reply
    bool closed = false;         // and the server closed the connection
    int lines = 0;
  };
  std::vector<Slow> slow(n_slow);
  std::vector<std::thread> threads;
  for (int i = 0; i < n_slow; i++)
    threads.emplace_back([&, i] {
      const int fd = connect_to(srv.port);
      if (fd < 0) return;
      // Every fourth trickles its body instead (the deadline covers head and body).
      const bool body = i % 4 == 3;
      const std::string first = body ? "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"
                                     : "POST /v1/completions HTTP/1.1\r\nHost: x\r\n";
      const auto t0 = std::chrono::steady_clock::now();
      send(fd, first.data(), first.size(), MSG_NOSIGNAL);
      for (int k = 0; k < 8; k++) {
        pollfd p{fd, POLLIN, 0};
        if (poll(&p, 1, 1000) > 0) {
          slow[i].reply = read_reply(fd);
          slow[i].answered_after = seconds_since(t0);
          char c;
          slow[i].closed = recv(fd, &c, 1, 0) == 0;
          break;
        }
        const std::string line = body ? std::string(" ") : "X-Slow-" + std::to_string(k) + ": y\r\n";
        if (send(fd, line.data(), line.size(), MSG_NOSIGNAL) > 0) slow[i].lines++;
      }
      close(fd);
    });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // every slow client is in its head
  double worst = 0;
  int answered = 0, tries = 0;
  const auto t_health = std::chrono::steady_clock::now();
  while (seconds_since(t_health) < 1.5) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string r = raw(srv.port, health_request());
    worst = std::max(worst, seconds_since(t0));
    tries++;
    if (status_of(r) == 200) answered++;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  for (auto& th : threads) th.join();
  std::printf("slowloris: %d clients sending a header line (or body byte) every 1 s; /health answered %d of %d times, slowest "
              "%.1f ms; the slow clients got:", n_slow, answered, tries, worst * 1000);
  double first = 1e9, last = 0;
  for (const Slow& s : slow) {
    first = std::min(first, s.answered_after);
    last = std::max(last, s.answered_after);
  }
  std::printf(" a reply %.2f .. %.2f s after their first byte\n", first, last);
  ::testing::Test::RecordProperty("health_worst_ms", (int)(worst * 1000));
  EXPECT_EQ(answered, tries);
  EXPECT_LT(worst, 1.0);
  for (int i = 0; i < n_slow; i++) {
    SCOPED_TRACE("slow client " + std::to_string(i));
    EXPECT_TRUE(is_error_reply(slow[i].reply, 408));
    EXPECT_TRUE(slow[i].closed);
    EXPECT_GE(slow[i].lines, 1);  // it was still sending (the read timeout did not cut it off)
    EXPECT_GE(slow[i].answered_after, deadline_ms / 1000.0 - 0.2);
    EXPECT_LT(slow[i].answered_after, deadline_ms / 1000.0 + 1.5);
  }
  const json t = expected_text();
  EXPECT_TRUE(is_expected_chat(raw(srv.port, http_post("/v1/chat/completions", good_chat_body(t))), t));
  stop_server(srv);
}

// One client may hold max_connections_per_client connections: with 4, a fifth from 127.0.0.1 gets 503
// (or just a close) while the four stay open and are served; another client (127.0.0.2) is not
// affected; once the four close, 127.0.0.1 connects again.
TEST(ServeHostile, ConnectionsPerClientAreCapped) {
  signal(SIGPIPE, SIG_IGN);
  const Child srv = start_server({"--max-connections-per-client", "4"});
  std::vector<int> four;
  for (int i = 0; i < 4; i++) {
    four.push_back(connect_to(srv.port));
    ASSERT_GE(four.back(), 0);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // accepted (the server takes them in order anyway)
  const int fifth = connect_to(srv.port);
  ASSERT_GE(fifth, 0);  // the kernel completes the handshake; the server then refuses it
  const std::string h = health_request();
  send(fifth, h.data(), h.size(), MSG_NOSIGNAL);
  const std::string refused = read_reply(fifth);
  close(fifth);
  std::printf("the fifth connection from 127.0.0.1 got: '%s'\n",
              refused.empty() ? "(closed)" : refused.substr(0, refused.find("\r\n")).c_str());
  EXPECT_TRUE(refused.empty() || is_error_reply(refused, 503)) << refused;
  // Another client is served meanwhile.
  EXPECT_EQ(status_of([&] {
              const int fd = connect_to(srv.port, "127.0.0.2");
              send(fd, h.data(), h.size(), MSG_NOSIGNAL);
              const std::string r = read_reply(fd);
              close(fd);
              return r;
            }()),
            200);
  // The four are open and served (keep-alive: they stay open after the reply).
  for (int fd : four) {
    const std::string keep = health_request(false);
    ASSERT_EQ(send(fd, keep.data(), keep.size(), MSG_NOSIGNAL), (ssize_t)keep.size());
    EXPECT_EQ(status_of(read_reply(fd)), 200);
  }
  for (int fd : four) close(fd);
  // Once the server has seen them close, a new connection works.
  int status = 0;
  const auto t0 = std::chrono::steady_clock::now();
  while (status != 200 && seconds_since(t0) < 2) {
    status = status_of(raw(srv.port, h));
    if (status != 200) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(status, 200);
  stop_server(srv);
}

// Malformed framing, each with the status it must get (and an error object), every one on a fresh
// connection; the server keeps serving throughout.  The requests go to GET /health, which would answer
// 200 to any of them read some other way (a body there is read and ignored).
TEST(ServeHostile, MalformedFramingGets4xxAndTheServerKeepsServing) {
  signal(SIGPIPE, SIG_IGN);
  const Child srv = start_server({"--max-body-bytes", "65536"});
  const std::string get = "GET /health HTTP/1.1\r\nHost: x\r\n";
  const std::string te = get + "Transfer-Encoding: chunked\r\n\r\n";
  std::string many_headers = "GET /health HTTP/1.1\r\nHost: x\r\n", big_head = many_headers;
  for (int i = 0; i < 200; i++) many_headers += "X-" + std::to_string(i) + ": y\r\n";
  for (int i = 0; i < 70; i++) big_head += "X-" + std::to_string(i) + ": " + std::string(1000, 'y') + "\r\n";
  const std::vector<std::pair<int, std::string>> cases = {
      // Content-Length
      {400, get + "Content-Length: abc\r\n\r\n{}"},
      {400, get + "Content-Length: -5\r\n\r\n{}"},
      {400, get + "Content-Length: +2\r\n\r\n{}"},
      {400, get + "Content-Length: 2, 2\r\n\r\n{}"},
      {400, get + "Content-Length: 0x10\r\n\r\n{}"},
      {400, get + "Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}x"},
      {413, get + "Content-Length: 65537\r\n\r\n{}"},
      {413, get + "Content-Length: 99999999999999999999999999\r\n\r\n{}"},
      // Transfer-Encoding
      {400, get + "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"},
      {400, get + "Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n"},
      {400, get + "Transfer-Encoding: gzip\r\n\r\n"},
      {400, get + "Transfer-Encoding: gzip, chunked\r\n\r\n"},
      {400, get + "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"},
      {400, "GET /health HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"},
      // chunks
      {400, te + "ZZZ\r\nabc\r\n0\r\n\r\n"},
      {400, te + "-1\r\nabc\r\n0\r\n\r\n"},
      {400, te + "\r\nabc\r\n0\r\n\r\n"},
      {400, te + "3 junk\r\nabc\r\n0\r\n\r\n"},
      {400, te + "3\r\nabcdef\r\n0\r\n\r\n"},  // data longer than its size
      {400, te + "3\r\nabcXY0\r\n\r\n"},      // no CRLF after the data
      {400, te + "3\nabc\r\n0\r\n\r\n"},
      {400, te + "3;" + std::string(2000, 'e') + "\r\nabc\r\n0\r\n\r\n"},
      {413, te + "FFFFFFFFFFFFFFFFFFFFFFFF\r\nabc\r\n"},
      {413, te + "8000\r\n" + std::string(32768, 'a') + "\r\n8000\r\n" + std::string(32768, 'a') + "\r\n1\r\na\r\n"},
      {431, te + "0\r\n" + std::string(9000, 'T') + "\r\n\r\n"},
      // the head
      {414, "GET /" + std::string(9000, 'a') + " HTTP/1.1\r\nHost: x\r\n\r\n"},
      {431, "GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(9000, 'y') + "\r\n\r\n"},
      {431, many_headers + "\r\n"},
      {431, big_head + "\r\n"},
      {400, "GET /health HTTP/1.1\nHost: x\n\n"},
      {400, "GET /health HTTP/1.1\r\nHost: x\rX: y\r\n\r\n"},
      {400, "GET /health HTTP/1.1\r\nHost: x\r\nX: y\r\n folded\r\n\r\n"},
      {400, "GET /health HTTP/1.1\r\nHost : x\r\n\r\n"},
      {400, "GET /health HTTP/1.1\r\nHost: x\r\nX: a" + std::string(1, '\0') + "b\r\n\r\n"},
      {400, "GET /health HTTP/1.1\r\n\r\n"},  // no Host
      {400, "GET /health HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n"},
      {400, "GET  /health HTTP/1.1\r\nHost: x\r\n\r\n"},
      {400, "GET http://x/health HTTP/1.1\r\nHost: x\r\n\r\n"},
      {400, "GET /health HTTP/2.0\r\nHost: x\r\n\r\n"},
      {400, "G(T /health HTTP/1.1\r\nHost: x\r\n\r\n"},
      {415, get + "Content-Encoding: gzip\r\nContent-Length: 2\r\n\r\n{}"},
      {417, get + "Expect: 200-ok\r\nContent-Length: 2\r\n\r\n{}"},
      {405, "HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n"},
      {404, "GET /v1/models/ HTTP/1.1\r\nHost: x\r\n\r\n"},
      // cut short (the client closes its side mid-request)
      {400, get + "Content-Length: 10\r\n\r\n{\"pr"},
      {400, te + "5\r\nab"},
  };
  for (size_t i = 0; i < cases.size(); i++) {
    const auto& [status, bytes] = cases[i];
    SCOPED_TRACE("case " + std::to_string(i) + ": " + bytes.substr(0, 100));
    EXPECT_TRUE(is_error_reply(raw(srv.port, bytes, /*half_close=*/true), status));
    if (i % 8 == 0) {
      EXPECT_EQ(status_of(raw(srv.port, health_request())), 200);
    }
  }
  // Well-formed edge cases are served: HTTP/1.0 without Host, an empty line before the request line,
  // a percent-encoded path, two pipelined requests in one write (answered in order).
  EXPECT_EQ(status_of(raw(srv.port, "GET /health HTTP/1.0\r\n\r\n")), 200);
  EXPECT_EQ(status_of(raw(srv.port, "\r\n" + health_request())), 200);
  EXPECT_EQ(status_of(raw(srv.port, "GET /v1/models/mixtral%5Fgqa HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")),
            200);
  {
    const int fd = connect_to(srv.port);
    ASSERT_GE(fd, 0);
    const std::string two = "GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n" + health_request();
    send(fd, two.data(), two.size(), MSG_NOSIGNAL);
    std::string all;
    char buf[4096];
    for (ssize_t n; (n = recv(fd, buf, sizeof buf, 0)) > 0;) all.append(buf, n);
    close(fd);
    const size_t second = all.find("HTTP/1.1 ", 1);
    ASSERT_NE(second, std::string::npos) << all;
    EXPECT_EQ(body_of(all.substr(0, second))["object"], "list");
    EXPECT_EQ(body_of(all.substr(second))["status"], "ok");
  }
  ASSERT_TRUE(alive(srv.pid));
  const json t = expected_text();
  EXPECT_TRUE(is_expected_chat(raw(srv.port, http_post("/v1/chat/completions", good_chat_body(t))), t));
  stop_server(srv);
}
