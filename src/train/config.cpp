#include "train/config.h"
#include "core/json_limits.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <string_view>
#include <type_traits>
#include <variant>

#include <yaml-cpp/yaml.h>

#include "core/error.h"
#include "tokenizer/utf8.h"

namespace moetron {

namespace {

using nlohmann::json;

// ---------------------------------------------------------------------------------------------
// The key table: every dotted key and the member it sets. Reading, validation messages, the
// suggestions for unknown keys, the YAML dump and the JSON dump all walk this one table, so a key
// added here is complete everywhere. Keys of one section are contiguous (the dump relies on it).

using FieldRef = std::variant<std::string*, int*, long*, uint64_t*, double*, bool*, std::optional<double>*, json*,
                              std::vector<int>*, std::vector<std::string>*>;

struct Field {
  const char* key;
  FieldRef ref;
};

std::vector<Field> fields_of(TrainConfig& c) {
  return {
      {"run_dir", &c.run_dir},
      {"device", &c.device},
      {"seed", &c.seed},
      {"model.init", &c.model.init},
      {"model.config", &c.model.config},
      {"model.dtype", &c.model.dtype},
      {"data.path", &c.data.path},
      {"data.seq_length", &c.data.seq_length},
      {"data.packing", &c.data.packing},
      {"data.over_long", &c.data.over_long},
      {"train.global_batch_size", &c.train.global_batch_size},
      {"train.micro_batch_size", &c.train.micro_batch_size},
      {"train.max_steps", &c.train.max_steps},
      {"train.epochs", &c.train.epochs},
      {"train.lr", &c.train.lr},
      {"train.min_lr", &c.train.min_lr},
      {"train.warmup_steps", &c.train.warmup_steps},
      {"train.schedule", &c.train.schedule},
      {"train.weight_decay", &c.train.weight_decay},
      {"train.adam_beta1", &c.train.adam_beta1},
      {"train.adam_beta2", &c.train.adam_beta2},
      {"train.adam_eps", &c.train.adam_eps},
      {"train.grad_clip", &c.train.grad_clip},
      {"train.nan_skip_limit", &c.train.nan_skip_limit},
      {"train.exit_interval", &c.train.exit_interval},
      {"train.recompute", &c.train.recompute},
      {"moe.aux_loss_coef", &c.moe.aux_loss_coef},
      {"moe.aux_loss", &c.moe.aux_loss},
      {"moe.z_loss_coef", &c.moe.z_loss_coef},
      {"moe.capacity_factor", &c.moe.capacity_factor},
      {"moe.bias_update_rate", &c.moe.bias_update_rate},
      {"lora.rank", &c.lora.rank},
      {"lora.alpha", &c.lora.alpha},
      {"lora.dropout", &c.lora.dropout},
      {"lora.targets", &c.lora.targets},
      {"lora.init_seed", &c.lora.init_seed},
      {"lora.rslora", &c.lora.rslora},
      {"parallel.tp", &c.parallel.tp},
      {"parallel.pp", &c.parallel.pp},
      {"parallel.ep", &c.parallel.ep},
      {"parallel.layers_per_stage", &c.parallel.layers_per_stage},
      {"parallel.zero1", &c.parallel.zero1},
      {"parallel.device_comm", &c.parallel.device_comm},
      {"checkpoint.every_steps", &c.checkpoint.every_steps},
      {"checkpoint.keep_last", &c.checkpoint.keep_last},
      {"checkpoint.resume", &c.checkpoint.resume},
      {"log.every_steps", &c.log.every_steps},
      {"log.tensorboard", &c.log.tensorboard},
      {"eval.every_steps", &c.eval.every_steps},
      {"eval.batches", &c.eval.batches},
  };
}

// Names people bring from Megatron-LM / NeMo / HF Trainer, mapped to ours (for suggestions only).
constexpr std::pair<const char*, const char*> kAliases[] = {
    {"learning_rate", "train.lr"},
    {"max_lr", "train.lr"},
    {"seq_len", "data.seq_length"},
    {"max_seq_len", "data.seq_length"},
    {"max_seq_length", "data.seq_length"},
    {"sequence_length", "data.seq_length"},
    {"encoder_seq_length", "data.seq_length"},
    {"train_iters", "train.max_steps"},
    {"max_iters", "train.max_steps"},
    {"num_epochs", "train.epochs"},
    {"max_epochs", "train.epochs"},
    {"num_train_epochs", "train.epochs"},
    {"warmup", "train.warmup_steps"},
    {"warmup_iters", "train.warmup_steps"},
    {"lr_warmup_iters", "train.warmup_steps"},
    {"clip_grad", "train.grad_clip"},
    {"gradient_clipping", "train.grad_clip"},
    {"max_grad_norm", "train.grad_clip"},
    {"lr_decay_style", "train.schedule"},
    {"lr_scheduler", "train.schedule"},
    {"lr_scheduler_type", "train.schedule"},
    {"recompute_granularity", "train.recompute"},
    {"activations_checkpoint_granularity", "train.recompute"},
    {"gradient_checkpointing", "train.recompute"},
    {"activation_checkpointing", "train.recompute"},
    {"beta1", "train.adam_beta1"},
    {"beta2", "train.adam_beta2"},
    {"eps", "train.adam_eps"},
    {"tensor_model_parallel_size", "parallel.tp"},
    {"pipeline_model_parallel_size", "parallel.pp"},
    {"expert_model_parallel_size", "parallel.ep"},
    {"router_aux_loss_coef", "moe.aux_loss_coef"},
    {"moe_aux_loss_coeff", "moe.aux_loss_coef"},
    {"moe_z_loss_coeff", "moe.z_loss_coef"},
    {"precision", "model.dtype"},
    {"lora_r", "lora.rank"},
    {"lora_alpha", "lora.alpha"},
    {"lora_dropout", "lora.dropout"},
    {"lora_target_modules", "lora.targets"},
    {"target_modules", "lora.targets"},
    {"data_path", "data.path"},
    {"save_interval", "checkpoint.every_steps"},
    {"log_interval", "log.every_steps"},
    {"eval_interval", "eval.every_steps"},
    {"eval_iters", "eval.batches"},
};

std::vector<std::string> split_dots(const std::string& key) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    const size_t dot = key.find('.', start);
    out.push_back(key.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
    if (dot == std::string::npos) return out;
    start = dot + 1;
  }
}

std::string parent_of(const std::string& key) {
  const size_t dot = key.rfind('.');
  return dot == std::string::npos ? std::string() : key.substr(0, dot);
}

std::string leaf_of(const std::string& key) {
  const size_t dot = key.rfind('.');
  return dot == std::string::npos ? key : key.substr(dot + 1);
}

std::string join_key(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

// Optimal string alignment distance (Levenshtein plus adjacent transpositions: "trian" -> "train" is 1).
size_t edit_distance(const std::string& a, const std::string& b) {
  const size_t n = a.size(), m = b.size();
  std::vector<std::vector<size_t>> d(n + 1, std::vector<size_t>(m + 1, 0));
  for (size_t i = 0; i <= n; ++i) d[i][0] = i;
  for (size_t j = 0; j <= m; ++j) d[0][j] = j;
  for (size_t i = 1; i <= n; ++i)
    for (size_t j = 1; j <= m; ++j) {
      const size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[n][m];
}

// ---------------------------------------------------------------------------------------------
// Scalars. yaml-cpp hands out every scalar as text; we resolve types ourselves (YAML 1.2 core
// schema, and both 1e-5 and 1.0e-5 are numbers). Quoted scalars are always strings.

bool is_quoted(const YAML::Node& n) { return n.Tag() == "!" || n.Tag() == "tag:yaml.org,2002:str"; }

std::string_view strip_plus(std::string_view s) {
  if (s.size() > 1 && s[0] == '+' && s[1] != '+' && s[1] != '-') s.remove_prefix(1);
  return s;
}

std::optional<double> parse_double(std::string_view s) {
  s = strip_plus(s);
  double v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || end != s.data() + s.size() || !std::isfinite(v)) return std::nullopt;
  return v;
}

// Integers; an integral float ("1e3", "100.0") also counts, up to 2^53 where doubles are exact.
std::optional<long long> parse_integer(std::string_view s) {
  s = strip_plus(s);
  long long v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (!s.empty() && ec == std::errc() && end == s.data() + s.size()) return v;
  if (const auto d = parse_double(s); d && std::floor(*d) == *d && std::fabs(*d) <= 9007199254740992.0)
    return static_cast<long long>(*d);
  return std::nullopt;
}

std::optional<bool> parse_bool(const std::string& s) {
  if (s == "true" || s == "True" || s == "TRUE") return true;
  if (s == "false" || s == "False" || s == "FALSE") return false;
  return std::nullopt;
}

bool is_null_word(const std::string& s) { return s == "~" || s == "null" || s == "Null" || s == "NULL"; }

std::string describe(const YAML::Node& n) {
  switch (n.Type()) {
    case YAML::NodeType::Null: return "null";
    case YAML::NodeType::Sequence: return "a sequence";
    case YAML::NodeType::Map: return "a mapping";
    case YAML::NodeType::Scalar:
      return is_quoted(n) ? fmt::format("the quoted string \"{}\" (numbers and booleans go unquoted)", n.Scalar())
                          : fmt::format("'{}'", n.Scalar());
    default: return "nothing";
  }
}

// A plain scalar as JSON: bool, integer, float, or string.
json plain_scalar_to_json(const std::string& s) {
  if (is_null_word(s)) return nullptr;
  if (const auto b = parse_bool(s)) return *b;
  {
    const std::string_view v = strip_plus(s);
    long long i = 0;
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), i);
    if (!v.empty() && ec == std::errc() && end == v.data() + v.size()) return i;
    unsigned long long u = 0;
    const auto [uend, uec] = std::from_chars(v.data(), v.data() + v.size(), u);
    if (!v.empty() && uec == std::errc() && uend == v.data() + v.size()) return u;
  }
  if (const auto d = parse_double(s)) return *d;
  return s;
}

