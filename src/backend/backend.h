// The backend interface (DESIGN §3, §5): the one model (src/model/model.cpp) is written once over
// it; a backend owns memory and supplies the kernels.
//
//   CpuBackend      (backend/cpu.h)      fp32, OpenMP, OpenBLAS: the reference every other backend
//                                        is compared with, and what CPU training runs.
//   Bf16CpuBackend  (backend/cpu_bf16.h) the CPU ops with every tensor the CUDA backend stores in
//                                        bf16 rounded to bf16: the naive bf16 implementation of the
//                                        FlashAttention tolerance rule, on every machine.
//   CudaBackend     (cuda/backend.h)     bf16 storage, fp32 accumulation, on one NVIDIA GPU.
//
// Tensors.  A Tensor is a view of backend memory (host memory for the CPU backends, device memory
// for CUDA) with a STORE, the precision the model asks for:
//   f32   the residual stream, norm statistics, router tensors, logits, losses, every gradient of a
//         parameter, and the fp32 master weights;
//   act   (what act_store() names) activations that feed GEMMs and the GEMM weights: f32 on the
//         CPU backend, bf16 on CUDA -- and on Bf16CpuBackend bf16 VALUES kept in fp32 memory
//         (elem_bytes 4), so its CPU kernels read them as floats;
//   i32 / u8  indices and masks.
// An op writes each output in its tensor's store (a bf16 output is rounded to nearest even, in the
// kernel on CUDA, after the op on Bf16CpuBackend) and computes in fp32.
//
// Op conventions (DESIGN §5): outputs first, then saved activations, then inputs, then weights,
// then dimensions.  Parameter gradients accumulate (+=); activation gradients assign (=) unless the
// op takes `accumulate`.  Dimension letters as in src/ops: N rows (tokens), C hidden, V vocabulary
// (Vr local rows of it, from V0), I FFN width, E experts, K experts per token, M = N*K routed rows,
// B batch, T sequence, NH / NKV heads, HD head dim.  Every op is in stream order with the others
// of its backend; host-visible results (a returned loss, router statistics) synchronise.
#pragma once

#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backend/weights.h"
#include "core/error.h"
#include "ops/moe_dispatch.h"
#include "ops/copy_block.h"
#include "ops/rope.h"
#include "ops/router.h"

namespace moetron {

namespace dist {
class Comm;
class MemorySpace;
}  // namespace dist

enum class Store : uint8_t { f32, bf16, i32, u8, stored };
const char* store_name(Store s);

struct Tensor {
  void* data = nullptr;
  size_t numel = 0;
  Store store = Store::f32;
  uint8_t elem_bytes = 4;  // physical bytes per element in the backend's memory
  // Store::stored (a weight used where it lies, inference on a CPU: backend/weights.h): `data` is
  // the WeightSource and the view covers its elements [offset, offset + numel); elem_bytes is 0.
  size_t offset = 0;

