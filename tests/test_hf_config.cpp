// Tests for io/hf_config: real HF configs (Mixtral-8x7B, Mistral, Llama), transformers-5 style
// fields, defaults, round trips through model_config_to_json, and one test per validation error.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/hf_config.h"
#include "model/params.h"

using namespace moetron;
using nlohmann::json;

namespace {

// mistralai/Mixtral-8x7B-v0.1 config.json as published on the Hub.
const char* kMixtralConfig = R"({
  "architectures": ["MixtralForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 32768,
  "model_type": "mixtral",
  "num_attention_heads": 32,
  "num_experts_per_tok": 2,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "num_local_experts": 8,
  "output_router_logits": false,
  "rms_norm_eps": 1e-05,
  "rope_theta": 1000000.0,
  "router_aux_loss_coef": 0.02,
  "sliding_window": null,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.36.0.dev0",
  "use_cache": true,
  "vocab_size": 32000
})";

json tiny_mixtral() {
  return json::parse(R"({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
    "num_experts_per_tok": 2})");
}

json tiny_mistral() {
  return json::parse(R"({"architectures": ["MistralForCausalLM"], "model_type": "mistral",
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2})");
}

// Expects parsing `j` to fail with a message naming the source and containing `parts`.
void expect_config_error(const json& j, std::initializer_list<std::string> parts) {
  try {
    model_config_from_json(j, "cfg.json");
    ADD_FAILURE() << "expected an Error for " << j.dump();
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("cfg.json: ", 0), 0u) << "message does not start with the source: " << msg;
    for (const std::string& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << "message lacks '" << p << "': " << msg;
  }
}

void expect_same(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.architecture, b.architecture);
  EXPECT_EQ(a.model_type, b.model_type);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.intermediate_size, b.intermediate_size);
  EXPECT_EQ(a.num_hidden_layers, b.num_hidden_layers);
  EXPECT_EQ(a.num_attention_heads, b.num_attention_heads);
  EXPECT_EQ(a.num_key_value_heads, b.num_key_value_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.num_local_experts, b.num_local_experts);
  EXPECT_EQ(a.num_experts_per_tok, b.num_experts_per_tok);
  EXPECT_EQ(a.rms_norm_eps, b.rms_norm_eps);
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(a.sliding_window, b.sliding_window);
  EXPECT_EQ(a.max_position_embeddings, b.max_position_embeddings);
  EXPECT_EQ(a.router_aux_loss_coef, b.router_aux_loss_coef);
  EXPECT_EQ(a.initializer_range, b.initializer_range);
  EXPECT_EQ(a.tie_word_embeddings, b.tie_word_embeddings);
  EXPECT_EQ(a.bos_token_id, b.bos_token_id);
  EXPECT_EQ(a.eos_token_id, b.eos_token_id);
  EXPECT_EQ(a.pad_token_id, b.pad_token_id);
  EXPECT_EQ(a.eos_token_ids, b.eos_token_ids);
  EXPECT_EQ(a.torch_dtype, b.torch_dtype);
  EXPECT_EQ(a.hidden_act, b.hidden_act);
  EXPECT_EQ(a.router_sigmoid, b.router_sigmoid);
  EXPECT_EQ(a.n_group, b.n_group);
  EXPECT_EQ(a.topk_group, b.topk_group);
  EXPECT_EQ(a.routed_scaling_factor, b.routed_scaling_factor);
  EXPECT_EQ(a.n_shared_experts, b.n_shared_experts);
  EXPECT_EQ(a.first_k_dense_replace, b.first_k_dense_replace);
  EXPECT_EQ(a.rotary_dim, b.rotary_dim);
  EXPECT_EQ(a.partial_rotary_factor, b.partial_rotary_factor);
  EXPECT_EQ(a.rope_interleave, b.rope_interleave);
  EXPECT_EQ(a.rope_type, b.rope_type);
  EXPECT_EQ(a.yarn_factor, b.yarn_factor);
  EXPECT_EQ(a.yarn_original_max_position_embeddings, b.yarn_original_max_position_embeddings);
  EXPECT_EQ(a.yarn_beta_fast, b.yarn_beta_fast);
  EXPECT_EQ(a.yarn_beta_slow, b.yarn_beta_slow);
  EXPECT_EQ(a.yarn_mscale, b.yarn_mscale);
  EXPECT_EQ(a.yarn_mscale_all_dim, b.yarn_mscale_all_dim);
  EXPECT_EQ(a.yarn_attention_factor, b.yarn_attention_factor);
  EXPECT_EQ(a.q_lora_rank, b.q_lora_rank);
  EXPECT_EQ(a.kv_lora_rank, b.kv_lora_rank);
  EXPECT_EQ(a.qk_nope_head_dim, b.qk_nope_head_dim);
  EXPECT_EQ(a.qk_rope_head_dim, b.qk_rope_head_dim);
  EXPECT_EQ(a.v_head_dim, b.v_head_dim);
  EXPECT_EQ(a.extra, b.extra);
}

}  // namespace

TEST(HfConfig, Mixtral8x7B) {
  const ModelConfig c = model_config_from_json(json::parse(kMixtralConfig), "mixtral.json");
  EXPECT_EQ(c.architecture, "MixtralForCausalLM");
  EXPECT_EQ(c.model_type, "mixtral");
  EXPECT_TRUE(c.is_moe());
  EXPECT_EQ(c.vocab_size, 32000);
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.intermediate_size, 14336);
  EXPECT_EQ(c.num_hidden_layers, 32);
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.num_local_experts, 8);
  EXPECT_EQ(c.num_experts_per_tok, 2);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.router_aux_loss_coef, 0.02);
  EXPECT_EQ(c.sliding_window, 0);
  EXPECT_EQ(c.max_position_embeddings, 32768);
  EXPECT_EQ(c.initializer_range, 0.02);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_EQ(c.eos_token_id, 2);
  EXPECT_EQ(c.pad_token_id, -1);
  EXPECT_EQ(c.torch_dtype, "bfloat16");
  EXPECT_EQ(c.hidden_act, "silu");
  EXPECT_EQ(c.extra, json::parse(R"({"attention_dropout": 0.0, "output_router_logits": false,
      "transformers_version": "4.36.0.dev0", "use_cache": true})"));
}

