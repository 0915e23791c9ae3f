// Bf16CpuBackend: each op runs as on CpuBackend, then rounds what it wrote in the bf16 store.  The
// fused CPU ops whose intermediates CUDA keeps in bf16 (the expert FFN, attention, the head's
// logit gradient) run unfused here, rounding each intermediate as it is materialised.
#include "backend/cpu_bf16.h"

#include "backend/attention_bf16.h"
#include "core/dtype.h"
#include "dist/tp_ops.h"
#include "ops/cross_entropy.h"
#include "ops/matmul.h"
#include "ops/swiglu.h"

namespace moetron {

void Bf16CpuBackend::round_all(float* p, size_t n) const {
  if (!round_) return;
  const long m = (long)n;
#pragma omp parallel for schedule(static)
  for (long i = 0; i < m; i++) p[i] = bf16_to_f32(f32_to_bf16(p[i]));
}

void Bf16CpuBackend::finish(Tensor t) const {
  if (!t.empty() && t.store == Store::bf16) round_all(t.f32(), t.numel);
}

void Bf16CpuBackend::convert(Tensor dst, Tensor src) {
  MOETRON_ASSERT(dst.numel == src.numel);
  if (dst.data != src.data) CpuBackend::copy(Tensor{dst.data, dst.numel, Store::f32, 4}, Tensor{src.data, src.numel, Store::f32, 4});
  finish(dst);
}

void Bf16CpuBackend::rmsnorm_forward(Tensor out, Tensor rstd, Tensor inp, Tensor weight, long N, int C, float eps) {
  CpuBackend::rmsnorm_forward(out, rstd, inp, weight, N, C, eps);
  finish(out);
}

void Bf16CpuBackend::rmsnorm_forward_stats(Tensor out, Tensor rstd, Tensor inp, Tensor weight, Tensor ss, long N,
                                           int C, int width, float ss_scale, float eps) {
  CpuBackend::rmsnorm_forward_stats(out, rstd, inp, weight, ss, N, C, width, ss_scale, eps);
  finish(out);
}

void Bf16CpuBackend::matmul_forward(Tensor out, Tensor inp, Tensor weight, int N, int IC, int OC, bool accumulate) {
  CpuBackend::matmul_forward(out, inp, weight, N, IC, OC, accumulate);
  finish(out);
}

void Bf16CpuBackend::matmul_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor weight, int N,
                                     int IC, int OC, bool accumulate) {
  CpuBackend::matmul_backward(dinp, dweight, dout, inp, weight, N, IC, OC, accumulate);
  finish(dinp);
}

void Bf16CpuBackend::copy_block(Tensor dst, Tensor src, const ops::BlockCopy& g, float alpha, bool accumulate) {
  CpuBackend::copy_block(dst, src, g, alpha, accumulate);
  finish(dst);  // an act-store destination holds bf16 values
}

void Bf16CpuBackend::rope_forward(Tensor x, Tensor pos, long N, int H, int HD, const ops::RopeSpec& spec) {
  CpuBackend::rope_forward(x, pos, N, H, HD, spec);
  finish(x);
}

void Bf16CpuBackend::rope_backward(Tensor dx, Tensor pos, long N, int H, int HD, const ops::RopeSpec& spec) {
  CpuBackend::rope_backward(dx, pos, N, H, HD, spec);
  finish(dx);
}

size_t Bf16CpuBackend::attention_saved_numel(int B, int T, int NH) const { return 2 * (size_t)B * NH * T * T; }

void Bf16CpuBackend::attention_forward(Tensor out, Tensor saved, Tensor q, Tensor k, Tensor v, const AttnMask& mask,
                                       int B, int T, int NH, int NKV, int HD) {
  const size_t P = (size_t)B * NH * T * T;
  attention_bf16_forward(out.f32(), saved.f32(), saved.f32() + P, q.f32(), k.f32(), v.f32(), host_mask(mask), B, T,
                         NH, NKV, HD, round_);
}

void Bf16CpuBackend::attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor out, Tensor saved,
                                        Tensor q, Tensor k, Tensor v, const AttnMask& mask, int B, int T, int NH,
                                        int NKV, int HD) {
  (void)out;
  (void)mask;  // the saved probabilities are 0 wherever the mask hides a key
  const size_t P = (size_t)B * NH * T * T;
  attention_bf16_backward(dq.f32(), dk.f32(), dv.f32(), dout.f32(), saved.f32(), saved.f32() + P, q.f32(), k.f32(),
                          v.f32(), B, T, NH, NKV, HD, round_);
}

// The fp32 reference over the bf16 cache, its output rounded as CUDA stores it.
void Bf16CpuBackend::attention_kv_forward(Tensor out, Tensor q, std::span<const KvSeq> seqs, int sliding_window,
                                          int NH, int NKV, int HD) {
  CpuBackend::attention_kv_forward(out, q, seqs, sliding_window, NH, NKV, HD);
  finish(out);
}

