// CudaBackend: the Backend interface (backend/backend.h) on one NVIDIA GPU -- bf16 storage of the
// act store (GEMM operands and outputs, the GEMM weights' copy), fp32 everywhere else, fp32
// accumulation; the kernels of cuda/ops.h on one stream.  Attention saves its log-sum-exp
// (flash-attention style, T x T never stored).  Host code only: it compiles in every build, and
// without CUDA (or without a usable GPU) the constructor fails with cuda_unavailable_reason().
// It is also the MemorySpace through which a host transport stages device buffers
// (dist/staged_comm.h).
#pragma once

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "cuda/attention_cudnn.h"
#include "cuda/ops.h"
#include "cuda/runtime.h"
#include "dist/staged_comm.h"

namespace moetron::gpu {

// "" when the CUDA kernels can run a model of this head dimension and expert count (0: dense),
// else the limit it exceeds (head_dim even and <= 128; at most 256 experts).
std::string cuda_model_limits(int head_dim, int experts);

class CudaBackend final : public Backend, public dist::MemorySpace {
 public:
  CudaBackend();
  ~CudaBackend() override;
  Context& context() { return *ctx_; }

  // Which attention kernel runs: automatic -- cuDNN's fused SDPA (cuda/attention_cudnn.h) where its
  // graph expresses the problem, else the native kernel (cuda/attention.cu) -- or native only.
  // MOETRON_ATTENTION=native|auto in the environment sets it at construction.  Each distinct choice
  // is logged once to stderr with its reason.
  enum class AttentionImpl { automatic, native };
  void set_attention_impl(AttentionImpl i) { attention_impl_ = i; }
  // The kernel of the last attention call: "cudnn", "native" ("none" before any).
  const char* last_attention() const { return last_attention_; }

  const char* name() const override { return "cuda"; }
  bool host_memory() const override { return false; }
  Store act_store() const override { return Store::bf16; }
  uint8_t element_bytes(Store s) const override { return s == Store::u8 ? 1 : s == Store::bf16 ? 2 : 4; }
  dist::MemorySpace* memory_space() override { return this; }
  void check_model(int head_dim, int experts) const override;
  void* device_stream() override { return stream_handle(*ctx_); }
  void to_host(void* host, const void* device, size_t bytes) override;
  void to_device(void* device, const void* host, size_t bytes) override;

  std::unique_ptr<Allocation> allocate(size_t bytes, const std::string& what) override;
  void upload(Tensor dst, const void* host) override;
  void download(void* host, Tensor src) override;
  void copy(Tensor dst, Tensor src) override;
  void fill_zero(Tensor t) override;
  void convert(Tensor dst, Tensor src) override;
  void add(Tensor y, Tensor x) override;
  void synchronize(const char* what) override;

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

 private:
  // Device scratch that grows to the largest request (freeing synchronises the device).
  class Scratch {
   public:
    void* get(CudaBackend& be, size_t bytes, const char* what);

   private:
    std::unique_ptr<Allocation> alloc_;
  };
  MoePlanDevice device_plan(const PlanView& pv) const;
  // Logs once which path the expert GEMMs take (cuda/grouped_gemm.h).
  void note_expert_gemms();
  bool expert_gemms_logged_ = false;
  // True when the fused cuDNN path runs this attention problem (its shape in *s); logs the choice.
  bool use_cudnn(const AttnMask& mask, int B, int T, int NH, int NKV, int HD, CudnnSdpaShape* s);
  std::unique_ptr<Context> ctx_;
  Scratch attn_, ffn_, stats_, ce_, norm_;
  std::unique_ptr<CudnnAttention> cudnn_;  // made at the first attention call
  AttentionImpl attention_impl_ = AttentionImpl::automatic;
  const char* last_attention_ = "none";
  std::set<std::string> attention_logged_;
};

}  // namespace moetron::gpu
