// The OpenAI HTTP API's request and response objects, as moetron serve speaks them.
//
// Requests (POST, JSON body):
//   /v1/chat/completions  messages [{role: system|developer|user|assistant, content: string or
//                         [{type: "text", text}]}], required, non-empty
//   /v1/completions       prompt: a string (or an array of exactly one string), required
// Common fields (all optional; unknown fields are ignored, as OpenAI-compatible servers do):
//   model (string; any name is accepted -- one model is served), max_tokens (integer >= 1;
//   chat also max_completion_tokens), temperature (0..2; below 1e-5, kGreedyTemperature, greedy, as
//   0 is), top_p (0 < p <= 1), n (only 1), stream
//   (bool), stream_options {include_usage: bool}, stop (string or array of at most 4 strings), seed
//   (integer), presence_penalty / frequency_penalty (-2..2), logprobs (false or absent only), echo
//   (false only), user (string); moetron extensions: top_k (integer >= 0), repetition_penalty (> 0).
// A field of the wrong type or out of range is an ApiError 400 naming it in `param`.
//
// Errors are {"error": {"message", "type", "param", "code"}} with the HTTP status in ApiError.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "infer/chat_format.h"
#include "infer/sampler.h"
#include "tokenizer/chat_template.h"

namespace moetron::server {

class ApiError : public std::runtime_error {
 public:
  ApiError(int status, std::string message, std::string type = "invalid_request_error", std::string param = "",
           std::string code = "")
      : std::runtime_error(message), status(status), type(std::move(type)), param(std::move(param)),
        code(std::move(code)) {}
  int status;
  std::string type, param, code;  // param / code: "" is written as null
};

// The error object's JSON text.
std::string error_json(const ApiError& e);

enum class Endpoint { chat, completion };

struct CompletionRequest {
  Endpoint endpoint = Endpoint::chat;
  std::string model;
  std::vector<ChatMessage> messages;  // chat (built-in formats)
  ChatRequest conversation;           // chat with the model's own template: the messages as sent (key
                                      // order kept), tools, chat_template_kwargs
  std::string prompt;                 // completion
  std::optional<int> max_tokens;      // absent: as many as the limits allow
  SamplingParams sampling;            // seed: given, or drawn by the server
  bool has_seed = false;
  std::vector<std::string> stop;
  bool stream = false;
  bool include_usage = false;
};

// Parses and validates a request body (ApiError 400 on anything malformed).  `model_template`: chats
// are rendered by the model's own Jinja template, which takes any role, assistant messages with
// tool_calls (content null or absent), tool results, reasoning_content, `tools` (an array of
// objects; tool_choice "auto" / "none") and `chat_template_kwargs` (an object) -- all passed to it
// in `conversation`.  Without it those are refused as before.  Tool calls in the reply are not
// parsed out: the model's text is the message content.
CompletionRequest parse_request(Endpoint endpoint, const std::string& body, bool model_template = false);

struct Usage {
  int prompt_tokens = 0, completion_tokens = 0;
};

// Response bodies.  `created` is a Unix time; `id` e.g. "chatcmpl-<hex>".
nlohmann::json completion_response(Endpoint endpoint, const std::string& id, long created, const std::string& model,
                                   const std::string& text, const std::string& finish_reason, const Usage& usage);
// One streamed chunk: a piece of text (role announces the assistant in the first chat chunk), or the
// final chunk with a finish_reason (text empty).
nlohmann::json stream_chunk(Endpoint endpoint, const std::string& id, long created, const std::string& model,
                            const std::string& text, bool first, const std::string& finish_reason);
// The usage chunk sent when stream_options.include_usage is set (choices empty).
nlohmann::json usage_chunk(Endpoint endpoint, const std::string& id, long created, const std::string& model,
                           const Usage& usage);

// JSON text of a value; invalid UTF-8 (which should not occur) is replaced instead of throwing.
std::string dump(const nlohmann::json& j);

}  // namespace moetron::server
