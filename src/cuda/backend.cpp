// CudaBackend; see backend.h.  Each op checks the stores it was given and calls its kernel.
#include "cuda/backend.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "core/error.h"
#include "cuda/grouped_gemm.h"
#include "dist/comm.h"

namespace moetron::gpu {

namespace {

class DeviceAllocation final : public Allocation {
 public:
  // One cudaMalloc of the 256-byte rounded size (DeviceArena hands out rounded pieces), zeroed.
  DeviceAllocation(Context& ctx, size_t bytes, const std::string& what)
      : arena_(DeviceArena::rounded(std::max<size_t>(bytes, 1)), what) {
    data_ = arena_.take(std::max<size_t>(bytes, 1));
    bytes_ = bytes;
    fill_zero(ctx, data_, arena_.capacity());
  }

 private:
  DeviceArena arena_;
};

DType dtype_of(const Tensor& t, const char* op) {
  if (t.store == Store::bf16) return DType::BF16;
  if (t.store == Store::f32) return DType::F32;
  fail("[cuda {}] expected a float tensor, got store {}", op, store_name(t.store));
}

void expect(const Tensor& t, Store s, const char* op, const char* what) {
  if (t.store != s) fail("[cuda {}] {} must be {}, got {}", op, what, store_name(s), store_name(t.store));
}

Bf16* b16(const Tensor& t) { return static_cast<Bf16*>(t.data); }
float* f32p(const Tensor& t) { return static_cast<float*>(t.data); }
int32_t* i32p(const Tensor& t) { return t.empty() ? nullptr : static_cast<int32_t*>(t.data); }
uint8_t* u8p(const Tensor& t) { return t.empty() ? nullptr : static_cast<uint8_t*>(t.data); }

AttentionMask device_mask(const AttnMask& m) {
  AttentionMask a;
  a.attention_mask = i32p(m.attention_mask);
  a.segment_ids = i32p(m.segment_ids);
  a.sliding_window = m.sliding_window;
  return a;
}

}  // namespace

std::string cuda_model_limits(int head_dim, int experts) {
  if (head_dim > 128 || head_dim % 2 != 0)
    return fmt::format("the CUDA attention supports even head dims up to 128, the model has head_dim {}", head_dim);
  if (experts > 512) return fmt::format("the CUDA router supports at most 512 experts, the model has {}", experts);
  return "";
}

void CudaBackend::check_model(int head_dim, int experts) const {
  const std::string why = cuda_model_limits(head_dim, experts);
  if (!why.empty()) fail("[cuda backend] {}", why);
}

void* CudaBackend::Scratch::get(CudaBackend& be, size_t bytes, const char* what) {
  if (!alloc_ || alloc_->bytes() < bytes) {
    alloc_.reset();
    alloc_ = be.allocate(bytes, what);
  }
  return alloc_->data();
}

CudaBackend::CudaBackend() {
  const std::string why = cuda_unavailable_reason();
  if (!why.empty()) fail("[cuda backend] {}", why);
  if (const char* a = std::getenv("MOETRON_ATTENTION"); a != nullptr && *a != '\0') {
    const std::string v = a;
    if (v == "native")
      attention_impl_ = AttentionImpl::native;
    else if (v != "auto")
      fail("[cuda backend] MOETRON_ATTENTION={}: expected auto or native", v);
  }
  ctx_ = std::make_unique<Context>();
}

bool CudaBackend::use_cudnn(const AttnMask& mask, int B, int T, int NH, int NKV, int HD, CudnnSdpaShape* s) {
  std::string why;
  if (attention_impl_ == AttentionImpl::native) {
    why = "native chosen (MOETRON_ATTENTION=native)";
  } else {
    if (!cudnn_) cudnn_ = std::make_unique<CudnnAttention>(stream_handle(*ctx_));
    *s = CudnnSdpaShape{B, T, NH, NKV, HD, mask.sliding_window};
    why = cudnn_->why_not(*s, !mask.attention_mask.empty() || !mask.segment_ids.empty());
  }
  const std::string choice =
      why.empty() ? "attention: cuDNN fused SDPA (" + cudnn_->version() + ")" : "attention: native kernel (" + why + ")";
  if (attention_logged_.insert(choice).second) std::fprintf(stderr, "moetron: %s\n", choice.c_str());
  last_attention_ = why.empty() ? "cudnn" : "native";
  return why.empty();
}

CudaBackend::~CudaBackend() {
  if (ctx_) ctx_->try_synchronize();
}

void CudaBackend::to_host(void* host, const void* device, size_t bytes) { copy_to_host(*ctx_, host, device, bytes); }
void CudaBackend::to_device(void* device, const void* host, size_t bytes) {
  copy_to_device(*ctx_, device, host, bytes);
}

std::unique_ptr<Allocation> CudaBackend::allocate(size_t bytes, const std::string& what) {
  return std::make_unique<DeviceAllocation>(*ctx_, bytes, what);
}
void CudaBackend::upload(Tensor dst, const void* host) { copy_to_device(*ctx_, dst.data, host, dst.nbytes()); }
void CudaBackend::download(void* host, Tensor src) { copy_to_host(*ctx_, host, src.data, src.nbytes()); }
void CudaBackend::copy(Tensor dst, Tensor src) {
  MOETRON_ASSERT(dst.nbytes() == src.nbytes());
  if (dst.data != src.data) copy_device(*ctx_, dst.data, src.data, dst.nbytes());
}
void CudaBackend::fill_zero(Tensor t) { gpu::fill_zero(*ctx_, t.data, t.nbytes()); }
void CudaBackend::convert(Tensor dst, Tensor src) {
  MOETRON_ASSERT(dst.numel == src.numel);
  if (dst.store == src.store) return copy(dst, src);
  if (dst.store == Store::bf16 && src.store == Store::f32) return convert_to_bf16(*ctx_, b16(dst), f32p(src), dst.numel);
  if (dst.store == Store::f32 && src.store == Store::bf16) return convert_to_f32(*ctx_, f32p(dst), b16(src), dst.numel);
  fail("[cuda convert] from {} to {}", store_name(src.store), store_name(dst.store));
}
void CudaBackend::add(Tensor y, Tensor x) {
  expect(y, Store::f32, "add", "y");
  expect(x, Store::f32, "add", "x");
  MOETRON_ASSERT(y.numel == x.numel);
  add_f32(*ctx_, f32p(y), f32p(x), y.numel);
}
void CudaBackend::synchronize(const char* what) { ctx_->synchronize(what); }

void CudaBackend::embedding_forward(Tensor out, Tensor tokens, Tensor wte, long N, int C, int64_t V0, int64_t Vr,
                                    bool whole) {
  (void)whole;  // the whole table is rows [0, V)
  gpu::embedding_forward(*ctx_, f32p(out), i32p(tokens), f32p(wte), N, C, V0, Vr);
}
void CudaBackend::embedding_backward(Tensor dwte, Tensor dout, Tensor tokens, long N, int C, int64_t V0, int64_t Vr,
                                     bool whole) {
  (void)whole;
  gpu::embedding_backward(*ctx_, f32p(dwte), f32p(dout), i32p(tokens), N, C, V0, Vr);
}

void CudaBackend::rmsnorm_forward(Tensor out, Tensor rstd, Tensor inp, Tensor weight, long N, int C, float eps) {
  gpu::rmsnorm_forward(*ctx_, out.data, dtype_of(out, "rmsnorm_forward"), rstd.empty() ? nullptr : f32p(rstd),
                       f32p(inp), f32p(weight), N, C, eps);
}
void CudaBackend::row_dot(Tensor out, Tensor a, Tensor b, Tensor w, long N, int C) {
  gpu::row_dot(*ctx_, f32p(out), f32p(a), f32p(b), w.empty() ? nullptr : f32p(w), N, C);
}
void CudaBackend::rmsnorm_forward_stats(Tensor out, Tensor rstd, Tensor inp, Tensor weight, Tensor ss, long N, int C,
                                        int width, float ss_scale, float eps) {
  gpu::rmsnorm_forward_stats(*ctx_, out.data, dtype_of(out, "rmsnorm_forward_stats"), f32p(rstd), f32p(inp),
                             f32p(weight), f32p(ss), N, C, width, ss_scale, eps);
}
void CudaBackend::rmsnorm_backward_stats(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor weight,
                                         Tensor rstd, Tensor dot, long N, int C, int width, float dot_scale) {
  gpu::rmsnorm_backward_stats(*ctx_, f32p(dinp), dweight.empty() ? nullptr : f32p(dweight), f32p(dout), f32p(inp), f32p(weight), f32p(rstd),
                              f32p(dot), N, C, width, dot_scale);
}
void CudaBackend::rmsnorm_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor weight, Tensor rstd,
                                   long N, int C, bool accumulate) {
  gpu::rmsnorm_backward(*ctx_, f32p(dinp), dweight.empty() ? nullptr : f32p(dweight), f32p(dout), f32p(inp),
                        f32p(weight), f32p(rstd), N, C, accumulate);
}

