#include "model/flops.h"

namespace moetron {

FlopCount count_flops(const ModelConfig& c, int T) {
  const double C = c.hidden_size, V = c.vocab_size, L = c.num_hidden_layers;
  const double Q = (double)c.num_attention_heads * c.head_dim, KV = (double)c.num_key_value_heads * c.head_dim;
  FlopCount f;
  // Per layer: attention projections, then the router and K experts (MoE layer) or one dense FFN.
  double ffn = 0.0;
  for (int l = 0; l < c.num_hidden_layers; l++)
    ffn += c.is_moe_layer(l) ? C * c.num_local_experts + (double)c.num_experts_per_tok * 3 * C * c.ffn_size(l) +
                                   (c.has_shared_expert() ? 3 * C * c.shared_expert_intermediate_size + C : 0.0)
                             : 3 * C * c.ffn_size(l);
  f.forward_matmul_per_token = 2.0 * (L * (C * Q + 2 * C * KV + Q * C) + ffn) + 2.0 * C * V;
  f.forward_attention_per_token = 2.0 * L * T * Q;
  return f;
}

}  // namespace moetron
