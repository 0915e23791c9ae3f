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
                                   (c.has_shared_expert() ? 3 * C * c.shared_expert_intermediate_size + (c.shared_expert_gated() ? C : 0.0) : 0.0)
                             : 3 * C * c.ffn_size(l);
  // Attention projections: q, k, v, o; latent attention's q_a / q_b (or q), kv_a, kv_b and o.
  double attn = C * Q + 2 * C * KV + Q * C;
  if (c.is_mla()) {
    const double NH = c.num_attention_heads, qr = c.q_lora_rank, kvr = c.kv_lora_rank;
    attn = (qr > 0 ? C * qr + qr * Q : C * Q) + C * (kvr + c.qk_rope_head_dim) +
           kvr * NH * (c.qk_nope_head_dim + c.v_head_dim) + NH * c.v_head_dim * C;
  }
  f.forward_matmul_per_token = 2.0 * (L * attn + ffn) + 2.0 * C * V;
  // q k^T over head_dim and the weighted sum over the value width, the causal half of T keys each.
  f.forward_attention_per_token = L * T * (double)c.num_attention_heads * (c.head_dim + c.value_head_dim());
  return f;
}

}  // namespace moetron