TEST(HfConfig, RoundTripPreservesEverything) {
  const json original = json::parse(kMixtralConfig);
  const ModelConfig c = model_config_from_json(original, "mixtral.json");
  const json written = model_config_to_json(c);
  // Every original field comes back with its value.
  for (const auto& [k, v] : original.items()) {
    ASSERT_TRUE(written.contains(k)) << k;
    EXPECT_EQ(written[k], v) << k;
  }
  EXPECT_EQ(written["head_dim"], 128);
  EXPECT_EQ(written["rope_parameters"], json::parse(R"({"rope_type":"default","rope_theta":1e6})"));
  expect_same(model_config_from_json(written, "written.json"), c);
}

TEST(HfConfig, RoundTripDenseAndEosList) {
  json j = tiny_mistral();
  j["eos_token_id"] = {2, 32000};
  j["pad_token_id"] = 0;
  j["sliding_window"] = 4096;
  j["attention_bias"] = false;
  j["custom_field"] = {{"nested", {1, 2}}};
  const ModelConfig c = model_config_from_json(j, "m.json");
  EXPECT_FALSE(c.is_moe());
  EXPECT_EQ(c.eos_token_id, 2);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int>{2, 32000}));
  EXPECT_EQ(c.pad_token_id, 0);
  EXPECT_EQ(c.sliding_window, 4096);
  const json w = model_config_to_json(c);
  EXPECT_EQ(w["eos_token_id"], json({2, 32000}));
  EXPECT_EQ(w["custom_field"], j["custom_field"]);
  EXPECT_EQ(w["attention_bias"], false);
  EXPECT_FALSE(w.contains("num_local_experts"));
  expect_same(model_config_from_json(w, "w.json"), c);
}

TEST(HfConfig, LoadFromFile) {
  std::string templ = (std::filesystem::temp_directory_path() / "moetron_cfg_XXXXXX").string();
  ASSERT_NE(mkdtemp(templ.data()), nullptr);
  const std::string path = templ + "/config.json";
  std::ofstream(path) << kMixtralConfig;
  EXPECT_EQ(load_model_config(path).num_local_experts, 8);
  std::ofstream(path) << "{\"vocab_size\": ";
  try {
    load_model_config(path);
    ADD_FAILURE() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path + ": not valid JSON"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(templ);
  try {
    load_model_config(path);
    ADD_FAILURE() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
}

TEST(HfConfig, Transformers5Style) {
  json j = tiny_mixtral();
  j["rope_parameters"] = {{"rope_theta", 500000.0}, {"rope_type", "default"}};
  j["dtype"] = "bfloat16";
  const ModelConfig c = model_config_from_json(j, "cfg.json");
  EXPECT_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(c.torch_dtype, "bfloat16");
  EXPECT_FALSE(c.extra.contains("dtype"));
  EXPECT_FALSE(c.extra.contains("rope_parameters"));
  j["rope_theta"] = 500000;  // both spellings, agreeing (an integer is a fine number)
  EXPECT_EQ(model_config_from_json(j, "cfg.json").rope_theta, 500000.0);
}

TEST(HfConfig, MixtralDefaults) {
  const ModelConfig c = model_config_from_json(tiny_mixtral(), "cfg.json");
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.router_aux_loss_coef, 0.001);  // as transformers' MixtralConfig
  EXPECT_EQ(c.sliding_window, 0);
  EXPECT_EQ(c.max_position_embeddings, 131072);
  EXPECT_EQ(c.initializer_range, 0.02);
  EXPECT_EQ(c.bos_token_id, -1);
  EXPECT_EQ(c.eos_token_id, -1);
  EXPECT_TRUE(c.eos_token_ids.empty());
  EXPECT_EQ(c.torch_dtype, "");
  EXPECT_TRUE(c.extra.empty());
  json j = tiny_mixtral();
  j.erase("num_key_value_heads");
  EXPECT_EQ(model_config_from_json(j, "cfg.json").num_key_value_heads, 4);
  j["head_dim"] = nullptr;
  EXPECT_EQ(model_config_from_json(j, "cfg.json").head_dim, 16);
}

TEST(HfConfig, MistralAndLlamaDefaults) {
  ModelConfig m = model_config_from_json(tiny_mistral(), "cfg.json");
  EXPECT_EQ(m.sliding_window, 4096);  // MistralConfig's default when the key is absent
  EXPECT_EQ(m.rope_theta, 10000.0);
  EXPECT_EQ(m.rms_norm_eps, 1e-6);
  EXPECT_EQ(m.num_local_experts, 0);
  EXPECT_EQ(m.num_experts_per_tok, 0);
  EXPECT_EQ(m.router_aux_loss_coef, 0.0);
  json j = tiny_mistral();
  j["sliding_window"] = nullptr;
  EXPECT_EQ(model_config_from_json(j, "cfg.json").sliding_window, 0);

  json l = tiny_mistral();
  l["architectures"] = {"LlamaForCausalLM"};
  l["model_type"] = "llama";
  l["sliding_window"] = 256;  // LlamaForCausalLM ignores it: kept as an unmodelled field
  const ModelConfig c = model_config_from_json(l, "cfg.json");
  EXPECT_EQ(c.sliding_window, 0);
  EXPECT_EQ(c.extra["sliding_window"], 256);
  EXPECT_EQ(c.max_position_embeddings, 2048);
  EXPECT_EQ(model_config_to_json(c)["sliding_window"], 256);
}

TEST(HfConfig, ArchitectureFromModelTypeAndBack) {
  json j = tiny_mixtral();
  j.erase("architectures");
  EXPECT_EQ(model_config_from_json(j, "cfg.json").architecture, "MixtralForCausalLM");
  j = tiny_mixtral();
  j.erase("model_type");
  EXPECT_EQ(model_config_from_json(j, "cfg.json").model_type, "mixtral");
}

TEST(HfConfig, HeadDimGivenExplicitly) {
  json j = tiny_mixtral();
  j["hidden_size"] = 60;  // 4 heads do not divide 60, fine when head_dim is given
  j["head_dim"] = 32;
  EXPECT_EQ(model_config_from_json(j, "cfg.json").head_dim, 32);
}

// ---------------------------------------------------------------------------------------------
// Errors, one per case.

TEST(HfConfigErrors, MissingRequiredFields) {
  for (const char* key : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                          "num_attention_heads", "num_local_experts", "num_experts_per_tok"}) {
    json j = tiny_mixtral();
    j.erase(key);
    expect_config_error(j, {"missing required field", std::string("'") + key + "'"});
  }
  for (const char* key : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                          "num_attention_heads"}) {
    json j = tiny_mistral();
    j.erase(key);
    expect_config_error(j, {"missing required field", std::string("'") + key + "'"});
  }
  json j = tiny_mixtral();
  j["vocab_size"] = nullptr;
  expect_config_error(j, {"'vocab_size'", "integer", "null"});
}

