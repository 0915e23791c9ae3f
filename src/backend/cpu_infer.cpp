// The CPU backend's inference ops; see cpu_infer.h.  Attention over the caches: cpu_infer_attention.cpp.
#include "backend/cpu_infer.h"

#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "backend/cpu_infer_threads.h"
#include "backend/kernels/gemm.h"
#include "backend/kernels/q8.h"
#include "core/error.h"
#include "ops/moe_dispatch.h"
#include "ops/rope.h"
#include "ops/router.h"
#include "ops/swiglu.h"

namespace moetron {

namespace {

// Attention runs per (query row, head) with dot products, all heads in one parallel region, up to this
// many (query, key) pairs per head; beyond, as two GEMMs per head (cpu_infer_attention.cpp).
constexpr long kRowAttentionMaxPairs = 1L << 18;

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

void DecodeSplitTuner::record(double seconds) {
  const long s = step_ - start_;
  if (s < kTrial) serial_ = s == 0 ? seconds : std::min(serial_, seconds);
  else if (s < 2 * kTrial) split_ = s == kTrial ? seconds : std::min(split_, seconds);
  if (s == 2 * kTrial - 1) {
    const bool split = split_ < serial_;
    period_ = decided_ && split == choice_ ? std::min(2 * period_, kMaxPeriod) : kPeriod;
    choice_ = split;
    decided_ = true;
  }
  if (++step_ - start_ == period_) start_ = step_;
}

namespace {

class MappedAllocation final : public Allocation {
 public:
  MappedAllocation(size_t bytes, const std::string& what) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) fail("[cpu] cannot map {} bytes for {}", bytes, what);
    data_ = p;
    bytes_ = bytes;
  }
  ~MappedAllocation() override { munmap(data_, bytes_); }
};

}  // namespace

std::unique_ptr<Allocation> CpuInferenceBackend::allocate(size_t bytes, const std::string& what) {
  if (bytes < kMapMin) return CpuBackend::allocate(bytes, what);
  return std::make_unique<MappedAllocation>(bytes, what);
}

CpuInferenceBackend::CpuInferenceBackend(long row_attention_max_pairs)
    : row_pairs_(row_attention_max_pairs < 0 ? kRowAttentionMaxPairs : row_attention_max_pairs) {}

void CpuInferenceBackend::begin_inference_pass(bool decode, long rows) {
  in_pass_ = true;
  decode_ = decode;
  rope_pos_ = nullptr;
  // One token with more than one thread: the tuner picks the split threshold and times the step.  A
  // prompt's few-row products (its last row's head) split as a decode batch's do (matmul: from
  // kGemvSplitMin): its passes fork for every product anyway (small model, prompt 128, 2 threads,
  // 2-core Zen 4 EPYC VM: the 32000 x 256 head 0.93 -> 0.55 ms).
  const bool threads = omp_get_max_threads() > 1;
  tuning_ = rows == 1 && threads;
  gemv_min_ = tuning_ ? (tuner_.split_next() ? kernels::kGemvSplitMin : kernels::kGemvParallelMin)
                      : (threads ? kernels::kGemvSplitMin : kernels::kGemvParallelMin);
  if (tuning_) pass_start_ = now_seconds();
}

void CpuInferenceBackend::end_inference_pass() {
  if (tuning_) tuner_.record(now_seconds() - pass_start_);
  in_pass_ = tuning_ = false;
  rope_pos_ = nullptr;
}

// The elementwise steps and small ops: their own thresholds keep decode rows on one thread; a prompt's
// steps stay on one thread below kThreadLimitMin (PromptLimit), as the prompt's products do.
void CpuInferenceBackend::add(Tensor y, Tensor x) {
  PromptLimit lim(decode_, (long)y.numel);
  CpuBackend::add(y, x);
}

void CpuInferenceBackend::embedding_forward(Tensor out, Tensor tokens, Tensor wte, long N, int C, int64_t V0,
                                            int64_t Vr, bool whole) {
  if (wte.store != Store::stored) return CpuBackend::embedding_forward(out, tokens, wte, N, C, V0, Vr, whole);
  MOETRON_ASSERT(V0 == 0 && whole);
  wte.source().rows(out.f32(), tokens.i32(), N, C);
}

