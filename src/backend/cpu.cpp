// CpuBackend: each op forwards to its src/ops (or src/dist/tp_ops) implementation, so the model
// computes exactly what those ops compute, in the same order.
#include "backend/cpu.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "core/dtype.h"
#include "core/rng.h"
#include "dist/tp_ops.h"
#include "ops/attention.h"
#include "ops/attention_kv.h"
#include "ops/bias.h"
#include "ops/clamp.h"
#include "ops/cross_entropy.h"
#include "ops/embedding.h"
#include "ops/grouped_matmul.h"
#include "ops/matmul.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/sigmoid.h"
#include "ops/swiglu.h"
#include "optim/adamw.h"

namespace moetron {

const char* store_name(Store s) {
  switch (s) {
    case Store::f32:
      return "f32";
    case Store::bf16:
      return "bf16";
    case Store::i32:
      return "i32";
    case Store::u8:
      return "u8";
    case Store::stored:
      return "stored";
  }
  return "?";
}

namespace {

class HostAllocation final : public Allocation {
 public:
  HostAllocation(size_t bytes, const std::string& what) {
    const size_t n = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
    data_ = std::aligned_alloc(64, n);
    if (data_ == nullptr) fail("[cpu] cannot allocate {} bytes for {}", n, what);
    std::memset(data_, 0, n);
    bytes_ = bytes;
  }
  ~HostAllocation() override { std::free(data_); }
};

const uint8_t* mask_or_null(Tensor t) { return t.empty() ? nullptr : t.u8(); }
const int32_t* i32_or_null(Tensor t) { return t.empty() ? nullptr : t.i32(); }

constexpr long kParallelMin = 1 << 15;  // elements below which a copy or sum stays on one thread

// y[n] += x[n]
void add_inplace(float* y, const float* x, long n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (long i = 0; i < n; i++) y[i] += x[i];
}

}  // namespace

ops::AttentionMask CpuBackend::host_mask(const AttnMask& m) {
  ops::AttentionMask a;
  a.attention_mask = i32_or_null(m.attention_mask);
  a.segment_ids = i32_or_null(m.segment_ids);
  a.sliding_window = m.sliding_window;
  return a;
}

void CpuBackend::logits_to_gradient(Tensor logits, Tensor lse, Tensor targets, long N, int64_t Vr, int64_t V0,
                                    float scale, bool whole) {
  float* l = logits.f32();
  if (whole)
    ops::cross_entropy_backward(l, l, lse.f32(), targets.i32(), N, (int)Vr, scale);
  else
    dist::cross_entropy_backward_vocab_parallel(l, l, lse.f32(), targets.i32(), N, Vr, V0, scale);
}

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

std::unique_ptr<Allocation> CpuBackend::allocate(size_t bytes, const std::string& what) {
  return std::make_unique<HostAllocation>(bytes, what);
}

void CpuBackend::upload(Tensor dst, const void* host) {
  if (dst.nbytes()) std::memcpy(dst.data, host, dst.nbytes());
}
void CpuBackend::download(void* host, Tensor src) {
  if (src.nbytes()) std::memcpy(host, src.data, src.nbytes());
}
void CpuBackend::copy(Tensor dst, Tensor src) {
  MOETRON_ASSERT(dst.nbytes() == src.nbytes());
  if (dst.data != src.data && dst.nbytes()) std::memcpy(dst.data, src.data, dst.nbytes());
}
void CpuBackend::fill_zero(Tensor t) {
  if (t.nbytes()) std::memset(t.data, 0, t.nbytes());
}
void CpuBackend::convert(Tensor dst, Tensor src) {
  MOETRON_ASSERT(dst.numel == src.numel);
  float* d = dst.f32();
  const float* s = src.f32();
  const long n = (long)dst.numel;
  if (dst.store == Store::bf16 && src.store != Store::bf16) {
#pragma omp parallel for schedule(static)
    for (long i = 0; i < n; i++) d[i] = bf16_to_f32(f32_to_bf16(s[i]));
  } else if (d != s) {
    std::memcpy(d, s, sizeof(float) * n);
  }
}
void CpuBackend::add(Tensor y, Tensor x) {
  MOETRON_ASSERT(y.numel == x.numel);
  add_inplace(y.f32(), x.f32(), (long)y.numel);
}

void CpuBackend::embedding_forward(Tensor out, Tensor tokens, Tensor wte, long N, int C, int64_t V0, int64_t Vr,
                                   bool whole) {
  if (whole)
    ops::embedding_forward(out.f32(), tokens.i32(), wte.f32(), N, C, (int)Vr);
  else
    dist::embedding_forward_vocab_parallel(out.f32(), tokens.i32(), wte.f32(), N, C, V0, Vr);
}

void CpuBackend::embedding_backward(Tensor dwte, Tensor dout, Tensor tokens, long N, int C, int64_t V0, int64_t Vr,
                                    bool whole) {
  if (whole)
    ops::embedding_backward(dwte.f32(), dout.f32(), tokens.i32(), N, C, (int)Vr);
  else
    dist::embedding_backward_vocab_parallel(dwte.f32(), dout.f32(), tokens.i32(), N, C, V0, Vr);
}

void CpuBackend::rmsnorm_forward(Tensor out, Tensor rstd, Tensor inp, Tensor weight, long N, int C, float eps) {
  float* r = rstd.empty() ? scratch(tmp_, N) : rstd.f32();
  ops::rmsnorm_forward(out.f32(), r, inp.f32(), weight.f32(), N, C, eps);
}

void CpuBackend::row_dot(Tensor out, Tensor a, Tensor b, Tensor w, long N, int C) {
  ops::row_dot(out.f32(), a.f32(), b.f32(), w.empty() ? nullptr : w.f32(), N, C);
}
void CpuBackend::rmsnorm_forward_stats(Tensor out, Tensor rstd, Tensor inp, Tensor weight, Tensor ss, long N, int C,
                                       int width, float ss_scale, float eps) {
  ops::rmsnorm_forward_stats(out.f32(), rstd.f32(), inp.f32(), weight.f32(), ss.f32(), N, C, width, ss_scale, eps);
}
void CpuBackend::rmsnorm_backward_stats(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor weight,
                                        Tensor rstd, Tensor dot, long N, int C, int width, float dot_scale) {
  ops::rmsnorm_backward_stats(dinp.f32(), dweight.f32(), dout.f32(), inp.f32(), weight.f32(), rstd.f32(), dot.f32(), N,
                              C, width, dot_scale);
}
void CpuBackend::rmsnorm_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor weight, Tensor rstd,
                                  long N, int C, bool accumulate) {
  if (!accumulate) {
    ops::rmsnorm_backward(dinp.f32(), dweight.f32(), dout.f32(), inp.f32(), weight.f32(), rstd.f32(), N, C);
    return;
  }
  float* t = scratch(tmp_, (size_t)N * C);
  ops::rmsnorm_backward(t, dweight.f32(), dout.f32(), inp.f32(), weight.f32(), rstd.f32(), N, C);
  add_inplace(dinp.f32(), t, N * C);
}

