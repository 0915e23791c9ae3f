#include "io/hf_config.h"
#include "core/json_limits.h"

#include <climits>
#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
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
  // The Qwen family: `use_sliding_window`, and (MoE) num_experts, moe_intermediate_size,
  // decoder_sparse_step, mlp_only_layers, norm_topk_prob.
  bool qwen = false;
  int default_head_dim = 0;  // when head_dim is absent; 0: hidden_size / num_attention_heads
  bool qk_norm = false;      // Qwen3: per-head q/k RMSNorm
  bool qwen2_moe = false;    // q/k/v biases (qkv_bias, default true) and a gated shared expert
  bool olmoe = false;        // num_experts, norm_topk_prob, clip_qkv; q/k norms over all heads
  // DeepSeek-V3 / GLM-4.5: n_routed_experts, sigmoid grouped routing with the selection bias,
  // n_shared_experts, first_k_dense_replace (hf_config.h); DeepSeek adds latent attention and YaRN,
  // GLM partial RoPE, use_qk_norm and attention_bias (q/k/v biases).
  bool deepseek = false;
  bool glm = false;
  const char* model_type_alias = nullptr;  // also accepted (Kimi-K2's config says kimi_k2)
};

constexpr ArchInfo kArchs[] = {
    {"MixtralForCausalLM", "mixtral", true, 1e-5, 1e6, 4096 * 32, 0, 0.001, true},
    {"MistralForCausalLM", "mistral", false, 1e-6, 1e4, 4096 * 32, 4096, 0.0, true},
    {"LlamaForCausalLM", "llama", false, 1e-6, 1e4, 2048, 0, 0.0, false},
    {"Qwen3MoeForCausalLM", "qwen3_moe", true, 1e-6, 1e4, 32768, 0, 0.001, false, true, 0, true, false},
    {"Qwen2MoeForCausalLM", "qwen2_moe", true, 1e-6, 1e4, 32768, 0, 0.001, false, true, 0, false, true},
    {"Qwen3ForCausalLM", "qwen3", false, 1e-6, 1e4, 32768, 0, 0.0, false, true, 128, true, false},
    {"OlmoeForCausalLM", "olmoe", true, 1e-5, 1e4, 4096, 0, 0.01, false, false, 0, true, false, true},
    {"DeepseekV3ForCausalLM", "deepseek_v3", true, 1e-6, 1e4, 4096, 0, 0.0, false, false, 0, false, false, false,
     true, false, "kimi_k2"},
    {"Glm4MoeForCausalLM", "glm4_moe", true, 1e-5, 1e4, 131072, 0, 0.0, false, false, 0, false, false, false, false,
     true},
};
constexpr const char* kArchList =
    "MixtralForCausalLM, Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, OlmoeForCausalLM, DeepseekV3ForCausalLM, "
    "Glm4MoeForCausalLM, MistralForCausalLM, LlamaForCausalLM or Qwen3ForCausalLM";
constexpr const char* kModelTypeList =
    "mixtral, qwen3_moe, qwen2_moe, olmoe, deepseek_v3, kimi_k2, glm4_moe, mistral, llama or qwen3";

bool model_type_fits(const ArchInfo& a, const std::string& model_type) {
  return model_type == a.model_type || (a.model_type_alias != nullptr && model_type == a.model_type_alias);
}

const ArchInfo* arch_by_name(const std::string& architecture) {
  for (const ArchInfo& a : kArchs)
    if (architecture == a.architecture) return &a;
  return nullptr;
}

