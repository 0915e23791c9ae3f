// moetron serve: an OpenAI-compatible HTTP server over the generation engine, on moetron's own
// HTTP/1.1 layer (http.h).
//
// Endpoints: POST /v1/chat/completions, POST /v1/completions (plain JSON, or Server-Sent Events with
// "stream": true, ending with "data: [DONE]"), GET /v1/models, GET /v1/models/<id>, GET /health.
// Requests and errors are described in openai_api.h; the queue in engine.h.
//
// Limits (ServerOptions): request bodies over max_body_bytes get 413 -- with Content-Length before
// the body is read, chunked the moment the decoded bytes pass the limit, so a body never takes more
// memory than the limit; prompts over max_prompt_tokens, or prompt + max_tokens beyond the model's
// positions, get 400 (code "context_length_exceeded"); max_tokens above max_tokens_limit gets 400; a
// full queue gets 429.  Every error is a JSON error object with a 4xx (5xx only for a failure inside
// generation, and 503 for a connection over the limits below) and the server keeps serving.
// Slow or stalled clients: request heads and bodies are read by one event thread for all connections,
// so a slow client holds no HTTP thread; a request must be complete request_timeout_ms after its
// first byte, with no silence over read_timeout_ms (else 408 and the connection is closed); one IP
// address may hold max_connections_per_client connections, everyone together max_connections (the
// next one gets 503 and is closed).  A streaming client that disconnects cancels its generation at
// the next token (or within 100 ms while it waits, when the connection was reset).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "infer/model.h"
#include "infer/runner.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace moetron::server {

namespace http {
class Server;
}

class Engine;

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                  // 0: any free port (see Server::port())
  std::string model_name = "moetron";
  size_t max_body_bytes = 1 << 20;  // 1 MiB
  int max_prompt_tokens = 0;        // 0: the model's positions - 1
  int max_tokens_limit = 4096;      // the largest max_tokens a request may ask for (also the default cap)
  size_t queue_size = 8;            // requests waiting behind the running batch
  int max_batch = 0;                // requests decoded together (continuous batching); 0: auto_max_batch()
  int http_threads = 0;             // threads running handlers; 0: queue_size + max_batch + 8
  int read_timeout_ms = 10000;      // silence allowed inside a request (and before a connection's first)
  int request_timeout_ms = 30000;   // a whole request (head and body) from its first byte
  int write_timeout_ms = 10000;
  int keep_alive_timeout_s = 5;
  int max_connections_per_client = 16;  // open connections from one IP address
  int max_connections = 1024;           // open connections in all
  bool log_requests = false;        // one line per request on stderr
};

// The default batch: 4 sequences per compute thread, 4 to 16 (a step of B sequences reads each
// weight once; beyond ~16 on a CPU the step's arithmetic, not its weight reads, sets the pace).
int auto_max_batch(int compute_threads);

class Server {
 public:
  // Borrows the runner (the model) and tokenizer (they must outlive the server).
  // `tc`: how chats are formatted (infer/model.h); with the model's Jinja template, requests may carry
  // tools, tool calls and results, reasoning_content and chat_template_kwargs, which it renders.
  Server(Runner& runner, const Tokenizer& tok, TemplateChoice tc, std::vector<int32_t> eos_ids, ServerOptions opts);
  Server(Runner& runner, const Tokenizer& tok, ChatTemplate tmpl, std::vector<int32_t> eos_ids, ServerOptions opts)
      : Server(runner, tok, TemplateChoice{tmpl, "", nullptr, {}}, std::move(eos_ids), std::move(opts)) {}
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds the listening socket (Error naming host:port when it cannot); returns the port.
  int bind();
  // Serves until stop() (blocking); bind() first.  Ignores SIGPIPE process-wide (a client that goes
  // away mid-response must not kill the server).
  void run();
  // Stops accepting, cancels generation and makes run() return.  Thread-safe; idempotent.
  void stop();
  int port() const { return port_; }
  int max_batch() const { return opts_.max_batch; }  // as resolved (auto: auto_max_batch)

 private:
  void routes();

  Runner& runner_;
  const Tokenizer& tok_;
  TemplateChoice tc_;
  std::vector<int32_t> eos_ids_;
  ServerOptions opts_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<http::Server> http_;
  int port_ = -1;
  long created_ = 0;
};

}  // namespace moetron::server
