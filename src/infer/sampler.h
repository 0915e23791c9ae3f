// Choosing the next token from the logits, as transformers' generate() does with its logits
// processors, in this order:
//   repetition penalty (HF RepetitionPenaltyLogitsProcessor: for every token of the prompt and the
//     reply so far, a positive logit is divided by the penalty, a negative one multiplied by it),
//   presence / frequency penalties (OpenAI: logit -= presence * [count > 0] + frequency * count,
//     counting the reply's tokens),
//   logit bias (OpenAI logit_bias: logit[id] += bias, for greedy decoding too),
//   then greedy (temperature below kGreedyTemperature, 0 included: the first index of the largest
//     logit, like torch.argmax -- the limit of sampling as the temperature falls; dividing by a
//     denormal temperature such as 1e-45 would overflow every logit to infinity), or
//   sampling: logits / temperature, top-k (keep the k largest), top-p (keep the smallest set of
//     most probable tokens whose probability reaches top_p; at least one), softmax, one draw.
// Draws come from a counter-based generator keyed by (seed, step), so a seeded request is
// reproducible token for token.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

namespace moetron {

// Temperatures below this are greedy decoding (see above).
constexpr float kGreedyTemperature = 1e-5f;

struct SamplingParams {
  float temperature = 0.0f;  // < kGreedyTemperature (e.g. 0): greedy
  int top_k = 0;             // 0: off
  float top_p = 1.0f;        // 1: off
  float repetition_penalty = 1.0f;  // 1: off
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  std::vector<std::pair<int32_t, float>> logit_bias;  // (token id, added to its logit); ids < the vocabulary
  uint64_t seed = 0;
  bool greedy() const { return temperature < kGreedyTemperature; }
};

// Error naming the field for values outside their domain (temperature < 0, top_p outside (0, 1],
// top_k < 0, repetition_penalty <= 0, non-finite values, a logit_bias id outside [0, vocab_size)
// when vocab_size > 0).
void validate_sampling(const SamplingParams& p, int vocab_size = 0);

// Error "OP: the logits at position P are not finite (token T: v): ..." unless every value of `logits`
// [rows, V] is finite; row r is position first_position + r.  NaN / Inf logits (weights, an adapter or
// activations that overflowed) can neither be sampled from nor scored: generation and perplexity stop.
void check_finite_logits(const char* op, const float* logits, size_t rows, int V, long first_position);

class Sampler {
 public:
  Sampler(const SamplingParams& params, int vocab_size);
  // Picks the next token.  `logits` [V] is modified.  `context`: the prompt and reply so far (for
  // the repetition penalty); `reply`: the reply's tokens (presence / frequency penalties).
  int32_t next(float* logits, std::span<const int32_t> context, std::span<const int32_t> reply);

 private:
  SamplingParams p_;
  int V_;
  uint64_t step_ = 0;
  std::vector<int32_t> idx_;
  std::vector<float> probs_;
  std::vector<int32_t> counts_;
};

}  // namespace moetron
