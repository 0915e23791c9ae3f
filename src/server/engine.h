// The generation engine behind moetron serve: one worker thread owns the decoder and one KV cache and
// runs requests one at a time, first come first served, from a bounded queue.
//
// Concurrency model (documented in README "moetron serve"): HTTP threads parse and validate requests
// and tokenize prompts concurrently; generation itself is sequential, each request using all compute
// threads (on a CPU, one sequence at a time already keeps every core busy in its matrix products).
// At most `queue_capacity` requests wait behind the running one; a request that finds the queue full
// is refused at once (HTTP 429), so memory and latency stay bounded under load.  The single KV cache
// keeps the previous sequence, so a follow-up request that repeats the conversation so far (a chat
// client sending its history) only computes the new turn.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "infer/generate.h"

namespace moetron::server {

// One request's generation: its inputs, and the text and result flowing back to the HTTP thread.
class Job {
 public:
  Job(std::vector<int32_t> prompt, GenerateOptions opts, bool stream)
      : prompt_(std::move(prompt)), opts_(std::move(opts)), stream_(stream) {}

  // HTTP side.
  // Moves the text pieces produced so far into `out`; waits up to timeout_ms for news.  True once
  // the job has finished (then every piece has been handed out).
  bool wait(std::vector<std::string>& out, int timeout_ms);
  // Blocks until the job finishes.
  void wait_done();
  // Ask the worker to stop this job (client gone); safe to call any time, from any thread.
  void cancel() { cancelled_ = true; }
  const GenerateResult& result() const { return result_; }  // after the job finished
  const std::string& error() const { return error_; }       // "" unless generation failed

  // Worker side.
  const std::vector<int32_t>& prompt() const { return prompt_; }
  const GenerateOptions& options() const { return opts_; }
  bool cancelled() const { return cancelled_; }
  void push_text(const std::string& piece);
  void finish(GenerateResult result, std::string error);

 private:
  std::vector<int32_t> prompt_;
  GenerateOptions opts_;
  bool stream_;
  std::atomic<bool> cancelled_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::string> pieces_;
  bool done_ = false;
  GenerateResult result_;
  std::string error_;
};

class Engine {
 public:
  // Borrows the model and tokenizer; starts the worker.
  Engine(const InferenceModel& model, const Tokenizer& tok, size_t queue_capacity);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues a job; false (and the job untouched) when queue_capacity jobs are already waiting or the
  // engine is stopping.
  bool submit(std::shared_ptr<Job> job);
  // Cancels the running and queued jobs and joins the worker.  Idempotent.
  void stop();
  size_t waiting() const;

 private:
  void worker_loop();

  Decoder decoder_;
  KvCache cache_;
  const Tokenizer& tok_;
  size_t capacity_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::shared_ptr<Job> running_;
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace moetron::server