  bool empty() const { return data == nullptr; }
  size_t nbytes() const { return numel * elem_bytes; }
  // Elements [begin, begin + n) of this tensor.
  Tensor part(size_t begin, size_t n) const {
    MOETRON_ASSERT(begin + n <= numel);
    if (store == Store::stored) return Tensor{data, n, store, 0, offset + begin};
    return Tensor{static_cast<char*>(data) + begin * elem_bytes, n, store, elem_bytes};
  }
  // Store::stored: the source of the values.
  const WeightSource& source() const {
    MOETRON_ASSERT(store == Store::stored);
    return *static_cast<const WeightSource*>(data);
  }
  // Typed access for backends whose memory the host (or a kernel) reads with these types: floats
  // are fp32 in memory (store f32, or bf16 values kept in fp32 by a CPU backend).
  float* f32() const {
    MOETRON_ASSERT(elem_bytes == 4 && (store == Store::f32 || store == Store::bf16));
    return static_cast<float*>(data);
  }
  // The data as a float pointer in the backend's memory (f32 store), for passing to a Comm or a
  // kernel -- host code must not dereference it on a device backend.
  float* f32_device() const {
    MOETRON_ASSERT(store == Store::f32);
    return static_cast<float*>(data);
  }
  int32_t* i32() const {
    MOETRON_ASSERT(store == Store::i32);
    return static_cast<int32_t*>(data);
  }
  uint8_t* u8() const {
    MOETRON_ASSERT(store == Store::u8);
    return static_cast<uint8_t*>(data);
  }
};

// One allocation of backend memory, zero-filled; freed with the object.
class Allocation {
 public:
  virtual ~Allocation() = default;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 protected:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// What attention sees besides q, k, v (visibility as ops/attention.h).
struct AttnMask {
  Tensor attention_mask;  // i32 [B,T] or empty
  Tensor segment_ids;     // i32 [B,T] or empty
  int sliding_window = 0;
};

// A MoE dispatch plan (ops::MoePlan, built on the host for every backend: routing decisions, the
// capacity limit and expert-parallel counts are host code written once) with its index arrays in
// backend memory.  plan->overflow marks a last expert that is never computed (capacity drops).
struct PlanView {
  const ops::MoePlan* plan = nullptr;
  Tensor row_token;  // i32 [M]
  Tensor row_of;     // i32 [N*K]
};

class Backend {
 public:
  virtual ~Backend() = default;
  Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  // "cpu", "cpu-bf16", "cuda".
  virtual const char* name() const = 0;
  // True when host code may read and write the tensors directly (the CPU backends).
  virtual bool host_memory() const = 0;
  // The store of GEMM operands (activations and the GEMM weights' copy).
  virtual Store act_store() const = 0;
  // Physical bytes per element of a store.
  virtual uint8_t element_bytes(Store s) const = 0;
  // For collectives on this backend's memory over a host transport (dist/staged_comm.h); null for
  // backends whose memory the host reads.
  virtual dist::MemorySpace* memory_space() { return nullptr; }
  // The device stream the ops run in (a cudaStream_t), for device transports to enqueue on; null
  // for host backends.
  virtual void* device_stream() { return nullptr; }

  // Error (naming the limit) when the backend's kernels cannot run a model of this head dimension
  // and expert count (0: dense).
  virtual void check_model(int head_dim, int experts) const {
    (void)head_dim;
    (void)experts;
  }

  Tensor view(void* data, Store s, size_t n) const { return Tensor{data, n, s, element_bytes(s)}; }

  // ---- memory ----------------------------------------------------------------------------------
  virtual std::unique_ptr<Allocation> allocate(size_t bytes, const std::string& what) = 0;
  virtual void upload(Tensor dst, const void* host) = 0;    // dst.nbytes() from host memory
  virtual void download(void* host, Tensor src) = 0;        // src.nbytes() to host memory
  virtual void copy(Tensor dst, Tensor src) = 0;            // same store and size
  virtual void fill_zero(Tensor t) = 0;
  // dst = src between float stores (same numel): rounding to bf16 (nearest even) or widening.
  virtual void convert(Tensor dst, Tensor src) = 0;
  // y[n] += x[n] (f32).
  virtual void add(Tensor y, Tensor x) = 0;
  // Waits for queued work (device backends); errors surface here, named by `what`.
  virtual void synchronize(const char* what) { (void)what; }

  // ---- embedding (rows [V0, V0 + Vr) of the vocabulary; `whole`: this table holds every row) ----
  // out[N,C] (f32) = wte[tokens[n] - V0], zeros for tokens outside the rows (whole: every token is
  // in range, checked by the model).
  virtual void embedding_forward(Tensor out, Tensor tokens, Tensor wte, long N, int C, int64_t V0, int64_t Vr,
                                 bool whole) = 0;
  // dwte[Vr,C] += scatter of dout[N,C] (f32).
  virtual void embedding_backward(Tensor dwte, Tensor dout, Tensor tokens, long N, int C, int64_t V0, int64_t Vr,
                                  bool whole) = 0;

  // ---- RMSNorm -----------------------------------------------------------------------------------
  // out[N,C] (any float store) = weight * inp * rstd; rstd[N] saved (skipped when empty).
  virtual void rmsnorm_forward(Tensor out, Tensor rstd, Tensor inp, Tensor weight, long N, int C, float eps) = 0;
  // dinp[N,C] (f32; = or += when accumulate), dweight[C] += (f32; skipped when empty: a frozen
  // weight).  dout, inp f32.
  virtual void rmsnorm_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor weight, Tensor rstd,
                                long N, int C, bool accumulate) = 0;