void CudaBackend::matmul_forward(Tensor out, Tensor inp, Tensor weight, int N, int IC, int OC, bool accumulate) {
  const DType ab = dtype_of(inp, "matmul_forward");
  if (dtype_of(weight, "matmul_forward") != ab) fail("[cuda matmul_forward] input and weight stores differ");
  gemm(*ctx_, false, true, N, OC, IC, 1.0f, inp.data, IC, weight.data, IC, accumulate ? 1.0f : 0.0f, out.data, OC, ab,
       dtype_of(out, "matmul_forward"));
}
void CudaBackend::matmul_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor weight, int N, int IC,
                                  int OC, bool accumulate) {
  const DType ab = dtype_of(dout, "matmul_backward");
  if (dtype_of(weight, "matmul_backward") != ab || dtype_of(inp, "matmul_backward") != ab)
    fail("[cuda matmul_backward] dout, input and weight stores differ");
  // dinp[N,IC] (=, +=) dout[N,OC] @ weight[OC,IC]
  if (!dinp.empty())
    gemm(*ctx_, false, false, N, IC, OC, 1.0f, dout.data, OC, weight.data, IC, accumulate ? 1.0f : 0.0f, dinp.data,
         IC, ab, dtype_of(dinp, "matmul_backward"));
  // dweight[OC,IC] += dout^T[OC,N] @ inp[N,IC]
  if (!dweight.empty() && N > 0)
    gemm(*ctx_, true, false, OC, IC, N, 1.0f, dout.data, OC, inp.data, IC, 1.0f, dweight.data, IC, ab, DType::F32);
}

