#include "data/chat_content.h"

#include <fmt/format.h>

namespace moetron {

std::optional<std::string> chat_content_text(const nlohmann::json& v, ContentError& err) {
  if (v.is_string()) return v.get<std::string>();
  if (!v.is_array()) {
    err = {ContentError::Kind::wrong_type, "", fmt::format("must be a string or an array of text parts, got {}", v.type_name())};
    return std::nullopt;
  }
  std::string out;
  for (size_t i = 0; i < v.size(); i++) {
    const nlohmann::json& part = v[i];
    if (!part.is_object()) {
      err = {ContentError::Kind::wrong_type, fmt::format("[{}]", i), "must be an object"};
      return std::nullopt;
    }
    const auto type = part.find("type");
    if (type == part.end() || !type->is_string() || type->get<std::string>() != "text") {
      err = {ContentError::Kind::bad_value, fmt::format("[{}].type", i), "must be \"text\" (only text content is supported)"};
      return std::nullopt;
    }
    const auto text = part.find("text");
    if (text == part.end() || text->is_null()) {
      err = {ContentError::Kind::missing, fmt::format("[{}].text", i), "is missing"};
      return std::nullopt;
    }
    if (!text->is_string()) {
      err = {ContentError::Kind::wrong_type, fmt::format("[{}].text", i), fmt::format("must be a string, got {}", text->type_name())};
      return std::nullopt;
    }
    out += text->get<std::string>();
  }
  return out;
}

}  // namespace moetron
