#include "io/hf_config.h"
#include "core/json_limits.h"

#include <climits>
#include <algorithm>
#include <cmath>
#include <fstream>
#include <set>
#include <sstream>

#include "core/error.h"

namespace moetron {

namespace {

using nlohmann::json;

struct ArchInfo {
  const char* architecture;
  const char* model_type;
  bool moe;
  // transformers' defaults for fields a config.json may omit.
  double rms_norm_eps;
  double rope_theta;
  int max_position_embeddings;
  int sliding_window;  // 0: None
  double router_aux_loss_coef;
  bool has_sliding_window;  // LlamaForCausalLM has no sliding window attention
};

constexpr ArchInfo kArchs[] = {
    {"MixtralForCausalLM", "mixtral", true, 1e-5, 1e6, 4096 * 32, 0, 0.001, true},
    {"MistralForCausalLM", "mistral", false, 1e-6, 1e4, 4096 * 32, 4096, 0.0, true},
    {"LlamaForCausalLM", "llama", false, 1e-6, 1e4, 2048, 0, 0.0, false},
};

const ArchInfo* arch_by_name(const std::string& architecture) {
  for (const ArchInfo& a : kArchs)
    if (architecture == a.architecture) return &a;
  return nullptr;
}

const ArchInfo* arch_by_model_type(const std::string& model_type) {
  for (const ArchInfo& a : kArchs)
    if (model_type == a.model_type) return &a;
  return nullptr;
}

// Field readers: each consumes the key (records it in `used`) and checks its JSON type.
class Fields {
 public:
  Fields(const json& j, const std::string& source) : j_(j), source_(source) {}

  // Present and not null.
  const json* get(const char* key) {
    used_.insert(key);
    auto it = j_.find(key);
    if (it == j_.end() || it->is_null()) return nullptr;
    return &*it;
  }
  bool has(const char* key) const { return j_.contains(key); }

  int to_int(const char* key, const json& v) const {
    if (!v.is_number_integer())
      fail("{}: field '{}' must be an integer, got {} {}", source_, key, v.type_name(), json_preview(v));
    if (v.is_number_unsigned() ? v.get<uint64_t>() > static_cast<uint64_t>(INT_MAX)
                               : (v.get<int64_t>() > INT_MAX || v.get<int64_t>() < INT_MIN))
      fail("{}: field '{}' value {} is out of range", source_, key, json_preview(v));
    return v.get<int>();
  }
  int required_int(const char* key) {
    const json* v = get(key);
    if (v == nullptr) {
      if (has(key)) fail("{}: field '{}' must be an integer, got null", source_, key);
      fail("{}: missing required field '{}'", source_, key);
    }
    return to_int(key, *v);
  }
  int optional_int(const char* key, int fallback) {
    const json* v = get(key);
    return v == nullptr ? fallback : to_int(key, *v);
  }
  double optional_double(const char* key, double fallback) {
    const json* v = get(key);
    if (v == nullptr) return fallback;
    if (!v->is_number())
      fail("{}: field '{}' must be a number, got {} {}", source_, key, v->type_name(), v->dump());
    return v->get<double>();
  }
  bool optional_bool(const char* key, bool fallback) {
    const json* v = get(key);
    if (v == nullptr) return fallback;
    if (!v->is_boolean())
      fail("{}: field '{}' must be true or false, got {} {}", source_, key, v->type_name(),
           v->dump());
    return v->get<bool>();
  }
  std::string optional_string(const char* key, const std::string& fallback) {
    const json* v = get(key);
    if (v == nullptr) return fallback;
    if (!v->is_string())
      fail("{}: field '{}' must be a string, got {} {}", source_, key, v->type_name(), v->dump());
    return v->get<std::string>();
  }

  json leftovers() const {
    json extra = json::object();
    for (const auto& [k, v] : j_.items())
      if (used_.count(k) == 0) extra[k] = v;
    return extra;
  }

