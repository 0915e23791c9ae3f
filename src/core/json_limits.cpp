#include "core/json_limits.h"

#include "core/error.h"

namespace moetron {

namespace {

struct TooDeep {};

nlohmann::json parse_bounded(std::string_view text, int max_depth) {
  auto callback = [max_depth](int depth, nlohmann::json::parse_event_t event, nlohmann::json&) -> bool {
    if ((event == nlohmann::json::parse_event_t::object_start || event == nlohmann::json::parse_event_t::array_start) &&
        depth >= max_depth)
      throw TooDeep{};
    return true;
  };
  return nlohmann::json::parse(text.begin(), text.end(), callback);
}

void preview(const nlohmann::json& v, int depth, std::string& out, size_t budget) {
  if (out.size() >= budget) return;
  if (v.is_object() || v.is_array()) {
    const bool obj = v.is_object();
    if (depth >= 3 || v.empty()) {
      out += obj ? (v.empty() ? "{}" : "{...}") : (v.empty() ? "[]" : "[...]");
      return;
    }
    out += obj ? '{' : '[';
    bool first = true;
    for (auto it = v.begin(); it != v.end() && out.size() < budget; ++it) {
      if (!first) out += ',';
      first = false;
      if (obj) out += nlohmann::json(it.key()).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + ":";
      preview(*it, depth + 1, out, budget);
    }
    out += obj ? '}' : ']';
    return;
  }
  if (v.is_string() && v.get_ref<const std::string&>().size() > budget) {  // a long string: its start
    out += nlohmann::json(v.get_ref<const std::string&>().substr(0, budget))
               .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    return;
  }
  out += v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);  // a scalar: no recursion
}

}  // namespace

nlohmann::json parse_json(std::string_view text, const std::string& what, int max_depth) {
  try {
    return parse_bounded(text, max_depth);
  } catch (const TooDeep&) {
    fail("{}: JSON nested deeper than {} levels", what, max_depth);
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not valid JSON: {}", what, e.what());
  }
}

nlohmann::ordered_json parse_ordered_json(std::string_view text, const std::string& what, int max_depth) {
  auto callback = [max_depth](int depth, nlohmann::ordered_json::parse_event_t event, nlohmann::ordered_json&) -> bool {
    if ((event == nlohmann::ordered_json::parse_event_t::object_start ||
         event == nlohmann::ordered_json::parse_event_t::array_start) &&
        depth >= max_depth)
      throw TooDeep{};
    return true;
  };
  try {
    return nlohmann::ordered_json::parse(text.begin(), text.end(), callback);
  } catch (const TooDeep&) {
    fail("{}: JSON nested deeper than {} levels", what, max_depth);
  } catch (const nlohmann::ordered_json::exception& e) {
    fail("{}: not valid JSON: {}", what, e.what());
  }
}

nlohmann::json parse_json_or_discarded(std::string_view text, int max_depth) {
  try {
    return parse_bounded(text, max_depth);
  } catch (...) {
    return nlohmann::json(nlohmann::json::value_t::discarded);
  }
}

std::string json_preview(const nlohmann::json& value, size_t max_chars) {
  std::string out;
  preview(value, 0, out, max_chars);
  if (out.size() > max_chars) out = out.substr(0, max_chars) + "...";
  return out;
}

}  // namespace moetron
