// `moetron plan`: validate a run's parallel layout against the world size and the model before any
// work, and estimate per rank what the layout needs: memory (parameters, gradients, optimizer state,
// activations), FLOPs per step and communication per step (DESIGN §6, Megatron semantics).
//
// Layout: world = pp x dp x tp; ep divides dp. tp splits attention heads (kv heads are replicated
// when NKV < tp), the expert FFN width I and the vocabulary (embedding and head); norms and the
// router are replicated on every tp rank. pp splits the layers into contiguous stages (equal ones,
// or parallel.layers_per_stage); the embedding lives on the first stage, the final norm, head and loss on the last. ep splits the
// experts (E/ep per rank); every other weight is replicated over the dp ranks. ZeRO-1 shards the
// fp32 master weights and the Adam moments over the dp ranks (expert tensors over the dp/ep ranks
// that hold the same experts). Every rank of a stage needs the same, assuming balanced routing.
//
// Dimensions: B micro-batch, T sequence, N = B*T tokens, C hidden, NH heads, NKV kv heads, HD head
// dim, Q = NH*HD, E experts, K experts per token, M = K*N routed rows, I expert FFN width, L layers,
// V vocab, m micro-batches per step per data-parallel rank. The formulas printed by format_plan
// (plan_formulas) are the definitions; this header only names the quantities.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/hf_config.h"
#include "train/config.h"
#include "train/layout.h"

namespace moetron {

// Parameters one rank holds, by kind (element counts).
struct RankParams {
  int64_t embedding = 0;  // V/tp x C, first stage
  int64_t attention = 0;  // q, k, v, o of the stage's layers (tp-split; kv replicated when NKV < tp)
  int64_t norms = 0;      // input/post-attention norms (+ final norm on the last stage), tp-replicated
  int64_t router = 0;     // E x C per layer, tp-replicated
  int64_t experts = 0;    // (E/ep) x 3 x (I/tp) x C per layer (dense FFN: 3 x (I/tp) x C)
  int64_t dense_ffn = 0;  // 3 x (I/tp) x C per dense layer of an MoE model (Qwen3-MoE mlp_only_layers)
  int64_t lm_head = 0;    // V/tp x C, last stage
  int64_t total() const { return embedding + attention + norms + router + experts + dense_ffn + lm_head; }
  int64_t expert_sharded() const { return experts; }      // ZeRO-1 group: dp/ep ranks
  int64_t dense() const { return total() - experts; }     // ZeRO-1 group: dp ranks
};

// Bytes one rank sends per optimizer step, by parallel dimension (ring algorithms: all-reduce
// 2(n-1)/n S, reduce-scatter and all-gather (n-1)/n S each, all-to-all (n-1)/n S, send S).
struct RankComm {
  int64_t tp = 0, dp = 0, pp = 0, ep = 0;
  int64_t total() const { return tp + dp + pp + ep; }
};

// One pipeline stage; every rank of the stage holds the same.
struct StagePlan {
  int stage = 0;
  int first_layer = 0, num_layers = 0;  // layers [first_layer, first_layer + num_layers)
  RankParams params;                    // per rank
  int64_t trainable = 0;                // parameters with gradients and AdamW state: params, or (LoRA)
                                        // the rank's adapters (the base frozen)
  int64_t param_bytes = 0;              // params x parameter dtype size (+ the adapters with LoRA)
  int64_t grad_bytes = 0;               // trainable x 4 (fp32 accumulation)
  int64_t optimizer_bytes = 0;          // (fp32 master if bf16) + Adam m, v of the trainable; / dp shards with ZeRO-1
  int64_t activation_bytes_per_micro_batch = 0;  // saved for the backward, one micro-batch
  int in_flight = 1;                             // micro-batches in flight under 1F1B: min(pp - stage, m)
  int64_t workspace_bytes = 0;                   // backward scratch of one layer and one micro-batch
  double flops = 0;                              // per step per rank (training: 3 x forward)
  RankComm comm;
  int64_t activation_bytes() const { return activation_bytes_per_micro_batch * in_flight + workspace_bytes; }
  int64_t total_bytes() const { return param_bytes + grad_bytes + optimizer_bytes + activation_bytes(); }
};

struct Plan {
  std::string model_source;  // the config.json path, or "model.config"
  ModelConfig model;
  std::string device, dtype;  // cfg.device, cfg.model.dtype
  int world = 1, tp = 1, pp = 1, dp = 1, ep = 1;
  bool zero1 = true;
  int seq_length = 0, micro_batch_size = 0, global_batch_size = 0;
  int micro_batches = 1;  // m: per step per data-parallel rank
  std::string recompute = "none";  // train.recompute: none | full | selective
  int64_t tokens_per_step = 0;
  int param_dtype_bytes = 4, grad_dtype_bytes = 4, optimizer_bytes_per_param = 8, activation_dtype_bytes = 4;
  // LoRA (cfg.lora.rank > 0): the frozen base's bytes per parameter (as Model keeps it: fp32,
  // and on cuda its bf16 GEMM copy beside), the adapters in fp32 (their own masters) with their
  // gradients and Adam moments.
  int lora_rank = 0;
  int base_bytes_per_param = 0;
  int64_t lora_params_total = 0;  // the whole model's adapters
  // Whole model (from ParamTable, no padding).
  int64_t params_total = 0;
  int64_t params_experts = 0;  // all expert (or dense FFN) weights
  int64_t params_active = 0;   // per token: total - (E - K)/E x experts
  int64_t params_active_compute = 0;  // the same without the input embedding (a lookup)
  double flops_per_step = 0;   // whole model, all ranks
  double bubble = 0;           // (pp - 1) / (m + pp - 1)
  std::vector<StagePlan> stages;
  std::vector<std::string> warnings;

  const StagePlan& largest_stage() const;  // by total_bytes (the first of equals)
};

// The model a training config trains: model.config when model.init is "random", otherwise
// model.init/config.json (relative paths from the current directory, as `moetron train` reads them;
// only config.json is read). `source` receives the path or "model.config".
ModelConfig plan_model_config(const TrainConfig& cfg, std::string* source = nullptr);

// Validates the layout with resolve_layout (train/layout.h: the rules `moetron train` applies, an
// Error with a one-line reason naming the numbers) and computes the plan.  A pipeline that cannot
// fill (m < pp) is a warning, not an error: 1F1B still runs, with a bubble of (pp-1)/(m+pp-1).
Plan make_plan(const TrainConfig& cfg, const ModelConfig& model, int world_size,
               const std::string& model_source = "model.config");


// The plan as text (tables, totals and the formulas), and as one JSON object.
std::string format_plan(const Plan& plan);
nlohmann::json plan_to_json(const Plan& plan);
// The formulas the estimates use, one per line.
std::vector<std::string> plan_formulas(const Plan& plan);

// "80GB" (10^9), "80GiB" (2^30), "512MiB", "1.5TB", "85899345920" (bytes); case-insensitive units
// B, KB, MB, GB, TB, KiB, MiB, GiB, TiB. Errors name `what` and the text.
int64_t parse_byte_size(const std::string& text, const std::string& what = "--device-memory");

// "12.34 GiB" style (binary units), and "46.70B" style counts (`decimals` after the point).
std::string format_bytes(double bytes);
std::string format_count(double n, int decimals = 2);

}  // namespace moetron