void CpuBackend::matmul_forward(Tensor out, Tensor inp, Tensor weight, int N, int IC, int OC, bool accumulate) {
  if (accumulate)
    ops::matmul_forward_accumulate(out.f32(), inp.f32(), weight.f32(), N, IC, OC);
  else
    ops::matmul_forward(out.f32(), inp.f32(), weight.f32(), N, IC, OC);
}

void CpuBackend::matmul_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor weight, int N, int IC,
                                 int OC, bool accumulate) {
  float* dw = dweight.empty() ? nullptr : dweight.f32();
  if (!accumulate || dinp.empty()) {
    ops::matmul_backward(dinp.empty() ? nullptr : dinp.f32(), dw, dout.f32(), inp.f32(), weight.f32(), N, IC, OC);
    return;
  }
  float* t = scratch(tmp_, (size_t)N * IC);
  ops::matmul_backward(t, dw, dout.f32(), inp.f32(), weight.f32(), N, IC, OC);
  add_inplace(dinp.f32(), t, (long)N * IC);
}

void CpuBackend::rope_forward(Tensor x, Tensor pos, long N, int H, int HD, const ops::RopeSpec& spec) {
  ops::rope_forward(x.f32(), x.f32(), pos.i32(), N, H, HD, spec);
}
void CpuBackend::rope_backward(Tensor dx, Tensor pos, long N, int H, int HD, const ops::RopeSpec& spec) {
  ops::rope_backward(dx.f32(), dx.f32(), pos.i32(), N, H, HD, spec);
}

