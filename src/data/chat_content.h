// A chat message's "content" as OpenAI's API and chat datasets write it: a string, or an array of
// text parts [{"type": "text", "text": "..."}] (concatenated).  One rule for `data prepare` and
// `serve`, so a message the server answers is one the dataset keeps, and the other way round.
#pragma once

#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace moetron {

// What is wrong with a content value: `where` is "" for the value itself, or "[i].type" /
// "[i].text" / "[i]" for part i (appended to the caller's name for the content); `message` says
// what was expected.
struct ContentError {
  enum class Kind { wrong_type, bad_value, missing } kind = Kind::wrong_type;
  std::string where, message;
};

// The text of `content`, or nullopt with `err` set.
std::optional<std::string> chat_content_text(const nlohmann::json& content, ContentError& err);

}  // namespace moetron
