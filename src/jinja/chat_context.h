// What a chat template sees, built as transformers' apply_chat_template builds it, so a rendering
// here equals apply_chat_template(messages, tools=..., add_generation_prompt=..., tokenize=False,
// **chat_template_kwargs):
//   messages  each message with its null-valued keys dropped (a "content": null is absent, not
//             none), and its reasoning aliased: when reasoning_content, thinking or reasoning is set
//             (first non-null in that order), the message becomes
//             {"thinking": r, **message, "reasoning_content": r} (gpt-oss reads "thinking");
//   tools     the request's tools, or none; documents none;
//   add_generation_prompt;
//   the tokenizer's special tokens (bos_token, eos_token, unk_token, pad_token, ... as strings, only
//   those it has), then chat_template_kwargs (which win on a clash).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "jinja/jinja.h"

namespace moetron::jinja {

struct ChatInput {
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  nlohmann::ordered_json tools;  // null: none
  bool add_generation_prompt = false;
  std::vector<std::pair<std::string, std::string>> special_tokens;  // e.g. {"bos_token", "<s>"}
  nlohmann::ordered_json kwargs = nlohmann::ordered_json::object();  // chat_template_kwargs
};

// The context dict; throws Error when messages is not an array of objects (naming the index).
Value chat_context(const ChatInput& in);

// Renders `in` with `t`; `generation` gets the {% generation %} byte ranges (when non-null).
std::string render_chat(const Template& t, const ChatInput& in, const RenderOptions& opts = {},
                        Spans* generation = nullptr);

// Where the assistant's turns are in `full` (= render_chat(t, in)) as byte ranges, for loss masks:
//   generation  the template's {% generation %} blocks (`generation`, from that render), as
//               transformers' return_assistant_tokens_mask;
//   prefix      otherwise, for each assistant message i: P = render(messages[:i],
//               add_generation_prompt=true), Q = render(messages[:i+1]); when Q starts with P and
//               `full` starts with Q, the turn is [|P|, |Q|): its content and the end-of-turn markup
//               the template closes it with;
//   unstable    a template without generation blocks where that fails for some turn (it renders
//               earlier turns differently once later ones exist, as Qwen3 drops old reasoning): no
//               spans; callers count and report such conversations.
enum class MaskRule : uint8_t { generation, prefix, unstable };
const char* mask_rule_name(MaskRule r);
struct AssistantSpans {
  Spans spans;
  MaskRule rule = MaskRule::prefix;
};
AssistantSpans assistant_spans(const Template& t, const ChatInput& in, const std::string& full, const Spans& generation,
                               const RenderOptions& opts = {});

}  // namespace moetron::jinja
