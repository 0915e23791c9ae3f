// The dense FFN block; see dense_ffn.h.
#include "model/dense_ffn.h"

#include <vector>

namespace moetron {

void DenseFfnSaved::carve(TensorCarver& c, const BlockEnv& env, const ExpertFfnWeights& w, long N, int I,
                          bool training) {
  const Store act = env.be.act_store(), i32 = Store::i32;
  row_token = c.take(i32, N);
  row_of = c.take(i32, N);
  const bool hidden = training || !env.be.experts_without_saved() || w.lora();
  ffn.h13 = hidden ? c.take(act, 2 * N * I) : Tensor{};
  // Selective recompute: act is the model's shared buffer, refilled by the backward.
  ffn.recompute_act = hidden && training && env.selective;
  ffn.act = hidden && !ffn.recompute_act ? c.take(act, N * I) : Tensor{};
  // LoRA: u = x A^T of each adapted projection ([N, 2r] for the separate gate / up factors).
  const auto lu = [&](const LinearWeights& lw) { return lw.lora.on() ? c.take(act, N * lw.lora.u_width()) : Tensor{}; };
  ffn.u13 = lu(w.w13);
  ffn.u2 = lu(w.w2);
}

void DenseFfnSaved::build_plan(Backend& be, long N) {
  experts.assign(N, 0);
  ops::moe_plan_build(plan, experts.data(), N, 1, 1);
  pv = be.upload_plan(plan, row_token, row_of);
}

void DenseFfnBlock::forward(const BlockEnv& env, Tensor out, DenseFfnSaved& s, Tensor ln, const ExpertFfnWeights& w,
                            int I) {
  {
    Section t(env, env.sec("fwd.experts", "dense ffn"));
    ffn_.forward(env.be, out, s.ffn, ln, s.pv, w, env.cfg.hidden_size, I);
  }
  if (env.tp_on()) env.tp_all_reduce(out);  // row-parallel down: a partial sum on each tp rank
}

void DenseFfnBlock::backward(const BlockEnv& env, Tensor dln, Tensor dout_act, DenseFfnSaved& s, Tensor ln,
                             const ExpertFfnWeights& w, int I) {
  Section t(env, "bwd.experts");
  ffn_.backward(env.be, dln, dout_act, s.ffn, ln, s.pv, w, env.cfg.hidden_size, I);
  if (env.tp_on()) env.tp_all_reduce(dln);  // column-parallel gate / up: partial input gradient
}

}  // namespace moetron
