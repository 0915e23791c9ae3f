// Small-batch kernels for decoding, where one token's activations meet each weight matrix once and
// the time goes into streaming the weights: matrix-vector products (HF nn.Linear layout, weight
// [OC, IC]) and dot products, register-blocked, OpenMP over output rows when the matrix is large.
// Weights come as fp32 or as bf16 (exactly the values of a bf16 checkpoint): bf16 widens to fp32
// exactly and the arithmetic is the same, so both give bitwise the same results, bf16 from half the bytes.
#pragma once

#include <cstdint>

namespace moetron::infer {

// y[OC] = W[OC,IC] x[IC]   (accumulate: y += ...)
void gemv(float* y, const float* W, const float* x, int OC, int IC, bool accumulate = false);
void gemv_bf16(float* y, const uint16_t* W, const float* x, int OC, int IC, bool accumulate = false);

// Several products with the same input width in one parallel region (fewer fork/join points per
// token): y_t[OC_t] (=, or += when accumulate) W_t[OC_t, IC] x_t[IC] for each task t.
struct GemvTask {
  float* y;
  const float* W;     // fp32 weights, or
  const uint16_t* Wh;  // bf16 weights (used when not null)
  const float* x;
  int OC;
  bool accumulate = false;
};
// Multiply-adds from which a gemv_batch is split across the OpenMP threads.  The default, 16M (64 MiB of
// fp32 weights, milliseconds of one core), gains even when other processes share the cores, where a
// fork/join can cost a scheduler time slice (on the 2-core shared VM, splitting a 32000 x 256 head
// with one core busy made decoding 2x slower).  On idle cores much smaller products gain (the same
// head split over 2 threads: 1.4x faster decoding); DecodeSplitTuner (decoder.h) measures which case
// holds and lowers the threshold to kGemvSplitMin when splitting pays.
constexpr long kGemvParallelMin = 1L << 24;
constexpr long kGemvSplitMin = 1L << 21;
// The result is bitwise the same whatever the threshold and thread count (rows are independent).
void gemv_batch(const GemvTask* tasks, int n_tasks, int IC, long parallel_min_macs = kGemvParallelMin);

// Three products of one input in one parallel region: ya = Wa x, yb = Wb x, yc = Wc x.
void gemv3(float* ya, const float* Wa, int OCa, float* yb, const float* Wb, int OCb, float* yc, const float* Wc,
           int OCc, const float* x, int IC);

// sum_i a[i] b[i]
float dot(const float* a, const float* b, int n);

// y[n] += alpha * x[n]
void axpy(float* y, float alpha, const float* x, int n);

}  // namespace moetron::infer