void CudaBackend::rope_forward(Tensor x, Tensor pos, long N, int H, int HD, const ops::RopeSpec& spec) {
  expect(x, Store::bf16, "rope_forward", "x");
  gpu::rope_forward(*ctx_, b16(x), b16(x), 0, i32p(pos), N, H, HD, spec);
}
void CudaBackend::rope_backward(Tensor dx, Tensor pos, long N, int H, int HD, const ops::RopeSpec& spec) {
  expect(dx, Store::bf16, "rope_backward", "dx");
  gpu::rope_backward(*ctx_, b16(dx), b16(dx), 0, i32p(pos), N, H, HD, spec);
}

size_t CudaBackend::attention_saved_numel(int B, int T, int NH) const { return (size_t)B * NH * T; }

void CudaBackend::attention_forward(Tensor out, Tensor saved, Tensor q, Tensor k, Tensor v, const AttnMask& mask,
                                    int B, int T, int NH, int NKV, int HD) {
  CudnnSdpaShape s;
  if (use_cudnn(mask, B, T, NH, NKV, HD, &s)) {
    for (const Tensor* t : {&out, &q, &k, &v}) expect(*t, Store::bf16, "attention_forward", "q, k, v and out");
    expect(saved, Store::f32, "attention_forward", "saved");
    return cudnn_->forward(s, out.data, f32p(saved), q.data, k.data, v.data);
  }
  gpu::attention_forward(*ctx_, b16(out), f32p(saved), b16(q), b16(k), b16(v), device_mask(mask), B, T, NH, NKV, HD, 0,
                         0);
}
void CudaBackend::attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor out, Tensor saved, Tensor q,
                                     Tensor k, Tensor v, const AttnMask& mask, int B, int T, int NH, int NKV,
                                     int HD) {
  CudnnSdpaShape s;
  if (use_cudnn(mask, B, T, NH, NKV, HD, &s)) {
    for (const Tensor* t : {&dq, &dk, &dv, &dout, &out, &q, &k, &v})
      expect(*t, Store::bf16, "attention_backward", "its bf16 operands");
    return cudnn_->backward(s, dq.data, dk.data, dv.data, dout.data, out.data, f32p(saved), q.data, k.data, v.data);
  }
  float* scratch = static_cast<float*>(
      attn_.get(*this, sizeof(float) * attention_backward_scratch_floats(B, T, NH, HD), "attention scratch"));
  gpu::attention_backward(*ctx_, b16(dq), b16(dk), b16(dv), scratch, b16(dout), b16(out), f32p(saved), b16(q), b16(k),
                          b16(v), device_mask(mask), B, T, NH, NKV, HD, 0, 0);
}

