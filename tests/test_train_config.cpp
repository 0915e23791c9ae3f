// Tests for train/config: the YAML training config, dotted overrides, unknown-key suggestions,
// type errors with file:line, every validation rule with its message, the resolved-config round
// trip, and the two example configs under configs/.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/hf_config.h"
#include "train/config.h"

using namespace moetron;
using nlohmann::json;

namespace {

const std::string kSource = MOETRON_SOURCE_DIR;

// A small valid config; line numbers matter to the tests below (line 1 is "run_dir").
const char* kBase = R"(run_dir: runs/t
device: cpu
seed: 7
model:
  init: random
  config: {architectures: [MixtralForCausalLM], vocab_size: 128, hidden_size: 64}
data:
  path: data/x
  seq_length: 128
train:
  global_batch_size: 8
  micro_batch_size: 2
  max_steps: 10
  lr: 1e-3
  min_lr: 1e-4
  schedule: cosine
)";

TrainConfig load_text(const std::string& yaml, const std::vector<std::string>& overrides = {}) {
  return train_config_from_yaml_text(yaml, "cfg.yaml", overrides);
}

// The error message of loading `yaml` with `overrides`; fails the test when no error is thrown.
std::string error_of(const std::string& yaml, const std::vector<std::string>& overrides = {}) {
  try {
    load_text(yaml, overrides);
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an Error for overrides " << testing::PrintToString(overrides) << " on:\n" << yaml;
  return "";
}

#define EXPECT_HAS(haystack, needle) EXPECT_NE(std::string(haystack).find(needle), std::string::npos) \
    << "message: " << (haystack) << "\nexpected to contain: " << (needle)

}  // namespace

TEST(TrainConfig, BaseLoadsWithDefaultsForAbsentKeys) {
  const TrainConfig c = load_text(kBase);
  EXPECT_EQ(c.run_dir, "runs/t");
  EXPECT_EQ(c.seed, 7u);
  EXPECT_EQ(c.model.config["hidden_size"], 64);
  EXPECT_EQ(c.model.config["architectures"], json::array({"MixtralForCausalLM"}));
  EXPECT_EQ(c.data.seq_length, 128);
  EXPECT_EQ(c.train.max_steps, 10);
  EXPECT_DOUBLE_EQ(c.train.lr, 1e-3);
  const TrainConfig d;  // absent keys keep the struct's defaults
  EXPECT_EQ(c.train.adam_beta2, d.train.adam_beta2);
  EXPECT_EQ(c.train.warmup_steps, d.train.warmup_steps);
  EXPECT_EQ(c.parallel, d.parallel);
  EXPECT_EQ(c.checkpoint, d.checkpoint);
  EXPECT_FALSE(c.moe.aux_loss_coef.has_value());
  EXPECT_FALSE(c.moe.capacity_factor.has_value());
}

TEST(TrainConfig, NumbersInEveryYamlSpelling) {
  // 1e-5 (YAML 1.2) and 1.0e-5 (YAML 1.1) and plain decimals all read as the same double.
  for (const char* text : {"1e-5", "1.0e-5", "0.00001", "1E-5", "+1e-5", "10e-6"}) {
    const TrainConfig c = load_text(kBase, {std::string("train.min_lr=") + text});
    EXPECT_DOUBLE_EQ(c.train.min_lr, 1e-5) << text;
  }
  EXPECT_EQ(load_text(kBase, {"train.weight_decay=0"}).train.weight_decay, 0.0);  // an int where a double goes
  EXPECT_EQ(load_text(kBase, {"train.max_steps=1e3"}).train.max_steps, 1000);      // an integral float
  EXPECT_EQ(load_text(kBase, {"train.max_steps=200.0"}).train.max_steps, 200);
  EXPECT_EQ(load_text(kBase, {"seed=18446744073709551615"}).seed, 18446744073709551615ull);
  EXPECT_EQ(load_text(kBase, {"train.epochs=2.5", "train.max_steps=0"}).train.epochs, 2.5);
}