size_t CpuBackend::attention_saved_numel(int B, int T, int NH) const { return (size_t)B * NH * T * T; }

void CpuBackend::attention_forward(Tensor out, Tensor saved, Tensor q, Tensor k, Tensor v, const AttnMask& mask, int B,
                                   int T, int NH, int NKV, int HD) {
  ops::attention_forward(out.f32(), saved.f32(), q.f32(), k.f32(), v.f32(), host_mask(mask), B, T, NH, NKV, HD);
}

void CpuBackend::attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor out, Tensor saved, Tensor q,
                                    Tensor k, Tensor v, const AttnMask& mask, int B, int T, int NH, int NKV, int HD) {
  (void)out;
  (void)mask;  // the saved probabilities are 0 wherever the mask hides a key
  ops::attention_backward(dq.f32(), dk.f32(), dv.f32(), dout.f32(), saved.f32(), q.f32(), k.f32(), v.f32(), B, T, NH,
                          NKV, HD);
}

void CpuBackend::attention_kv_forward(Tensor out, Tensor q, std::span<const KvSeq> seqs, int sliding_window, int NH,
                                      int NKV, int HD) {
  const size_t Q = (size_t)NH * HD;
  for (const KvSeq& s : seqs)
    ops::attention_kv_forward(out.f32() + s.row0 * Q, q.f32() + s.row0 * Q, s.k.f32(), s.v.f32(), s.rows, s.pos0,
                              sliding_window, NH, NKV, HD);
}

void CpuBackend::copy_block(Tensor dst, Tensor src, const ops::BlockCopy& g, float alpha, bool accumulate) {
  ops::check_block_copy("copy_block", g, (long)dst.numel, (long)src.numel);
  ops::copy_block(dst.f32(), src.f32(), g, alpha, accumulate);
}

void CpuBackend::add_bias_rows(Tensor x, Tensor bias, long N, int E) {
  float* p = x.f32();
  const float* b = bias.f32();
#pragma omp parallel for schedule(static) if (N * E >= (1 << 15))
  for (long n = 0; n < N; n++)
    for (int e = 0; e < E; e++) p[n * E + e] += b[e];
}
void CpuBackend::bias_backward(Tensor dbias, Tensor dout, long N, int C) {
  ops::bias_backward(dbias.f32(), dout.f32(), N, C);
}
void CpuBackend::sigmoid_forward(Tensor s, Tensor x, long n) { ops::sigmoid_forward(s.f32(), x.f32(), n); }
void CpuBackend::clamp_forward(Tensor x, Tensor mask, float c, long n) {
  // A bf16-valued tensor (Bf16CpuBackend's act store) is clamped to the bf16 value of c.
  ops::clamp_forward(x.f32(), mask.u8(), x.store == Store::bf16 ? bf16_to_f32(f32_to_bf16(c)) : c, n);
}
void CpuBackend::clamp_backward(Tensor dx, Tensor mask, long n) { ops::clamp_backward(dx.f32(), mask.u8(), n); }
void CpuBackend::sigmoid_backward(Tensor dx, Tensor ds, Tensor s, long n) {
  ops::sigmoid_backward(dx.f32(), ds.f32(), s.f32(), n);
}

void CpuBackend::router_forward(Tensor probs, Tensor topk_idx, Tensor topk_w, Tensor logits, Tensor bias, long N, int E,
                                int K, const ops::RouterSpec& spec) {
  ops::router_forward(probs.f32(), topk_idx.i32(), topk_w.f32(), logits.f32(), bias.empty() ? nullptr : bias.f32(), N,
                      E, K, spec);
}

void CpuBackend::router_layer_stats(ops::RouterLayerStats& st, Tensor logits, Tensor probs, Tensor topk_idx,
                                    Tensor token_mask, long N, int E, int K) {
  ops::router_layer_stats(st, logits.f32(), probs.f32(), topk_idx.i32(), mask_or_null(token_mask), N, E, K);
}

void CpuBackend::router_backward(Tensor dlogits, Tensor dtopk_w, const double* dprobs_per_expert, Tensor token_mask,
                                 Tensor probs, Tensor topk_idx, Tensor topk_w, long N, int E, int K,
                                 const ops::RouterSpec& spec) {
  ops::router_backward(dlogits.f32(), dtopk_w.f32(), dprobs_per_expert, mask_or_null(token_mask), probs.f32(),
                       topk_idx.i32(), topk_w.f32(), N, E, K, spec);
}