// Strings that a YAML reader (ours, or a YAML 1.1 one such as PyYAML) would not read back as the
// same string when written plain.
bool needs_quotes(const std::string& s) {
  if (s.empty() || std::isspace(static_cast<unsigned char>(s.front())) ||
      std::isspace(static_cast<unsigned char>(s.back())))
    return true;
  if (!plain_scalar_to_json(s).is_string()) return true;
  static constexpr const char* kYaml11Words[] = {"y", "Y", "n", "N", "yes", "Yes", "YES", "no", "No", "NO",
                                                 "on", "On", "ON", "off", "Off", "OFF"};
  for (const char* w : kYaml11Words)
    if (s == w) return true;
  return s.front() == '.' || s.front() == '-' || s.front() == '+' || std::isdigit(static_cast<unsigned char>(s.front()));
}

// ---------------------------------------------------------------------------------------------
// Reading.

// Where a value came from: FILE:LINE:COL, or FILE: override 'k=v'.
struct Origin {
  std::string source;
  std::string override_text;  // set for command-line overrides
  std::string at(const YAML::Mark& m) const {
    if (!override_text.empty()) return fmt::format("{}: override '{}'", source, override_text);
    if (m.is_null()) return source;
    return fmt::format("{}:{}:{}", source, m.line + 1, m.column + 1);
  }
};