 private:
  const json& j_;
  const std::string& source_;
  std::set<std::string> used_;
};

void check_positive(const std::string& source, const char* field, int value) {
  if (value <= 0) fail("{}: field '{}' must be positive, got {}", source, field, value);
}

// Bounds on the sizes a config.json may ask for, checked before anything is allocated from them:
// far above any released model (the largest have ~256 experts, ~128 layers, ~256K vocabulary), far
// below what would overflow the products the model computes in 64 bits (a tensor's element count,
// the parameter total) or in 32 (a row width such as heads x head_dim).
void check_sizes(const ModelConfig& c, const std::string& source) {
  struct Bound {
    const char* field;
    int64_t value, max;
  };
  const Bound bounds[] = {
      {"vocab_size", c.vocab_size, 1 << 24},          {"hidden_size", c.hidden_size, 1 << 20},
      {"intermediate_size", c.intermediate_size, 1 << 22}, {"num_hidden_layers", c.num_hidden_layers, 4096},
      {"num_attention_heads", c.num_attention_heads, 1 << 12}, {"num_key_value_heads", c.num_key_value_heads, 1 << 12},
      {"head_dim", c.head_dim, 1 << 14},              {"num_local_experts", c.num_local_experts, 1 << 12},
  };
  for (const Bound& b : bounds)
    if (b.value > b.max)
      fail("{}: field '{}' = {} is beyond what moetron supports ({} at most)", source, b.field, b.value, b.max);
  if ((int64_t)c.num_attention_heads * c.head_dim > (1 << 20))
    fail("{}: fields 'num_attention_heads' x 'head_dim' = {} x {} exceed {} (the attention width)", source,
         c.num_attention_heads, c.head_dim, 1 << 20);
  // The parameter total, in double (no overflow): at most 2^44 (17.6 trillion).
  const double C = c.hidden_size, Q = (double)c.num_attention_heads * c.head_dim,
               KV = (double)c.num_key_value_heads * c.head_dim, E = std::max(c.num_local_experts, 1);
  const double per_layer = C * Q * 2 + C * KV * 2 + E * 3.0 * c.intermediate_size * C + E * C + 2 * C;
  const double total = per_layer * c.num_hidden_layers + 2.0 * c.vocab_size * C + C;
  if (total > (double)kMaxModelParameters)
    fail("{}: the sizes imply {:.3g} parameters (hidden_size {}, num_hidden_layers {}, num_local_experts {}, "
         "intermediate_size {}, vocab_size {}), beyond the 1.76e13 moetron supports",
         source, total, c.hidden_size, c.num_hidden_layers, c.num_local_experts, c.intermediate_size, c.vocab_size);
}

void check_positive_finite(const std::string& source, const char* field, double value) {
  if (!(value > 0.0) || !std::isfinite(value))
    fail("{}: field '{}' must be a positive finite number, got {}", source, field, value);
}

}  // namespace

ModelConfig model_config_from_json(const json& j, const std::string& source) {
  if (!j.is_object()) fail("{}: config must be a JSON object, got {}", source, j.type_name());
  Fields f(j, source);
  ModelConfig c;

  // Architecture and model type.
  if (const json* a = f.get("architectures")) {
    if (!a->is_array() || a->empty() || !(*a)[0].is_string())
      fail("{}: field 'architectures' must be a non-empty list of strings, got {}", source,
           a->dump());
    if (a->size() > 1)
      fail("{}: field 'architectures' lists {} architectures, expected one: {}", source, a->size(),
           a->dump());
    c.architecture = (*a)[0].get<std::string>();
  }
  c.model_type = f.optional_string("model_type", "");
  const ArchInfo* arch = nullptr;
  if (!c.architecture.empty()) {
    arch = arch_by_name(c.architecture);
    if (arch == nullptr)
      fail("{}: field 'architectures': unsupported architecture '{}' (expected MixtralForCausalLM, "
           "MistralForCausalLM or LlamaForCausalLM)",
           source, c.architecture);
  } else if (!c.model_type.empty()) {
    arch = arch_by_model_type(c.model_type);
    if (arch == nullptr)
      fail("{}: field 'model_type': unsupported model type '{}' (expected mixtral, mistral or "
           "llama)",
           source, c.model_type);
    c.architecture = arch->architecture;
  } else {
    fail("{}: missing required field 'architectures' (or 'model_type')", source);
  }
  if (c.model_type.empty()) c.model_type = arch->model_type;
  if (c.model_type != arch->model_type)
    fail("{}: field 'model_type' is '{}' but architecture {} needs '{}'", source, c.model_type,
         c.architecture, arch->model_type);

  // Sizes.
  c.vocab_size = f.required_int("vocab_size");
  c.hidden_size = f.required_int("hidden_size");
  c.intermediate_size = f.required_int("intermediate_size");
  c.num_hidden_layers = f.required_int("num_hidden_layers");
  c.num_attention_heads = f.required_int("num_attention_heads");
  check_positive(source, "hidden_size", c.hidden_size);
  check_positive(source, "num_attention_heads", c.num_attention_heads);
  c.num_key_value_heads = f.optional_int("num_key_value_heads", c.num_attention_heads);
  if (f.get("head_dim") != nullptr) {
    c.head_dim = f.optional_int("head_dim", 0);
  } else {
    if (c.hidden_size % c.num_attention_heads != 0)
      fail("{}: field 'head_dim' is absent and hidden_size {} is not divisible by "
           "num_attention_heads {}",
           source, c.hidden_size, c.num_attention_heads);
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  if (arch->moe) {
    c.num_local_experts = f.required_int("num_local_experts");
    c.num_experts_per_tok = f.required_int("num_experts_per_tok");
    c.router_aux_loss_coef = f.optional_double("router_aux_loss_coef", arch->router_aux_loss_coef);
  }

  // Numerics.
  c.rms_norm_eps = f.optional_double("rms_norm_eps", arch->rms_norm_eps);
  c.max_position_embeddings =
      f.optional_int("max_position_embeddings", arch->max_position_embeddings);
  c.initializer_range = f.optional_double("initializer_range", 0.02);
  if (arch->has_sliding_window) {
    c.sliding_window = f.has("sliding_window") ? f.optional_int("sliding_window", 0)
                                               : arch->sliding_window;
  }

  // RoPE: top-level rope_theta (transformers 4) or rope_parameters (transformers 5).
  if (const json* rs = f.get("rope_scaling"))
    fail("{}: field 'rope_scaling' is not supported (got {}); only plain RoPE with rope_theta is",
         source, rs->dump());
  const bool has_top_theta = f.get("rope_theta") != nullptr;
  const double top_theta = f.optional_double("rope_theta", arch->rope_theta);
  c.rope_theta = top_theta;
  if (const json* rp = f.get("rope_parameters")) {
    if (!rp->is_object())
      fail("{}: field 'rope_parameters' must be an object, got {}", source, rp->dump());
    bool has_theta = false;
    for (const auto& [k, v] : rp->items()) {
      if (k == "rope_type" || k == "type") {
        if (!v.is_string() || v.get<std::string>() != "default")
          fail("{}: field 'rope_parameters.{}' = {} is not supported; only \"default\" is", source,
               k, json_preview(v));
      } else if (k == "rope_theta") {
        if (!v.is_number())
          fail("{}: field 'rope_parameters.rope_theta' must be a number, got {}", source, json_preview(v));
        c.rope_theta = v.get<double>();
        has_theta = true;
      } else {
        fail("{}: field 'rope_parameters.{}' is not supported (only rope_type \"default\" and "
             "rope_theta are)",
             source, k);
      }
    }
    if (has_theta && has_top_theta && c.rope_theta != top_theta)
      fail("{}: field 'rope_theta' {} disagrees with 'rope_parameters.rope_theta' {}", source,
           top_theta, c.rope_theta);
  }

  // Flags and ids.
  c.tie_word_embeddings = f.optional_bool("tie_word_embeddings", false);
  c.hidden_act = f.optional_string("hidden_act", "silu");
  for (const char* key : {"attention_bias", "mlp_bias"}) {
    auto it = j.find(key);  // validated here, kept in `extra`
    if (it != j.end() && !it->is_null()) {
      if (!it->is_boolean())
        fail("{}: field '{}' must be true or false, got {}", source, key, it->dump());
      if (it->get<bool>()) fail("{}: field '{}' = true is not supported (no biases)", source, key);
    }
  }
  auto token_id = [&](const char* key, const json& v) {
    const int id = f.to_int(key, v);
    if (id < 0) fail("{}: field '{}' must be non-negative, got {}", source, key, id);
    return id;
  };
  if (const json* v = f.get("bos_token_id")) c.bos_token_id = token_id("bos_token_id", *v);
  if (const json* v = f.get("pad_token_id")) c.pad_token_id = token_id("pad_token_id", *v);
  if (const json* v = f.get("eos_token_id")) {
    if (v->is_array()) {
      if (v->empty()) fail("{}: field 'eos_token_id' is an empty list", source);
      for (const json& e : *v) c.eos_token_ids.push_back(token_id("eos_token_id", e));
    } else {
      c.eos_token_ids.push_back(token_id("eos_token_id", *v));
    }
    c.eos_token_id = c.eos_token_ids[0];
  }
  const std::string td = f.optional_string("torch_dtype", "");
  const std::string d = f.optional_string("dtype", "");
  if (!td.empty() && !d.empty() && td != d)
    fail("{}: fields 'torch_dtype' ({}) and 'dtype' ({}) disagree", source, td, d);
  c.torch_dtype = td.empty() ? d : td;
  if (!c.torch_dtype.empty() && c.torch_dtype != "float32" && c.torch_dtype != "bfloat16" &&
      c.torch_dtype != "float16")
    fail("{}: field 'torch_dtype' = '{}' is not supported (expected float32, bfloat16 or float16)",
         source, c.torch_dtype);

  c.extra = f.leftovers();
  validate_model_config(c, source);
  return c;
}

ModelConfig load_model_config(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open model config", path);
  std::stringstream ss;
  ss << in.rdbuf();
  return model_config_from_json(parse_json(ss.str(), path), path);
}

json model_config_to_json(const ModelConfig& c) {
  json j = c.extra.is_object() ? c.extra : json::object();
  const ArchInfo* arch = arch_by_name(c.architecture);
  j["architectures"] = json::array({c.architecture});
  j["model_type"] = c.model_type;
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.head_dim;
  if (c.is_moe() || (arch != nullptr && arch->moe)) {
    j["num_local_experts"] = c.num_local_experts;
    j["num_experts_per_tok"] = c.num_experts_per_tok;
    j["router_aux_loss_coef"] = c.router_aux_loss_coef;
  }
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["rope_theta"] = c.rope_theta;
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", c.rope_theta}};
  if (arch == nullptr || arch->has_sliding_window)
    j["sliding_window"] = c.sliding_window > 0 ? json(c.sliding_window) : json(nullptr);
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["initializer_range"] = c.initializer_range;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["hidden_act"] = c.hidden_act;
  auto id = [](int v) { return v >= 0 ? json(v) : json(nullptr); };
  j["bos_token_id"] = id(c.bos_token_id);
  j["pad_token_id"] = id(c.pad_token_id);
  if (c.eos_token_ids.size() > 1)
    j["eos_token_id"] = c.eos_token_ids;
  else
    j["eos_token_id"] = id(c.eos_token_id);
  if (!c.torch_dtype.empty()) j["torch_dtype"] = c.torch_dtype;
  return j;
}

void validate_model_config(const ModelConfig& c, const std::string& source) {
  const ArchInfo* arch = arch_by_name(c.architecture);
  if (arch == nullptr)
    fail("{}: field 'architectures': unsupported architecture '{}' (expected MixtralForCausalLM, "
         "MistralForCausalLM or LlamaForCausalLM)",
         source, c.architecture);
  if (c.model_type != arch->model_type)
    fail("{}: field 'model_type' is '{}' but architecture {} needs '{}'", source, c.model_type,
         c.architecture, arch->model_type);
  check_positive(source, "vocab_size", c.vocab_size);
  check_positive(source, "hidden_size", c.hidden_size);
  check_positive(source, "intermediate_size", c.intermediate_size);
  check_positive(source, "num_hidden_layers", c.num_hidden_layers);
  check_positive(source, "num_attention_heads", c.num_attention_heads);
  check_positive(source, "num_key_value_heads", c.num_key_value_heads);
  check_positive(source, "head_dim", c.head_dim);
  check_positive(source, "max_position_embeddings", c.max_position_embeddings);
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    fail("{}: field 'num_key_value_heads' ({}) must divide num_attention_heads ({})", source,
         c.num_key_value_heads, c.num_attention_heads);
  if (arch->moe) {
    check_positive(source, "num_local_experts", c.num_local_experts);
    if (c.num_experts_per_tok < 1 || c.num_experts_per_tok > c.num_local_experts)
      fail("{}: field 'num_experts_per_tok' must be in [1, num_local_experts = {}], got {}", source,
           c.num_local_experts, c.num_experts_per_tok);
    if (!(c.router_aux_loss_coef >= 0.0) || !std::isfinite(c.router_aux_loss_coef))
      fail("{}: field 'router_aux_loss_coef' must be a finite number >= 0, got {}", source,
           c.router_aux_loss_coef);
  } else if (c.num_local_experts != 0 || c.num_experts_per_tok != 0) {
    fail("{}: dense architecture {} must have num_local_experts = num_experts_per_tok = 0 (got {} "
         "and {})",
         source, c.architecture, c.num_local_experts, c.num_experts_per_tok);
  }
  check_sizes(c, source);
  check_positive_finite(source, "rms_norm_eps", c.rms_norm_eps);
  check_positive_finite(source, "rope_theta", c.rope_theta);
  if (c.sliding_window < 0)
    fail("{}: field 'sliding_window' must be null or positive, got {}", source, c.sliding_window);
  if (!(c.initializer_range >= 0.0) || !std::isfinite(c.initializer_range))
    fail("{}: field 'initializer_range' must be a finite number >= 0, got {}", source,
         c.initializer_range);
  if (c.tie_word_embeddings)
    fail("{}: field 'tie_word_embeddings' = true is not supported yet (moetron needs an untied "
         "lm_head)",
         source);
  if (c.hidden_act != "silu")
    fail("{}: field 'hidden_act' = '{}' is not supported (expected \"silu\")", source,
         c.hidden_act);
}

}  // namespace moetron