TEST(TrainConfig, UnknownKeyNamesFileLineAndClosestKey) {
  std::string yaml = kBase;
  yaml += "  lrr: 0.1\n";  // line 17, under train
  const std::string e = error_of(yaml);
  EXPECT_HAS(e, "cfg.yaml:17:3: unknown key 'train.lrr' (did you mean train.lr?)");
}

TEST(TrainConfig, UnknownKeySuggestions) {
  struct Case {
    std::string yaml_tail, expected;
  };
  const std::vector<Case> cases = {
      {"trian: {lr: 1}\n", "unknown key 'trian' (did you mean train?)"},                      // a misspelt section
      {"  warmup_step: 3\n", "unknown key 'train.warmup_step' (did you mean train.warmup_steps?)"},
      {"  tp: 2\n", "unknown key 'train.tp' (did you mean parallel.tp?)"},                    // right name, wrong section
      {"  learning_rate: 3\n", "unknown key 'train.learning_rate' (did you mean train.lr?)"},  // a Megatron/HF name
      {"  recompute_granularity: full\n", "unknown key 'train.recompute_granularity' (did you mean train.recompute?)"},
      {"  tensor_model_parallel_size: 8\n", "(did you mean parallel.tp?)"},
      {"  zzzzzzzzzzzz: 1\n", "unknown key 'train.zzzzzzzzzzzz' (valid keys under train: global_batch_size, "
                              "micro_batch_size, max_steps"},
      {"qqqqqqqqqqqqqqqq: 1\n", "(valid top-level keys: run_dir, device, seed, model, data, train, moe, lora, parallel,"},
      {"parallel: {tp: 1, pipeline: 2}\n", "cfg.yaml:17:19: unknown key 'parallel.pipeline'"},
  };
  for (const Case& c : cases) EXPECT_HAS(error_of(kBase + c.yaml_tail), c.expected);
}

TEST(TrainConfig, FreeFormKeysInsideModelConfigAreAccepted) {
  const TrainConfig c = load_text(kBase, {"model.config.some_new_hf_field=abc", "model.config.rope_scaling.factor=2"});
  EXPECT_EQ(c.model.config["some_new_hf_field"], "abc");
  EXPECT_EQ(c.model.config["rope_scaling"]["factor"], 2);
}

TEST(TrainConfig, WrongTypesNameFileLineAndValue) {
  struct Case {
    std::string from, to, expected;
  };
  const std::vector<Case> cases = {
      {"max_steps: 10", "max_steps: ten", "cfg.yaml:13:14: train.max_steps: expected an integer, got 'ten'"},
      {"max_steps: 10", "max_steps: 10.5", "cfg.yaml:13:14: train.max_steps: expected an integer, got '10.5'"},
      {"max_steps: 10", "max_steps: \"10\"", "train.max_steps: expected an integer, got the quoted string \"10\""},
      {"lr: 1e-3", "lr: fast", "cfg.yaml:14:7: train.lr: expected a number, got 'fast'"},
      {"lr: 1e-3", "lr: [1, 2]", "cfg.yaml:14:3: train.lr: expected a number, got a sequence"},
      {"lr: 1e-3", "lr: .inf", "train.lr: expected a number, got '.inf'"},
      {"lr: 1e-3", "lr:", "cfg.yaml:14:3: train.lr: expected a number, got null"},
      {"seed: 7", "seed: -1", "cfg.yaml:3:7: seed: expected a non-negative integer, got '-1'"},
      {"seq_length: 128", "seq_length: 99999999999", "data.seq_length: expected an integer in [-2147483648, "
                                                     "2147483647], got '99999999999'"},
      {"path: data/x", "path: {a: 1}", "data.path: expected a string, got a mapping"},
      {"device: cpu", "device: [cpu]", "cfg.yaml:2:1: device: expected a string, got a sequence"},
      {"  init: random", "  init: random\n  dtype: {}", "model.dtype: expected a string, got a mapping"},
  };
  for (const Case& c : cases) {
    std::string yaml = kBase;
    const size_t at = yaml.find(c.from);
    ASSERT_NE(at, std::string::npos) << c.from;
    yaml.replace(at, c.from.size(), c.to);
    EXPECT_HAS(error_of(yaml), c.expected);
  }
  // Sections and model.config must be mappings; booleans are true/false.
  EXPECT_HAS(error_of(std::string(kBase) + "parallel: 8\n"),
             "cfg.yaml:17:11: parallel: expected a mapping (a section with keys tp, pp, ep, layers_per_stage, zero1, device_comm), got '8'");
  EXPECT_HAS(error_of(kBase, {"model.config=[1]"}), "model.config: expected a mapping of HF config.json fields");
  EXPECT_HAS(error_of(std::string(kBase) + "log: {tensorboard: yes}\n"),
             "cfg.yaml:17:20: log.tensorboard: expected true or false, got 'yes'");
  EXPECT_HAS(error_of(std::string(kBase) + "log: {tensorboard: \"true\"}\n"), "log.tensorboard: expected true or false");
}