// Bounds on what one config value may expand to: YAML aliases let a 1 KB file name 10^9 leaves (an
// "alias bomb"), and the copy into JSON would expand every one of them.  No training config is
// anywhere near these.
constexpr long kMaxYamlNodes = 100000;
constexpr int kMaxYamlDepth = 64;

// A scalar's text (a value or a key): UTF-8 without control characters but tab and newline.  The
// file is checked before parsing, but YAML escapes ("\\x01", "\\0") can still make control
// characters, which yaml-cpp writes back as escapes it then misreads ("\\0" before "_" reads as
// the "\\_" escape, a lone byte): config.yaml would not read back as the config it records.
bool is_config_text(const std::string& s) {
  if (!is_valid_utf8(s)) return false;
  for (size_t i = 0; i < s.size(); i++) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if ((c < 0x20 && c != '\t' && c != '\n') || c == 0x7f) return false;
    if (c == 0xC2 && i + 1 < s.size() && static_cast<unsigned char>(s[i + 1]) < 0xA0) return false;  // U+0080..U+009F
  }
  return true;
}

const std::string& utf8_scalar(const YAML::Node& n, const std::string& key, const Origin& o) {
  if (!is_config_text(n.Scalar()))
    fail("{}: {}: the text is not valid UTF-8 or holds control characters (only tab and newline are allowed)",
         o.at(n.Mark()), key);
  return n.Scalar();
}

struct YamlBudget {
  long nodes = 0;
};

json yaml_to_json(const YAML::Node& n, const std::string& key, const Origin& o, YamlBudget& budget, int depth) {
  if (++budget.nodes > kMaxYamlNodes)
    fail("{}: {}: the value expands to more than {} YAML nodes (aliases?); a training config needs far fewer",
         o.at(n.Mark()), key, kMaxYamlNodes);
  if (depth > kMaxYamlDepth) fail("{}: {}: nested deeper than {} levels", o.at(n.Mark()), key, kMaxYamlDepth);
  switch (n.Type()) {
    case YAML::NodeType::Null: return nullptr;
    case YAML::NodeType::Scalar: {
      const std::string& text = utf8_scalar(n, key, o);
      return is_quoted(n) ? json(text) : plain_scalar_to_json(text);
    }
    case YAML::NodeType::Sequence: {
      json a = json::array();
      for (const YAML::Node& item : n) a.push_back(yaml_to_json(item, key, o, budget, depth + 1));
      return a;
    }
    case YAML::NodeType::Map: {
      json obj = json::object();
      for (const auto& kv : n) {
        if (!kv.first.IsScalar()) fail("{}: {}: keys must be names, got {}", o.at(kv.first.Mark()), key, describe(kv.first));
        const std::string name = utf8_scalar(kv.first, key, o);
        if (obj.contains(name)) fail("{}: duplicate key '{}'", o.at(kv.first.Mark()), join_key(key, name));
        obj[name] = yaml_to_json(kv.second, join_key(key, name), o, budget, depth + 1);
      }
      return obj;
    }
    default: return nullptr;
  }
}

json yaml_to_json(const YAML::Node& n, const std::string& key, const Origin& o) {
  YamlBudget budget;
  return yaml_to_json(n, key, o, budget, 0);
}

class Reader {
 public:
  Reader(TrainConfig& cfg, std::string source) : cfg_(cfg), source_(std::move(source)), fields_(fields_of(cfg)) {}

