#include "server/engine.h"

#include <algorithm>
#include <chrono>

#include <omp.h>

#include "core/error.h"

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

// A running request: its job, its cache (index into caches_) and its generation.
struct Engine::Active {
  std::shared_ptr<Job> job;
  size_t cache;
  std::unique_ptr<Generation> gen;
};

Engine::Engine(Runner& runner, const Tokenizer& tok, size_t queue_capacity, int max_batch)
    : runner_(runner), tok_(tok), capacity_(queue_capacity), max_batch_(std::max(1, max_batch)) {
  for (int i = 0; i < max_batch_; i++) caches_.push_back(runner_.new_cache());
  cache_busy_.assign(caches_.size(), false);
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

size_t Engine::running() const {
  std::lock_guard lock(mu_);
  return running_.size();
}

void Engine::stop() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    for (auto& j : queue_) j->cancel();
    for (auto& j : running_) j->cancel();
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void Engine::admit(std::vector<std::shared_ptr<Job>> jobs, std::vector<std::unique_ptr<Active>>& active) {
  std::vector<std::unique_ptr<Active>> group;
  auto release = [&](Active& a, GenerateResult r, std::string error) {
    if (!error.empty()) caches_[a.cache].clear();  // whatever state the failure left behind
    cache_busy_[a.cache] = false;
    a.job->finish(std::move(r), std::move(error));
  };
  for (auto& job : jobs) {
    if (job->cancelled()) {
      GenerateResult r;
      r.finish = FinishReason::cancelled;
      job->finish(std::move(r), "");
      continue;
    }
    // The free cache sharing the longest prefix with the prompt (a chat's earlier turns).
    size_t best = caches_.size();
    int best_len = -1;
    for (size_t c = 0; c < caches_.size(); c++)
      if (!cache_busy_[c]) {
        const int len = reusable_prefix(caches_[c], job->prompt());
        if (len > best_len) best = c, best_len = len;
      }
    MOETRON_ASSERT(best < caches_.size());
    auto a = std::make_unique<Active>();
    a->job = job;
    a->cache = best;
    cache_busy_[best] = true;
    GenerateCallbacks cb;
    Job* j = job.get();
    cb.on_token = [j](int32_t) { return !j->cancelled(); };
    cb.on_text = [j](const std::string& piece) {
      j->push_text(piece);
      return !j->cancelled();
    };
    try {
      a->gen = std::make_unique<Generation>(runner_, caches_[best], job->prompt(), job->options(), &tok_, cb,
                                            /*prefill=*/false);
    } catch (const std::exception& e) {
      release(*a, GenerateResult{}, e.what());
      continue;
    }
    group.push_back(std::move(a));
  }
  // Prefill: short prompts together, row by row (each weight read once for all of them, and a
  // prompt's arithmetic the same alone or not); long ones alone, with GEMMs.  Either way a request's
  // arithmetic depends only on itself, so its reply is what it gets alone.
  std::vector<Active*> rows;
  for (auto& a : group) {
    if ((int)a->gen->to_prefill().size() <= kRowPrefillMax) {
      rows.push_back(a.get());
      continue;
    }
    try {
      runner_.forward(caches_[a->cache], a->gen->to_prefill(), a->gen->logits());
    } catch (const std::exception& e) {
      release(*a, GenerateResult{}, e.what());
      a.reset();
    }
  }
  // The running requests' next tokens ride in the same pass, a row each (a decode step's arithmetic:
  // prefill_rows), so one read of the weights serves the new prompts and the running requests' step.
  bool stepped = false;
  if (!rows.empty()) {
    std::vector<KvCache*> caches;
    std::vector<std::span<const int32_t>> feed;
    for (Active* a : rows) {
      caches.push_back(&caches_[a->cache]);
      feed.push_back(a->gen->to_prefill());
    }
    std::vector<int32_t> next(active.size());
    for (size_t i = 0; i < active.size(); i++) {
      next[i] = active[i]->gen->next_token();
      caches.push_back(&caches_[active[i]->cache]);
      feed.push_back(std::span<const int32_t>(&next[i], 1));
    }
    const size_t V = (size_t)runner_.vocab_size();
    batch_logits_.resize(caches.size() * V);
    std::string error;
    try {
      runner_.prefill_rows(caches, feed, batch_logits_.data());
      stepped = !active.empty();
      if (stepped) shared_passes_++;
    } catch (const std::exception& e) {
      error = e.what();
    }
    if (!error.empty() && !active.empty()) {  // nothing changed: the prompts alone, to give them the error
      error.clear();
      caches.resize(rows.size());
      feed.resize(rows.size());
      try {
        runner_.prefill_rows(caches, feed, batch_logits_.data());
      } catch (const std::exception& e) {
        error = e.what();
      }
    }
    for (size_t r = 0; r < rows.size(); r++)
      if (error.empty()) std::copy(batch_logits_.begin() + r * V, batch_logits_.begin() + (r + 1) * V, rows[r]->gen->logits());
    if (stepped) {
      peak_batch_ = std::max(peak_batch_.load(), (int)active.size());
      for (size_t i = 0; i < active.size(); i++)
        std::copy(batch_logits_.begin() + (rows.size() + i) * V, batch_logits_.begin() + (rows.size() + i + 1) * V,
                  active[i]->gen->logits());
      conclude(active, "");
    }
    if (!error.empty())
      for (auto& a : group)
        if (a && (int)a->gen->to_prefill().size() <= kRowPrefillMax) {
          release(*a, GenerateResult{}, error);
          a.reset();
        }
  }
  if (!stepped && !active.empty()) step(active);
  for (auto& a : group) {
    if (!a) continue;
    try {
      a->gen->prefilled();
      if (!a->gen->advance()) {
        release(*a, a->gen->finish(), "");
        continue;
      }
    } catch (const std::exception& e) {
      release(*a, GenerateResult{}, e.what());
      continue;
    }
    {
      std::lock_guard lock(mu_);
      running_.push_back(a->job);
    }
    active.push_back(std::move(a));
  }
}

void Engine::step(std::vector<std::unique_ptr<Active>>& active) {
  const int n = (int)active.size();
  peak_batch_ = std::max(peak_batch_.load(), n);
  std::string batch_error;
  try {
    if (n == 1) {
      Active& a = *active[0];
      const int32_t t = a.gen->next_token();
      runner_.forward(caches_[a.cache], std::span<const int32_t>(&t, 1), a.gen->logits());
    } else {
      std::vector<KvCache*> caches(n);
      std::vector<int32_t> tokens(n);
      for (int i = 0; i < n; i++) {
        caches[i] = &caches_[active[i]->cache];
        tokens[i] = active[i]->gen->next_token();
      }
      const size_t V = (size_t)runner_.vocab_size();
      batch_logits_.resize((size_t)n * V);
      runner_.forward_batch(caches, tokens, batch_logits_.data());
      for (int i = 0; i < n; i++)
        std::copy(batch_logits_.begin() + i * V, batch_logits_.begin() + (i + 1) * V, active[i]->gen->logits());
    }
  } catch (const std::exception& e) {
    batch_error = e.what();  // the step failed for every running request
  }
  conclude(active, batch_error);
}

void Engine::conclude(std::vector<std::unique_ptr<Active>>& active, const std::string& batch_error) {
  std::vector<std::unique_ptr<Active>> still;
  for (auto& a : active) {
    bool more = false;
    std::string error = batch_error;
    if (error.empty()) {
      try {
        a->gen->fed();
        more = a->gen->advance();
      } catch (const std::exception& e) {
        error = e.what();
      }
    }
    if (more) {
      still.push_back(std::move(a));
      continue;
    }
    if (!error.empty()) caches_[a->cache].clear();
    GenerateResult r = error.empty() ? a->gen->finish() : GenerateResult{};
    cache_busy_[a->cache] = false;
    {
      std::lock_guard lock(mu_);
      running_.erase(std::find(running_.begin(), running_.end(), a->job));
    }
    a->job->finish(std::move(r), std::move(error));
  }
  active = std::move(still);
}

void Engine::worker_loop() {
  std::vector<std::unique_ptr<Active>> active;
  for (;;) {
    std::vector<std::shared_ptr<Job>> admitted;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty() || !active.empty(); });
      if (stopping_ && queue_.empty() && active.empty()) return;
      // New requests join at this token boundary, as many as the batch has room for.
      while (!queue_.empty() && (int)(active.size() + admitted.size()) < max_batch_) {
        admitted.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
    }
    if (!admitted.empty())
      admit(std::move(admitted), active);  // steps the running requests too
    else if (!active.empty())
      step(active);
  }
}

}  // namespace moetron::server
