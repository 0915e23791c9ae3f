// Decode-time forward over a KV cache; see decoder.h.
#include "infer/decoder.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include <omp.h>

#include "core/error.h"
#include "infer/gemm.h"
#include "infer/kernels.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/router.h"
#include "ops/sigmoid.h"
#include "ops/softmax.h"
#include "ops/swiglu.h"

namespace moetron {

namespace {

// Attention runs per (query row, head) with dot products, all heads in one parallel region, up to this
// many (query, key) pairs per head; beyond, as two GEMMs per head (2 * NH gemm_nt calls: faster for long
// prompts on an idle machine, but each call is a fork/join, which is slow when the cores are shared).
constexpr long kRowAttentionMaxPairs = 1L << 18;
// Prefill: an expert's rows are run in pieces of at most this many (bounds the scratch; 64 rows are
// two of gemm_nt's AVX-512 tiles, and a weight row widened once per piece costs 1/64 of its products).
constexpr long kExpertRows = 64;
// Work (multiply-adds, or elements) below which a prefill step runs on one thread: 2M (a fork/join may
// cost a scheduler time slice on a shared machine: see kGemvSplitMin in kernels.h; at 16M, the earlier
// threshold, a small model's prefill ran almost all on one thread: 2 threads gave 5400 prompt
// tokens/s, at 2M 6860, on the 2-core VM with hidden 256).  Prefill steps are limited
// with ThreadLimit, which the OpenMP regions inside the ops and gemm_nt follow (omp_get_max_threads()
// at each call).
constexpr long kParallelMin = 1L << 21;

class ThreadLimit {
 public:
  explicit ThreadLimit(long work) : saved_(omp_get_max_threads()) {
    active_ = work < kParallelMin && saved_ > 1;
    if (active_) omp_set_num_threads(1);
  }
  ~ThreadLimit() {
    if (active_) omp_set_num_threads(saved_);
  }
  ThreadLimit(const ThreadLimit&) = delete;
  ThreadLimit& operator=(const ThreadLimit&) = delete;

