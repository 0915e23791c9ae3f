// The generation engine behind moetron serve: one worker thread runs the model (a Runner) over max_batch KV
// caches and runs up to max_batch requests at once by continuous batching, first come first served,
// from a bounded queue.
//
// Concurrency model (documented in README "moetron serve"): HTTP threads parse and validate requests
// and tokenize prompts concurrently.  The worker admits waiting requests into the running batch at
// token boundaries (short prompts prefilled together, row by row, in the same pass as the running
// requests' next step; long ones alone), and decodes one token of every running request per step with
// Runner::forward_batch: each weight -- each routed expert -- is read once per
// step for all the sequences that use it, which is where batching gains on a CPU, where one sequence
// spends its time streaming weights.  Each request keeps its own cache, sampling settings and stream;
// a request's tokens are bitwise what it gets alone (greedy replies are equal).  At most
// `queue_capacity` requests wait behind the running batch; a request that finds the queue full is
// refused at once (HTTP 429), so memory and latency stay bounded under load.  A finished request's
// cache keeps its sequence, and a new request takes the free cache sharing the longest prefix with its
// prompt, so a follow-up that repeats the conversation so far (a chat client sending its history)
// only computes the new turn.
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
  // Borrows the runner and tokenizer (only the worker uses the runner while the engine lives); starts
  // the worker.  max_batch >= 1 requests run at once.
  Engine(Runner& runner, const Tokenizer& tok, size_t queue_capacity, int max_batch = 1);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues a job; false (and the job untouched) when queue_capacity jobs are already waiting or the
  // engine is stopping.
  bool submit(std::shared_ptr<Job> job);
  // Cancels the running and queued jobs and joins the worker.  Idempotent.
  void stop();
  size_t waiting() const;
  size_t running() const;
  // The largest number of requests decoded in one step so far (tests, /health).
  int peak_batch() const { return peak_batch_; }
  // Passes in which running requests took their step together with new prompts' prefill (tests).
  int shared_passes() const { return shared_passes_; }

 private:
  struct Active;
  void worker_loop();
  // Prefills `jobs` into free caches and adds them to the batch, or finishes them (an error, nothing
  // to generate); the requests already in `active` take one decoding step, in the same pass as the
  // short prompts when there are any.
  void admit(std::vector<std::shared_ptr<Job>> jobs, std::vector<std::unique_ptr<Active>>& active);
  // Prompts (their uncached part) up to this many tokens are prefilled row by row, together.
  static constexpr int kRowPrefillMax = 32;
  // One decoding step of every running request; finished ones leave the batch.
  void step(std::vector<std::unique_ptr<Active>>& active);
  // After a pass fed every request in `active` its next token (its logits in place), or failed with
  // batch_error: each samples its next token, and finished or failed ones leave the batch.
  void conclude(std::vector<std::unique_ptr<Active>>& active, const std::string& batch_error);

  Runner& runner_;
  std::vector<KvCache> caches_;
  std::vector<bool> cache_busy_;
  const Tokenizer& tok_;
  size_t capacity_;
  int max_batch_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::vector<std::shared_ptr<Job>> running_;
  std::atomic<int> peak_batch_{0};
  std::atomic<int> shared_passes_{0};
  bool stopping_ = false;
  std::thread worker_;
  std::vector<float> batch_logits_;
};

}  // namespace moetron::server