TEST(HfConfigErrors, MissingArchitecture) {
  json j = tiny_mixtral();
  j.erase("architectures");
  j.erase("model_type");
  expect_config_error(j, {"'architectures'"});
}

TEST(HfConfigErrors, WrongJsonTypes) {
  const std::vector<std::pair<const char*, json>> cases = {
      {"hidden_size", "64"},          {"hidden_size", 64.0},
      {"num_local_experts", true},    {"rms_norm_eps", "1e-5"},
      {"rope_theta", json::array()},  {"tie_word_embeddings", "false"},
      {"architectures", "MixtralForCausalLM"},
      {"model_type", 3},              {"bos_token_id", "1"},
      {"eos_token_id", json::array()}, {"torch_dtype", 16},
      {"rope_parameters", 1e6},       {"sliding_window", 4096.5},
      {"vocab_size", 1e12},           {"attention_bias", "no"}};
  for (const auto& [key, value] : cases) {
    json j = tiny_mixtral();
    j[key] = value;
    SCOPED_TRACE(std::string(key) + " = " + value.dump());
    expect_config_error(j, {key});
  }
  json j = tiny_mixtral();
  j["vocab_size"] = 3000000000LL;
  expect_config_error(j, {"'vocab_size'", "out of range"});
}

TEST(HfConfigErrors, NonPositiveSizes) {
  for (const char* key : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                          "num_attention_heads", "num_key_value_heads", "num_local_experts",
                          "max_position_embeddings", "head_dim"}) {
    for (int bad : {0, -4}) {
      json j = tiny_mixtral();
      j[key] = bad;
      SCOPED_TRACE(std::string(key) + " = " + std::to_string(bad));
      expect_config_error(j, {std::string("'") + key + "'"});
    }
  }
  json j = tiny_mixtral();
  j["rms_norm_eps"] = 0.0;
  expect_config_error(j, {"'rms_norm_eps'", "positive"});
  j = tiny_mixtral();
  j["rope_theta"] = -1.0;
  expect_config_error(j, {"'rope_theta'", "positive"});
  j = tiny_mixtral();
  j["sliding_window"] = -1;
  expect_config_error(j, {"'sliding_window'"});
  j = tiny_mixtral();
  j["router_aux_loss_coef"] = -0.01;
  expect_config_error(j, {"'router_aux_loss_coef'"});
  j = tiny_mixtral();
  j["bos_token_id"] = -1;
  expect_config_error(j, {"'bos_token_id'", "non-negative"});
}

TEST(HfConfigErrors, HeadsDoNotDivideHiddenWithoutHeadDim) {
  json j = tiny_mixtral();
  j["hidden_size"] = 66;
  expect_config_error(j, {"'head_dim'", "hidden_size 66", "num_attention_heads 4"});
}

TEST(HfConfigErrors, KvHeadsMustDivideHeads) {
  json j = tiny_mixtral();
  j["num_key_value_heads"] = 3;
  expect_config_error(j, {"'num_key_value_heads'", "(3)", "(4)"});
  j["num_key_value_heads"] = 8;  // more kv heads than heads
  expect_config_error(j, {"'num_key_value_heads'"});
}

TEST(HfConfigErrors, ExpertsPerTokenOutOfRange) {
  json j = tiny_mixtral();
  j["num_experts_per_tok"] = 5;
  expect_config_error(j, {"'num_experts_per_tok'", "num_local_experts = 4", "got 5"});
  j["num_experts_per_tok"] = 0;
  expect_config_error(j, {"'num_experts_per_tok'", "got 0"});
}

TEST(HfConfigErrors, UnknownArchitecture) {
  json j = tiny_mixtral();
  j["architectures"] = {"Phi3ForCausalLM"};  // (Qwen2-MoE, then DeepSeek-V3 were the example before each was supported)
  expect_config_error(j, {"'architectures'", "Phi3ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeForCausalLM"});
  j = tiny_mixtral();
  j.erase("architectures");
  j["model_type"] = "gpt2";
  expect_config_error(j, {"'model_type'", "gpt2"});
  j = tiny_mixtral();
  j["architectures"] = {"MixtralForCausalLM", "MistralForCausalLM"};
  expect_config_error(j, {"'architectures'", "expected one"});
}

TEST(HfConfigErrors, ModelTypeMismatch) {
  json j = tiny_mixtral();
  j["model_type"] = "mistral";
  expect_config_error(j, {"'model_type'", "mistral", "mixtral"});
}

TEST(HfConfigErrors, RopeScalingNotSupported) {
  json j = tiny_mixtral();
  j["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  expect_config_error(j, {"'rope_scaling'", "not supported"});
  j["rope_scaling"] = nullptr;  // null is the normal "no scaling"
  EXPECT_NO_THROW(model_config_from_json(j, "cfg.json"));
  j = tiny_mixtral();
  j["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 1e6}, {"factor", 4.0}};
  expect_config_error(j, {"'rope_parameters.", "not supported"});
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1e6}, {"factor", 4.0}};
  expect_config_error(j, {"'rope_parameters.factor'", "not supported"});
  j = tiny_mixtral();
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1e6}};
  j["rope_theta"] = 1e4;
  expect_config_error(j, {"'rope_theta'", "disagrees"});
}

// Tied embeddings (small Qwen3 models): accepted; the table has no lm_head (tests/test_golden.cpp
// checks the numerics, tests/test_layout.cpp the refused pipeline layouts).
TEST(HfConfig, TiedEmbeddingsHaveNoLmHead) {
  json j = tiny_mixtral();
  j["tie_word_embeddings"] = true;
  const ModelConfig c = model_config_from_json(j, "cfg.json");
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_TRUE(model_config_to_json(c).at("tie_word_embeddings").get<bool>());
  const ParamTable t(c);
  EXPECT_FALSE(t.has(ParamKind::lm_head));
  EXPECT_EQ(t.head_kind(), ParamKind::embedding);
  EXPECT_EQ(t.find_hf("lm_head.weight"), nullptr);
  // A stage holding the head but not the embedding cannot be built.
  ParamShard last;
  last.layer_begin = 1;
  EXPECT_THROW(ParamTable(c, last), Error);
}

