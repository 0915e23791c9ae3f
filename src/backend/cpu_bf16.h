// The bf16-rounding CPU backend: the CPU ops with every tensor the CUDA backend stores in bf16
// (the act store: GEMM operands, their outputs, the GEMM weights' copy, attention's scores and
// probabilities) rounded to bf16, nearest even, as it is written; everything CUDA keeps in f32
// stays f32.  It is the naive bf16 implementation of the FlashAttention tolerance rule (DESIGN §5):
// the same model body as every backend, unfused, with eager bf16 attention (attention_bf16.h) --
// the reference a GPU is compared with, and the mixed-precision policy tested on every machine.
// bf16 values are kept in fp32 memory (element_bytes 4), so the CPU kernels read them as floats.
#pragma once

#include "backend/cpu.h"

namespace moetron {

class Bf16CpuBackend final : public CpuBackend {
 public:
  // round = false: the same computation without rounding (for testing this backend itself).
  explicit Bf16CpuBackend(bool round = true) : round_(round) {}
  const char* name() const override { return "cpu-bf16"; }
  Store act_store() const override { return Store::bf16; }

  void convert(Tensor dst, Tensor src) override;
  void copy_block(Tensor dst, Tensor src, const ops::BlockCopy& g, float alpha, bool accumulate) override;
  void rmsnorm_forward(Tensor out, Tensor rstd, Tensor inp, Tensor weight, long N, int C, float eps) override;
  void rmsnorm_forward_stats(Tensor out, Tensor rstd, Tensor inp, Tensor weight, Tensor ss, long N, int C, int width,
                             float ss_scale, float eps) override;
  void matmul_forward(Tensor out, Tensor inp, Tensor weight, int N, int IC, int OC, bool accumulate) override;
  void matmul_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor weight, int N, int IC, int OC,
                       bool accumulate) override;
  void rope_forward(Tensor x, Tensor pos, long N, int H, int HD, const ops::RopeSpec& spec) override;
  void rope_backward(Tensor dx, Tensor pos, long N, int H, int HD, const ops::RopeSpec& spec) override;
  size_t attention_saved_numel(int B, int T, int NH) const override;
  void attention_forward(Tensor out, Tensor saved, Tensor q, Tensor k, Tensor v, const AttnMask& mask, int B, int T,
                         int NH, int NKV, int HD) override;
  void attention_kv_forward(Tensor out, Tensor q, std::span<const KvSeq> seqs, int sliding_window, int NH, int NKV,
                            int HD) override;
  void attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor out, Tensor saved, Tensor q, Tensor k,
                          Tensor v, const AttnMask& mask, int B, int T, int NH, int NKV, int HD) override;
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
  void head_backward(Tensor dln, Tensor dhead, Tensor logits, Tensor lse, Tensor targets, Tensor lnf, Tensor head,
                     long N, int C, int64_t Vr, int64_t V0, float scale, bool whole) override;

 private:
  // Rounds t in place when its store is bf16 (n elements from `begin`; all by default).
  void finish(Tensor t) const;
  void round_all(float* p, size_t n) const;
  bool round_;
};

}  // namespace moetron