  void apply_document(const YAML::Node& root) {
    const Origin o{source_, {}};
    if (root.IsNull())
      fail("{}: the config is empty; expected a mapping with the sections model, data, train, ...", source_);
    if (!root.IsMap()) fail("{}: expected a mapping at the top level (model:, data:, train:, ...), got {}",
                            o.at(root.Mark()), describe(root));
    apply_map("", root, o);
  }

  void apply_override(const std::string& text) {
    const Origin o{source_, text};
    const size_t eq = text.find('=');
    if (eq == std::string::npos)
      fail("{}: override '{}': expected KEY=VALUE with a dotted key, such as train.lr=3e-4", source_, text);
    const std::string key = text.substr(0, eq);
    bool valid = !key.empty();
    for (const std::string& part : split_dots(key)) {
      valid = valid && !part.empty();
      for (const char ch : part)
        valid = valid && (std::isalnum(static_cast<unsigned char>(ch)) || ch == '_' || ch == '-');
    }
    if (!valid)
      fail("{}: override '{}': '{}' is not a dotted key such as train.lr or model.config.hidden_size", source_,
           text, key);
    YAML::Node value;
    try {
      value = YAML::Load(text.substr(eq + 1));
    } catch (const YAML::Exception& e) {
      fail("{}: override '{}': the value is not valid YAML: {}", source_, text, e.msg);
    }
    apply(key, value, o, YAML::Mark::null_mark());
  }

  std::map<std::string, std::string> origins;  // dotted key -> where its value was set

 private:
  const Field* find_field(const std::string& key) const {
    for (const Field& f : fields_)
      if (key == f.key) return &f;
    return nullptr;
  }

  bool is_section(const std::string& key) const {
    for (const Field& f : fields_)
      if (std::string_view(f.key).starts_with(key + ".")) return true;
    return false;
  }

  // The direct children of a section ("" is the top level): field leaves and sub-section names.
  std::vector<std::string> children(const std::string& section) const {
    std::vector<std::string> out;
    const std::string prefix = section.empty() ? "" : section + ".";
    for (const Field& f : fields_) {
      const std::string_view k(f.key);
      if (!k.starts_with(prefix)) continue;
      std::string rest(k.substr(prefix.size()));
      rest = rest.substr(0, rest.find('.'));
      if (std::find(out.begin(), out.end(), rest) == out.end()) out.push_back(rest);
    }
    return out;
  }

  std::string suggestion(const std::string& key) const {
    const std::string leaf = leaf_of(key);
    // 1. The same name in another section ("train.tp" -> "parallel.tp").
    std::string best;
    size_t best_d = std::numeric_limits<size_t>::max();
    for (const Field& f : fields_)
      if (leaf_of(f.key) == leaf && key != f.key && edit_distance(key, f.key) < best_d) {
        best = f.key;
        best_d = edit_distance(key, f.key);
      }
    if (!best.empty()) return fmt::format(" (did you mean {}?)", best);
    // 2. A name from Megatron / NeMo / HF.
    for (const auto& [from, to] : kAliases)
      if (leaf == from) return fmt::format(" (did you mean {}?)", to);
    // 3. The closest key or section by edit distance, when it is close.
    std::set<std::string> candidates;
    for (const Field& f : fields_)
      for (std::string k = f.key; !k.empty(); k = parent_of(k)) candidates.insert(k);
    for (const std::string& c : candidates)
      if (const size_t d = edit_distance(key, c); d < best_d) {
        best = c;
        best_d = d;
      }
    if (best_d <= std::max<size_t>(2, key.size() / 3)) return fmt::format(" (did you mean {}?)", best);
    // 4. Otherwise the valid keys of the nearest enclosing section.
    std::string section = parent_of(key);
    while (!section.empty() && !is_section(section)) section = parent_of(section);
    std::string list;
    for (const std::string& c : children(section)) list += (list.empty() ? "" : ", ") + c;
    return section.empty() ? fmt::format(" (valid top-level keys: {})", list)
                           : fmt::format(" (valid keys under {}: {})", section, list);
  }

  void apply_map(const std::string& prefix, const YAML::Node& map, const Origin& o) {
    std::set<std::string> seen;
    for (const auto& kv : map) {
      const YAML::Node& k = kv.first;
      if (!k.IsScalar())
        fail("{}: {}: keys must be names, got {}", o.at(k.Mark()), prefix.empty() ? "top level" : prefix, describe(k));
      const std::string key = join_key(prefix, k.Scalar());
      if (!seen.insert(k.Scalar()).second) fail("{}: duplicate key '{}'", o.at(k.Mark()), key);
      apply(key, kv.second, o, k.Mark());
    }
  }