void CpuInferenceBackend::rmsnorm_forward(Tensor out, Tensor rstd, Tensor inp, Tensor weight, long N, int C,
                                          float eps) {
  PromptLimit lim(decode_, N * C);
  CpuBackend::rmsnorm_forward(out, rstd, inp, weight, N, C, eps);
}

template <class Fn>
void CpuInferenceBackend::for_each_piece(const Tensor& w, int OC, int IC, Fn&& fn) const {
  if (w.store != Store::stored) return fn(WeightRef{w.f32(), DType::F32}, 0, OC);
  const WeightSource& src = w.source();
  for (int r = 0; r < OC;) {
    const size_t at = w.offset + (size_t)r * IC;
    const WeightSource::Piece p = src.piece(at);
    const int rows = (int)std::min<size_t>((size_t)(OC - r), p.count / IC);
    MOETRON_ASSERT(rows > 0);  // pieces hold whole rows
    fn(p.ref, r, rows);
    r += rows;
  }
}

void CpuInferenceBackend::add_row_tasks(std::vector<kernels::GemvTask>& tasks, float* y, int ld_y, WeightRef W,
                                        const float* x, int ld_x, int n, int OC, bool accumulate) const {
  // Up to kMaxGemvInputs rows: one task.  More (a batched prefill): tasks of at most 6, as equal as
  // possible -- the AVX-512 kernels take 6 inputs in one pass and 8 in two of 4, and 6 a pass did
  // 8-9% more multiply-adds a second than 8 (one thread, 1024-wide bf16 rows, in L2 or from memory).
  const int tasks_n = n <= kernels::kMaxGemvInputs ? 1 : (n + 5) / 6;
  for (int k = 0, j = 0; k < tasks_n; k++) {
    const int m = n / tasks_n + (k < n % tasks_n ? 1 : 0);
    kernels::GemvTask t{y + (size_t)j * ld_y, W, x + (size_t)j * ld_x, OC, accumulate};
    j += m;
    t.n = m;
    t.ld_x = ld_x;
    t.ld_y = ld_y;
    tasks.push_back(t);
  }
}

void CpuInferenceBackend::run_tasks(std::vector<kernels::GemvTask>& tasks, int IC) {
  for (const kernels::GemvTask& t : tasks) {
    const size_t values = (size_t)t.OC * IC;
    weights_read_ += t.W.q8() ? values + values / kernels::kQ8Block * sizeof(uint16_t) : values * dtype_size(t.W.dtype);
  }
  for (size_t t = 0; t < tasks.size(); t += kernels::kMaxGemvTasks)
    kernels::gemv_batch(tasks.data() + t, (int)std::min<size_t>(kernels::kMaxGemvTasks, tasks.size() - t), IC,
                        gemv_min_);
  tasks.clear();
}

void CpuInferenceBackend::linear(float* out, int ld_out, const float* x, int ld_x, WeightRef W, int n, int IC, int OC,
                                 bool accumulate) {
  if (n == 1) {
    const kernels::GemvTask t{out, W, x, OC, accumulate};
    kernels::gemv_batch(&t, 1, IC, gemv_min_);
    return;
  }
  ThreadLimit lim((long)n * IC * OC);
  kernels::matmul(out, ld_out, x, ld_x, W, n, IC, OC, accumulate, widen_);
}

void CpuInferenceBackend::matmul_forward(Tensor out, Tensor inp, Tensor weight, int N, int IC, int OC,
                                         bool accumulate) {
  const MatmulTask t{out, weight, OC, accumulate};
  matmul_forward_group(std::span(&t, 1), inp, N, IC);
}

void CpuInferenceBackend::matmul_forward_rowwise(Tensor out, Tensor inp, Tensor weight, int N, int IC, int OC) {
  if (!in_pass_) return CpuBackend::matmul_forward(out, inp, weight, N, IC, OC, false);
  float* y = out.f32();
  for_each_piece(weight, OC, IC, [&](WeightRef W, int r0, int rows) {
    add_row_tasks(tasks_, y + r0, OC, W, inp.f32(), IC, N, rows, false);
  });
  run_tasks(tasks_, IC);
}