TEST(TrainConfig, DuplicateKeysAndSyntaxErrorsNameTheLine) {
  EXPECT_HAS(error_of(std::string(kBase) + "seed: 8\n"), "cfg.yaml:17:1: duplicate key 'seed'");
  EXPECT_HAS(error_of(std::string(kBase) + "log: {every_steps: 1\n"), "cfg.yaml:");
  EXPECT_HAS(error_of(std::string(kBase) + "log: {every_steps: 1\n"), "YAML syntax error");
  EXPECT_HAS(error_of(""), "cfg.yaml: the config is empty");
  EXPECT_HAS(error_of("- a\n- b\n"), "expected a mapping at the top level");
}

TEST(TrainConfig, Overrides) {
  const TrainConfig c = load_text(kBase, {
                                             "train.lr=3e-4",                  // nested, present in the file
                                             "parallel.tp=2",                  // a section absent from the file
                                             "moe.capacity_factor=1.25",       // an optional
                                             "model.config.hidden_size=32",    // one HF field
                                             "model.config.num_local_experts=4",
                                             "checkpoint={every_steps: 5, resume: none}",  // a whole section
                                             "data.path=/abs/path with space",
                                             "train.lr=5e-4",                  // later overrides win
                                         });
  EXPECT_DOUBLE_EQ(c.train.lr, 5e-4);
  EXPECT_EQ(c.parallel.tp, 2);
  EXPECT_EQ(c.moe.capacity_factor, 1.25);
  EXPECT_EQ(c.model.config["hidden_size"], 32);
  EXPECT_EQ(c.model.config["num_local_experts"], 4);
  EXPECT_EQ(c.model.config["vocab_size"], 128);  // the rest of model.config stays
  EXPECT_EQ(c.checkpoint.every_steps, 5);
  EXPECT_EQ(c.checkpoint.resume, "none");
  EXPECT_EQ(c.checkpoint.keep_last, 3);
  EXPECT_EQ(c.data.path, "/abs/path with space");

  // null clears an optional field set in the file.
  std::string yaml = std::string(kBase) + "moe: {aux_loss_coef: 0.01}\n";
  EXPECT_EQ(load_text(yaml).moe.aux_loss_coef, 0.01);
  EXPECT_FALSE(load_text(yaml, {"moe.aux_loss_coef=null"}).moe.aux_loss_coef.has_value());
  EXPECT_FALSE(load_text(yaml, {"moe.aux_loss_coef=~"}).moe.aux_loss_coef.has_value());
}

TEST(TrainConfig, OverrideErrorsNameTheOverride) {
  EXPECT_HAS(error_of(kBase, {"train.lr"}), "cfg.yaml: override 'train.lr': expected KEY=VALUE");
  EXPECT_HAS(error_of(kBase, {"=3"}), "override '=3': '' is not a dotted key");
  EXPECT_HAS(error_of(kBase, {"train..lr=3"}), "override 'train..lr=3': 'train..lr' is not a dotted key");
  EXPECT_HAS(error_of(kBase, {"train lr=3"}), "override 'train lr=3': 'train lr' is not a dotted key");
  EXPECT_HAS(error_of(kBase, {"train.lr=[1,"}), "override 'train.lr=[1,': the value is not valid YAML");
  EXPECT_HAS(error_of(kBase, {"train.lrr=3"}),
             "cfg.yaml: override 'train.lrr=3': unknown key 'train.lrr' (did you mean train.lr?)");
  EXPECT_HAS(error_of(kBase, {"trian.lr=3"}), "unknown key 'trian.lr' (did you mean train.lr?)");
  EXPECT_HAS(error_of(kBase, {"train.max_steps=ten"}),
             "cfg.yaml: override 'train.max_steps=ten': train.max_steps: expected an integer, got 'ten'");
  EXPECT_HAS(error_of(kBase, {"train.schedule=cosin"}),
             "cfg.yaml: override 'train.schedule=cosin': train.schedule: expected one of cosine | linear | constant");
  EXPECT_HAS(error_of(kBase, {"model.config.architectures.x=1"}),
             "model.config.architectures is [\"MixtralForCausalLM\"], not a mapping");
}