  void apply(const std::string& key, const YAML::Node& value, const Origin& o, const YAML::Mark& key_mark) {
    const std::string at = o.at(value.IsScalar() && !value.Mark().is_null() ? value.Mark() : key_mark);
    if (const Field* f = find_field(key)) {
      set_field(*f, value, o, at);
      origins[key] = at;
      return;
    }
    if (is_section(key)) {
      if (value.IsNull()) return;  // "parallel:" with nothing under it keeps the defaults
      if (!value.IsMap()) {
        std::string list;
        for (const std::string& c : children(key)) list += (list.empty() ? "" : ", ") + c;
        fail("{}: {}: expected a mapping (a section with keys {}), got {}", at, key, list, describe(value));
      }
      apply_map(key, value, o);
      return;
    }
    if (key.starts_with("model.config.")) {  // an override of one HF field: model.config.hidden_size=64
      set_model_config_path(key, value, o, at);
      origins["model.config"] = at;
      return;
    }
    fail("{}: unknown key '{}'{}", o.at(key_mark), key, suggestion(key));
  }

  void set_model_config_path(const std::string& key, const YAML::Node& value, const Origin& o, const std::string& at) {
    const std::vector<std::string> parts = split_dots(key.substr(std::string("model.config.").size()));
    json* node = &cfg_.model.config;
    std::string path = "model.config";
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      path += "." + parts[i];
      json& child = (*node)[parts[i]];
      if (child.is_null()) child = json::object();
      if (!child.is_object()) fail("{}: {}: cannot set {}: {} is {}, not a mapping", at, key, key, path, json_preview(child));
      node = &child;
    }
    (*node)[parts.back()] = yaml_to_json(value, key, o);
  }

  void set_field(const Field& f, const YAML::Node& v, const Origin& o, const std::string& at) {
    const std::string key = f.key;
    auto bad = [&](const char* expected) { fail("{}: {}: expected {}, got {}", at, key, expected, describe(v)); };
    auto number = [&](const char* expected) -> double {
      if (!v.IsScalar() || is_quoted(v)) bad(expected);
      const auto d = parse_double(v.Scalar());
      if (!d) bad(expected);
      return *d;
    };
    auto integer = [&](long long lo, long long hi) -> long long {
      if (!v.IsScalar() || is_quoted(v)) bad("an integer");
      const auto i = parse_integer(v.Scalar());
      if (!i) bad("an integer");
      if (*i < lo || *i > hi) fail("{}: {}: expected an integer in [{}, {}], got '{}'", at, key, lo, hi, v.Scalar());
      return *i;
    };
    std::visit(
        [&](auto* p) {
          using T = std::remove_pointer_t<decltype(p)>;
          if constexpr (std::is_same_v<T, std::string>) {
            if (!v.IsScalar()) bad("a string");
            *p = utf8_scalar(v, key, o);
          } else if constexpr (std::is_same_v<T, int>) {
            *p = static_cast<int>(integer(std::numeric_limits<int>::min(), std::numeric_limits<int>::max()));
          } else if constexpr (std::is_same_v<T, long>) {
            *p = static_cast<long>(integer(std::numeric_limits<long>::min(), std::numeric_limits<long>::max()));
          } else if constexpr (std::is_same_v<T, uint64_t>) {
            if (!v.IsScalar() || is_quoted(v)) bad("a non-negative integer");
            const std::string_view s = strip_plus(v.Scalar());
            unsigned long long u = 0;
            const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), u);
            if (!s.empty() && ec == std::errc() && end == s.data() + s.size()) {
              *p = u;
            } else {
              const auto i = parse_integer(s);
              if (!i || *i < 0) bad("a non-negative integer");
              *p = static_cast<uint64_t>(*i);
            }
          } else if constexpr (std::is_same_v<T, double>) {
            *p = number("a number");
          } else if constexpr (std::is_same_v<T, std::optional<double>>) {
            if (v.IsNull()) *p = std::nullopt;
            else *p = number("a number or null");
          } else if constexpr (std::is_same_v<T, bool>) {
            if (!v.IsScalar() || is_quoted(v)) bad("true or false");
            const auto b = parse_bool(v.Scalar());
            if (!b) bad("true or false");
            *p = *b;
          } else if constexpr (std::is_same_v<T, std::vector<int>>) {
            constexpr const char* expected = "a list of integers, e.g. [3, 5] (or [] / null)";
            if (v.IsNull()) {
              p->clear();
            } else {
              if (!v.IsSequence()) bad(expected);
              std::vector<int> out;
              for (const YAML::Node& e : v) {
                if (!e.IsScalar() || is_quoted(e)) bad(expected);
                const auto i = parse_integer(e.Scalar());
                if (!i || *i < std::numeric_limits<int>::min() || *i > std::numeric_limits<int>::max()) bad(expected);
                out.push_back((int)*i);
              }
              *p = std::move(out);
            }
          } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
            constexpr const char* expected = "a list of names, e.g. [q_proj, experts]";
            if (!v.IsSequence()) bad(expected);
            std::vector<std::string> out;
            for (const YAML::Node& e : v) {
              if (!e.IsScalar()) bad(expected);
              out.push_back(utf8_scalar(e, key, o));
            }
            *p = std::move(out);
          } else if constexpr (std::is_same_v<T, json>) {
            if (v.IsNull()) *p = json::object();
            else if (v.IsMap()) *p = yaml_to_json(v, key, o);
            else bad("a mapping of HF config.json fields (hidden_size: 64, ...)");
          }
        },
        f.ref);
  }

  TrainConfig& cfg_;
  std::string source_;
  std::vector<Field> fields_;
};

