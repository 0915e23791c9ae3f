// moetron serve: an OpenAI-compatible HTTP server for a model directory (src/server/server.h).
// Prints "moetron serve: listening on http://HOST:PORT" once the socket is bound; SIGINT / SIGTERM
// stop it cleanly (running and queued requests are cancelled).
#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>

#include <CLI/CLI.hpp>
#include <omp.h>

#include "cli/commands.h"
#include "cli/generation_options.h"
#include "cli/threads.h"
#include "core/error.h"
#include "infer/model.h"
#include "server/server.h"

namespace moetron::cli {

int run_serve(int argc, char** argv) {
  CLI::App app{"OpenAI-compatible HTTP server: POST /v1/chat/completions and /v1/completions (plain or streaming\n"
               "with \"stream\": true), GET /v1/models and /health.  Up to --max-batch requests are decoded together\n"
               "(continuous batching: new ones join at token boundaries); up to --queue-size more wait, more get HTTP 429.",
               "moetron serve"};
  ModelOptions m;
  server::ServerOptions o;
  o.model_name.clear();
  int threads = 0;
  bool quiet = false;
  add_model_options(app, m);
  app.add_option("--host", o.host, "address to bind (default 127.0.0.1: this machine only; 0.0.0.0: everyone)");
  app.add_option("--port", o.port, "port (0: any free port)");
  app.add_option("--model-name", o.model_name, "the model id in /v1/models and replies (default: the directory name)");
  app.add_option("--max-body-bytes", o.max_body_bytes, "largest request body; larger ones get 413");
  app.add_option("--max-prompt-tokens", o.max_prompt_tokens, "longest prompt in tokens (0: the model's positions - 1)");
  app.add_option("--max-tokens-limit", o.max_tokens_limit, "largest max_tokens a request may ask for");
  app.add_option("--queue-size", o.queue_size, "requests that may wait behind the running batch");
  app.add_option("--max-batch", o.max_batch,
                 "requests decoded together (0, the default: 4 per compute thread, from 4 to 16; at most 256)");
  app.add_option("--http-threads", o.http_threads,
                 "threads running requests (0: queue size + max batch + 8; at most 4096); slow clients hold none");
  app.add_option("--read-timeout-ms", o.read_timeout_ms, "close a connection that sends nothing for this long");
  app.add_option("--request-timeout-ms", o.request_timeout_ms,
                 "a request (head and body) must arrive within this long of its first byte, else 408");
  app.add_option("--max-connections-per-client", o.max_connections_per_client,
                 "open connections one IP address may hold; more get 503");
  app.add_option("--max-connections", o.max_connections, "open connections in all; more get 503");
  app.add_option("--write-timeout-ms", o.write_timeout_ms, "give up on a client that takes nothing for this long");
  app.add_option("--keep-alive-s", o.keep_alive_timeout_s, "idle keep-alive connections close after this long");
  app.add_option("--threads", threads, "compute threads for OpenMP and BLAS (default: all)");
  app.add_flag("--quiet", quiet, "no per-request log lines on stderr");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  check_thread_count("--threads", threads);
  check_thread_count("--http-threads", o.http_threads, 4096);
  if (threads > 0) omp_set_num_threads(threads);  // inference uses no BLAS library (backend/kernels/gemm.h)
  o.log_requests = !quiet;
  if (o.model_name.empty()) o.model_name = std::filesystem::path(m.dir).lexically_normal().filename().string();
  if (o.model_name.empty()) o.model_name = std::filesystem::absolute(m.dir).parent_path().filename().string();
  const LoadedModel model = load_model(m);
  const std::unique_ptr<Tokenizer> tok = load_model_tokenizer(m.dir, m.tokenizer_path, model.cfg, true);
  const TemplateChoice tc = choose_chat_template(m.dir, m.template_name, tok->byte_level());
  std::vector<int32_t> eos = model_eos_ids(m.dir, model.cfg, tok.get());
  add_chat_stop_ids(eos, tc, *tok, model.cfg);

  // SIGINT / SIGTERM go to one waiting thread (blocked everywhere else, so set before any thread starts).
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);

  server::Server srv(*model.runner, *tok, tc, eos, o);
  const int port = srv.bind();
  std::atomic<bool> signalled{false};
  std::thread waiter([&] {
    int sig = 0;
    sigwait(&sigs, &sig);
    signalled = true;
    srv.stop();
  });
  std::fprintf(stderr, "moetron serve: model %s (%s, %d layers), chat template %s (%s), batch %d, queue %zu\n",
               o.model_name.c_str(), model.cfg.architecture.c_str(), model.cfg.num_hidden_layers,
               tc.name().c_str(), tc.source.c_str(), srv.max_batch(), o.queue_size);
  std::printf("moetron serve: listening on http://%s:%d\n", o.host.c_str(), port);
  std::fflush(stdout);
  srv.run();
  if (!signalled) pthread_kill(waiter.native_handle(), SIGTERM);
  waiter.join();
  srv.stop();
  std::fprintf(stderr, "moetron serve: stopped\n");
  return 0;
}

}  // namespace moetron::cli