  // The norm over rows split across ranks (ops/rmsnorm.h: row_dot, rmsnorm_*_stats); all f32.
  // out[N] (=) = sum_c a b (w when not empty).
  virtual void row_dot(Tensor out, Tensor a, Tensor b, Tensor w, long N, int C) = 0;
  // out[N,C] (any float store), rstd[N] from the row sums of squares ss[N] of all `width` features.
  virtual void rmsnorm_forward_stats(Tensor out, Tensor rstd, Tensor inp, Tensor weight, Tensor ss, long N, int C,
                                     int width, float ss_scale, float eps) = 0;
  // dinp[N,C] (assign), dweight[C] (+=; skipped when empty) from the all-rank dot[N] = sum w dy x.
  virtual void rmsnorm_backward_stats(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor weight, Tensor rstd,
                                      Tensor dot, long N, int C, int width, float dot_scale) = 0;

  // ---- matmul, HF nn.Linear convention (weight [OC,IC]) ---------------------------------------
  // out[N,OC] (= or += when accumulate) inp[N,IC] @ weight^T.  inp and weight in the same store.
  virtual void matmul_forward(Tensor out, Tensor inp, Tensor weight, int N, int IC, int OC, bool accumulate) = 0;
  // dinp[N,IC] (= or += when accumulate) dout @ weight (skipped when empty);
  // dweight[OC,IC] += dout^T @ inp (f32; skipped when empty).  dout, inp, weight in one store.
  virtual void matmul_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor weight, int N, int IC,
                               int OC, bool accumulate) = 0;

  // Several products reading the same input (q, k and v): out_t[N,OC_t] (= or += when accumulate)
  // inp[N,IC] @ weight_t^T, in the order given -- one call, which a backend may run in one parallel
  // region.  The default calls matmul_forward for each.
  struct MatmulTask {
    Tensor out, weight;
    int OC = 0;
    bool accumulate = false;
  };
  // out[N,OC] (assign) = inp[N,IC] @ weight^T with every row computed as it would be alone, whatever
  // the pass (latent attention re-expands its cached positions each pass, and a position's keys must
  // not depend on how many rows the pass has).  The default: matmul_forward (row-independent already).
  virtual void matmul_forward_rowwise(Tensor out, Tensor inp, Tensor weight, int N, int IC, int OC) {
    matmul_forward(out, inp, weight, N, IC, OC, false);
  }
  virtual void matmul_forward_group(std::span<const MatmulTask> tasks, Tensor inp, int N, int IC) {
    for (const MatmulTask& t : tasks) matmul_forward(t.out, inp, t.weight, N, IC, t.OC, t.accumulate);
  }

  // ---- RoPE (in place; which dims, the pair layout, YaRN: ops/rope.h RopeSpec) -------------------
  virtual void rope_forward(Tensor x, Tensor pos, long N, int H, int HD, const ops::RopeSpec& spec) = 0;
  virtual void rope_backward(Tensor dx, Tensor pos, long N, int H, int HD, const ops::RopeSpec& spec) = 0;