// ---------------------------------------------------------------------------------------------
// Validation.

void validate(const TrainConfig& c, const std::string& source, const std::map<std::string, std::string>& origins) {
  auto at = [&](const std::string& key) {
    const auto it = origins.find(key);
    return it == origins.end() ? source : it->second;
  };
  auto one_of = [&](const std::string& key, const std::string& value, std::initializer_list<const char*> choices) {
    std::string list;
    for (const char* ch : choices) {
      if (value == ch) return;
      list += (list.empty() ? "" : " | ") + std::string(ch);
    }
    fail("{}: {}: expected one of {}, got '{}'", at(key), key, list, value);
  };
  auto positive = [&](const std::string& key, long long v) {
    if (v <= 0) fail("{}: {}: must be a positive integer, got {}", at(key), key, v);
  };
  auto non_empty = [&](const std::string& key, const std::string& v, const char* what) {
    if (v.empty()) fail("{}: {}: must not be empty ({})", at(key), key, what);
  };
  auto at_least = [&](const std::string& key, double v, double lo, const char* why) {
    if (!(v >= lo)) fail("{}: {}: must be >= {}{}, got {}", at(key), key, lo, why, v);
  };
  auto beta = [&](const std::string& key, double v) {
    if (!(v >= 0.0 && v < 1.0)) fail("{}: {}: must be in [0, 1), got {}", at(key), key, v);
  };

  non_empty("run_dir", c.run_dir, "the directory for metrics, checkpoints and config.yaml");
  one_of("device", c.device, {"cpu", "cuda"});
  one_of("parallel.device_comm", c.parallel.device_comm, {"auto", "staged", "nccl"});

  non_empty("model.init", c.model.init, "'random' or the path of an HF model directory");
  one_of("model.dtype", c.model.dtype, {"fp32", "bf16"});
  if (!c.model.config.is_object())
    fail("{}: model.config: expected a mapping of HF config.json fields, got {}", at("model.config"), json_preview(c.model.config));
  if (c.model.init == "random" && c.model.config.empty())
    fail("{}: model.config: is empty, but model.init is 'random': give the HF config.json fields of the model "
         "(architectures, vocab_size, hidden_size, num_hidden_layers, ...)",
         at("model.config"));
  if (c.model.init != "random" && !c.model.config.empty())
    fail("{}: model.config: must be empty when model.init is a directory ('{}'): the directory's config.json "
         "defines the model",
         at("model.config"), c.model.init);

  non_empty("data.path", c.data.path, "a directory written by `moetron data prepare`");
  positive("data.seq_length", c.data.seq_length);
  one_of("data.over_long", c.data.over_long, {"split", "drop"});

  positive("train.global_batch_size", c.train.global_batch_size);
  positive("train.micro_batch_size", c.train.micro_batch_size);
  if (c.train.global_batch_size % c.train.micro_batch_size != 0)
    fail("{}: train.global_batch_size ({}) must be divisible by train.micro_batch_size ({})",
         at("train.global_batch_size"), c.train.global_batch_size, c.train.micro_batch_size);
  if (c.train.max_steps < 0) fail("{}: train.max_steps: must be >= 0, got {}", at("train.max_steps"), c.train.max_steps);
  // Bounded: the step count is epochs x steps per epoch, cast to an integer (1e300 epochs wrapped to
  // "the run has no steps").
  if (!(c.train.epochs >= 0 && c.train.epochs <= kMaxEpochs))
    fail("{}: train.epochs: must be in [0, {}], got {}", at("train.epochs"), kMaxEpochs, c.train.epochs);
  if ((c.train.max_steps > 0) == (c.train.epochs > 0))
    fail("{}: train: set exactly one of max_steps > 0 or epochs > 0 (got max_steps {}, epochs {})",
         at(c.train.max_steps > 0 ? "train.epochs" : "train.max_steps"), c.train.max_steps, c.train.epochs);
  at_least("train.min_lr", c.train.min_lr, 0.0, "");
  if (!(c.train.lr >= c.train.min_lr))
    fail("{}: train.lr ({}) must be >= train.min_lr ({})", at("train.lr"), c.train.lr, c.train.min_lr);
  if (c.train.warmup_steps < 0)
    fail("{}: train.warmup_steps: must be >= 0, got {}", at("train.warmup_steps"), c.train.warmup_steps);
  one_of("train.schedule", c.train.schedule, {"cosine", "linear", "constant"});
  one_of("train.recompute", c.train.recompute, {"none", "full", "selective"});
  at_least("train.weight_decay", c.train.weight_decay, 0.0, "");
  beta("train.adam_beta1", c.train.adam_beta1);
  beta("train.adam_beta2", c.train.adam_beta2);
  if (!(c.train.adam_eps > 0)) fail("{}: train.adam_eps: must be > 0, got {}", at("train.adam_eps"), c.train.adam_eps);
  at_least("train.grad_clip", c.train.grad_clip, 0.0, " (0: no clipping)");
  positive("train.nan_skip_limit", c.train.nan_skip_limit);
  if (c.train.exit_interval < 0)
    fail("{}: train.exit_interval: must be >= 0 (0: never), got {}", at("train.exit_interval"), c.train.exit_interval);

  if (c.moe.aux_loss_coef) at_least("moe.aux_loss_coef", *c.moe.aux_loss_coef, 0.0, " (or null: the model's)");
  one_of("moe.aux_loss", c.moe.aux_loss, {"hf_pooled", "per_layer", "sequence"});
  if (c.lora.rank < 0 || c.lora.rank > 65536)
    fail("{}: lora.rank: must be in [0, 65536] (0: no LoRA, the whole model trains), got {}", at("lora.rank"),
         c.lora.rank);
  if (c.lora.rank > 0) {
    if (!(c.lora.alpha > 0 && std::isfinite(c.lora.alpha)))
      fail("{}: lora.alpha: must be > 0, got {}", at("lora.alpha"), c.lora.alpha);
    if (c.lora.dropout != 0.0)
      fail("{}: lora.dropout: only 0 is implemented (PEFT refuses dropout on fused experts too), got {}",
           at("lora.dropout"), c.lora.dropout);
    if (c.lora.targets.empty()) fail("{}: lora.targets: empty (e.g. [attention, experts])", at("lora.targets"));
  }
  at_least("moe.z_loss_coef", c.moe.z_loss_coef, 0.0, "");
  if (!(c.moe.bias_update_rate >= 0 && c.moe.bias_update_rate <= 1))
    fail("{}: moe.bias_update_rate: must be in [0, 1] (0: off; DeepSeek-V3 used 1e-3), got {}",
         at("moe.bias_update_rate"), c.moe.bias_update_rate);
  // Bounded: the capacity ceil(f * tokens * K / E) is cast to an integer; at f >= E / K (E <= 4096) no
  // token is ever dropped, so a larger factor means nothing more.
  if (c.moe.capacity_factor && !(*c.moe.capacity_factor > 0 && *c.moe.capacity_factor <= kMaxCapacityFactor))
    fail("{}: moe.capacity_factor: must be in (0, {}] (or null: dropless), got {}", at("moe.capacity_factor"),
         kMaxCapacityFactor, *c.moe.capacity_factor);

  positive("parallel.tp", c.parallel.tp);
  positive("parallel.pp", c.parallel.pp);
  positive("parallel.ep", c.parallel.ep);
  for (size_t i = 0; i < c.parallel.layers_per_stage.size(); i++)
    if (c.parallel.layers_per_stage[i] < 1)
      fail("{}: parallel.layers_per_stage: entry {} (stage {}) must be >= 1, got {}", at("parallel.layers_per_stage"),
           i, i, c.parallel.layers_per_stage[i]);

  if (c.checkpoint.every_steps < 0)
    fail("{}: checkpoint.every_steps: must be >= 0 (0: only at the end), got {}", at("checkpoint.every_steps"),
         c.checkpoint.every_steps);
  positive("checkpoint.keep_last", c.checkpoint.keep_last);
  non_empty("checkpoint.resume", c.checkpoint.resume, "auto | none | the path of a checkpoint");

  positive("log.every_steps", c.log.every_steps);
  if (c.eval.every_steps < 0)
    fail("{}: eval.every_steps: must be >= 0 (0: no evaluation), got {}", at("eval.every_steps"), c.eval.every_steps);
  positive("eval.batches", c.eval.batches);
}

