// Decode-time forward over a KV cache; see decoder.h.
#include "infer/decoder.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

#include <omp.h>

#include "core/error.h"
#include "infer/kernels.h"
#include "ops/matmul.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/router.h"
#include "ops/sigmoid.h"
#include "ops/swiglu.h"

namespace moetron {

namespace {

// Attention runs per (query row, head) with dot products, all heads in one parallel region, up to this
// many (query, key) pairs per head; beyond, as two GEMMs per head (2 * NH BLAS calls: faster for long
// prompts on an idle machine, but each call is a fork/join, which is slow when the cores are shared).
constexpr long kRowAttentionMaxPairs = 1L << 18;
// Work (multiply-adds, or elements) below which a step runs on one thread: 16M, as kernels.h's kGemvParallelMin,
// which explains why (each fork/join may cost a scheduler time slice on a shared machine).  Prefill
// steps are limited with ThreadLimit, which the OpenMP regions inside the ops and the OpenMP build of
// OpenBLAS follow (it takes its thread count from omp_get_max_threads() at each call).
constexpr long kParallelMin = 1L << 24;

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

// In place: row softmax of s[0..n), returns nothing; masked entries are not part of s.
void softmax_inplace(float* s, int n) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int j = 0; j < n; j++) mx = std::max(mx, s[j]);
  float sum = 0.0f;
  for (int j = 0; j < n; j++) {
    s[j] = std::exp(s[j] - mx);
    sum += s[j];
  }
  const float inv = 1.0f / sum;
  for (int j = 0; j < n; j++) s[j] *= inv;
}

// ops::router_forward for one token, without its parallel region (same arithmetic): softmax in fp32
// with a double sum, K argmax passes (strict '>': ties to the lower index), weights renormalised
// (unless !renormalize: Qwen3-MoE's norm_topk_prob false).
void route_one(float* p, int32_t* idx, float* w, const float* l, int E, int K, bool renormalize) {
  float mx = l[0];
  for (int e = 1; e < E; e++) mx = std::fmax(mx, l[e]);
  double s = 0.0;
  for (int e = 0; e < E; e++) {
    p[e] = std::exp(l[e] - mx);
    s += p[e];
  }
  const float inv = (float)(1.0 / s);
  for (int e = 0; e < E; e++) p[e] *= inv;
  float sum = 0.0f;
  for (int k = 0; k < K; k++) {
    int best = -1;
    for (int e = 0; e < E; e++) {
      bool taken = false;
      for (int j = 0; j < k; j++) taken |= idx[j] == e;
      if (taken) continue;
      if (best < 0 || p[e] > p[best]) best = e;
    }
    idx[k] = best;
    w[k] = p[best];
    sum += p[best];
  }
  if (renormalize)
    for (int k = 0; k < K; k++) w[k] /= sum;
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
  h13_.resize(M * 2 * I_);
  act_.resize(M * I_);
  yperm_.resize(M * C_);
  pos_.resize(N);
}