  // ---- attention (causal GQA; q[B,T,NH,HD], k/v[B,T,NKV,HD], packed) ----------------------------
  // What the forward saves for its own backward is the backend's (probabilities on the CPU, the
  // log-sum-exp on CUDA): attention_saved_numel f32 elements.
  virtual size_t attention_saved_numel(int B, int T, int NH) const = 0;
  virtual void attention_forward(Tensor out, Tensor saved, Tensor q, Tensor k, Tensor v, const AttnMask& mask, int B,
                                 int T, int NH, int NKV, int HD) = 0;
  // dq/dk/dv (assign).
  virtual void attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor out, Tensor saved, Tensor q,
                                  Tensor k, Tensor v, const AttnMask& mask, int B, int T, int NH, int NKV,
                                  int HD) = 0;

  // ---- inference passes (Model::infer) ---------------------------------------------------------------
  // A pass over `rows` rows: decode when every row must get what it gets alone (one token, or rows
  // of several sequences), else one sequence's prompt rows, which a backend may compute together
  // (GEMMs whose rounding depends on the rows).  Backends whose results do not depend on it ignore it.
  virtual void begin_inference_pass(bool decode, long rows) {
    (void)decode;
    (void)rows;
  }
  virtual void end_inference_pass() {}

  // ---- attention over a KV cache (inference; ops/attention_kv.h) -----------------------------------
  // One sequence's rows of a pass: rows [row0, row0 + rows) are its positions pos0 .. pos0+rows-1;
  // k / v: its cache's tensors of the layer ([capacity, NKV*HD], act store), whose first pos0 + rows
  // rows hold its keys and values (the rows' own included).
  struct KvSeq {
    int row0 = 0, rows = 0, pos0 = 0;
    Tensor k, v;
  };
  // out[N,NH*HD] (act store, assign) for the query rows q[N,NH*HD] (act store) of the sequences, each
  // over its own cache; causal, with the sliding window (0: none).
  virtual void attention_kv_forward(Tensor out, Tensor q, std::span<const KvSeq> seqs, int sliding_window, int NH,
                                    int NKV, int HD) = 0;

  // ---- strided block copy (ops/copy_block.h: latent attention's head slices) ----------------------
  // dst (=, or += with accumulate) alpha * src over the geometry; either tensor f32 or the act store.
  virtual void copy_block(Tensor dst, Tensor src, const ops::BlockCopy& g, float alpha, bool accumulate) = 0;

  // ---- biases (ops/bias.h) and the sigmoid gate (ops/sigmoid.h) ------------------------------------
  // x[N,E] += bias[E] (f32): projection biases, and a test aid that skews routing.
  virtual void add_bias_rows(Tensor x, Tensor bias, long N, int E) = 0;
  // dbias[C] += column sums of dout[N,C] (f32).
  virtual void bias_backward(Tensor dbias, Tensor dout, long N, int C) = 0;
  // s[n] = sigmoid(x[n]); dx[n] = ds[n] s[n] (1 - s[n]) (f32, assign).
  virtual void sigmoid_forward(Tensor s, Tensor x, long n) = 0;
  virtual void sigmoid_backward(Tensor dx, Tensor ds, Tensor s, long n) = 0;
  // OLMoE clip_qkv (ops/clamp.h): x (any float store) clamped to [-c, c] in place, mask u8[n] = 1 where
  // kept; dx (any float store) zeroed in place where mask is 0.
  virtual void clamp_forward(Tensor x, Tensor mask, float c, long n) = 0;
  virtual void clamp_backward(Tensor dx, Tensor mask, long n) = 0;

  // ---- router (ops/router.h) --------------------------------------------------------------------
  // spec (ops/router.h): softmax (renormalised top-K weights, or the probs: norm_topk_prob false) or
  // DeepSeek's sigmoid; bias: the sigmoid rule's selection bias [E] f32 (empty: none).
  virtual void router_forward(Tensor probs, Tensor topk_idx, Tensor topk_w, Tensor logits, Tensor bias, long N, int E,
                              int K, const ops::RouterSpec& spec) = 0;
  // Host statistics of one layer over its real tokens (token_mask u8 [N] or empty); synchronises.
  virtual void router_layer_stats(ops::RouterLayerStats& st, Tensor logits, Tensor probs, Tensor topk_idx,
                                  Tensor token_mask, long N, int E, int K) = 0;
  // dlogits[N,E] (assign); dprobs_per_expert: HOST [E] (or null).
  virtual void router_backward(Tensor dlogits, Tensor dtopk_w, const double* dprobs_per_expert, Tensor token_mask,
                               Tensor probs, Tensor topk_idx, Tensor topk_w, long N, int E, int K,
                               const ops::RouterSpec& spec) = 0;
  // dlogits += scale * d z / d logits; real_tokens: tokens with token_mask != 0 (N without a mask).
  virtual void router_z_loss_backward(Tensor dlogits, Tensor logits, Tensor probs, Tensor token_mask, long N, int E,
                                      float scale, long real_tokens) = 0;
  // The sequence-wise balance loss (ops/router.h): st's per-row statistics (host; synchronises), and
  // dlogits += scale * its gradient from row_grad [B,E] f32 in backend memory.
  virtual void router_row_stats(ops::RouterLayerStats& st, Tensor probs, Tensor topk_idx, Tensor token_mask, long N,
                                int E, int K, int row_len, bool sigmoid) = 0;
  virtual void router_sequence_backward(Tensor dlogits, Tensor row_grad, Tensor token_mask, Tensor probs, long N, int E,
                                        int row_len, bool sigmoid, float scale) = 0;

  // ---- MoE dispatch (ops/moe_dispatch.h) --------------------------------------------------------
  // The plan's index arrays in this backend's memory (copied into row_token / row_of, or -- host
  // backends -- views of the plan's own arrays, which must outlive the view).
  virtual PlanView upload_plan(const ops::MoePlan& plan, Tensor row_token, Tensor row_of) = 0;
  // xperm[M,C] = x[row_token[m]]
  virtual void moe_permute_forward(Tensor xperm, Tensor x, const PlanView& plan, int C) = 0;
  // dx[N,C] (f32, assign) = sum_k dxperm[row_of[n,k]]
  virtual void moe_permute_backward(Tensor dx, Tensor dxperm, const PlanView& plan, int C) = 0;
  // out[N,C] (f32, assign) = sum_k w[n,k] * yperm[row_of[n,k]]
  virtual void moe_combine_forward(Tensor out, Tensor yperm, Tensor w, const PlanView& plan, int C) = 0;
  // dyperm[M,C] = w * dout[token];  dw[N,K] (f32) = <dout[n], yperm[row_of[n,k]]>
  virtual void moe_combine_backward(Tensor dyperm, Tensor dw, Tensor dout, Tensor yperm, Tensor w,
                                    const PlanView& plan, int C) = 0;
  // Per expert over its rows: h13 = xperm @ w13[e]^T, act = swiglu(h13), y = act @ w2[e]^T (y in
  // any float store; h13 and act are saved).  The overflow expert is not computed.
  virtual void moe_experts_forward(Tensor y, Tensor h13, Tensor act, Tensor xperm, Tensor w13, Tensor w2,
                                   const PlanView& plan, int C, int I) = 0;
  // True when moe_experts_forward also takes empty h13 / act (nothing kept for a backward: the backend
  // holds the hidden activations in scratch of its own), as an inference pass asks.
  virtual bool experts_without_saved() const { return false; }
  // dxperm[M,C] (any float store, assign); dw13[E,2I,C], dw2[E,C,I] (f32, accumulate).  dy in the
  // act store.
  virtual void moe_experts_backward(Tensor dxperm, Tensor dw13, Tensor dw2, Tensor dy, Tensor h13, Tensor act,
                                    Tensor xperm, Tensor w13, Tensor w2, const PlanView& plan, int C, int I) = 0;
  // The expert FFN in pieces (ops/grouped_matmul.h, ops/swiglu.h), for what the fused op cannot
  // carry (LoRA on experts, a frozen base):  out[M,OC] (act store, or f32; = or += when accumulate)
  // = alpha * inp[M,IC] @ weight[e]^T per expert e over its rows (weight[E,OC,IC], act store; the
  // overflow expert's rows untouched).  A dense projection is the one-expert identity plan.
  // ld_in / ld_out: row strides of inp (dinp) and out (dout) -- 0: IC / OC -- so a column block of a
  // wider matrix is an operand (its Tensor starts at the block's first element).
  virtual void grouped_matmul_forward(Tensor out, Tensor inp, Tensor weight, const PlanView& plan, int IC, int OC,
                                      float alpha, bool accumulate, int ld_in = 0, int ld_out = 0) = 0;
  // dinp[M,IC] (act store or f32; = or += when accumulate; skipped when empty) = alpha * dout @ weight[e];
  // dweight[E,OC,IC] (f32, +=; skipped when empty) += alpha * dout^T @ inp.  dout, inp, weight in the
  // act store.
  virtual void grouped_matmul_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor weight,
                                       const PlanView& plan, int IC, int OC, float alpha, bool accumulate,
                                       int ld_in = 0, int ld_out = 0) = 0;
  // act[M,I] = silu(h13[:, :I]) * h13[:, I:]; dh13[M,2I] (assign) from dact.  All in the act store.
  virtual void swiglu_forward(Tensor act, Tensor h13, long M, int I) = 0;
  virtual void swiglu_backward(Tensor dh13, Tensor dact, Tensor h13, long M, int I) = 0;
  // out[m,:] = in[index[m],:] for m < rows (the expert-parallel exchange's reorderings).
  virtual void gather_rows(Tensor out, Tensor in, Tensor index, long rows, int C) = 0;

  // ---- cross-entropy over vocabulary columns [V0, V0 + Vr) ------------------------------------
  // lse[N] saved; returns scale * sum over rows with a target of -log p[target] (fp64, host: it
  // synchronises).  tp: the group holding the other columns (null: this rank has them all).
  virtual double cross_entropy_forward(Tensor lse, Tensor logits, Tensor targets, long N, int64_t Vr, int64_t V0,
                                       float scale, dist::Comm* tp) = 0;
  // The head's backward from the loss: logits[N,Vr] (f32) are overwritten by their gradient
  // scale * (softmax - onehot) (kept in whatever form the backend's GEMM reads), then
  // dln[N,C] (f32, assign) = dlogits @ head and dhead[Vr,C] += dlogits^T @ lnf (skipped when empty).
  // whole: these are every column (one process or no tensor parallelism).
  virtual void head_backward(Tensor dln, Tensor dhead, Tensor logits, Tensor lse, Tensor targets, Tensor lnf,
                             Tensor head, long N, int C, int64_t Vr, int64_t V0, float scale, bool whole) = 0;

  // ---- initialisation ----------------------------------------------------------------------------
  // p[i] = std * normal_at(seed, key, i) (core/rng.h, fp64), or `fill` everywhere when std == 0.
  virtual void init_normal(Tensor p, uint64_t seed, uint64_t key, double std, float fill) = 0;

  // ---- optimizer (optim/adamw.h semantics) ------------------------------------------------------
  // AdamW on n elements of param/m/v with gradient grad * grad_scale; step is 1-based.
  virtual void adamw_update(Tensor param, Tensor m, Tensor v, Tensor grad, float grad_scale, double lr, double beta1,
                            double beta2, double eps, double weight_decay, long step) = 0;
  // sum of values[i]^2 over the sorted, disjoint flat ranges `counted` of an array of `total`
  // elements, summed per fixed 16384-element chunk of the flat index and the chunks in order
  // (deterministic; on the CPU backend bitwise global_grad_norm's square for one process, on
  // CUDA each chunk's segments by a fixed block tree); synchronises.
  virtual double sum_squares(Tensor values, const std::vector<std::pair<size_t, size_t>>& counted) = 0;
};