void CudaBackend::attention_kv_forward(Tensor out, Tensor q, std::span<const KvSeq> seqs, int sliding_window, int NH,
                                       int NKV, int HD) {
  expect(out, Store::bf16, "attention_kv_forward", "out");
  const size_t Q = (size_t)NH * HD;
  for (const KvSeq& s : seqs)
    gpu::attention_kv_forward(*ctx_, b16(out) + s.row0 * Q, b16(q) + s.row0 * Q, b16(s.k), b16(s.v), s.rows, s.pos0,
                              sliding_window, NH, NKV, HD);
}

void CudaBackend::copy_block(Tensor dst, Tensor src, const ops::BlockCopy& g, float alpha, bool accumulate) {
  ops::check_block_copy("copy_block", g, (long)dst.numel, (long)src.numel);
  gpu::copy_block(*ctx_, dst.data, dst.store == Store::bf16, src.data, src.store == Store::bf16, g, alpha, accumulate);
}
void CudaBackend::add_bias_rows(Tensor x, Tensor bias, long N, int E) {
  gpu::add_bias_rows(*ctx_, f32p(x), f32p(bias), N, E);
}
void CudaBackend::bias_backward(Tensor dbias, Tensor dout, long N, int C) {
  gpu::bias_backward(*ctx_, f32p(dbias), f32p(dout), N, C);
}
void CudaBackend::sigmoid_forward(Tensor s, Tensor x, long n) { gpu::sigmoid_forward(*ctx_, f32p(s), f32p(x), n); }
void CudaBackend::clamp_forward(Tensor x, Tensor mask, float c, long n) {
  gpu::clamp_forward(*ctx_, x.data, dtype_of(x, "clamp_forward"), u8p(mask), c, n);
}
void CudaBackend::clamp_backward(Tensor dx, Tensor mask, long n) {
  gpu::clamp_backward(*ctx_, dx.data, dtype_of(dx, "clamp_backward"), u8p(mask), n);
}
void CudaBackend::sigmoid_backward(Tensor dx, Tensor ds, Tensor s, long n) {
  gpu::sigmoid_backward(*ctx_, f32p(dx), f32p(ds), f32p(s), n);
}
void CudaBackend::router_forward(Tensor probs, Tensor topk_idx, Tensor topk_w, Tensor logits, Tensor bias, long N, int E,
                                 int K, const ops::RouterSpec& spec) {
  gpu::router_forward(*ctx_, f32p(probs), i32p(topk_idx), f32p(topk_w), f32p(logits), f32p(bias), N, E, K, spec);
}
void CudaBackend::router_layer_stats(ops::RouterLayerStats& st, Tensor logits, Tensor probs, Tensor topk_idx,
                                     Tensor token_mask, long N, int E, int K) {
  double* d = static_cast<double*>(stats_.get(*this, sizeof(double) * (2 * E + 2), "router statistics"));
  gpu::router_layer_stats(*ctx_, d, f32p(logits), f32p(probs), i32p(topk_idx), u8p(token_mask), N, E, K);
  std::vector<double> h(2 * E + 2);
  copy_to_host(*ctx_, h.data(), d, sizeof(double) * h.size());
  st.assigned.assign(h.begin(), h.begin() + E);
  st.prob_sum.assign(h.begin() + E, h.begin() + 2 * E);
  st.tokens = h[2 * E];
  st.z_sum = h[2 * E + 1];
}
void CudaBackend::router_backward(Tensor dlogits, Tensor dtopk_w, const double* dprobs_per_expert, Tensor token_mask,
                                  Tensor probs, Tensor topk_idx, Tensor topk_w, long N, int E, int K,
                                  const ops::RouterSpec& spec) {
  gpu::router_backward(*ctx_, f32p(dlogits), f32p(dtopk_w), dprobs_per_expert, u8p(token_mask), f32p(probs),
                       i32p(topk_idx), f32p(topk_w), N, E, K, spec);
}
void CudaBackend::router_z_loss_backward(Tensor dlogits, Tensor logits, Tensor probs, Tensor token_mask, long N, int E,
                                         float scale, long real_tokens) {
  gpu::router_z_loss_backward(*ctx_, f32p(dlogits), f32p(logits), f32p(probs), u8p(token_mask), N, E, scale,
                              real_tokens);
}