void Decoder::lora_add(float* out, int ld_out, const float* x, int ld_x, const float* A, const float* B, int n, int IC,
                       int OC) {
  if (A == nullptr) return;
  const int r = m_.lora->spec.rank;
  lora_u_.resize((size_t)n * r);
  ops::sgemm(false, true, n, r, IC, 1.0f, x, ld_x, A, IC, 0.0f, lora_u_.data(), r);
  ops::sgemm(false, true, n, OC, r, m_.lora->spec.scale(), lora_u_.data(), r, B, r, 1.0f, out, ld_out);
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
  const int s = (int)(step_ % kPeriod);
  if (s < kTrial) serial_ = s == 0 ? seconds : std::min(serial_, seconds);
  else if (s < 2 * kTrial) split_ = s == kTrial ? seconds : std::min(split_, seconds);
  if (s == 2 * kTrial - 1) choice_ = split_ < serial_;
  step_++;
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
    const bool tune = n == 1 && omp_get_max_threads() > 1;
    gemv_min_ = tune && tuner_.split_next() ? infer::kGemvSplitMin : infer::kGemvParallelMin;
    const auto t0 = std::chrono::steady_clock::now();
    forward_chunk(cache, tokens.data() + s, n, out, all_logits);
    if (tune) tuner_.record(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
}

void Decoder::forward_chunk(KvCache& cache, const int32_t* tokens, int n, float* logits, bool all_logits) {
  reserve_scratch(n);
  const int pos0 = cache.len();
  const float eps = (float)m_.cfg.rms_norm_eps, theta = (float)m_.cfg.rope_theta;
  for (int i = 0; i < n; i++) pos_[i] = pos0 + i;
  float* x = x_.data();
  float* ln = ln_.data();
  const long N = n;
  {
    ThreadLimit lim(N * C_);
    const infer::WeightRef emb = m_.mat(ParamKind::embedding, -1, 0, (size_t)V_ * C_);
    for (int i = 0; i < n; i++) infer::widen_row(x + (size_t)i * C_, emb, (size_t)tokens[i], C_);
  }
  cache.grow(n);
  for (int l = 0; l < L_; l++) {
    float* kdst = cache.keys(l) + (size_t)pos0 * KVd_;  // [n, KV]
    float* vdst = cache.values(l) + (size_t)pos0 * KVd_;
    // Attention block: x += o_proj(attn(rope(q), rope(k), v)) with k, v written straight into the cache.
    {
      ThreadLimit lim(N * C_);
      ops::rmsnorm_forward(ln, rstd_.data(), x, m_.vec(ParamKind::input_norm, l), n, C_, eps);
    }
    if (n == 1) {
      const infer::GemvTask qkv[3] = {task(q_.data(), ParamKind::q_proj, l, 0, ln, Q_, C_),
                                      task(kdst, ParamKind::k_proj, l, 0, ln, KVd_, C_),
                                      task(vdst, ParamKind::v_proj, l, 0, ln, KVd_, C_)};
      infer::gemv_batch(qkv, 3, C_, gemv_min_);
    } else {
      linear(q_.data(), Q_, ln, C_, ParamKind::q_proj, l, 0, n, C_, Q_);
      linear(kdst, KVd_, ln, C_, ParamKind::k_proj, l, 0, n, C_, KVd_);
      linear(vdst, KVd_, ln, C_, ParamKind::v_proj, l, 0, n, C_, KVd_);
    }
    if (m_.lora) {  // unmerged adapters on the projections, before their biases and norms
      lora_linear(q_.data(), ln, ParamKind::q_proj, l, 0, n, C_, Q_);
      lora_linear(kdst, ln, ParamKind::k_proj, l, 0, n, C_, KVd_);
      lora_linear(vdst, ln, ParamKind::v_proj, l, 0, n, C_, KVd_);
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
      ops::rope_forward(q_.data(), q_.data(), pos_.data(), n, NH_, HD_, theta);
      ops::rope_forward(kdst, kdst, pos_.data(), n, NKV_, HD_, theta);
    }
    attention(att_.data(), q_.data(), cache.keys(l), cache.values(l), pos0, n);
    linear(x, C_, att_.data(), Q_, ParamKind::o_proj, l, 0, n, Q_, C_, /*accumulate=*/true);
    if (m_.lora) lora_linear(x, att_.data(), ParamKind::o_proj, l, 0, n, Q_, C_);
    // FFN block: x += ffn(rmsnorm(x)).
    {
      ThreadLimit lim(N * C_);
      ops::rmsnorm_forward(ln, rstd_.data(), x, m_.vec(ParamKind::post_norm, l), n, C_, eps);
    }
    {
      // One expert's gate/up product over its share of the rows (decode: the kernels decide).
      ThreadLimit lim(n == 1 ? kParallelMin : std::max(1L, N * K_ / E_) * 2 * I_ * C_);
      ffn(x, ln, l, n);
    }
  }
  cache.commit(std::span<const int32_t>(tokens, n));
  if (!logits) return;
  // Final norm and head: every row, or the last one.
  const int rows = all_logits ? n : 1;
  const float* xin = all_logits ? x : x + (size_t)(n - 1) * C_;
  {
    ThreadLimit lim((long)rows * C_);
    ops::rmsnorm_forward(ln, rstd_.data(), xin, m_.vec(ParamKind::final_norm), rows, C_, eps);
  }
  linear(logits, V_, ln, C_, m_.table.head_kind(), -1, 0, rows, C_, V_);
}

// out[n, Q] for queries at positions pos0..pos0+n-1 over cached keys/values [0, pos0+n).
void Decoder::attention(float* out, const float* q, const float* keys, const float* values, int pos0, int n) {
  const int G = NH_ / NKV_, W = m_.cfg.sliding_window;
  const float scale = 1.0f / std::sqrt((float)HD_);
  auto first_key = [&](int p) { return W > 0 ? std::max(0, p - W + 1) : 0; };
  if ((long)n * (pos0 + n) <= row_pairs_) {
    const long work = (long)n * NH_ * (pos0 + n) * HD_;
#pragma omp parallel if (work >= kParallelMin)
    {
      std::vector<float> s(pos0 + n);
#pragma omp for schedule(static, 1)  // interleaved: causal rows grow in length
      for (int ih = 0; ih < n * NH_; ih++) {
        const int i = ih / NH_, h = ih % NH_, g = h / G;
        const int p = pos0 + i, lo = first_key(p), cnt = p - lo + 1;
        const float* qi = q + (size_t)i * Q_ + (size_t)h * HD_;
        for (int j = 0; j < cnt; j++) s[j] = infer::dot(qi, keys + (size_t)(lo + j) * KVd_ + (size_t)g * HD_, HD_) * scale;
        softmax_inplace(s.data(), cnt);
        float* o = out + (size_t)i * Q_ + (size_t)h * HD_;
        std::fill(o, o + HD_, 0.0f);
        for (int j = 0; j < cnt; j++) infer::axpy(o, s[j], values + (size_t)(lo + j) * KVd_ + (size_t)g * HD_, HD_);
      }
    }
    return;
  }
  // Many rows: per head S = scale * q_h k_g^T over the keys any row can see, masked row softmax,
  // out_h = S v_g.
  const int lo_all = first_key(pos0), cols = pos0 + n - lo_all;
  ThreadLimit lim((long)n * cols * HD_);
  scores_.resize((size_t)n * cols);
  float* S = scores_.data();
  for (int h = 0; h < NH_; h++) {
    const int g = h / G;
    ops::sgemm(false, true, n, cols, HD_, scale, q + (size_t)h * HD_, Q_, keys + (size_t)lo_all * KVd_ + (size_t)g * HD_,
               KVd_, 0.0f, S, cols);
#pragma omp parallel for schedule(static) if ((long)n * cols >= kParallelMin)
    for (int i = 0; i < n; i++) {
      const int p = pos0 + i, lo = first_key(p) - lo_all, hi = p - lo_all;  // visible columns [lo, hi]
      float* row = S + (size_t)i * cols;
      std::fill(row, row + lo, 0.0f);
      softmax_inplace(row + lo, hi - lo + 1);
      std::fill(row + hi + 1, row + cols, 0.0f);
    }
    ops::sgemm(false, false, n, HD_, cols, 1.0f, S, cols, values + (size_t)lo_all * KVd_ + (size_t)g * HD_, KVd_, 0.0f,
               out + (size_t)h * HD_, Q_);
  }
}

// x[n, C] += FFN(ln[n, C]) for layer `layer`: the routed experts (MoE) or the dense SwiGLU MLP.
// Gate and up rows are separate tensors in the files, so they are two products into h13's halves.
void Decoder::ffn(float* x, const float* ln, int layer, int n) {
  const int I = m_.cfg.ffn_size(layer);  // this layer's width
  const size_t IC = (size_t)I * C_;
  float* h13 = h13_.data();
  float* act = act_.data();
  if (!m_.cfg.is_moe_layer(layer)) {
    if (n == 1) {
      const infer::GemvTask up[2] = {task(h13, ParamKind::ffn_w13, layer, 0, ln, I, C_),
                                     task(h13 + I, ParamKind::ffn_w13, layer, IC, ln, I, C_)};
      infer::gemv_batch(up, 2, C_, gemv_min_);
    } else {
      linear(h13, 2 * I, ln, C_, ParamKind::ffn_w13, layer, 0, n, C_, I);
      linear(h13 + I, 2 * I, ln, C_, ParamKind::ffn_w13, layer, IC, n, C_, I);
    }
    if (m_.lora) lora_gate_up_split(h13, ln, ParamKind::ffn_w13, layer, n, I);
    ops::swiglu_forward(act, h13, n, I);
    linear(x, C_, act, I, ParamKind::ffn_w2, layer, 0, n, I, C_, /*accumulate=*/true);
    if (m_.lora) lora_linear(x, act, ParamKind::ffn_w2, layer, 0, n, I, C_);
    return;
  }
  float* tmp = tmp_.data();
  if (n == 1) {
    // One token: the router serially, then the K experts' gate/up products in one parallel region
    // and their down products in another.
    const infer::GemvTask router = task(rlogits_.data(), ParamKind::router, layer, 0, ln, E_, C_);
    infer::gemv_batch(&router, 1, C_, gemv_min_);
    if (m_.lora) lora_linear(rlogits_.data(), ln, ParamKind::router, layer, 0, 1, C_, E_);
    route_one(rprobs_.data(), topk_idx_.data(), topk_w_.data(), rlogits_.data(), E_, K_, m_.cfg.norm_topk_prob);
    MOETRON_ASSERT(2 * K_ <= infer::kMaxGemvTasks);
    infer::GemvTask up[infer::kMaxGemvTasks], down[infer::kMaxGemvTasks];
    float* y = yperm_.data();  // [K, C]
    for (int k = 0; k < K_; k++) {
      const size_t e = (size_t)topk_idx_[k];
      up[2 * k] = task(h13 + (size_t)k * 2 * I, ParamKind::ffn_w13, layer, e * 2 * IC, ln, I, C_);
      up[2 * k + 1] = task(h13 + (size_t)k * 2 * I + I, ParamKind::ffn_w13, layer, e * 2 * IC + IC, ln, I, C_);
      down[k] = task(y + (size_t)k * C_, ParamKind::ffn_w2, layer, e * IC, act + (size_t)k * I, C_, I);
    }
    infer::gemv_batch(up, 2 * K_, C_, gemv_min_);
    if (m_.lora)
      for (int k = 0; k < K_; k++)
        lora_linear(h13 + (size_t)k * 2 * I, ln, ParamKind::ffn_w13, layer, topk_idx_[k], 1, C_, 2 * I);
    ops::swiglu_forward(act, h13, K_, I);
    infer::gemv_batch(down, K_, I, gemv_min_);
    if (m_.lora)
      for (int k = 0; k < K_; k++)
        lora_linear(y + (size_t)k * C_, act + (size_t)k * I, ParamKind::ffn_w2, layer, topk_idx_[k], 1, I, C_);
    std::fill(tmp, tmp + C_, 0.0f);
    for (int k = 0; k < K_; k++) infer::axpy(tmp, topk_w_[k], y + (size_t)k * C_, C_);
    add_inplace(x, tmp, C_);
    shared_expert(x, ln, layer, 1);
    return;
  }
  ops::matmul_forward(rlogits_.data(), ln, m_.vec(ParamKind::router, layer), n, C_, E_);
  if (m_.lora) lora_linear(rlogits_.data(), ln, ParamKind::router, layer, 0, n, C_, E_);
  ops::router_forward(rprobs_.data(), topk_idx_.data(), topk_w_.data(), rlogits_.data(), n, E_, K_,
                      m_.cfg.norm_topk_prob);
  ops::moe_plan_build(plan_, topk_idx_.data(), n, E_, K_);
  ops::moe_permute_forward(xperm_.data(), ln, plan_, C_);
  // Expert-major: each expert's rows gathered (the plan) and run as one product per weight, with its
  // adapters between the products.
  for (int e = 0; e < E_; e++) {
    const long off = plan_.expert_offsets[e], rows = plan_.expert_offsets[e + 1] - off;
    if (rows == 0) continue;
    float *he = h13 + off * 2 * I, *ae = act + off * I, *ye = yperm_.data() + off * C_;
    const float* xe = xperm_.data() + off * C_;
    const int r = (int)rows;
    linear(he, 2 * I, xe, C_, ParamKind::ffn_w13, layer, (size_t)e * 2 * IC, r, C_, I);
    linear(he + I, 2 * I, xe, C_, ParamKind::ffn_w13, layer, (size_t)e * 2 * IC + IC, r, C_, I);
    if (m_.lora) lora_linear(he, xe, ParamKind::ffn_w13, layer, e, r, C_, 2 * I);
    ops::swiglu_forward(ae, he, rows, I);
    linear(ye, C_, ae, I, ParamKind::ffn_w2, layer, (size_t)e * IC, r, I, C_);
    if (m_.lora) lora_linear(ye, ae, ParamKind::ffn_w2, layer, e, r, I, C_);
  }
  ops::moe_combine_forward(tmp, yperm_.data(), topk_w_.data(), plan_, C_);
  add_inplace(x, tmp, (long)n * C_);
  shared_expert(x, ln, layer, n);
}

// Qwen2-MoE: x[n, C] += sigmoid(ln . w_gate) * FFN_shared(ln), every token (MoE layers only).
void Decoder::shared_expert(float* x, const float* ln, int layer, int n) {
  if (!m_.cfg.has_shared_expert()) return;
  const int Is = m_.cfg.shared_expert_intermediate_size;
  const size_t IsC = (size_t)Is * C_;
  shared_h13_.resize((size_t)n * 2 * Is);
  shared_act_.resize((size_t)n * Is);
  shared_y_.resize((size_t)n * C_);
  float gate_logit[1], gate[1];
  linear(shared_h13_.data(), 2 * Is, ln, C_, ParamKind::shared_w13, layer, 0, n, C_, Is);
  linear(shared_h13_.data() + Is, 2 * Is, ln, C_, ParamKind::shared_w13, layer, IsC, n, C_, Is);
  if (m_.lora) lora_gate_up_split(shared_h13_.data(), ln, ParamKind::shared_w13, layer, n, Is);
  ops::swiglu_forward(shared_act_.data(), shared_h13_.data(), n, Is);
  linear(shared_y_.data(), C_, shared_act_.data(), Is, ParamKind::shared_w2, layer, 0, n, Is, C_);
  if (m_.lora) lora_linear(shared_y_.data(), shared_act_.data(), ParamKind::shared_w2, layer, 0, n, Is, C_);
  const float* wg = m_.vec(ParamKind::shared_gate, layer);  // [1, C]
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