TEST(TrainConfig, EveryValidationRuleHasItsMessage) {
  struct Case {
    std::vector<std::string> overrides;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {{"run_dir=''"}, "run_dir: must not be empty"},
      {{"device=gpu"}, "device: expected one of cpu | cuda, got 'gpu'"},
      {{"model.dtype=fp16"}, "model.dtype: expected one of fp32 | bf16, got 'fp16'"},
      {{"model.init=''"}, "model.init: must not be empty"},
      {{"model.config={}"}, "model.config: is empty, but model.init is 'random'"},
      {{"model.init=/models/m"}, "model.config: must be empty when model.init is a directory ('/models/m')"},
      {{"data.path=''"}, "data.path: must not be empty (a directory written by `moetron data prepare`)"},
      {{"data.seq_length=0"}, "data.seq_length: must be a positive integer, got 0"},
      {{"data.over_long=truncate"}, "data.over_long: expected one of split | drop, got 'truncate'"},
      {{"train.global_batch_size=0"}, "train.global_batch_size: must be a positive integer, got 0"},
      {{"train.micro_batch_size=-1"}, "train.micro_batch_size: must be a positive integer, got -1"},
      {{"train.micro_batch_size=3"}, "train.global_batch_size (8) must be divisible by train.micro_batch_size (3)"},
      {{"train.max_steps=0"}, "train: set exactly one of max_steps > 0 or epochs > 0 (got max_steps 0, epochs 0)"},
      {{"train.epochs=3"}, "train: set exactly one of max_steps > 0 or epochs > 0 (got max_steps 10, epochs 3)"},
      {{"train.max_steps=-5"}, "train.max_steps: must be >= 0, got -5"},
      {{"train.epochs=-1"}, "train.epochs: must be in [0, 1000000], got -1"},
      // epochs become a step count (an integer): 1e300 wrapped to "the run has no steps".
      {{"train.max_steps=0", "train.epochs=1e300"}, "train.epochs: must be in [0, 1000000], got 1e+300"},
      {{"train.lr=1e-5"}, "train.lr (1e-05) must be >= train.min_lr (0.0001)"},
      {{"train.min_lr=-1e-6", "train.lr=0"}, "train.min_lr: must be >= 0, got -1e-06"},
      {{"train.warmup_steps=-1"}, "train.warmup_steps: must be >= 0, got -1"},
      {{"train.schedule=step"}, "train.schedule: expected one of cosine | linear | constant, got 'step'"},
      {{"train.recompute=true"}, "train.recompute: expected one of none | full | selective, got 'true'"},
      {{"train.weight_decay=-0.1"}, "train.weight_decay: must be >= 0, got -0.1"},
      {{"train.adam_beta1=1"}, "train.adam_beta1: must be in [0, 1), got 1"},
      {{"train.adam_beta2=-0.5"}, "train.adam_beta2: must be in [0, 1), got -0.5"},
      {{"train.adam_eps=0"}, "train.adam_eps: must be > 0, got 0"},
      {{"train.grad_clip=-1"}, "train.grad_clip: must be >= 0 (0: no clipping), got -1"},
      {{"train.nan_skip_limit=0"}, "train.nan_skip_limit: must be a positive integer, got 0"},
      {{"train.exit_interval=-1"}, "train.exit_interval: must be >= 0 (0: never), got -1"},
      {{"moe.aux_loss_coef=-0.01"}, "moe.aux_loss_coef: must be >= 0 (or null: the model's), got -0.01"},
      {{"moe.aux_loss=switch"}, "moe.aux_loss: expected one of hf_pooled | per_layer | sequence, got 'switch'"},
      {{"moe.bias_update_rate=-0.1"}, "moe.bias_update_rate: must be in [0, 1] (0: off; DeepSeek-V3 used 1e-3), got -0.1"},
      {{"moe.z_loss_coef=-1"}, "moe.z_loss_coef: must be >= 0, got -1"},
      {{"moe.capacity_factor=0"}, "moe.capacity_factor: must be in (0, 4096] (or null: dropless), got 0"},
      {{"moe.capacity_factor=1e300"}, "moe.capacity_factor: must be in (0, 4096] (or null: dropless), got 1e+300"},
      {{"parallel.tp=0"}, "parallel.tp: must be a positive integer, got 0"},
      {{"parallel.pp=0"}, "parallel.pp: must be a positive integer, got 0"},
      {{"parallel.ep=-2"}, "parallel.ep: must be a positive integer, got -2"},
      {{"checkpoint.every_steps=-1"}, "checkpoint.every_steps: must be >= 0 (0: only at the end), got -1"},
      {{"checkpoint.keep_last=0"}, "checkpoint.keep_last: must be a positive integer, got 0"},
      {{"checkpoint.resume=''"}, "checkpoint.resume: must not be empty"},
      {{"log.every_steps=0"}, "log.every_steps: must be a positive integer, got 0"},
      {{"eval.every_steps=-1"}, "eval.every_steps: must be >= 0 (0: no evaluation), got -1"},
      {{"eval.batches=0"}, "eval.batches: must be a positive integer, got 0"},
  };
  for (const Case& c : cases) {
    const std::string e = error_of(kBase, c.overrides);
    EXPECT_HAS(e, c.expected);
    EXPECT_HAS(e, "cfg.yaml");  // every message names the config (and here the override that set the value)
  }
  // The boundaries that are allowed.
  EXPECT_NO_THROW(load_text(kBase, {"train.lr=1e-4"}));  // lr == min_lr
  EXPECT_NO_THROW(load_text(kBase, {"train.adam_beta1=0", "train.grad_clip=0", "train.warmup_steps=0",
                                    "checkpoint.every_steps=0", "eval.every_steps=0", "moe.aux_loss_coef=0"}));
  EXPECT_NO_THROW(load_text(kBase, {"train.max_steps=0", "train.epochs=0.5"}));
  EXPECT_NO_THROW(load_text(kBase, {"train.max_steps=0", "train.epochs=1e6", "moe.capacity_factor=4096"}));
  EXPECT_NO_THROW(load_text(kBase, {"model.init=/models/m", "model.config={}"}));
}

