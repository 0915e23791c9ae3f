// The training config of `moetron train` / `plan` / `eval` (DESIGN §2 "Training config contract"):
// a YAML file with sections model / data / train / moe / lora / parallel / checkpoint / log / eval, plus
// dotted `key=value` overrides from the command line ("train.lr=3e-4", "parallel.tp=2",
// "model.config.hidden_size=64", "moe.aux_loss_coef=null", "parallel={tp: 2, pp: 2}").
//
// Reading is strict: an unknown key at any level (except inside model.config, which holds free-form
// HF config.json fields checked later by ModelConfig) is an error naming the dotted key, where it
// came from (FILE:LINE:COL or the override) and the closest valid key ("did you mean train.lr?");
// a value of the wrong type names the same place ("train.max_steps: expected an integer, got
// 'ten'"). Numbers may be written as ints or floats where a double is expected (1e-5, 1.0e-5,
// 0.00001); integers may be written as integral floats (1e3). Quoted scalars are strings.
// Every error is a moetron::Error with one message; nothing is partially applied.
//
// Validation (after the overrides), beyond types: global_batch_size divisible by micro_batch_size
// (division by the data-parallel size is the trainer's check); exactly one of max_steps > 0 or
// epochs > 0 (epochs at most kMaxEpochs); enums (device cpu|cuda, model.dtype fp32|bf16, data.over_long split|drop,
// train.schedule cosine|linear|constant, moe.aux_loss hf_pooled|per_layer|sequence); lr >= min_lr >= 0;
// warmup_steps >= 0; betas in [0, 1); adam_eps > 0; weight_decay, grad_clip (0: no clipping),
// z_loss_coef and aux_loss_coef >= 0; capacity_factor in (0, kMaxCapacityFactor]; positive sizes (seq_length, batch sizes,
// tp/pp/ep, layers_per_stage entries, keep_last, nan_skip_limit, log.every_steps, eval.batches);
// checkpoint.every_steps >= 0
// (0: only at the end) and eval.every_steps >= 0 (0: no evaluation); data.path, run_dir,
// model.init and checkpoint.resume non-empty; model.init "random" needs a non-empty model.config,
// model.init DIR needs an empty one (the directory's config.json defines the model).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace moetron {

// Bounds on the doubles that become integers (the step count, an expert's capacity).
constexpr double kMaxEpochs = 1e6;
constexpr double kMaxCapacityFactor = 4096;

struct TrainConfig {
  std::string run_dir = "runs/default";  // metrics.jsonl, tb/, checkpoints/, config.yaml go here
  std::string device = "cpu";            // cpu | cuda
  uint64_t seed = 1234;

  struct Model {
    std::string init = "random";                            // random | path of an HF model directory
    nlohmann::json config = nlohmann::json::object();        // HF config.json fields, for init: random
    std::string dtype = "fp32";                              // parameter storage: fp32 | bf16
    bool operator==(const Model&) const = default;
  } model;

  struct Data {
    std::string path;               // a directory written by `moetron data prepare`
    int seq_length = 2048;
    bool packing = true;
    std::string over_long = "split";  // documents longer than seq_length: split | drop
    bool operator==(const Data&) const = default;
  } data;

  struct Train {
    int global_batch_size = 32;  // sequences per optimizer step, over all data-parallel ranks
    int micro_batch_size = 1;
    long max_steps = 0;  // exactly one of max_steps, epochs is > 0
    double epochs = 0;
    double lr = 1e-5, min_lr = 1e-6;
    long warmup_steps = 10;
    std::string schedule = "cosine";  // cosine | linear | constant
    double weight_decay = 0.1, adam_beta1 = 0.9, adam_beta2 = 0.95, adam_eps = 1e-8, grad_clip = 1.0;
    int nan_skip_limit = 5;  // this many non-finite steps in a row abort the run
    long exit_interval = 0;  // save and exit after every step that is a multiple of this (0: never), as
                             // Megatron's --exit-interval: fits a long run into time-limited jobs
    // Activation recompute (model/recompute.h): none | full (keep each layer's input only) |
    // selective (recompute attention probabilities and the experts' SwiGLU outputs).
    std::string recompute = "none";
    bool operator==(const Train&) const = default;
  } train;