void CudaBackend::router_row_stats(ops::RouterLayerStats& st, Tensor probs, Tensor topk_idx, Tensor token_mask, long N,
                                   int E, int K, int row_len, bool sigmoid) {
  // Host sums in token order (as the CPU's) over copies: a [N,E] transfer per layer when the loss is on.
  std::vector<float> p(probs.numel);
  std::vector<int32_t> idx(topk_idx.numel);
  std::vector<uint8_t> mask(token_mask.numel);
  download(p.data(), probs);
  download(idx.data(), topk_idx);
  if (!token_mask.empty()) download(mask.data(), token_mask);
  ops::router_row_stats(st, p.data(), idx.data(), token_mask.empty() ? nullptr : mask.data(), N, E, K, row_len,
                        sigmoid);
}
void CudaBackend::router_sequence_backward(Tensor dlogits, Tensor row_grad, Tensor token_mask, Tensor probs, long N,
                                           int E, int row_len, bool sigmoid, float scale) {
  gpu::router_sequence_backward(*ctx_, f32p(dlogits), f32p(row_grad), u8p(token_mask), f32p(probs), N, E, row_len,
                                sigmoid, scale);
}

PlanView CudaBackend::upload_plan(const ops::MoePlan& plan, Tensor row_token, Tensor row_of) {
  MOETRON_ASSERT(row_token.numel >= plan.row_token.size() && row_of.numel >= plan.row_of.size());
  PlanView v;
  v.plan = &plan;
  v.row_token = row_token.part(0, plan.row_token.size());
  v.row_of = row_of.part(0, plan.row_of.size());
  upload(v.row_token, plan.row_token.data());
  upload(v.row_of, plan.row_of.data());
  return v;
}

MoePlanDevice CudaBackend::device_plan(const PlanView& pv) const {
  MoePlanDevice d;
  d.N = pv.plan->N;
  d.E = pv.plan->E;
  d.K = pv.plan->K;
  d.overflow = pv.plan->overflow;
  d.expert_offsets = pv.plan->expert_offsets;
  d.row_token = i32p(pv.row_token);
  d.row_of = i32p(pv.row_of);
  return d;
}

void CudaBackend::moe_permute_forward(Tensor xperm, Tensor x, const PlanView& plan, int C) {
  gpu::moe_permute_forward(*ctx_, b16(xperm), b16(x), device_plan(plan), C);
}
void CudaBackend::moe_permute_backward(Tensor dx, Tensor dxperm, const PlanView& plan, int C) {
  gpu::moe_permute_backward(*ctx_, f32p(dx), b16(dxperm), device_plan(plan), C, false);
}
void CudaBackend::moe_combine_forward(Tensor out, Tensor yperm, Tensor w, const PlanView& plan, int C) {
  gpu::moe_combine_forward(*ctx_, f32p(out), b16(yperm), f32p(w), device_plan(plan), C);
}
void CudaBackend::moe_combine_backward(Tensor dyperm, Tensor dw, Tensor dout, Tensor yperm, Tensor w,
                                       const PlanView& plan, int C) {
  gpu::moe_combine_backward(*ctx_, b16(dyperm), f32p(dw), f32p(dout), b16(yperm), f32p(w), device_plan(plan), C);
}
void CudaBackend::note_expert_gemms() {
  if (expert_gemms_logged_) return;
  expert_gemms_logged_ = true;
  const std::string why = grouped_gemm_unavailable();
  std::fprintf(stderr, "moetron: expert GEMMs: %s\n",
               why.empty() ? "CUTLASS grouped GEMM (sm_90a; per-expert cuBLASLt where a shape is not 16-byte aligned)"
                           : ("per-expert cuBLASLt (" + why + ")").c_str());
}

