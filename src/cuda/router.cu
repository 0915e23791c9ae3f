// MoE router on the device: softmax over all experts in fp32, top-K, renormalisation, the routing
// statistics of the auxiliary losses, and the backward; see ops.h and src/ops/router.h for the maths.
//   N tokens, E experts (<= kMaxE), K experts per token.  One thread per token.  The sigmoid rule
// (DeepSeek-V3's grouped selection by score + bias) follows ops::route_token's loops exactly.
// Activation gradients assign (=), except router_z_loss_backward, which accumulates (+=).
#include <cmath>

#include "cuda/common.cuh"
#include "cuda/ops.h"

namespace moetron::gpu {

namespace {

constexpr int kMaxE = 512;  // Qwen3-MoE has 128 experts, DeepSeek-V3 256, Kimi-K2 384

struct ExpertDoubles {
  double v[kMaxE];
};

__device__ __forceinline__ bool is_real(const uint8_t* mask, long n) { return mask == nullptr || mask[n] != 0; }

__device__ double row_logsumexp(const float* row, int E) {
  double mx = row[0];
  for (int e = 1; e < E; e++) mx = fmax(mx, (double)row[e]);
  double s = 0.0;
  for (int e = 0; e < E; e++) s += exp((double)row[e] - mx);
  return mx + log(s);
}

// The sigmoid rule for one token (ops/router.h); groups searched as a bit mask (n_group <= 64).
__device__ void route_sigmoid(float* p, int32_t* idx, float* w, const float* l, const float* bias, int E, int K,
                              ops::RouterSpec spec) {
  for (int e = 0; e < E; e++) p[e] = 1.0f / (1.0f + expf(-l[e]));
  auto choice = [&](int e) { return bias ? p[e] + bias[e] : p[e]; };
  const int G = spec.n_group, gsz = E / G;
  unsigned long long allowed = G >= 64 ? ~0ull : (1ull << G) - 1;
  if (spec.topk_group < G) {
    allowed = 0;
    for (int t = 0; t < spec.topk_group; t++) {
      int best = -1;
      float best_score = 0.0f;
      for (int g = 0; g < G; g++) {
        if (allowed >> g & 1ull) continue;
        int b1 = -1, b2 = -1;
        for (int e = g * gsz; e < (g + 1) * gsz; e++) {
          if (b1 < 0 || choice(e) > choice(b1)) {
            b2 = b1;
            b1 = e;
          } else if (b2 < 0 || choice(e) > choice(b2)) {
            b2 = e;
          }
        }
        const float score = choice(b1) + choice(b2);
        if (best < 0 || score > best_score) {
          best = g;
          best_score = score;
        }
      }
      allowed |= 1ull << best;
    }
  }
  float sum = 0.0f;
  for (int k = 0; k < K; k++) {
    int best = -1;
    for (int e = 0; e < E; e++) {
      if (!(allowed >> (e / gsz) & 1ull)) continue;
      bool taken = false;
      for (int j = 0; j < k; j++) taken |= idx[j] == e;
      if (taken) continue;
      if (best < 0 || choice(e) > choice(best)) best = e;
    }
    idx[k] = best;
    w[k] = p[best];
    sum += p[best];
  }
  const float den = spec.renormalize ? sum + 1e-20f : 1.0f;
  for (int k = 0; k < K; k++) w[k] = w[k] / den * spec.scale;
}

__global__ void router_forward_kernel(float* probs, int32_t* topk_idx, float* topk_weight, const float* logits,
                                      const float* bias, long N, int E, int K, ops::RouterSpec spec) {
  const long n = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (n >= N) return;
  if (spec.sigmoid) {
    route_sigmoid(probs + n * E, topk_idx + n * K, topk_weight + n * K, logits + n * E, bias, E, K, spec);
    return;
  }
  const bool renormalize = spec.renormalize;
  const float* l = logits + n * E;
  float* p = probs + n * E;
  float mx = l[0];
  for (int e = 1; e < E; e++) mx = fmaxf(mx, l[e]);
  double s = 0.0;
  for (int e = 0; e < E; e++) {
    const float pe = expf(l[e] - mx);
    p[e] = pe;
    s += pe;
  }
  const float inv = (float)(1.0 / s);
  for (int e = 0; e < E; e++) p[e] *= inv;
  // K passes of argmax over the unchosen experts; strict '>' keeps the lower index on ties, and a
  // NaN row still yields K distinct indices.
  int32_t* idx = topk_idx + n * K;
  float* w = topk_weight + n * K;
  float sum = 0.0f;
  for (int k = 0; k < K; k++) {
    int best = -1;
    for (int e = 0; e < E; e++) {
      bool taken = false;  // among the k already chosen (K is small)
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

// stats: assigned[E], prob_sum[E], tokens, z_sum (zeroed by the caller); block partials in shared
// memory, then one atomic per value and block.
__global__ void router_stats_kernel(double* stats, const float* logits, const float* probs, const int32_t* topk_idx,
                                    const uint8_t* token_mask, long N, int E, int K) {
  __shared__ double acc[2 * kMaxE + 2];
  for (int i = threadIdx.x; i < 2 * E + 2; i += blockDim.x) acc[i] = 0.0;
  __syncthreads();
  for (long n = blockIdx.x * (long)blockDim.x + threadIdx.x; n < N; n += (long)gridDim.x * blockDim.x) {
    if (!is_real(token_mask, n)) continue;
    atomicAdd(&acc[2 * E], 1.0);
    for (int e = 0; e < E; e++) atomicAdd(&acc[E + e], (double)probs[n * E + e]);
    for (int k = 0; k < K; k++) {
      const int e = topk_idx[n * K + k];
      if (e >= 0 && e < E) atomicAdd(&acc[e], 1.0);
    }
    const double lse = row_logsumexp(logits + n * E, E);
    atomicAdd(&acc[2 * E + 1], lse * lse);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < 2 * E + 2; i += blockDim.x) atomicAdd(stats + i, acc[i]);
}

__global__ void router_backward_kernel(float* dlogits, const float* dtopk_weight, ExpertDoubles daux, bool has_aux,
                                       const uint8_t* token_mask, const float* probs, const int32_t* topk_idx,
                                       const float* topk_weight, long N, int E, int K, ops::RouterSpec spec) {
  const long n = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (n >= N) return;
  const float* p = probs + n * E;
  double dp[kMaxE];
  for (int e = 0; e < E; e++) dp[e] = 0.0;
  const bool renormalize = spec.renormalize;
  if (spec.sigmoid) {  // ops::router_backward's sigmoid branch
    const int32_t* idx = topk_idx + n * K;
    if (dtopk_weight != nullptr) {
      const float* w = topk_weight + n * K;
      const float* dw = dtopk_weight + n * K;
      if (renormalize) {
        float S = 0.0f;
        double dot = 0.0;
        for (int k = 0; k < K; k++) {
          S += p[idx[k]];
          dot += (double)dw[k] * (double)w[k];
        }
        const double den = (double)(S + 1e-20f);
        for (int k = 0; k < K; k++) dp[idx[k]] += ((double)spec.scale * dw[k] - dot) / den;
      } else {
        for (int k = 0; k < K; k++) dp[idx[k]] += (double)spec.scale * dw[k];
      }
    }
    if (has_aux && is_real(token_mask, n))
      for (int e = 0; e < E; e++) dp[e] += daux.v[e];
    float* dl = dlogits + n * E;
    for (int e = 0; e < E; e++) dl[e] = (float)(dp[e] * (double)p[e] * (1.0 - (double)p[e]));
    return;
  }
  if (dtopk_weight != nullptr && !renormalize) {
    // w_k = p_k
    for (int k = 0; k < K; k++) dp[topk_idx[n * K + k]] += (double)dtopk_weight[n * K + k];
  } else if (dtopk_weight != nullptr) {
    // w_k = p_k / S over the chosen: dp_k = (dw_k - sum_j dw_j w_j) / S
    const int32_t* idx = topk_idx + n * K;
    const float* w = topk_weight + n * K;
    const float* dw = dtopk_weight + n * K;
    double S = 0.0, dot = 0.0;
    for (int k = 0; k < K; k++) {
      S += p[idx[k]];
      dot += (double)dw[k] * (double)w[k];
    }
    for (int k = 0; k < K; k++) dp[idx[k]] += ((double)dw[k] - dot) / S;
  }
  if (has_aux && is_real(token_mask, n))
    for (int e = 0; e < E; e++) dp[e] += daux.v[e];
  double pdp = 0.0;
  for (int e = 0; e < E; e++) pdp += (double)p[e] * dp[e];
  float* dl = dlogits + n * E;
  for (int e = 0; e < E; e++) dl[e] = (float)((double)p[e] * (dp[e] - pdp));
}

__global__ void router_z_backward_kernel(float* dlogits, const float* logits, const float* probs,
                                         const uint8_t* token_mask, long N, int E, double c) {
  const long n = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (n >= N || !is_real(token_mask, n)) return;
  const double g = c * row_logsumexp(logits + n * E, E);
  for (int e = 0; e < E; e++) dlogits[n * E + e] += (float)(g * (double)probs[n * E + e]);
}

// One thread per token: ops::router_sequence_backward's loop body.
__global__ void router_sequence_backward_kernel(float* dlogits, const float* row_grad, const uint8_t* token_mask,
                                                const float* probs, long N, int E, int row_len, bool sigmoid,
                                                float scale) {
  const long n = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (n >= N || !is_real(token_mask, n)) return;
  const float* p = probs + n * E;
  const float* g = row_grad + (n / row_len) * E;
  double S = 0.0;
  for (int e = 0; e < E; e++) S += p[e];
  const double inv = sigmoid ? 1.0 / S : 1.0;
  double dot = 0.0;
  for (int e = 0; e < E; e++) dot += (double)g[e] * ((double)p[e] * inv);
  for (int e = 0; e < E; e++) {
    const double d = sigmoid ? ((double)g[e] - dot) / S * (double)p[e] * (1.0 - (double)p[e])
                             : (double)p[e] * ((double)g[e] - dot);
    dlogits[n * E + e] += (float)((double)scale * d);
  }
}

void check_dims(const char* op, long N, int E, int K) {
  MOETRON_OP_CHECK(N >= 0, op, "token count N must be >= 0, got {}", N);
  MOETRON_OP_CHECK(E >= 1 && E <= kMaxE, op, "expert count E must be in [1, {}], got {}", kMaxE, E);
  MOETRON_OP_CHECK(K >= 1 && K <= E, op, "experts per token K must be in [1, E={}], got {}", E, K);
}

}  // namespace

void router_forward(Context& ctx, float* probs, int32_t* topk_idx, float* topk_weight, const float* logits,
                    const float* bias, long N, int E, int K, const ops::RouterSpec& spec) {
  check_dims("router_forward", N, E, K);
  ops::check_router_spec("router_forward", spec, E, K);
  MOETRON_OP_CHECK(spec.n_group <= 64, "router_forward", "n_group {} exceeds the device router's 64", spec.n_group);
  if (N == 0) return;
  router_forward_kernel<<<blocks_for(N, 128), 128, 0, stream_of(ctx)>>>(probs, topk_idx, topk_weight, logits, bias, N,
                                                                        E, K, spec);
  CUDA_LAUNCHED("router_forward");
}

void router_layer_stats(Context& ctx, double* stats, const float* logits, const float* probs,
                        const int32_t* topk_idx, const uint8_t* token_mask, long N, int E, int K) {
  check_dims("router_layer_stats", N, E, K);
  fill_zero(ctx, stats, sizeof(double) * (2 * E + 2));
  if (N == 0) return;
  const unsigned blocks = blocks_for(N, 256) < 512u ? blocks_for(N, 256) : 512u;
  router_stats_kernel<<<blocks, 256, 0, stream_of(ctx)>>>(stats, logits, probs, topk_idx, token_mask, N, E, K);
  CUDA_LAUNCHED("router_layer_stats");
}

void router_backward(Context& ctx, float* dlogits, const float* dtopk_weight, const double* dprobs_per_expert,
                     const uint8_t* token_mask, const float* probs, const int32_t* topk_idx,
                     const float* topk_weight, long N, int E, int K, const ops::RouterSpec& spec) {
  check_dims("router_backward", N, E, K);
  ops::check_router_spec("router_backward", spec, E, K);
  if (N == 0) return;
  ExpertDoubles daux{};
  if (dprobs_per_expert)
    for (int e = 0; e < E; e++) daux.v[e] = dprobs_per_expert[e];
  router_backward_kernel<<<blocks_for(N, 128), 128, 0, stream_of(ctx)>>>(
      dlogits, dtopk_weight, daux, dprobs_per_expert != nullptr, token_mask, probs, topk_idx, topk_weight, N, E, K, spec);
  CUDA_LAUNCHED("router_backward");
}

void router_z_loss_backward(Context& ctx, float* dlogits, const float* logits, const float* probs,
                            const uint8_t* token_mask, long N, int E, float scale, long real_tokens) {
  MOETRON_OP_CHECK(N >= 0 && E >= 1, "router_z_loss_backward", "need N >= 0 and E >= 1, got N={} E={}", N, E);
  if (N == 0 || real_tokens <= 0) return;
  const double c = 2.0 * (double)scale / (double)real_tokens;
  router_z_backward_kernel<<<blocks_for(N, 128), 128, 0, stream_of(ctx)>>>(dlogits, logits, probs, token_mask, N, E,
                                                                           c);
  CUDA_LAUNCHED("router_z_loss_backward");
}

}  // namespace moetron::gpu

namespace moetron::gpu {

void router_sequence_backward(Context& ctx, float* dlogits, const float* row_grad, const uint8_t* token_mask,
                              const float* probs, long N, int E, int row_len, bool sigmoid, float scale) {
  MOETRON_OP_CHECK(N >= 0 && E >= 1 && row_len > 0 && N % row_len == 0, "router_sequence_backward",
                   "bad dimensions N={} E={} row_len={}", N, E, row_len);
  if (N == 0) return;
  router_sequence_backward_kernel<<<blocks_for(N, 128), 128, 0, stream_of(ctx)>>>(dlogits, row_grad, token_mask, probs,
                                                                                   N, E, row_len, sigmoid, scale);
  CUDA_LAUNCHED("router_sequence_backward");
}

}  // namespace moetron::gpu