TEST(HfConfigErrors, OnlySiluActivation) {
  json j = tiny_mixtral();
  j["hidden_act"] = "gelu";
  expect_config_error(j, {"'hidden_act'", "gelu", "silu"});
}

TEST(HfConfigErrors, BiasesNotSupported) {
  for (const char* key : {"attention_bias", "mlp_bias"}) {
    json j = tiny_mistral();
    j[key] = true;
    expect_config_error(j, {std::string("'") + key + "'", "not supported"});
  }
}

TEST(HfConfigErrors, TorchDtype) {
  json j = tiny_mixtral();
  j["torch_dtype"] = "float64";
  expect_config_error(j, {"'torch_dtype'", "float64"});
  j["torch_dtype"] = "float32";
  j["dtype"] = "bfloat16";
  expect_config_error(j, {"'torch_dtype'", "'dtype'", "disagree"});
}

TEST(HfConfigErrors, NotAnObject) { expect_config_error(json::array(), {"JSON object"}); }

TEST(HfConfigErrors, ValidateProgrammaticConfig) {
  ModelConfig c = model_config_from_json(tiny_mixtral(), "cfg.json");
  c.num_experts_per_tok = 9;
  try {
    validate_model_config(c, "yaml model.config");
    ADD_FAILURE() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("yaml model.config: field 'num_experts_per_tok'"),
              std::string::npos)
        << e.what();
  }
  ModelConfig d = model_config_from_json(tiny_mistral(), "cfg.json");
  d.num_local_experts = 2;
  EXPECT_THROW(validate_model_config(d, "x"), Error);
}

// The committed golden configs were written by transformers 5 (rope_parameters, "dtype",
// "head_dim": null for Mixtral).
TEST(HfConfig, GoldenConfigsFromTransformers) {
  struct Case {
    const char* dir;
    const char* arch;
    int V, C, I, NH, NKV, HD, E, K, window;
    double theta;
  };
  const Case cases[] = {
      {"mixtral_gqa", "MixtralForCausalLM", 128, 32, 64, 4, 2, 8, 4, 2, 0, 1e6},
      {"mixtral_e3_k1", "MixtralForCausalLM", 100, 48, 80, 6, 2, 8, 3, 1, 0, 1e6},
      {"mixtral_swa_padded", "MixtralForCausalLM", 112, 32, 56, 4, 2, 8, 4, 2, 5, 1e6},
      {"mistral_dense", "MistralForCausalLM", 128, 32, 64, 4, 2, 8, 0, 0, 0, 1e6},
      {"llama_dense", "LlamaForCausalLM", 120, 32, 56, 4, 4, 8, 0, 0, 0, 1e4},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.dir);
    const ModelConfig c = load_model_config(std::string(MOETRON_SOURCE_DIR) + "/tests/golden/" +
                                            k.dir + "/config.json");
    EXPECT_EQ(c.architecture, k.arch);
    EXPECT_EQ(c.vocab_size, k.V);
    EXPECT_EQ(c.hidden_size, k.C);
    EXPECT_EQ(c.intermediate_size, k.I);
    EXPECT_EQ(c.num_hidden_layers, 2);
    EXPECT_EQ(c.num_attention_heads, k.NH);
    EXPECT_EQ(c.num_key_value_heads, k.NKV);
    EXPECT_EQ(c.head_dim, k.HD);
    EXPECT_EQ(c.num_local_experts, k.E);
    EXPECT_EQ(c.num_experts_per_tok, k.K);
    EXPECT_EQ(c.sliding_window, k.window);
    EXPECT_EQ(c.rope_theta, k.theta);
    EXPECT_EQ(c.rms_norm_eps, 1e-5);
    EXPECT_EQ(c.router_aux_loss_coef, k.E > 0 ? 0.02 : 0.0);
    EXPECT_EQ(c.torch_dtype, "float32");
    EXPECT_EQ(c.bos_token_id, 1);
    EXPECT_EQ(c.eos_token_id, 2);
    EXPECT_EQ(c.pad_token_id, -1);
  }
}

// Sizes no model has, refused from config.json alone (before anything is allocated from them),
// naming the field: the hostile-input review's 10^6 experts, 2^31 - 1 layers, hidden 10^9, and
// products that would wrap (heads = head_dim = 2^24).
TEST(HfConfigErrors, AbsurdSizesAreRefusedNamingTheField) {
  const std::pair<const char*, json> cases[] = {
      {"num_hidden_layers", 2147483647}, {"hidden_size", 1000000000}, {"vocab_size", 1 << 25},
      {"num_attention_heads", 1 << 24},  {"intermediate_size", 1 << 30},
  };
  for (const auto& [field, value] : cases) {
    json j = tiny_mistral();
    j["head_dim"] = 16;  // explicit: else a derived head_dim fails first
    j[field] = value;
    expect_config_error(j, {std::string("'") + field + "'", "beyond what moetron supports"});
  }
  json wrap = tiny_mistral();
  wrap["num_attention_heads"] = 4096;
  wrap["num_key_value_heads"] = 4096;
  wrap["head_dim"] = 16384;
  expect_config_error(wrap, {"'num_attention_heads' x 'head_dim'"});
  json many = tiny_mistral();
  many["architectures"] = {"MixtralForCausalLM"};
  many["model_type"] = "mixtral";
  many["num_local_experts"] = 1000000;
  many["num_experts_per_tok"] = 2;
  expect_config_error(many, {"'num_local_experts'", "beyond what moetron supports"});
  json big = tiny_mistral();  // each field within bounds, the product not
  big["hidden_size"] = 1 << 20;
  big["intermediate_size"] = 1 << 22;
  big["num_hidden_layers"] = 4096;
  big["head_dim"] = 64;
  expect_config_error(big, {"parameters", "beyond the 1.76e13"});
}

// ---- Qwen3 / Qwen3-MoE ------------------------------------------------------------------------

namespace {

json tiny_qwen3_moe() {
  return json::parse(R"({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
    "num_experts": 8, "num_experts_per_tok": 2, "mlp_only_layers": [2], "decoder_sparse_step": 1})");
}

}  // namespace

