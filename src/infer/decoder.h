// The decode-time forward pass of the Mixtral / Mistral / Llama decoder over a KV cache: prefill
// (many tokens at once, GEMMs: infer/gemm.h) and decode (one token, matrix-vector kernels).  Same model and
// numerics as Model::forward -- RMSNorm, HF rotate-half RoPE, causal GQA attention with the
// optional sliding window (query i sees key j iff i - W < j <= i), softmax top-K router with
// renormalised weights, SwiGLU experts -- built from the ops in src/ops plus the kernels in kernels.h.
// Dimensions: n new tokens, C hidden, NH heads, NKV kv heads, HD head dim, Q = NH*HD, KV = NKV*HD,
// E experts, K experts per token, I FFN width, V vocab.
//
// A Decoder borrows the model's weights (read-only) and owns scratch buffers, so one Decoder serves
// one forward at a time; any number of KvCaches (sequences) can be used with it in turn.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/profile.h"
#include "infer/kernels.h"
#include "infer/kv_cache.h"
#include "infer/model.h"
#include "infer/runner.h"
#include "ops/moe_dispatch.h"

namespace moetron {

// Decides, from measured decode steps, whether mid-sized products (kGemvSplitMin up to kGemvParallelMin
// multiply-adds) are split across threads: splitting is faster on idle cores and much slower when
// other processes share them (kernels.h).  At the start of each period it times 4 steps each way (the
// fastest of each four) and uses the faster way for the rest; the results are the same either way.
// The first period is kPeriod steps; each trial that keeps the choice doubles the period, up to
// kMaxPeriod, and one that changes it starts again from kPeriod.  The trials of the slower way cost
// their steps' difference: with a period of 64 on idle cores (0.49B bf16, 2-core Xeon VM) 4 steps
// in 64 took ~20 ms instead of ~12, 4% of the decoding time; at 512 it is 0.5%, and a change of
// load is still noticed within 512 steps.
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

class Decoder final : public Runner {
 public:
  // prefill_chunk: the most tokens computed in one pass (bounds the scratch memory of long prompts).
  // row_attention_max_pairs: a prefill pass's attention runs per (query row, head) with dot products
  // up to this many (query, key) pairs per head, beyond as two GEMMs per head (-1: the default, 2^18);
  // decode steps (forward_batch, prefill_rows, one token) always run per row.
  // The weights are read where the model holds them, in their dtype (infer/kernels.h).
  explicit Decoder(const InferenceModel& model, int prefill_chunk = 256, long row_attention_max_pairs = -1);

  const ModelConfig& config() const override { return m_.cfg; }
  KvCache new_cache() const override { return KvCache(m_.cfg.num_hidden_layers, KVd_); }

  // Feeds `tokens` at positions cache.len(), cache.len()+1, ...; appends their keys and values to the
  // cache and writes logits: [tokens.size(), V] when all_logits, else [V] for the last token only.
  // Error for an empty span or a token outside the vocabulary (the cache is then unchanged).
  void forward(KvCache& cache, std::span<const int32_t> tokens, float* logits, bool all_logits = false) override;

  // One decoding step of several sequences at once (continuous batching): tokens[i] is fed to
  // *caches[i] at its next position; logits [n, V].  Each weight is read once for the step -- an
  // expert once for all the sequences routed to it -- and row i's logits and cache are bitwise what
  // forward(*caches[i], {tokens[i]}) gives alone.  Error (nothing changed) for a count mismatch, a
  // token outside the vocabulary, a cache of another shape or one cache given twice.
  void forward_batch(std::span<KvCache* const> caches, std::span<const int32_t> tokens, float* logits) override;

  // Feeds several sequences' tokens at once, row by row with the decoding kernels (each weight read once
  // per pass of up to prefill_chunk rows): tokens[s] into *caches[s] at its next positions; logits
  // [caches.size(), V]: each sequence's last token's.  Row for row the arithmetic of forward_batch, so
  // a sequence's logits and cache are bitwise those of feeding its tokens one at a time -- whatever
  // else is in the pass (serve prefills short prompts this way, alone or together).  Error as
  // forward_batch (nothing changed).
  void prefill_rows(std::span<KvCache* const> caches, std::span<const std::span<const int32_t>> tokens,
                    float* logits) override;

  // Bytes of weights the matrix-vector kernels have read so far (decode steps, forward_batch,
  // prefill_rows): each matrix once per product -- an expert's only when a row was routed to it -- as
  // stored (bf16 2 bytes a value, Q8_0 with its scales).  bench generate divides it by the steps: the
  // weights one token reads alone against what a batched step reads, the bound on what batching gains
  // where decoding streams the weights.
  size_t weights_read() const { return weights_read_; }

  // Time per section of the decode-time passes (forward_batch, prefill_rows, one-token forward) into
  // *profile from now on (null: none, the default): `bench generate --profile`.
  void set_profile(Profile* profile) { profile_ = profile; }