TEST(TrainConfig, ValidationErrorsNameTheFileLineOfTheKey) {
  std::string yaml = kBase;
  yaml.replace(yaml.find("schedule: cosine"), 16, "schedule: cosin");
  EXPECT_HAS(error_of(yaml), "cfg.yaml:16:13: train.schedule: expected one of cosine | linear | constant, got 'cosin'");
  // A rule on a key left at its default names the file.
  EXPECT_HAS(error_of(kBase, {"train.lr=1e-4", "train.min_lr=2e-4"}), "cfg.yaml: override 'train.lr=1e-4': train.lr");
  TrainConfig c = load_text(kBase);
  c.train.micro_batch_size = 3;
  try {
    validate_train_config(c, "in-code");
    ADD_FAILURE() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_HAS(e.what(), "in-code: train.global_batch_size (8) must be divisible by train.micro_batch_size (3)");
  }
}

TEST(TrainConfig, ResolvedYamlRoundTrips) {
  // Values chosen to be awkward to write: strings that look like other types, floats with long
  // expansions, nested HF fields, a set optional and an unset one.
  const TrainConfig c = load_text(kBase, {
      "run_dir=\"123\"", "checkpoint.resume=\"true\"", "data.path='null'", "train.lr=0.1234567890123",
      "train.min_lr=1e-9", "train.adam_eps=3e-300", "moe.capacity_factor=1.0", "moe.z_loss_coef=0.001",
      "model.config.rope_theta=1000000.0", "model.config.rms_norm_eps=1e-05",
      "model.config.name_or_path=\"007\"", "model.config.eos_token_id=[2, 32000]",
      "model.config.rope_scaling={type: linear, factor: 2.0}", "model.config.sliding_window=null",
      "model.config.flag=true", "model.config.big=18446744073709551615", "seed=0", "data.packing=false",
      "log.tensorboard=false", "parallel.zero1=false", "parallel.layers_per_stage=[3, 5]"});
  EXPECT_EQ(c.run_dir, "123");
  EXPECT_EQ(c.checkpoint.resume, "true");
  EXPECT_EQ(c.data.path, "null");
  EXPECT_TRUE(c.model.config["rope_theta"].is_number_float());
  EXPECT_TRUE(c.model.config["sliding_window"].is_null());
  EXPECT_EQ(c.parallel.layers_per_stage, (std::vector<int>{3, 5}));
  const std::string yaml = train_config_to_yaml(c);
  const TrainConfig back = load_text(yaml);
  EXPECT_EQ(back, c) << yaml;
  EXPECT_EQ(train_config_to_json(back), train_config_to_json(c));
  EXPECT_TRUE(back.model.config["rope_theta"].is_number_float()) << "a float stays a float: " << yaml;
  EXPECT_EQ(train_config_to_yaml(back), yaml);  // the dump is a fixed point

  // Every key appears in the dump, and the example configs round-trip too.
  for (const std::string& key : train_config_keys()) {
    const std::string leaf = key.substr(key.rfind('.') == std::string::npos ? 0 : key.rfind('.') + 1);
    EXPECT_HAS(yaml, leaf + ":");
  }
  for (const char* name : {"tiny-mixtral.yaml", "mixtral-8x7b-sft.yaml"}) {
    const TrainConfig e = load_train_config(kSource + "/configs/" + name, {});
    EXPECT_EQ(load_text(train_config_to_yaml(e)), e) << name;
  }
}

