#include "infer/perplexity.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "infer/sampler.h"

namespace moetron {

double PerplexityResult::perplexity() const { return scored > 0 ? std::exp(nll / (double)scored) : 0.0; }

namespace {

constexpr size_t kMaxLogitValues = 64u << 20;  // 256 MiB of fp32 logits per forward

// -log softmax(logits)[target], in double.
double nll_of(const float* logits, int V, int32_t target) {
  float mx = logits[0];
  for (int v = 1; v < V; v++) mx = std::max(mx, logits[v]);
  double sum = 0;
  for (int v = 0; v < V; v++) sum += std::exp((double)logits[v] - mx);
  return std::log(sum) + mx - (double)logits[target];
}

}  // namespace

PerplexityResult perplexity(Runner& dec, std::span<const int32_t> tokens, const PerplexityOptions& o) {
  const ModelConfig& cfg = dec.config();
  if (o.ctx < 2) fail("perplexity: the window must hold at least 2 tokens, got {}", o.ctx);
  if (o.step < 1) fail("perplexity: tokens per forward must be at least 1, got {}", o.step);
  if (cfg.max_position_embeddings > 0 && o.ctx > cfg.max_position_embeddings)
    fail("perplexity: a window of {} tokens is beyond the model's {} positions", o.ctx, cfg.max_position_embeddings);
  if (tokens.size() < 2) fail("perplexity: the text is {} token(s); at least 2 are needed", tokens.size());
  const int V = dec.vocab_size();
  for (size_t i = 0; i < tokens.size(); i++)
    if (tokens[i] < 0 || tokens[i] >= V) fail("perplexity: token {} is id {}, outside the vocabulary of {}", i, tokens[i], V);
  const int step = std::min(o.step, o.ctx - 1);  // rows per forward (a window scores ctx - 1)
  if ((size_t)step * V > kMaxLogitValues)
    fail("perplexity: {} tokens per forward x a vocabulary of {} is {} MiB of logits; at most {} MiB: take fewer "
         "tokens per forward",
         step, V, (size_t)step * V * 4 >> 20, kMaxLogitValues * 4 >> 20);
  PerplexityResult r;
  std::vector<float> logits((size_t)step * V);
  for (size_t w0 = 0; w0 + 1 < tokens.size(); w0 += (size_t)o.ctx) {
    const size_t n = std::min((size_t)o.ctx, tokens.size() - w0);
    if (n < 2) break;  // a last window of one token predicts nothing
    const std::span<const int32_t> win = tokens.subspan(w0, n);
    KvCache cache = dec.new_cache();
    cache.reserve((int)n);
    for (size_t c0 = 0; c0 + 1 < n; c0 += (size_t)step) {
      const size_t m = std::min((size_t)step, n - 1 - c0);  // rows c0 .. c0+m-1 predict c0+1 .. c0+m
      dec.forward(cache, win.subspan(c0, m), logits.data(), /*all_logits=*/true);
      // A NaN / Inf logit would print "nan" as if it were a measurement.
      check_finite_logits("perplexity", logits.data(), m, V, (long)(w0 + c0));
      for (size_t i = 0; i < m; i++) r.nll += nll_of(logits.data() + i * V, V, win[c0 + i + 1]);
      r.scored += (long)m;
    }
    r.windows++;
  }
  return r;
}

}  // namespace moetron