 private:
  // decode: row i is one token of sequence *caches[i]; else n consecutive tokens of *caches[0].
  void forward_chunk(KvCache* const* caches, const int32_t* tokens, int n, float* logits, bool all_logits,
                     bool decode);
  void attention(float* out, const float* q, const float* keys, const float* values, int pos0, int n);
  void attention_decode(KvCache* const* caches, int n, int l);
  void attend_heads(float* o, const float* q, const float* layer_keys, const float* layer_values, int lo, int p, int g0,
                    int g1, float* s) const;
  int first_key(int p) const;  // the first key position visible from position p (sliding window)
  void ffn(float* x, const float* ln, int layer, int n);
  void ffn_decode(float* x, const float* ln, int layer, int n);
  void shared_expert(float* x, const float* ln, int layer, int n, bool decode);
  // A LoRA adapter's product added to n rows: as one product (prefill) or row by row (decode, so a
  // row's result does not depend on the batch).
  void lora_rows(float* out, const float* x, ParamKind target, int layer, int n, int IC, int OC, bool decode);
  // Tasks y_j (row stride ld_y) (=, or +=) W x_j for the n rows of x (stride ld_x), up to
  // kMaxGemvInputs per task; run_tasks runs (and clears) them, kMaxGemvTasks per parallel region.
  void add_row_tasks(std::vector<infer::GemvTask>& tasks, float* y, int ld_y, ParamKind kind, int layer, size_t offset,
                     const float* x, int ld_x, int n, int OC, int IC, bool accumulate = false) const;
  void run_tasks(std::vector<infer::GemvTask>& tasks, int IC);
  void reserve_scratch(int n);
  // LoRA, unmerged: out[n, OC] (row stride ld_out) += scale * (x[n, IC] (row stride ld_x) A^T) B^T,
  // A [r, IC], B [OC, r] (null A: not adapted, nothing to do).
  void lora_add(float* out, int ld_out, const float* x, int ld_x, const float* A, const float* B, int n, int IC, int OC);
  // The adapter of base tensor `target` (layer, expert e of a stacked one) added to out = x W^T.
  void lora_linear(float* out, const float* x, ParamKind target, int layer, int e, int n, int IC, int OC);
  // A dense FFN's (or shared expert's) split gate / up adapters on h13[n, 2I] from ln[n, C].
  void lora_gate_up_split(float* h13, const float* ln, ParamKind target, int layer, int n, int I);
  // A decode-time product y[OC] (=, or +=) W x[IC], W the OC rows of `kind` from element `offset`.
  infer::GemvTask task(float* y, ParamKind kind, int layer, size_t offset, const float* x, int OC, int IC,
                       bool accumulate = false) const;
  // out[n, OC] (row stride ld_out; =, or +=) x[n, IC] (row stride ld_x) W^T, W as in task(); n == 1 as
  // a decode step (gemv with the tuned split), more as a prefill product.
  void linear(float* out, int ld_out, const float* x, int ld_x, ParamKind kind, int layer, size_t offset, int n,
              int IC, int OC, bool accumulate = false);

  const InferenceModel& m_;
  int chunk_;
  long row_pairs_;
  int C_, V_, I_, NH_, NKV_, HD_, Q_, KVd_, E_, K_, L_;
  bool moe_;
  // Scratch, sized for the largest chunk seen.
  int cap_ = 0;
  std::vector<uint8_t> row_bytes_;  // an embedding row as stored (InferenceModel::embedding_row)
  // From cache lines: the SIMD kernels read them 64 bytes at a time (core/line_vector.h).
  LineVector<float> x_, ln_, rstd_, q_, att_, tmp_, rlogits_, rprobs_, topk_w_, xperm_, h13_, act_, yperm_, scores_;
  std::vector<float> shared_h13_, shared_act_, shared_y_;  // Qwen2-MoE's shared expert
  std::vector<int32_t> topk_idx_, pos_;
  std::vector<float> rope_cs_, rope_sn_;  // a pass's rows' RoPE cos / sin [n, HD/2], for every layer's q and k
  std::vector<float> lora_u_;  // LoRA's x A^T
  std::vector<float> values_t_;  // long-prompt attention: a kv head's values transposed [HD, cols]
  std::vector<float> widen_;  // prefill: infer::gemm_nt's scratch (x packed, a few weight rows widened)
  struct ExpertScratch {  // prefill: one expert's rows at a time
    std::vector<float> gemm;  // infer::matmul's scratch (experts run in parallel)
    std::vector<float> h13, act;  // its gate/up products [rows, 2I] and SwiGLU [rows, I]
  };
  std::vector<ExpertScratch> expert_widen_;  // one per thread, for experts run in parallel
  std::vector<int> expert_order_;             // their order (largest first)
  ExpertScratch expert_serial_;  // experts run one after another
  std::vector<float> kv_;     // a decode batch's new keys and values [2][n, KV]
  std::vector<infer::GemvTask> tasks_;
  std::vector<int> slot_row_, expert_start_, expert_fill_;  // decode: expert-major gathering
  std::vector<int> logit_rows_;  // prefill_rows: the rows whose logits a pass computes (empty: as asked)
  ops::MoePlan plan_;
  // Decode steps (n == 1) split products from this many multiply-adds (set per step by the tuner).
  long gemv_min_ = infer::kGemvParallelMin;
  DecodeSplitTuner tuner_;
  Profile* profile_ = nullptr;
  size_t weights_read_ = 0;
};

}  // namespace moetron
