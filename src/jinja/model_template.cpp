// A model directory's chat template; see model_template.h.
#include "jinja/model_template.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json_limits.h"

namespace moetron::jinja {

namespace fs = std::filesystem;

namespace {

constexpr size_t kMaxTemplateFile = 64u << 20;  // tokenizer_config.json / chat_template.jinja

std::optional<std::string> read_small(const fs::path& p) {
  std::error_code ec;
  if (!fs::is_regular_file(p, ec)) return std::nullopt;
  const auto size = fs::file_size(p, ec);
  if (ec) throw InputError(fmt::format("{}: cannot read: {}", p.string(), ec.message()));
  if (size > kMaxTemplateFile)
    throw InputError(fmt::format("{}: {} bytes, over the {} MiB a chat template file may have", p.string(), size, kMaxTemplateFile >> 20));
  std::ifstream in(p, std::ios::binary);
  if (!in) throw InputError(fmt::format("{}: cannot open", p.string()));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

nlohmann::json parse_config(const std::string& text, const std::string& file) {
  nlohmann::json j;
  try {
    j = parse_json(text, file);
  } catch (const Error& e) {
    throw InputError(e.what());
  }
  if (!j.is_object()) throw InputError(fmt::format("{}: expected a JSON object, got {}", file, j.type_name()));
  return j;
}

}  // namespace

std::vector<std::pair<std::string, std::string>> template_special_tokens(const std::string& config_text,
                                                                         const std::string& file) {
  const nlohmann::json cfg = parse_config(config_text, file);
  std::vector<std::pair<std::string, std::string>> out;
  for (const char* key : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}) {
    if (!cfg.contains(key) || cfg[key].is_null()) continue;
    const auto& v = cfg[key];
    if (v.is_string()) {
      out.emplace_back(key, v.get<std::string>());
    } else if (v.is_object() && v.contains("content") && v["content"].is_string()) {
      out.emplace_back(key, v["content"].get<std::string>());
    } else {
      throw InputError(fmt::format("{}: field '{}' must be a string or an object with a string \"content\", got {}", file, key, v.type_name()));
    }
  }
  return out;
}

ModelTemplate load_template_file(const std::string& path, const std::string& tokens_dir) {
  auto text = read_small(path);
  if (!text) throw InputError(fmt::format("--template {}: no such file", path));
  ModelTemplate t;
  t.source = std::move(*text);
  t.origin = path;
  if (!tokens_dir.empty())
    if (auto cfg = read_small(fs::path(tokens_dir) / "tokenizer_config.json"))
      t.special_tokens = template_special_tokens(*cfg, (fs::path(tokens_dir) / "tokenizer_config.json").string());
  return t;
}

std::optional<ModelTemplate> load_model_template(const std::string& dir, const std::string& name) {
  ModelTemplate t;
  const fs::path cfg_path = fs::path(dir) / "tokenizer_config.json";
  std::optional<nlohmann::json> cfg;
  if (auto text = read_small(cfg_path)) {
    cfg = parse_config(*text, cfg_path.string());
    t.special_tokens = template_special_tokens(*text, cfg_path.string());
  }
  const fs::path jinja_path = fs::path(dir) / "chat_template.jinja";
  if (auto text = read_small(jinja_path)) {
    if (!name.empty() && name != "default")
      throw InputError(fmt::format("{}: a single template; there is no template named '{}'", jinja_path.string(), name));
    t.source = std::move(*text);
    t.origin = jinja_path.string();
    return t;
  }
  if (!cfg || !cfg->contains("chat_template") || (*cfg)["chat_template"].is_null()) return std::nullopt;
  const auto& ct = (*cfg)["chat_template"];
  if (ct.is_string()) {
    if (!name.empty() && name != "default")
      throw InputError(fmt::format("{}: a single chat_template; there is no template named '{}'", cfg_path.string(), name));
    t.source = ct.get<std::string>();
    t.origin = cfg_path.string();
    return t;
  }
  if (!ct.is_array())
    throw InputError(fmt::format("{}: field 'chat_template' must be a string or a list of {{\"name\", \"template\"}}, got {}", cfg_path.string(), ct.type_name()));
  const std::string want = name.empty() ? "default" : name;
  for (size_t k = 0; k < ct.size(); ++k) {
    const auto& e = ct[k];
    if (!e.is_object() || !e.contains("name") || !e["name"].is_string() || !e.contains("template") || !e["template"].is_string())
      throw InputError(fmt::format("{}: chat_template[{}] must be an object with string fields \"name\" and \"template\"", cfg_path.string(), k));
    t.names.push_back(e["name"].get<std::string>());
  }
  for (size_t k = 0; k < ct.size(); ++k)
    if (ct[k]["name"] == want) {
      t.source = ct[k]["template"].get<std::string>();
      t.origin = fmt::format("{} (chat_template '{}')", cfg_path.string(), want);
      return t;
    }
  std::string names;
  for (const auto& n : t.names) names += (names.empty() ? "" : ", ") + n;
  throw InputError(fmt::format("{}: no chat template named '{}' (it has: {})", cfg_path.string(), want, names));
}

}  // namespace moetron::jinja
