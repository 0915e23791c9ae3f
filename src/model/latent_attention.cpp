// Multi-head latent attention; see latent_attention.h.  The backward is the forward in reverse.
#include "model/latent_attention.h"

#include <algorithm>
#include <span>

#include "core/error.h"

namespace moetron {

namespace {

constexpr float kLatentNormEps = 1e-6f;  // DeepseekV3RMSNorm's default, which q_a / kv_a layernorms keep

// This rank's sizes.
struct Mla {
  int nh, dn, dr, dv, HD, qr, kvr;
  long Q() const { return (long)nh * HD; }          // q, k, v, att widths
  long KVB() const { return (long)nh * (dn + dv); }  // kv_b's output
  long V() const { return (long)nh * dv; }          // o_proj's input
  static Mla of(const BlockEnv& env) {
    const ModelConfig& c = env.cfg;
    return {c.num_attention_heads / env.tp_size, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.head_dim,
            c.q_lora_rank, c.kv_lora_rank};
  }
};

// The RoPE of the shared key: an [N, 1, dr] tensor, all of it rotated.
ops::RopeSpec key_rope(const ModelConfig& cfg) {
  ops::RopeSpec s = rope_spec(cfg);
  s.offset = 0;
  return s;
}

// src (f32) in the act store: src itself when that is f32, else converted into `scratch`.
Tensor as_act(Backend& be, Tensor src, Tensor scratch) {
  if (be.act_store() == src.store) return src;
  be.convert(scratch, src);
  return scratch;
}

// Column block [off, off + width) of an [N, ld] matrix <-> a dense [N, width] one.
ops::BlockCopy columns_out(long N, int width, long ld, long off) { return {N, 1, width, width, 0, 0, ld, 0, off}; }
ops::BlockCopy columns_in(long N, int width, long ld, long off) { return {N, 1, width, ld, 0, off, width, 0, 0}; }

}  // namespace

void LatentAttention::carve_saved(AttentionSaved& s, TensorCarver& c, const BlockEnv& env, const AttentionWeights& w,
                                  int B, int T, bool training) {
  (void)w;
  const Mla m = Mla::of(env);
  const long N = (long)B * T;
  const Store act = env.be.act_store(), f32 = Store::f32;
  s.qa32 = m.qr > 0 ? c.take(f32, N * m.qr) : Tensor{};
  s.rstd_qa = m.qr > 0 ? c.take(f32, N) : Tensor{};
  s.qan = m.qr > 0 ? c.take(act, N * m.qr) : Tensor{};
  s.kva32 = c.take(f32, N * (m.kvr + m.dr));
  s.lat32 = c.take(f32, N * m.kvr);
  s.rstd_kv = c.take(f32, N);
  s.latn = c.take(act, N * m.kvr);
  s.krope = c.take(act, N * m.dr);
  s.q = c.take(act, N * m.Q());
  s.k = c.take(act, N * m.Q());
  s.v = c.take(act, N * m.Q());
  const size_t state = env.be.attention_saved_numel(B, T, m.nh);
  s.recompute_state = training && env.selective && state > (size_t)N * m.nh;
  s.attn_saved = training && !s.recompute_state ? c.take(f32, state) : Tensor{};
  s.att = c.take(act, N * m.Q());
  s.atv = c.take(act, N * m.V());
}

void LatentAttention::carve_scratch(AttentionScratch& s, TensorCarver& c, const BlockEnv& env, long N, bool training) {
  const Mla m = Mla::of(env);
  const Store act = env.be.act_store(), f32 = Store::f32;
  s.kvb = c.take(act, N * m.KVB());
  if (!training) return;
  s.datt = c.take(act, N * m.Q());
  s.dq = c.take(act, N * m.Q());
  s.dk = c.take(act, N * m.Q());
  s.dv = c.take(act, N * m.Q());
  s.datv = c.take(act, N * m.V());
  s.dkvb = c.take(act, N * m.KVB());
  s.dkrope = c.take(act, N * m.dr);
  s.dkrope32 = c.take(f32, N * m.dr);
  s.dlatn = c.take(f32, N * m.kvr);
  s.dlat32 = c.take(f32, N * m.kvr);
  s.dkva32 = c.take(f32, N * (m.kvr + m.dr));
  s.dqan = m.qr > 0 ? c.take(f32, N * m.qr) : Tensor{};
  s.dqa32 = m.qr > 0 ? c.take(f32, N * m.qr) : Tensor{};
  // The act-store copies of f32 gradients entering GEMMs (the f32 ones themselves on an f32 store).
  s.dstage = act != f32 ? c.take(act, N * std::max<long>(m.kvr + m.dr, m.qr)) : Tensor{};
}

namespace {

// q (RoPE'd, scaled), the normed latent and the rotated RoPE key of N rows: the projections both the
// training forward and the cached one start with.
void project(const BlockEnv& env, AttentionSaved& a, Tensor ln, Tensor positions, const AttentionWeights& w,
             const PlanView& ident, long N) {
  Backend& be = env.be;
  const ModelConfig& cfg = env.cfg;
  const Mla m = Mla::of(env);
  const int C = cfg.hidden_size, kva = m.kvr + m.dr;
  {
    Section t(env, env.sec("fwd.attn_proj", "q/k/v"));
    if (m.qr > 0) {
      linear_forward(be, a.qa32, Tensor{}, ln, w.q_a, ident, N, C, m.qr, false);
      be.rmsnorm_forward(a.qan, a.rstd_qa, a.qa32, w.q_a_norm, N, m.qr, kLatentNormEps);
      linear_forward(be, a.q, Tensor{}, a.qan, w.q_b, ident, N, m.qr, (int)m.Q(), false);
    } else {
      linear_forward(be, a.q, Tensor{}, ln, w.q, ident, N, C, (int)m.Q(), false);
    }
    linear_forward(be, a.kva32, Tensor{}, ln, w.kv_a, ident, N, C, kva, false);
    be.copy_block(a.lat32, a.kva32, columns_out(N, m.kvr, kva, 0), 1.0f, false);
    be.rmsnorm_forward(a.latn, a.rstd_kv, a.lat32, w.kv_a_norm, N, m.kvr, kLatentNormEps);
    be.copy_block(a.krope, a.kva32, columns_out(N, m.dr, kva, m.kvr), 1.0f, false);
  }
  Section t(env, env.sec("fwd.rope", "q/k/v"));
  be.rope_forward(a.krope, positions, N, 1, m.dr, key_rope(cfg));
  be.rope_forward(a.q, positions, N, m.nh, m.HD, rope_spec(cfg));
  const float s = (float)cfg.softmax_scale_factor();
  if (s != 1.0f) be.copy_block(a.q, a.q, {N, 1, (int)m.Q(), m.Q(), 0, 0, m.Q(), 0, 0}, s, false);
}

// k [rows, nh*HD] = per head [k_nope | the shared rope key], v [rows, nh*HD] = per head [v | 0], from
// kvb [rows, nh*(dn+dv)] and rope [rows, dr].
void expand(Backend& be, const Mla& m, Tensor k, Tensor v, Tensor kvb, Tensor rope, long rows) {
  const int w_kvb = m.dn + m.dv, HD = m.HD;
  be.copy_block(k, kvb, {rows, m.nh, m.dn, m.Q(), HD, 0, m.KVB(), w_kvb, 0}, 1.0f, false);
  be.copy_block(k, rope, {rows, m.nh, m.dr, m.Q(), HD, m.dn, m.dr, 0, 0}, 1.0f, false);
  be.fill_zero(v.part(0, (size_t)rows * m.Q()));
  be.copy_block(v, kvb, {rows, m.nh, m.dv, m.Q(), HD, 0, m.KVB(), w_kvb, m.dn}, 1.0f, false);
}

// h += o_proj(the attention output's v slices) (all-reduced under tp).
void output(const BlockEnv& env, Tensor h, AttentionSaved& a, AttentionScratch& sc, const AttentionWeights& w,
            const PlanView& ident, long N) {
  Backend& be = env.be;
  const Mla m = Mla::of(env);
  const int C = env.cfg.hidden_size;
  be.copy_block(a.atv, a.att, {N, m.nh, m.dv, m.V(), m.dv, 0, m.Q(), m.HD, 0}, 1.0f, false);
  Section t(env, env.sec("fwd.attn_proj", "o"));
  if (!env.tp_on()) return linear_forward(be, h, Tensor{}, a.atv, w.o, ident, N, (int)m.V(), C, true);
  linear_forward(be, sc.tmp, Tensor{}, a.atv, w.o, ident, N, (int)m.V(), C, false);  // row-parallel: partial
  env.tp_all_reduce(sc.tmp);
  be.add(h, sc.tmp);
}

}  // namespace

void LatentAttention::forward(const BlockEnv& env, Tensor h, AttentionSaved& a, AttentionScratch& sc, Tensor ln,
                              Tensor positions, const AttnMask& mask, const AttentionWeights& w, const PlanView& ident,
                              int B, int T) {
  const Mla m = Mla::of(env);
  const long N = (long)B * T;
  project(env, a, ln, positions, w, ident, N);
  {
    Section t(env, "fwd.attention");
    linear_forward(env.be, sc.kvb, Tensor{}, a.latn, w.kv_b, ident, N, m.kvr, (int)m.KVB(), false);
    expand(env.be, m, a.k, a.v, sc.kvb, a.krope, N);
    env.be.attention_forward(a.att, a.attn_saved, a.q, a.k, a.v, mask, B, T, m.nh, m.nh, m.HD);
  }
  output(env, h, a, sc, w, ident, N);
}

void LatentAttention::forward_cached(const BlockEnv& env, Tensor h, AttentionSaved& a, AttentionScratch& sc, Tensor ln,
                                     Tensor positions, std::span<const KvRows> seqs, const AttentionWeights& w,
                                     const PlanView& ident, long N) {
  Backend& be = env.be;
  const Mla m = Mla::of(env);
  project(env, a, ln, positions, w, ident, N);
  Section t(env, env.sec("fwd.attention", "attention"));
  for (const KvRows& r : seqs) {
    const long len = (long)r.pos0 + r.rows;
    MOETRON_ASSERT(r.k.numel >= (size_t)len * m.kvr && r.v.numel >= (size_t)len * m.dr && r.row0 + r.rows <= N);
    MOETRON_ASSERT(sc.xk.numel >= (size_t)len * m.Q() && sc.xkvb.numel >= (size_t)len * m.KVB());
    // The rows' latents and RoPE keys join the cache; then every cached position is expanded.
    be.copy(r.k.part((size_t)r.pos0 * m.kvr, (size_t)r.rows * m.kvr), a.latn.part((size_t)r.row0 * m.kvr, (size_t)r.rows * m.kvr));
    be.copy(r.v.part((size_t)r.pos0 * m.dr, (size_t)r.rows * m.dr), a.krope.part((size_t)r.row0 * m.dr, (size_t)r.rows * m.dr));
    // Row by row as alone: a position's expansion must not depend on the pass (bitwise decoding).
    be.matmul_forward_rowwise(sc.xkvb, r.k.part(0, (size_t)len * m.kvr), w.kv_b.w, (int)len, m.kvr, (int)m.KVB());
    expand(be, m, sc.xk, sc.xv, sc.xkvb, r.v, len);
    // The sequence's rows alone (a backend may take a pass's rows as the sequences' in order).
    const KvRows one{0, r.rows, r.pos0, sc.xk, sc.xv};
    const size_t at = (size_t)r.row0 * m.Q(), count = (size_t)r.rows * m.Q();
    be.attention_kv_forward(a.att.part(at, count), a.q.part(at, count), std::span<const KvRows>(&one, 1), 0, m.nh,
                            m.nh, m.HD);
  }
  output(env, h, a, sc, w, ident, N);
}

void LatentAttention::backward(const BlockEnv& env, Tensor dln, Tensor dh_act, const AttentionSaved& a,
                               AttentionScratch& sc, Tensor ln, Tensor positions, const AttnMask& mask,
                               const AttentionWeights& w, const PlanView& ident, int B, int T) {
  Backend& be = env.be;
  const ModelConfig& cfg = env.cfg;
  const Mla m = Mla::of(env);
  const long N = (long)B * T;
  const int C = cfg.hidden_size, HD = m.HD, kva = m.kvr + m.dr, w_kvb = m.dn + m.dv;
  {
    Section t(env, "bwd.attn_proj");
    linear_backward(be, sc.datv, sc.du, dh_act, a.atv, Tensor{}, w.o, ident, N, (int)m.V(), C, false);
    be.fill_zero(sc.datt);
    be.copy_block(sc.datt, sc.datv, {N, m.nh, m.dv, m.Q(), HD, 0, m.V(), m.dv, 0}, 1.0f, false);
  }
  if (a.recompute_state) {
    Section t(env, "bwd.recompute");
    be.attention_forward(sc.dq, a.attn_saved, a.q, a.k, a.v, mask, B, T, m.nh, m.nh, HD);
  }
  {
    Section t(env, "bwd.attention");
    be.attention_backward(sc.dq, sc.dk, sc.dv, sc.datt, a.att, a.attn_saved, a.q, a.k, a.v, mask, B, T, m.nh, m.nh,
                          HD);
  }
  {
    Section t(env, "bwd.rope");
    const float s = (float)cfg.softmax_scale_factor();
    if (s != 1.0f) be.copy_block(sc.dq, sc.dq, {N, 1, (int)m.Q(), m.Q(), 0, 0, m.Q(), 0, 0}, s, false);
    be.rope_backward(sc.dq, positions, N, m.nh, HD, rope_spec(cfg));
    // The shared key's gradient: its slice of every head's, summed (over this rank's heads, then tp).
    be.fill_zero(sc.dkrope32);
    be.copy_block(sc.dkrope32, sc.dk, {N, m.nh, m.dr, m.dr, 0, 0, m.Q(), HD, m.dn}, 1.0f, true);
    if (env.tp_on()) env.tp_all_reduce(sc.dkrope32);
    be.convert(sc.dkrope, sc.dkrope32);
    be.rope_backward(sc.dkrope, positions, N, 1, m.dr, key_rope(cfg));
  }
  Section t(env, "bwd.attn_proj");
  // kv_b: d[k_nope | v] per head, then the latent.
  be.copy_block(sc.dkvb, sc.dk, {N, m.nh, m.dn, m.KVB(), w_kvb, 0, m.Q(), HD, 0}, 1.0f, false);
  be.copy_block(sc.dkvb, sc.dv, {N, m.nh, m.dv, m.KVB(), w_kvb, m.dn, m.Q(), HD, 0}, 1.0f, false);
  linear_backward(be, sc.dlatn, sc.du, sc.dkvb, a.latn, Tensor{}, w.kv_b, ident, N, m.kvr, (int)m.KVB(), false);
  if (m.qr > 0) linear_backward(be, sc.dqan, sc.du, sc.dq, a.qan, Tensor{}, w.q_b, ident, N, m.qr, (int)m.Q(), false);
  // The replicated down-projections see every head's gradient.
  if (env.tp_on()) {
    env.tp_all_reduce(sc.dlatn);
    if (m.qr > 0) env.tp_all_reduce(sc.dqan);
  }
  be.rmsnorm_backward(sc.dlat32, w.dkv_a_norm, sc.dlatn, a.lat32, w.kv_a_norm, a.rstd_kv, N, m.kvr, false);
  be.copy_block(sc.dkva32, sc.dlat32, columns_in(N, m.kvr, kva, 0), 1.0f, false);
  be.copy_block(sc.dkva32, sc.dkrope, columns_in(N, m.dr, kva, m.kvr), 1.0f, false);
  if (m.qr > 0) {
    be.rmsnorm_backward(sc.dqa32, w.dq_a_norm, sc.dqan, a.qa32, w.q_a_norm, a.rstd_qa, N, m.qr, false);
    const Tensor dqa = as_act(be, sc.dqa32, sc.dstage.empty() ? Tensor{} : sc.dstage.part(0, (size_t)N * m.qr));
    linear_backward(be, dln, sc.du, dqa, ln, Tensor{}, w.q_a, ident, N, C, m.qr, false);
  } else {
    // Column-parallel q_proj: a partial input gradient, summed over tp before the whole kv_a one joins.
    linear_backward(be, dln, sc.du, sc.dq, ln, Tensor{}, w.q, ident, N, C, (int)m.Q(), false);
    if (env.tp_on()) env.tp_all_reduce(dln);
  }
  const Tensor dkva = as_act(be, sc.dkva32, sc.dstage.empty() ? Tensor{} : sc.dstage.part(0, (size_t)N * kva));
  linear_backward(be, dln, sc.du, dkva, ln, Tensor{}, w.kv_a, ident, N, C, kva, true);
}

}  // namespace moetron