// parallel.layers_per_stage is a list of positive integers ([] or null: an even split).
TEST(TrainConfig, LayersPerStageIsAListOfPositiveIntegers) {
  EXPECT_EQ(load_text(kBase, {"parallel.layers_per_stage=[1, 3]"}).parallel.layers_per_stage, (std::vector<int>{1, 3}));
  EXPECT_TRUE(load_text(kBase, {"parallel.layers_per_stage=null"}).parallel.layers_per_stage.empty());
  EXPECT_TRUE(load_text(kBase, {"parallel.layers_per_stage=[]"}).parallel.layers_per_stage.empty());
  EXPECT_TRUE(load_text(kBase).parallel.layers_per_stage.empty());
  EXPECT_HAS(error_of(kBase, {"parallel.layers_per_stage=4"}),
             "override 'parallel.layers_per_stage=4': parallel.layers_per_stage: expected a list of integers");
  EXPECT_HAS(error_of(kBase, {"parallel.layers_per_stage=[2, two]"}), "expected a list of integers, e.g. [3, 5]");
  EXPECT_HAS(error_of(kBase, {"parallel.layers_per_stage=[2, 0]"}),
             "parallel.layers_per_stage: entry 1 (stage 1) must be >= 1, got 0");
}

TEST(TrainConfig, JsonHasEveryKeyInItsSection) {
  const TrainConfig c = load_text(kBase, {"moe.capacity_factor=2"});
  const json j = train_config_to_json(c);
  for (const std::string& key : train_config_keys()) {
    std::string pointer = "/" + key;
    std::replace(pointer.begin(), pointer.end(), '.', '/');
    EXPECT_TRUE(j.contains(json::json_pointer(pointer))) << key;
  }
  EXPECT_EQ(j["train"]["lr"], 1e-3);
  EXPECT_EQ(j["moe"]["capacity_factor"], 2.0);
  EXPECT_TRUE(j["moe"]["aux_loss_coef"].is_null());
  EXPECT_EQ(j["model"]["config"]["hidden_size"], 64);
  EXPECT_EQ(train_config_keys().size(), 50u);  // update with the key table
  EXPECT_EQ(j["moe"]["bias_update_rate"], 0.0);
  EXPECT_EQ(j["lora"]["rank"], 0);
  EXPECT_EQ(j["lora"]["targets"], json({"attention", "experts"}));
}