void CudaBackend::moe_experts_forward(Tensor y, Tensor h13, Tensor act, Tensor xperm, Tensor w13, Tensor w2,
                                      const PlanView& plan, int C, int I) {
  note_expert_gemms();
  gpu::moe_experts_forward(*ctx_, y.data, dtype_of(y, "moe_experts_forward"), b16(h13), b16(act), b16(xperm), b16(w13),
                           b16(w2), device_plan(plan), C, I);
}
void CudaBackend::moe_experts_backward(Tensor dxperm, Tensor dw13, Tensor dw2, Tensor dy, Tensor h13, Tensor act,
                                       Tensor xperm, Tensor w13, Tensor w2, const PlanView& plan, int C, int I) {
  const size_t M = (size_t)plan.plan->N * plan.plan->K;
  Bf16* scratch = static_cast<Bf16*>(ffn_.get(*this, sizeof(Bf16) * std::max<size_t>(3 * M * I, 1), "expert scratch"));
  gpu::moe_experts_backward(*ctx_, dxperm.data, dtype_of(dxperm, "moe_experts_backward"), f32p(dw13), f32p(dw2),
                            scratch, b16(dy), b16(h13), b16(act), b16(xperm), b16(w13), b16(w2), device_plan(plan), C,
                            I);
}
// Operands in the act store (bf16), or all f32 (the router's adapters).
void CudaBackend::grouped_matmul_forward(Tensor out, Tensor inp, Tensor weight, const PlanView& plan, int IC, int OC,
                                         float alpha, bool accumulate, int ld_in, int ld_out) {
  note_expert_gemms();
  const DType ab = dtype_of(inp, "grouped_matmul_forward");
  if (dtype_of(weight, "grouped_matmul_forward") != ab) fail("[cuda grouped_matmul_forward] input and weight stores differ");
  gpu::grouped_matmul_forward(*ctx_, out.data, dtype_of(out, "grouped_matmul_forward"), inp.data, weight.data, ab,
                              plan.plan->expert_offsets, plan.plan->E - plan.plan->overflow, IC, OC, alpha, accumulate,
                              ld_in, ld_out);
}
void CudaBackend::grouped_matmul_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor weight,
                                          const PlanView& plan, int IC, int OC, float alpha, bool accumulate, int ld_in,
                                          int ld_out) {
  const DType ab = dtype_of(dout, "grouped_matmul_backward");
  if (dtype_of(inp, "grouped_matmul_backward") != ab || dtype_of(weight, "grouped_matmul_backward") != ab)
    fail("[cuda grouped_matmul_backward] dout, input and weight stores differ");
  gpu::grouped_matmul_backward(*ctx_, dinp.data, dinp.empty() ? ab : dtype_of(dinp, "grouped_matmul_backward"),
                               dweight.empty() ? nullptr : f32p(dweight), dout.data, inp.data, weight.data, ab,
                               plan.plan->expert_offsets, plan.plan->E - plan.plan->overflow, IC, OC, alpha, accumulate,
                               ld_in, ld_out);
}
void CudaBackend::swiglu_forward(Tensor act, Tensor h13, long M, int I) {
  if (M > 0) gpu::swiglu_forward(*ctx_, b16(act), b16(h13), M, I);
}
void CudaBackend::swiglu_backward(Tensor dh13, Tensor dact, Tensor h13, long M, int I) {
  if (M > 0) gpu::swiglu_backward(*ctx_, b16(dh13), b16(dact), b16(h13), M, I);
}
void CudaBackend::gather_rows(Tensor out, Tensor in, Tensor index, long rows, int C) {
  MOETRON_ASSERT(out.elem_bytes == in.elem_bytes);
  gpu::gather_rows(*ctx_, out.data, in.data, i32p(index), rows, (size_t)C * in.elem_bytes);
}

double CudaBackend::cross_entropy_forward(Tensor lse, Tensor logits, Tensor targets, long N, int64_t Vr, int64_t V0,
                                          float scale, dist::Comm* tp) {
  // Scratch: row_loss [N] f32, row_max [N] f32, sums [2N] f64.
  char* s = static_cast<char*>(ce_.get(*this, 24 * (size_t)std::max<long>(N, 1) + 512, "cross-entropy scratch"));
  float* row_loss = reinterpret_cast<float*>(s);
  if (tp == nullptr)
    return gpu::cross_entropy_forward(*ctx_, f32p(lse), row_loss, f32p(logits), i32p(targets), N, (int)Vr, scale);
  float* row_max = row_loss + N;
  double* sums = reinterpret_cast<double*>(s + ((8 * (size_t)N + 255) / 256) * 256);
  cross_entropy_row_max(*ctx_, row_max, f32p(logits), N, (int)Vr);
  tp->all_reduce(row_max, (size_t)N, dist::CommDType::f32, dist::ReduceOp::max);
  cross_entropy_row_sums(*ctx_, sums, f32p(logits), row_max, i32p(targets), N, (int)Vr, V0);
  tp->all_reduce(sums, 2 * (size_t)N, dist::CommDType::f64, dist::ReduceOp::sum);
  return cross_entropy_finish(*ctx_, f32p(lse), row_loss, row_max, sums, i32p(targets), N, scale);
}

