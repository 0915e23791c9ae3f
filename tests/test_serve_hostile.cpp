// moetron serve against hostile clients, as a child process (the real binary, its own memory):
// well over 500 malformed requests -- truncated and invalid JSON, wrong types and out-of-range values
// for every field, negative and huge max_tokens, too-long prompts, bodies over the size limit,
// garbage instead of HTTP, bad framing, clients that stall before or inside a request, clients that
// disconnect mid-stream.  Each must get a 4xx with an error object, or a clean close; afterwards the
// server answers a valid request with the expected reply and exits cleanly on SIGTERM.  The child's
// resident memory before and after is printed (and bounded).  Short timeouts (flags) keep it fast.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

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

long rss_kib(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  return -1;
}

bool alive(pid_t pid) { return kill(pid, 0) == 0 && waitpid(pid, nullptr, WNOHANG) == 0; }

int connect_to(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
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
