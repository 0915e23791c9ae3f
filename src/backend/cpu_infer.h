// The CPU backend's inference ops: what Model::infer runs on a CPU over a checkpoint used where it lies
// (infer/model.h InferenceModel, a WeightProvider).  The CPU backend's ops, with
//   - the products over weights in their stored dtype -- bf16, f16, f32 or Q8_0, through a
//     WeightSource (backend/weights.h) -- by the inference kernels (backend/kernels/: gemv.h, gemm.h):
//     decode rows by matrix-vector products (each row bitwise what it gets alone, up to 8 rows per
//     pass over a matrix, every task of a step in one parallel region), a sequence's prompt rows by
//     the prefill GEMM; LoRA factors (plain f32) by the GEMM, whose every value is one fma chain;
//   - the fused experts expert-major (decode: every expert's gate/up rows in one region, down in
//     another; prefill: experts in parallel, largest first, in pieces of kExpertRows rows);
//   - attention over the host KV caches (cpu_infer_attention.cpp);
//   - RoPE from angles computed once per pass; small steps on one thread (ThreadLimit), as a
//     fork/join may cost a scheduler slice on a shared machine;
//   - the decode split tuner (DecodeSplitTuner) for one sequence's decode steps.
// Every result is independent of the thread count.  Activations and the KV caches are host fp32.
#pragma once

#include <vector>

#include "backend/cpu.h"
#include "backend/kernels/gemv.h"
#include "ops/moe_dispatch.h"

namespace moetron {

// Decides, from measured decode steps, whether mid-sized products (kGemvSplitMin up to kGemvParallelMin
// multiply-adds) are split across threads: splitting is faster on idle cores and much slower when
// other processes share them (backend/kernels/gemv.h).  At the start of each period it times 4 steps each way
// (the fastest of each four) and uses the faster way for the rest; the results are the same either
// way.  The first period is kPeriod steps; each trial that keeps the choice doubles the period, up to
// kMaxPeriod, and one that changes it starts again from kPeriod.  The trials of the slower way cost
// their steps' difference: with a period of 64 on idle cores (0.49B bf16, 2-core Xeon VM) 4 steps in
// 64 took ~20 ms instead of ~12, 4% of the decoding time; at 512 it is 0.5%, and a change of load is
// still noticed within 512 steps.
class DecodeSplitTuner {
 public:
  static constexpr int kPeriod = 64, kMaxPeriod = 512, kTrial = 4;
  // Whether the next decode step splits mid-sized products.
  bool split_next() const {
    const long s = step_ - start_;
    return s < kTrial ? false : s < 2 * kTrial ? true : choice_;
  }
  // The time of the step that split_next() described.
  void record(double seconds);
  bool choice() const { return choice_; }
  int period() const { return period_; }  // the current period's length, in steps

 private:
  long step_ = 0, start_ = 0;  // start_: the step the current period began at
  int period_ = kPeriod;
  double serial_ = 0, split_ = 0;
  bool choice_ = false, decided_ = false;
};

class CpuInferenceBackend final : public CpuBackend {
 public:
  // row_attention_max_pairs: a prompt's attention runs per (query row, head) with dot products up to
  // this many (query, key) pairs per head, beyond as two GEMMs per head (-1: the default, 2^18);
  // decode passes always run per row.
  explicit CpuInferenceBackend(long row_attention_max_pairs = -1);

  // Zero-filled host memory; from kMapMin bytes an anonymous mapping, whose pages the kernel zeroes
  // when first touched: a KV cache grown to twice its rows, or an activation arena sized for a long
  // prompt, costs memory only as it is used (aligned_alloc + memset touched every page at once).
  // Below it the heap's: a fresh mapping faults in every 4 KiB page once (~1.5 us each), and a
  // sequence's per-layer caches are made and freed per request -- a small model's 128-token prompt
  // spent 5% of its prefill in those faults, where recycled heap memory costs one memset.
  std::unique_ptr<Allocation> allocate(size_t bytes, const std::string& what) override;
  static constexpr size_t kMapMin = 1 << 20;

  void begin_inference_pass(bool decode, long rows) override;
  void end_inference_pass() override;