// The Hub config of Qwen3-30B-A3B (transformers 4 field names: num_experts, rope_theta).
TEST(HfConfig, Qwen3Moe30bA3bFromTheHub) {
  const ModelConfig c = load_model_config(std::string(MOETRON_SOURCE_DIR) + "/configs/models/qwen3-30b-a3b/config.json");
  EXPECT_EQ(c.architecture, "Qwen3MoeForCausalLM");
  EXPECT_EQ(c.model_type, "qwen3_moe");
  EXPECT_EQ(c.num_local_experts, 128);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.moe_intermediate_size, 768);
  EXPECT_EQ(c.intermediate_size, 6144);
  EXPECT_EQ(c.head_dim, 128);  // != hidden 2048 / 32 heads
  EXPECT_TRUE(c.qk_norm);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.sliding_window, 0);
  EXPECT_EQ(c.eos_token_id, 151645);
  for (int l = 0; l < 48; l++) EXPECT_TRUE(c.is_moe_layer(l)) << l;
  EXPECT_EQ(c.ffn_size(0), 768);
  // The inert window fields stay as they were.
  EXPECT_EQ(c.extra.at("max_window_layers"), 48);
  EXPECT_TRUE(c.extra.at("sliding_window").is_null());
}

TEST(HfConfig, Qwen3MoeLayersAndDefaults) {
  ModelConfig c = model_config_from_json(tiny_qwen3_moe(), "cfg.json");
  EXPECT_FALSE(c.norm_topk_prob);  // Qwen3MoeConfig's default
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.router_aux_loss_coef, 0.001);
  EXPECT_TRUE(c.is_moe_layer(0));
  EXPECT_TRUE(c.is_moe_layer(1));
  EXPECT_FALSE(c.is_moe_layer(2));  // mlp_only_layers
  EXPECT_TRUE(c.is_moe_layer(3));
  EXPECT_EQ(c.ffn_size(2), 96);
  EXPECT_EQ(c.ffn_size(3), 32);
  // decoder_sparse_step 2: layers 1 and 3 are sparse, 2 is listed dense anyway.
  json j = tiny_qwen3_moe();
  j["decoder_sparse_step"] = 2;
  c = model_config_from_json(j, "cfg.json");
  EXPECT_FALSE(c.is_moe_layer(0));
  EXPECT_TRUE(c.is_moe_layer(1));
  EXPECT_FALSE(c.is_moe_layer(2));
  EXPECT_TRUE(c.is_moe_layer(3));
  // transformers 5 writes num_local_experts; the two names must agree when both are given.
  j = tiny_qwen3_moe();
  j.erase("num_experts");
  j["num_local_experts"] = 8;
  EXPECT_EQ(model_config_from_json(j, "cfg.json").num_local_experts, 8);
  j["num_experts"] = 6;
  expect_config_error(j, {"'num_experts' (6)", "'num_local_experts' (8)", "disagree"});
}

TEST(HfConfig, Qwen3RoundTripAndDenseDefaults) {
  const ModelConfig moe = model_config_from_json(tiny_qwen3_moe(), "cfg.json");
  const json written = model_config_to_json(moe);
  EXPECT_EQ(written.at("num_experts"), 8);
  EXPECT_EQ(written.at("num_local_experts"), 8);
  EXPECT_EQ(written.at("mlp_only_layers"), json::array({2}));
  EXPECT_EQ(written.at("moe_intermediate_size"), 32);
  EXPECT_EQ(written.at("norm_topk_prob"), false);
  const ModelConfig back = model_config_from_json(written, "written");
  expect_same(moe, back);
  EXPECT_EQ(back.mlp_only_layers, moe.mlp_only_layers);
  EXPECT_EQ(back.moe_intermediate_size, 32);
  EXPECT_EQ(back.norm_topk_prob, false);
  // Dense Qwen3: head_dim defaults to 128 (Qwen3Config), q/k norms on.
  const ModelConfig dense = model_config_from_json(
      json::parse(R"({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 256,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2})"),
      "cfg.json");
  EXPECT_EQ(dense.model_type, "qwen3");
  EXPECT_EQ(dense.head_dim, 128);
  EXPECT_TRUE(dense.qk_norm);
  EXPECT_FALSE(dense.is_moe());
  expect_same(dense, model_config_from_json(model_config_to_json(dense), "written"));
}

TEST(HfConfigErrors, Qwen3FieldsMoetronDoesNotSupportAreNamed) {
  json j = tiny_qwen3_moe();
  j["use_sliding_window"] = true;
  expect_config_error(j, {"'use_sliding_window'", "not supported"});
  j = tiny_qwen3_moe();
  j["layer_types"] = {"full_attention", "sliding_attention", "full_attention", "full_attention"};
  expect_config_error(j, {"'layer_types'", "sliding_attention"});
  j = tiny_qwen3_moe();
  j["mlp_only_layers"] = {4};
  expect_config_error(j, {"'mlp_only_layers'", "holds 4", "[0, num_hidden_layers = 4)"});
  j["mlp_only_layers"] = {1, 1};
  expect_config_error(j, {"'mlp_only_layers'", "distinct"});
  j["mlp_only_layers"] = "1";
  expect_config_error(j, {"'mlp_only_layers'", "list"});
  j = tiny_qwen3_moe();
  j["decoder_sparse_step"] = 0;
  expect_config_error(j, {"'decoder_sparse_step'", ">= 1"});
  j = tiny_qwen3_moe();
  j["num_experts_per_tok"] = 9;
  expect_config_error(j, {"'num_experts_per_tok'", "num_experts = 8"});
  j = tiny_qwen3_moe();
  j["attention_bias"] = true;
  expect_config_error(j, {"'attention_bias'"});
  j = tiny_qwen3_moe();
  j["moe_intermediate_size"] = 0;
  expect_config_error(j, {"'moe_intermediate_size'", "positive"});
  // Mixtral has no such fields.
  json m = tiny_mixtral();
  m["norm_topk_prob"] = false;
  const ModelConfig kept = model_config_from_json(m, "cfg.json");  // not Mixtral's: kept verbatim
  EXPECT_TRUE(kept.norm_topk_prob);
  EXPECT_EQ(kept.extra.at("norm_topk_prob"), false);
  ModelConfig bad = model_config_from_json(tiny_mixtral(), "x");
  bad.mlp_only_layers = {0};
  EXPECT_THROW(validate_model_config(bad, "x"), Error);
  // An unknown architecture lists the supported ones.
  expect_config_error(json::parse(R"({"architectures": ["OlmoForCausalLM"], "vocab_size": 8})"),
                      {"Qwen3MoeForCausalLM", "Qwen3ForCausalLM", "MixtralForCausalLM"});
}

