// The CUDA backend's kernels (DESIGN §5): the op families of src/ops/*.h with the same names, the
// same argument order (outputs, saved activations, inputs, weights, dimensions) and the same maths,
// with a Context first.  The model reaches them only through CudaBackend (cuda/backend.h), which
// implements the Backend interface (backend/backend.h) with them; tests/test_cuda_ops.cpp checks
// each against the CPU op.  Every pointer is DEVICE memory unless it says host.
//
// Precision: activations are stored in bf16 (Bf16*) where they feed tensor-core GEMMs; every op
// computes in fp32; the residual stream, normalisation statistics, router tensors, logits and all
// parameter gradients are fp32; parameters are read from fp32 masters except the bf16 GEMM
// operands.  Which buffer has which type is in each signature.
// Gradients: parameter gradients accumulate (+=); activation gradients assign (=) unless the
// signature says `accumulate`.  Deterministic except where noted (atomics in embedding_backward,
// rmsnorm_backward's dweight, attention_backward's dq and the router statistics: fp32/fp64
// summation order may vary between runs).
// Failures (a bad dimension, a CUDA or cuBLAS error) throw Error naming the op and the call.
//   Dimension letters as in src/ops: N tokens (rows), C hidden, V vocab, I FFN width, E experts,
//   K experts per token, M = N*K routed rows, B batch, T sequence, NH / NKV heads, HD head dim.
#pragma once

#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "cuda/runtime.h"
#include "ops/copy_block.h"
#include "ops/rope.h"
#include "ops/router.h"