void Bf16CpuBackend::moe_combine_backward(Tensor dyperm, Tensor dw, Tensor dout, Tensor yperm, Tensor w,
                                          const PlanView& plan, int C) {
  CpuBackend::moe_combine_backward(dyperm, dw, dout, yperm, w, plan, C);
  finish(dyperm);
}

// Per expert over its rows, each GEMM output and the SwiGLU output rounded as CUDA stores them.
void Bf16CpuBackend::moe_experts_forward(Tensor y, Tensor h13, Tensor act, Tensor xperm, Tensor w13, Tensor w2,
                                         const PlanView& plan, int C, int I) {
  const ops::MoePlan& p = *plan.plan;
  const bool round_y = y.store == Store::bf16;
  for (int e = 0; e < p.E - p.overflow; e++) {
    const long off = p.expert_offsets[e], rows = p.expert_offsets[e + 1] - off;
    if (rows == 0) continue;
    float* hp = h13.f32() + off * 2 * I;
    float* ap = act.f32() + off * I;
    float* yp = y.f32() + off * C;
    ops::matmul_forward(hp, xperm.f32() + off * C, w13.f32() + (size_t)e * 2 * I * C, (int)rows, C, 2 * I);
    round_all(hp, (size_t)rows * 2 * I);
    ops::swiglu_forward(ap, hp, rows, I);
    round_all(ap, (size_t)rows * I);
    ops::matmul_forward(yp, ap, w2.f32() + (size_t)e * I * C, (int)rows, I, C);
    if (round_y) round_all(yp, (size_t)rows * C);
  }
}

void Bf16CpuBackend::moe_experts_backward(Tensor dxperm, Tensor dw13, Tensor dw2, Tensor dy, Tensor h13, Tensor act,
                                          Tensor xperm, Tensor w13, Tensor w2, const PlanView& plan, int C, int I) {
  const ops::MoePlan& p = *plan.plan;
  const bool round_dx = dxperm.store == Store::bf16;
  const size_t M = (size_t)p.N * p.K;
  float* dact = scratch(ffn_scratch_, 3 * M * I);
  float* dh13 = dact + M * I;
  const size_t IC = (size_t)I * C;
  for (int e = 0; e < p.E - p.overflow; e++) {
    const long off = p.expert_offsets[e], rows = p.expert_offsets[e + 1] - off;
    if (rows == 0) continue;
    ops::matmul_backward(dact + off * I, dw2.f32() + e * IC, dy.f32() + off * C, act.f32() + off * I,
                         w2.f32() + e * IC, (int)rows, I, C);
    round_all(dact + off * I, (size_t)rows * I);
    ops::swiglu_backward(dh13 + off * 2 * I, dact + off * I, h13.f32() + off * 2 * I, rows, I);
    round_all(dh13 + off * 2 * I, (size_t)rows * 2 * I);
    ops::matmul_backward(dxperm.f32() + off * C, dw13.f32() + e * 2 * IC, dh13 + off * 2 * I,
                         xperm.f32() + off * C, w13.f32() + e * 2 * IC, (int)rows, C, 2 * I);
    if (round_dx) round_all(dxperm.f32() + off * C, (size_t)rows * C);
  }
}

// The grouped linear and SwiGLU with their act-store outputs rounded as CUDA writes them.
// (A strided operand's Tensor spans its rows: rounding the columns between is a no-op on bf16 values.)
void Bf16CpuBackend::grouped_matmul_forward(Tensor out, Tensor inp, Tensor weight, const PlanView& plan, int IC, int OC,
                                            float alpha, bool accumulate, int ld_in, int ld_out) {
  CpuBackend::grouped_matmul_forward(out, inp, weight, plan, IC, OC, alpha, accumulate, ld_in, ld_out);
  finish(out);
}
void Bf16CpuBackend::grouped_matmul_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor weight,
                                             const PlanView& plan, int IC, int OC, float alpha, bool accumulate,
                                             int ld_in, int ld_out) {
  CpuBackend::grouped_matmul_backward(dinp, dweight, dout, inp, weight, plan, IC, OC, alpha, accumulate, ld_in, ld_out);
  finish(dinp);
}
void Bf16CpuBackend::swiglu_forward(Tensor act, Tensor h13, long M, int I) {
  CpuBackend::swiglu_forward(act, h13, M, I);
  finish(act);
}
void Bf16CpuBackend::swiglu_backward(Tensor dh13, Tensor dact, Tensor h13, long M, int I) {
  CpuBackend::swiglu_backward(dh13, dact, h13, M, I);
  finish(dh13);
}

void Bf16CpuBackend::head_backward(Tensor dln, Tensor dhead, Tensor logits, Tensor lse, Tensor targets, Tensor lnf,
                                   Tensor head, long N, int C, int64_t Vr, int64_t V0, float scale, bool whole) {
  logits_to_gradient(logits, lse, targets, N, Vr, V0, scale, whole);
  float* l = logits.f32();
  round_all(l, (size_t)N * Vr);  // the logit gradient is a bf16 GEMM operand
  ops::matmul_backward(dln.f32(), dhead.f32(), l, lnf.f32(), head.f32(), (int)N, C, (int)Vr);
}

}  // namespace moetron
