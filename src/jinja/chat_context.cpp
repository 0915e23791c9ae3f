// The template context of a conversation; see chat_context.h.
#include "jinja/chat_context.h"

#include <algorithm>

namespace moetron::jinja {

Value chat_context(const ChatInput& in) {
  if (!in.messages.is_array()) fail("chat template input: 'messages' must be an array, got {}", in.messages.type_name());
  std::vector<Value> msgs;
  msgs.reserve(in.messages.size());
  for (size_t k = 0; k < in.messages.size(); ++k) {
    const auto& m = in.messages[k];
    if (!m.is_object()) fail("chat template input: messages[{}] must be an object, got {}", k, m.type_name());
    Value d = Value::dict();
    for (auto it = m.begin(); it != m.end(); ++it)
      if (!it.value().is_null()) {
        d.obj->items.emplace_back(it.key(), from_json(it.value()));
        d.obj->depth = std::max(d.obj->depth, nesting(d.obj->items.back().second) + 1);
      }
    const Value* r = nullptr;
    for (const char* key : {"reasoning_content", "thinking", "reasoning"})
      if (!r) r = d.obj->find(key);
    if (r) {  // {"thinking": r, **message, "reasoning_content": r}, in one pass
      const Value reasoning = *r;
      const Value* own_thinking = d.obj->find("thinking");
      Value a = Value::dict();
      a.obj->items.emplace_back("thinking", own_thinking ? *own_thinking : reasoning);
      bool had_rc = false;
      for (auto& kv : d.obj->items) {
        if (kv.first == "thinking") continue;
        if (kv.first == "reasoning_content") {
          had_rc = true;
          a.obj->items.emplace_back(kv.first, reasoning);
        } else {
          a.obj->items.emplace_back(kv.first, kv.second);
        }
      }
      if (!had_rc) a.obj->items.emplace_back("reasoning_content", reasoning);
      a.obj->depth = d.obj->depth;
      d = std::move(a);
    }
    msgs.push_back(std::move(d));
  }
  Value ctx = Value::dict();
  Object& c = *ctx.obj;
  c.set("messages", Value::list(std::move(msgs)));
  c.set("tools", in.tools.is_null() ? Value::none() : from_json(in.tools));
  c.set("documents", Value::none());
  c.set("add_generation_prompt", Value::boolean(in.add_generation_prompt));
  for (const auto& [k, v] : in.special_tokens) c.set(k, Value::string(v));
  if (!in.kwargs.is_null()) {
    if (!in.kwargs.is_object()) fail("chat template input: 'chat_template_kwargs' must be an object, got {}", in.kwargs.type_name());
    for (auto it = in.kwargs.begin(); it != in.kwargs.end(); ++it) c.set(it.key(), from_json(it.value()));
  }
  return ctx;
}

std::string render_chat(const Template& t, const ChatInput& in, const RenderOptions& opts, Spans* generation) {
  return t.render(chat_context(in), opts, generation);
}

const char* mask_rule_name(MaskRule r) {
  switch (r) {
    case MaskRule::generation: return "generation";
    case MaskRule::prefix: return "prefix";
    case MaskRule::unstable: return "unstable";
  }
  return "?";
}

AssistantSpans assistant_spans(const Template& t, const ChatInput& in, const std::string& full, const Spans& generation,
                               const RenderOptions& opts) {
  AssistantSpans out;
  if (t.has_generation()) {
    out.rule = MaskRule::generation;
    out.spans = generation;
    return out;
  }
  const auto starts = [](const std::string& s, const std::string& p) { return s.compare(0, p.size(), p) == 0; };
  ChatInput part = in;
  for (size_t i = 0; i < in.messages.size(); ++i) {
    const auto& m = in.messages[i];
    if (!m.is_object() || !m.contains("role") || m["role"] != "assistant") continue;
    try {
      part.messages = nlohmann::ordered_json(std::vector<nlohmann::ordered_json>(in.messages.begin(), in.messages.begin() + (long)i));
      part.add_generation_prompt = true;
      const std::string p = render_chat(t, part, opts);
      part.messages.push_back(m);
      part.add_generation_prompt = false;
      const std::string q = render_chat(t, part, opts);
      if (!starts(q, p) || !starts(full, q) || q.size() == p.size()) {
        out.spans.clear();
        out.rule = MaskRule::unstable;
        return out;
      }
      out.spans.emplace_back(p.size(), q.size());
    } catch (const TemplateError&) {  // a prefix the template refuses (e.g. must end with a user turn)
      out.spans.clear();
      out.rule = MaskRule::unstable;
      return out;
    }
  }
  return out;
}

}  // namespace moetron::jinja
