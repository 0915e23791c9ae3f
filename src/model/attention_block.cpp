// The attention block; see attention_block.h.  The backward is the forward's call list in reverse.
#include "model/attention_block.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "model/latent_attention.h"

namespace moetron {

namespace {

// The q (or k) norm: per head (Qwen3), or over the whole projection (OLMoE), whose row statistics
// are summed over the tp ranks.  out = norm(raw); rows N, heads h of HD each.
void qk_norm_forward(const BlockEnv& env, AttentionScratch& sc, Tensor out, Tensor rstd, Tensor raw, Tensor weight,
                     bool k, long N, int heads) {
  Backend& be = env.be;
  const ModelConfig& cfg = env.cfg;
  const int HD = cfg.head_dim, width = heads * HD;  // this rank's part
  const float eps = (float)cfg.rms_norm_eps;
  if (!cfg.qk_norm_full) return be.rmsnorm_forward(out, rstd, raw, weight, N * heads, HD, eps);
  if (!env.tp_on()) return be.rmsnorm_forward(out, rstd, raw, weight, N, width, eps);
  // The sum of squares over every rank's heads; a kv head replicated on rep ranks is counted rep times.
  const int full = (k ? cfg.num_key_value_heads : cfg.num_attention_heads) * HD;
  be.row_dot(sc.row_stat, raw, raw, Tensor{}, N, width);
  env.tp_all_reduce(sc.row_stat);
  be.rmsnorm_forward_stats(out, rstd, raw, weight, sc.row_stat, N, width, full,
                           k ? 1.0f / (float)env.kv_replicas() : 1.0f, eps);
}

// d(raw) (f32, assign) and d(weight) (+=) from d(out) (f32).
void qk_norm_backward(const BlockEnv& env, AttentionScratch& sc, Tensor draw, Tensor dout, Tensor raw, Tensor rstd,
                      Tensor weight, Tensor dweight, bool k, long N, int heads) {
  Backend& be = env.be;
  const ModelConfig& cfg = env.cfg;
  const int HD = cfg.head_dim, width = heads * HD;
  if (!cfg.qk_norm_full) return be.rmsnorm_backward(draw, dweight, dout, raw, weight, rstd, N * heads, HD, false);
  if (!env.tp_on()) return be.rmsnorm_backward(draw, dweight, dout, raw, weight, rstd, N, width, false);
  // sum_j w_j dy_j x_j over every rank's part.  A replicated kv head's d(out) is partial on each of its
  // rep ranks (their own query heads' share): the all-rank sum is the true dot once, and each replica
  // takes 1/rep of the term, so that summing d(raw) over the replicas (as the k_proj gradient and the
  // layer input's are) gives the whole.
  const int full = (k ? cfg.num_key_value_heads : cfg.num_attention_heads) * HD;
  be.row_dot(sc.row_stat, dout, raw, weight, N, width);
  env.tp_all_reduce(sc.row_stat);
  be.rmsnorm_backward_stats(draw, dweight, dout, raw, weight, rstd, sc.row_stat, N, width, full,
                            k ? 1.0f / (float)env.kv_replicas() : 1.0f);
}

// src (act store) as f32: src itself when the act store is f32, else converted into `scratch`.
Tensor as_f32(Backend& be, Tensor src, Tensor scratch) {
  if (src.store == Store::f32) return src;
  be.convert(scratch, src);
  return scratch;
}

// src (f32) in the act store: src itself when that is f32, else converted into `scratch`.
Tensor as_act(Backend& be, Tensor src, Tensor scratch) {
  if (be.act_store() == src.store) return src;
  be.convert(scratch, src);
  return scratch;
}

}  // namespace

ops::RopeSpec rope_spec(const ModelConfig& cfg) {
  ops::RopeSpec s;
  s.theta = (float)cfg.rope_theta;
  s.rotary_dim = cfg.rope_dim();
  s.offset = cfg.is_mla() ? cfg.qk_nope_head_dim : 0;
  s.interleaved = cfg.rope_interleave;
  if (cfg.rope_type == "yarn") {
    // transformers' find_correction_range with truncate: the dims whose wavelengths complete between
    // beta_fast and beta_slow rotations over the original context.
    const double R = s.rotary_dim, base = cfg.rope_theta, orig = cfg.yarn_original_max_position_embeddings;
    const auto dim_of = [&](double rotations) {
      return R * std::log(orig / (rotations * 2 * M_PI)) / (2 * std::log(base));
    };
    s.yarn = true;
    s.yarn_factor = (float)cfg.yarn_factor;
    s.yarn_low = (float)std::max(std::floor(dim_of(cfg.yarn_beta_fast)), 0.0);
    s.yarn_high = (float)std::min(std::ceil(dim_of(cfg.yarn_beta_slow)), R - 1);
    s.attention_factor = (float)cfg.rope_attention_factor();
  }
  return s;
}

AttentionDims AttentionDims::of(const BlockEnv& env) {
  const ModelConfig& cfg = env.cfg;
  const int tp = env.tp_size;
  const int NH = cfg.num_attention_heads / tp;
  const int NKV = cfg.num_key_value_heads >= tp ? cfg.num_key_value_heads / tp : 1;
  return AttentionDims{NH, NKV, cfg.head_dim, NH * cfg.head_dim, NKV * cfg.head_dim};
}

void AttentionSaved::carve(TensorCarver& c, const BlockEnv& env, const AttentionWeights& w, int B, int T,
                           bool training) {
  if (env.cfg.is_mla()) return LatentAttention::carve_saved(*this, c, env, w, B, T, training);
  const long N = (long)B * T;
  const auto [NH, NKV, HD, Q, KVd] = AttentionDims::of(env);
  (void)HD;
  const Store act = env.be.act_store(), f32 = Store::f32;
  const bool qkn = env.cfg.qk_norm, clip = env.cfg.clip_qkv > 0;
  q = c.take(act, N * Q);
  k = c.take(act, N * KVd);
  v = c.take(act, N * KVd);
  qraw = qkn ? c.take(f32, N * Q) : Tensor{};
  kraw = qkn ? c.take(f32, N * KVd) : Tensor{};
  rstdq = qkn ? c.take(f32, N * NH) : Tensor{};  // per head, or (full) N of them
  rstdk = qkn ? c.take(f32, N * NKV) : Tensor{};
  clipq = clip ? c.take(Store::u8, N * Q) : Tensor{};
  clipk = clip ? c.take(Store::u8, N * KVd) : Tensor{};
  clipv = clip ? c.take(Store::u8, N * KVd) : Tensor{};
  const size_t state = env.be.attention_saved_numel(B, T, NH);
  recompute_state = training && env.selective && state > (size_t)N * NH;
  attn_saved = training && !recompute_state ? c.take(f32, state) : Tensor{};
  att = c.take(act, N * Q);
  const auto lu = [&](const LinearWeights& lw) { return lw.lora.on() ? c.take(act, N * lw.lora.u_width()) : Tensor{}; };
  uq = lu(w.q);
  uk = lu(w.k);
  uv = lu(w.v);
  uo = lu(w.o);
}

void AttentionScratch::carve(TensorCarver& c, const BlockEnv& env, int lora_rank, long N, bool training) {
  if (env.cfg.is_mla()) return LatentAttention::carve_scratch(*this, c, env, N, training);
  const auto [NH, NKV, HD, Q, KVd] = AttentionDims::of(env);
  (void)NH;
  (void)NKV;
  (void)HD;
  const Store act = env.be.act_store(), f32 = Store::f32;
  const ModelConfig& cfg = env.cfg;
  const bool qkn = cfg.qk_norm, bias = cfg.qkv_bias;
  stage32 = (bias || cfg.clip_qkv > 0) && act != f32 ? c.take(f32, N * std::max(Q, KVd)) : Tensor{};
  row_stat = cfg.qk_norm_full && env.tp_on() ? c.take(f32, N) : Tensor{};
  if (!training) return;
  datt = c.take(act, N * Q);
  dq = c.take(act, N * Q);
  dk = c.take(act, N * KVd);
  dv = c.take(act, N * KVd);
  dq32 = (qkn || bias) && act != f32 ? c.take(f32, N * Q) : dq;
  dk32 = (qkn || bias) && act != f32 ? c.take(f32, N * KVd) : dk;
  dv32 = bias && act != f32 ? c.take(f32, N * KVd) : dv;
  du = lora_rank > 0 ? c.take(act, N * (long)lora_rank) : Tensor{};
  dqraw = qkn ? c.take(f32, N * Q) : Tensor{};
  dkraw = qkn ? c.take(f32, N * KVd) : Tensor{};
}

void AttentionBlock::project(const BlockEnv& env, AttentionSaved& a, AttentionScratch& sc, Tensor ln, Tensor positions,
                             const AttentionWeights& w, const PlanView& ident, long N) {
  Backend& be = env.be;
  const ModelConfig& cfg = env.cfg;
  const int C = cfg.hidden_size;
  const auto [NH, NKV, HD, Q, KVd] = AttentionDims::of(env);
  {
    Section t(env, env.sec("fwd.attn_proj", "q/k/v"));
    const bool bias = cfg.qkv_bias, clip = cfg.clip_qkv > 0, qkn = cfg.qk_norm;
    const float c = (float)cfg.clip_qkv;
    // What follows a projection (bias, norm, OLMoE's clip) runs in f32: in place when the act store is
    // f32, else on the f32 staging buffer, rounded into the act store once at the end -- so which
    // values are clipped is decided on f32 values, as the fp32 model decides (deciding on rounded
    // values would flip the gradient of values near +-c).  The backward needs only d(q), d(k), d(v).
    // With q/k norms the q and k projections are f32 (qraw, kraw) and their norms write q and k.
    const bool staged = be.act_store() != Store::f32 && (bias || clip);
    const auto finish = [&](Tensor out, Tensor t, Tensor keep, long n) {
      if (clip) be.clamp_forward(t, keep, c, n);
      if (t.data != out.data) be.convert(out, t);
    };
    // After a projection's product t: its LoRA, bias, then its norm (q, k) and clip.
    const auto complete = [&](Tensor out, Tensor t, const LinearWeights& lw, Tensor u, Tensor b, int OC, Tensor keep,
                              bool norm, Tensor rstd, Tensor norm_w, bool k, int heads) {
      lora_forward(be, t, u, ln, lw.lora, ident, C, OC);
      if (bias) be.add_bias_rows(t, b, N, OC);
      if (!norm) return finish(out, t, keep, (long)N * OC);
      const Tensor tn = clip && be.act_store() != Store::f32 ? sc.stage32.part(0, (size_t)N * OC) : out;
      qk_norm_forward(env, sc, tn, rstd, t, norm_w, k, N, heads);
      finish(out, tn, keep, (long)N * OC);
    };
    const Tensor tq = qkn ? a.qraw : a.q, tk = qkn ? a.kraw : a.k;
    if (!staged) {  // the three products in one call (a backend may run them in one parallel region)
      const Backend::MatmulTask tasks[3] = {{tq, w.q.w, Q}, {tk, w.k.w, KVd}, {a.v, w.v.w, KVd}};
      be.matmul_forward_group(tasks, ln, (int)N, C);
      complete(a.q, tq, w.q, a.uq, w.q_bias, Q, a.clipq, qkn, a.rstdq, w.q_norm, false, NH);
      complete(a.k, tk, w.k, a.uk, w.k_bias, KVd, a.clipk, qkn, a.rstdk, w.k_norm, true, NKV);
      complete(a.v, a.v, w.v, a.uv, w.v_bias, KVd, a.clipv, false, Tensor{}, Tensor{}, false, 0);
    } else {  // one projection at a time through the shared staging buffer (f32 q/k products with norms)
      const auto product = [&](Tensor t, const LinearWeights& lw, int OC) {
        be.matmul_forward(t, ln, lw.w, (int)N, C, OC, false);
      };
      const Tensor sq = qkn ? a.qraw : sc.stage32.part(0, (size_t)N * Q);
      product(sq, w.q, Q);
      complete(a.q, sq, w.q, a.uq, w.q_bias, Q, a.clipq, qkn, a.rstdq, w.q_norm, false, NH);
      const Tensor sk = qkn ? a.kraw : sc.stage32.part(0, (size_t)N * KVd);
      product(sk, w.k, KVd);
      complete(a.k, sk, w.k, a.uk, w.k_bias, KVd, a.clipk, qkn, a.rstdk, w.k_norm, true, NKV);
      const Tensor sv = sc.stage32.part(0, (size_t)N * KVd);
      product(sv, w.v, KVd);
      complete(a.v, sv, w.v, a.uv, w.v_bias, KVd, a.clipv, false, Tensor{}, Tensor{}, false, 0);
    }
  }
  Section t(env, env.sec("fwd.rope", "q/k/v"));
  const ops::RopeSpec rs = rope_spec(cfg);
  be.rope_forward(a.q, positions, N, NH, HD, rs);
  be.rope_forward(a.k, positions, N, NKV, HD, rs);
}

void AttentionBlock::output(const BlockEnv& env, Tensor h, AttentionSaved& a, AttentionScratch& sc,
                            const AttentionWeights& w, const PlanView& ident, long N) {
  Backend& be = env.be;
  const int C = env.cfg.hidden_size, Q = AttentionDims::of(env).Q;
  Section t(env, env.sec("fwd.attn_proj", "o"));
  if (!env.tp_on()) return linear_forward(be, h, a.uo, a.att, w.o, ident, N, Q, C, true);
  // Row-parallel o_proj: each rank's heads give a partial sum of the output (its LoRA's too: u is
  // partial, B whole).
  linear_forward(be, sc.tmp, a.uo, a.att, w.o, ident, N, Q, C, false);
  env.tp_all_reduce(sc.tmp);
  be.add(h, sc.tmp);
}

void AttentionBlock::forward(const BlockEnv& env, Tensor h, AttentionSaved& a, AttentionScratch& sc, Tensor ln,
                             Tensor positions, const AttnMask& mask, const AttentionWeights& w, const PlanView& ident,
                             int B, int T) {
  if (env.cfg.is_mla()) return LatentAttention::forward(env, h, a, sc, ln, positions, mask, w, ident, B, T);
  const long N = (long)B * T;
  const auto [NH, NKV, HD, Q, KVd] = AttentionDims::of(env);
  project(env, a, sc, ln, positions, w, ident, N);
  {
    Section t(env, "fwd.attention");
    env.be.attention_forward(a.att, a.attn_saved, a.q, a.k, a.v, mask, B, T, NH, NKV, HD);
  }
  output(env, h, a, sc, w, ident, N);
}

void AttentionBlock::forward_cached(const BlockEnv& env, Tensor h, AttentionSaved& a, AttentionScratch& sc, Tensor ln,
                                    Tensor positions, std::span<const KvRows> seqs, const AttentionWeights& w,
                                    const PlanView& ident, long N) {
  if (env.cfg.is_mla()) return LatentAttention::forward_cached(env, h, a, sc, ln, positions, seqs, w, ident, N);
  Backend& be = env.be;
  const auto [NH, NKV, HD, Q, KVd] = AttentionDims::of(env);
  project(env, a, sc, ln, positions, w, ident, N);
  {
    Section t(env, env.sec("fwd.attention", "attention"));
    // Every sequence's new keys and values join its cache first: its rows then see each other's.
    for (const KvRows& r : seqs) {
      MOETRON_ASSERT(r.k.numel >= (size_t)(r.pos0 + r.rows) * KVd && r.row0 + r.rows <= N);
      be.copy(r.k.part((size_t)r.pos0 * KVd, (size_t)r.rows * KVd),
              a.k.part((size_t)r.row0 * KVd, (size_t)r.rows * KVd));
      be.copy(r.v.part((size_t)r.pos0 * KVd, (size_t)r.rows * KVd),
              a.v.part((size_t)r.row0 * KVd, (size_t)r.rows * KVd));
    }
    be.attention_kv_forward(a.att, a.q, seqs, env.cfg.sliding_window, NH, NKV, HD);
  }
  output(env, h, a, sc, w, ident, N);
}

void AttentionBlock::backward(const BlockEnv& env, Tensor dln, Tensor dh_act, const AttentionSaved& a,
                              AttentionScratch& sc, Tensor ln, Tensor positions, const AttnMask& mask,
                              const AttentionWeights& w, const PlanView& ident, int B, int T) {
  if (env.cfg.is_mla()) return LatentAttention::backward(env, dln, dh_act, a, sc, ln, positions, mask, w, ident, B, T);
  Backend& be = env.be;
  const ModelConfig& cfg = env.cfg;
  const long N = (long)B * T;
  const int C = cfg.hidden_size;
  const auto [NH, NKV, HD, Q, KVd] = AttentionDims::of(env);
  {
    Section t(env, "bwd.attn_proj");
    linear_backward(be, sc.datt, sc.du, dh_act, a.att, a.uo, w.o, ident, N, Q, C, false);
  }
  if (a.recompute_state) {
    // The state as the forward left it; the output goes to dq, which the backward then assigns.
    Section t(env, "bwd.recompute");
    be.attention_forward(sc.dq, a.attn_saved, a.q, a.k, a.v, mask, B, T, NH, NKV, HD);
  }
  {
    Section t(env, "bwd.attention");
    be.attention_backward(sc.dq, sc.dk, sc.dv, sc.datt, a.att, a.attn_saved, a.q, a.k, a.v, mask, B, T, NH, NKV, HD);
  }
  {
    Section t(env, "bwd.rope");
    const ops::RopeSpec rs = rope_spec(cfg);
    be.rope_backward(sc.dq, positions, N, NH, HD, rs);
    be.rope_backward(sc.dk, positions, N, NKV, HD, rs);
  }
  Tensor dq = sc.dq, dk = sc.dk;  // d(the projections' outputs), in the act store
  if (cfg.clip_qkv > 0) {         // clipped values pass no gradient
    be.clamp_backward(sc.dq, a.clipq, N * Q);
    be.clamp_backward(sc.dk, a.clipk, N * KVd);
    be.clamp_backward(sc.dv, a.clipv, N * KVd);
  }
  if (cfg.qk_norm) {
    Section t(env, "bwd.norms");
    if (sc.dq32.data != sc.dq.data) {
      be.convert(sc.dq32, sc.dq);
      be.convert(sc.dk32, sc.dk);
    }
    qk_norm_backward(env, sc, sc.dqraw, sc.dq32, a.qraw, a.rstdq, w.q_norm, w.dq_norm, false, N, NH);
    qk_norm_backward(env, sc, sc.dkraw, sc.dk32, a.kraw, a.rstdk, w.k_norm, w.dk_norm, true, N, NKV);
    dq = as_act(be, sc.dqraw, sc.dq);
    dk = as_act(be, sc.dkraw, sc.dk);
  }
  if (cfg.qkv_bias && !w.dq_bias.empty()) {
    // d(bias) = column sums of d(the biased projection): after the norm's backward when there is one.
    Section t(env, "bwd.bias");
    const Tensor gq = cfg.qk_norm ? sc.dqraw : as_f32(be, sc.dq, sc.dq32);
    const Tensor gk = cfg.qk_norm ? sc.dkraw : as_f32(be, sc.dk, sc.dk32);
    be.bias_backward(w.dq_bias, gq, N, Q);
    be.bias_backward(w.dk_bias, gk, N, KVd);
    be.bias_backward(w.dv_bias, as_f32(be, sc.dv, sc.dv32), N, KVd);
  }
  Section t(env, "bwd.attn_proj");
  linears_backward(be, dln, sc.du, ln, {{w.q, dq, a.uq, Q}, {w.k, dk, a.uk, KVd}, {w.v, sc.dv, a.uv, KVd}}, ident, N,
                   C);
  if (env.tp_on()) env.tp_all_reduce(dln);  // column-parallel q/k/v: partial input gradient
}

}  // namespace moetron
