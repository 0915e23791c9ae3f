// Q8_0 weights: llama.cpp's 8-bit layout, made at load (quantize_q8_0) and read by the matrix-vector
// products (gemv.h, q8_impl.h) and, widened, by the prefill GEMM (gemm.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include "backend/weights.h"
#include "core/dtype.h"

namespace moetron::kernels {

// Q8_0, llama.cpp's 8-bit layout with the scales apart: blocks of kQ8Block consecutive values of a row
// w[i] ~ d * q[i], d = max|w| / 127 (stored f16), q = round(w / d) in [-127, 127].  Rows must hold
// whole blocks.
constexpr int kQ8Block = kQ8_0Block;  // core/dtype.h: the rule

// Quantizes `rows` rows of IC values (IC a multiple of kQ8Block) of W (F32, BF16 or F16) to Q8_0:
// q[rows * IC], d[rows * IC / kQ8Block].  Rows in parallel; the result does not depend on threads.
// False when a block's scale is beyond f16 (|w| > 65504 * 127: not representable in Q8_0).
bool quantize_q8_0(WeightRef W, size_t rows, int IC, int8_t* q, uint16_t* d);

}  // namespace moetron::kernels