 private:
  int saved_;
  bool active_ = false;
};

// x[i] clamped to [-c, c] (as ops::clamp_forward, without its mask).
void clip_inplace(float* x, long n, float c) {
  for (long i = 0; i < n; i++) x[i] = x[i] > c ? c : x[i] < -c ? -c : x[i];
}

// x[n, C] += bias[C] per row.
void add_bias(float* x, const float* bias, long n, int C) {
  for (long i = 0; i < n; i++)
    for (int c = 0; c < C; c++) x[i * C + c] += bias[c];
}

void add_inplace(float* y, const float* x, long n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (long i = 0; i < n; i++) y[i] += x[i];
}

}  // namespace

Decoder::Decoder(const InferenceModel& model, int prefill_chunk, long row_attention_max_pairs)
    : m_(model), chunk_(std::max(1, prefill_chunk)),
      row_pairs_(row_attention_max_pairs < 0 ? kRowAttentionMaxPairs : row_attention_max_pairs) {
  const ModelConfig& c = m_.cfg;
  moe_ = c.is_moe();
  C_ = c.hidden_size;
  V_ = c.vocab_size;
  I_ = 0;  // the widest FFN of any layer (scratch); each layer's own is cfg.ffn_size(l)
  for (int l = 0; l < c.num_hidden_layers; l++) I_ = std::max(I_, c.ffn_size(l));
  NH_ = c.num_attention_heads;
  NKV_ = c.num_key_value_heads;
  HD_ = c.head_dim;
  Q_ = NH_ * HD_;
  KVd_ = NKV_ * HD_;
  E_ = moe_ ? c.num_local_experts : 1;
  K_ = moe_ ? c.num_experts_per_tok : 1;
  L_ = c.num_hidden_layers;
  MOETRON_ASSERT(NKV_ > 0 && NH_ % NKV_ == 0 && HD_ > 0);
}

infer::GemvTask Decoder::task(float* y, ParamKind kind, int layer, size_t offset, const float* x, int OC, int IC,
                              bool accumulate) const {
  const infer::WeightRef W = InferenceModel::is_small(kind) ? infer::WeightRef{m_.vec(kind, layer) + offset, DType::F32}
                                                            : m_.mat(kind, layer, offset, (size_t)OC * IC);
  return {y, W, x, OC, accumulate};
}

void Decoder::linear(float* out, int ld_out, const float* x, int ld_x, ParamKind kind, int layer, size_t offset, int n,
                     int IC, int OC, bool accumulate) {
  const infer::GemvTask t = task(out, kind, layer, offset, x, OC, IC, accumulate);
  if (n == 1) {
    infer::gemv_batch(&t, 1, IC, gemv_min_);
    return;
  }
  ThreadLimit lim((long)n * IC * OC);
  infer::matmul(out, ld_out, x, ld_x, t.W, n, IC, OC, accumulate, widen_);
}

// v holds at least `size` values (never shrinks).
template <class Vec>
static float* at_least(Vec& v, size_t size) {
  if (v.size() < size) v.resize(size);
  return v.data();
}

void Decoder::reserve_scratch(int n) {
  if (n <= cap_) return;
  cap_ = n;
  const size_t N = n, M = (size_t)n * K_;
  x_.resize(N * C_);
  ln_.resize(N * C_);
  rstd_.resize(N * std::max(1, NH_));  // also the per-head q/k norms' statistics
  q_.resize(N * Q_);
  att_.resize(N * Q_);
  tmp_.resize(N * C_);
  rlogits_.resize(N * E_);
  rprobs_.resize(N * E_);
  topk_w_.resize(M);
  topk_idx_.resize(M);
  xperm_.resize(M * C_);
  yperm_.resize(M * C_);
  pos_.resize(N);
  rope_cs_.resize(N * (HD_ / 2));
  rope_sn_.resize(N * (HD_ / 2));
  kv_.resize(2 * N * KVd_);
}

void Decoder::lora_add(float* out, int ld_out, const float* x, int ld_x, const float* A, const float* B, int n, int IC,
                       int OC) {
  if (A == nullptr) return;
  const int r = m_.lora->spec.rank;
  lora_u_.resize((size_t)n * r);
  infer::gemm_nt(lora_u_.data(), r, x, ld_x, {A}, IC, n, IC, r, 1.0f, false, widen_);
  infer::gemm_nt(out, ld_out, lora_u_.data(), r, {B}, r, n, r, OC, m_.lora->spec.scale(), true, widen_);
}

void Decoder::lora_linear(float* out, const float* x, ParamKind target, int layer, int e, int n, int IC, int OC) {
  const float* A = m_.lora_factor(target, layer, false);
  if (A == nullptr) return;
  const size_t r = (size_t)m_.lora->spec.rank;
  lora_add(out, OC, x, IC, A + (size_t)e * r * IC, m_.lora_factor(target, layer, true) + (size_t)e * OC * r, n, IC, OC);
}

void Decoder::lora_gate_up_split(float* h13, const float* ln, ParamKind target, int layer, int n, int I) {
  const float* A = m_.lora_factor(target, layer, false);  // [2r, C]: gate, then up
  if (A == nullptr) return;
  const float* B = m_.lora_factor(target, layer, true);   // [2I, r]: gate rows, then up rows
  const size_t r = (size_t)m_.lora->spec.rank;
  for (int half = 0; half < 2; half++)
    lora_add(h13 + (size_t)half * I, 2 * I, ln, C_, A + half * r * C_, B + half * (size_t)I * r, n, C_, I);
}

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

void Decoder::forward(KvCache& cache, std::span<const int32_t> tokens, float* logits, bool all_logits) {
  if (tokens.empty()) fail("[Decoder::forward] no tokens to feed");
  if (cache.layers() != L_ || cache.kv_dim() != KVd_)
    fail("[Decoder::forward] the KV cache has {} layers of width {}, the model {} of width {}", cache.layers(),
         cache.kv_dim(), L_, KVd_);
  for (size_t i = 0; i < tokens.size(); i++)
    if (tokens[i] < 0 || tokens[i] >= V_)
      fail("[Decoder::forward] token id {} at position {} is outside the vocabulary [0, {})", tokens[i], i, V_);
  const int total = (int)tokens.size();
  for (int s = 0; s < total; s += chunk_) {
    const int n = std::min(chunk_, total - s);
    const bool last = s + n == total;
    float* out = all_logits ? logits + (size_t)s * V_ : (last ? logits : nullptr);
    // One-token steps with more than one thread: the tuner picks the split threshold and times them.
    // A prompt's last-row head (and any other one-row product of a prompt pass) splits as the prompt's
    // few-row products do (matmul: from kGemvSplitMin): its passes fork for every product anyway (small
    // model, prompt 128, 2 threads, 2-core Zen 4 EPYC VM: the 32000 x 256 head 0.93 -> 0.55 ms).
    const bool tune = n == 1 && omp_get_max_threads() > 1;
    gemv_min_ = tune ? (tuner_.split_next() ? infer::kGemvSplitMin : infer::kGemvParallelMin)
                     : (omp_get_max_threads() > 1 ? infer::kGemvSplitMin : infer::kGemvParallelMin);
    const auto t0 = std::chrono::steady_clock::now();
    KvCache* const one[1] = {&cache};
    forward_chunk(one, tokens.data() + s, n, out, all_logits, /*decode=*/n == 1);
    if (tune) tuner_.record(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
}

void Decoder::forward_batch(std::span<KvCache* const> caches, std::span<const int32_t> tokens, float* logits) {
  if (tokens.empty() || caches.size() != tokens.size())
    fail("[Decoder::forward_batch] {} caches for {} tokens (one token per sequence, at least one)", caches.size(),
         tokens.size());
  for (size_t i = 0; i < caches.size(); i++) {
    if (caches[i]->layers() != L_ || caches[i]->kv_dim() != KVd_)
      fail("[Decoder::forward_batch] KV cache {} has {} layers of width {}, the model {} of width {}", i,
           caches[i]->layers(), caches[i]->kv_dim(), L_, KVd_);
    if (tokens[i] < 0 || tokens[i] >= V_)
      fail("[Decoder::forward_batch] token id {} of sequence {} is outside the vocabulary [0, {})", tokens[i], i, V_);
    for (size_t j = 0; j < i; j++)
      if (caches[j] == caches[i]) fail("[Decoder::forward_batch] sequences {} and {} share a KV cache", j, i);
  }
  gemv_min_ = omp_get_max_threads() > 1 ? infer::kGemvSplitMin : infer::kGemvParallelMin;
  forward_chunk(caches.data(), tokens.data(), (int)tokens.size(), logits, true, /*decode=*/true);
}

void Decoder::prefill_rows(std::span<KvCache* const> caches, std::span<const std::span<const int32_t>> tokens,
                           float* logits) {
  if (caches.empty() || caches.size() != tokens.size())
    fail("[Decoder::prefill_rows] {} caches for {} token lists", caches.size(), tokens.size());
  std::vector<KvCache*> row_cache;
  std::vector<int32_t> row_token;
  logit_rows_.clear();
  for (size_t s = 0; s < caches.size(); s++) {
    if (tokens[s].empty()) fail("[Decoder::prefill_rows] sequence {} has no tokens to feed", s);
    if (caches[s]->layers() != L_ || caches[s]->kv_dim() != KVd_)
      fail("[Decoder::prefill_rows] KV cache {} has {} layers of width {}, the model {} of width {}", s,
           caches[s]->layers(), caches[s]->kv_dim(), L_, KVd_);
    for (size_t j = 0; j < s; j++)
      if (caches[j] == caches[s]) fail("[Decoder::prefill_rows] sequences {} and {} share a KV cache", j, s);
    for (size_t i = 0; i < tokens[s].size(); i++)
      if (tokens[s][i] < 0 || tokens[s][i] >= V_)
        fail("[Decoder::prefill_rows] token id {} at position {} of sequence {} is outside the vocabulary [0, {})",
             tokens[s][i], i, s, V_);
  }
  for (size_t s = 0; s < caches.size(); s++) {
    for (int32_t t : tokens[s]) {
      row_cache.push_back(caches[s]);
      row_token.push_back(t);
    }
  }
  gemv_min_ = omp_get_max_threads() > 1 ? infer::kGemvSplitMin : infer::kGemvParallelMin;
  // In passes of at most chunk_ rows (the scratch bound), each ending its sequences' rows where it
  // ends; logits for the rows that end a sequence.
  const int total = (int)row_token.size();
  for (int s0 = 0; s0 < total; s0 += chunk_) {
    const int n = std::min(chunk_, total - s0);
    logit_rows_.clear();
    for (int i = 0; i < n; i++)
      if (s0 + i + 1 == total || row_cache[s0 + i + 1] != row_cache[s0 + i]) logit_rows_.push_back(i);
    std::vector<float> out((size_t)logit_rows_.size() * V_);
    const std::vector<int> ends = logit_rows_;
    forward_chunk(row_cache.data() + s0, row_token.data() + s0, n, out.data(), true, /*decode=*/true);
    // Row r of `out` is the last row of its sequence in this pass; a sequence's final one wins.
    for (size_t r = 0; r < ends.size(); r++) {
      const KvCache* c = row_cache[s0 + ends[r]];
      const size_t seq = (size_t)(std::find(caches.begin(), caches.end(), c) - caches.begin());
      std::memcpy(logits + seq * V_, out.data() + r * V_, sizeof(float) * V_);
    }
  }
  logit_rows_.clear();
}

void Decoder::run_tasks(std::vector<infer::GemvTask>& tasks, int IC) {
  for (const infer::GemvTask& t : tasks) {
    const size_t values = (size_t)t.OC * IC;
    weights_read_ += t.W.q8() ? values + values / infer::kQ8Block * sizeof(uint16_t) : values * dtype_size(t.W.dtype);
  }
  for (size_t t = 0; t < tasks.size(); t += infer::kMaxGemvTasks)
    infer::gemv_batch(tasks.data() + t, (int)std::min<size_t>(infer::kMaxGemvTasks, tasks.size() - t), IC, gemv_min_);
  tasks.clear();
}

void Decoder::add_row_tasks(std::vector<infer::GemvTask>& tasks, float* y, int ld_y, ParamKind kind, int layer,
                            size_t offset, const float* x, int ld_x, int n, int OC, int IC, bool accumulate) const {
  // Up to kMaxGemvInputs rows: one task.  More (a batched prefill): tasks of at most 6, as equal as
  // possible -- the AVX-512 kernels take 6 inputs in one pass and 8 in two of 4, and 6 a pass did
  // 8-9% more multiply-adds a second than 8 (one thread, 1024-wide bf16 rows, in L2 or from memory).
  const int tasks_n = n <= infer::kMaxGemvInputs ? 1 : (n + 5) / 6;
  for (int k = 0, j = 0; k < tasks_n; k++) {
    const int m = n / tasks_n + (k < n % tasks_n ? 1 : 0);
    infer::GemvTask t = task(y + (size_t)j * ld_y, kind, layer, offset, x + (size_t)j * ld_x, OC, IC, accumulate);
    j += m;
    t.n = m;
    t.ld_x = ld_x;
    t.ld_y = ld_y;
    tasks.push_back(t);
  }
}

void Decoder::forward_chunk(KvCache* const* caches, const int32_t* tokens, int n, float* logits, bool all_logits,
                            bool decode) {
  // decode: row i is one token of sequence caches[i] (n == 1: a decode step of one sequence); else the
  // n rows are consecutive tokens of caches[0] (prefill).
  reserve_scratch(n);
  KvCache& cache0 = *caches[0];
  const int pos0 = cache0.len();
  const float eps = (float)m_.cfg.rms_norm_eps, theta = (float)m_.cfg.rope_theta;
  // decode: a sequence may have several consecutive rows (a batched prefill): row i's position is its
  // cache's length plus its earlier rows in this pass.
  for (int i = 0; i < n; i++) {
    pos_[i] = decode ? caches[i]->len() : pos0 + i;
    if (decode)
      for (int j = i - 1; j >= 0 && caches[j] == caches[i]; j--) pos_[i]++;
  }
  ops::rope_angles(rope_cs_.data(), rope_sn_.data(), pos_.data(), n, HD_, theta);  // once for all layers
  float* x = x_.data();
  float* ln = ln_.data();
  const long N = n;
  for (int i = 0; i < n; i++) m_.embedding_row(x + (size_t)i * C_, (size_t)tokens[i], row_bytes_);
  if (decode) {
    for (int i = 0; i < n; i++)
      if (i + 1 == n || caches[i + 1] != caches[i]) caches[i]->grow(pos_[i] - caches[i]->len() + 1);  // its last row
  } else {
    cache0.grow(n);
  }
  std::vector<infer::GemvTask>& tasks = tasks_;
  for (int l = 0; l < L_; l++) {
    // Prefill writes k, v straight into the cache; a decode batch into kv_ first, then each row into
    // its sequence's cache.
    float* kdst = decode ? kv_.data() : cache0.keys(l) + (size_t)pos0 * KVd_;  // [n, KV]
    float* vdst = decode ? kv_.data() + (size_t)n * KVd_ : cache0.values(l) + (size_t)pos0 * KVd_;
    // Attention block: x += o_proj(attn(rope(q), rope(k), v)).
    {
      ThreadLimit lim(N * C_);
      ops::rmsnorm_forward(ln, rstd_.data(), x, m_.vec(ParamKind::input_norm, l), n, C_, eps);
    }
    if (decode) {
      ScopedTimer t(profile_, "q/k/v");
      add_row_tasks(tasks, q_.data(), Q_, ParamKind::q_proj, l, 0, ln, C_, n, Q_, C_);
      add_row_tasks(tasks, kdst, KVd_, ParamKind::k_proj, l, 0, ln, C_, n, KVd_, C_);
      add_row_tasks(tasks, vdst, KVd_, ParamKind::v_proj, l, 0, ln, C_, n, KVd_, C_);
      run_tasks(tasks, C_);
    } else {
      linear(q_.data(), Q_, ln, C_, ParamKind::q_proj, l, 0, n, C_, Q_);
      linear(kdst, KVd_, ln, C_, ParamKind::k_proj, l, 0, n, C_, KVd_);
      linear(vdst, KVd_, ln, C_, ParamKind::v_proj, l, 0, n, C_, KVd_);
    }
    if (m_.lora) {  // unmerged adapters on the projections, before their biases and norms
      lora_rows(q_.data(), ln, ParamKind::q_proj, l, n, C_, Q_, decode);
      lora_rows(kdst, ln, ParamKind::k_proj, l, n, C_, KVd_, decode);
      lora_rows(vdst, ln, ParamKind::v_proj, l, n, C_, KVd_, decode);
    }
    if (m_.cfg.qkv_bias) {  // Qwen2-MoE: q/k/v biases, rows of the projections
      ThreadLimit lim(N * (Q_ + 2 * KVd_));
      add_bias(q_.data(), m_.vec(ParamKind::q_bias, l), n, Q_);
      add_bias(kdst, m_.vec(ParamKind::k_bias, l), n, KVd_);
      add_bias(vdst, m_.vec(ParamKind::v_bias, l), n, KVd_);
    }
    if (m_.cfg.qk_norm) {  // RMSNorm over each head of q and k (OLMoE: over all of q, k), in place, before RoPE
      ThreadLimit lim(N * (Q_ + KVd_));
      const bool full = m_.cfg.qk_norm_full;
      ops::rmsnorm_forward(q_.data(), rstd_.data(), q_.data(), m_.vec(ParamKind::q_norm, l), full ? N : N * NH_,
                           full ? Q_ : HD_, eps);
      ops::rmsnorm_forward(kdst, rstd_.data(), kdst, m_.vec(ParamKind::k_norm, l), full ? N : N * NKV_,
                           full ? KVd_ : HD_, eps);
    }
    if (m_.cfg.clip_qkv > 0) {  // OLMoE clip_qkv
      const float c = (float)m_.cfg.clip_qkv;
      clip_inplace(q_.data(), N * Q_, c);
      clip_inplace(kdst, N * KVd_, c);
      clip_inplace(vdst, N * KVd_, c);
    }
    {
      ThreadLimit lim(N * (Q_ + KVd_));
      ops::rope_forward_angles(q_.data(), q_.data(), rope_cs_.data(), rope_sn_.data(), n, NH_, HD_);
      ops::rope_forward_angles(kdst, kdst, rope_cs_.data(), rope_sn_.data(), n, NKV_, HD_);
    }
    if (decode) {
      {
        ScopedTimer t(profile_, "attention");
        // Every row's key and value first: a later row of the same sequence (prefill_rows) sees them.
        for (int i = 0; i < n; i++) {
          KvCache& c = *caches[i];
          std::memcpy(c.keys(l) + (size_t)pos_[i] * KVd_, kdst + (size_t)i * KVd_, sizeof(float) * KVd_);
          std::memcpy(c.values(l) + (size_t)pos_[i] * KVd_, vdst + (size_t)i * KVd_, sizeof(float) * KVd_);
        }
        attention_decode(caches, n, l);
      }
      ScopedTimer t(profile_, "o");
      add_row_tasks(tasks, x, C_, ParamKind::o_proj, l, 0, att_.data(), Q_, n, C_, Q_, /*accumulate=*/true);
      run_tasks(tasks, Q_);
    } else {
      attention(att_.data(), q_.data(), cache0.keys(l), cache0.values(l), pos0, n);
      linear(x, C_, att_.data(), Q_, ParamKind::o_proj, l, 0, n, Q_, C_, /*accumulate=*/true);
    }
    if (m_.lora) lora_rows(x, att_.data(), ParamKind::o_proj, l, n, Q_, C_, decode);
    // FFN block: x += ffn(rmsnorm(x)).
    {
      ThreadLimit lim(N * C_);
      ops::rmsnorm_forward(ln, rstd_.data(), x, m_.vec(ParamKind::post_norm, l), n, C_, eps);
    }
    if (decode) {
      ffn_decode(x, ln, l, n);
    } else {
      // One expert's gate/up product over its share of the rows.
      ThreadLimit lim(std::max(1L, N * K_ / E_) * 2 * I_ * C_);
      ffn(x, ln, l, n);
    }
  }
  if (decode)
    for (int i = 0; i < n; i++) caches[i]->commit(std::span<const int32_t>(tokens + i, 1));
  else
    cache0.commit(std::span<const int32_t>(tokens, n));
  if (!logits) return;
  // Final norm and head: every row, the last one, or (logit_rows_ set) the rows it names.
  int rows = all_logits ? n : 1;
  const float* xin = all_logits ? x : x + (size_t)(n - 1) * C_;
  if (!logit_rows_.empty()) {
    rows = (int)logit_rows_.size();
    for (int r = 0; r < rows; r++)
      std::memcpy(tmp_.data() + (size_t)r * C_, x + (size_t)logit_rows_[r] * C_, sizeof(float) * C_);
    xin = tmp_.data();
  }
  {
    ThreadLimit lim((long)rows * C_);
    ops::rmsnorm_forward(ln, rstd_.data(), xin, m_.vec(ParamKind::final_norm), rows, C_, eps);
  }
  if (decode) {
    ScopedTimer t(profile_, "head");
    add_row_tasks(tasks, logits, V_, m_.table.head_kind(), -1, 0, ln, C_, rows, V_, C_);
    run_tasks(tasks, C_);
  } else {
    linear(logits, V_, ln, C_, m_.table.head_kind(), -1, 0, rows, C_, V_);
  }
}

void Decoder::lora_rows(float* out, const float* x, ParamKind target, int layer, int n, int IC, int OC, bool decode) {
  if (!decode) return lora_linear(out, x, target, layer, 0, n, IC, OC);
  for (int i = 0; i < n; i++) lora_linear(out + (size_t)i * OC, x + (size_t)i * IC, target, layer, 0, 1, IC, OC);
}

int Decoder::first_key(int p) const {
  const int W = m_.cfg.sliding_window;
  return W > 0 ? std::max(0, p - W + 1) : 0;
}

// Decode: att_[i] for row i (query q_[i], its position pos_[i]) over its own cache's layer-l keys and
// values, which hold that row's key already.  A piece of work is a row and a range of its kv heads
// (attend_heads: the cache rows read in order); a row is split into as few ranges as give every
// thread four pieces (one sequence: each kv head a piece).  The pieces run in parallel from 1/8 of the
// products' threshold (gemv_min_: a decode batch's, or what the tuner chose for one sequence), as a
// multiply-add here costs more (the keys and values come from memory, the softmax).
void Decoder::attention_decode(KvCache* const* caches, int n, int l) {
  const int G = NH_ / NKV_;
  long work = 0;
  int longest = 0;
  for (int i = 0; i < n; i++) {
    const int cnt = pos_[i] - first_key(pos_[i]) + 1;
    work += 2L * NH_ * cnt * HD_;
    longest = std::max(longest, cnt);
  }
  const bool parallel = work >= gemv_min_ / 8;
  const int threads = parallel ? omp_get_max_threads() : 1;
  // kv heads split into `ranges` equal ranges, a divisor of NKV_, for the threads to share; one thread
  // takes a row's heads in one range, reading each cached row whole, in order (0.49B bf16, one thread,
  // 2-core Zen 4 EPYC VM: 4 ranges of 2 kv heads, each reading 512 bytes of every 2 KiB row, took 0.605
  // ms a step, one range 0.567).
  int ranges = 1;
  while (threads > 1 && ranges < NKV_ && (long)n * ranges < 4L * threads) {
    ranges++;
    while (NKV_ % ranges) ranges++;
  }
  const int per = NKV_ / ranges;
#pragma omp parallel if (parallel)
  {
    std::vector<float> s((size_t)per * G * longest);
#pragma omp for schedule(dynamic, 1)
    for (int ir = 0; ir < n * ranges; ir++) {
      const int i = ir / ranges, g0 = ir % ranges * per;
      attend_heads(att_.data() + (size_t)i * Q_, q_.data() + (size_t)i * Q_, caches[i]->keys(l), caches[i]->values(l),
                   first_key(pos_[i]), pos_[i], g0, g0 + per, s.data());
    }
  }
}

// Row o[Q] for query q[Q] at position p, its query heads of kv heads [g0, g1), over the keys and
// values [lo, p] (rows of KVd_ values from `keys` / `values`: a layer of a cache); s: (g1 - g0) G
// (p - lo + 1) floats of scratch.  Per head: scores by dot_rows, softmax, then the weighted sum by
// axpy_rows in key order -- bitwise the same in any blocks of keys, so every path (a decode batch, a
// prompt's rows) computes a (row, head) pair exactly this way and a row's result does not depend on
// which pass, batch or thread computes it.  The keys, then the values, are read kBlock cache rows at
// a time for all the heads, in order, the next block prefetched: a row's kv heads lie side by side,
// so the cache streams from memory instead of each head reading its slice of every row (8 sequences
// at ~230 positions on the 0.49B model: 3.78 -> 3.37 ms a step; 2-core Xeon VM).
void Decoder::attend_heads(float* o, const float* q, const float* layer_keys, const float* layer_values, int lo, int p,
                           int g0, int g1, float* s) const {
  constexpr int kBlock = 16;  // e.g. 8 kv heads of 64 fp32 values: 32 KiB of keys, in L1
  const int G = NH_ / NKV_, cnt = p - lo + 1, h0 = g0 * G, h1 = g1 * G;
  const float scale = 1.0f / std::sqrt((float)HD_);
  const float* keys = layer_keys + (size_t)lo * KVd_;
  const float* values = layer_values + (size_t)lo * KVd_;
  const int width = (g1 - g0) * HD_;  // a cache row's values for these heads
  for (int j = 0; j < cnt; j += kBlock) {
    const int m = std::min(kBlock, cnt - j);
    if (j + kBlock < cnt)
      infer::prefetch_rows(keys + (size_t)(j + kBlock) * KVd_ + (size_t)g0 * HD_, KVd_, std::min(kBlock, cnt - j - kBlock), width);
    else
      infer::prefetch_rows(values + (size_t)g0 * HD_, KVd_, std::min(kBlock, cnt), width);
    for (int h = h0; h < h1; h++)
      infer::dot_rows(s + (size_t)(h - h0) * cnt + j, q + (size_t)h * HD_, keys + (size_t)j * KVd_ + (size_t)(h / G) * HD_,
                      KVd_, m, HD_, scale);
  }
  ops::softmax_rows(s, h1 - h0, cnt, cnt);
  std::fill(o + (size_t)h0 * HD_, o + (size_t)h1 * HD_, 0.0f);
  for (int j = 0; j < cnt; j += kBlock) {
    const int m = std::min(kBlock, cnt - j);
    if (j + kBlock < cnt)
      infer::prefetch_rows(values + (size_t)(j + kBlock) * KVd_ + (size_t)g0 * HD_, KVd_, std::min(kBlock, cnt - j - kBlock), width);
    for (int h = h0; h < h1;) {
      const float* v = values + (size_t)j * KVd_ + (size_t)(h / G) * HD_;
      const float* w = s + (size_t)(h - h0) * cnt + j;
      if (h + 1 < h1 && (h + 1) / G == h / G) {  // two heads of one kv head: each value row read once for both
        infer::axpy_rows2(o + (size_t)h * HD_, o + (size_t)(h + 1) * HD_, w, w + cnt, v, KVd_, m, HD_);
        h += 2;
      } else {
        infer::axpy_rows(o + (size_t)h * HD_, w, v, KVd_, m, HD_);
        h++;
      }
    }
  }
}

// out[n, Q] for queries at positions pos0..pos0+n-1 over cached keys/values [0, pos0+n).
void Decoder::attention(float* out, const float* q, const float* keys, const float* values, int pos0, int n) {
  const int G = NH_ / NKV_;
  const float scale = 1.0f / std::sqrt((float)HD_);
  if ((long)n * (pos0 + n) <= row_pairs_) {
    const long work = (long)n * NH_ * (pos0 + n) * HD_;
#pragma omp parallel if (work >= kParallelMin)
    {
      std::vector<float> s((size_t)G * (pos0 + n));
#pragma omp for schedule(static, 1)  // interleaved: causal rows grow in length
      for (int ig = 0; ig < n * NKV_; ig++) {
        const int i = ig / NKV_, g = ig % NKV_, p = pos0 + i;
        attend_heads(out + (size_t)i * Q_, q + (size_t)i * Q_, keys, values, first_key(p), p, g, g + 1, s.data());
      }
    }
    return;
  }
  // Many rows: per head S = scale * q_h k_g^T over the keys any row can see, masked row softmax,
  // out_h = S v_g (v_g transposed once per kv head, to the weight layout gemm_nt takes).
  const int lo_all = first_key(pos0), cols = pos0 + n - lo_all;
  ThreadLimit lim((long)n * cols * HD_);
  scores_.resize((size_t)n * cols);
  values_t_.resize((size_t)HD_ * cols);
  float* S = scores_.data();
  float* vt = values_t_.data();
  for (int h = 0; h < NH_; h++) {
    const int g = h / G;
    if (h % G == 0)
      for (int c = 0; c < cols; c++)
        for (int d = 0; d < HD_; d++) vt[(size_t)d * cols + c] = values[(size_t)(lo_all + c) * KVd_ + (size_t)g * HD_ + d];
    infer::gemm_nt(S, cols, q + (size_t)h * HD_, Q_, {keys + (size_t)lo_all * KVd_ + (size_t)g * HD_}, KVd_, n, HD_,
                   cols, scale, false, widen_);
#pragma omp parallel for schedule(static) if ((long)n * cols >= kParallelMin)
    for (int i = 0; i < n; i++) {
      const int p = pos0 + i, lo = first_key(p) - lo_all, hi = p - lo_all;  // visible columns [lo, hi]
      float* row = S + (size_t)i * cols;
      std::fill(row, row + lo, 0.0f);
      ops::softmax_inplace(row + lo, hi - lo + 1);
      std::fill(row + hi + 1, row + cols, 0.0f);
    }
    infer::gemm_nt(out + (size_t)h * HD_, Q_, S, cols, {vt}, cols, n, cols, HD_, 1.0f, false, widen_);
  }
}

// Prefill: x[n, C] += FFN(ln[n, C]) for layer `layer` (n consecutive tokens of one sequence): the
// routed experts (MoE) or the dense SwiGLU MLP.  Gate and up rows are separate tensors in the files,
// so they are two products into h13's halves.
void Decoder::ffn(float* x, const float* ln, int layer, int n) {
  const int I = m_.cfg.ffn_size(layer);  // this layer's width
  const size_t IC = (size_t)I * C_;
  if (!m_.cfg.is_moe_layer(layer)) {
    float* h13 = at_least(h13_, (size_t)n * 2 * I);
    float* act = at_least(act_, (size_t)n * I);
    linear(h13, 2 * I, ln, C_, ParamKind::ffn_w13, layer, 0, n, C_, I);
    linear(h13 + I, 2 * I, ln, C_, ParamKind::ffn_w13, layer, IC, n, C_, I);
    if (m_.lora) lora_gate_up_split(h13, ln, ParamKind::ffn_w13, layer, n, I);
    ops::swiglu_forward_exp_f32(act, h13, n, I);
    linear(x, C_, act, I, ParamKind::ffn_w2, layer, 0, n, I, C_, /*accumulate=*/true);
    if (m_.lora) lora_linear(x, act, ParamKind::ffn_w2, layer, 0, n, I, C_);
    return;
  }
  float* tmp = tmp_.data();
  infer::gemm_nt(rlogits_.data(), E_, ln, C_, {m_.vec(ParamKind::router, layer)}, C_, n, C_, E_, 1.0f, false, widen_);
  if (m_.lora) lora_linear(rlogits_.data(), ln, ParamKind::router, layer, 0, n, C_, E_);
  ops::router_forward(rprobs_.data(), topk_idx_.data(), topk_w_.data(), rlogits_.data(), n, E_, K_,
                      m_.cfg.norm_topk_prob);
  ops::moe_plan_build(plan_, topk_idx_.data(), n, E_, K_);
  ops::moe_permute_forward(xperm_.data(), ln, plan_, C_);
  // Expert-major: each expert's rows gathered (the plan) and run as one product per weight, with its
  // adapters between the products.  Without adapters, experts run in parallel, one thread each with
  // its own widening scratch and its products on that thread: a prompt's experts hold a few dozen rows
  // each, too few for one GEMM to split well (0.49B model, 2 threads, AVX-512 AMD EPYC VM: prefill
  // tokens/s 1.22x in bf16, 1.28x in Q8_0, medians of 3).
  const bool expert_parallel = !m_.lora && omp_get_max_threads() > 1 && (long)n * K_ * 3 * C_ * I >= 4 * kParallelMin;
  // Expert e's rows: gate/up, SwiGLU, down, in pieces of at most kExpertRows rows (equal pieces, so
  // none is left with a few rows) whose hidden activations live in the thread's scratch: a skewed
  // router can send most of a prompt's n K rows to one expert.  Each row's result is its own, so the
  // pieces change nothing.  In parallel an expert's products stay on the calling thread
  // (infer::matmul with that thread's scratch); serially they go through linear (thread limits).
  auto run_expert = [&](int e, ExpertScratch& sc) {
    const long off = plan_.expert_offsets[e], rows = plan_.expert_offsets[e + 1] - off;
    if (rows == 0) return;
    const long pieces = (rows + kExpertRows - 1) / kExpertRows, step = (rows + pieces - 1) / pieces;
    float* he = at_least(sc.h13, (size_t)step * 2 * I);
    float* ae = at_least(sc.act, (size_t)step * I);
    for (long p0 = off; p0 < off + rows; p0 += step) {
      const int r = (int)std::min(step, off + rows - p0);
      float* ye = yperm_.data() + p0 * C_;
      const float* xe = xperm_.data() + p0 * C_;
      auto product = [&](float* out, int ld_out, const float* in, int ld_in, ParamKind kind, size_t offset, int ic,
                         int oc) {
        if (expert_parallel)
          infer::matmul(out, ld_out, in, ld_in, m_.mat(kind, layer, offset, (size_t)ic * oc), r, ic, oc, false, sc.gemm);
        else
          linear(out, ld_out, in, ld_in, kind, layer, offset, r, ic, oc);
      };
      product(he, 2 * I, xe, C_, ParamKind::ffn_w13, (size_t)e * 2 * IC, C_, I);
      product(he + I, 2 * I, xe, C_, ParamKind::ffn_w13, (size_t)e * 2 * IC + IC, C_, I);
      if (m_.lora) lora_linear(he, xe, ParamKind::ffn_w13, layer, e, r, C_, 2 * I);
      ops::swiglu_forward_exp_f32(ae, he, r, I);
      product(ye, C_, ae, I, ParamKind::ffn_w2, (size_t)e * IC, I, C_);
      if (m_.lora) lora_linear(ye, ae, ParamKind::ffn_w2, layer, e, r, I, C_);
    }
  };
  if (expert_parallel) {
    // Largest experts first (each is one thread's): the threads then finish nearly together (small
    // model, prompt 128, 2 threads, 2-core Zen 4 EPYC VM: experts 6.2 -> 5.7 ms a prefill, 3 runs each).
    expert_widen_.resize(omp_get_max_threads());
    expert_order_.resize(E_);
    for (int e = 0; e < E_; e++) expert_order_[e] = e;
    const auto rows = [&](int e) { return plan_.expert_offsets[e + 1] - plan_.expert_offsets[e]; };
    std::stable_sort(expert_order_.begin(), expert_order_.end(), [&](int a, int b) { return rows(a) > rows(b); });
#pragma omp parallel for schedule(dynamic, 1)
    for (int i = 0; i < E_; i++) run_expert(expert_order_[i], expert_widen_[omp_get_thread_num()]);
  } else {
    for (int e = 0; e < E_; e++) run_expert(e, expert_serial_);
  }
  ops::moe_combine_forward(tmp, yperm_.data(), topk_w_.data(), plan_, C_);
  add_inplace(x, tmp, (long)n * C_);
  shared_expert(x, ln, layer, n, /*decode=*/false);
}

// Decode: x[n, C] += FFN(ln[n, C]) where each row is one token of its own sequence.  Each row gets
// bitwise what it gets alone (n == 1): the matrix-vector kernels (gemv_rows = gemv per input), the
// router, adapters and combination per row -- while each weight, an expert's included, is read once
// for all the rows that use it (expert-major), in two parallel regions (gate/up, down).
void Decoder::ffn_decode(float* x, const float* ln, int layer, int n) {
  const int I = m_.cfg.ffn_size(layer);
  const size_t IC = (size_t)I * C_;
  const size_t rows = m_.cfg.is_moe_layer(layer) ? (size_t)n * K_ : (size_t)n;  // routed: n K
  float* h13 = at_least(h13_, rows * 2 * I);
  float* act = at_least(act_, rows * I);
  std::vector<infer::GemvTask>& tasks = tasks_;
  if (!m_.cfg.is_moe_layer(layer)) {
    ScopedTimer t(profile_, "dense ffn");
    add_row_tasks(tasks, h13, 2 * I, ParamKind::ffn_w13, layer, 0, ln, C_, n, I, C_);
    add_row_tasks(tasks, h13 + I, 2 * I, ParamKind::ffn_w13, layer, IC, ln, C_, n, I, C_);
    run_tasks(tasks, C_);
    if (m_.lora)
      for (int i = 0; i < n; i++)
        lora_gate_up_split(h13 + (size_t)i * 2 * I, ln + (size_t)i * C_, ParamKind::ffn_w13, layer, 1, I);
    ops::swiglu_forward_exp_f32(act, h13, n, I);
    add_row_tasks(tasks, x, C_, ParamKind::ffn_w2, layer, 0, act, I, n, C_, I, /*accumulate=*/true);
    run_tasks(tasks, I);
    if (m_.lora) lora_rows(x, act, ParamKind::ffn_w2, layer, n, I, C_, true);
    return;
  }
  ScopedTimer t_route(profile_, "router and gathering");
  add_row_tasks(tasks, rlogits_.data(), E_, ParamKind::router, layer, 0, ln, C_, n, E_, C_);
  run_tasks(tasks, C_);
  if (m_.lora) lora_rows(rlogits_.data(), ln, ParamKind::router, layer, n, C_, E_, true);
  for (int i = 0; i < n; i++)
    ops::route_token(rprobs_.data() + (size_t)i * E_, topk_idx_.data() + (size_t)i * K_,
                     topk_w_.data() + (size_t)i * K_, rlogits_.data() + (size_t)i * E_, E_, K_, m_.cfg.norm_topk_prob);
  // Slots s = i * K + k, gathered expert by expert (rows in order) at slot_row_[s].
  const int S = n * K_;
  slot_row_.resize(S);
  expert_start_.assign(E_ + 1, 0);
  for (int s = 0; s < S; s++) expert_start_[topk_idx_[s] + 1]++;
  for (int e = 0; e < E_; e++) expert_start_[e + 1] += expert_start_[e];
  std::vector<int>& fill = expert_fill_;
  fill.assign(expert_start_.begin(), expert_start_.end() - 1);
  float* xg = xperm_.data();  // [S, C] gathered inputs
  for (int s = 0; s < S; s++) {
    const int g = fill[topk_idx_[s]]++;
    slot_row_[s] = g;
    std::memcpy(xg + (size_t)g * C_, ln + (size_t)(s / K_) * C_, sizeof(float) * C_);
  }
  t_route.stop();
  ScopedTimer t_w13(profile_, "experts gate/up");
  for (int e = 0; e < E_; e++) {
    const int g0 = expert_start_[e], m = expert_start_[e + 1] - g0;
    if (m == 0) continue;
    add_row_tasks(tasks, h13 + (size_t)g0 * 2 * I, 2 * I, ParamKind::ffn_w13, layer, (size_t)e * 2 * IC,
                  xg + (size_t)g0 * C_, C_, m, I, C_);
    add_row_tasks(tasks, h13 + (size_t)g0 * 2 * I + I, 2 * I, ParamKind::ffn_w13, layer, (size_t)e * 2 * IC + IC,
                  xg + (size_t)g0 * C_, C_, m, I, C_);
  }
  run_tasks(tasks, C_);
  if (m_.lora)
    for (int s = 0; s < S; s++) {
      const int g = slot_row_[s];
      lora_linear(h13 + (size_t)g * 2 * I, xg + (size_t)g * C_, ParamKind::ffn_w13, layer, topk_idx_[s], 1, C_, 2 * I);
    }
  ops::swiglu_forward_exp_f32(act, h13, S, I);
  t_w13.stop();
  ScopedTimer t_w2(profile_, "experts down");
  float* y = yperm_.data();  // [S, C], gathered order
  for (int e = 0; e < E_; e++) {
    const int g0 = expert_start_[e], m = expert_start_[e + 1] - g0;
    if (m == 0) continue;
    add_row_tasks(tasks, y + (size_t)g0 * C_, C_, ParamKind::ffn_w2, layer, (size_t)e * IC, act + (size_t)g0 * I, I, m,
                  C_, I);
  }
  run_tasks(tasks, I);
  if (m_.lora)
    for (int s = 0; s < S; s++) {
      const int g = slot_row_[s];
      lora_linear(y + (size_t)g * C_, act + (size_t)g * I, ParamKind::ffn_w2, layer, topk_idx_[s], 1, I, C_);
    }
  t_w2.stop();
  ScopedTimer t_combine(profile_, "experts combine");
  float* tmp = tmp_.data();
  for (int i = 0; i < n; i++) {  // per row: its K experts in k order, then added to x
    std::fill(tmp, tmp + C_, 0.0f);
    for (int k = 0; k < K_; k++) {
      const int s = i * K_ + k;
      infer::axpy(tmp, topk_w_[s], y + (size_t)slot_row_[s] * C_, C_);
    }
    add_inplace(x + (size_t)i * C_, tmp, C_);
  }
  t_combine.stop();
  ScopedTimer t_shared(m_.cfg.has_shared_expert() ? profile_ : nullptr, "shared expert");
  shared_expert(x, ln, layer, n, /*decode=*/true);
}

// Qwen2-MoE: x[n, C] += sigmoid(ln . w_gate) * FFN_shared(ln), every token (MoE layers only).
void Decoder::shared_expert(float* x, const float* ln, int layer, int n, bool decode) {
  if (!m_.cfg.has_shared_expert()) return;
  const int Is = m_.cfg.shared_expert_intermediate_size;
  const size_t IsC = (size_t)Is * C_;
  shared_h13_.resize((size_t)n * 2 * Is);
  shared_act_.resize((size_t)n * Is);
  shared_y_.resize((size_t)n * C_);
  float* h = shared_h13_.data();
  if (decode) {
    add_row_tasks(tasks_, h, 2 * Is, ParamKind::shared_w13, layer, 0, ln, C_, n, Is, C_);
    add_row_tasks(tasks_, h + Is, 2 * Is, ParamKind::shared_w13, layer, IsC, ln, C_, n, Is, C_);
    run_tasks(tasks_, C_);
  } else {
    linear(h, 2 * Is, ln, C_, ParamKind::shared_w13, layer, 0, n, C_, Is);
    linear(h + Is, 2 * Is, ln, C_, ParamKind::shared_w13, layer, IsC, n, C_, Is);
  }
  if (m_.lora) {
    if (decode)
      for (int i = 0; i < n; i++)
        lora_gate_up_split(h + (size_t)i * 2 * Is, ln + (size_t)i * C_, ParamKind::shared_w13, layer, 1, Is);
    else
      lora_gate_up_split(h, ln, ParamKind::shared_w13, layer, n, Is);
  }
  ops::swiglu_forward_exp_f32(shared_act_.data(), h, n, Is);
  if (decode) {
    add_row_tasks(tasks_, shared_y_.data(), C_, ParamKind::shared_w2, layer, 0, shared_act_.data(), Is, n, C_, Is);
    run_tasks(tasks_, Is);
  } else {
    linear(shared_y_.data(), C_, shared_act_.data(), Is, ParamKind::shared_w2, layer, 0, n, Is, C_);
  }
  if (m_.lora) lora_rows(shared_y_.data(), shared_act_.data(), ParamKind::shared_w2, layer, n, Is, C_, decode);
  const float* wg = m_.vec(ParamKind::shared_gate, layer);  // [1, C]
  float gate_logit[1], gate[1];
  for (int i = 0; i < n; i++) {
    const float* li = ln + (size_t)i * C_;
    double dot = 0.0;  // as the model's [N,C] x [1,C] product, in fp32 pieces summed in double
    for (int c = 0; c < C_; c++) dot += (double)li[c] * (double)wg[c];
    gate_logit[0] = (float)dot;
    ops::sigmoid_forward(gate, gate_logit, 1);
    infer::axpy(x + (size_t)i * C_, gate[0], shared_y_.data() + (size_t)i * C_, C_);
  }
}

}  // namespace moetron
