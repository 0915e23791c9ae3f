// JSON from files and clients moetron does not control, with bounds: nlohmann's dump() recurses
// once per nesting level, so a value nested 10^5 deep (200 KB of brackets) overflows the stack
// wherever it is printed or re-written.  Every untrusted document is parsed here, refused beyond
// kMaxJsonDepth levels (no format moetron reads nests more than a handful), and error messages
// print values through json_preview, which is bounded in size whatever the value.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace moetron {

constexpr int kMaxJsonDepth = 64;

// The parsed value; Error "WHAT: not valid JSON: ..." or "WHAT: JSON nested deeper than 64
// levels" (nothing is built beyond the limit).
nlohmann::json parse_json(std::string_view text, const std::string& what, int max_depth = kMaxJsonDepth);
// The same keeping the objects' key order (chat templates print tool schemas in their order).
nlohmann::ordered_json parse_ordered_json(std::string_view text, const std::string& what, int max_depth = kMaxJsonDepth);
// The same without exceptions: a discarded value (is_discarded()) when malformed or too deep.
nlohmann::json parse_json_or_discarded(std::string_view text, int max_depth = kMaxJsonDepth);

// The value as compact JSON text, at most max_chars characters ("..." marks a cut), nested levels
// beyond a few shown as [...] / {...}.  For error messages.
std::string json_preview(const nlohmann::json& value, size_t max_chars = 80);

}  // namespace moetron
