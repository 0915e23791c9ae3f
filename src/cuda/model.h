// The Mixtral decoder (and dense Mistral / Llama) on one NVIDIA GPU: the same interface and maths
// as moetron::MixtralModel (src/model/mixtral.h), the whole forward and backward on the device.
//
// Precision (the Megatron-style mixed-precision recipe):
//   - fp32 master weights, fp32 gradients (accumulating, +=) and fp32 Adam moments on the device,
//     plus a bf16 copy of the weights that the tensor-core GEMMs read (refreshed by every update);
//   - the residual stream (x, h), RMSNorm statistics, router logits/probabilities, the logits and
//     the losses in fp32; GEMM inputs and the other saved activations in bf16; every op computes
//     in fp32 (fp32 GEMM accumulation);
//   - the router runs in fp32 end to end (fp32 normalised input, fp32 gate weight, fp32 GEMM), so
//     routing decisions see no bf16 rounding of their own.
// Memory: one arena for the model state (weights, bf16 copy, gradients), one for the activations
// of the current (B, T) (re-laid when the shape changes), one per optimizer for its moments.
// The expert inputs (xperm) are recomputed in the backward rather than saved.
//   Dimension letters as in mixtral.h; S = Q + 2*KV is the row width of the fused qkv buffer.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/profile.h"
#include "cuda/ops.h"
#include "cuda/runtime.h"
#include "io/hf_config.h"
#include "model/mixtral.h"
#include "model/params.h"
#include "ops/router.h"
#include "optim/adamw.h"

namespace moetron::gpu {

class CudaMixtralModel {
 public:
  explicit CudaMixtralModel(const ModelConfig& cfg);
  ~CudaMixtralModel();
  CudaMixtralModel(const CudaMixtralModel&) = delete;
  CudaMixtralModel& operator=(const CudaMixtralModel&) = delete;

  const ModelConfig& config() const { return cfg_; }
  const ParamTable& table() const { return table_; }
  Context& context() { return *ctx_; }

  // Parameters in the ParamTable layout (table().total() floats, host memory).
  void set_params(const float* host);
  void get_params(float* host);
  // moetron::init_parameters evaluated on the device (the same counter RNG, fp64 maths).
  void init_parameters(uint64_t seed);
  void get_grads(float* host);
  void zero_grads();

  // As MixtralModel::forward / backward.  The backward overwrites the logits.
  Losses forward(const Batch& batch, const LossWeights& weights);
  void backward();
  // [B,T,V] logits of the last forward (until backward) into host memory.
  void get_logits(float* host);
  const std::vector<ops::RouterLayerStats>& router_stats() const { return router_stats_; }
  // Time sections into `profile` (null: off); each section synchronises the device when on.
  void set_profile(Profile* profile) { profile_ = profile; }

  // Global L2 norm of the gradients (fp64, deterministic).
  double grad_norm();

  // Device memory held, in bytes.
  size_t state_bytes() const { return state_.capacity(); }
  size_t activation_bytes() const { return acts_.capacity(); }

  // Device arrays in the ParamTable layout, for the optimizer.
  float* device_params() { return master_; }
  Bf16* device_params_bf16() { return weights_bf16_; }
  float* device_grads() { return grads_; }

 private:
  struct LayerActs {
    float *x = nullptr, *rstd1 = nullptr, *h = nullptr, *rstd2 = nullptr, *lse = nullptr;
    Bf16 *ln1 = nullptr, *qkv = nullptr, *att = nullptr, *ln2 = nullptr;
    float *rlogits = nullptr, *rprobs = nullptr, *topk_w = nullptr;
    int32_t *topk_idx = nullptr, *row_token = nullptr, *row_of = nullptr;
    Bf16 *yperm = nullptr, *h13 = nullptr, *act = nullptr;
    MoePlanDevice plan;
  };
  struct Dims {
    int C, V, I, NH, NKV, HD, Q, KVd, S, E, K;
    bool moe;
  };
  Dims dims() const;
  void allocate(int B, int T);
  const float* W(ParamKind kind, int layer = -1) const { return master_ + table_.at(kind, layer).offset; }
  const Bf16* Wb(ParamKind kind, int layer = -1) const { return weights_bf16_ + table_.at(kind, layer).offset; }
  float* G(ParamKind kind, int layer = -1) { return grads_ + table_.at(kind, layer).offset; }
  bool qkv_contiguous(int layer) const;
  void qkv_forward(LayerActs& a, int layer);
  void qkv_backward(LayerActs& a, int layer);

  ModelConfig cfg_;
  ParamTable table_;
  std::unique_ptr<Context> ctx_;
  DeviceArena state_;  // master fp32, bf16 copy, grads fp32, norm scratch
  float* master_ = nullptr;
  Bf16* weights_bf16_ = nullptr;
  float* grads_ = nullptr;
  double* norm_scratch_ = nullptr;

  int B_ = 0, T_ = 0;
  DeviceArena acts_;
  std::vector<LayerActs> layers_;
  float *x_final_ = nullptr, *rstdf_ = nullptr, *logits_ = nullptr, *ce_lse_ = nullptr, *row_loss_ = nullptr;
  Bf16* lnf_ = nullptr;
  int32_t *tokens_d_ = nullptr, *positions_d_ = nullptr, *targets_d_ = nullptr, *amask_d_ = nullptr,
          *seg_d_ = nullptr;
  uint8_t* token_mask_d_ = nullptr;
  // Scratch shared by the layers.
  float *ln2_f32_ = nullptr, *dres_ = nullptr, *dln_ = nullptr, *attn_scratch_ = nullptr, *drlogits_ = nullptr,
        *dtopk_ = nullptr;
  Bf16 *xperm_ = nullptr, *dres_bf_ = nullptr, *datt_ = nullptr, *dqkv_ = nullptr, *dyperm_ = nullptr,
       *ffn_scratch_ = nullptr;
  int64_t* plan_scratch_ = nullptr;
  double* stats_d_ = nullptr;  // [L][2E+2]

  // Per-forward state kept for the backward.
  bool has_amask_ = false, has_seg_ = false, has_token_mask_ = false, has_labels_ = false;
  long real_tokens_ = 0;
  LossWeights weights_;
  std::vector<ops::RouterLayerStats> router_stats_;
  std::vector<std::vector<double>> aux_dprobs_;  // [L][E] d(aux_coef*aux)/d probs
  bool forward_done_ = false;
  Profile* profile_ = nullptr;
};

// AdamW (torch semantics, as moetron::AdamW) over the model's fp32 master weights on the device;
// every update also refreshes the bf16 weight copy.  The moments live in one arena of their own.
class CudaAdamW {
 public:
  CudaAdamW(CudaMixtralModel& model, const AdamWConfig& cfg);
  // One step at learning rate lr with gradients scaled by grad_scale (the clip coefficient);
  // weight decay skips the RMSNorm weights.
  void step(double lr, float grad_scale);
  long steps_taken() const { return step_; }
  void set_steps_taken(long s) { step_ = s; }
  size_t state_bytes() const { return arena_.capacity(); }
  // The moments in the ParamTable layout (host memory, table().total() floats each), for
  // checkpoints that stay device-independent.
  void get_state(float* exp_avg, float* exp_avg_sq);
  void set_state(const float* exp_avg, const float* exp_avg_sq);

 private:
  CudaMixtralModel& model_;
  AdamWConfig cfg_;
  DeviceArena arena_;
  float *m_ = nullptr, *v_ = nullptr;
  long step_ = 0;
};

}  // namespace moetron::gpu
