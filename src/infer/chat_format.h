// A conversation -> the prompt tokens the model continues from (ending with the template's
// assistant header), with the chosen template (infer/model.h's TemplateChoice): a built-in format,
// or the model's Jinja template rendered as transformers' apply_chat_template(add_generation_prompt=
// True) and encoded whole (HF's encode: added tokens matched, no BOS/EOS added).
#pragma once

#include <cstdint>
#include <vector>

#include <nlohmann/json.hpp>

#include "infer/model.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace moetron {

// A conversation in OpenAI's shapes: messages (for a Jinja template any roles, tool_calls, tool
// results, reasoning_content, content as parts), tools (null: none), chat_template_kwargs (an object).
struct ChatRequest {
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  nlohmann::ordered_json tools;
  nlohmann::ordered_json kwargs = nlohmann::ordered_json::object();
};

// ChatError (kind unknown_role / bad_role_order / ...) when a built-in format cannot express the
// conversation (or it carries tools: only a model's own template renders them); jinja::TemplateError
// when the model's template refuses it.
std::vector<int32_t> chat_prompt_tokens(const TemplateChoice& tc, const Tokenizer& tok, const ChatRequest& conv);
std::vector<int32_t> chat_prompt_tokens(const TemplateChoice& tc, const Tokenizer& tok,
                                        const std::vector<ChatMessage>& messages);

}  // namespace moetron