// Each golden Qwen3 config, as transformers 5 wrote it.
TEST(HfConfig, Qwen3GoldenConfigs) {
  const std::string g = std::string(MOETRON_SOURCE_DIR) + "/tests/golden/";
  const ModelConfig mixed = load_model_config(g + "qwen3_moe_mixed/config.json");
  EXPECT_EQ(mixed.head_dim, 12);
  EXPECT_EQ(mixed.num_local_experts, 4);
  EXPECT_EQ(mixed.mlp_only_layers, std::vector<int>{1});
  EXPECT_FALSE(mixed.norm_topk_prob);
  EXPECT_FALSE(mixed.is_moe_layer(1));
  const ModelConfig step = load_model_config(g + "qwen3_moe_norm_topk_padded/config.json");
  EXPECT_TRUE(step.norm_topk_prob);
  EXPECT_EQ(step.decoder_sparse_step, 2);
  EXPECT_FALSE(step.is_moe_layer(0));
  EXPECT_TRUE(step.is_moe_layer(3));
  const ModelConfig dense = load_model_config(g + "qwen3_dense/config.json");
  EXPECT_EQ(dense.architecture, "Qwen3ForCausalLM");
  EXPECT_EQ(dense.head_dim, 16);
}

// Qwen1.5-MoE-A2.7B's Hub config: Qwen2-MoE fields, q/k/v biases on (transformers 4 always has them).
TEST(HfConfig, Qwen2MoeFromTheHub) {
  const ModelConfig c =
      load_model_config(std::string(MOETRON_SOURCE_DIR) + "/configs/models/qwen1.5-moe-a2.7b/config.json");
  EXPECT_EQ(c.model_type, "qwen2_moe");
  EXPECT_EQ(c.num_local_experts, 60);
  EXPECT_EQ(c.num_experts_per_tok, 4);
  EXPECT_EQ(c.moe_intermediate_size, 1408);
  EXPECT_EQ(c.shared_expert_intermediate_size, 5632);
  EXPECT_TRUE(c.has_shared_expert());
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.sliding_window, 0);  // use_sliding_window false: the window fields are inert
  const ParamTable t(c);
  EXPECT_TRUE(t.find_hf("model.layers.0.self_attn.q_proj.bias") != nullptr);
  EXPECT_TRUE(t.find_hf("model.layers.23.mlp.shared_expert.up_proj.weight") != nullptr);
  EXPECT_TRUE(t.find_hf("model.layers.23.mlp.shared_expert_gate.weight") != nullptr);
  EXPECT_TRUE(t.find_hf("model.layers.5.mlp.experts.59.down_proj.weight") != nullptr);
  EXPECT_EQ(t.find_hf("model.layers.0.self_attn.o_proj.bias"), nullptr);  // o_proj has none
  // Written back and read again: the same model.
  const ModelConfig back = model_config_from_json(model_config_to_json(c), "written");
  expect_same(c, back);
  EXPECT_EQ(back.shared_expert_intermediate_size, 5632);
  EXPECT_TRUE(back.qkv_bias);
}

TEST(HfConfigErrors, Qwen2MoeFieldsElsewhereAreRefused) {
  ModelConfig bad = model_config_from_json(tiny_qwen3_moe(), "x");
  bad.shared_expert_intermediate_size = 16;
  EXPECT_THROW(validate_model_config(bad, "x"), Error);
  json j = json::parse(R"({"architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 64, "hidden_size": 32,
    "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": -1})");
  expect_config_error(j, {"'shared_expert_intermediate_size'", ">= 0"});
  j["shared_expert_intermediate_size"] = 0;  // no shared expert: allowed
  EXPECT_FALSE(model_config_from_json(j, "cfg.json").has_shared_expert());
  j["qkv_bias"] = "yes";
  expect_config_error(j, {"'qkv_bias'", "true or false"});
}

// OLMoE-1B-7B's Hub config, and what OLMoE refuses.
TEST(HfConfig, OlmoeFromTheHub) {
  const ModelConfig c = load_model_config(std::string(MOETRON_SOURCE_DIR) + "/configs/models/olmoe-1b-7b/config.json");
  EXPECT_EQ(c.model_type, "olmoe");
  EXPECT_EQ(c.num_local_experts, 64);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.intermediate_size, 1024);
  EXPECT_EQ(c.expert_intermediate_size(), 1024);
  EXPECT_TRUE(c.qk_norm && c.qk_norm_full);
  EXPECT_EQ(c.clip_qkv, 0.0);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_EQ(c.router_aux_loss_coef, 0.01);
  EXPECT_EQ(c.pad_token_id, 1);
  const ParamTable t(c);
  EXPECT_EQ(t.at(ParamKind::q_norm, 0).numel, 2048u);
  EXPECT_EQ(t.at(ParamKind::k_norm, 0).numel, 2048u);
  EXPECT_TRUE(t.find_hf("model.layers.15.mlp.experts.63.up_proj.weight") != nullptr);
  const ModelConfig back = model_config_from_json(model_config_to_json(c), "written");
  expect_same(c, back);
  EXPECT_TRUE(back.qk_norm_full);
  EXPECT_EQ(model_config_to_json(c).at("clip_qkv"), nullptr);
}

TEST(HfConfigErrors, OlmoeFieldsNamed) {
  json j = json::parse(R"({"architectures": ["OlmoeForCausalLM"], "vocab_size": 64, "hidden_size": 32,
    "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_experts": 4,
    "num_experts_per_tok": 2})");
  EXPECT_EQ(model_config_from_json(j, "cfg.json").clip_qkv, 0.0);
  j["clip_qkv"] = 8.0;
  EXPECT_EQ(model_config_from_json(j, "cfg.json").clip_qkv, 8.0);
  EXPECT_EQ(model_config_from_json(model_config_to_json(model_config_from_json(j, "c")), "w").clip_qkv, 8.0);
  j["clip_qkv"] = -1.0;
  expect_config_error(j, {"'clip_qkv'", "positive"});
  j["clip_qkv"] = nullptr;
  j["head_dim"] = 16;  // q_norm spans hidden_size: head_dim must be 32 / 4
  expect_config_error(j, {"'head_dim'", "hidden_size / num_attention_heads = 8"});
  j.erase("head_dim");
  j["attention_bias"] = true;
  expect_config_error(j, {"'attention_bias'"});
  // Under tp the norms split with their heads: rank 1 of 2 holds q_norm [16, 32) of 32.
  j.erase("attention_bias");
  const ModelConfig c = model_config_from_json(j, "cfg.json");
  ParamShard tp2;
  tp2.tp_size = 2;
  tp2.tp_rank = 1;
  const ParamTable t(c, tp2);
  const HfTensorRef* qn = t.find_hf("model.layers.0.self_attn.q_norm.weight");
  ASSERT_NE(qn, nullptr);
  EXPECT_EQ(qn->slice_dim, 0);
  EXPECT_EQ(qn->slice_begin, 16);
  EXPECT_EQ(qn->slice_end, 32);
  ModelConfig bad = model_config_from_json(tiny_mixtral(), "x");
  bad.clip_qkv = 4.0;
  EXPECT_THROW(validate_model_config(bad, "x"), Error);
}