const ArchInfo* arch_by_model_type(const std::string& model_type) {
  for (const ArchInfo& a : kArchs)
    if (model_type_fits(a, model_type)) return &a;
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
      {"moe_intermediate_size", c.moe_intermediate_size, 1 << 22},
      {"shared_expert_intermediate_size", c.shared_expert_intermediate_size, 1 << 22},
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
  const double I = std::max(c.intermediate_size, c.moe_intermediate_size);
  const double per_layer = C * Q * 2 + C * KV * 2 + E * 3.0 * I * C + E * C + 2 * C + 2.0 * c.head_dim +
                           3.0 * c.shared_expert_intermediate_size * C + Q + 2 * KV;
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

double yarn_get_mscale(double scale, double m) { return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; }

// The DeepSeek-V3 / GLM-4.5 fields (hf_config.h): routing groups, shared experts, dense-first layers,
// partial / interleaved / YaRN RoPE and latent attention; absent from every other family.
void validate_routing_and_attention(const ModelConfig& c, const ArchInfo& arch, const std::string& source) {
  const bool sig = arch.deepseek || arch.glm;
  if (c.router_sigmoid != sig)
    fail("{}: sigmoid routing (n_group, topk_group, routed_scaling_factor) is DeepSeek-V3's and GLM-4.5's, not {}'s",
         source, c.architecture);
  if (sig) {
    const int E = c.num_local_experts;
    if (c.n_group < 1 || E % c.n_group != 0)
      fail("{}: field 'n_group' = {} must be positive and divide n_routed_experts = {}", source, c.n_group, E);
    if (E / c.n_group < 2)
      fail("{}: field 'n_group' = {}: each group needs at least 2 of the {} experts (a group scores by its two best)",
           source, c.n_group, E);
    if (c.topk_group < 1 || c.topk_group > c.n_group)
      fail("{}: field 'topk_group' = {} must be in [1, n_group = {}]", source, c.topk_group, c.n_group);
    if (c.num_experts_per_tok > c.topk_group * (E / c.n_group))
      fail("{}: field 'num_experts_per_tok' = {} exceeds the {} experts of the topk_group = {} groups searched",
           source, c.num_experts_per_tok, c.topk_group * (E / c.n_group), c.topk_group);
    check_positive_finite(source, "routed_scaling_factor", c.routed_scaling_factor);
    if (c.first_k_dense_replace < 0 || c.first_k_dense_replace > c.num_hidden_layers)
      fail("{}: field 'first_k_dense_replace' = {} must be in [0, num_hidden_layers = {}]", source,
           c.first_k_dense_replace, c.num_hidden_layers);
    if (c.n_shared_experts < 0 || c.shared_expert_intermediate_size != c.n_shared_experts * c.moe_intermediate_size)
      fail("{}: field 'n_shared_experts' = {}: the shared experts' width must be n_shared_experts x "
           "moe_intermediate_size",
           source, c.n_shared_experts);
  } else if (c.n_group != 1 || c.topk_group != 1 || c.routed_scaling_factor != 1.0 || c.n_shared_experts != 0 ||
             c.first_k_dense_replace != 0) {
    fail("{}: fields 'n_group', 'topk_group', 'routed_scaling_factor', 'n_shared_experts' and "
         "'first_k_dense_replace' are DeepSeek-V3's and GLM-4.5's, not {}'s",
         source, c.architecture);
  }
  // RoPE.
  if (c.rotary_dim < 0 || c.rotary_dim > c.head_dim || c.rotary_dim % 2 != 0 || (c.rotary_dim == 0 && c.head_dim % 2))
    fail("{}: field 'partial_rotary_factor' / 'qk_rope_head_dim': the rotated width {} must be even, positive and at "
         "most head_dim = {}",
         source, c.rope_dim(), c.head_dim);
  if (c.rope_interleave && !arch.deepseek)
    fail("{}: field 'rope_interleave' is DeepSeek-V3's, not {}'s", source, c.architecture);
  if (c.rope_type != "default" && c.rope_type != "yarn")
    fail("{}: field 'rope_parameters.rope_type' = '{}' is not supported (expected \"default\" or \"yarn\")", source,
         c.rope_type);
  if (c.rope_type == "yarn") {
    if (!sig) fail("{}: YaRN RoPE scaling is supported for DeepSeek-V3 and GLM-4.5 only, not {}", source, c.architecture);
    if (!(c.yarn_factor >= 1.0) || !std::isfinite(c.yarn_factor))
      fail("{}: field 'rope_scaling.factor' must be a finite number >= 1, got {}", source, c.yarn_factor);
    check_positive(source, "rope_scaling.original_max_position_embeddings", c.yarn_original_max_position_embeddings);
    check_positive_finite(source, "rope_scaling.beta_fast", c.yarn_beta_fast);
    check_positive_finite(source, "rope_scaling.beta_slow", c.yarn_beta_slow);
    if (!(c.yarn_mscale >= 0) || !(c.yarn_mscale_all_dim >= 0) || !(c.yarn_attention_factor >= 0))
      fail("{}: fields 'rope_scaling.mscale', 'mscale_all_dim' and 'attention_factor' must be >= 0", source);
  }
  // Latent attention.
  if (arch.deepseek) {
    if (c.kv_lora_rank <= 0 || c.qk_rope_head_dim <= 0 || c.v_head_dim <= 0 || c.qk_nope_head_dim < 0 ||
        c.q_lora_rank < 0)
      fail("{}: fields 'kv_lora_rank', 'qk_rope_head_dim', 'v_head_dim' must be positive (qk_nope_head_dim, "
           "q_lora_rank >= 0)",
           source);
    if (c.head_dim != c.qk_nope_head_dim + c.qk_rope_head_dim || c.rotary_dim != c.qk_rope_head_dim)
      fail("{}: latent attention's head_dim must be qk_nope_head_dim + qk_rope_head_dim = {}", source,
           c.qk_nope_head_dim + c.qk_rope_head_dim);
    if (c.num_key_value_heads != c.num_attention_heads)
      fail("{}: field 'num_key_value_heads' = {} must equal num_attention_heads = {} (latent attention expands the "
           "latent into every head)",
           source, c.num_key_value_heads, c.num_attention_heads);
    for (const auto& [field, v] : {std::pair{"q_lora_rank", c.q_lora_rank}, {"kv_lora_rank", c.kv_lora_rank},
                                   {"qk_nope_head_dim", c.qk_nope_head_dim}, {"qk_rope_head_dim", c.qk_rope_head_dim},
                                   {"v_head_dim", c.v_head_dim}})
      if (v > (1 << 16)) fail("{}: field '{}' = {} is beyond what moetron supports (65536 at most)", source, field, v);
  } else if (c.q_lora_rank != 0 || c.kv_lora_rank != 0 || c.qk_nope_head_dim != 0 || c.qk_rope_head_dim != 0 ||
             c.v_head_dim != 0) {
    fail("{}: latent-attention fields (q_lora_rank, kv_lora_rank, ...) are DeepSeek-V3's, not {}'s", source,
         c.architecture);
  }
}

}  // namespace