void CpuInferenceBackend::matmul_forward_group(std::span<const MatmulTask> group, Tensor inp, int N, int IC) {
  const float* x = inp.f32();
  for (const MatmulTask& t : group) {
    float* y = t.out.f32();
    for_each_piece(t.weight, t.OC, IC, [&](WeightRef W, int r0, int rows) {
      if (decode_)
        add_row_tasks(tasks_, y + r0, t.OC, W, x, IC, N, rows, t.accumulate);
      else
        linear(y + r0, t.OC, x, IC, W, N, IC, rows, t.accumulate);
    });
  }
  if (decode_) run_tasks(tasks_, IC);  // every product of the group in one parallel region
}

void CpuInferenceBackend::rope_forward(Tensor x, Tensor pos, long N, int H, int HD, const ops::RopeSpec& spec) {
  if (!in_pass_) return CpuBackend::rope_forward(x, pos, N, H, HD, spec);
  const int R = spec.rotated(HD);
  // The angles of the pass's positions once, for every layer's q and k (bitwise rope_forward's).
  if (rope_pos_ != pos.data || rope_n_ != N || rope_hd_ != R || !(rope_spec_ == spec)) {
    rope_cs_.resize((size_t)N * (R / 2));
    rope_sn_.resize((size_t)N * (R / 2));
    ops::rope_angles(rope_cs_.data(), rope_sn_.data(), pos.i32(), N, R, spec);
    rope_pos_ = pos.data;
    rope_n_ = N;
    rope_hd_ = R;
    rope_spec_ = spec;
  }
  PromptLimit lim(decode_, N * H * HD);
  ops::rope_forward_angles(x.f32(), x.f32(), rope_cs_.data(), rope_sn_.data(), N, H, HD, spec);
}

void CpuInferenceBackend::add_bias_rows(Tensor x, Tensor bias, long N, int E) {
  PromptLimit lim(decode_, N * E);
  CpuBackend::add_bias_rows(x, bias, N, E);
}

void CpuInferenceBackend::router_forward(Tensor probs, Tensor topk_idx, Tensor topk_w, Tensor logits, Tensor bias,
                                         long N, int E, int K, const ops::RouterSpec& spec) {
  PromptLimit lim(decode_, N * E * 8);  // a softmax and K passes over the experts per row
  CpuBackend::router_forward(probs, topk_idx, topk_w, logits, bias, N, E, K, spec);
}

void CpuInferenceBackend::moe_permute_forward(Tensor xperm, Tensor x, const PlanView& plan, int C) {
  PromptLimit lim(decode_, plan.plan->N * plan.plan->K * (long)C);
  CpuBackend::moe_permute_forward(xperm, x, plan, C);
}

void CpuInferenceBackend::moe_combine_forward(Tensor out, Tensor yperm, Tensor w, const PlanView& plan, int C) {
  PromptLimit lim(decode_, plan.plan->N * plan.plan->K * (long)C);
  CpuBackend::moe_combine_forward(out, yperm, w, plan, C);
}

void CpuInferenceBackend::swiglu_forward(Tensor act, Tensor h13, long M, int I) {
  PromptLimit lim(decode_, M * I * 8);
  ops::swiglu_forward_exp_f32(act.f32(), h13.f32(), M, I);
}

void CpuInferenceBackend::gather_rows(Tensor out, Tensor in, Tensor index, long rows, int C) {
  PromptLimit lim(decode_, rows * C);
  CpuBackend::gather_rows(out, in, index, rows, C);
}

