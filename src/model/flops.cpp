#include "model/flops.h"

namespace moetron {

FlopCount count_flops(const ModelConfig& c, int T) {
  const double C = c.hidden_size, V = c.vocab_size, I = c.intermediate_size, L = c.num_hidden_layers;
  const double Q = (double)c.num_attention_heads * c.head_dim, KV = (double)c.num_key_value_heads * c.head_dim;
  const double E = c.is_moe() ? c.num_local_experts : 0, K = c.is_moe() ? c.num_experts_per_tok : 1;
  FlopCount f;
  f.forward_matmul_per_token = 2.0 * L * (C * Q + 2 * C * KV + Q * C + C * E + K * 3 * C * I) + 2.0 * C * V;
  f.forward_attention_per_token = 2.0 * L * T * Q;
  return f;
}

}  // namespace moetron
