// Prompt tokens of a conversation; see chat_format.h.
#include "infer/chat_format.h"

#include "data/chat_content.h"
#include "infer/generate.h"
#include "jinja/chat_context.h"

namespace moetron {

std::vector<int32_t> chat_prompt_tokens(const TemplateChoice& tc, const Tokenizer& tok, const ChatRequest& conv) {
  if (tc.jinja) {
    jinja::ChatInput in;
    in.messages = conv.messages;
    in.tools = conv.tools;
    in.kwargs = conv.kwargs.is_null() ? nlohmann::ordered_json::object() : conv.kwargs;
    in.add_generation_prompt = true;
    in.special_tokens = tc.special_tokens;
    jinja::RenderOptions opts;
    opts.now = tc.now;
    return tok.encode(jinja::render_chat(*tc.jinja, in, opts));
  }
  if (!conv.tools.is_null() && !(conv.tools.is_array() && conv.tools.empty()))
    throw ChatError(ChatErrorKind::unknown_role,
                    fmt::format("tools need the model's own chat template; the {} format has no place for them",
                                chat_template_name(tc.tmpl)));
  std::vector<ChatMessage> msgs;
  for (size_t k = 0; k < conv.messages.size(); ++k) {
    const auto& m = conv.messages[k];
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      throw ChatError(ChatErrorKind::unknown_role, fmt::format("messages[{}]: expected an object with a string role", k));
    ChatMessage cm;
    cm.role = parse_role(m["role"].get<std::string>());
    ContentError err;
    const auto text = m.contains("content") ? chat_content_text(nlohmann::json::parse(m["content"].dump()), err) : std::nullopt;
    if (!text)
      throw ChatError(ChatErrorKind::unknown_role,
                      fmt::format("messages[{}].content{}: {}", k, err.where, m.contains("content") ? err.message : "missing"));
    cm.content = *text;
    msgs.push_back(std::move(cm));
  }
  return chat_prompt_tokens(tc.tmpl, tok, msgs);
}

std::vector<int32_t> chat_prompt_tokens(const TemplateChoice& tc, const Tokenizer& tok,
                                        const std::vector<ChatMessage>& messages) {
  if (!tc.jinja) return chat_prompt_tokens(tc.tmpl, tok, messages);
  ChatRequest conv;
  for (const ChatMessage& m : messages) conv.messages.push_back({{"role", role_name(m.role)}, {"content", m.content}});
  return chat_prompt_tokens(tc, tok, conv);
}

}  // namespace moetron
