// The GGUF architecture of a Hugging Face model (llama.cpp's general.architecture), what llama.cpp's
// graph for it computes, and its hyperparameter keys; the export (moetron export gguf) writes them.
// After llama.cpp's convert_hf_to_gguf.py and the loaders of its architectures (src/models/*.cpp):
//   model_type                  general.architecture  tensors and keys beyond the common ones
//   mixtral, mistral, llama     llama      q/k rows permuted (interleaved-pair RoPE); experts stacked as
//                                          ffn_{gate,up,down}_exps, llama.expert_count / expert_used_count
//   qwen3_moe                   qwen3moe   attn_{q,k}_norm [head_dim]; expert_feed_forward_length
//   qwen2_moe                   qwen2moe   q/k/v biases; the shared expert ffn_*_shexp and its gate
//                                          ffn_gate_inp_shexp [C]; expert_(shared_)feed_forward_length
//   olmoe                       olmoe      attn_{q,k}_norm over all heads [C]
//   qwen3                       qwen3      attn_{q,k}_norm [head_dim]
//   glm4_moe                    glm4moe    sigmoid routing with the selection bias exp_probs_b,
//                                          expert_weights_scale / _norm, expert_gating_func 2; ungated
//                                          shared experts ffn_*_shexp (expert_shared_count); the first
//                                          leading_dense_block_count layers dense; partial RoPE
//                                          (rope.dimension_count); optional attn_{q,k}_norm and q/k/v
//                                          biases; the FFN input norm is post_attention_norm
#pragma once

#include <string>

#include "io/gguf.h"
#include "io/hf_config.h"

namespace moetron::gguf {

// What llama.cpp's graph for a GGUF architecture computes (llama.cpp src/models/<arch>.cpp).
struct Arch {
  std::string name;
  bool permute_qk = false;      // interleaved-pair RoPE (llama)
  bool moe = false;             // every layer routed (false: every layer dense)
  bool norm_topk = false;       // the top-K router weights renormalised (build_moe_ffn's norm_w)
  bool shared_expert = false;   // a gated shared expert in every layer (qwen2moe)
  int qk_norm = 0;              // 0: none, 1: per head [HD], 2: over all heads [C]
  bool attn_is_hidden = false;  // the graph sizes q and o by n_embd (NH * HD must equal C)
  bool kv_is_heads = false;     // k_norm sized n_embd: no GQA
  bool needs_output = false;    // output.weight required (no fallback to token_embd for tied models)
  bool sigmoid_router = false;  // glm4moe: sigmoid scores, selection bias, scale, leading dense layers
};

// The architecture of `cfg` (by model_type); InputError naming `src` and the field otherwise.
Arch arch_for(const ModelConfig& cfg, const std::string& src);

// InputError, naming the field, for what `a`'s llama.cpp graph would compute differently: dense
// layers among MoE ones (mlp_only_layers, decoder_sparse_step), norm_topk_prob where the graph
// hard-codes the other choice, clip_qkv (no clamp in llama.cpp's graphs), a head width other than
// hidden_size where the graph assumes it (qwen2moe, olmoe: head_dim), GQA in olmoe
// (num_key_value_heads), and a sliding_window shorter than max_position_embeddings (llama.cpp's llama
// architecture attends to every position) unless `window_as_context`.  Returns the context length to
// write: max_position_embeddings, or with `window_as_context` the sliding_window, the positions over
// which the file computes exactly what moetron computes.
int check_expressible(const ModelConfig& cfg, const Arch& a, bool window_as_context, const std::string& src);

// Appends the architecture's hyperparameter keys ("<arch>.vocab_size", ..., the expert counts and
// widths of an MoE model) with context_length = `context`.
void add_arch_keys(KeyValues& kv, const ModelConfig& cfg, const Arch& a, int context);

}  // namespace moetron::gguf