void CpuBackend::router_row_stats(ops::RouterLayerStats& st, Tensor probs, Tensor topk_idx, Tensor token_mask, long N,
                                  int E, int K, int row_len, bool sigmoid) {
  ops::router_row_stats(st, probs.f32(), topk_idx.i32(), mask_or_null(token_mask), N, E, K, row_len, sigmoid);
}

void CpuBackend::router_sequence_backward(Tensor dlogits, Tensor row_grad, Tensor token_mask, Tensor probs, long N,
                                          int E, int row_len, bool sigmoid, float scale) {
  ops::router_sequence_backward(dlogits.f32(), row_grad.f32(), mask_or_null(token_mask), probs.f32(), N, E, row_len,
                                sigmoid, scale);
}

void CpuBackend::router_z_loss_backward(Tensor dlogits, Tensor logits, Tensor probs, Tensor token_mask, long N, int E,
                                        float scale, long real_tokens) {
  (void)real_tokens;  // counted from the mask by the op
  ops::router_z_loss_backward(dlogits.f32(), logits.f32(), probs.f32(), mask_or_null(token_mask), N, E, scale);
}

PlanView CpuBackend::upload_plan(const ops::MoePlan& plan, Tensor row_token, Tensor row_of) {
  (void)row_token;
  (void)row_of;
  PlanView v;
  v.plan = &plan;
  v.row_token = view(const_cast<int32_t*>(plan.row_token.data()), Store::i32, plan.row_token.size());
  v.row_of = view(const_cast<int32_t*>(plan.row_of.data()), Store::i32, plan.row_of.size());
  return v;
}

void CpuBackend::moe_permute_forward(Tensor xperm, Tensor x, const PlanView& plan, int C) {
  ops::moe_permute_forward(xperm.f32(), x.f32(), *plan.plan, C);
}
void CpuBackend::moe_permute_backward(Tensor dx, Tensor dxperm, const PlanView& plan, int C) {
  ops::moe_permute_backward(dx.f32(), dxperm.f32(), *plan.plan, C);
}
void CpuBackend::moe_combine_forward(Tensor out, Tensor yperm, Tensor w, const PlanView& plan, int C) {
  ops::moe_combine_forward(out.f32(), yperm.f32(), w.f32(), *plan.plan, C);
}
void CpuBackend::moe_combine_backward(Tensor dyperm, Tensor dw, Tensor dout, Tensor yperm, Tensor w,
                                      const PlanView& plan, int C) {
  ops::moe_combine_backward(dyperm.f32(), dw.f32(), dout.f32(), yperm.f32(), w.f32(), *plan.plan, C);
}
void CpuBackend::moe_experts_forward(Tensor y, Tensor h13, Tensor act, Tensor xperm, Tensor w13, Tensor w2,
                                     const PlanView& plan, int C, int I) {
  ops::moe_experts_forward(y.f32(), h13.f32(), act.f32(), xperm.f32(), w13.f32(), w2.f32(), *plan.plan, C, I);
}
void CpuBackend::moe_experts_backward(Tensor dxperm, Tensor dw13, Tensor dw2, Tensor dy, Tensor h13, Tensor act,
                                      Tensor xperm, Tensor w13, Tensor w2, const PlanView& plan, int C, int I) {
  const size_t M = (size_t)plan.plan->N * plan.plan->K;
  float* s = scratch(ffn_scratch_, 3 * M * I);
  ops::moe_experts_backward(dxperm.f32(), dw13.f32(), dw2.f32(), s, dy.f32(), h13.f32(), act.f32(), xperm.f32(),
                            w13.f32(), w2.f32(), *plan.plan, C, I);
}

void CpuBackend::gather_rows(Tensor out, Tensor in, Tensor index, long rows, int C) {
  float* o = out.f32();
  const float* x = in.f32();
  const int32_t* idx = index.i32();
#pragma omp parallel for schedule(static) if (rows * C >= kParallelMin)
  for (long m = 0; m < rows; m++) std::memcpy(o + m * C, x + (size_t)idx[m] * C, sizeof(float) * C);
}