// Per expert over its rows (the plan's expert-contiguous order): h13 = xperm W13^T, act = swiglu(h13),
// y = act W2^T.  Nothing is kept for a backward: h13 and act may be empty (inference), and the hidden
// activations then live in this backend's scratch.  Decode: every expert's gate/up tasks in one
// parallel region, then the down tasks -- each weight read once for all the rows routed to it, each
// row bitwise what it gets alone.
void CpuInferenceBackend::moe_experts_forward(Tensor y, Tensor h13, Tensor act, Tensor xperm, Tensor w13, Tensor w2,
                                              const PlanView& plan, int C, int I) {
  const ops::MoePlan& p = *plan.plan;
  const int E = p.E - p.overflow;
  const size_t IC = (size_t)I * C;
  const long M = p.expert_offsets[E];
  if (!decode_)
    return experts_prefill(y.f32(), h13.empty() ? nullptr : h13.f32(), act.empty() ? nullptr : act.f32(),
                           xperm.f32(), w13, w2, p, C, I);
  if (h13.empty()) expert_serial_.h13.resize((size_t)M * 2 * I);
  if (act.empty()) expert_serial_.act.resize((size_t)M * I);
  float* h = h13.empty() ? expert_serial_.h13.data() : h13.f32();
  float* a = act.empty() ? expert_serial_.act.data() : act.f32();
  const float* x = xperm.f32();
  for (int e = 0; e < E; e++) {
    const long g0 = p.expert_offsets[e], m = p.expert_offsets[e + 1] - g0;
    if (m == 0) continue;
    for_each_piece(w13.part((size_t)e * 2 * IC, 2 * IC), 2 * I, C, [&](WeightRef W, int r0, int rows) {
      add_row_tasks(tasks_, h + g0 * 2 * I + r0, 2 * I, W, x + g0 * C, C, (int)m, rows, false);
    });
  }
  run_tasks(tasks_, C);
  ops::swiglu_forward_exp_f32(a, h, M, I);
  for (int e = 0; e < E; e++) {
    const long g0 = p.expert_offsets[e], m = p.expert_offsets[e + 1] - g0;
    if (m == 0) continue;
    for_each_piece(w2.part((size_t)e * IC, IC), C, I, [&](WeightRef W, int r0, int rows) {
      add_row_tasks(tasks_, y.f32() + g0 * C + r0, C, W, a + g0 * I, I, (int)m, rows, false);
    });
  }
  run_tasks(tasks_, I);
}

