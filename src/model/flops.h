// FLOPs of a training step, for throughput and MFU figures.
//   forward matmuls per token: 2*L*(C*Q + 2*C*KV + Q*C + C*E + K*3*C*I) + 2*C*V
//   causal attention per token (QK^T and PV over on average T/2 keys): 2*L*T*Q
//   training = 3 x forward (backward = 2 x forward).
#pragma once

#include "io/hf_config.h"

namespace moetron {

struct FlopCount {
  double forward_matmul_per_token = 0;
  double forward_attention_per_token = 0;
  double train_per_token() const { return 3.0 * (forward_matmul_per_token + forward_attention_per_token); }
};

FlopCount count_flops(const ModelConfig& cfg, int seq_length);

}  // namespace moetron