// The lora section: a list of names, dumped and read back equal.
TEST(TrainConfig, LoraSectionRoundTrips) {
  const TrainConfig c = load_text(kBase, {"lora={rank: 8, alpha: 16, targets: [q_proj, experts.down_proj], rslora: true}"});
  EXPECT_EQ(c.lora.rank, 8);
  EXPECT_EQ(c.lora.targets, (std::vector<std::string>{"q_proj", "experts.down_proj"}));
  EXPECT_TRUE(c.lora.rslora);
  EXPECT_EQ(train_config_from_yaml_text(train_config_to_yaml(c), "dump", {}), c);
  EXPECT_THROW(load_text(kBase, {"lora.targets=q_proj"}), Error);  // a list, not a scalar
}

TEST(TrainConfig, TinyMixtralExampleLoads) {
  const TrainConfig c = load_train_config(kSource + "/configs/tiny-mixtral.yaml", {});
  EXPECT_EQ(c.device, "cpu");
  EXPECT_EQ(c.model.init, "random");
  EXPECT_EQ(c.data.path, "runs/demo-data");
  EXPECT_EQ(c.data.seq_length, 256);
  EXPECT_EQ(c.train.global_batch_size, 8);
  EXPECT_EQ(c.train.micro_batch_size, 2);
  EXPECT_EQ(c.train.max_steps, 30);
  EXPECT_DOUBLE_EQ(c.train.lr, 3e-3);
  EXPECT_DOUBLE_EQ(c.train.min_lr, 3e-4);
  EXPECT_EQ(c.train.warmup_steps, 3);
  EXPECT_EQ(c.train.schedule, "cosine");
  EXPECT_EQ(c.checkpoint.every_steps, 10);
  EXPECT_EQ(c.log.every_steps, 1);
  EXPECT_EQ(c.eval.every_steps, 10);
  EXPECT_EQ(c.eval.batches, 2);
  const ModelConfig m = model_config_from_json(c.model.config, "tiny-mixtral.yaml model.config");
  EXPECT_EQ(m.architecture, "MixtralForCausalLM");
  EXPECT_EQ(m.vocab_size, 32000);
  EXPECT_EQ(m.hidden_size, 64);
  EXPECT_EQ(m.num_hidden_layers, 2);
  EXPECT_EQ(m.num_attention_heads, 4);
  EXPECT_EQ(m.num_key_value_heads, 2);
  EXPECT_EQ(m.num_local_experts, 4);
  EXPECT_EQ(m.num_experts_per_tok, 2);
  EXPECT_EQ(m.intermediate_size, 128);
  EXPECT_DOUBLE_EQ(m.rms_norm_eps, 1e-5);  // written 1.0e-5 (the YAML 1.1 spelling)
  EXPECT_GE(m.max_position_embeddings, c.data.seq_length);
}