  struct Moe {
    std::optional<double> aux_loss_coef;  // null: the model config's router_aux_loss_coef
    std::string aux_loss = "hf_pooled";   // hf_pooled | per_layer | sequence (DeepSeek-V3's, per batch row)
    double z_loss_coef = 0.0;
    std::optional<double> capacity_factor;  // null: dropless
    // Aux-loss-free balancing (DeepSeek-V3's gamma): after each optimizer step every MoE layer's
    // selection bias moves by bias_update_rate * sign(mean load - expert load); 0: off.  Needs a
    // model with a selection bias (sigmoid routing: DeepSeek-V3, GLM-4.5).
    double bias_update_rate = 0.0;
    bool operator==(const Moe&) const = default;
  } moe;

  // LoRA fine-tuning (model/lora.h): adapters on a frozen base; rank 0 trains the whole model.
  struct Lora {
    int rank = 0;
    double alpha = 16.0;  // scale alpha / rank (alpha / sqrt(rank) with rslora)
    double dropout = 0.0;  // only 0 (PEFT refuses dropout on fused experts)
    std::vector<std::string> targets = {"attention", "experts"};  // see parse_lora_targets
    uint64_t init_seed = 0;  // the adapters' initialisation (A uniform, B zero)
    bool rslora = false;
    bool operator==(const Lora&) const = default;
  } lora;

  struct Parallel {
    int tp = 1, pp = 1, ep = 1;
    // Decoder layers of each pipeline stage, first stage first ([] : an even split; else pp positive
    // entries summing to num_hidden_layers, checked with the model by plan's layout rules).
    std::vector<int> layers_per_stage;
    bool zero1 = true;
    // How ranks on a GPU exchange device buffers: nccl (one GPU per rank), staged (MPI through host
    // memory; ranks may share a GPU), auto (nccl when built with it and every rank has its own GPU).
    std::string device_comm = "auto";
    bool operator==(const Parallel&) const = default;
  } parallel;

  struct Checkpoint {
    long every_steps = 100;  // 0: only at the end
    int keep_last = 3;
    std::string resume = "auto";  // auto | none | PATH
    bool operator==(const Checkpoint&) const = default;
  } checkpoint;

  struct Log {
    long every_steps = 1;
    bool tensorboard = true;
    bool operator==(const Log&) const = default;
  } log;

  struct Eval {
    long every_steps = 100;  // 0: no evaluation
    int batches = 10;
    bool operator==(const Eval&) const = default;
  } eval;

  bool operator==(const TrainConfig&) const = default;
};

// Reads the YAML file at `path`, applies `overrides` in order ("train.lr=3e-4"; the value is YAML,
// "null" clears an optional field), validates. Errors name `path` (and the line, or the override).
TrainConfig load_train_config(const std::string& path, const std::vector<std::string>& overrides);

// Same, from YAML text; `source` names it in errors.
TrainConfig train_config_from_yaml_text(const std::string& yaml, const std::string& source,
                                        const std::vector<std::string>& overrides);

// The validation rules above, for a config built in code; errors name `source` and the key.
void validate_train_config(const TrainConfig& cfg, const std::string& source);

// The resolved config as YAML: every key, in the order of the contract; loads back to an equal config.
std::string train_config_to_yaml(const TrainConfig& cfg);

// The same tree as JSON (optional fields unset are null).
nlohmann::json train_config_to_json(const TrainConfig& cfg);

// Every valid dotted key of a TrainConfig ("run_dir", "model.init", ..., "eval.batches"), in order.
std::vector<std::string> train_config_keys();

}  // namespace moetron