namespace moetron::gpu {

// ---- conversions --------------------------------------------------------------------------
void convert_to_bf16(Context& ctx, Bf16* out, const float* in, size_t n);
void convert_to_f32(Context& ctx, float* out, const Bf16* in, size_t n);

// ---- GEMM (cuBLASLt, fp32 accumulation) -----------------------------------------------------
// Row-major C[M,N] = alpha * op(A)[M,K] @ op(B)[K,N] + beta * C, as ops::sgemm.  A and B are both
// `ab` (BF16 or F32), C is `c` (BF16 or F32); lda/ldb/ldc are row strides in elements.  BF16
// operands run on tensor cores with fp32 accumulation; F32 operands compute in true fp32 (no TF32).
void gemm(Context& ctx, bool trans_a, bool trans_b, int M, int N, int K, float alpha, const void* A, long lda,
          const void* B, long ldb, float beta, void* C, long ldc, DType ab, DType c);

// HF nn.Linear convention (weight [OC,IC]), bf16 operands:
// out[N,OC] = inp[N,IC] @ weight^T                      (bf16 out)
void matmul_forward(Context& ctx, Bf16* out, const Bf16* inp, const Bf16* weight, int N, int IC, int OC);
// out[N,OC] (= or += when accumulate) inp @ weight^T    (fp32 out, e.g. onto the residual stream)
void matmul_forward_f32(Context& ctx, float* out, const Bf16* inp, const Bf16* weight, int N, int IC, int OC,
                        bool accumulate);
// dinp[N,IC] = dout[N,OC] @ weight (bf16, assign; skipped when null);
// dweight[OC,IC] += dout^T @ inp (fp32, accumulate; skipped when null)
void matmul_backward(Context& ctx, Bf16* dinp, float* dweight, const Bf16* dout, const Bf16* inp,
                     const Bf16* weight, int N, int IC, int OC);

// ---- embedding (this table's vocabulary rows [V0, V0 + Vr); V0 = 0, Vr = V for the whole) -----
// out[N,C] = wte[tokens[n] - V0] (fp32 from the fp32 master); a token outside the rows writes
// zeros (the tensor-parallel all-reduce then completes the lookup).
void embedding_forward(Context& ctx, float* out, const int32_t* tokens, const float* wte, long N, int C, int64_t V0,
                       int64_t Vr);
// dwte[Vr,C] += scatter of dout[N,C] for the tokens of these rows (fp32 atomics).
void embedding_backward(Context& ctx, float* dwte, const float* dout, const int32_t* tokens, long N, int C,
                        int64_t V0, int64_t Vr);

// ---- RMSNorm --------------------------------------------------------------------------------
// out[N,C] (out_dtype BF16 or F32) = weight * x * rstd; rstd[N] saved (skipped when null).
// inp fp32, weight fp32.
void rmsnorm_forward(Context& ctx, void* out, DType out_dtype, float* rstd, const float* inp, const float* weight,
                     long N, int C, float eps);
// dinp[N,C] (fp32; = or += when accumulate, for the residual stream); dweight[C] += (fp32).
void rmsnorm_backward(Context& ctx, float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, long N, int C, bool accumulate);
// The norm over rows split across ranks, as ops/rmsnorm.h's row_dot / rmsnorm_*_stats (fp32; out of
// the forward bf16 or fp32).
void row_dot(Context& ctx, float* out, const float* a, const float* b, const float* w, long N, int C);
void rmsnorm_forward_stats(Context& ctx, void* out, DType out_dtype, float* rstd, const float* inp, const float* weight,
                           const float* ss, long N, int C, int width, float ss_scale, float eps);
void rmsnorm_backward_stats(Context& ctx, float* dinp, float* dweight, const float* dout, const float* inp,
                            const float* weight, const float* rstd, const float* dot, long N, int C, int width,
                            float dot_scale);

// ---- RoPE (HF rotate-half; the angle in fp32 exactly as ops::rope) ---------------------------
// Rows are `stride` elements apart (0: H*HD), so q and k can live inside one fused qkv buffer.
// out may alias inp.  spec: which dims of each head rotate, the pair layout, YaRN (ops/rope.h).
void rope_forward(Context& ctx, Bf16* out, const Bf16* inp, long stride, const int32_t* pos, long N, int H, int HD,
                  const ops::RopeSpec& spec);
void rope_backward(Context& ctx, Bf16* dinp, const Bf16* dout, long stride, const int32_t* pos, long N, int H,
                   int HD, const ops::RopeSpec& spec);
inline void rope_forward(Context& ctx, Bf16* out, const Bf16* inp, long stride, const int32_t* pos, long N, int H,
                         int HD, float theta) {
  rope_forward(ctx, out, inp, stride, pos, N, H, HD, ops::RopeSpec{theta});
}
inline void rope_backward(Context& ctx, Bf16* dinp, const Bf16* dout, long stride, const int32_t* pos, long N, int H,
                          int HD, float theta) {
  rope_backward(ctx, dinp, dout, stride, pos, N, H, HD, ops::RopeSpec{theta});
}

// ---- attention (flash-attention style: tiled online softmax, T x T never stored) -------------
struct AttentionMask {
  const int32_t* attention_mask = nullptr;  // device [B,T] or null (1 = real token)
  const int32_t* segment_ids = nullptr;     // device [B,T] or null
  int sliding_window = 0;                   // 0: none
};
// q[B,T,NH,HD] with row stride q_stride, k/v[B,T,NKV,HD] with row stride kv_stride (0: packed);
// out[B,T,NH,HD] packed (bf16); lse[B,NH,T] (fp32, saved: log2-domain logsumexp of the scaled
// scores, 0 for a query with no visible key, whose output is zeros).  HD <= 128.
// Visibility exactly as ops::attention.
void attention_forward(Context& ctx, Bf16* out, float* lse, const Bf16* q, const Bf16* k, const Bf16* v,
                       const AttentionMask& mask, int B, int T, int NH, int NKV, int HD, long q_stride,
                       long kv_stride);
// Floats of scratch attention_backward needs.
size_t attention_backward_scratch_floats(int B, int T, int NH, int HD);
// dq/dk/dv (bf16, assign) with the strides of q/k/v; recomputes the scores from q, k and lse.
void attention_backward(Context& ctx, Bf16* dq, Bf16* dk, Bf16* dv, float* scratch, const Bf16* dout,
                        const Bf16* out, const float* lse, const Bf16* q, const Bf16* k, const Bf16* v,
                        const AttentionMask& mask, int B, int T, int NH, int NKV, int HD, long q_stride,
                        long kv_stride);

// ---- attention over a KV cache (inference; ops/attention_kv.h) ------------------------------------
// out[n,NH,HD] (bf16) for the n query rows q[n,NH,HD] at positions pos0 .. pos0+n-1 over the cache's
// rows k/v[0 .. pos0+n-1, NKV, HD] (bf16); causal, sliding window (0: none).  HD <= 256.
void attention_kv_forward(Context& ctx, Bf16* out, const Bf16* q, const Bf16* k, const Bf16* v, int n, int pos0,
                          int sliding_window, int NH, int NKV, int HD);

// ---- SwiGLU ---------------------------------------------------------------------------------
// out[N,I] = silu(gate_up[:, :I]) * gate_up[:, I:]  (bf16)
// ---- the grouped linear (ops/grouped_matmul.h) ------------------------------------------------
// For experts e < E over rows [offsets[e], offsets[e+1]) (offsets on the HOST): out (out_dtype BF16
// or F32; = or += when accumulate) = alpha * inp @ weight[e]^T, weight [E,OC,IC] bf16.
// ld_in / ld_out: row strides of inp (dinp) and out (dout); 0: IC / OC.
// Operands (inp, weight; dout) in `ab`: BF16 (tensor cores) or F32 (the router's f32 adapters).
void grouped_matmul_forward(Context& ctx, void* out, DType out_dtype, const void* inp, const void* weight, DType ab,
                            const std::vector<int64_t>& offsets, int E, int IC, int OC, float alpha, bool accumulate,
                            int ld_in, int ld_out);
// dinp (dinp_dtype BF16 or F32; = or +=; skipped when null) = alpha * dout @ weight[e]; dweight[e]
// (fp32, +=; skipped when null) += alpha * dout^T @ inp.
void grouped_matmul_backward(Context& ctx, void* dinp, DType dinp_dtype, float* dweight, const void* dout,
                             const void* inp, const void* weight, DType ab, const std::vector<int64_t>& offsets, int E,
                             int IC, int OC, float alpha, bool accumulate, int ld_in, int ld_out);

void swiglu_forward(Context& ctx, Bf16* out, const Bf16* gate_up, long N, int I);
// dgate_up[N,2I] (bf16, assign)
void swiglu_backward(Context& ctx, Bf16* dgate_up, const Bf16* dout, const Bf16* gate_up, long N, int I);

// ---- strided block copy (ops/copy_block.h); dst and src each bf16 (dst_bf16 / src_bf16) or f32 ----
void copy_block(Context& ctx, void* dst, bool dst_bf16, const void* src, bool src_bf16, const ops::BlockCopy& g,
                float alpha, bool accumulate);

// ---- router (ops/router.h: softmax over all E in fp32, top-K, renormalised unless !renormalize; or
// DeepSeek's sigmoid rule with the selection bias [E] (device, or null); E <= 512) ----
void router_forward(Context& ctx, float* probs, int32_t* topk_idx, float* topk_weight, const float* logits,
                    const float* bias, long N, int E, int K, const ops::RouterSpec& spec);
// stats[2E+2] (fp64, assign): assigned[E], prob_sum[E], tokens, z_sum over real tokens, as
// ops::router_layer_stats.  token_mask: device uint8 [N] or null.
void router_layer_stats(Context& ctx, double* stats, const float* logits, const float* probs,
                        const int32_t* topk_idx, const uint8_t* token_mask, long N, int E, int K);
// dlogits[N,E] (assign), as ops::router_backward.  dprobs_per_expert is a HOST array [E] (or null).
void router_backward(Context& ctx, float* dlogits, const float* dtopk_weight, const double* dprobs_per_expert,
                     const uint8_t* token_mask, const float* probs, const int32_t* topk_idx,
                     const float* topk_weight, long N, int E, int K, const ops::RouterSpec& spec);
// dlogits += scale * the sequence-wise balance loss's gradient (accumulate), as
// ops::router_sequence_backward; row_grad [B,E] device f32.
void router_sequence_backward(Context& ctx, float* dlogits, const float* row_grad, const uint8_t* token_mask,
                              const float* probs, long N, int E, int row_len, bool sigmoid, float scale);
// dlogits += scale * d z / d logits (accumulate), as ops::router_z_loss_backward; real_tokens is
// the number of tokens with token_mask != 0 (all N without a mask).
void router_z_loss_backward(Context& ctx, float* dlogits, const float* logits, const float* probs,
                            const uint8_t* token_mask, long N, int E, float scale, long real_tokens);

// ---- MoE dispatch ---------------------------------------------------------------------------
// The permutation of ops::MoePlan (expert-contiguous; within an expert by token, then slot) with
// its index arrays on the device and the expert offsets on the host.  overflow = 1: the last expert
// collects the assignments a capacity limit dropped and is never computed (as ops::MoePlan).
struct MoePlanDevice {
  long N = 0;
  int E = 0, K = 0;
  int overflow = 0;
  std::vector<int64_t> expert_offsets;  // HOST [E+1]
  const int32_t* row_token = nullptr;   // device [M]
  const int32_t* row_of = nullptr;      // device [N*K]
};
// Builds the plan from topk_idx[N,K]; row_token/row_of are caller memory (M ints each), scratch
// is E+1 int64 of device memory.  Synchronises (the offsets come to the host).
void moe_plan_build(Context& ctx, MoePlanDevice& plan, int32_t* row_token, int32_t* row_of, int64_t* scratch,
                    const int32_t* topk_idx, long N, int E, int K);
// xperm[M,C] = x[row_token[m]]  (bf16)
void moe_permute_forward(Context& ctx, Bf16* xperm, const Bf16* x, const MoePlanDevice& plan, int C);
// dx[N,C] (fp32; = or += when accumulate) = sum_k dxperm[row_of[n,k]]
void moe_permute_backward(Context& ctx, float* dx, const Bf16* dxperm, const MoePlanDevice& plan, int C,
                          bool accumulate);
// out[N,C] (fp32, assign) = sum_k topk_weight[n,k] * yperm[row_of[n,k]]
void moe_combine_forward(Context& ctx, float* out, const Bf16* yperm, const float* topk_weight,
                         const MoePlanDevice& plan, int C);
// dyperm[M,C] = topk_weight * dout[token] (bf16);  dtopk_weight[N,K] = <dout[n], yperm[row]> (fp32)
void moe_combine_backward(Context& ctx, Bf16* dyperm, float* dtopk_weight, const float* dout, const Bf16* yperm,
                          const float* topk_weight, const MoePlanDevice& plan, int C);
// Grouped expert FFN, one cuBLASLt GEMM per expert over its contiguous rows (empty experts and the
// overflow expert skipped): h13[M,2I] = xperm @ w13[e]^T, act[M,I] = swiglu(h13) (bf16),
// y[M,C] = act @ w2[e]^T (y_dtype BF16 or F32).
void moe_experts_forward(Context& ctx, void* y, DType y_dtype, Bf16* h13, Bf16* act, const Bf16* xperm,
                         const Bf16* w13, const Bf16* w2, const MoePlanDevice& plan, int C, int I);
// dxperm[M,C] (dx_dtype BF16 or F32, assign; may alias dy when BF16); dw13[E,2I,C], dw2[E,C,I]
// (fp32, accumulate); scratch: 3*M*I bf16.
void moe_experts_backward(Context& ctx, void* dxperm, DType dx_dtype, float* dw13, float* dw2, Bf16* scratch,
                          const Bf16* dy, const Bf16* h13, const Bf16* act, const Bf16* xperm, const Bf16* w13,
                          const Bf16* w2, const MoePlanDevice& plan, int C, int I);

// ---- cross-entropy (one block per row, the vocabulary swept in chunks with an online logsumexp)
// lse[N] and row_loss[N] (fp32, -log p[target], 0 for ignored rows) from logits[N,V] (fp32);
// returns scale * sum of row_loss in row order (fp64, on the host: synchronises).  Targets must be
// IGNORE_INDEX or in [0, V) (the model validates labels on the host).
double cross_entropy_forward(Context& ctx, float* lse, float* row_loss, const float* logits,
                             const int32_t* targets, long N, int V, float scale);
// dlogits[N,V] (bf16, row stride ld elements) = scale * (softmax - onehot), 0 for ignored rows,
// over the vocabulary columns [V0, V0 + V) these logits hold (the one-hot of a target outside them
// is 0; lse is the whole vocabulary's).  In place is allowed: dlogits == (Bf16*)logits with
// ld = 2V (each bf16 row inside its fp32 row).
void cross_entropy_backward(Context& ctx, Bf16* dlogits, long ld, const float* logits, const float* lse,
                            const int32_t* targets, long N, int V, int64_t V0, float scale);
// The vocabulary-parallel forward (as dist::cross_entropy_forward_vocab_parallel), in three steps
// around the caller's all-reduces over the tensor-parallel group:
//   row_max[N] = max over these columns;                                   (all-reduce: max)
//   sums[2N] (fp64) = sum exp(x - row_max) [0, N) and the target's logit when it is one of these
//   columns, else 0 [N, 2N);                                               (all-reduce: sum)
//   lse[N] = row_max + log(sums), row_loss[N] = lse - target logit (0 for ignored rows); returns
//   scale * sum of row_loss in row order (host, synchronises).
void cross_entropy_row_max(Context& ctx, float* row_max, const float* logits, long N, int V);
void cross_entropy_row_sums(Context& ctx, double* sums, const float* logits, const float* row_max,
                            const int32_t* targets, long N, int V, int64_t V0);
double cross_entropy_finish(Context& ctx, float* lse, float* row_loss, const float* row_max, const double* sums,
                            const int32_t* targets, long N, float scale);

// ---- element-wise and data movement -----------------------------------------------------------
// y[n] += x[n] (fp32)
void add_f32(Context& ctx, float* y, const float* x, size_t n);
// x[N,E] += bias[E] (fp32)
void add_bias_rows(Context& ctx, float* x, const float* bias, long N, int E);
// dbias[C] += column sums of dout[N,C] (fp32; each column in row order, as ops::bias_backward)
void bias_backward(Context& ctx, float* dbias, const float* dout, long N, int C);
// s = sigmoid(x); dx = ds s (1 - s)  (fp32, n values, as ops/sigmoid.h)
void sigmoid_forward(Context& ctx, float* s, const float* x, long n);
void sigmoid_backward(Context& ctx, float* dx, const float* ds, const float* s, long n);
// x clamped to [-c, c] in place (bf16 or fp32), mask[i] = 1 where it was inside; dx zeroed where
// mask is 0 (as ops/clamp.h)
void clamp_forward(Context& ctx, void* x, DType dtype, uint8_t* mask, float c, long n);
void clamp_backward(Context& ctx, void* dx, DType dtype, const uint8_t* mask, long n);
// out[m] = in[index[m]] for rows of row_bytes bytes (m < rows)
void gather_rows(Context& ctx, void* out, const void* in, const int32_t* index, long rows, size_t row_bytes);
// partial[s] = sum of values[i]^2 over segment s = [begin[s], end[s]) (fp64, fixed reduction order).
void sum_squares_segments(Context& ctx, double* partial, const float* values, const int64_t* begin,
                          const int64_t* end, size_t segments);

// ---- optimizer ------------------------------------------------------------------------------
// AdamW exactly as moetron::adamw_update (torch semantics) on fp32 master weights, also writing
// the bf16 copy the GEMMs read (param_bf16, skipped when null).
void adamw_update(Context& ctx, float* param, Bf16* param_bf16, float* m, float* v, const float* grad, size_t n,
                  float grad_scale, double lr, double beta1, double beta2, double eps, double weight_decay,
                  long step);
// fp64 scratch elements global_grad_norm needs for n gradients.
size_t grad_norm_scratch_doubles(size_t n);
// L2 norm of grad[n] (fixed chunks reduced in order: deterministic); synchronises.
double global_grad_norm(Context& ctx, double* scratch, const float* grad, size_t n);
// p[i] = std * normal_at(seed, key, i) (the counter RNG of core/rng.h, evaluated on the device in
// fp64), or `fill` for every element when std == 0.
void init_normal(Context& ctx, float* p, size_t n, uint64_t seed, uint64_t key, double std, float fill);

}  // namespace moetron::gpu
