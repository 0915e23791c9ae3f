#include "server/server.h"

#include <algorithm>
#include <csignal>
#include <chrono>
#include <climits>
#include <cstdio>
#include <random>

#include <fmt/format.h>
#include <omp.h>

#include "core/error.h"
#include "infer/chat_format.h"
#include "infer/generate.h"
#include "server/engine.h"
#include "server/http.h"
#include "server/openai_api.h"

namespace moetron::server {

namespace {

using json = nlohmann::json;

std::string random_id(const char* prefix) {
  std::random_device rd;
  return fmt::format("{}{:08x}{:08x}{:08x}", prefix, rd(), rd(), rd());
}

long unix_now() {
  return (long)std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void send_error(http::Response& res, const ApiError& e) {
  res = http::Response{};
  res.status = e.status;
  res.body = error_json(e);
}

void send_json(http::Response& res, const json& j) { res.body = dump(j); }

// A streamed reply's state, owned by the response's stream function.  Whatever ends the response (the
// stream finished, was cut, or never started because the head could not be sent) destroys it, and
// that cancels the job: a generation nobody will read stops at its next token.
struct StreamState {
  std::shared_ptr<Job> job;
  Endpoint endpoint;
  std::string id, model;
  long created = 0;
  int prompt_tokens = 0;
  bool include_usage = false;
  ~StreamState() {
    if (job) job->cancel();  // a no-op once the job has finished
  }
};

bool send_event(http::StreamSink& sink, const std::string& data) { return sink.write("data: " + data + "\n\n"); }

// The Server-Sent Events of one streamed completion; true when the stream ended with [DONE].
bool stream_events(StreamState& st, http::StreamSink& sink) {
  const Endpoint ep = st.endpoint;
  // An empty first chunk (the assistant role) right away.
  if (ep == Endpoint::chat && !send_event(sink, dump(stream_chunk(ep, st.id, st.created, st.model, "", true, ""))))
    return false;
  for (;;) {
    std::vector<std::string> pieces;
    const bool done = st.job->wait(pieces, 100);
    for (const std::string& p : pieces)
      if (!send_event(sink, dump(stream_chunk(ep, st.id, st.created, st.model, p, false, "")))) return false;
    if (done) break;
    if (!sink.connected()) return false;  // reset by the client while its job waits or prefills
  }
  const GenerateResult& g = st.job->result();
  if (!st.job->error().empty()) {
    if (!send_event(sink, error_json(ApiError(500, "generation failed: " + st.job->error(), "server_error", "",
                                              "generation_failed"))))
      return false;
  } else {
    if (g.finish == FinishReason::cancelled) return false;  // shutting down
    if (!send_event(sink, dump(stream_chunk(ep, st.id, st.created, st.model, "", false, finish_reason_name(g.finish)))))
      return false;
    if (st.include_usage &&
        !send_event(sink, dump(usage_chunk(ep, st.id, st.created, st.model, {st.prompt_tokens, (int)g.tokens.size()}))))
      return false;
  }
  return send_event(sink, "[DONE]");
}

// The error body of a reply the HTTP layer makes itself (framing, limits, routes): the same OpenAI
// error object as every other error.
std::string http_error_body(int status, const std::string& message) {
  return error_json(ApiError(status, message, status < 500 ? "invalid_request_error" : "server_error", "",
                             status == 405 ? "method_not_allowed" : ""));
}

}  // namespace

int auto_max_batch(int compute_threads) { return std::clamp(4 * compute_threads, 4, 16); }

Server::Server(Runner& runner, const Tokenizer& tok, TemplateChoice tc, std::vector<int32_t> eos_ids,
               ServerOptions opts)
    : runner_(runner), tok_(tok), tc_(std::move(tc)), eos_ids_(std::move(eos_ids)), opts_(std::move(opts)) {
  if (opts_.queue_size < 1) fail("serve: the queue size must be at least 1");
  if (opts_.max_tokens_limit < 1) fail("serve: the max_tokens limit must be at least 1");
  if (opts_.read_timeout_ms < 1 || opts_.write_timeout_ms < 1 || opts_.request_timeout_ms < 1)
    fail("serve: timeouts must be positive");
  if (opts_.keep_alive_timeout_s < 0) fail("serve: the keep-alive timeout must not be negative");
  if (opts_.max_connections < 1 || opts_.max_connections_per_client < 1)
    fail("serve: connection limits must be at least 1");
  if (opts_.max_batch < 0 || opts_.max_batch > 256) fail("serve: the batch size must be in [0, 256] (0: auto)");
  if (opts_.max_batch == 0) opts_.max_batch = auto_max_batch(omp_get_max_threads());
  created_ = unix_now();
  engine_ = std::make_unique<Engine>(runner_, tok_, opts_.queue_size, opts_.max_batch);
  http::Options h;
  h.threads = opts_.http_threads > 0 ? opts_.http_threads : (int)opts_.queue_size + opts_.max_batch + 8;
  h.max_body_bytes = opts_.max_body_bytes;
  h.read_timeout_ms = opts_.read_timeout_ms;
  h.request_timeout_ms = opts_.request_timeout_ms;
  h.write_timeout_ms = opts_.write_timeout_ms;
  h.keep_alive_timeout_ms = opts_.keep_alive_timeout_s * 1000;
  h.keep_alive_max_requests = 100;
  h.max_connections = opts_.max_connections;
  h.max_connections_per_client = opts_.max_connections_per_client;
  http_ = std::make_unique<http::Server>(h, http_error_body);
  routes();
}

Server::~Server() { stop(); }

int Server::bind() {
  if (opts_.port < 0 || opts_.port > 65535) fail("serve: port {} is outside [0, 65535]", opts_.port);
  try {
    port_ = http_->bind(opts_.host, opts_.port);
  } catch (const Error& e) {
    fail("serve: {} (in use, or not an address of this machine?)", e.what());
  }
  return port_;
}

void Server::run() {
  if (port_ < 0) fail("serve: bind() before run()");
  std::signal(SIGPIPE, SIG_IGN);
  http_->run();
}

void Server::stop() {
  if (engine_) engine_->stop();
  if (http_) http_->stop();
}

void Server::routes() {
  const int positions = runner_.config().max_position_embeddings > 0 ? runner_.config().max_position_embeddings : INT_MAX;

  http_->route("GET", "/health", [this](const http::Request&, http::Response& res) {
    send_json(res, json{{"status", "ok"}, {"model", opts_.model_name}, {"waiting", engine_->waiting()},
                        {"running", engine_->running()}, {"max_batch", opts_.max_batch}});
  });
  auto model_object = [this] {
    return json{{"id", opts_.model_name}, {"object", "model"}, {"created", created_}, {"owned_by", "moetron"}};
  };
  http_->route("GET", "/v1/models", [model_object](const http::Request&, http::Response& res) {
    send_json(res, json{{"object", "list"}, {"data", json::array({model_object()})}});
  });
  http_->route_prefix("GET", "/v1/models/", [this, model_object](const http::Request& req, http::Response& res) {
    if (req.tail == opts_.model_name)
      send_json(res, model_object());
    else
      send_error(res, ApiError(404, fmt::format("The model '{}' does not exist", req.tail), "invalid_request_error",
                               "model", "model_not_found"));
  });

  auto handle = [this, positions](Endpoint ep, const http::Request& req, http::Response& res) {
    try {
      CompletionRequest r = parse_request(ep, req.body, tc_.jinja != nullptr);
      std::vector<int32_t> prompt;
      if (ep == Endpoint::chat) {
        try {
          prompt = tc_.jinja ? chat_prompt_tokens(tc_, tok_, r.conversation) : chat_prompt_tokens(tc_.tmpl, tok_, r.messages);
        } catch (const Error& e) {
          throw ApiError(400, fmt::format("'messages' cannot be formatted with the {} chat template: {}", tc_.name(),
                                          e.what()),
                         "invalid_request_error", "messages", "invalid_value");
        }
      } else {
        prompt = completion_prompt_tokens(tok_, r.prompt);
      }
      const char* prompt_param = ep == Endpoint::chat ? "messages" : "prompt";
      if (prompt.empty())  // "" with a tokenizer that adds no BOS: nothing to continue from
        throw ApiError(400, "The prompt has no tokens: give some text (this model's tokenizer adds no BOS token).",
                       "invalid_request_error", prompt_param, "invalid_value");
      const int max_prompt = opts_.max_prompt_tokens > 0 ? std::min(opts_.max_prompt_tokens, positions - 1) : positions - 1;
      if ((long)prompt.size() > max_prompt)
        throw ApiError(400,
                       fmt::format("The prompt has {} tokens; this server accepts prompts of at most {} tokens.",
                                   prompt.size(), max_prompt),
                       "invalid_request_error", prompt_param, "context_length_exceeded");
      int max_tokens = 0;
      if (r.max_tokens) {
        if (*r.max_tokens > opts_.max_tokens_limit)
          throw ApiError(400, fmt::format("max_tokens is {}; this server allows at most {}.", *r.max_tokens,
                                          opts_.max_tokens_limit),
                         "invalid_request_error", "max_tokens", "invalid_value");
        if ((long)prompt.size() + *r.max_tokens > positions)
          throw ApiError(400,
                         fmt::format("This model's maximum context length is {} tokens. However, you requested {} "
                                     "tokens ({} in the prompt, {} in the completion).",
                                     positions, (long)prompt.size() + *r.max_tokens, prompt.size(), *r.max_tokens),
                         "invalid_request_error", "max_tokens", "context_length_exceeded");
        max_tokens = *r.max_tokens;
      } else {
        max_tokens = (int)std::min<long>(opts_.max_tokens_limit, (long)positions - (long)prompt.size());
      }
      if (!r.has_seed) r.sampling.seed = ((uint64_t)std::random_device{}() << 32) ^ std::random_device{}();
      GenerateOptions go;
      go.max_new_tokens = max_tokens;
      go.sampling = r.sampling;
      go.eos_ids = eos_ids_;
      go.stop = r.stop;
      go.max_positions = runner_.config().max_position_embeddings;
      go.chat_reply = ep == Endpoint::chat;
      for (const auto& [id, bias] : go.sampling.logit_bias)
        if (id >= runner_.vocab_size())
          throw ApiError(400, fmt::format("'logit_bias' names token {}, outside this model's vocabulary of {}", id,
                                          runner_.vocab_size()),
                         "invalid_request_error", "logit_bias", "invalid_value");
      try {
        validate_sampling(go.sampling);
      } catch (const Error& e) {
        throw ApiError(400, e.what(), "invalid_request_error", "", "invalid_value");
      }
      const int prompt_tokens = (int)prompt.size();
      auto job = std::make_shared<Job>(std::move(prompt), std::move(go), r.stream);
      if (!engine_->submit(job))
        throw ApiError(429,
                       fmt::format("The server is busy: {} requests are already waiting. Retry later.",
                                   opts_.queue_size),
                       "rate_limit_error", "", "queue_full");
      const std::string id = random_id(ep == Endpoint::chat ? "chatcmpl-" : "cmpl-");
      const long created = unix_now();
      if (!r.stream) {
        job->wait_done();
        if (!job->error().empty())
          throw ApiError(500, "generation failed: " + job->error(), "server_error", "", "generation_failed");
        const GenerateResult& g = job->result();
        if (g.finish == FinishReason::cancelled)
          throw ApiError(503, "the server is shutting down", "server_error", "", "shutting_down");
        send_json(res, completion_response(ep, id, created, opts_.model_name, g.text, finish_reason_name(g.finish),
                                           {prompt_tokens, (int)g.tokens.size()}));
        return;
      }
      auto st = std::make_shared<StreamState>();
      st->job = job;
      st->endpoint = ep;
      st->id = id;
      st->model = opts_.model_name;
      st->created = created;
      st->prompt_tokens = prompt_tokens;
      st->include_usage = r.include_usage;
      res.content_type = "text/event-stream";
      res.headers = {{"Cache-Control", "no-cache"}, {"X-Accel-Buffering", "no"}};
      res.stream = [st](http::StreamSink& sink) { return stream_events(*st, sink); };
    } catch (const ApiError& e) {
      send_error(res, e);
    } catch (const std::exception& e) {
      send_error(res, ApiError(500, std::string("internal error: ") + e.what(), "server_error"));
    }
  };
  http_->route("POST", "/v1/chat/completions",
               [handle](const http::Request& req, http::Response& res) { handle(Endpoint::chat, req, res); });
  http_->route("POST", "/v1/completions",
               [handle](const http::Request& req, http::Response& res) { handle(Endpoint::completion, req, res); });
  // Other methods on these paths (405) and unknown paths (404) get the same JSON error objects from
  // the HTTP layer (http_error_body); so do handler exceptions (500).
  if (opts_.log_requests)
    http_->set_logger([](const std::string& remote, const std::string& method, const std::string& path, int status) {
      std::fprintf(stderr, "%s %s %s -> %d\n", remote.c_str(), method.empty() ? "-" : method.c_str(),
                   path.empty() ? "-" : path.c_str(), status);
    });
}

}  // namespace moetron::server
