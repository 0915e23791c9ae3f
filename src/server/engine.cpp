#include "server/engine.h"

#include <chrono>

#include <omp.h>

namespace moetron::server {

bool Job::wait(std::vector<std::string>& out, int timeout_ms) {
  std::unique_lock lock(mu_);
  cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] { return done_ || !pieces_.empty(); });
  for (std::string& p : pieces_) out.push_back(std::move(p));
  pieces_.clear();
  return done_;
}

void Job::wait_done() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return done_; });
}

void Job::push_text(const std::string& piece) {
  if (!stream_) return;  // a plain response takes the whole text from the result
  {
    std::lock_guard lock(mu_);
    pieces_.push_back(piece);
  }
  cv_.notify_all();
}

void Job::finish(GenerateResult result, std::string error) {
  {
    std::lock_guard lock(mu_);
    result_ = std::move(result);
    error_ = std::move(error);
    done_ = true;
  }
  cv_.notify_all();
}

Engine::Engine(const InferenceModel& model, const Tokenizer& tok, size_t queue_capacity)
    : decoder_(model), cache_(decoder_.new_cache()), tok_(tok), capacity_(queue_capacity) {
  // OpenMP's thread count is per thread: the worker takes the constructing thread's (--threads).
  const int threads = omp_get_max_threads();
  worker_ = std::thread([this, threads] {
    omp_set_num_threads(threads);
    worker_loop();
  });
}

Engine::~Engine() { stop(); }

bool Engine::submit(std::shared_ptr<Job> job) {
  {
    std::lock_guard lock(mu_);
    if (stopping_ || queue_.size() >= capacity_) return false;
    queue_.push_back(std::move(job));
  }
  cv_.notify_all();
  return true;
}

size_t Engine::waiting() const {
  std::lock_guard lock(mu_);
  return queue_.size();
}

void Engine::stop() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    for (auto& j : queue_) j->cancel();
    if (running_) running_->cancel();
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void Engine::worker_loop() {
  for (;;) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping with nothing left
      job = std::move(queue_.front());
      queue_.pop_front();
      running_ = job;
    }
    GenerateResult result;
    std::string error;
    if (job->cancelled()) {
      result.finish = FinishReason::cancelled;
    } else {
      GenerateCallbacks cb;
      cb.on_token = [&](int32_t) { return !job->cancelled(); };
      cb.on_text = [&](const std::string& piece) {
        job->push_text(piece);
        return !job->cancelled();
      };
      try {
        result = generate(decoder_, cache_, job->prompt(), job->options(), &tok_, cb);
      } catch (const std::exception& e) {
        error = e.what();
        cache_.clear();  // whatever state the failure left behind
      }
    }
    {
      std::lock_guard lock(mu_);
      running_.reset();
    }
    job->finish(std::move(result), std::move(error));
  }
}

}  // namespace moetron::server