// Lays out tensors in one allocation in two passes over the same sequence of take() calls: the
// first (no base) measures, the second hands out views.  Pieces are 256-byte aligned.
class TensorCarver {
 public:
  TensorCarver(const Backend& be, void* base) : be_(be), base_(static_cast<char*>(base)) {}
  Tensor take(Store s, size_t n) {
    Tensor t{base_ ? base_ + used_ : nullptr, n, s, be_.element_bytes(s)};
    used_ += (t.nbytes() + 255) / 256 * 256;
    return t;
  }
  size_t used() const { return used_; }

 private:
  const Backend& be_;
  char* base_;
  size_t used_ = 0;
};

// A buffer of backend memory that grows to the largest size asked for (its contents are not kept
// when it grows).
class GrowableBuffer {
 public:
  Tensor get(Backend& be, Store s, size_t n, const char* what) {
    const size_t bytes = std::max<size_t>(n * be.element_bytes(s), 1);
    if (!alloc_ || alloc_->bytes() < bytes) {
      alloc_.reset();
      alloc_ = be.allocate(bytes, what);
    }
    return be.view(alloc_->data(), s, n);
  }
  size_t bytes() const { return alloc_ ? alloc_->bytes() : 0; }

 private:
  std::unique_ptr<Allocation> alloc_;
};

// The default backend of this process for host-side tools (CPU, fp32).
std::unique_ptr<Backend> make_cpu_backend();

}  // namespace moetron
