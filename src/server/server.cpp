#include "server/server.h"

#include <csignal>
#include <chrono>
#include <climits>
#include <cstdio>
#include <random>

#include <fmt/format.h>
#include <httplib.h>

#include "core/error.h"
#include "infer/generate.h"
#include "server/engine.h"
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

void send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  res.set_content(error_json(e), "application/json");
}

const char* status_message(int status) {
  switch (status) {
    case 400:
      return "Bad request: the HTTP request could not be parsed.";
    case 404:
      return "Not found.";
    case 405:
      return "Method not allowed.";
    case 408:
      return "Request timeout.";
    case 413:
      return "Request body too large.";
    case 414:
      return "Request URI too long.";
    case 416:
      return "Range not satisfiable.";
    case 431:
      return "Request header fields too large.";
    default:
      return status < 500 ? "Bad request." : "Internal server error.";
  }
}

// A streamed reply's state, shared by the content provider's calls.
struct StreamState {
  std::shared_ptr<Job> job;
  Endpoint endpoint;
  std::string id, model;
  long created = 0;
  int prompt_tokens = 0;
  bool include_usage = false;
  bool started = false;
};

bool send_event(httplib::DataSink& sink, const std::string& data) {
  const std::string s = "data: " + data + "\n\n";
  return sink.write(s.data(), s.size());
}

}  // namespace

Server::Server(const InferenceModel& model, const Tokenizer& tok, ChatTemplate tmpl, std::vector<int32_t> eos_ids,
               ServerOptions opts)
    : model_(model), tok_(tok), tmpl_(tmpl), eos_ids_(std::move(eos_ids)), opts_(std::move(opts)) {
  if (opts_.queue_size < 1) fail("serve: the queue size must be at least 1");
  if (opts_.max_tokens_limit < 1) fail("serve: the max_tokens limit must be at least 1");
  if (opts_.read_timeout_ms < 1 || opts_.write_timeout_ms < 1) fail("serve: timeouts must be positive");
  created_ = unix_now();
  engine_ = std::make_unique<Engine>(model_, tok_, opts_.queue_size);
  http_ = std::make_unique<httplib::Server>();
  const size_t threads = opts_.http_threads > 0 ? (size_t)opts_.http_threads : opts_.queue_size + 8;
  http_->new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  http_->set_payload_max_length(opts_.max_body_bytes);
  http_->set_read_timeout(std::chrono::milliseconds(opts_.read_timeout_ms));
  http_->set_write_timeout(std::chrono::milliseconds(opts_.write_timeout_ms));
  http_->set_keep_alive_timeout(opts_.keep_alive_timeout_s);
  http_->set_keep_alive_max_count(100);
  http_->set_tcp_nodelay(true);  // headers and body go out in separate writes: no Nagle delay
  routes();
}

Server::~Server() { stop(); }

int Server::bind() {
  if (opts_.port == 0) {
    port_ = http_->bind_to_any_port(opts_.host);
    if (port_ < 0) fail("serve: cannot bind to {} (any port)", opts_.host);
  } else {
    if (opts_.port < 0 || opts_.port > 65535) fail("serve: port {} is outside [0, 65535]", opts_.port);
    if (!http_->bind_to_port(opts_.host, opts_.port))
      fail("serve: cannot bind to {}:{} (in use, or not an address of this machine)", opts_.host, opts_.port);
    port_ = opts_.port;
  }
  return port_;
}

void Server::run() {
  if (port_ < 0) fail("serve: bind() before run()");
  std::signal(SIGPIPE, SIG_IGN);
  http_->listen_after_bind();
}

void Server::stop() {
  if (engine_) engine_->stop();
  if (http_) http_->stop();
}

