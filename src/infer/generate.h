// Greedy text generation with the CPU model.  This first version recomputes the whole sequence for
// every new token (no KV cache yet), which is fine for the short prompts of the demo and tests.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/mixtral.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace moetron {

// Appends up to max_new_tokens greedy (argmax) tokens to `prompt`; stops after eos_id (not included
// in the result).  Returns the new tokens only.
std::vector<int32_t> generate_greedy(MixtralModel& model, const std::vector<int32_t>& prompt, int max_new_tokens,
                                     int32_t eos_id);

// The prompt tokens for a chat: the template applied to `messages` (which end with a user turn).
std::vector<int32_t> chat_prompt_tokens(ChatTemplate tmpl, const Tokenizer& tok, const std::vector<ChatMessage>& messages);

struct AnswerAccuracy {
  long correct = 0, total = 0;
  std::vector<std::string> examples;  // a few "prompt => reply (expected ...)" lines
  double fraction() const { return total > 0 ? (double)correct / (double)total : 0.0; }
};

// Exact-answer accuracy over a chat JSONL file: for each line's conversation the last assistant turn
// is the expected answer, everything before it the prompt; the greedy reply (whitespace-trimmed) must
// equal the answer (whitespace-trimmed).  Errors name file:line for unusable lines.
AnswerAccuracy chat_answer_accuracy(MixtralModel& model, const Tokenizer& tok, ChatTemplate tmpl,
                                    const std::string& jsonl_path, int max_new_tokens, long limit);

}  // namespace moetron
