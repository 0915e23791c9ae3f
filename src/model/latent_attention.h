// Multi-head latent attention (DeepSeek-V3; modeling_deepseek_v3.py DeepseekV3Attention), the
// attention block's body when the config has kv_lora_rank (AttentionBlock dispatches here):
//   q    = q_b(rmsnorm(q_a(x)))  (q_lora_rank > 0)  or  q_proj(x)         [N, NH, dn + dr]
//   [latent | k_rope] = kv_a_proj_with_mqa(x)                              [N, kvr + dr]
//   [k_nope | v] per head = kv_b(rmsnorm(latent))                          [N, NH, dn + dv]
//   k    = [k_nope | rope(k_rope)] per head (the one RoPE key shared by every head)
//   q    = [q_nope | rope(q_rope)] x mscale^2 (YaRN's softmax factor; 1 without it)
//   out  = o_proj(attention(q, k, v)),  softmax scale 1/sqrt(dn + dr)
// RoPE: the last dr dims of each head, interleaved pairs, YaRN (attention_block.h rope_spec).  The
// two norms use transformers' DeepseekV3RMSNorm default eps 1e-6, not rms_norm_eps.  v is padded to
// the q/k head width with zeros so the one attention op serves (its extra outputs are zeros).
// Under tensor parallelism the heads are split (q_b / q_proj, kv_b by rows, o_proj by columns); the
// down-projections and their norms are replicated: the backward all-reduces their outputs' gradients
// over tp first, so their weight gradients agree on every rank and d(x) is whole.
#pragma once

#include "model/attention_block.h"

namespace moetron {

struct LatentAttention {
  static void carve_saved(AttentionSaved& s, TensorCarver& c, const BlockEnv& env, const AttentionWeights& w, int B,
                          int T, bool training);
  static void carve_scratch(AttentionScratch& s, TensorCarver& c, const BlockEnv& env, long N, bool training);
  static void forward(const BlockEnv& env, Tensor h, AttentionSaved& a, AttentionScratch& sc, Tensor ln,
                      Tensor positions, const AttnMask& mask, const AttentionWeights& w, const PlanView& ident, int B,
                      int T);
  static void backward(const BlockEnv& env, Tensor dln, Tensor dh_act, const AttentionSaved& a, AttentionScratch& sc,
                       Tensor ln, Tensor positions, const AttnMask& mask, const AttentionWeights& w,
                       const PlanView& ident, int B, int T);
  // Inference over caches of latents (infer/kv_cache.h cache_widths): each sequence's rows join its
  // cache (k: the normed latent, v: the rotated RoPE key), then its cached positions are expanded
  // through kv_b into sc.xk / sc.xv and its rows attend to them.  Memory per cached position and
  // layer: kv_lora_rank + qk_rope_head_dim values, not heads x (qk head + v head).
  static void forward_cached(const BlockEnv& env, Tensor h, AttentionSaved& a, AttentionScratch& sc, Tensor ln,
                             Tensor positions, std::span<const KvRows> seqs, const AttentionWeights& w,
                             const PlanView& ident, long N);
  // Elements of each expansion buffer per cached row (xkvb, xk, xv) for a tp-whole model.
  static long expand_width_kvb(const ModelConfig& cfg) { return (long)cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim); }
  static long expand_width_kv(const ModelConfig& cfg) { return (long)cfg.num_attention_heads * cfg.head_dim; }
};

}  // namespace moetron