// A prompt's experts.  With several experts holding rows (and no adapters: this is the fused op), the
// experts run in parallel, one thread each with its own widening scratch and its products on that
// thread: a prompt's experts hold a few dozen rows each, too few for one GEMM to split well (0.49B
// model, 2 threads, AVX-512 AMD EPYC VM: prefill tokens/s 1.22x in bf16, 1.28x in Q8_0, medians of 3).
// Largest experts first (each is one thread's): the threads then finish nearly together (small model,
// prompt 128, 2 threads, 2-core Zen 4 EPYC VM: experts 6.2 -> 5.7 ms a prefill).  Otherwise one expert
// after another, each product split over the threads as its size allows.  Without h13 / act from the
// caller, an expert's rows run in pieces of at most kExpertRows (equal pieces, so none is left with a
// few rows) whose hidden activations live in the thread's scratch: a skewed router can send most of a
// prompt's rows to one expert.  One expert alone (a dense FFN) runs its rows whole: one GEMM each.
void CpuInferenceBackend::experts_prefill(float* y, float* h13, float* act, const float* xperm, const Tensor& w13,
                                          const Tensor& w2, const ops::MoePlan& p, int C, int I) {
  constexpr long kExpertRows = 64;  // two of gemm_nt's AVX-512 tiles; a widened weight row costs 1/64 of its products
  const int E = p.E - p.overflow;
  const size_t IC = (size_t)I * C;
  const auto rows_of = [&](int e) { return p.expert_offsets[e + 1] - p.expert_offsets[e]; };
  int active = 0;
  for (int e = 0; e < E; e++) active += rows_of(e) > 0;
  // One expert's gate/up product over its share of the rows bounds the threads.
  ThreadLimit lim(std::max(1L, p.N * p.K / std::max(1, active)) * 2 * I * C);
  const long M = p.expert_offsets[E];
  const bool parallel = active > 1 && omp_get_max_threads() > 1 && M * 3 * C * (long)I >= 4 * kThreadLimitMin;
  auto run_expert = [&](int e, ExpertScratch& sc) {
    const long off = p.expert_offsets[e], rows = rows_of(e);
    if (rows == 0) return;
    const long pieces = h13 != nullptr || active == 1 ? 1 : (rows + kExpertRows - 1) / kExpertRows;
    const long step = (rows + pieces - 1) / pieces;
    if (h13 == nullptr) sc.h13.resize((size_t)step * 2 * I);
    if (act == nullptr) sc.act.resize((size_t)step * I);
    for (long p0 = off; p0 < off + rows; p0 += step) {
      const int m = (int)std::min(step, off + rows - p0);
      float* h = h13 != nullptr ? h13 + p0 * 2 * I : sc.h13.data();
      float* a = act != nullptr ? act + p0 * I : sc.act.data();
      const auto product = [&](float* out, int ld_out, const float* in, int ld_in, const Tensor& w, int ic, int oc) {
        for_each_piece(w, oc, ic, [&](WeightRef W, int r0, int n) {
          if (parallel)
            kernels::matmul(out + r0, ld_out, in, ld_in, W, m, ic, n, false, sc.gemm);
          else
            linear(out + r0, ld_out, in, ld_in, W, m, ic, n, false);
        });
      };
      product(h, 2 * I, xperm + p0 * C, C, w13.part((size_t)e * 2 * IC, 2 * IC), C, 2 * I);
      ops::swiglu_forward_exp_f32(a, h, m, I);
      product(y + p0 * C, C, a, I, w2.part((size_t)e * IC, IC), I, C);
    }
  };
  if (!parallel) {
    for (int e = 0; e < E; e++) run_expert(e, expert_serial_);
    return;
  }
  expert_widen_.resize(omp_get_max_threads());
  expert_order_.resize(E);
  for (int e = 0; e < E; e++) expert_order_[e] = e;
  std::stable_sort(expert_order_.begin(), expert_order_.end(), [&](int a, int b) { return rows_of(a) > rows_of(b); });
#pragma omp parallel for schedule(dynamic, 1)
  for (int i = 0; i < E; i++) run_expert(expert_order_[i], expert_widen_[omp_get_thread_num()]);
}

// Per expert over its rows, for what the fused op cannot carry (adapters): the base's rows by the
// matrix-vector tasks (decode, one region) or per expert (a prompt); a plain f32 weight -- an
// adapter's factor -- by the GEMM (alpha scaling; every value one fma chain, so a row's result does
// not depend on the others).
void CpuInferenceBackend::grouped_matmul_forward(Tensor out, Tensor inp, Tensor weight, const PlanView& plan, int IC,
                                                 int OC, float alpha, bool accumulate, int ld_in, int ld_out) {
  const ops::MoePlan& p = *plan.plan;
  const int E = p.E - p.overflow;
  if (ld_in == 0) ld_in = IC;
  if (ld_out == 0) ld_out = OC;
  float* o = out.f32();
  const float* x = inp.f32();
  const size_t per = (size_t)OC * IC;
  for (int e = 0; e < E; e++) {
    const long g0 = p.expert_offsets[e], m = p.expert_offsets[e + 1] - g0;
    if (m == 0) continue;
    const Tensor w = weight.part((size_t)e * per, per);
    if (w.store != Store::stored) {
      kernels::gemm_nt(o + g0 * ld_out, ld_out, x + g0 * ld_in, ld_in, WeightRef{w.f32(), DType::F32}, IC, (int)m, IC,
                       OC, alpha, accumulate, widen_);
      continue;
    }
    MOETRON_ASSERT(alpha == 1.0f);
    for_each_piece(w, OC, IC, [&](WeightRef W, int r0, int rows) {
      if (decode_)
        add_row_tasks(tasks_, o + g0 * ld_out + r0, ld_out, W, x + g0 * ld_in, ld_in, (int)m, rows, accumulate);
      else
        linear(o + g0 * ld_out + r0, ld_out, x + g0 * ld_in, ld_in, W, (int)m, IC, rows, accumulate);
    });
  }
  if (decode_) run_tasks(tasks_, IC);
}

}  // namespace moetron
