// Weights a Model reads instead of holding its own (model.h: the constructor over a provider): the
// parameters of a checkpoint used where they lie, as inference uses them (infer/model.h
// InferenceModel).  Tensors are views the provider keeps valid while it lives.
#pragma once

#include "backend/backend.h"
#include "io/hf_config.h"
#include "model/lora.h"
#include "model/params.h"

namespace moetron {

class WeightProvider {
 public:
  virtual ~WeightProvider() = default;
  virtual const ModelConfig& config() const = 0;
  // A parameter of the whole model's table as the blocks read it: the norms, biases, the router and
  // the shared expert's gate in f32 (host memory), the matrices -- embedding, projections, FFN, head --
  // as Store::stored views (backend/weights.h).
  virtual Tensor weight(ParamKind kind, int layer) const = 0;
  // The LoRA adapter applied unmerged (null: none), and its factor b (else A) of base tensor `target`
  // in `layer` (f32; empty when not adapted).
  virtual const LoraSpec* lora_spec() const = 0;
  virtual Tensor adapter_factor(ParamKind target, int layer, bool b) const = 0;
};

}  // namespace moetron
