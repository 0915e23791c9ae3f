#include "server/openai_api.h"
#include "core/json_limits.h"
#include "data/chat_content.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <utility>
#include <vector>

#include <fmt/format.h>

namespace moetron::server {

namespace {

using json = nlohmann::json;

[[noreturn]] void bad(const std::string& param, const std::string& message, const std::string& code = "") {
  throw ApiError(400, message, "invalid_request_error", param, code);
}

// The field, or null when absent (OpenAI treats an explicit null like an absent field).
const json* field(const json& body, const char* name) {
  const auto it = body.find(name);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

// An integer field in [lo, hi]; integers outside int64 count as out of range.
int64_t get_int(const json& v, const std::string& name, int64_t lo, int64_t hi) {
  if (!v.is_number_integer()) bad(name, fmt::format("'{}' must be an integer, got {}", name, v.type_name()), "invalid_type");
  int64_t x;
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    x = u > (uint64_t)std::numeric_limits<int64_t>::max() ? std::numeric_limits<int64_t>::max() : (int64_t)u;
  } else {
    x = v.get<int64_t>();
  }
  if (x < lo || x > hi) bad(name, fmt::format("'{}' must be between {} and {}, got {}", name, lo, hi, v.dump()),
                            "invalid_value");
  return x;
}

double get_number(const json& v, const std::string& name, double lo, double hi, bool lo_open = false) {
  if (!v.is_number()) bad(name, fmt::format("'{}' must be a number, got {}", name, v.type_name()), "invalid_type");
  const double x = v.get<double>();
  if (!std::isfinite(x) || x < lo || x > hi || (lo_open && x == lo))
    bad(name, fmt::format("'{}' must be in {}{}, {}], got {}", name, lo_open ? "(" : "[", lo, hi, v.dump()),
        "invalid_value");
  return x;
}

bool get_bool(const json& v, const std::string& name) {
  if (!v.is_boolean()) bad(name, fmt::format("'{}' must be a boolean, got {}", name, v.type_name()), "invalid_type");
  return v.get<bool>();
}

const std::string& get_string(const json& v, const std::string& name) {
  if (!v.is_string()) bad(name, fmt::format("'{}' must be a string, got {}", name, v.type_name()), "invalid_type");
  return v.get_ref<const std::string&>();
}

// A message's content (data/chat_content.h: the rule data prepare keeps too).
std::string message_content(const json& v, const std::string& name) {
  ContentError err;
  if (std::optional<std::string> text = chat_content_text(v, err)) return std::move(*text);
  const std::string where = name + err.where;
  if (err.kind == ContentError::Kind::missing)
    bad(where, fmt::format("Missing required parameter: '{}'.", where), "missing_required_parameter");
  bad(where, fmt::format("'{}' {}", where, err.message),
      err.kind == ContentError::Kind::wrong_type ? "invalid_type" : "invalid_value");
}

// OpenAI's roles, by the one rule (tokenizer/chat_template.h parse_role: "developer" is "system").
Role message_role(const json& v, const std::string& name) {
  const std::string& r = get_string(v, name);
  try {
    return parse_role(r);
  } catch (const ChatError& e) {
    bad(name, fmt::format("'{}': {}", name, e.what()), "invalid_value");
  }
}

void reject_if_set(const json& body, const char* name, const char* why) {
  const json* v = field(body, name);
  if (!v) return;
  const bool harmless = (v->is_boolean() && !v->get<bool>()) || (v->is_number_integer() && v->get<int64_t>() == 0) ||
                        (v->is_array() && v->empty());
  if (!harmless) bad(name, fmt::format("'{}' is not supported: {}", name, why), "unsupported_parameter");
}

// Every request parameter is honoured or refused with a 400 naming it, never ignored (a client that
// sends response_format or tool_choice expects them to take effect).  Honoured: the fields parsed
// below; harmless values of those that change nothing here (store false, a default service tier,
// text modalities, tool_choice "none"/"auto" without tools, parallel_tool_calls without tools).
void refuse_unknown_parameters(const json& body, Endpoint endpoint) {
  static const std::set<std::string> common = {
      "model",          "max_tokens", "n",    "temperature", "top_p",    "top_k",      "repetition_penalty",
      "presence_penalty", "frequency_penalty", "seed", "stream", "stream_options", "stop", "user",
      "logprobs",       "logit_bias", "store", "service_tier", "metadata"};
  static const std::set<std::string> chat = {"messages", "max_completion_tokens", "tools", "functions",
                                             "top_logprobs", "response_format", "tool_choice", "function_call",
                                             "parallel_tool_calls", "modalities", "chat_template_kwargs"};
  static const std::set<std::string> completion = {"prompt", "echo", "best_of", "suffix"};
  const std::set<std::string>& own = endpoint == Endpoint::chat ? chat : completion;
  for (const auto& [name, value] : body.items()) {
    if (common.count(name) || own.count(name)) continue;
    bad(name.substr(0, 64), fmt::format("Unrecognized request argument supplied: '{}' (moetron refuses what it would not honour)",
                          name.substr(0, 64)),
        "unrecognized_parameter");
  }
  auto refuse = [&](const char* name, const std::string& why) {
    bad(name, fmt::format("'{}' is not supported: {}", name, why), "unsupported_parameter");
  };
  if (const json* v = field(body, "store"); v && !(v->is_boolean() && !v->get<bool>()))
    refuse("store", "completions are not stored");
  if (const json* v = field(body, "metadata"); v && !(v->is_object() && v->empty()))
    refuse("metadata", "completions are not stored, so they carry no metadata");
  if (const json* v = field(body, "service_tier"); v && !(v->is_string() && (v->get<std::string>() == "auto" ||
                                                                            v->get<std::string>() == "default")))
    refuse("service_tier", "one tier is served (\"auto\" or \"default\")");
  if (endpoint != Endpoint::chat) return;
  if (const json* v = field(body, "response_format")) {
    const json* type = v->is_object() ? field(*v, "type") : nullptr;
    if (!type || !type->is_string() || type->get<std::string>() != "text")
      refuse("response_format", "only {\"type\": \"text\"}: structured output (json_object, json_schema) is not "
                                "implemented");
  }
  for (const char* name : {"tool_choice", "function_call"})
    if (const json* v = field(body, name);
        v && !(v->is_string() && (v->get<std::string>() == "none" || v->get<std::string>() == "auto")))
      refuse(name, "tool calls are not implemented (only \"none\" or \"auto\", which call nothing)");
  if (const json* v = field(body, "parallel_tool_calls")) get_bool(*v, "parallel_tool_calls");
  if (const json* v = field(body, "modalities"); v && !(*v == json::array({"text"})))
    refuse("modalities", "only [\"text\"]");
}

// logit_bias: {"token id": bias in [-100, 100]} (OpenAI's range), at most kMaxLogitBias entries.  The
// ids are checked against the vocabulary by the server.
constexpr size_t kMaxLogitBias = 1024;
std::vector<std::pair<int32_t, float>> parse_logit_bias(const json& v) {
  if (!v.is_object()) bad("logit_bias", fmt::format("'logit_bias' must be an object, got {}", v.type_name()),
                          "invalid_type");
  if (v.size() > kMaxLogitBias)
    bad("logit_bias", fmt::format("'logit_bias' may hold at most {} tokens, got {}", kMaxLogitBias, v.size()),
        "invalid_value");
  std::vector<std::pair<int32_t, float>> out;
  for (const auto& [key, bias] : v.items()) {
    int64_t id = -1;
    const bool digits = !key.empty() && key.size() <= 10 &&
                        std::all_of(key.begin(), key.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (digits) id = std::stoll(key);
    if (!digits || id > INT32_MAX)
      bad("logit_bias", fmt::format("'logit_bias' keys must be token ids (decimal integers), got '{}'",
                                    key.substr(0, 64)),
          "invalid_value");
    out.emplace_back((int32_t)id, (float)get_number(bias, "logit_bias", -100.0, 100.0));
  }
  return out;
}

}  // namespace

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string error_json(const ApiError& e) {
  json err = {{"message", e.what()},
              {"type", e.type},
              {"param", e.param.empty() ? json(nullptr) : json(e.param)},
              {"code", e.code.empty() ? json(nullptr) : json(e.code)}};
  return dump(json{{"error", err}});
}

CompletionRequest parse_request(Endpoint endpoint, const std::string& body_text, bool model_template) {
  const json body = parse_json_or_discarded(body_text);
  if (body.is_discarded())
    bad("",
        fmt::format("We could not parse the JSON body of your request: it is not valid JSON (UTF-8 text) or it is "
                    "nested deeper than {} levels.",
                    kMaxJsonDepth),
        "invalid_json");
  if (!body.is_object()) bad("", fmt::format("The request body must be a JSON object, got {}", body.type_name()),
                             "invalid_type");
  refuse_unknown_parameters(body, endpoint);
  CompletionRequest r;
  r.endpoint = endpoint;
  if (const json* v = field(body, "model")) r.model = get_string(*v, "model");

  if (endpoint == Endpoint::chat) {
    const json* msgs = field(body, "messages");
    if (!msgs) bad("messages", "Missing required parameter: 'messages'.", "missing_required_parameter");
    if (!msgs->is_array()) bad("messages", fmt::format("'messages' must be an array, got {}", msgs->type_name()),
                               "invalid_type");
    if (msgs->empty()) bad("messages", "'messages' must contain at least one message", "invalid_value");
    for (size_t i = 0; i < msgs->size(); i++) {
      const json& m = (*msgs)[i];
      const std::string name = fmt::format("messages[{}]", i);
      if (!m.is_object()) bad(name, fmt::format("'{}' must be an object, got {}", name, m.type_name()), "invalid_type");
      const json* role = field(m, "role");
      if (!role) bad(name + ".role", fmt::format("Missing required parameter: '{}.role'.", name),
                     "missing_required_parameter");
      const json* content = field(m, "content");
      if (model_template) {  // any role; content a string, parts or null (an assistant's tool calls)
        if (!role->is_string()) bad(name + ".role", fmt::format("'{}.role' must be a string", name), "invalid_type");
        const json* calls = field(m, "tool_calls");
        if (calls && !calls->is_array())
          bad(name + ".tool_calls", fmt::format("'{}.tool_calls' must be an array", name), "invalid_type");
        if ((!content || content->is_null()) && !calls)
          bad(name + ".content", fmt::format("Missing required parameter: '{}.content'.", name),
              "missing_required_parameter");
        if (content && !content->is_null() && !content->is_string() && !content->is_array())
          bad(name + ".content", fmt::format("'{}.content' must be a string or an array of parts", name), "invalid_type");
        continue;
      }
      if (!content) bad(name + ".content", fmt::format("Missing required parameter: '{}.content'.", name),
                        "missing_required_parameter");
      ChatMessage cm;
      cm.role = message_role(*role, name + ".role");
      cm.content = message_content(*content, name + ".content");
      r.messages.push_back(std::move(cm));
    }
    if (model_template) {
      // The messages, tools and kwargs as sent, keys in order (the template prints tool schemas).
      const nlohmann::ordered_json ob = parse_ordered_json(body_text, "the request body");
      r.conversation.messages = ob["messages"];
      if (const json* t = field(body, "tools"); t && !t->is_null()) {
        if (!t->is_array()) bad("tools", fmt::format("'tools' must be an array, got {}", t->type_name()), "invalid_type");
        for (size_t i = 0; i < t->size(); i++)
          if (!(*t)[i].is_object())
            bad(fmt::format("tools[{}]", i), fmt::format("'tools[{}]' must be an object", i), "invalid_type");
        r.conversation.tools = ob["tools"];
      }
      if (const json* k = field(body, "chat_template_kwargs"); k && !k->is_null()) {
        if (!k->is_object())
          bad("chat_template_kwargs", fmt::format("'chat_template_kwargs' must be an object, got {}", k->type_name()),
              "invalid_type");
        r.conversation.kwargs = ob["chat_template_kwargs"];
      }
    } else {
      reject_if_set(body, "tools", "tool calls need the model's own chat template (this server formats chats with a "
                                   "built-in format)");
      reject_if_set(body, "chat_template_kwargs", "this server formats chats with a built-in format, not the model's "
                                                  "template");
    }
    reject_if_set(body, "functions", "function calls are not implemented");
    reject_if_set(body, "top_logprobs", "log probabilities are not implemented");
  } else {
    const json* p = field(body, "prompt");
    if (!p) bad("prompt", "Missing required parameter: 'prompt'.", "missing_required_parameter");
    if (p->is_array()) {
      if (p->size() != 1 || !(*p)[0].is_string())
        bad("prompt", "'prompt' must be a string or an array of exactly one string (batches are not supported)",
            "invalid_value");
      r.prompt = (*p)[0].get<std::string>();
    } else {
      r.prompt = get_string(*p, "prompt");
    }
    if (const json* v = field(body, "echo"); v && get_bool(*v, "echo"))
      bad("echo", "'echo' is not supported", "unsupported_parameter");
    if (const json* v = field(body, "best_of")) get_int(*v, "best_of", 1, 1);
    if (field(body, "suffix")) bad("suffix", "'suffix' is not supported", "unsupported_parameter");
  }
  reject_if_set(body, "logprobs", "log probabilities are not implemented");

  const char* max_name = endpoint == Endpoint::chat && field(body, "max_completion_tokens") ? "max_completion_tokens"
                                                                                            : "max_tokens";
  if (const json* v = field(body, max_name))
    r.max_tokens = (int)std::min<int64_t>(get_int(*v, max_name, 1, std::numeric_limits<int64_t>::max()), INT32_MAX);
  if (const json* v = field(body, "n"); v && get_int(*v, "n", 1, 128) != 1)
    bad("n", "only 'n' = 1 is supported", "unsupported_parameter");
  SamplingParams& s = r.sampling;
  s.temperature = 1.0f;  // OpenAI's default
  if (const json* v = field(body, "temperature")) {
    s.temperature = (float)get_number(*v, "temperature", 0.0, 2.0);
    if (s.temperature < kGreedyTemperature) s.temperature = 0.0f;  // greedy, as the CLI (sampler.h)
  }
  if (const json* v = field(body, "top_p")) {
    const double p = get_number(*v, "top_p", 0.0, 1.0);
    if (p == 0.0)
      s.temperature = 0.0f;  // only the most likely token survives: greedy
    else
      s.top_p = (float)p;
  }
  if (const json* v = field(body, "top_k")) s.top_k = (int)get_int(*v, "top_k", 0, INT32_MAX);
  if (const json* v = field(body, "repetition_penalty"))
    s.repetition_penalty = (float)get_number(*v, "repetition_penalty", 0.0, 100.0, /*lo_open=*/true);
  if (const json* v = field(body, "presence_penalty")) s.presence_penalty = (float)get_number(*v, "presence_penalty", -2, 2);
  if (const json* v = field(body, "frequency_penalty"))
    s.frequency_penalty = (float)get_number(*v, "frequency_penalty", -2, 2);
  if (const json* v = field(body, "logit_bias")) s.logit_bias = parse_logit_bias(*v);
  if (const json* v = field(body, "seed")) {
    if (!v->is_number_integer()) bad("seed", fmt::format("'seed' must be an integer, got {}", v->type_name()),
                                     "invalid_type");
    s.seed = v->is_number_unsigned() ? v->get<uint64_t>() : (uint64_t)v->get<int64_t>();
    r.has_seed = true;
  }
  if (const json* v = field(body, "stream")) r.stream = get_bool(*v, "stream");
  if (const json* v = field(body, "stream_options")) {
    if (!v->is_object()) bad("stream_options", "'stream_options' must be an object", "invalid_type");
    if (const json* u = field(*v, "include_usage")) r.include_usage = get_bool(*u, "stream_options.include_usage");
  }
  if (const json* v = field(body, "stop")) {
    auto add = [&](const json& x, const std::string& name) {
      const std::string& s = get_string(x, name);
      if (s.size() > 256) bad(name, fmt::format("'{}' is longer than 256 bytes", name), "invalid_value");
      if (!s.empty()) r.stop.push_back(s);
    };
    if (v->is_array()) {
      if (v->size() > 4) bad("stop", "'stop' may hold at most 4 sequences", "invalid_value");
      for (size_t i = 0; i < v->size(); i++) add((*v)[i], fmt::format("stop[{}]", i));
    } else {
      add(*v, "stop");
    }
  }
  if (const json* v = field(body, "user")) get_string(*v, "user");
  return r;
}

json completion_response(Endpoint endpoint, const std::string& id, long created, const std::string& model,
                         const std::string& text, const std::string& finish_reason, const Usage& usage) {
  json choice = {{"index", 0}, {"finish_reason", finish_reason}, {"logprobs", nullptr}};
  if (endpoint == Endpoint::chat)
    choice["message"] = {{"role", "assistant"}, {"content", text}};
  else
    choice["text"] = text;
  return {{"id", id},
          {"object", endpoint == Endpoint::chat ? "chat.completion" : "text_completion"},
          {"created", created},
          {"model", model},
          {"choices", json::array({choice})},
          {"usage",
           {{"prompt_tokens", usage.prompt_tokens},
            {"completion_tokens", usage.completion_tokens},
            {"total_tokens", usage.prompt_tokens + usage.completion_tokens}}}};
}

json stream_chunk(Endpoint endpoint, const std::string& id, long created, const std::string& model,
                  const std::string& text, bool first, const std::string& finish_reason) {
  json choice = {{"index", 0},
                 {"finish_reason", finish_reason.empty() ? json(nullptr) : json(finish_reason)},
                 {"logprobs", nullptr}};
  if (endpoint == Endpoint::chat) {
    json delta = json::object();
    if (first) delta["role"] = "assistant";
    if (!text.empty() || (first && finish_reason.empty())) delta["content"] = text;
    choice["delta"] = delta;
  } else {
    choice["text"] = text;
  }
  return {{"id", id},
          {"object", endpoint == Endpoint::chat ? "chat.completion.chunk" : "text_completion"},
          {"created", created},
          {"model", model},
          {"choices", json::array({choice})}};
}

json usage_chunk(Endpoint endpoint, const std::string& id, long created, const std::string& model, const Usage& usage) {
  return {{"id", id},
          {"object", endpoint == Endpoint::chat ? "chat.completion.chunk" : "text_completion"},
          {"created", created},
          {"model", model},
          {"choices", json::array()},
          {"usage",
           {{"prompt_tokens", usage.prompt_tokens},
            {"completion_tokens", usage.completion_tokens},
            {"total_tokens", usage.prompt_tokens + usage.completion_tokens}}}};
}

}  // namespace moetron::server