  void add(Tensor y, Tensor x) override;
  void embedding_forward(Tensor out, Tensor tokens, Tensor wte, long N, int C, int64_t V0, int64_t Vr,
                         bool whole) override;
  void rmsnorm_forward(Tensor out, Tensor rstd, Tensor inp, Tensor weight, long N, int C, float eps) override;
  void matmul_forward(Tensor out, Tensor inp, Tensor weight, int N, int IC, int OC, bool accumulate) override;
  void matmul_forward_group(std::span<const MatmulTask> tasks, Tensor inp, int N, int IC) override;
  // The decode kernels (each row alone) in every pass.
  void matmul_forward_rowwise(Tensor out, Tensor inp, Tensor weight, int N, int IC, int OC) override;
  void rope_forward(Tensor x, Tensor pos, long N, int H, int HD, const ops::RopeSpec& spec) override;
  void attention_kv_forward(Tensor out, Tensor q, std::span<const KvSeq> seqs, int sliding_window, int NH, int NKV,
                            int HD) override;
  void add_bias_rows(Tensor x, Tensor bias, long N, int E) override;
  void router_forward(Tensor probs, Tensor topk_idx, Tensor topk_w, Tensor logits, Tensor bias, long N, int E, int K,
                      const ops::RouterSpec& spec) override;
  void moe_permute_forward(Tensor xperm, Tensor x, const PlanView& plan, int C) override;
  void moe_combine_forward(Tensor out, Tensor yperm, Tensor w, const PlanView& plan, int C) override;
  void moe_experts_forward(Tensor y, Tensor h13, Tensor act, Tensor xperm, Tensor w13, Tensor w2,
                           const PlanView& plan, int C, int I) override;
  void grouped_matmul_forward(Tensor out, Tensor inp, Tensor weight, const PlanView& plan, int IC, int OC, float alpha,
                              bool accumulate, int ld_in = 0, int ld_out = 0) override;
  bool experts_without_saved() const override { return true; }
  void swiglu_forward(Tensor act, Tensor h13, long M, int I) override;
  void gather_rows(Tensor out, Tensor in, Tensor index, long rows, int C) override;

  // Bytes of weights the matrix-vector products of decode passes have read so far: each matrix once
  // per product -- an expert's only when a row was routed to it -- as stored (bf16 2 bytes a value,
  // Q8_0 with its scales).  bench generate divides it by the steps: the weights one token reads alone
  // against what a batched step reads, the bound on what batching gains where decoding streams them.
  size_t weights_read() const { return weights_read_; }
  const DecodeSplitTuner& tuner() const { return tuner_; }

 private:
  // The contiguous row ranges of weight rows [0, OC) (IC values each) of `w`: fn(ref, row0, rows) per
  // stored piece; a plain f32 tensor is one piece.
  template <class Fn>
  void for_each_piece(const Tensor& w, int OC, int IC, Fn&& fn) const;
  // Tasks y_j (row stride ld_y) (=, or +=) W x_j for the n rows of x (stride ld_x), up to
  // kMaxGemvInputs per task; run_tasks runs (and clears) them, kMaxGemvTasks per parallel region.
  void add_row_tasks(std::vector<kernels::GemvTask>& tasks, float* y, int ld_y, WeightRef W, const float* x, int ld_x,
                     int n, int OC, bool accumulate) const;
  void run_tasks(std::vector<kernels::GemvTask>& tasks, int IC);
  // out[n, OC] (row stride ld_out; =, or +=) x[n, IC] (row stride ld_x) W^T: one row as a gemv with the
  // step's split threshold, more as a prefill product.
  void linear(float* out, int ld_out, const float* x, int ld_x, WeightRef W, int n, int IC, int OC, bool accumulate);
  // Prefill experts (moe_experts_forward outside decode passes).
  // h13 / act null: the hidden activations in this backend's scratch.
  void experts_prefill(float* y, float* h13, float* act, const float* xperm, const Tensor& w13, const Tensor& w2,
                       const ops::MoePlan& p, int C, int I);
  // Attention (cpu_infer_attention.cpp): a prompt's rows of one sequence, and decode rows.
  void attention_prompt(float* out, const float* q, const float* keys, const float* values, int pos0, int n, int window,
                        int NH, int NKV, int HD);
  void attention_decode(float* out, const float* q, std::span<const KvSeq> seqs, int window, int NH, int NKV, int HD);

  long row_pairs_;
  bool in_pass_ = false, decode_ = false, tuning_ = false;
  long gemv_min_ = kernels::kGemvParallelMin;
  DecodeSplitTuner tuner_;
  double pass_start_ = 0;
  size_t weights_read_ = 0;
  std::vector<kernels::GemvTask> tasks_;
  std::vector<float> widen_;  // prefill products' scratch (gemm_nt: x packed, weight rows widened)
  struct ExpertScratch {
    std::vector<float> gemm;      // kernels::matmul's (experts run in parallel: the thread's own)
    std::vector<float> h13, act;  // hidden activations when the caller keeps none
  };
  std::vector<ExpertScratch> expert_widen_;  // one per thread, experts run in parallel
  ExpertScratch expert_serial_;              // experts run one after another, and decode steps
  std::vector<int> expert_order_;
  // RoPE angles of the pass's positions (computed once, used by every layer's q and k).
  const void* rope_pos_ = nullptr;
  long rope_n_ = 0;
  int rope_hd_ = 0;
  ops::RopeSpec rope_spec_{};
  std::vector<float> rope_cs_, rope_sn_;
  // Attention scratch: a prompt's scores and transposed values; decode rows' caches and positions.
  std::vector<float> scores_, values_t_;
  std::vector<const float*> row_keys_, row_values_;
  std::vector<int> row_pos_;
};

}  // namespace moetron
