// The CPU backend: fp32 tensors in host memory, the ops of src/ops (OpenMP, OpenBLAS).  The
// reference backend: what CPU training runs, and what every other backend is compared with.
// Bf16CpuBackend (cpu_bf16.h) derives from it.
#pragma once

#include <vector>

#include "backend/backend.h"
#include "ops/attention.h"

namespace moetron {

class CpuBackend : public Backend {
 public:
  const char* name() const override { return "cpu"; }
  bool host_memory() const override { return true; }
  Store act_store() const override { return Store::f32; }
  uint8_t element_bytes(Store s) const override { return s == Store::u8 ? 1 : 4; }

  std::unique_ptr<Allocation> allocate(size_t bytes, const std::string& what) override;
  void upload(Tensor dst, const void* host) override;
  void download(void* host, Tensor src) override;
  void copy(Tensor dst, Tensor src) override;
  void fill_zero(Tensor t) override;
  void convert(Tensor dst, Tensor src) override;
  void add(Tensor y, Tensor x) override;

  void embedding_forward(Tensor out, Tensor tokens, Tensor wte, long N, int C, int64_t V0, int64_t Vr,
                         bool whole) override;
  void embedding_backward(Tensor dwte, Tensor dout, Tensor tokens, long N, int C, int64_t V0, int64_t Vr,
                          bool whole) override;
  void rmsnorm_forward(Tensor out, Tensor rstd, Tensor inp, Tensor weight, long N, int C, float eps) override;
  void rmsnorm_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor weight, Tensor rstd, long N,
                        int C, bool accumulate) override;
  void row_dot(Tensor out, Tensor a, Tensor b, Tensor w, long N, int C) override;
  void rmsnorm_forward_stats(Tensor out, Tensor rstd, Tensor inp, Tensor weight, Tensor ss, long N, int C, int width,
                             float ss_scale, float eps) override;
  void rmsnorm_backward_stats(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor weight, Tensor rstd,
                              Tensor dot, long N, int C, int width, float dot_scale) override;
  void matmul_forward(Tensor out, Tensor inp, Tensor weight, int N, int IC, int OC, bool accumulate) override;
  void matmul_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor weight, int N, int IC, int OC,
                       bool accumulate) override;
  void rope_forward(Tensor x, Tensor pos, long N, int H, int HD, const ops::RopeSpec& spec) override;
  void rope_backward(Tensor dx, Tensor pos, long N, int H, int HD, const ops::RopeSpec& spec) override;
  size_t attention_saved_numel(int B, int T, int NH) const override;
  void attention_forward(Tensor out, Tensor saved, Tensor q, Tensor k, Tensor v, const AttnMask& mask, int B, int T,
                         int NH, int NKV, int HD) override;
  void attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor out, Tensor saved, Tensor q, Tensor k,
                          Tensor v, const AttnMask& mask, int B, int T, int NH, int NKV, int HD) override;
  void attention_kv_forward(Tensor out, Tensor q, std::span<const KvSeq> seqs, int sliding_window, int NH, int NKV,
                            int HD) override;
  void copy_block(Tensor dst, Tensor src, const ops::BlockCopy& g, float alpha, bool accumulate) override;
  void add_bias_rows(Tensor x, Tensor bias, long N, int E) override;
  void bias_backward(Tensor dbias, Tensor dout, long N, int C) override;
  void sigmoid_forward(Tensor s, Tensor x, long n) override;
  void sigmoid_backward(Tensor dx, Tensor ds, Tensor s, long n) override;
  void clamp_forward(Tensor x, Tensor mask, float c, long n) override;
  void clamp_backward(Tensor dx, Tensor mask, long n) override;
  void router_forward(Tensor probs, Tensor topk_idx, Tensor topk_w, Tensor logits, Tensor bias, long N, int E, int K,
                      const ops::RouterSpec& spec) override;
  void router_layer_stats(ops::RouterLayerStats& st, Tensor logits, Tensor probs, Tensor topk_idx, Tensor token_mask,
                          long N, int E, int K) override;
  void router_backward(Tensor dlogits, Tensor dtopk_w, const double* dprobs_per_expert, Tensor token_mask,
                       Tensor probs, Tensor topk_idx, Tensor topk_w, long N, int E, int K, const ops::RouterSpec& spec) override;
  void router_row_stats(ops::RouterLayerStats& st, Tensor probs, Tensor topk_idx, Tensor token_mask, long N, int E,
                        int K, int row_len, bool sigmoid) override;
  void router_sequence_backward(Tensor dlogits, Tensor row_grad, Tensor token_mask, Tensor probs, long N, int E,
                                int row_len, bool sigmoid, float scale) override;
  void router_z_loss_backward(Tensor dlogits, Tensor logits, Tensor probs, Tensor token_mask, long N, int E,
                              float scale, long real_tokens) override;
  PlanView upload_plan(const ops::MoePlan& plan, Tensor row_token, Tensor row_of) override;
  void moe_permute_forward(Tensor xperm, Tensor x, const PlanView& plan, int C) override;
  void moe_permute_backward(Tensor dx, Tensor dxperm, const PlanView& plan, int C) override;
  void moe_combine_forward(Tensor out, Tensor yperm, Tensor w, const PlanView& plan, int C) override;
  void moe_combine_backward(Tensor dyperm, Tensor dw, Tensor dout, Tensor yperm, Tensor w, const PlanView& plan,
                            int C) override;
  void moe_experts_forward(Tensor y, Tensor h13, Tensor act, Tensor xperm, Tensor w13, Tensor w2,
                           const PlanView& plan, int C, int I) override;
  void moe_experts_backward(Tensor dxperm, Tensor dw13, Tensor dw2, Tensor dy, Tensor h13, Tensor act, Tensor xperm,
                            Tensor w13, Tensor w2, const PlanView& plan, int C, int I) override;
  void grouped_matmul_forward(Tensor out, Tensor inp, Tensor weight, const PlanView& plan, int IC, int OC, float alpha,
                              bool accumulate, int ld_in = 0, int ld_out = 0) override;
  void grouped_matmul_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor weight,
                               const PlanView& plan, int IC, int OC, float alpha, bool accumulate, int ld_in = 0,
                               int ld_out = 0) override;
  void swiglu_forward(Tensor act, Tensor h13, long M, int I) override;
  void swiglu_backward(Tensor dh13, Tensor dact, Tensor h13, long M, int I) override;
  void gather_rows(Tensor out, Tensor in, Tensor index, long rows, int C) override;
  double cross_entropy_forward(Tensor lse, Tensor logits, Tensor targets, long N, int64_t Vr, int64_t V0, float scale,
                               dist::Comm* tp) override;
  void head_backward(Tensor dln, Tensor dhead, Tensor logits, Tensor lse, Tensor targets, Tensor lnf, Tensor head,
                     long N, int C, int64_t Vr, int64_t V0, float scale, bool whole) override;
  void init_normal(Tensor p, uint64_t seed, uint64_t key, double std, float fill) override;
  void adamw_update(Tensor param, Tensor m, Tensor v, Tensor grad, float grad_scale, double lr, double beta1,
                    double beta2, double eps, double weight_decay, long step) override;
  double sum_squares(Tensor values, const std::vector<std::pair<size_t, size_t>>& counted) override;

 protected:
  // logits[N,Vr] become scale * (softmax - onehot) in place (whole: ops/cross_entropy; else the
  // vocabulary-parallel form of dist/tp_ops).
  static void logits_to_gradient(Tensor logits, Tensor lse, Tensor targets, long N, int64_t Vr, int64_t V0, float scale,
                                 bool whole);
  static ops::AttentionMask host_mask(const AttnMask& m);
  // Scratch floats owned by the backend (the accumulating variants, the expert backward).
  float* scratch(std::vector<float>& buf, size_t n) {
    if (buf.size() < n) buf.resize(n);
    return buf.data();
  }
  std::vector<float> tmp_, ffn_scratch_;
};

}  // namespace moetron