// ---- DeepSeek-V3 / Kimi-K2 / GLM-4.5 (hf_config.h) -----------------------------------------------

namespace {

ModelConfig hub_config(const char* dir) {
  return load_model_config(std::string(MOETRON_SOURCE_DIR) + "/configs/models/" + dir + "/config.json");
}

json tiny_deepseek() {
  return json::parse(R"({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "vocab_size": 128, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8,
    "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2, "n_shared_experts": 2, "first_k_dense_replace": 1,
    "q_lora_rank": 16, "kv_lora_rank": 12, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6,
    "routed_scaling_factor": 2.5, "max_position_embeddings": 256,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
      "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1, "mscale": 0.8, "mscale_all_dim": 0.6}})");
}

json tiny_glm() {
  return json::parse(R"({"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
    "vocab_size": 128, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
    "partial_rotary_factor": 0.5, "use_qk_norm": true, "attention_bias": true, "routed_scaling_factor": 2.5,
    "rope_theta": 1000000.0})");
}

}  // namespace

TEST(HfConfig, DeepSeekV3FromTheHub) {
  const ModelConfig c = hub_config("deepseek-v3");
  EXPECT_EQ(c.architecture, "DeepseekV3ForCausalLM");
  EXPECT_EQ(c.num_local_experts, 256);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_TRUE(c.router_sigmoid);
  EXPECT_TRUE(c.has_selection_bias());
  EXPECT_EQ(c.n_group, 8);
  EXPECT_EQ(c.topk_group, 4);
  EXPECT_EQ(c.routed_scaling_factor, 2.5);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_EQ(c.shared_expert_intermediate_size, 2048);
  EXPECT_FALSE(c.shared_expert_gated());
  EXPECT_EQ(c.first_k_dense_replace, 3);
  EXPECT_FALSE(c.is_moe_layer(2));
  EXPECT_TRUE(c.is_moe_layer(3));
  EXPECT_EQ(c.ffn_size(0), 18432);
  EXPECT_EQ(c.ffn_size(60), 2048);
  EXPECT_TRUE(c.is_mla());
  EXPECT_EQ(c.q_lora_rank, 1536);
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.head_dim, 192);
  EXPECT_EQ(c.rope_dim(), 64);
  EXPECT_EQ(c.value_head_dim(), 128);
  EXPECT_TRUE(c.rope_interleave);
  EXPECT_EQ(c.rope_type, "yarn");
  EXPECT_EQ(c.yarn_factor, 40.0);
  EXPECT_EQ(c.yarn_original_max_position_embeddings, 4096);
  EXPECT_EQ(c.rope_theta, 1e4);
  // mscale = mscale_all_dim = 1: cos/sin unscaled; softmax scale x (0.1 ln 40 + 1)^2.
  EXPECT_DOUBLE_EQ(c.rope_attention_factor(), 1.0);
  EXPECT_NEAR(c.softmax_scale_factor(), std::pow(0.1 * std::log(40.0) + 1.0, 2), 1e-15);
  EXPECT_EQ(c.router_aux_loss_coef, 0.0);  // transformers' model has no auxiliary loss
  // DeepSeek's own fields stay verbatim.
  EXPECT_EQ(c.extra.at("topk_method"), "noaux_tc");
  EXPECT_EQ(c.extra.at("num_nextn_predict_layers"), 1);
  EXPECT_TRUE(c.extra.contains("quantization_config"));
  expect_same(c, model_config_from_json(model_config_to_json(c), "round-trip"));
}

TEST(HfConfig, KimiK2IsDeepSeekV3WithItsOwnModelType) {
  const ModelConfig c = hub_config("kimi-k2-instruct");
  EXPECT_EQ(c.architecture, "DeepseekV3ForCausalLM");
  EXPECT_EQ(c.model_type, "kimi_k2");  // written back as it was
  EXPECT_EQ(c.num_local_experts, 384);
  EXPECT_EQ(c.n_group, 1);
  EXPECT_EQ(c.first_k_dense_replace, 1);
  EXPECT_EQ(c.routed_scaling_factor, 2.827);
  EXPECT_EQ(c.yarn_factor, 32.0);
  EXPECT_EQ(c.yarn_beta_fast, 1.0);
  EXPECT_EQ(model_config_to_json(c).at("model_type"), "kimi_k2");
  expect_same(c, model_config_from_json(model_config_to_json(c), "round-trip"));
  // model_type alone finds the architecture.
  json j = tiny_deepseek();
  j.erase("architectures");
  j["model_type"] = "kimi_k2";
  EXPECT_EQ(model_config_from_json(j, "cfg.json").architecture, "DeepseekV3ForCausalLM");
}

TEST(HfConfig, Glm45AndAirFromTheHub) {
  const ModelConfig c = hub_config("glm-4.5");
  EXPECT_EQ(c.architecture, "Glm4MoeForCausalLM");
  EXPECT_EQ(c.num_local_experts, 160);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.rope_dim(), 64);  // partial_rotary_factor 0.5
  EXPECT_FALSE(c.rope_interleave);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_FALSE(c.qk_norm_full);
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_FALSE(c.is_mla());
  EXPECT_EQ(c.first_k_dense_replace, 3);
  EXPECT_EQ(c.shared_expert_intermediate_size, 1536);
  EXPECT_EQ(c.routed_scaling_factor, 2.5);
  EXPECT_EQ(c.rope_type, "default");
  EXPECT_DOUBLE_EQ(c.softmax_scale_factor(), 1.0);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int>{151329, 151336, 151338}));
  expect_same(c, model_config_from_json(model_config_to_json(c), "round-trip"));
  const ModelConfig air = hub_config("glm-4.5-air");
  EXPECT_FALSE(air.qk_norm);
  EXPECT_EQ(air.first_k_dense_replace, 1);
  EXPECT_EQ(air.routed_scaling_factor, 1.0);
  expect_same(air, model_config_from_json(model_config_to_json(air), "round-trip"));
  // Glm4MoeConfig's defaults: partial_rotary_factor 0.5, first_k_dense_replace 1, no q/k norm.
  json j = tiny_glm();
  for (const char* k : {"partial_rotary_factor", "first_k_dense_replace", "use_qk_norm", "attention_bias"}) j.erase(k);
  const ModelConfig d = model_config_from_json(j, "cfg.json");
  EXPECT_EQ(d.rope_dim(), 8);
  EXPECT_EQ(d.first_k_dense_replace, 1);
  EXPECT_FALSE(d.qk_norm);
  EXPECT_FALSE(d.qkv_bias);
  // transformers 5 keeps partial_rotary_factor inside rope_parameters.
  j = tiny_glm();
  j.erase("partial_rotary_factor");
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1e6}, {"partial_rotary_factor", 0.25}};
  EXPECT_EQ(model_config_from_json(j, "cfg.json").rope_dim(), 4);
}