void CudaBackend::head_backward(Tensor dln, Tensor dhead, Tensor logits, Tensor lse, Tensor targets, Tensor lnf,
                                Tensor head, long N, int C, int64_t Vr, int64_t V0, float scale, bool whole) {
  (void)whole;  // V0 = 0 for the whole vocabulary
  expect(lnf, Store::bf16, "head_backward", "lnf");
  expect(head, Store::bf16, "head_backward", "head");
  // dlogits (bf16) is written in place over the fp32 logits: row n's bf16 values occupy the first
  // half of its fp32 row, so the bf16 matrix has row stride 2 Vr.
  Bf16* dlogits = b16(logits);
  const long ld = 2 * Vr;
  cross_entropy_backward(*ctx_, dlogits, ld, f32p(logits), f32p(lse), i32p(targets), N, (int)Vr, V0, scale);
  gemm(*ctx_, false, false, (int)N, C, (int)Vr, 1.0f, dlogits, ld, head.data, C, 0.0f, dln.data, C, DType::BF16,
       DType::F32);
  if (!dhead.empty())  // empty: a frozen head
    gemm(*ctx_, true, false, (int)Vr, C, (int)N, 1.0f, dlogits, ld, lnf.data, C, 1.0f, dhead.data, C, DType::BF16,
         DType::F32);
}

void CudaBackend::init_normal(Tensor p, uint64_t seed, uint64_t key, double std, float fill) {
  gpu::init_normal(*ctx_, f32p(p), p.numel, seed, key, std, fill);
}

void CudaBackend::adamw_update(Tensor param, Tensor m, Tensor v, Tensor grad, float grad_scale, double lr,
                               double beta1, double beta2, double eps, double weight_decay, long step) {
  gpu::adamw_update(*ctx_, f32p(param), nullptr, f32p(m), f32p(v), f32p(grad), param.numel, grad_scale, lr, beta1,
                    beta2, eps, weight_decay, step);
}

double CudaBackend::sum_squares(Tensor values, const std::vector<std::pair<size_t, size_t>>& counted) {
  // Segments: the counted ranges cut at the 16384-element chunks of the flat index (as the CPU
  // backend's chunks), each summed by one block; the chunk sums, then the total, in order.
  constexpr size_t chunk = 1 << 14;
  std::vector<int64_t> seg;  // begin, end pairs
  std::vector<size_t> seg_chunk;
  for (const auto& [b, e] : counted)
    for (size_t lo = b; lo < e;) {
      const size_t hi = std::min(e, (lo / chunk + 1) * chunk);
      seg.push_back((int64_t)lo);
      seg.push_back((int64_t)hi);
      seg_chunk.push_back(lo / chunk);
      lo = hi;
    }
  const size_t n = seg_chunk.size();
  if (n == 0) return 0.0;
  std::vector<int64_t> begins(n), ends(n);
  for (size_t i = 0; i < n; i++) {
    begins[i] = seg[2 * i];
    ends[i] = seg[2 * i + 1];
  }
  char* s = static_cast<char*>(norm_.get(*this, 24 * n + 512, "norm scratch"));
  int64_t* db = reinterpret_cast<int64_t*>(s);
  int64_t* de = db + n;
  double* partial = reinterpret_cast<double*>(de + n);
  copy_to_device(*ctx_, db, begins.data(), 8 * n);
  copy_to_device(*ctx_, de, ends.data(), 8 * n);
  sum_squares_segments(*ctx_, partial, f32p(values), db, de, n);
  std::vector<double> h(n);
  copy_to_host(*ctx_, h.data(), partial, 8 * n);
  double total = 0.0, chunk_sum = 0.0;
  for (size_t i = 0; i < n; i++) {
    chunk_sum += h[i];
    if (i + 1 == n || seg_chunk[i + 1] != seg_chunk[i]) {
      total += chunk_sum;
      chunk_sum = 0.0;
    }
  }
  return total;
}

}  // namespace moetron::gpu