// ---------------------------------------------------------------------------------------------
// Writing.

// Shortest text that reads back to the same double, always with '.' or 'e' so it reads as a float.
std::string format_double(double v) {
  std::string s = fmt::format("{}", v);
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

void emit_string(YAML::Emitter& em, const std::string& s) {
  if (needs_quotes(s)) em << YAML::DoubleQuoted;
  em << s;
}

void emit_json(YAML::Emitter& em, const json& j) {
  switch (j.type()) {
    case json::value_t::object:
      if (j.empty()) {
        em << YAML::Flow << YAML::BeginMap << YAML::EndMap;
        break;
      }
      em << YAML::BeginMap;
      for (const auto& [k, v] : j.items()) {
        em << YAML::Key;
        emit_string(em, k);
        em << YAML::Value;
        emit_json(em, v);
      }
      em << YAML::EndMap;
      break;
    case json::value_t::array:
      em << YAML::Flow << YAML::BeginSeq;
      for (const json& v : j) emit_json(em, v);
      em << YAML::EndSeq;
      break;
    case json::value_t::string: emit_string(em, j.get<std::string>()); break;
    case json::value_t::boolean: em << (j.get<bool>() ? "true" : "false"); break;
    case json::value_t::number_integer: em << j.get<long long>(); break;
    case json::value_t::number_unsigned: em << j.get<unsigned long long>(); break;
    case json::value_t::number_float: em << format_double(j.get<double>()); break;
    default: em << YAML::Null; break;
  }
}

void emit_field(YAML::Emitter& em, const FieldRef& ref) {
  std::visit(
      [&](auto* p) {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, std::string>) {
          emit_string(em, *p);
        } else if constexpr (std::is_same_v<T, double>) {
          em << format_double(*p);
        } else if constexpr (std::is_same_v<T, std::optional<double>>) {
          if (*p) em << format_double(**p);
          else em << YAML::Null;
        } else if constexpr (std::is_same_v<T, bool>) {
          em << (*p ? "true" : "false");
        } else if constexpr (std::is_same_v<T, json>) {
          emit_json(em, *p);
        } else if constexpr (std::is_same_v<T, std::vector<int>>) {
          em << YAML::Flow << YAML::BeginSeq;
          for (int x : *p) em << x;
          em << YAML::EndSeq;
        } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
          em << YAML::Flow << YAML::BeginSeq;
          for (const std::string& x : *p) emit_string(em, x);
          em << YAML::EndSeq;
        } else {
          em << *p;  // integers
        }
      },
      ref);
}