TEST(HfConfig, DeepSeekTinyYarnAndPlainQ) {
  ModelConfig c = model_config_from_json(tiny_deepseek(), "cfg.json");
  EXPECT_EQ(c.head_dim, 12);
  // transformers' _compute_yarn_parameters: mscale and mscale_all_dim both set.
  const double m = 0.1 * 0.8 * std::log(4.0) + 1.0, mall = 0.1 * 0.6 * std::log(4.0) + 1.0;
  EXPECT_NEAR(c.rope_attention_factor(), m / mall, 1e-15);
  EXPECT_NEAR(c.softmax_scale_factor(), mall * mall, 1e-15);
  expect_same(c, model_config_from_json(model_config_to_json(c), "round-trip"));
  // transformers 4's rope_scaling gives the same, and a factor that disagrees between the two is refused.
  json j = tiny_deepseek();
  json rs = j["rope_parameters"];
  rs.erase("rope_theta");
  rs.erase("rope_type");
  rs["type"] = "yarn";
  j["rope_scaling"] = rs;
  j["rope_theta"] = 10000.0;
  j.erase("rope_parameters");
  expect_same(c, model_config_from_json(j, "cfg.json"));
  j["rope_parameters"] = tiny_deepseek()["rope_parameters"];
  j["rope_parameters"]["factor"] = 8.0;
  expect_config_error(j, {"'rope_parameters.factor'", "disagrees"});
  // q_lora_rank null: a plain q_proj.
  j = tiny_deepseek();
  j["q_lora_rank"] = nullptr;
  c = model_config_from_json(j, "cfg.json");
  EXPECT_EQ(c.q_lora_rank, 0);
  EXPECT_TRUE(model_config_to_json(c).at("q_lora_rank").is_null());
  // yarn without a factor: max_position_embeddings / original (transformers' rule).
  j = tiny_deepseek();
  j["rope_parameters"].erase("factor");
  EXPECT_EQ(model_config_from_json(j, "cfg.json").yarn_factor, 4.0);
}

TEST(HfConfigErrors, DeepSeekAndGlmRoutingAndRope) {
  json j = tiny_deepseek();
  j["n_group"] = 3;
  expect_config_error(j, {"'n_group' = 3", "divide n_routed_experts = 8"});
  j = tiny_deepseek();
  j["topk_group"] = 5;
  expect_config_error(j, {"'topk_group' = 5", "[1, n_group = 4]"});
  j = tiny_deepseek();
  j["n_group"] = 8;
  j["topk_group"] = 2;
  expect_config_error(j, {"'n_group' = 8", "at least 2"});
  j = tiny_deepseek();
  j["topk_group"] = 1;
  expect_config_error(j, {"'num_experts_per_tok' = 3", "topk_group = 1"});
  j = tiny_deepseek();
  j["rope_parameters"]["rope_type"] = "longrope";
  expect_config_error(j, {"'rope_parameters.rope_type'", "longrope", "not supported"});
  j = tiny_deepseek();
  j.erase("rope_parameters");
  j["rope_scaling"] = {{"type", "dynamic"}, {"factor", 2.0}};
  expect_config_error(j, {"'rope_scaling.type'", "dynamic", "not supported"});
  j = tiny_deepseek();
  j["rope_parameters"]["factor"] = 0.5;
  expect_config_error(j, {"'rope_scaling.factor'", ">= 1"});
  j = tiny_deepseek();
  j["rope_parameters"]["low_freq_factor"] = 1.0;
  expect_config_error(j, {"'rope_parameters.low_freq_factor'", "not supported"});
  j = tiny_deepseek();
  j["routed_scaling_factor"] = 0.0;
  expect_config_error(j, {"'routed_scaling_factor'", "positive"});
  j = tiny_deepseek();
  j["num_key_value_heads"] = 2;
  expect_config_error(j, {"'num_key_value_heads' = 2", "latent attention"});
  j = tiny_deepseek();
  j["qk_rope_head_dim"] = 3;
  expect_config_error(j, {"rotated width 3", "even"});
  j = tiny_deepseek();
  j["attention_bias"] = true;
  expect_config_error(j, {"'attention_bias' = true", "not supported"});
  j = tiny_deepseek();
  j["scoring_func"] = "softmax";
  expect_config_error(j, {"'scoring_func'", "softmax", "not supported"});
  j = tiny_deepseek();
  j["first_k_dense_replace"] = 4;
  expect_config_error(j, {"'first_k_dense_replace' = 4", "num_hidden_layers = 3"});
  j = tiny_glm();
  j["partial_rotary_factor"] = 0.3;  // int(16 x 0.3) = 4: fine
  EXPECT_EQ(model_config_from_json(j, "cfg.json").rope_dim(), 4);
  j["partial_rotary_factor"] = 0.2;  // int(3.2) = 3: odd
  expect_config_error(j, {"rotated width 3", "even"});
  j["partial_rotary_factor"] = 1.5;
  expect_config_error(j, {"'partial_rotary_factor'", "(0, 1]"});
  j = tiny_glm();
  j["rope_interleave"] = true;  // not a GLM field: kept in extra, never followed
  EXPECT_FALSE(model_config_from_json(j, "cfg.json").rope_interleave);
  // The DeepSeek fields are refused on other families (built in code, past the reader).
  ModelConfig m = model_config_from_json(tiny_mixtral(), "cfg.json");
  m.n_group = 2;
  try {
    validate_model_config(m, "cfg.json");
    ADD_FAILURE() << "n_group on Mixtral";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'n_group'"), std::string::npos) << e.what();
  }
}
