// The attention block of the layer body: from the normalised input ln [N,C] to the residual stream
//   h += o_proj(attention(rope(norm_q(clip(q_proj(ln) + bq))), rope(norm_k(clip(k_proj(ln) + bk))),
//                         clip(v_proj(ln) + bv)))
// with each family's options from the config -- q/k/v biases (qkv_bias), per-head or whole-projection
// q/k RMSNorm (qk_norm, qk_norm_full), OLMoE's clip (clip_qkv) -- LoRA on the projections
// (model/linear.h), causal GQA with the optional sliding window, segment and padding masks (AttnMask).
// Under tensor parallelism (Megatron) q/k/v are column-parallel (this rank's heads; a kv head
// replicated when NKV < tp) and o_proj row-parallel: the o_proj output is all-reduced before it
// joins h, and d(ln) is all-reduced in the backward.  A whole-projection q/k norm sums its row
// statistics over the tp group.
// Dimensions (this tp rank's): N tokens (B sequences of T), C hidden, NH / NKV heads, HD head dim,
// Q = NH*HD, KVd = NKV*HD.
#pragma once

#include <span>

#include "backend/backend.h"
#include "model/block.h"
#include "model/linear.h"

namespace moetron {

// The RoPE of a config (ops/rope.h): rotated width (partial_rotary_factor; MLA's qk_rope_head_dim, at
// offset qk_nope_head_dim of each query head), pair layout, YaRN's frequencies and attention factor.
ops::RopeSpec rope_spec(const ModelConfig& cfg);

// This rank's share of the attention heads.
struct AttentionDims {
  int NH, NKV, HD, Q, KVd;
  static AttentionDims of(const BlockEnv& env);
};

// One layer's attention parameters as the block reads them: the projections (act store, with their
// adapters), and in f32 the biases (qkv_bias) and the q/k norm weights (qk_norm), each with its
// gradient (f32, +=; empty when frozen).
struct AttentionWeights {
  LinearWeights q, k, v, o;
  Tensor q_bias, k_bias, v_bias, dq_bias, dk_bias, dv_bias;
  Tensor q_norm, k_norm, dq_norm, dk_norm;
  // Latent attention (model/latent_attention.cpp): q = q_b(norm(q_a(x))) (q_lora_rank > 0) or q(x);
  // kv_a(x) = [latent | k_rope]; kv_b(norm(latent)) = per head [k_nope | v].  Norm weights f32.
  LinearWeights q_a, q_b, kv_a, kv_b;
  Tensor q_a_norm, kv_a_norm, dq_a_norm, dkv_a_norm;
};

// What the forward keeps for the backward (one micro-batch, one layer).
struct AttentionSaved {
  Tensor q, k, v;                   // [N,Q], [N,KVd] x 2 (act store): the attention's inputs after RoPE
  Tensor qraw, kraw, rstdq, rstdk;  // qk_norm: f32 projections before their norm, its statistics
  Tensor clipq, clipk, clipv;       // clip_qkv: u8 masks of the values kept (not clipped)
  Tensor attn_saved;                // the backend's attention state (attention_saved_numel)
  // Selective recompute, where the backend's state is more than per-row statistics (the CPU's
  // probabilities): attn_saved is not carved -- the model points it at a buffer every layer shares --
  // and the backward first runs the attention forward again to refill it.
  bool recompute_state = false;
  Tensor att;                       // [N,Q] attention output (act store)
  Tensor uq, uk, uv, uo;            // LoRA: x A^T of each adapted projection
  // Latent attention: q = [N, NH*HD], k the same (the shared k_rope in every head), v [N, NH*HD]
  // with each head's v_head_dim values then zeros (one head width for the attention op), att
  // likewise; atv [N, NH*dv] the o_proj input.
  Tensor qa32, rstd_qa, qan;        // q_a output (f32), its norm's statistics, the normed (act store)
  Tensor kva32, lat32, rstd_kv, latn;  // kv_a output [N, kvr + dr] (f32), the latent (f32), stats, normed
  Tensor krope;                     // [N, dr] act store: the shared RoPE key after RoPE
  Tensor atv;                       // [N, NH*dv] act store
  // Lays the tensors out (TensorCarver's two passes); w tells which projections are adapted.
  // training false: what an inference pass uses (no attention state for a backward).
  void carve(TensorCarver& c, const BlockEnv& env, const AttentionWeights& w, int B, int T, bool training = true);
};

// Work buffers shared by every layer (the model sizes them once per batch shape).
struct AttentionScratch {
  Tensor datt, dq, dk, dv;  // act store
  Tensor dq32, dk32, dv32;  // f32 gradients around the norms and biases (dq / dk / dv when act is f32)
  Tensor dqraw, dkraw;      // qk_norm: d(the projections before the norm)
  Tensor stage32;           // forward: an f32 projection before its bias / clip (act store not f32)
  Tensor row_stat;          // whole-projection q/k norm under tp: [N] partial row sums, all-reduced
  Tensor du;                // LoRA backward [N, r]
  Tensor tmp;               // [N,C] f32: the o_proj output before its all-reduce (tp); the body's
  // Latent attention: kv_b's output (forward), and the backward's pieces.
  Tensor kvb;                          // [N, NH*(dn+dv)] act store
  Tensor datv, dkvb, dkrope;           // act store
  Tensor dkrope32, dlatn, dlat32, dkva32, dqan, dqa32;  // f32
  Tensor dstage;                       // act store: an f32 gradient entering a GEMM (act store not f32)
  // Latent attention over caches: one sequence's cached positions expanded (set by the model for a
  // pass, [rows >= its longest sequence] each): kv_b's output, the keys and the padded values.
  Tensor xkvb, xk, xv;
  // training false: the forward's buffers only (stage32, row_stat).
  void carve(TensorCarver& c, const BlockEnv& env, int lora_rank, long N, bool training = true);
};

// Inference over KV caches: one sequence's rows of a pass and its cache of the layer being run
// (backend.h), whose first pos0 rows are cached.
using KvRows = Backend::KvSeq;

class AttentionBlock {
 public:
  // h[N,C] (f32) += the block's output (complete: all-reduced under tp).  ln [N,C] act store;
  // positions i32 [N]; ident: the identity plan of the N rows (LoRA's grouped products).
  static void forward(const BlockEnv& env, Tensor h, AttentionSaved& s, AttentionScratch& sc, Tensor ln,
                      Tensor positions, const AttnMask& mask, const AttentionWeights& w, const PlanView& ident, int B,
                      int T);
  // Inference: the same for N rows of one or more sequences (seqs, in row order; positions i32 [N]),
  // each attending to its own cache, which its rows' keys and values join (rows pos0 .. pos0+rows-1
  // written).  Only q, k, v, att (and the norms' and clip's tensors) of s are used.
  static void forward_cached(const BlockEnv& env, Tensor h, AttentionSaved& s, AttentionScratch& sc, Tensor ln,
                             Tensor positions, std::span<const KvRows> seqs, const AttentionWeights& w,
                             const PlanView& ident, long N);
  // dln[N,C] (f32, assign; all-reduced under tp) from dh[N,C] (f32) = d loss / d(the block's
  // output); dh_act: dh in the act store (dh itself when that is f32).  Parameter gradients +=.
  static void backward(const BlockEnv& env, Tensor dln, Tensor dh_act, const AttentionSaved& s, AttentionScratch& sc,
                       Tensor ln, Tensor positions, const AttnMask& mask, const AttentionWeights& w,
                       const PlanView& ident, int B, int T);

 private:
  // q, k, v of the N rows: projections, biases, norms, clip, then RoPE at `positions`.
  static void project(const BlockEnv& env, AttentionSaved& s, AttentionScratch& sc, Tensor ln, Tensor positions,
                      const AttentionWeights& w, const PlanView& ident, long N);
  // h += o_proj(s.att) (all-reduced under tp).
  static void output(const BlockEnv& env, Tensor h, AttentionSaved& s, AttentionScratch& sc, const AttentionWeights& w,
                     const PlanView& ident, long N);
};

}  // namespace moetron