json field_to_json(const FieldRef& ref) {
  return std::visit(
      [](auto* p) -> json {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, std::optional<double>>) return *p ? json(**p) : json(nullptr);
        else return json(*p);
      },
      ref);
}

}  // namespace

TrainConfig train_config_from_yaml_text(const std::string& yaml, const std::string& source,
                                        const std::vector<std::string>& overrides) {
  // YAML is UTF-8 text; other bytes would come back altered when config.yaml is written and read again.
  size_t line = 1;
  for (size_t at = 0; at <= yaml.size();) {
    const size_t nl = std::min(yaml.find('\n', at), yaml.size());
    if (!is_valid_utf8(std::string_view(yaml).substr(at, nl - at)))
      fail("{}:{}: not valid UTF-8 (a training config is UTF-8 text)", source, line);
    at = nl + 1;
    line++;
  }
  for (const std::string& o : overrides)
    if (!is_valid_utf8(o)) fail("{}: override '{}' is not valid UTF-8", source, o);
  YAML::Node root;
  try {
    root = YAML::Load(yaml);
  } catch (const YAML::Exception& e) {
    if (e.mark.is_null()) fail("{}: YAML syntax error: {}", source, e.msg);
    fail("{}:{}:{}: YAML syntax error: {}", source, e.mark.line + 1, e.mark.column + 1, e.msg);
  }
  TrainConfig cfg;
  Reader reader(cfg, source);
  reader.apply_document(root);
  for (const std::string& o : overrides) reader.apply_override(o);
  validate(cfg, source, reader.origins);
  return cfg;
}

TrainConfig load_train_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open the training config", path);
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) fail("{}: error while reading the training config", path);
  return train_config_from_yaml_text(text.str(), path, overrides);
}

void validate_train_config(const TrainConfig& cfg, const std::string& source) { validate(cfg, source, {}); }

std::string train_config_to_yaml(const TrainConfig& cfg) {
  TrainConfig c = cfg;
  YAML::Emitter em;
  em.SetNullFormat(YAML::LowerNull);
  em << YAML::BeginMap;
  std::vector<std::string> open;  // the sections currently open, outermost first
  for (const Field& f : fields_of(c)) {
    const std::vector<std::string> parts = split_dots(f.key);
    size_t common = 0;
    while (common < open.size() && common + 1 < parts.size() && open[common] == parts[common]) ++common;
    while (open.size() > common) {
      em << YAML::EndMap;
      open.pop_back();
    }
    while (open.size() + 1 < parts.size()) {
      const std::string& name = parts[open.size()];
      em << YAML::Key << name << YAML::Value << YAML::BeginMap;
      open.push_back(name);
    }
    em << YAML::Key << parts.back() << YAML::Value;
    emit_field(em, f.ref);
  }
  while (!open.empty()) {
    em << YAML::EndMap;
    open.pop_back();
  }
  em << YAML::EndMap;
  if (!em.good()) fail("train_config_to_yaml: YAML emitter error: {}", em.GetLastError());
  return "# moetron training config, resolved: every key, defaults and overrides applied.\n" +
         std::string(em.c_str()) + "\n";
}

json train_config_to_json(const TrainConfig& cfg) {
  TrainConfig c = cfg;
  json j = json::object();
  for (const Field& f : fields_of(c)) {
    std::string pointer(1, '/');
    pointer += f.key;
    std::replace(pointer.begin(), pointer.end(), '.', '/');
    j[json::json_pointer(pointer)] = field_to_json(f.ref);
  }
  return j;
}

std::vector<std::string> train_config_keys() {
  TrainConfig c;
  std::vector<std::string> keys;
  for (const Field& f : fields_of(c)) keys.emplace_back(f.key);
  return keys;
}

}  // namespace moetron
