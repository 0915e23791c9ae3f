#include "infer/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "backend/kernels/argmax.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/rng.h"

namespace moetron {

void validate_sampling(const SamplingParams& p, int vocab_size) {
  auto finite = [](float v, const char* name) {
    if (!std::isfinite(v)) fail("sampling: {} must be a finite number", name);
  };
  finite(p.temperature, "temperature");
  finite(p.top_p, "top_p");
  finite(p.repetition_penalty, "repetition_penalty");
  finite(p.presence_penalty, "presence_penalty");
  finite(p.frequency_penalty, "frequency_penalty");
  if (p.temperature < 0.0f) fail("sampling: temperature must be >= 0 (0 = greedy), got {}", p.temperature);
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) fail("sampling: top_p must be in (0, 1], got {}", p.top_p);
  if (p.top_k < 0) fail("sampling: top_k must be >= 0 (0 = off), got {}", p.top_k);
  if (p.repetition_penalty <= 0.0f) fail("sampling: repetition_penalty must be > 0, got {}", p.repetition_penalty);
  for (const auto& [id, bias] : p.logit_bias) {
    if (id < 0 || (vocab_size > 0 && id >= vocab_size))
      fail("sampling: logit_bias token {} is outside the vocabulary [0, {})", id, vocab_size);
    finite(bias, "a logit_bias value");
  }
}

void check_finite_logits(const char* op, const float* logits, size_t rows, int V, long first_position) {
  const size_t n = rows * (size_t)V, bad = first_non_finite(logits, n);
  if (bad < n)
    fail("{}: the logits at position {} are not finite (token {}: {}): the weights, an adapter or the activations "
         "overflowed",
         op, first_position + (long)(bad / (size_t)V), bad % (size_t)V, logits[bad]);
}

Sampler::Sampler(const SamplingParams& params, int vocab_size) : p_(params), V_(vocab_size) {
  validate_sampling(p_, vocab_size);
  MOETRON_ASSERT(V_ > 0);
}

int32_t Sampler::next(float* logits, std::span<const int32_t> context, std::span<const int32_t> reply) {
  const uint64_t step = step_++;
  if (p_.repetition_penalty != 1.0f) {
    // Each distinct token once (HF gathers the scores of the unique ids, then scatters them back).
    counts_.assign(V_, 0);
    for (int32_t t : context)
      if (t >= 0 && t < V_ && !counts_[t]++) {
        float& l = logits[t];
        l = l > 0 ? l / p_.repetition_penalty : l * p_.repetition_penalty;
      }
  }
  if (p_.presence_penalty != 0.0f || p_.frequency_penalty != 0.0f) {
    counts_.assign(V_, 0);
    for (int32_t t : reply)
      if (t >= 0 && t < V_) counts_[t]++;
    for (int v = 0; v < V_; v++)
      if (counts_[v]) logits[v] -= p_.presence_penalty + p_.frequency_penalty * (float)counts_[v];
  }
  for (const auto& [id, bias] : p_.logit_bias) logits[id] += bias;
  if (p_.greedy()) return (int32_t)kernels::argmax(logits, V_);

  const float inv_t = 1.0f / p_.temperature;
  for (int v = 0; v < V_; v++) logits[v] *= inv_t;
  // Candidates in descending order of logit: the top k, or for top-p a growing sorted prefix that is
  // extended until it holds the nucleus.
  idx_.resize(V_);
  for (int v = 0; v < V_; v++) idx_[v] = v;
  auto by_logit = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  int n = (p_.top_k > 0 && p_.top_k < V_) ? p_.top_k : V_;
  const float mx = *std::max_element(logits, logits + V_);
  double z = 0.0;  // softmax normaliser over the top-k set (or everything)
  if (n < V_) {
    std::partial_sort(idx_.begin(), idx_.begin() + n, idx_.end(), by_logit);
    for (int i = 0; i < n; i++) z += std::exp((double)logits[idx_[i]] - mx);
  } else {
    for (int v = 0; v < V_; v++) z += std::exp((double)logits[v] - mx);
  }
  if (p_.top_p < 1.0f) {
    // Sort a prefix of 64, 256, ... candidates until the cumulative probability reaches top_p.
    int sorted = n < V_ ? n : 0;
    int keep = n;
    for (int want = 64;; want *= 4) {
      const int m = std::min(want, n);
      if (m > sorted) {
        std::partial_sort(idx_.begin() + sorted, idx_.begin() + m, idx_.begin() + n, by_logit);
        sorted = m;
      }
      double cum = 0.0;
      int i = 0;
      for (; i < sorted; i++) {
        cum += std::exp((double)logits[idx_[i]] - mx) / z;
        if (cum >= (double)p_.top_p) break;
      }
      if (i < sorted) {
        keep = i + 1;
        break;
      }
      if (sorted == n) break;  // float rounding: the whole set
    }
    n = keep;
    z = 0.0;
    for (int i = 0; i < n; i++) z += std::exp((double)logits[idx_[i]] - mx);
  }
  // One draw from the kept candidates.
  const double u = uniform_at(p_.seed, 0x73616d706c65ULL /* "sample" */, step, 0) * z;
  double cum = 0.0;
  if (n < V_) {
    for (int i = 0; i < n; i++) {
      cum += std::exp((double)logits[idx_[i]] - mx);
      if (u < cum) return idx_[i];
    }
    return idx_[n - 1];
  }
  int last = 0;
  for (int v = 0; v < V_; v++) {
    const double e = std::exp((double)logits[v] - mx);
    if (e > 0) last = v;
    cum += e;
    if (u < cum) return v;
  }
  return last;
}

}  // namespace moetron