void CpuBackend::grouped_matmul_forward(Tensor out, Tensor inp, Tensor weight, const PlanView& plan, int IC, int OC,
                                        float alpha, bool accumulate, int ld_in, int ld_out) {
  ops::grouped_matmul_forward(out.f32(), inp.f32(), weight.f32(), *plan.plan, IC, OC, alpha, accumulate, ld_in, ld_out);
}
void CpuBackend::grouped_matmul_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor weight,
                                         const PlanView& plan, int IC, int OC, float alpha, bool accumulate, int ld_in,
                                         int ld_out) {
  ops::grouped_matmul_backward(dinp.f32(), dweight.f32(), dout.f32(), inp.f32(), weight.f32(), *plan.plan, IC, OC, alpha,
                               accumulate, ld_in, ld_out);
}
void CpuBackend::swiglu_forward(Tensor act, Tensor h13, long M, int I) { ops::swiglu_forward(act.f32(), h13.f32(), M, I); }
void CpuBackend::swiglu_backward(Tensor dh13, Tensor dact, Tensor h13, long M, int I) {
  ops::swiglu_backward(dh13.f32(), dact.f32(), h13.f32(), M, I);
}

double CpuBackend::cross_entropy_forward(Tensor lse, Tensor logits, Tensor targets, long N, int64_t Vr, int64_t V0,
                                         float scale, dist::Comm* tp) {
  if (tp == nullptr) return ops::cross_entropy_forward(lse.f32(), logits.f32(), targets.i32(), N, (int)Vr, scale);
  return dist::cross_entropy_forward_vocab_parallel(lse.f32(), logits.f32(), targets.i32(), N, Vr, V0, scale, *tp);
}

void CpuBackend::head_backward(Tensor dln, Tensor dhead, Tensor logits, Tensor lse, Tensor targets, Tensor lnf,
                               Tensor head, long N, int C, int64_t Vr, int64_t V0, float scale, bool whole) {
  logits_to_gradient(logits, lse, targets, N, Vr, V0, scale, whole);
  ops::matmul_backward(dln.f32(), dhead.f32(), logits.f32(), lnf.f32(), head.f32(), (int)N, C, (int)Vr);
}

void CpuBackend::init_normal(Tensor p, uint64_t seed, uint64_t key, double std, float fill) {
  float* x = p.f32();
  const size_t n = p.numel;
  if (std == 0.0) {
    std::fill(x, x + n, fill);
    return;
  }
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; i++) x[i] = (float)(std * normal_at(seed, key, i));
}

void CpuBackend::adamw_update(Tensor param, Tensor m, Tensor v, Tensor grad, float grad_scale, double lr, double beta1,
                              double beta2, double eps, double weight_decay, long step) {
  MOETRON_ASSERT(m.numel == param.numel && v.numel == param.numel && grad.numel == param.numel);
  moetron::adamw_update(param.f32(), m.f32(), v.f32(), grad.f32(), param.numel, grad_scale, lr, beta1, beta2, eps,
                        weight_decay, step);
}

double CpuBackend::sum_squares(Tensor values, const std::vector<std::pair<size_t, size_t>>& counted) {
  using Range = std::pair<size_t, size_t>;
  constexpr size_t chunk = 1 << 14;
  const float* x = values.f32();
  const size_t n = values.numel;
  const size_t nchunks = (n + chunk - 1) / chunk;
  std::vector<double> partial(nchunks, 0.0);
  const std::vector<Range>& iv = counted;
#pragma omp parallel for schedule(static)
  for (size_t c = 0; c < nchunks; c++) {
    const size_t c0 = c * chunk, c1 = std::min(n, c0 + chunk);
    // First interval that ends after c0.
    size_t k = std::upper_bound(iv.begin(), iv.end(), c0, [](size_t a, const Range& r) { return a < r.second; }) -
               iv.begin();
    double s = 0.0;
    for (; k < iv.size() && iv[k].first < c1; k++) {
      const size_t lo = std::max(c0, iv[k].first), hi = std::min(c1, iv[k].second);
      for (size_t i = lo; i < hi; i++) s += (double)x[i] * x[i];
    }
    partial[c] = s;
  }
  double total = 0.0;
  for (double s : partial) total += s;
  return total;
}

}  // namespace moetron