TEST(TrainConfig, MixtralSftRecipeLoads) {
  const TrainConfig c = load_train_config(kSource + "/configs/mixtral-8x7b-sft.yaml", {});
  EXPECT_NE(c.model.init, "random");
  EXPECT_TRUE(c.model.config.empty());
  EXPECT_EQ(c.model.dtype, "bf16");
  EXPECT_EQ(c.data.seq_length, 2048);
  EXPECT_EQ(c.train.global_batch_size, 32);
  EXPECT_EQ(c.train.micro_batch_size, 1);
  EXPECT_EQ(c.train.max_steps, 0);
  EXPECT_EQ(c.train.epochs, 3.0);
  EXPECT_DOUBLE_EQ(c.train.lr, 1e-5);
  EXPECT_DOUBLE_EQ(c.train.min_lr, 1e-6);
  EXPECT_EQ(c.train.warmup_steps, 10);
  EXPECT_EQ(c.train.schedule, "cosine");
  EXPECT_DOUBLE_EQ(c.train.weight_decay, 0.1);
  EXPECT_DOUBLE_EQ(c.train.adam_beta1, 0.9);
  EXPECT_DOUBLE_EQ(c.train.adam_beta2, 0.95);
  EXPECT_DOUBLE_EQ(c.train.grad_clip, 1.0);
  EXPECT_FALSE(c.moe.aux_loss_coef.has_value());  // the model's 0.02
  // The layout `plan --search` ranks first on 16 H100 80 GB (test_plan: PlanCli.Search*).
  EXPECT_EQ(c.parallel.tp, 4);
  EXPECT_EQ(c.parallel.pp, 2);
  EXPECT_EQ(c.parallel.ep, 2);
  EXPECT_EQ(c.train.recompute, "selective");
  // The placeholder directory can be replaced from the command line.
  EXPECT_EQ(load_train_config(kSource + "/configs/mixtral-8x7b-sft.yaml", {"model.init=/data/m"}).model.init, "/data/m");
}

TEST(TrainConfig, MissingFileIsNamed) {
  try {
    load_train_config("/nonexistent/x.yaml", {});
    ADD_FAILURE() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_HAS(e.what(), "/nonexistent/x.yaml: cannot open the training config");
  }
}


// The hostile-input review's alias bomb: under 1 KB of YAML whose aliases name 10^10 leaves in
// model.config.  The copy into JSON stops at 100000 nodes with an error naming the value, before
// the expansion (10^10 values) could take its memory.
TEST(TrainConfig, YamlAliasBombIsRefusedBeforeExpanding) {
  std::string yaml = "run_dir: runs/t\nmodel:\n  init: random\n  config:\n    architectures: [MixtralForCausalLM]\n";
  yaml += "    l0: &l0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n";
  for (int i = 1; i <= 9; i++) {
    yaml += "    l" + std::to_string(i) + ": &l" + std::to_string(i) + " [";
    for (int j = 0; j < 10; j++) yaml += (j ? ", *l" : "*l") + std::to_string(i - 1);
    yaml += "]\n";
  }
  yaml += "data: {path: d, seq_length: 8}\ntrain: {global_batch_size: 1, micro_batch_size: 1, max_steps: 1}\n";
  ASSERT_LT(yaml.size(), 1200u);
  const std::string e = error_of(yaml);
  EXPECT_NE(e.find("expands to more than 100000 YAML nodes"), std::string::npos) << e;
  EXPECT_NE(e.find("model.config"), std::string::npos) << e;
}


// Found by tests/fuzz/fuzz_train_config: a scalar with a byte that is not UTF-8 came back altered from
// the run directory's config.yaml (the resumed run read a different value).  Configs are UTF-8.
TEST(TrainConfig, BytesThatAreNotUtf8AreRefusedNamingTheLine) {
  const std::string yaml = "run_dir: runs/x\nseed: 1\nmodel:\n  config:\n    rope_theta: 10000\xf9.0\n";
  try {
    train_config_from_yaml_text(yaml, "cfg.yaml", {});
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cfg.yaml:5: not valid UTF-8"), std::string::npos) << e.what();
  }
  // Found by the same target: control characters (here from YAML escapes in a key) were written
  // back to config.yaml as escapes yaml-cpp misreads ("\0" then "_type" reads as the "\_" escape, a
  // lone byte), and writing the resolved config as JSON threw: "unexpected error" at the start.
  for (const std::string& y : {std::string("model:\n  config: {\"model\\x01\\0_type\": mixtral}\n"),
                               std::string("run_dir: \"runs/\\x7f\"\n"),
                               std::string("run_dir: \"runs/\\x85\"\n")}) {
    try {
      train_config_from_yaml_text(y, "cfg.yaml", {});
      FAIL() << "expected an Error for " << y;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("cfg.yaml:"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("control characters"), std::string::npos) << e.what();
    }
  }
  try {
    train_config_from_yaml_text("run_dir: runs/x\n", "cfg.yaml", {"run_dir=a\xff" "b"});
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is not valid UTF-8"), std::string::npos) << e.what();
  }
}
