// A model directory's chat template, as transformers loads it: chat_template.jinja beside the
// tokenizer when present, else tokenizer_config.json's "chat_template" (a string, or a list of
// {"name", "template"}: "default", or "tool_use" when the caller asks for it); the special tokens
// the template sees (bos_token, eos_token, unk_token, sep_token, pad_token, cls_token, mask_token:
// a string or an added-token object {"content": ...}; null or absent: not passed) come from
// tokenizer_config.json.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace moetron::jinja {

struct ModelTemplate {
  std::string source;  // the template text
  std::string origin;  // the file it came from (and the entry, for a named one)
  std::vector<std::string> names;  // the named templates tokenizer_config.json offers (empty: one)
  std::vector<std::pair<std::string, std::string>> special_tokens;
};

// nullopt when `dir` holds no template; InputError naming the file and field for a malformed one.
// `name`: which named template ("" = "default", or the only one).
std::optional<ModelTemplate> load_model_template(const std::string& dir, const std::string& name = "");

// A template file given by the user (--template F.jinja), with the special tokens of `tokens_dir`'s
// tokenizer_config.json ("" or a directory without one: none).  InputError naming the file when it is
// missing, unreadable or over 64 MiB.
ModelTemplate load_template_file(const std::string& path, const std::string& tokens_dir);

// The special tokens of a tokenizer_config.json's text (`file` names it in errors).
std::vector<std::pair<std::string, std::string>> template_special_tokens(const std::string& config_text,
                                                                         const std::string& file);

}  // namespace moetron::jinja