double ModelConfig::rope_attention_factor() const {
  if (rope_type != "yarn") return 1.0;
  if (yarn_attention_factor > 0) return yarn_attention_factor;
  if (yarn_mscale > 0 && yarn_mscale_all_dim > 0)
    return yarn_get_mscale(yarn_factor, yarn_mscale) / yarn_get_mscale(yarn_factor, yarn_mscale_all_dim);
  return yarn_get_mscale(yarn_factor, 1.0);
}

double ModelConfig::softmax_scale_factor() const {
  // DeepseekV3Attention: scaling *= mscale(factor, mscale_all_dim)^2 when mscale_all_dim is set.
  if (rope_type != "yarn" || !is_mla() || yarn_mscale_all_dim <= 0) return 1.0;
  const double m = yarn_get_mscale(yarn_factor, yarn_mscale_all_dim);
  return m * m;
}

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
      fail("{}: field 'architectures': unsupported architecture '{}' (expected {})", source, c.architecture,
           kArchList);
  } else if (!c.model_type.empty()) {
    arch = arch_by_model_type(c.model_type);
    if (arch == nullptr)
      fail("{}: field 'model_type': unsupported model type '{}' (expected {})", source, c.model_type,
           kModelTypeList);
    c.architecture = arch->architecture;
  } else {
    fail("{}: missing required field 'architectures' (or 'model_type')", source);
  }
  if (c.model_type.empty()) c.model_type = arch->model_type;
  if (!model_type_fits(*arch, c.model_type))
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
  } else if (arch->default_head_dim > 0) {
    c.head_dim = arch->default_head_dim;
  } else if (arch->deepseek) {
    // set from the latent-attention fields below
  } else {
    if (c.hidden_size % c.num_attention_heads != 0)
      fail("{}: field 'head_dim' is absent and hidden_size {} is not divisible by "
           "num_attention_heads {}",
           source, c.hidden_size, c.num_attention_heads);
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  // num_experts (transformers 4 and OLMoE) or num_local_experts (transformers 5 for Qwen3-MoE): both
  // are read, and must agree when both are present.
  auto experts_count = [&](int fallback) {
    const int hub = f.optional_int("num_experts", -1), v5 = f.optional_int("num_local_experts", -1);
    if (hub >= 0 && v5 >= 0 && hub != v5)
      fail("{}: fields 'num_experts' ({}) and 'num_local_experts' ({}) disagree", source, hub, v5);
    return v5 >= 0 ? v5 : hub >= 0 ? hub : fallback;
  };
  if (arch->olmoe) {  // OlmoeConfig's names and defaults; intermediate_size is the experts' width
    c.num_local_experts = experts_count(64);
    c.num_experts_per_tok = f.optional_int("num_experts_per_tok", 8);
    c.norm_topk_prob = f.optional_bool("norm_topk_prob", false);
    c.router_aux_loss_coef = f.optional_double("router_aux_loss_coef", arch->router_aux_loss_coef);
    c.clip_qkv = f.optional_double("clip_qkv", 0.0);
    if (f.get("clip_qkv") != nullptr && !(c.clip_qkv > 0.0 && std::isfinite(c.clip_qkv)))
      fail("{}: field 'clip_qkv' must be null or a positive number, got {}", source, c.clip_qkv);
    c.qk_norm = true;
    c.qk_norm_full = true;
  } else if (arch->deepseek || arch->glm) {  // DeepseekV3Config's / Glm4MoeConfig's names and defaults
    const bool ds = arch->deepseek;
    const int routed = f.optional_int("n_routed_experts", -1), v5 = f.optional_int("num_local_experts", -1);
    if (routed >= 0 && v5 >= 0 && routed != v5)
      fail("{}: fields 'n_routed_experts' ({}) and 'num_local_experts' ({}) disagree", source, routed, v5);
    c.num_local_experts = v5 >= 0 ? v5 : routed >= 0 ? routed : ds ? 256 : 128;
    c.num_experts_per_tok = f.optional_int("num_experts_per_tok", 8);
    c.moe_intermediate_size = f.optional_int("moe_intermediate_size", ds ? 2048 : 1408);
    check_positive(source, "moe_intermediate_size", c.moe_intermediate_size);
    c.n_shared_experts = f.optional_int("n_shared_experts", f.has("n_shared_experts") ? 0 : 1);
    if (c.n_shared_experts < 0 || c.n_shared_experts > 64)
      fail("{}: field 'n_shared_experts' must be in [0, 64], got {}", source, c.n_shared_experts);
    c.shared_expert_intermediate_size = c.n_shared_experts * c.moe_intermediate_size;
    c.routed_scaling_factor = f.optional_double("routed_scaling_factor", ds ? 2.5 : 1.0);
    c.n_group = f.optional_int("n_group", ds ? 8 : 1);
    c.topk_group = f.optional_int("topk_group", ds ? 4 : 1);
    c.first_k_dense_replace = f.optional_int("first_k_dense_replace", ds ? 3 : 1);
    c.norm_topk_prob = f.optional_bool("norm_topk_prob", true);
    c.router_aux_loss_coef = f.optional_double("router_aux_loss_coef", 0.0);
    c.router_sigmoid = true;
    // DeepSeek's own config fields (its remote code; transformers ignores them): kept in `extra`, but a
    // value transformers' model would silently not follow is refused.
    auto expect = [&](const char* key, const json& want) {
      auto it = j.find(key);
      if (it != j.end() && !it->is_null() && *it != want)
        fail("{}: field '{}' = {} is not supported (DeepSeek-V3's is {})", source, key, json_preview(*it),
             want.dump());
    };
    expect("scoring_func", "sigmoid");
    expect("topk_method", "noaux_tc");
    expect("moe_layer_freq", 1);
    if (ds) {
      if (f.has("q_lora_rank") && f.get("q_lora_rank") == nullptr)
        c.q_lora_rank = 0;  // null: a plain q_proj
      else
        c.q_lora_rank = f.optional_int("q_lora_rank", 1536);
      c.kv_lora_rank = f.optional_int("kv_lora_rank", 512);
      c.qk_nope_head_dim = f.optional_int("qk_nope_head_dim", 128);
      c.qk_rope_head_dim = f.optional_int("qk_rope_head_dim", 64);
      c.v_head_dim = f.optional_int("v_head_dim", 128);
      check_positive(source, "kv_lora_rank", c.kv_lora_rank);
      check_positive(source, "qk_rope_head_dim", c.qk_rope_head_dim);
      check_positive(source, "v_head_dim", c.v_head_dim);
      if (c.q_lora_rank < 0) fail("{}: field 'q_lora_rank' must be null or positive, got {}", source, c.q_lora_rank);
      if (c.qk_nope_head_dim < 0)
        fail("{}: field 'qk_nope_head_dim' must be >= 0, got {}", source, c.qk_nope_head_dim);
      // transformers sets head_dim to qk_rope_head_dim whatever the file says (the RoPE width).
      (void)f.get("head_dim");
      c.head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim;
      c.rotary_dim = c.qk_rope_head_dim;
      c.rope_interleave = f.optional_bool("rope_interleave", true);
      if (f.optional_bool("attention_bias", false))
        fail("{}: field 'attention_bias' = true is not supported for DeepseekV3ForCausalLM (latent attention "
             "without biases)",
             source);
    } else {
      c.qk_norm = f.optional_bool("use_qk_norm", false);
      c.qkv_bias = f.optional_bool("attention_bias", false);  // q, k, v biases; o_proj has none
    }
  } else if (arch->moe && !arch->qwen) {
    c.num_local_experts = f.required_int("num_local_experts");
    c.num_experts_per_tok = f.required_int("num_experts_per_tok");
    c.router_aux_loss_coef = f.optional_double("router_aux_loss_coef", arch->router_aux_loss_coef);
  } else if (arch->moe) {  // Qwen3MoeConfig's / Qwen2MoeConfig's names and defaults
    c.num_local_experts = experts_count(arch->qwen2_moe ? 60 : 128);
    c.num_experts_per_tok = f.optional_int("num_experts_per_tok", arch->qwen2_moe ? 4 : 8);
    c.moe_intermediate_size = f.optional_int("moe_intermediate_size", arch->qwen2_moe ? 1408 : 768);
    check_positive(source, "moe_intermediate_size", c.moe_intermediate_size);
    c.decoder_sparse_step = f.optional_int("decoder_sparse_step", 1);
    c.norm_topk_prob = f.optional_bool("norm_topk_prob", false);
    c.router_aux_loss_coef = f.optional_double("router_aux_loss_coef", arch->router_aux_loss_coef);
    if (const json* m = f.get("mlp_only_layers")) {
      if (!m->is_array()) fail("{}: field 'mlp_only_layers' must be a list of layer indices, got {}", source, json_preview(*m));
      if (m->size() > 4096) fail("{}: field 'mlp_only_layers' lists {} layers, more than 4096", source, m->size());
      for (const json& v : *m) c.mlp_only_layers.push_back(f.to_int("mlp_only_layers", v));
    }
  }
  if (arch->qwen2_moe) {
    c.qkv_bias = f.optional_bool("qkv_bias", true);  // transformers 4 has the biases always
    c.shared_expert_intermediate_size = f.optional_int("shared_expert_intermediate_size", 5632);
    if (c.shared_expert_intermediate_size < 0)
      fail("{}: field 'shared_expert_intermediate_size' must be >= 0, got {}", source, c.shared_expert_intermediate_size);
  }
  if (arch->qwen) {
    c.qk_norm = arch->qk_norm;
    // Sliding-window attention per layer (use_sliding_window with max_window_layers / layer_types)
    // is not modelled; off (the default and every released Qwen3) the window fields are inert and
    // stay in `extra`.
    if (f.optional_bool("use_sliding_window", false))
      fail("{}: field 'use_sliding_window' = true is not supported (per-layer sliding windows)", source);
    if (auto it = j.find("layer_types"); it != j.end() && !it->is_null()) {
      if (!it->is_array()) fail("{}: field 'layer_types' must be a list, got {}", source, json_preview(*it));
      for (const json& t : *it)
        if (!t.is_string() || t.get<std::string>() != "full_attention")
          fail("{}: field 'layer_types' holds {}; only \"full_attention\" layers are supported", source,
               json_preview(t));
    }
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
  // DeepSeek-V3 and GLM-4.5 also take YaRN scaling (rope_scaling, transformers 4; or rope_parameters'
  // rope_type "yarn", transformers 5) and GLM's partial_rotary_factor (top level or in rope_parameters);
  // a key given twice must agree.
  const bool scaled_rope = arch->deepseek || arch->glm;
  if (!scaled_rope) {
    if (const json* rs = f.get("rope_scaling"))
      fail("{}: field 'rope_scaling' is not supported (got {}); only plain RoPE with rope_theta is",
           source, rs->dump());
  }
  const bool has_top_theta = f.get("rope_theta") != nullptr;
  const double top_theta = f.optional_double("rope_theta", arch->rope_theta);
  c.rope_theta = top_theta;
  std::map<std::string, std::pair<std::string, json>> rope_keys;  // key -> (where, value), for the agreement check
  auto rope_key = [&](const std::string& field, const std::string& k, const json& v) {
    const std::string where = field == k ? field : field + "." + k;
    auto [it, fresh] = rope_keys.emplace(k, std::pair{where, v});
    if (!fresh && it->second.second != v)
      fail("{}: field '{}' = {} disagrees with '{}' = {}", source, where, json_preview(v), it->second.first,
           json_preview(it->second.second));
  };
  auto read_rope = [&](const char* field, const json& rp) {
    if (!rp.is_object()) fail("{}: field '{}' must be an object, got {}", source, field, json_preview(rp));
    for (const auto& item : rp.items()) {
      // Named copies, not structured bindings: clang before 16 cannot capture those in the lambda below.
      const std::string k = item.key();
      const json& v = item.value();
      const std::string key = k == "type" ? "rope_type" : k;
      auto number = [&]() {
        if (!v.is_number() || !std::isfinite(v.get<double>()))
          fail("{}: field '{}.{}' must be a number, got {}", source, field, k, json_preview(v));
        return v.get<double>();
      };
      if (key == "rope_type") {
        if (!v.is_string() || (v.get<std::string>() != "default" && (!scaled_rope || v.get<std::string>() != "yarn")))
          fail("{}: field '{}.{}' = {} is not supported (expected \"default\"{})", source, field, k, json_preview(v),
               scaled_rope ? " or \"yarn\"" : "");
        rope_key(field, key, v);
        c.rope_type = v.get<std::string>();
        continue;
      }
      if (key == "rope_theta") {
        c.rope_theta = number();
      } else if (!scaled_rope) {
        fail("{}: field '{}.{}' is not supported (only rope_type \"default\" and rope_theta are)", source, field, k);
      } else if (key == "partial_rotary_factor") {
        c.partial_rotary_factor = number();
      } else if (key == "factor") {
        c.yarn_factor = number();
      } else if (key == "original_max_position_embeddings") {
        c.yarn_original_max_position_embeddings = f.to_int("original_max_position_embeddings", v);
      } else if (key == "beta_fast") {
        c.yarn_beta_fast = number();
      } else if (key == "beta_slow") {
        c.yarn_beta_slow = number();
      } else if (key == "mscale") {
        c.yarn_mscale = number();
      } else if (key == "mscale_all_dim") {
        c.yarn_mscale_all_dim = number();
      } else if (key == "attention_factor") {
        c.yarn_attention_factor = number();
      } else if (key == "truncate") {
        if (!v.is_boolean() || !v.get<bool>())
          fail("{}: field '{}.truncate' = {} is not supported (only true, the default)", source, field,
               json_preview(v));
      } else {
        fail("{}: field '{}.{}' is not supported (expected rope_type, rope_theta, factor, "
             "original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim, attention_factor, "
             "partial_rotary_factor)",
             source, field, k);
      }
      rope_key(field, key, v);
    }
  };
  if (has_top_theta) rope_key("rope_theta", "rope_theta", json(top_theta));
  if (scaled_rope) {
    if (const json* rs = f.get("rope_scaling")) read_rope("rope_scaling", *rs);
    if (const json* pr = f.get("partial_rotary_factor")) {
      if (!pr->is_number()) fail("{}: field 'partial_rotary_factor' must be a number, got {}", source, json_preview(*pr));
      rope_key("partial_rotary_factor", "partial_rotary_factor", *pr);
      c.partial_rotary_factor = pr->get<double>();
    } else if (arch->glm) {
      c.partial_rotary_factor = 0.5;  // Glm4MoeConfig's default
    }
  }
  if (const json* rp = f.get("rope_parameters")) read_rope("rope_parameters", *rp);
  if (c.rope_type == "yarn" && c.yarn_original_max_position_embeddings == 0)
    c.yarn_original_max_position_embeddings = -1;  // resolved below, once max_position_embeddings is read

  // Flags and ids.
  if (c.yarn_original_max_position_embeddings == -1)  // transformers' default: the model's own
    c.yarn_original_max_position_embeddings = c.max_position_embeddings;
  if (c.rope_type == "yarn" && c.yarn_factor == 0.0 && c.yarn_original_max_position_embeddings > 0)
    c.yarn_factor = (double)c.max_position_embeddings / c.yarn_original_max_position_embeddings;  // transformers' rule
  if (arch->glm) {  // transformers: int(head_dim * partial_rotary_factor) dims rotated
    if (!(c.partial_rotary_factor > 0.0 && c.partial_rotary_factor <= 1.0))
      fail("{}: field 'partial_rotary_factor' must be in (0, 1], got {}", source, c.partial_rotary_factor);
    c.rotary_dim = (int)(c.head_dim * c.partial_rotary_factor);
  } else if (arch->deepseek && c.partial_rotary_factor != 1.0) {
    fail("{}: field 'partial_rotary_factor' is not supported for DeepseekV3ForCausalLM (qk_rope_head_dim sets "
         "the rotated width)",
         source);
  }
  c.tie_word_embeddings = f.optional_bool("tie_word_embeddings", false);
  c.hidden_act = f.optional_string("hidden_act", "silu");
  for (const char* key : {"attention_bias", "mlp_bias"}) {
    if (std::string(key) == "attention_bias" && (arch->deepseek || arch->glm)) continue;  // read above
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

bool ModelConfig::is_moe_layer(int l) const {
  if (!is_moe() || l < first_k_dense_replace) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), l) != mlp_only_layers.end()) return false;
  return (l + 1) % std::max(decoder_sparse_step, 1) == 0;
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
  const bool qwen = arch != nullptr && arch->qwen;
  if (c.is_moe() || (arch != nullptr && arch->moe)) {
    j["num_local_experts"] = c.num_local_experts;
    if (qwen) j["num_experts"] = c.num_local_experts;  // transformers 4's name (5 reads either)
    j["num_experts_per_tok"] = c.num_experts_per_tok;
    j["router_aux_loss_coef"] = c.router_aux_loss_coef;
    if (qwen) {
      j["moe_intermediate_size"] = c.moe_intermediate_size;
      j["decoder_sparse_step"] = c.decoder_sparse_step;
      j["mlp_only_layers"] = c.mlp_only_layers;
      j["norm_topk_prob"] = c.norm_topk_prob;
    }
  }
  if (qwen) j["use_sliding_window"] = false;
  if (arch != nullptr && (arch->deepseek || arch->glm)) {  // DeepseekV3Config's / Glm4MoeConfig's names
    j.erase("num_local_experts");
    j["n_routed_experts"] = c.num_local_experts;
    j["moe_intermediate_size"] = c.moe_intermediate_size;
    j["n_shared_experts"] = c.n_shared_experts;
    j["routed_scaling_factor"] = c.routed_scaling_factor;
    j["n_group"] = c.n_group;
    j["topk_group"] = c.topk_group;
    j["first_k_dense_replace"] = c.first_k_dense_replace;
    j["norm_topk_prob"] = c.norm_topk_prob;
    if (arch->deepseek) {
      j["q_lora_rank"] = c.q_lora_rank > 0 ? json(c.q_lora_rank) : json(nullptr);
      j["kv_lora_rank"] = c.kv_lora_rank;
      j["qk_nope_head_dim"] = c.qk_nope_head_dim;
      j["qk_rope_head_dim"] = c.qk_rope_head_dim;
      j["v_head_dim"] = c.v_head_dim;
      j["rope_interleave"] = c.rope_interleave;
      j["attention_bias"] = false;
      j["head_dim"] = c.qk_rope_head_dim;  // what transformers sets (and ignores on reading)
    } else {
      j["use_qk_norm"] = c.qk_norm;
      j["attention_bias"] = c.qkv_bias;
      j["partial_rotary_factor"] = c.partial_rotary_factor;
    }
  }
  if (arch != nullptr && arch->olmoe) {
    j["num_experts"] = c.num_local_experts;
    j["norm_topk_prob"] = c.norm_topk_prob;
    j["clip_qkv"] = c.clip_qkv > 0 ? json(c.clip_qkv) : json(nullptr);
  }
  if (arch != nullptr && arch->qwen2_moe) {
    j["qkv_bias"] = c.qkv_bias;
    j["shared_expert_intermediate_size"] = c.shared_expert_intermediate_size;
  }
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["rope_theta"] = c.rope_theta;
  j["rope_parameters"] = {{"rope_type", c.rope_type}, {"rope_theta", c.rope_theta}};
  if (arch != nullptr && arch->glm) j["rope_parameters"]["partial_rotary_factor"] = c.partial_rotary_factor;
  if (c.rope_type == "yarn") {
    json& rp = j["rope_parameters"];
    rp["factor"] = c.yarn_factor;
    rp["original_max_position_embeddings"] = c.yarn_original_max_position_embeddings;
    rp["beta_fast"] = c.yarn_beta_fast;
    rp["beta_slow"] = c.yarn_beta_slow;
    if (c.yarn_mscale > 0) rp["mscale"] = c.yarn_mscale;
    if (c.yarn_mscale_all_dim > 0) rp["mscale_all_dim"] = c.yarn_mscale_all_dim;
    if (c.yarn_attention_factor > 0) rp["attention_factor"] = c.yarn_attention_factor;
    // transformers 4 reads rope_scaling; 5 takes it over rope_parameters when both are present.
    j["rope_scaling"] = rp;
    j["rope_scaling"].erase("rope_theta");
    j["rope_scaling"].erase("partial_rotary_factor");
  } else {
    j.erase("rope_scaling");
  }
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
    fail("{}: field 'architectures': unsupported architecture '{}' (expected {})", source, c.architecture, kArchList);
  if (!model_type_fits(*arch, c.model_type))
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
  const char* experts_field = arch->qwen || arch->olmoe ? "num_experts" : "num_local_experts";
  if (arch->moe) {
    check_positive(source, experts_field, c.num_local_experts);
    if (c.num_experts_per_tok < 1 || c.num_experts_per_tok > c.num_local_experts)
      fail("{}: field 'num_experts_per_tok' must be in [1, {} = {}], got {}", source, experts_field,
           c.num_local_experts, c.num_experts_per_tok);
    if (!(c.router_aux_loss_coef >= 0.0) || !std::isfinite(c.router_aux_loss_coef))
      fail("{}: field 'router_aux_loss_coef' must be a finite number >= 0, got {}", source,
           c.router_aux_loss_coef);
    if (c.moe_intermediate_size < 0 || (c.moe_intermediate_size > 0 && !arch->qwen && !arch->deepseek && !arch->glm))
      fail("{}: field 'moe_intermediate_size' = {} does not fit architecture {}", source, c.moe_intermediate_size,
           c.architecture);
    if (c.decoder_sparse_step < 1)
      fail("{}: field 'decoder_sparse_step' must be >= 1, got {}", source, c.decoder_sparse_step);
    const bool sigmoid_family = arch->deepseek || arch->glm;
    if (!arch->qwen && (c.decoder_sparse_step != 1 || !c.mlp_only_layers.empty() ||
                        (!c.norm_topk_prob && !arch->olmoe && !sigmoid_family)))
      fail("{}: fields 'decoder_sparse_step', 'mlp_only_layers' and 'norm_topk_prob' are Qwen3-MoE's; {} routes "
           "every layer with renormalised weights",
           source, c.architecture);
    std::set<int> seen;
    for (int l : c.mlp_only_layers)
      if (l < 0 || l >= c.num_hidden_layers || !seen.insert(l).second)
        fail("{}: field 'mlp_only_layers' holds {}: expected distinct layer indices in [0, num_hidden_layers = {})",
             source, l, c.num_hidden_layers);
  } else if (c.num_local_experts != 0 || c.num_experts_per_tok != 0 || c.moe_intermediate_size != 0 ||
             !c.mlp_only_layers.empty()) {
    fail("{}: dense architecture {} must have num_local_experts = num_experts_per_tok = 0 (got {} "
         "and {})",
         source, c.architecture, c.num_local_experts, c.num_experts_per_tok);
  }
  validate_routing_and_attention(c, *arch, source);
  check_sizes(c, source);
  check_positive_finite(source, "rms_norm_eps", c.rms_norm_eps);
  check_positive_finite(source, "rope_theta", c.rope_theta);
  if (c.sliding_window < 0)
    fail("{}: field 'sliding_window' must be null or positive, got {}", source, c.sliding_window);
  if (!(c.initializer_range >= 0.0) || !std::isfinite(c.initializer_range))
    fail("{}: field 'initializer_range' must be a finite number >= 0, got {}", source,
         c.initializer_range);
  if (c.qk_norm_full != arch->olmoe || (c.clip_qkv != 0.0 && !arch->olmoe))
    fail("{}: fields 'clip_qkv' and full-width q/k norms are OLMoE's, not {}'s", source, c.architecture);
  if (!(c.clip_qkv >= 0.0) || !std::isfinite(c.clip_qkv))
    fail("{}: field 'clip_qkv' must be null or a positive number, got {}", source, c.clip_qkv);
  if (c.qk_norm_full && c.head_dim * c.num_attention_heads != c.hidden_size)
    fail("{}: field 'head_dim' = {}: OLMoE's q norm spans hidden_size {}, so head_dim must be hidden_size / "
         "num_attention_heads = {}",
         source, c.head_dim, c.hidden_size, c.hidden_size / c.num_attention_heads);
  if (c.qk_norm != arch->qk_norm && !arch->glm)
    fail("{}: q/k norms are {} for architecture {}", source, arch->qk_norm ? "required" : "not part", c.architecture);
  if ((!arch->qwen2_moe && !arch->glm && c.qkv_bias) ||
      (!arch->qwen2_moe && !arch->deepseek && !arch->glm && c.shared_expert_intermediate_size != 0))
    fail("{}: fields 'qkv_bias' and 'shared_expert_intermediate_size' are Qwen2-MoE's, not {}'s", source,
         c.architecture);
  if (c.shared_expert_intermediate_size < 0)
    fail("{}: field 'shared_expert_intermediate_size' must be >= 0, got {}", source, c.shared_expert_intermediate_size);
  if (c.hidden_act != "silu")
    fail("{}: field 'hidden_act' = '{}' is not supported (expected \"silu\")", source,
         c.hidden_act);
}

}  // namespace moetron
