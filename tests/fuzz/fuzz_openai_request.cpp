// Fuzz target: the request body of `serve`'s POST /v1/chat/completions and /v1/completions (parse
// and validate; no model needed).  Bad bodies must be an ApiError with a 4xx status, an OpenAI error
// object, never another exception.  Input: the first byte picks the endpoint.
#include "fuzz_common.h"
#include "server/openai_api.h"

using namespace moetron;
using namespace moetron::server;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const Endpoint ep = (data[0] & 1) ? Endpoint::completion : Endpoint::chat;
  const std::string body(fuzz::as_text(data + 1, size - 1));
  try {
    const CompletionRequest r = parse_request(ep, body);
    if (r.endpoint != ep) std::abort();
    if (r.max_tokens && *r.max_tokens < 0) std::abort();
  } catch (const ApiError& e) {
    if (e.status < 400 || e.status >= 500 || std::string(e.what()).empty()) std::abort();
    const nlohmann::json j = nlohmann::json::parse(error_json(e));  // must be valid JSON
    if (!j.contains("error")) std::abort();
  }
  return 0;
}