void Server::routes() {
  const int positions = model_.cfg.max_position_embeddings > 0 ? model_.cfg.max_position_embeddings : INT_MAX;

  http_->Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(dump(json{{"status", "ok"}, {"model", opts_.model_name}, {"waiting", engine_->waiting()}}),
                    "application/json");
  });
  auto model_object = [this] {
    return json{{"id", opts_.model_name}, {"object", "model"}, {"created", created_}, {"owned_by", "moetron"}};
  };
  http_->Get("/v1/models", [model_object](const httplib::Request&, httplib::Response& res) {
    res.set_content(dump(json{{"object", "list"}, {"data", json::array({model_object()})}}), "application/json");
  });
  http_->Get(R"(/v1/models/(.+))", [this, model_object](const httplib::Request& req, httplib::Response& res) {
    if (req.matches[1] == opts_.model_name)
      res.set_content(dump(model_object()), "application/json");
    else
      send_error(res, ApiError(404, fmt::format("The model '{}' does not exist", req.matches[1].str()),
                               "invalid_request_error", "model", "model_not_found"));
  });

  auto handle = [this, positions](Endpoint ep, const httplib::Request& req, httplib::Response& res) {
    try {
      CompletionRequest r = parse_request(ep, req.body);
      std::vector<int32_t> prompt;
      if (ep == Endpoint::chat) {
        try {
          prompt = chat_prompt_tokens(tmpl_, tok_, r.messages);
        } catch (const Error& e) {
          throw ApiError(400, fmt::format("'messages' cannot be formatted with the {} chat template: {}",
                                          chat_template_name(tmpl_), e.what()),
                         "invalid_request_error", "messages", "invalid_value");
        }
      } else {
        prompt = completion_prompt_tokens(tok_, r.prompt);
      }
      const char* prompt_param = ep == Endpoint::chat ? "messages" : "prompt";
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
      go.max_positions = model_.cfg.max_position_embeddings;
      go.chat_reply = ep == Endpoint::chat;
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
        res.set_content(dump(completion_response(ep, id, created, opts_.model_name, g.text,
                                                 finish_reason_name(g.finish),
                                                 {prompt_tokens, (int)g.tokens.size()})),
                        "application/json");
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
      res.set_header("Cache-Control", "no-cache");
      res.set_header("X-Accel-Buffering", "no");
      res.set_chunked_content_provider(
          "text/event-stream",
          [st](size_t, httplib::DataSink& sink) -> bool {
            const Endpoint ep = st->endpoint;
            if (!st->started) {  // an empty first chunk (the assistant role) right away
              st->started = true;
              if (ep == Endpoint::chat &&
                  !send_event(sink, dump(stream_chunk(ep, st->id, st->created, st->model, "", true, "")))) {
                st->job->cancel();
                return false;
              }
            }
            std::vector<std::string> pieces;
            const bool done = st->job->wait(pieces, 100);
            for (const std::string& p : pieces)
              if (!send_event(sink, dump(stream_chunk(ep, st->id, st->created, st->model, p, false, "")))) {
                st->job->cancel();
                return false;
              }
            if (!done) return true;
            const GenerateResult& g = st->job->result();
            if (!st->job->error().empty()) {
              send_event(sink, error_json(ApiError(500, "generation failed: " + st->job->error(), "server_error", "",
                                                   "generation_failed")));
            } else {
              if (g.finish == FinishReason::cancelled) return false;  // shutting down
              if (!send_event(sink, dump(stream_chunk(ep, st->id, st->created, st->model, "", false,
                                                      finish_reason_name(g.finish)))))
                return false;
              if (st->include_usage &&
                  !send_event(sink, dump(usage_chunk(ep, st->id, st->created, st->model,
                                                     {st->prompt_tokens, (int)g.tokens.size()}))))
                return false;
            }
            if (!send_event(sink, "[DONE]")) return false;
            sink.done();
            return true;
          },
          [job](bool success) {
            if (!success) job->cancel();
          });
    } catch (const ApiError& e) {
      send_error(res, e);
    } catch (const std::exception& e) {
      send_error(res, ApiError(500, std::string("internal error: ") + e.what(), "server_error"));
    }
  };
  http_->Post("/v1/chat/completions", [handle](const httplib::Request& req, httplib::Response& res) {
    handle(Endpoint::chat, req, res);
  });
  http_->Post("/v1/completions", [handle](const httplib::Request& req, httplib::Response& res) {
    handle(Endpoint::completion, req, res);
  });
  for (const char* path : {"/v1/chat/completions", "/v1/completions"})
    http_->Get(path, [](const httplib::Request& req, httplib::Response& res) {
      send_error(res, ApiError(405, fmt::format("{} {} is not supported; use POST", req.method, req.path),
                               "invalid_request_error", "", "method_not_allowed"));
    });

  // Everything else that ends in an error status without a body of ours: the same JSON error shape.
  http_->set_error_handler(httplib::Server::HandlerWithResponse([this](const httplib::Request& req,
                                                                      httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    std::string msg = status_message(res.status);
    if (res.status == 404) msg = fmt::format("Unknown request URL: {} {}", req.method, req.path);
    if (res.status == 413) msg = fmt::format("The request body exceeds this server's limit of {} bytes.",
                                             opts_.max_body_bytes);
    send_error(res, ApiError(res.status, msg, res.status < 500 ? "invalid_request_error" : "server_error"));
    return httplib::Server::HandlerResponse::Handled;
  }));
  http_->set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown exception";
    try {
      if (ep) std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    send_error(res, ApiError(500, "internal error: " + what, "server_error"));
  });
  if (opts_.log_requests)
    http_->set_logger([](const httplib::Request& req, const httplib::Response& res) {
      std::fprintf(stderr, "%s %s %s -> %d\n", req.remote_addr.c_str(), req.method.c_str(), req.path.c_str(),
                   res.status);
    });
}

}  // namespace moetron::server
