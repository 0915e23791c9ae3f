// Inference kernels over weights used in place: matrix-vector products for decoding (one token's
// activations meet each weight matrix once, and the time goes into streaming the weights) and
// products of a few rows of activations for prefill, HF nn.Linear layout (weight [OC, IC]).
//
// Weights are fp32, bf16 or f16 wherever they lie -- a mapped safetensors file, an owned buffer -- and
// are widened to fp32 in registers: the arithmetic is fp32 FMA on exactly the stored values, so a
// bf16 matrix and its fp32 widening give bitwise the same results (bf16 and f16 widen exactly).
// Q8_0 weights (made at load time, quantize_q8_0) meet inputs quantized the same way, per block of
// 32 (as llama.cpp's q8_0 x q8_0 product): exact int8 dot products per block, scaled and summed in
// fp32 -- the same operations at every SIMD level, so Q8_0 results are bitwise equal across levels.
// Products of more than kMaxGemvInputs rows (matmul: prefill) widen Q8_0 blocks to fp32 instead
// and leave the inputs unquantized.
// The SIMD path is chosen at run time from the CPU's features (simd_level()): AVX-512, AVX2+FMA, or
// portable code; each output row is computed by one thread in a fixed order, so results do not depend
// on the thread count (they may differ in the last bits between SIMD levels, whose sums are ordered
// differently).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "backend/kernels/simd.h"
#include "backend/weights.h"

namespace moetron::kernels {

// Several products with the same input width in one parallel region (fewer fork/join points per
// token): y_t[OC_t] (=, or += when accumulate) W_t[OC_t, IC] x_t[IC] for each task t -- or, with
// n > 1 (at most kMaxGemvInputs), the same for inputs x_t + j * ld_x into y_t + j * ld_y, j < n, W_t
// read once (as gemv_rows).
struct GemvTask {
  float* y;
  WeightRef W;
  const float* x;
  int OC;
  bool accumulate = false;
  int n = 1, ld_x = 0, ld_y = 0;
};
// Multiply-adds from which a gemv_batch is split across the OpenMP threads.  The default, 16M (64 MiB of
// fp32 weights, milliseconds of one core), gains even when other processes share the cores, where a
// fork/join can cost a scheduler time slice (on the 2-core shared VM, splitting a 32000 x 256 head
// with one core busy made decoding 2x slower).  On idle cores much smaller products gain (the same
// head split over 2 threads: 1.4x faster decoding); DecodeSplitTuner (backend/cpu_infer.h) measures which case
// holds and lowers the threshold to kGemvSplitMin when splitting pays.  kGemvSplitMin, 1M, splits a
// 1024 x 1024 o_proj (2 MiB of bf16: one thread streamed it at ~16 GB/s): one sequence's decoding,
// 0.49B bf16 model, 2 threads, idle 2-core Xeon VM, 4 alternating runs: 78-83 -> 83-85 tokens/s at
// 1M against 2M (q8_0: 119-126 -> 123-133); the small model (hidden 256) the same either way.  256K
// also splits the small model's experts (a layer's gate/up tasks of one token: 512K): its decoding, 2
// threads, 2-core Zen 4 EPYC VM, 6 alternating runs, 1185-1268 -> 1287-1409 tokens/s (median 1249 ->
// 1351); the 0.49B model the same (97.1 and 98.2).
constexpr long kGemvParallelMin = 1L << 24;
constexpr long kGemvSplitMin = 1L << 18;
constexpr int kMaxGemvTasks = 32;
constexpr int kMaxGemvInputs = 8;
// The result is bitwise the same whatever the threshold and thread count (rows are independent).
void gemv_batch(const GemvTask* tasks, int n_tasks, int IC, long parallel_min_macs = kGemvParallelMin);
// y[OC] (=, or +=) W[OC, IC] x[IC]
void gemv(float* y, WeightRef W, const float* x, int OC, int IC, bool accumulate = false);
// The same on one thread with the kernels of `level` (at most simd_level()), for tests and benchmarks.
void gemv_at(SimdLevel level, float* y, WeightRef W, const float* x, int OC, int IC);

// out_j[OC] (=, or +=) W x_j for n <= kMaxGemvInputs (8) inputs x_j = x + j * ld_x, out_j = out + j * ld_out:
// W is read once for all of them (a batch of decoding sequences, an expert's few prefill rows), and
// each out_j is bitwise what gemv gives for x_j alone.
void gemv_rows(float* out, int ld_out, const float* x, int ld_x, WeightRef W, int n, int IC, int OC, bool accumulate,
               long parallel_min_macs = kGemvParallelMin);

// out[n, OC] (row stride ld_out; =, or += when accumulate) = x[n, IC] (row stride ld_x) W[OC, IC]^T.
// Up to kMaxGemvInputs rows run as gemv_rows; more as a GEMM (gemm.h: W's rows widened to fp32 a
// few at a time per thread in `scratch`, so a bf16 matrix is never copied).  For a given n, a bf16 matrix and its fp32
// widening give bitwise the same result.  OpenMP threads follow the caller's omp_get_max_threads().
void matmul(float* out, int ld_out, const float* x, int ld_x, WeightRef W, int n, int IC, int OC, bool accumulate,
            std::vector<float>& scratch);

// out[n] = W[row, 0..n) as fp32 (an embedding row).
void widen_row(float* out, WeightRef W, size_t row, int n);
// out[rows * n] = rows [row, row + rows) of W (each n values, stored contiguously) as fp32: one call for
// a GEMM's few rows (a WeightRef passed by value per row cost a stalled copy each).
void widen_rows(float* out, const WeightRef& W, size_t row, int rows, int n);

}  // namespace moetron::kernels
