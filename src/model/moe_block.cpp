// The MoE block; see moe_block.h.  The backward is the forward's call list in reverse.
#include "model/moe_block.h"

#include "core/error.h"
#include "dist/comm.h"

namespace moetron {

ops::RouterSpec router_spec(const ModelConfig& cfg) {
  ops::RouterSpec s = ops::RouterSpec::softmax(cfg.norm_topk_prob);
  if (cfg.router_sigmoid) {
    s.sigmoid = true;
    s.n_group = cfg.n_group;
    s.topk_group = cfg.topk_group;
    s.scale = (float)cfg.routed_scaling_factor;
  }
  return s;
}

void MoeSaved::carve(TensorCarver& c, const BlockEnv& env, const MoeWeights& w, long N, bool local_experts,
                     bool training) {
  const ModelConfig& cfg = env.cfg;
  const Store act = env.be.act_store(), f32 = Store::f32, i32 = Store::i32;
  const int C = cfg.hidden_size, E = cfg.num_local_experts, K = cfg.num_experts_per_tok;
  const long M = N * K, I = cfg.expert_intermediate_size() / env.tp_size;
  rlogits = c.take(f32, N * E);
  rprobs = c.take(f32, N * E);
  topk_w = c.take(f32, N * K);
  topk_idx = c.take(i32, N * K);
  combine_w = c.take(f32, N * K);
  xperm = c.take(act, M * C);
  yperm = c.take(act, M * C);
  row_token = c.take(i32, M);
  row_of = c.take(i32, M);
  // The pieces path (adapters) writes them; the fused op may keep them itself.
  const bool own = !training && env.be.experts_without_saved();
  const bool hidden = local_experts && (!own || w.experts.lora());
  const bool rc = training && env.selective;
  dispatch.h13 = hidden ? c.take(act, 2 * M * I) : Tensor{};
  dispatch.act = hidden && !rc ? c.take(act, M * I) : Tensor{};
  dispatch.recompute_act = hidden && rc;
  // LoRA: each adapted projection keeps u = x A^T [rows, r].
  const auto lu = [&](const LinearWeights& lw, long rows) {
    return lw.lora.on() ? c.take(act, rows * lw.lora.u_width()) : Tensor{};
  };
  dispatch.u13 = local_experts ? lu(w.experts.w13, M) : Tensor{};
  dispatch.u2 = local_experts ? lu(w.experts.w2, M) : Tensor{};
  ur = w.router.lora.on() ? c.take(f32, N * (long)w.router.lora.r) : Tensor{};
  const bool sh = cfg.has_shared_expert();
  const long Is = sh ? cfg.shared_expert_intermediate_size / env.tp_size : 0;
  const bool sh_hidden = sh && (!own || w.shared.lora());
  shu13 = sh ? lu(w.shared.w13, N) : Tensor{};
  shu2 = sh ? lu(w.shared.w2, N) : Tensor{};
  sh13 = sh_hidden ? c.take(act, N * 2 * Is) : Tensor{};
  shact = sh_hidden && !rc ? c.take(act, N * Is) : Tensor{};
  shact_recompute = sh_hidden && rc;
  shy = sh ? c.take(act, N * C) : Tensor{};
  sgl = cfg.shared_expert_gated() ? c.take(f32, N) : Tensor{};
  sg = cfg.shared_expert_gated() ? c.take(f32, N) : Tensor{};
}

void MoeScratch::carve(TensorCarver& c, const BlockEnv& env, int router_lora_rank, long N) {
  const ModelConfig& cfg = env.cfg;
  const Store act = env.be.act_store(), f32 = Store::f32;
  const int C = cfg.hidden_size, E = cfg.num_local_experts, K = cfg.num_experts_per_tok;
  const long M = N * K;
  const bool shared = cfg.has_shared_expert(), gated = cfg.shared_expert_gated();
  drlogits = c.take(f32, N * E);
  dtopk = c.take(f32, N * K);
  dxperm = c.take(act, M * C);
  dyperm = c.take(act, M * C);
  dshy = shared ? c.take(act, N * C) : Tensor{};
  dsg = gated ? c.take(f32, N) : Tensor{};
  dsgl = gated ? c.take(f32, N) : Tensor{};
  dxs = shared ? c.take(f32, N * C) : Tensor{};
  dur = router_lora_rank > 0 ? c.take(f32, N * (long)router_lora_rank) : Tensor{};
}

MoeBlock::MoeBlock(Backend& be, const ModelConfig& cfg, dist::Comm* ep, int tp_size) {
  const int C = cfg.hidden_size, I = cfg.expert_intermediate_size() / tp_size;
  dispatch_ = ep && ep->size() > 1 ? make_all_to_all_dispatch(be, *ep, C, I, cfg.num_local_experts)
                                   : make_local_dispatch(be, C, I);
}

void MoeBlock::zero_dropped_rows(Backend& be, Tensor rows, const ops::MoePlan& plan, int C) {
  const size_t kept = (size_t)plan.expert_offsets[plan.E - plan.overflow], all = (size_t)plan.N * plan.K;
  if (kept < all) be.fill_zero(rows.part(kept * C, (all - kept) * C));
}

long MoeBlock::forward(const BlockEnv& env, Tensor out, MoeSaved& a, MoeScratch& sc, Tensor ln, Tensor lnf,
                       Tensor token_mask, const uint8_t* host_mask, const MoeWeights& w, const PlanView& ident,
                       ops::RouterLayerStats* stats) {
  Backend& be = env.be;
  const ModelConfig& cfg = env.cfg;
  const int C = cfg.hidden_size, E = cfg.num_local_experts, K = cfg.num_experts_per_tok;
  const long N = (long)ln.numel / C;
  long dropped = 0;
  {
    Section t(env, env.sec("fwd.router", "router and gathering"));
    linear_forward(be, a.rlogits, a.ur, lnf, w.router, ident, N, C, E, false);  // f32, its LoRA too
    if (!router_bias_.empty()) be.add_bias_rows(a.rlogits, router_bias_, N, E);
    be.router_forward(a.rprobs, a.topk_idx, a.topk_w, a.rlogits, w.selection_bias, N, E, K, router_spec(cfg));
    if (stats) be.router_layer_stats(*stats, a.rlogits, a.rprobs, a.topk_idx, token_mask, N, E, K);
    if (stats && seq_row_len_ > 0)
      be.router_row_stats(*stats, a.rprobs, a.topk_idx, token_mask, N, E, K, seq_row_len_, cfg.router_sigmoid);
    // The plan is built on the host from the router's choices (copies on a device backend).
    const int32_t* idx = nullptr;
    const float *tw = nullptr, *probs = nullptr;
    if (be.host_memory()) {
      idx = a.topk_idx.i32();
      tw = a.topk_w.f32();
      probs = a.rprobs.f32();
    } else {
      topk_idx_host_.resize(a.topk_idx.numel);
      be.download(topk_idx_host_.data(), a.topk_idx);
      idx = topk_idx_host_.data();
      if (capacity_factor_ > 0) {
        topk_w_host_.resize(a.topk_w.numel);
        probs_host_.resize(a.rprobs.numel);
        be.download(topk_w_host_.data(), a.topk_w);
        be.download(probs_host_.data(), a.rprobs);
        tw = topk_w_host_.data();
        probs = probs_host_.data();
      }
    }
    dropped = build_dispatch_plan(a.plan, combine_host_, idx, tw, probs, host_mask, N, E, K, capacity_factor_);
    if (a.plan.overflow) be.upload(a.combine_w, combine_host_.data());
    a.pv = be.upload_plan(a.plan, a.row_token, a.row_of);
  }
  {
    Section t(env, env.sec("fwd.moe_permute", "router and gathering"));
    be.moe_permute_forward(a.xperm, ln, a.pv, C);
  }
  if (env.inference) {  // one section for the experts (the dispatcher's sections are training's)
    Section t(env, "experts");
    dispatch_->forward(a.dispatch, a.yperm, a.xperm, a.pv, w.experts, nullptr);
  } else {
    dispatch_->forward(a.dispatch, a.yperm, a.xperm, a.pv, w.experts, env.profile);
  }
  zero_dropped_rows(be, a.yperm, a.plan, C);  // dropped rows (capacity) computed nothing: zeros
  {
    Section t(env, env.sec("fwd.moe_permute", "experts combine"));
    be.moe_combine_forward(out, a.yperm, a.plan.overflow ? a.combine_w : a.topk_w, a.pv, C);
  }
  if (!a.shy.empty()) {
    // The shared expert, every token: out += sigmoid(ln . w_gate) * FFN_shared(ln) (Qwen2-MoE), or
    // out += FFN_shared(ln) (DeepSeek-V3 / GLM-4.5's ungated shared experts, one FFN of their summed width).
    Section t(env, env.sec("fwd.shared_expert", "shared expert"));
    const int Is = cfg.shared_expert_intermediate_size / env.tp_size;
    shared_ffn_.forward(be, a.shy, ExpertFfnSaved{a.sh13, a.shact, a.shu13, a.shu2, a.shact_recompute}, ln, ident,
                       w.shared, C, Is);
    if (cfg.shared_expert_gated()) {
      linear_forward(be, a.sgl, Tensor{}, lnf, w.shared_gate, ident, N, C, 1, false);
      be.sigmoid_forward(a.sg, a.sgl, N);
      be.moe_combine_forward(sc.tmp, a.shy, a.sg, ident, C);
    } else {
      be.convert(sc.tmp, a.shy);
    }
    be.add(out, sc.tmp);  // under tp both parts are partial sums, all-reduced together below
  }
  // Row-parallel w2: the output is a partial sum on each tp rank.
  if (env.tp_on()) env.tp_all_reduce(out);
  return dropped;
}

void MoeBlock::backward(const BlockEnv& env, Tensor dln, Tensor dout, MoeSaved& a, MoeScratch& sc, Tensor ln,
                        Tensor lnf, Tensor token_mask, const double* aux_dprobs, double z_coef, long real_tokens,
                        const MoeWeights& w, const PlanView& ident, const std::vector<float>* seq_row_grad) {
  Backend& be = env.be;
  const ModelConfig& cfg = env.cfg;
  const int C = cfg.hidden_size, E = cfg.num_local_experts, K = cfg.num_experts_per_tok;
  const long N = (long)ln.numel / C;
  {
    Section t(env, "bwd.moe_permute");
    be.moe_combine_backward(sc.dyperm, sc.dtopk, dout, a.yperm, a.plan.overflow ? a.combine_w : a.topk_w, a.pv, C);
  }
  // yperm is this rank's partial expert output, so the routing-weight gradient is partial too.
  if (env.tp_on()) env.tp_all_reduce(sc.dtopk);
  dispatch_->backward(sc.dxperm, sc.dyperm, a.dispatch, a.xperm, a.pv, w.experts, env.profile);
  zero_dropped_rows(be, sc.dxperm, a.plan, C);  // dropped rows pass no gradient to the input
  {
    Section t(env, "bwd.moe_permute");
    be.moe_permute_backward(dln, sc.dxperm, a.pv, C);
  }
  if (env.tp_on()) env.tp_all_reduce(dln);  // column-parallel w1/w3: partial input gradient
  Section t(env, "bwd.router");
  be.router_backward(sc.drlogits, sc.dtopk, aux_dprobs, token_mask, a.rprobs, a.topk_idx, a.topk_w, N, E, K,
                     router_spec(cfg));
  if (z_coef != 0.0)
    be.router_z_loss_backward(sc.drlogits, a.rlogits, a.rprobs, token_mask, N, E, (float)z_coef, real_tokens);
  if (seq_row_grad != nullptr && !seq_row_grad->empty()) {
    MOETRON_ASSERT(seq_row_len_ > 0 && (long)seq_row_grad->size() == N / seq_row_len_ * E);
    const size_t bytes = seq_row_grad->size() * sizeof(float);
    if (!row_grad_ || row_grad_->bytes() < bytes) row_grad_ = be.allocate(bytes, "sequence loss gradient");
    const Tensor g = be.view(row_grad_->data(), Store::f32, seq_row_grad->size());
    be.upload(g, seq_row_grad->data());
    be.router_sequence_backward(sc.drlogits, g, token_mask, a.rprobs, N, E, seq_row_len_, cfg.router_sigmoid, 1.0f);
  }
  linear_backward(be, dln, sc.dur, sc.drlogits, lnf, a.ur, w.router, ident, N, C, E, true);
  if (a.shy.empty()) return;
  // The shared expert in reverse: d(shy) = sg * dout, d(sg) = <dout, shy> (a partial sum under tp,
  // like shy), through the sigmoid into the gate (ungated: d(shy) = dout); the FFN's input gradient
  // is partial too.
  Section ts(env, "bwd.shared_expert");
  const int Is = cfg.shared_expert_intermediate_size / env.tp_size;
  if (cfg.shared_expert_gated()) {
    be.moe_combine_backward(sc.dshy, sc.dsg, dout, a.shy, a.sg, ident, C);
    if (env.tp_on()) env.tp_all_reduce(sc.dsg);
    be.sigmoid_backward(sc.dsgl, sc.dsg, a.sg, N);
    linear_backward(be, dln, Tensor{}, sc.dsgl, lnf, Tensor{}, w.shared_gate, ident, N, C, 1, true);
  } else {
    be.convert(sc.dshy, dout);
  }
  shared_ffn_.backward(be, sc.dxs, sc.dshy, ExpertFfnSaved{a.sh13, a.shact, a.shu13, a.shu2, a.shact_recompute}, ln, ident,
                       w.shared, C,
                       Is);
  if (env.tp_on()) env.tp_all_reduce(sc.dxs);
  be.add(dln, sc.dxs);
}

}  // namespace moetron
